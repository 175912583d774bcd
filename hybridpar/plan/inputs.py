"""What a plan is asked about: the layout of the ranks, the workload, and the hardware."""

from __future__ import annotations

import dataclasses

GIB = 2**30
MASTER_BYTES = 4  # the trainer builds the model in fp32: master params, grads and AdamW moments are fp32


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh (dp_replicate, dp_shard, mp) plus activation checkpointing and the resharding choice."""

    mp: int
    dp_shard: int
    dp_replicate: int = 1
    ac: str = "none"  # none | selective (every ac_every-th block) | full
    ac_every: int = 2
    reshard_after_forward: bool = True  # False: ZeRO-2 (shard_grad_op / hybrid_shard_zero2)
    sequence_parallel: bool = True  # parallel.sequence_parallel (acts only when mp > 1)

    @property
    def dp(self) -> int:
        return self.dp_shard * self.dp_replicate

    @property
    def world(self) -> int:
        return self.mp * self.dp

    @property
    def strategy(self) -> str:
        """The fsdp.sharding_strategy to put in the config for this layout."""
        if self.dp_replicate == 1:
            return "full_shard" if self.reshard_after_forward else "shard_grad_op"
        if self.dp_shard == 1:
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
        return f"mp{self.mp}_dp{self.dp}"

    def describe(self) -> str:
        ac = {"none": "no AC", "full": "full AC", "selective": f"AC every {self.ac_every}"}[self.ac]
        sp = ", sequence parallel" if self.sequence_parallel and self.mp > 1 else ""
        return (f"mp {self.mp} x dp_shard {self.dp_shard} x dp_replicate {self.dp_replicate} "
                f"({self.strategy}, {ac}{sp})")


@dataclasses.dataclass(frozen=True)
class Workload:
    seq_len: int
    micro_batch: int = 1  # sequences per micro-batch per data-parallel rank
    global_batch: int = 0  # sequences per optimizer step; 0: one micro-batch per dp rank (no accumulation)
    param_dtype: str = "bf16"  # FSDP compute dtype (the gathered parameters and activations)
    reduce_dtype: str = "fp32"  # FSDP gradient reduction dtype
    grad_sync: str = "last"  # train.grad_sync: reduce-scatter after the last micro-batch, or after "every" one

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
    gpus: int
    gpu_mem_gib: float
    gpus_per_node: int = 8
    intra_node_busbw: float = 150e9  # bytes/s, nccl-tests busbw inside a node (NVLink)
    inter_node_busbw: float = 25e9  # bytes/s per GPU between nodes (one 200 Gb/s NIC per GPU)
    peak_flops: float = 312e12  # dense bf16 per GPU (A100; 989e12 for H100 SXM)
    mfu: float = 0.4  # fraction of the peak the math reaches while computing (communication excluded)
    reserve_gib: float = 4.0  # CUDA context, NCCL buffers, allocator fragmentation

    @property
    def usable_bytes(self) -> float:
        return (self.gpu_mem_gib - self.reserve_gib) * GIB
