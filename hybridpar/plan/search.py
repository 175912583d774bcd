"""The estimate of one layout, and the search: every layout of the GPUs (plan.layouts), estimated and ranked."""

from __future__ import annotations

import dataclasses
from typing import Optional

from hybridpar.models.args import ModelArgs

from ..config.dtypes import dtype_bytes
from ..config.llama4 import context_parallel_gaps
from ..config.sharding import AC_MODES
from ..parallel.cost import collective_seconds
from .async_tp import async_tp_seconds
from .comm import (StepTime, all_gather_seconds, all_reduce_seconds, collective_bytes,
                   flops_per_token, group_busbw, overlapped)
from .compute import OPTIMIZER_BYTES, Work, head_work, micro_batch_work, step_work
from .experts import ExpertTerms, check_experts, dense_skeleton, expert_terms
from .inputs import MASTER_BYTES, Hardware, Layout, Workload, check_float8
from .layouts import candidate_layouts, no_layout_for_ep
from .memory import (Memory, ParamCounts, activation_bytes, gathered_bytes, gathered_kv_bytes, local_param_shapes,
                     param_counts)
from ..pipeline.schedules import least_microbatches, max_stages, rounds_of
from .pipeline_cost import bubble_fraction, in_flight, rank_layers, schedule_stages, stage_units

STEP_SCALARS = 3  # the trainer's all-reduces per step: target tokens, the loss, the gradient norm
CP_NEEDED = 1 / 3  # context_parallel_needed: the share of memory one sequence's activations may take at cp 1


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
    experts: ExpertTerms = ExpertTerms()  # a mixture of experts' routed experts (plan.experts): their share

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_bytes

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.time.step / self.layout.world

    def mfu(self, peak_flops: float) -> float:
        return self.model_flops_per_step / (self.time.step * peak_flops * self.layout.world)


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
    check_float8(workload, hw)
    original, mp, dr, cp = layout, layout.mp, layout.dp_replicate, layout.cp
    if cp < 1 or (cp > 1 and workload.seq_len % (2 * cp)):
        raise ValueError(f"seq_len = {workload.seq_len} is not divisible by 2 x cp = {2 * cp}")
    a, r = dtype_bytes(workload.param_dtype), dtype_bytes(workload.reduce_dtype)
    grad_accum = workload.grad_accum(layout.dp)
    global_batch = layout.dp * workload.micro_batch * grad_accum
    b, s, pp = workload.micro_batch, workload.seq_len, layout.pp
    whole = args
    check_experts(args, layout.ep)
    if layout.dp_shard % layout.ep:
        raise ValueError(f"ep = {layout.ep} does not divide dp_shard = {layout.dp_shard}: the experts are split over "
                         "ep of the dp_shard ranks")
    gaps = context_parallel_gaps(args)
    if cp > 1 and gaps:
        raise ValueError(f"cp = {cp}: {gaps} (hybridpar.config.llama4): plan it with --cp 1")
    args, layers = dense_skeleton(args), None  # the rest priced as a dense model (plan.experts)
    if pp > 1:
        # A pipeline rank holds its stages' blocks: priced as the rank with most of them, and FSDP
        # does not reshard between micro-batches (one all-gather per step), so hybridpar's pipeline
        # engine keeps the stage's parameters gathered and its gradients unsharded until the last one.
        schedule = layout.pp_schedule
        v = schedule_stages(schedule, layout.v)
        if pp * v > max_stages(args.n_layers):
            raise ValueError(f"pp x stages per rank = {pp * v} is more than the model's {args.n_layers} layers + 2")
        # torch's schedule would refuse the micro-batches, as hybridpar's preflight does
        needed, rounds = least_microbatches(schedule, pp * v), rounds_of(schedule, pp, grad_accum)
        if grad_accum < needed or grad_accum % rounds:
            raise ValueError(f"{grad_accum} micro-batches per step: {schedule} at pp = {pp} needs at least "
                             f"{needed}, in rounds of {pp}")
        args = dataclasses.replace(args, n_layers=stage_units(args.n_layers, pp, v, schedule))
        layout = dataclasses.replace(layout, reshard_after_forward=False)
        # A mixture of experts' routed experts: those of the rank holding most MoE layers.
        layers = max(rank_layers(whole.n_layers, pp, v, schedule),
                     key=lambda held: sum(whole.is_moe_layer(i) for i in held))
    moe = expert_terms(whole, layout, workload, layers)  # zeros for a dense model
    L = args.n_layers

    counts = param_counts(args, mp, layout.fsdp_shard)
    if pp > 1:  # the middle ranks' blocks, or one fewer with the embedding, or with the head
        counts = max(param_counts(args, mp, layout.fsdp_shard, L, False, False),
                     param_counts(args, mp, layout.fsdp_shard, L - 1, True, False),
                     param_counts(args, mp, layout.fsdp_shard, L - 1, False, True), key=lambda c: c.sharded)
    n_ac = layout.checkpointed_blocks(L)
    acts = activation_bytes(args, mp, b, s, a, n_ac, layout.sequence_parallel, cp)
    saved = acts.saved
    if pp > 1:  # the micro-batches in flight on the first rank; the head's of one micro-batch
        ends = acts.head + acts.embedding
        flight = in_flight(layout.pp_schedule, pp, v, grad_accum)
        saved, moe = flight * (saved - ends) + ends, dataclasses.replace(moe, saved_mb=flight * moe.saved_mb)

    kept_blocks = counts.n_layers if not layout.reshard_after_forward else min(2, L)  # current + prefetched
    # A block's float8 linears are gathered in 1 byte with float8.fsdp_all_gather.
    block = gathered_bytes(local_param_shapes(args, mp)["block"], a, workload.float8_gathered(layout.fsdp_shard))
    gathered = (counts.embedding + counts.output + counts.root) * a + kept_blocks * block + moe.gathered
    # A MoE layer's experts' unsharded gradients beside its block's.
    grad_buffers = _grad_buffers(args, counts, a, r) + moe.expert_unit * (a + r)
    sync_every = workload.grad_sync == "every"
    accumulated = (counts.total + moe.local) * r if grad_accum > 1 and not sync_every else 0.0
    # Backward of a block: its recomputation (AC) plus gradient temporaries of a few [T, D] and
    # [T, ffn/mp] tensors (dL/dh, and the three SwiGLU input gradients); with context parallelism
    # also the gradient of the block's gathered K|V before its reduce-scatter.
    t = b * s // cp
    backward_work = acts.recompute + a * t * (2 * args.dim + 3 * args.ffn_hidden_dim // mp)
    if cp > 1:
        backward_work += gathered_kv_bytes(args, mp, b, s, a)
    sharded = counts.sharded + moe.sharded
    tensors = Memory(
        params=sharded * MASTER_BYTES, grads=sharded * MASTER_BYTES,
        optimizer=2 * sharded * MASTER_BYTES, accumulated_grads=accumulated,
        gathered_params=gathered, grad_buffers=grad_buffers, activations=saved + moe.saved_mb,
        transient=max(acts.loss_transient, backward_work + moe.transient_mb),
    )
    memory = dataclasses.replace(tensors, allocator=hw.allocator_overhead * tensors.total)

    # Compute: this rank's kernels for one micro-batch (its 1/mp share, recomputation included),
    # and per step FSDP's copies and the optimizer.
    comm = collective_bytes(args, layout, workload)
    reductions = grad_accum if sync_every else 1
    gathers = (2 if layout.reshard_after_forward else 1) * (grad_accum if pp == 1 else 1)
    dp_calls = (grad_accum if pp == 1 else 1) * comm.fsdp_gather_calls + reductions * comm.fsdp_reduce_calls \
        + comm.replica_calls
    work = micro_batch_work(args, layout, workload, comm.tp_calls + comm.cp_calls)
    if pp > 1:  # the middle ranks' blocks, or the last rank's one fewer and the head
        head = head_work(args, mp, b * s // cp, a)
        work = max(work + (-1) * head, micro_batch_work(dataclasses.replace(args, n_layers=L - 1), layout, workload,
                                                       comm.tp_calls + comm.cp_calls), key=lambda w: w.seconds(hw))
    # The experts' FSDP copies come with each micro-batch's all-gathers; under pp with the step's one.
    work += moe.work_mb + (moe.gather_copies if pp == 1 else Work())
    compute_mb = work.seconds(hw)
    # The experts' shards through the optimizer, their gradients into the reduce-scatter's buffer.
    moe_step = Work(memory_bytes=moe.sharded * OPTIMIZER_BYTES + reductions * moe.local * (a + 2 * r))
    if pp > 1:
        moe_step += moe.gather_copies
    step_extra = (step_work(args, layout, workload, gathers, reductions, dp_calls) + moe_step).seconds(hw)
    # The mesh (dp_replicate, dp_shard, cp, mp), mp innermost: FSDP's group is the dp_shard x cp
    # ranks mp apart, the cp group the cp ranks mp apart, the replicas mp x cp x dp_shard apart.
    fs = layout.fsdp_shard
    mp_bw, cp_bw = group_busbw(1, mp, hw), group_busbw(mp, cp, hw)
    fs_bw, dr_bw = group_busbw(mp, fs, hw), group_busbw(mp * fs, dr, hw)
    tp_mb = (all_reduce_seconds(comm.tp_all_reduce, mp, mp_bw) + all_gather_seconds(comm.tp_all_gather, mp, mp_bw)
             + all_gather_seconds(comm.tp_reduce_scatter, mp, mp_bw))
    if workload.async_tp:
        tp_mb = async_tp_seconds(args, layout, workload, hw, tp_mb)
    # Context parallelism's collectives wait for their result: hybridpar.parallel.context gathers K|V
    # before the attention that needs it, and the block's backward goes on from the reduced dK|dV.
    cp_mb = all_gather_seconds(comm.cp_all_gather, cp, cp_bw) + all_gather_seconds(comm.cp_reduce_scatter, cp, cp_bw)
    ag = all_gather_seconds(comm.fsdp_all_gather, fs, fs_bw)
    rs = all_gather_seconds(comm.fsdp_reduce_scatter, fs, fs_bw)
    ar = all_reduce_seconds(comm.replica_all_reduce, dr, dr_bw)
    if moe.expert_unit:
        # The ep group: ep neighbouring dp_shard ranks, mp x cp apart; the experts' FSDP group the
        # dp_shard / ep ranks holding the same experts, mp x cp x ep apart (hybridpar.mesh.device).
        es, ep_bw = moe.expert_fsdp, group_busbw(mp * cp, layout.ep, hw)
        tp_mb += all_gather_seconds(moe.router_tp_mb, mp, mp_bw)
        ag += all_gather_seconds(moe.gather_mb, es, group_busbw(mp * cp * layout.ep, es, hw))
        rs += all_gather_seconds(moe.reduce, es, group_busbw(mp * cp * layout.ep, es, hw))
        ar += all_reduce_seconds(moe.replica_reduce, dr, dr_bw)
    # Expert parallelism's all-to-alls wait for their result: the experts need the tokens, the layer their outputs.
    ep_mb = collective_seconds("all_to_all", moe.all_to_all_mb, layout.ep, ep_bw) if moe.all_to_all_mb else 0.0
    busy = compute_mb + tp_mb + cp_mb + ep_mb
    pp_mb = 0.0
    if pp > 1:
        # Each of a rank's v stages receives a micro-batch's hidden state and sends its own, and the
        # gradients back (the sequence-parallel shard under mp): over the pp link, between nodes
        # once a stage's ranks fill one.
        sp = mp if layout.sequence_parallel and mp > 1 else 1
        hidden = b * s // cp // sp * args.dim * a
        pp_mb = 2 * v * hidden / group_busbw(layout.world // pp, pp, hw)
    held = hw.nccl_share  # of the SMs, while a collective overlaps compute
    last = overlapped(ag + rs + ar, busy, held)
    if pp > 1:  # the stage's parameters gathered once, its gradients reduced once per step
        (exposed, contention), dp_comm = last, ag + rs + ar
    elif sync_every:  # every micro-batch gathers and reduces: sharded accumulation, more traffic
        exposed, contention = (grad_accum * x for x in last)
        dp_comm = grad_accum * (ag + rs + ar)
    else:
        exposed, contention = ((grad_accum - 1) * x + y for x, y in zip(overlapped(ag, busy, held), last))
        dp_comm = grad_accum * ag + rs + ar
    compute, tp, cp_time = grad_accum * compute_mb + step_extra, grad_accum * tp_mb, grad_accum * cp_mb
    ep_time = grad_accum * ep_mb
    if hw.cores:
        # CPU ranks: communication is core time too (gloo copies), so nothing hides it, and ranks
        # beyond the node's cores queue for them; each synchronising call also waits for peers
        # that are off a core. The trainer's per-step scalars (tokens, loss, gradient norm) sync too.
        share = max(1.0, min(hw.gpus_per_node, hw.gpus) / hw.cores)
        tp_calls, dp_calls = grad_accum * comm.tp_calls, dp_calls + STEP_SCALARS
        compute = share * compute
        tp = share * tp + tp_calls * hw.sync_wait
        cp_time = share * cp_time + grad_accum * comm.cp_calls * hw.sync_wait
        ep_time = share * ep_time + grad_accum * moe.all_to_all_calls_mb * hw.sync_wait
        dp_comm = exposed = share * dp_comm + dp_calls * hw.sync_wait
        contention = 0.0  # exposed already: nothing overlaps
    pp_comm = grad_accum * pp_mb
    # The bubble: each rank idles (p - 1) / (v m + p - 1) of the pipelined part of the step.
    bubble = 0.0
    if pp > 1:
        share = bubble_fraction(pp, v, grad_accum)
        bubble = share / (1 - share) * (compute - step_extra + tp + cp_time + pp_comm)
    time = StepTime(compute=compute, tp_comm=tp, dp_comm=dp_comm, dp_exposed=exposed, dp_contention=contention,
                    cp_comm=cp_time,
                    cp_exposed=cp_time, pp_comm=pp_comm, pp_bubble=bubble, ep_comm=ep_time)
    tokens = global_batch * s
    return Estimate(
        layout=original, grad_accum=grad_accum, global_batch=global_batch, memory=memory, time=time,
        tokens_per_step=tokens, model_flops_per_step=flops_per_token(whole, s) * tokens, usable_bytes=hw.usable_bytes,
        experts=moe,
    )


@dataclasses.dataclass
class Plan:
    args: ModelArgs
    workload: Workload
    hardware: Hardware
    estimates: list[Estimate]  # fitting ones first, fastest first; then the rest by memory
    rejected: dict[int, str]  # mp -> why no layout with it was considered
    skipped: list[tuple[Layout, str]]  # layouts the global batch does not divide
    context_parallel: bool = False  # layouts with cp > 1 were considered
    pipeline: tuple[int, ...] = ()  # the pp sizes > 1 considered
    expert_parallel: int = 0  # --ep N: layouts with ep N only (0: every ep the experts and dp_shard allow)
    pipeline_left: tuple[int, ...] = ()  # pp sizes tried whose stages have no layout at the ep (or cp) given

    @property
    def fitting(self) -> list[Estimate]:
        return [e for e in self.estimates if e.fits]

    def find(self, mp: int, dp_shard: int, dp_replicate: int, ac: Optional[str] = None, cp: int = 1,
             pp: int = 1, ep: Optional[int] = None) -> list[Estimate]:
        return [e for e in self.estimates if (e.layout.mp, e.layout.cp, e.layout.dp_shard, e.layout.dp_replicate,
                                              e.layout.pp) == (mp, cp, dp_shard, dp_replicate, pp)
                and (ac is None or e.layout.ac == ac) and (ep is None or e.layout.ep == ep)]


def make_plan(args: ModelArgs, workload: Workload, hw: Hardware, **candidate_options) -> Plan:
    """Estimate every candidate layout and rank them: layouts that fit, by tokens/s per GPU."""
    if workload.seq_len > args.max_seq_len:
        raise ValueError(f"seq_len = {workload.seq_len} is larger than the model's max_seq_len = {args.max_seq_len}")
    for name, value in (("gpus", hw.gpus), ("gpus_per_node", hw.gpus_per_node), ("seq_len", workload.seq_len),
                        ("micro_batch", workload.micro_batch)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    for name in ("gemm_efficiency", "attention_efficiency", "memory_efficiency"):
        if not 0 < getattr(hw, name) <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {getattr(hw, name)}")
    if hw.usable_bytes <= 0:
        raise ValueError(f"gpu memory {hw.gpu_mem_gib} GiB leaves nothing after the {hw.reserve_gib} GiB reserve")
    check_float8(workload, hw)  # before the layouts: estimate's ValueError would read as a batch that does not divide
    cp = candidate_options.pop("cp", 0)
    if cp < 0:
        raise ValueError(f"cp must be 1 or more (0: the planner chooses), got {cp}")
    pp = candidate_options.pop("pp", 0)
    if pp < 0 or (pp and hw.gpus % pp):
        raise ValueError(f"pp must divide the {hw.gpus} GPUs (0: the planner chooses), got {pp}")
    ep = candidate_options.pop("ep", 0)
    if ep < 0:
        raise ValueError(f"--ep {ep}: ep must be 1 or more (0, or no --ep: the planner chooses)")
    if ep:
        check_experts(args, ep, flag=True)
    gaps = context_parallel_gaps(args)
    if cp > 1 and gaps:  # as the job refuses it (hybridpar.config.llama4.check_llama4)
        raise ValueError(f"--cp {cp}: {gaps} (hybridpar.config.llama4); plan it with --cp 1")
    if gaps:  # nor searched
        cp = 1
    layouts, rejected = candidate_layouts(args, hw, seq_len=workload.seq_len, cp=cp, pp=max(pp, 1), ep=ep,
                                          **candidate_options)
    if cp > 1 and not layouts:
        raise ValueError(f"cp = {cp} fits no layout of {hw.gpus} GPUs: cp must divide gpus / mp and seq_len "
                         f"{workload.seq_len} be a multiple of 2 x cp (x mp with sequence parallelism)")
    if ep and not layouts:
        every = candidate_layouts(args, hw, seq_len=workload.seq_len, cp=cp, pp=max(pp, 1), **candidate_options)[0]
        if every:  # else no mp runs at all: the report's reasons say why
            raise ValueError(no_layout_for_ep(ep, every, hw.gpus, pp))
    estimates, skipped = [], []

    def add(candidates: list[Layout]) -> None:
        for layout in candidates:
            try:
                estimates.append(estimate(args, layout, workload, hw))
            except ValueError as err:
                if layout.pp == 1:  # a pipeline the batch cannot fill is not listed
                    skipped.append((layout, str(err)))

    add([lay for lay in layouts if lay.cp == 1 or cp])
    if not cp and context_parallel_needed(estimates, hw):
        add([lay for lay in layouts if lay.cp > 1])
    # Pipeline stages when nothing fits without them: every power of two dividing the GPUs that the
    # layers allow (stages divide the state and the activations; the bubble costs time).
    # A stage's GPUs may leave no dp_shard that a fixed ep (or cp) divides: that pp is left out, and said so.
    tried, left = ((pp,) if pp > 1 else ()), ()
    if not pp and not any(e.fits for e in estimates):
        sizes = [n for n in (2 ** k for k in range(1, 12)) if hw.gpus % n == 0 and n <= max_stages(args.n_layers)]
        staged = {n: candidate_layouts(args, hw, seq_len=workload.seq_len, cp=cp, pp=n, ep=ep, **candidate_options)[0]
                  for n in sizes}
        for n in sizes:
            add(staged[n])
        tried, left = tuple(n for n in sizes if staged[n]), tuple(n for n in sizes if not staged[n])
    if skipped and not estimates:
        dps = sorted({lay.dp for lay, _ in skipped})
        at_ep = f" that ep {ep} divides" if ep > 1 else ""
        raise ValueError(f"global batch {workload.global_batch} is not a multiple of dp x micro-batch "
                         f"({workload.micro_batch}) for any data-parallel size of {hw.gpus} GPUs{at_ep} ({dps}): "
                         "choose a global batch divisible by one of them" + (", or a smaller --ep" if ep > 1 else ""))
    estimates.sort(key=lambda e: (not e.fits, -e.tokens_per_s_per_gpu if e.fits else e.memory.total, e.memory.total))
    considered = any(e.layout.cp > 1 for e in estimates) or any(lay.cp > 1 for lay, _ in skipped)
    return Plan(args, workload, hw, estimates, rejected, skipped, considered, tried, ep, left)


def context_parallel_needed(estimates: list[Estimate], hw: Hardware) -> bool:
    """Whether the sequence is long enough for context parallelism: no layout without it fits, or in
    the one needing least memory the activations and the peaks on top of them (what only cutting the
    sequence shrinks) take more than CP_NEEDED of the memory. Shorter sequences keep cp 1, as Meta
    trained Llama 3 up to 8192 tokens; `--cp N` prices a cp the planner would not consider."""
    if not estimates:
        return True
    if not any(e.fits for e in estimates):
        return True
    least = min(estimates, key=lambda e: e.memory.total).memory
    return least.activations + least.transient > CP_NEEDED * hw.usable_bytes


def larger_cp(plan: "Plan", e: Estimate) -> Optional[Estimate]:
    """When e's activations and buffers alone do not fit: e's layout at the smallest larger cp whose
    do, on the same GPUs (fewer data-parallel ranks) where the batch allows, else on more (the same
    data-parallel sizes); None when no cp the sequence allows gets there."""
    lay, w, hw = e.layout, plan.workload, plan.hardware
    split = lay.mp if lay.sequence_parallel else 1
    cp = 2 * lay.cp
    while w.seq_len % (2 * cp * split) == 0:
        grow = cp // lay.cp
        tries = [(dataclasses.replace(lay, cp=cp, dp_shard=lay.dp_shard // grow), hw)] if lay.dp_shard % grow == 0 else []
        tries += [(dataclasses.replace(lay, cp=cp), dataclasses.replace(hw, gpus=hw.gpus * grow))]
        for layout, gpus in tries:
            try:
                bigger = estimate(plan.args, layout, w, gpus)
            except ValueError:  # the global batch does not divide the fewer data-parallel ranks
                continue
            if bigger.memory.total - bigger.memory.state < hw.usable_bytes:
                return bigger
        cp *= 2
    return None


def larger_mp(plan: "Plan", e: Estimate) -> Optional[Estimate]:
    """With an ep fixed, the GPUs may leave e's layout only a small mp beside the ep's dp_shard: e's layout at
    the smallest larger mp inside a node whose activations and buffers fit, on as many more GPUs; None when
    no mp gets there."""
    lay, w, hw = e.layout, plan.workload, plan.hardware
    for mp in range(2 * lay.mp, hw.gpus_per_node + 1, lay.mp):
        try:
            plan.args.check(mp)
            if lay.sequence_parallel and w.seq_len % mp:
                continue
            wider = estimate(plan.args, dataclasses.replace(lay, mp=mp), w,
                             dataclasses.replace(hw, gpus=hw.gpus * mp // lay.mp))
        except ValueError:  # the model does not split over this mp
            continue
        if wider.memory.total - wider.memory.state < hw.usable_bytes:
            return wider
    return None
