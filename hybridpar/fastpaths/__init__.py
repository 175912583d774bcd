"""CPU fast paths on torch internals, behind one switch, `enabled()`: HYBRIDPAR_FAST_PATHS unset or
anything but "0" is on; "0" turns all of them off and torch's stock paths run, with the same results.
Each one: what it saves; the torch internals it touches; what runs when it is off.

gloo_collectives  FSDP's all-gather and reduce-scatter as gloo all-to-alls on pooled buffers: less CPU
    per collective, no page faults on fresh buffers. FSDP2's AllGather/ReduceScatter hooks, storage
    use counts. Off: FSDP2's own collectives (fsdp.gloo_all_to_all = false does the same). Sequence
    parallelism's all-gather and reduce-scatter on the CPU too (gloo's reduce-scatter is an
    all-reduce inside). Off: torch.distributed's.
dcp_reader  stored bytes read straight into the destination tensors, in threads: no buffer and copy
    per tensor. torch.save's zip reader, the data offset torch.load records on "meta", the storage
    table of DCP's FileSystemReader. Off: DCP's FileSystemReader.
dcp_writer  no zip CRC-32 per tensor (no reader checks them): less CPU per save. torch.save's settings.
    Off: DCP's FileSystemWriter.
optimizer_state  a fresh optimizer's state allocated from the checkpoint's metadata: no zero-gradient
    optimizer step before a load. The names torch's wrappers put into parameter names. Off: that step.
"""

from __future__ import annotations

import os

ENV = "HYBRIDPAR_FAST_PATHS"


def enabled() -> bool:
    """Whether the fast paths run; read at each call, so a process can change it between uses."""
    return os.environ.get(ENV, "1") != "0"
