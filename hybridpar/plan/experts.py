"""A mixture-of-experts model (Llama 4: models.moe) in the planner: its dense skeleton, priced as any
dense model, plus the routed experts' terms on top (ExpertTerms), which search.estimate adds.

The skeleton is the model without its routed experts and routers: every layer a dense block whose
feed-forward has the layers' mean hidden size (an MoE layer's shared expert, a dense layer's
intermediate_size_mlp). What adds up over the layers (parameters, FLOPs, activations, FSDP's bytes)
is then exact; what one block holds at a time (a gathered block, its gradient buffers) uses the mean.

The routed experts, per MoE layer and rank: n_experts / ep of them (parallel.ep; models.moe), each
expert's hidden size split over mp; FSDP shards them over the dp_shard / ep ranks holding the same
experts (parallel.fsdp.expert_mesh_for), the rest over every dp_shard rank. Routing is taken as
balanced: each rank's experts receive as many token slots as it sends, tokens x experts_per_token
(a hot expert's rank gets more; the trainer's metrics show the real split). Expert parallelism's
all-to-alls (parallel.experts: dispatch and combine, forward and backward, again for a recomputed
block) carry tokens x top-k x dim in the compute dtype, of which (ep - 1) / ep leaves the rank; they
wait for their result, so compute hides none of them. The FLOPs the trainer's MFU counts are
6 x the active parameters per token (ModelArgs.flops_per_token) plus the attention's.

Under pipeline parallelism a rank holds its stages' MoE layers only (`layers`: search.estimate passes
those of the rank holding most of them). float8 (parallel.float8) converts the skeleton's linears only:
the experts' grouped matmuls, the router and the all-to-alls stay in the compute dtype. train.compile
compiles the blocks around MoE.routed, which stays eager: the experts' SwiGLU is priced unfused.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

from hybridpar.models.args import ModelArgs

from ..config.dtypes import dtype_bytes
from .compute import Work, elementwise_bytes, linear_work
from .inputs import Layout, Workload
from .layouts import divisors
from .memory import sharded_numel

# Copies of the routed token slots a MoE layer makes, each reading and writing tokens x top-k x dim:
# the slots in expert order, scaled by their weights, regrouped by expert after the dispatch, put back
# before the combine and into slot order after it, and the top-k outputs summed.
SLOT_COPIES = 6


def dense_skeleton(args: ModelArgs) -> ModelArgs:
    """The model without its routed experts and routers (a dense model's own args unchanged): every
    layer's feed-forward of the layers' mean hidden size."""
    if not args.n_experts:
        return args
    sizes = [args.expert_hidden_dim if args.is_moe_layer(i) else args.ffn_hidden_dim for i in range(args.n_layers)]
    return dataclasses.replace(args, n_experts=0, experts_per_token=1, moe_layers=None, expert_hidden_size=None,
                               ffn_hidden_size=sum(sizes) // args.n_layers)


def moe_layers(args: ModelArgs) -> list[int]:
    return [i for i in range(args.n_layers) if args.is_moe_layer(i)]


def check_experts(args: ModelArgs, ep: int, flag: bool = False) -> None:
    """ValueError, in one line, for an ep the model's experts do not allow (`flag`: said as `--ep N`, the
    plan command's, else as a layout's `ep = N`)."""
    said = f"--ep {ep}" if flag else f"ep = {ep}"
    if ep > 1 and not args.n_experts:
        raise ValueError(f"{said}: a dense model has no experts to split (n_experts = 0); drop --ep")
    if args.n_experts and args.n_experts % ep:
        raise ValueError(f"{said} does not divide the model's {args.n_experts} experts (n_experts): choose an --ep "
                         f"dividing {args.n_experts} ({', '.join(map(str, divisors(args.n_experts)))})")


@dataclasses.dataclass(frozen=True)
class ExpertTerms:
    """What the routed experts and the routers add to one rank of a layout (all 0 for a dense model):
    elements, bytes per micro-batch (`_mb`) or per step, and the work of one micro-batch."""

    experts_per_rank: int = 0  # of each MoE layer's experts (n_experts / ep)
    local: int = 0  # elements of every MoE layer's experts and router on this rank, unsharded (the mp, ep slice)
    sharded: int = 0  # this rank's FSDP shard of them
    expert_unit: int = 0  # one MoE layer's experts on this rank, unsharded: an FSDP unit of its own
    gathered: float = 0.0  # bytes of the experts FSDP keeps gathered at once (the current and prefetched layers')
    saved_mb: float = 0.0  # activations the MoE layers that are not checkpointed keep for backward
    transient_mb: float = 0.0  # on top in backward: a recomputed MoE layer's, and the experts' gradient temporaries
    work_mb: Work = Work()  # the experts' and routers' kernels, recomputation included
    gather_copies: Work = Work()  # FSDP's copies into and out of one pass of the experts' all-gathers
    all_to_all_mb: float = 0.0  # bytes this rank hands to the ep group's all-to-alls (as nccl-tests counts them)
    all_to_all_calls_mb: int = 0
    router_tp_mb: float = 0.0  # the routers' logits entering the tensor-parallel region (all-gather / all-reduce)
    gather_mb: float = 0.0  # FSDP's all-gathers of the experts (dp_shard / ep ranks)
    reduce: float = 0.0  # FSDP's reduce-scatter of their gradients, per step
    replica_reduce: float = 0.0  # their all-reduce over dp_replicate (hybrid sharding), per step
    expert_fsdp: int = 1  # ranks the experts are sharded over (dp_shard / ep)
    ep: int = 1

    @property
    def leaving_share(self) -> float:
        """The share of the all-to-all's bytes that leaves the rank: (ep - 1) / ep."""
        return (self.ep - 1) / self.ep


def expert_shapes(args: ModelArgs, mp: int, ep: int) -> list[tuple[int, ...]]:
    """One MoE layer's routed experts as one rank holds them: w1, w3 [E / ep, hidden / mp, dim] and w2."""
    e, h, d = args.n_experts // ep, args.expert_hidden_dim // mp, args.dim
    return [(e, h, d), (e, h, d), (e, d, h)]


def expert_terms(args: ModelArgs, layout: Layout, workload: Workload,
                 layers: Optional[Sequence[int]] = None) -> ExpertTerms:
    """The experts' and routers' share of `layout` for one micro-batch and step (ExpertTerms), over the
    MoE layers among `layers` (a pipeline rank's; None: the whole model's)."""
    if not args.n_experts:
        return ExpertTerms()
    mp, ep, ds = layout.mp, layout.ep, layout.fsdp_shard
    a, r = dtype_bytes(workload.param_dtype), dtype_bytes(workload.reduce_dtype)
    layers = moe_layers(args) if layers is None else [i for i in layers if args.is_moe_layer(i)]
    n = len(layers)
    if not n:  # a pipeline rank holding dense layers only
        return ExpertTerms(experts_per_rank=args.n_experts // ep, expert_fsdp=ds // ep, ep=ep)
    d, h, k, E = args.dim, args.expert_hidden_dim // mp, args.experts_per_token, args.n_experts
    shapes, router = expert_shapes(args, mp, ep), (E, d)
    es = ds // ep  # FSDP's ranks for the experts: those of the dp_shard ranks holding the same ones
    unit = sum(math.prod(s) for s in shapes)
    local = n * (unit + E * d)
    sharded = n * (sum(sharded_numel(s, es) for s in shapes) + sharded_numel(router, ds))
    # FSDP's padded buffers: the experts' over es ranks, the router's (in its block's unit) over ds.
    padded = sum(sharded_numel(s, es) * es for s in shapes) + (sharded_numel(router, ds) * ds if ds > 1 else 0)

    t = workload.micro_batch * workload.seq_len // layout.cp  # this rank's tokens
    slots = t * k  # token slots routed by this rank, and (balanced) received by its experts
    t_sp = t // mp if layout.sequence_parallel and mp > 1 else t  # the router reads the layer's input as it arrives
    # Saved for backward (models.moe, eager; tests/test_plan.py measures them): at dim, the slots in expert
    # order (the weights' multiply's input), the experts' input (the grouped matmuls') and their output
    # (index_copy's source back to slot order; under ep also the combined rows); at hidden / mp, the SwiGLU's
    # three inputs and w2's; the top-k indices (int64), their fp32 sigmoid and its weights in slot order,
    # the expert order (int64) and under ep the exchange's index (int64).
    exchanged = 1 if ep > 1 else 0
    per_layer = (3 + exchanged) * a * slots * d + 4 * a * slots * h + slots * (12 + a + 8 + 8 * exchanged)
    checkpointed = set(range(args.n_layers)) if layout.ac == "full" else \
        set(range(0, args.n_layers, layout.ac_every)) if layout.ac == "selective" else set()
    recomputed = len([i for i in layers if i in checkpointed])
    # Backward temporaries: the gradients of the experts' input and of their SwiGLU's inputs.
    transient = (per_layer if recomputed else 0.0) + a * slots * (d + 3 * h)

    expert_fwd, expert_bwd = linear_work([(d, h), (d, h), (h, d)], slots, a)
    router_fwd, router_bwd = linear_work([(d, E)], t_sp, a)
    # MoE.routed runs eager under train.compile too: its SwiGLU unfused.
    swiglu, copies = elementwise_bytes(a, False)["swiglu"], 2 * a * slots * d * SLOT_COPIES
    forward = expert_fwd + router_fwd + Work(memory_bytes=swiglu[0] * slots * h + copies)
    backward = expert_bwd + router_bwd + Work(memory_bytes=swiglu[1] * slots * h + copies)
    gathers = 2 * n if layout.reshard_after_forward else n
    # FSDP's copies into and out of the experts' all-gathers (as plan.compute.step_work's for the rest).
    fsdp_copies = Work(memory_bytes=gathers * 2 * unit * a if es > 1 else 0.0)
    work = n * (forward + backward) + recomputed * forward

    exchanges = 4 * n + 2 * recomputed  # dispatch and combine, forward and backward; a recomputed forward's again
    # Each forward's dispatch exchanges the tokens per expert first (E int64 counts; no backward).
    a2a = exchanges * slots * d * a + (n + recomputed) * E * 8
    router_tp = 2 * n * t * E * a if mp > 1 else 0.0
    gather = gathers * padded * a if ds > 1 else 0.0
    return ExpertTerms(
        experts_per_rank=E // ep, local=local, sharded=sharded, expert_unit=unit,
        gathered=(min(2, n) if layout.reshard_after_forward else n) * unit * a, saved_mb=(n - recomputed) * per_layer,
        transient_mb=transient, work_mb=work, gather_copies=fsdp_copies, all_to_all_mb=a2a if ep > 1 else 0.0,
        all_to_all_calls_mb=(exchanges + n + recomputed) if ep > 1 else 0, router_tp_mb=router_tp,
        gather_mb=gather, reduce=n * padded * r if ds > 1 else 0.0,
        replica_reduce=sharded * r if layout.dp_replicate > 1 else 0.0, expert_fsdp=es, ep=ep)
