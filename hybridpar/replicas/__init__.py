"""Replica groups that fail alone (fault_tolerance.enabled, through torchft): each group is its own
launcher world; the groups average their gradients every step over torchft's managed process group,
so a group that dies or hangs drops out of the step while the others commit it, and it rejoins healed
from a live group's state over the network, never from disk.

    replicas = make_replicas(config.fault_tolerance, grad_accum)    # LoneGroup when off
    loader = ... data_rank=replicas.data_rank(parallel) ...          # each group its own share
    replicas.connect(parallel, modules, optimizer, scheduler, loader, step=step)
    step = replicas.begin_step(step)     # the quorum; a joining group is healed here (QuorumStopped: a
                                         # stop signal while it waited)
    replicas.average(params)             # the groups' mean gradient
    if replicas.commit(): optimizer.step()    # else the step is done again, from the same data
"""

from .groups import LoneGroup, make_replicas
from .quorum import QuorumStopped

__all__ = ["LoneGroup", "QuorumStopped", "make_replicas"]
