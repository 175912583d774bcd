"""The [fsdp] config section, without torch: the config (and so the command line's `--help`) reads
it before anything imports torch; hybridpar.parallel.fsdp applies it."""

from __future__ import annotations

import dataclasses

from . import dtypes
from .options import option

STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "no_shard")
AC_MODES = ("none", "selective", "full")  # least recomputation first: `hybridpar plan` lists layouts in this order


@dataclasses.dataclass
class FSDPConfig:
    sharding_strategy: str = option("hybrid_shard", f"one of {', '.join(STRATEGIES)}")
    param_dtype: str = option("bfloat16", f"compute dtype of the gathered parameters ({', '.join(dtypes.NAMES)})")
    reduce_dtype: str = option("float32", "gradient reduction dtype")
    activation_checkpointing: str = option("none", f"one of {', '.join(AC_MODES)}")
    ac_every: int = option(2, "selective: checkpoint every k-th block")
    cpu_offload: bool = option(False, "keep parameters, gradients and optimizer state on the CPU (GPUs)")
    forward_prefetch: int = option(1, "blocks whose all-gather is issued ahead in forward (0: FSDP2's implicit)")
    backward_prefetch: int = option(1, "the same in backward")
    # They cost gloo less CPU for the same bytes (a fast path: HYBRIDPAR_FAST_PATHS=0 turns it off too).
    gloo_all_to_all: bool = option(True, "on gloo, FSDP's all-gather and reduce-scatter as all-to-alls; false "
                                         "keeps FSDP2's own, the ones nccl runs")

    def validate(self) -> None:
        """ValueError naming the fsdp.* key and its valid values."""
        if self.sharding_strategy not in STRATEGIES:
            raise ValueError(f"fsdp.sharding_strategy must be one of {', '.join(STRATEGIES)}, "
                             f"got {self.sharding_strategy!r}")
        if self.activation_checkpointing not in AC_MODES:
            raise ValueError(f"fsdp.activation_checkpointing must be one of {', '.join(AC_MODES)}, "
                             f"got {self.activation_checkpointing!r}")
        for name in ("param_dtype", "reduce_dtype"):
            dtypes.check(getattr(self, name), f"fsdp.{name}")
        if self.ac_every < 1:
            raise ValueError(f"fsdp.ac_every must be >= 1, got {self.ac_every}")
