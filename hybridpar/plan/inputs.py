"""What a plan is asked about: the layout of the ranks, the workload, and the hardware."""

from __future__ import annotations

import dataclasses

from ..config.low_precision import RECIPES as FLOAT8_RECIPES  # the [float8] section's recipes ("none": bf16)

GIB = 2**30
# The SMs an NCCL collective's kernel holds while it runs, which no compute kernel shares: "NCCL uses the
# minimal number of SMs to achieve the performance of the platform ... on DGX with 8 NICs ... 16 SMs" and
# "NCCL CTAs won't share an SM with compute kernels" (its maintainer, github.com/NVIDIA/nccl/issues/689);
# Meta profiling FSDP on H100 saw NCCL occupy ~10% of the 132 SMs (github.com/pytorch/pytorch/issues/143988).
NCCL_SMS = 16
MASTER_BYTES = 4  # the trainer builds the model in fp32: master params, grads and AdamW moments are fp32
# What a GPU's caching allocator reserves beyond the tensors the planner counts (Memory.allocator), as a
# fraction of them: the blocks a step frees (the activations, in backward) stay cached for what it makes
# next (the gradients, of other sizes). Measured on one H200 (docs/benchmarks.md, first light), Llama 3
# 8B's shape with 20 layers at world 1: torchtitan's allocator reserved 1.32x its peak allocation (114.7
# of 86.9 GiB; compiled, 1.24x); hybridpar's peak allocation was 90.5 GiB, so at 1.32x its card held
# about 119.4 GiB, where the planner's terms (each counted as alive at once) sum to 112.4: 6.3% more.
# The GPU check now measures hybridpar's own (bench/gpu: planned/reserved).
ALLOCATOR_OVERHEAD = 0.063


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh (pp, dp_replicate, dp_shard, cp, mp) plus activation checkpointing and the resharding choice.
    cp (context parallelism, hybridpar.parallel.context) cuts every sequence over cp ranks that hold
    the same parameters: FSDP shards over dp_shard x cp, the batch per dp coordinate is unchanged."""

    mp: int
    dp_shard: int
    dp_replicate: int = 1
    ac: str = "none"  # none | selective (every ac_every-th block) | full
    ac_every: int = 2
    reshard_after_forward: bool = True  # False: ZeRO-2 (shard_grad_op / hybrid_shard_zero2)
    sequence_parallel: bool = True  # parallel.sequence_parallel (acts only when mp > 1)
    cp: int = 1  # parallel.cp: ranks that share each sequence (last: positional callers predate it)
    pp: int = 1  # parallel.pp: pipeline stages, the outermost dimension (hybridpar.plan.pipeline_cost)
    pp_schedule: str = "1F1B"  # parallel.pp_schedule (GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble)
    v: int = 1  # virtual stages per rank: 1 for GPipe and 1F1B, 2 for ZBV, 2 or more interleaved
    ep: int = 1  # parallel.ep: the experts split over ep of the dp_shard ranks (a mixture of experts; plan.experts)

    @property
    def dp(self) -> int:
        return self.dp_shard * self.dp_replicate

    @property
    def fsdp_shard(self) -> int:
        """Ranks one FSDP shard group spans: the cp ranks of a dp coordinate hold the same parameters."""
        return self.dp_shard * self.cp

    @property
    def world(self) -> int:
        return self.pp * self.mp * self.cp * self.dp

    @property
    def strategy(self) -> str:
        """The fsdp.sharding_strategy to put in the config for this layout."""
        if self.dp_replicate == 1:
            return "full_shard" if self.reshard_after_forward else "shard_grad_op"
        if self.fsdp_shard == 1:
            return "no_shard"
        return "hybrid_shard" if self.reshard_after_forward else "hybrid_shard_zero2"

    def checkpointed_blocks(self, n_layers: int) -> int:
        """How many blocks apply_activation_checkpointing wraps for this mode."""
        if self.ac == "none":
            return 0
        if self.ac == "full":
            return n_layers
        return len(range(0, n_layers, self.ac_every))

    @property
    def name(self) -> str:
        cp = f"_cp{self.cp}" if self.cp > 1 else ""
        pp = f"pp{self.pp}{'v' + str(self.v) if self.v > 1 else ''}_" if self.pp > 1 else ""
        ep = f"_ep{self.ep}" if self.ep > 1 else ""
        return f"{pp}mp{self.mp}{cp}{ep}_dp{self.dp}"

    def describe(self) -> str:
        ac = {"none": "no AC", "full": "full AC", "selective": f"AC every {self.ac_every}"}[self.ac]
        sp = ", sequence parallel" if self.sequence_parallel and self.mp > 1 else ""
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        pp = f"pp {self.pp} ({self.pp_schedule}, {self.v} stage(s) per rank) x " if self.pp > 1 else ""
        ep = f" (ep {self.ep} of them)" if self.ep > 1 else ""
        return (f"{pp}mp {self.mp}{cp} x dp_shard {self.dp_shard}{ep} x dp_replicate {self.dp_replicate} "
                f"({self.strategy}, {ac}{sp})")


@dataclasses.dataclass(frozen=True)
class Workload:
    seq_len: int
    micro_batch: int = 1  # sequences per micro-batch per data-parallel rank
    global_batch: int = 0  # sequences per optimizer step; 0: one micro-batch per dp rank (no accumulation)
    param_dtype: str = "bfloat16"  # FSDP compute dtype (the gathered parameters and activations)
    reduce_dtype: str = "float32"  # FSDP gradient reduction dtype
    grad_sync: str = "last"  # train.grad_sync: reduce-scatter after the last micro-batch, or after "every" one
    compile: bool = False  # train.compile: each block's elementwise chains fused
    # torch's asynchronous TP (torchtitan's enable_async_tensor_parallel, which hybridpar does not
    # have): the tensor-parallel collectives overlap the matmuls beside them (plan.async_tp prices it).
    async_tp: bool = False
    # float8.recipe and float8.fsdp_all_gather: the blocks' linears in float8 (plan.compute prices them).
    float8: str = "none"
    float8_all_gather: bool = False

    def __post_init__(self) -> None:
        if self.float8 not in FLOAT8_RECIPES:
            raise ValueError(f"--float8 {self.float8!r}: choose one of {', '.join(FLOAT8_RECIPES[1:])}")
        if self.float8_all_gather and self.float8 != "tensorwise":
            raise ValueError(f"--float8-all-gather needs --float8 tensorwise, not {self.float8}: only a "
                             "tensorwise scale can be computed before FSDP gathers the weight")

    def float8_gathered(self, fsdp_shard: int) -> bool:
        """Whether FSDP all-gathers the float8 linears' weights in float8: asked for, and something is sharded."""
        return self.float8_all_gather and fsdp_shard > 1

    def grad_accum(self, dp: int) -> int:
        """Micro-batches per step for `dp` data-parallel ranks; ValueError when they do not divide."""
        if not self.global_batch:
            return 1
        per_step = dp * self.micro_batch
        if self.global_batch % per_step:
            raise ValueError(f"global batch {self.global_batch} is not a multiple of dp x micro-batch = {per_step}")
        return self.global_batch // per_step


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One kind of accelerator and its links. Rates are sustained ones: a peak times the fraction of
    it a kind of kernel reaches (hybridpar/plan/hardware.py names real GPUs and measures a CPU)."""

    gpus: int
    gpu_mem_gib: float
    gpus_per_node: int = 8
    intra_node_busbw: float = 150e9  # bytes/s, nccl-tests busbw inside a node (NVLink)
    inter_node_busbw: float = 25e9  # bytes/s per GPU between nodes (one 200 Gb/s NIC per GPU)
    peak_flops: float = 312e12  # dense bf16 per GPU from the datasheet: the MFU denominator
    float8_peak_flops: float = 0.0  # dense float8 per GPU from the datasheet; 0: the card has no float8 matmuls
    gemm_efficiency: float = 0.85  # fraction of the peak large matrix multiplies sustain
    attention_efficiency: float = 0.55  # fraction flash attention sustains (forward and backward)
    memory_bw: float = 2.0e12  # device memory bytes/s from the datasheet
    memory_efficiency: float = 0.8  # fraction elementwise kernels sustain
    op_overhead: float = 0.0  # host seconds per op the device does not hide (CPU: dispatch)
    cores: int = 0  # >0: the ranks of a node share this many cores (CPU); communication does not overlap
    sync_wait: float = 0.0  # seconds a synchronising call adds when ranks share the cores (CPU)
    reserve_gib: float = 4.0  # CUDA context, NCCL buffers
    allocator_overhead: float = ALLOCATOR_OVERHEAD  # the caching allocator's reserve, of the rest (a CPU: 0)
    sms: int = 0  # streaming multiprocessors; 0: NCCL's share of them not priced (a CPU, or not stated)
    name: str = ""

    @property
    def nccl_share(self) -> float:
        """The share of the SMs an NCCL kernel holds: compute it overlaps runs on the rest (NCCL_SMS)."""
        return min(1.0, NCCL_SMS / self.sms) if self.sms else 0.0

    @property
    def usable_bytes(self) -> float:
        return (self.gpu_mem_gib - self.reserve_gib) * GIB

    def describe(self) -> str:
        peak = (f"{self.peak_flops / 1e12:g} TFLOP/s" if self.peak_flops >= 1e12
                else f"{self.peak_flops / 1e9:.0f} GFLOP/s")
        sustained = (f"matmul {self.gemm_efficiency:.2f} and attention {self.attention_efficiency:.2f} of {peak}, "
                     f"memory {self.memory_efficiency:.2f} of {self.memory_bw / 1e9:.4g} GB/s")
        if self.sms:
            sustained += f"; NCCL's kernels hold {min(NCCL_SMS, self.sms)} of its {self.sms} SMs while they overlap compute"
        if self.op_overhead:
            sustained += f", {self.op_overhead * 1e6:.1f} us per op"
        if self.cores:
            sustained += f", {self.cores} cores shared by the ranks of a node, {self.sync_wait * 1e3:.2f} ms per sync"
        return sustained


def check_float8(workload: Workload, hw: Hardware) -> None:
    """ValueError, in one line, for a float8 plan on hardware without float8 matmuls."""
    if workload.float8 != "none" and not hw.float8_peak_flops:
        card = hw.name.split(" ")[0] or "this hardware"
        raise ValueError(f"--float8 {workload.float8}: {card} has no float8 matmuls (no float8 peak in "
                         "hybridpar/plan/hardware.py): plan it without --float8, on a card with them (--gpu h100), "
                         "or give the card's --float8-tflops")
