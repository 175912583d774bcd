"""torch's asynchronous tensor parallelism (torchtitan's enable_async_tensor_parallel; hybridpar has
it not, some published runs do): the compiler cuts each sequence-parallel all-gather into pieces
that the matmuls it feeds consume as they arrive, and feeds each reduce-scatter piece by piece from
the matmuls before it. So a collective hides behind its own matmuls and no others: up to their
time, and what is longer stays exposed. Float8 halves those matmuls' time, and with it what they
hide. The collectives outside the blocks' four regions (the embedding's, the head's, the norms'
gradient sums, the loss's) are not rewritten and stay exposed, as does everything without sequence
parallelism (the rewrite matches its all-gather and reduce-scatter only)."""

from __future__ import annotations

from hybridpar.models.args import ModelArgs

from ..config.dtypes import dtype_bytes
from .comm import all_gather_seconds, group_busbw
from .compute import REGIONS, block_linears, linear_work
from .inputs import Hardware, Layout, Workload


def async_tp_seconds(args: ModelArgs, layout: Layout, workload: Workload, hw: Hardware, tp_seconds: float) -> float:
    """One micro-batch's `tp_seconds` of tensor-parallel collectives, less what async TP hides."""
    mp = layout.mp
    if mp == 1 or not layout.sequence_parallel:
        return tp_seconds
    a = dtype_bytes(workload.param_dtype)
    tokens = workload.micro_batch * workload.seq_len // layout.cp
    # Each region's collective moves one [tokens, dim] activation (plan.comm.collective_bytes).
    one = all_gather_seconds(tokens * args.dim * a, mp, group_busbw(1, mp, hw))
    linears, L = block_linears(args, mp), args.n_layers
    recomputed = layout.checkpointed_blocks(L)
    hidden = 0.0
    # An entry's all-gather feeds its linears (wq/wk/wv, w1/w3), an exit's reduce-scatter takes wo's or
    # w2's output; backward, the exit's gradient is gathered for the same matmuls and the entry's reduced.
    for region, which in REGIONS.items():
        forward, backward = (w.seconds(hw) for w in linear_work(
            linears[which], tokens, a, workload.float8, workload.float8_gathered(layout.fsdp_shard), workload.compile,
            shared_input=True))
        again = 0 if region == "feed-forward exit" else recomputed  # recomputation stops at w2's input
        hidden += (L + again) * min(one, forward)
    return tp_seconds - hidden
