"""The estimate of one layout, and the search: every layout of the GPUs, estimated and ranked."""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

from models.llama import ModelArgs

from ..dtypes import dtype_bytes
from ..parallel.fsdp import AC_MODES
from .comm import (StepTime, all_gather_seconds, all_reduce_seconds, collective_bytes,
                   flops_per_token, group_busbw)
from .inputs import MASTER_BYTES, Hardware, Layout, Workload
from .memory import Memory, ParamCounts, activation_bytes, param_counts


@dataclasses.dataclass(frozen=True)
class Estimate:
    layout: Layout
    grad_accum: int
    global_batch: int  # sequences per step
    memory: Memory
    time: StepTime
    tokens_per_step: int
    model_flops_per_step: float  # the trainer's MFU numerator (no recomputation)
    usable_bytes: float

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_bytes

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.time.step / self.layout.world

    def mfu(self, peak_flops: float) -> float:
        return self.model_flops_per_step / (self.time.step * peak_flops * self.layout.world)


def _block_params(args: ModelArgs) -> int:
    d, kv = args.dim, args.kv_heads * args.head_dim
    return 2 * d * d + 2 * d * kv + 3 * d * args.ffn_hidden_dim + 2 * d


def _grad_buffers(args: ModelArgs, counts: ParamCounts, a: int, r: int) -> float:
    """The unsharded gradients (compute dtype, and the reduce-dtype copy) alive at once in backward."""
    if not args.tie_embeddings:
        return max(counts.block, counts.output) * (a + r)  # one unit's; the head's is the first
    # Tied, the root unit holds the shared weight (apply_fsdp): its gradient, begun by the head's
    # backward, is reduced only after the embedding's, so it lives beside every block's.
    shared = counts.embedding + counts.root
    return max(shared * a + counts.block * (a + r), shared * (a + r))


def estimate(args: ModelArgs, layout: Layout, workload: Workload, hw: Hardware) -> Estimate:
    """Memory per rank and time per step of one layout. ValueError if the batch does not divide."""
    if layout.ac not in AC_MODES:
        raise ValueError(f"ac must be one of {AC_MODES}, got {layout.ac!r}")
    mp, ds, dr = layout.mp, layout.dp_shard, layout.dp_replicate
    a, r = dtype_bytes(workload.param_dtype), dtype_bytes(workload.reduce_dtype)
    grad_accum = workload.grad_accum(layout.dp)
    global_batch = layout.dp * workload.micro_batch * grad_accum
    b, s, L = workload.micro_batch, workload.seq_len, args.n_layers

    counts = param_counts(args, mp, ds)
    n_ac = layout.checkpointed_blocks(L)
    acts = activation_bytes(args, mp, b, s, a, n_ac, layout.sequence_parallel)

    kept_blocks = L if not layout.reshard_after_forward else min(2, L)  # current + prefetched
    gathered = (counts.embedding + counts.output + counts.root + kept_blocks * counts.block) * a
    grad_buffers = _grad_buffers(args, counts, a, r)
    sync_every = workload.grad_sync == "every"
    accumulated = counts.total * r if grad_accum > 1 and not sync_every else 0.0
    # Backward of a block: its recomputation (AC) plus gradient temporaries of a few [T, D] and
    # [T, ffn/mp] tensors (dL/dh, and the three SwiGLU input gradients).
    t = b * s
    backward_work = acts.recompute + a * t * (2 * args.dim + 3 * args.ffn_hidden_dim // mp)
    memory = Memory(
        params=counts.sharded * MASTER_BYTES, grads=counts.sharded * MASTER_BYTES,
        optimizer=2 * counts.sharded * MASTER_BYTES, accumulated_grads=accumulated,
        gathered_params=gathered, grad_buffers=grad_buffers, activations=acts.saved,
        transient=max(acts.loss_transient, backward_work),
    )

    # Compute: this rank's 1/mp share of the micro-batch's FLOPs, plus the recomputed forwards.
    per_token = flops_per_token(args, s)
    recompute_per_token = n_ac * (2 * _block_params(args) + 4 * args.dim * s)
    compute_mb = (per_token + recompute_per_token) * t / mp / (hw.peak_flops * hw.mfu)

    comm = collective_bytes(args, layout, workload)
    mp_bw, ds_bw, dr_bw = group_busbw(1, mp, hw), group_busbw(mp, ds, hw), group_busbw(mp * ds, dr, hw)
    tp_mb = (all_reduce_seconds(comm.tp_all_reduce, mp, mp_bw) + all_gather_seconds(comm.tp_all_gather, mp, mp_bw)
             + all_gather_seconds(comm.tp_reduce_scatter, mp, mp_bw))
    ag = all_gather_seconds(comm.fsdp_all_gather, ds, ds_bw)
    rs = all_gather_seconds(comm.fsdp_reduce_scatter, ds, ds_bw)
    ar = all_reduce_seconds(comm.replica_all_reduce, dr, dr_bw)
    busy = compute_mb + tp_mb
    if sync_every:  # every micro-batch gathers and reduces: sharded accumulation, more traffic
        exposed = grad_accum * max(0.0, ag + rs + ar - busy)
        dp_comm = grad_accum * (ag + rs + ar)
    else:
        exposed = (grad_accum - 1) * max(0.0, ag - busy) + max(0.0, ag + rs + ar - busy)
        dp_comm = grad_accum * ag + rs + ar
    time = StepTime(compute=grad_accum * compute_mb, tp_comm=grad_accum * tp_mb, dp_comm=dp_comm, dp_exposed=exposed)
    tokens = global_batch * s
    return Estimate(
        layout=layout, grad_accum=grad_accum, global_batch=global_batch, memory=memory, time=time,
        tokens_per_step=tokens, model_flops_per_step=per_token * tokens, usable_bytes=hw.usable_bytes,
    )


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_layouts(args: ModelArgs, hw: Hardware, *, allow_cross_node_mp: bool = False,
                      ac_modes: Iterable[str] = AC_MODES, zero2: bool = False, ac_every: int = 2,
                      sequence_parallel: bool = True, seq_len: int = 0) -> tuple[list[Layout], dict[int, str]]:
    """Every layout of hw.gpus ranks the model can run; and the rejected mp sizes with the reason."""
    layouts: list[Layout] = []
    rejected: dict[int, str] = {}
    for mp in divisors(hw.gpus):
        try:
            args.check(mp)
        except ValueError as err:
            rejected[mp] = str(err)
            continue
        if mp > hw.gpus_per_node and not allow_cross_node_mp:
            rejected[mp] = (f"mp = {mp} spans nodes of {hw.gpus_per_node} GPUs: tensor-parallel all-reduces would "
                            "leave the node (--allow-cross-node-mp to consider it)")
            continue
        if sequence_parallel and seq_len % mp:
            rejected[mp] = (f"seq_len = {seq_len} is not divisible by mp = {mp}, as sequence parallelism needs "
                            "(--no-sequence-parallel to consider it without)")
            continue
        dp = hw.gpus // mp
        for ds in divisors(dp):
            for ac in ac_modes:
                for reshard in (True, False) if zero2 else (True,):
                    if not reshard and ds == 1:
                        continue  # nothing is sharded: ZeRO-2 is the same layout
                    layouts.append(Layout(mp, ds, dp // ds, ac, ac_every, reshard, sequence_parallel))
    return layouts, rejected


@dataclasses.dataclass
class Plan:
    args: ModelArgs
    workload: Workload
    hardware: Hardware
    estimates: list[Estimate]  # fitting ones first, fastest first; then the rest by memory
    rejected: dict[int, str]  # mp -> why no layout with it was considered
    skipped: list[tuple[Layout, str]]  # layouts the global batch does not divide

    @property
    def fitting(self) -> list[Estimate]:
        return [e for e in self.estimates if e.fits]

    def find(self, mp: int, dp_shard: int, dp_replicate: int, ac: Optional[str] = None) -> list[Estimate]:
        return [e for e in self.estimates if (e.layout.mp, e.layout.dp_shard, e.layout.dp_replicate) ==
                (mp, dp_shard, dp_replicate) and (ac is None or e.layout.ac == ac)]


def make_plan(args: ModelArgs, workload: Workload, hw: Hardware, **candidate_options) -> Plan:
    """Estimate every candidate layout and rank them: layouts that fit, by tokens/s per GPU."""
    if workload.seq_len > args.max_seq_len:
        raise ValueError(f"seq_len = {workload.seq_len} is larger than the model's max_seq_len = {args.max_seq_len}")
    for name, value in (("gpus", hw.gpus), ("gpus_per_node", hw.gpus_per_node), ("seq_len", workload.seq_len),
                        ("micro_batch", workload.micro_batch)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if not 0 < hw.mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {hw.mfu}")
    if hw.usable_bytes <= 0:
        raise ValueError(f"gpu memory {hw.gpu_mem_gib} GiB leaves nothing after the {hw.reserve_gib} GiB reserve")
    layouts, rejected = candidate_layouts(args, hw, seq_len=workload.seq_len, **candidate_options)
    estimates, skipped = [], []
    for layout in layouts:
        try:
            estimates.append(estimate(args, layout, workload, hw))
        except ValueError as err:
            skipped.append((layout, str(err)))
    if skipped and not estimates:
        dps = sorted({lay.dp for lay, _ in skipped})
        raise ValueError(f"global batch {workload.global_batch} is not a multiple of dp x micro-batch "
                         f"({workload.micro_batch}) for any data-parallel size of {hw.gpus} GPUs ({dps}): "
                         "choose a global batch divisible by one of them")
    estimates.sort(key=lambda e: (not e.fits, -e.tokens_per_s_per_gpu if e.fits else e.memory.total, e.memory.total))
    return Plan(args, workload, hw, estimates, rejected, skipped)
