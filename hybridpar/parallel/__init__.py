"""Tensor (model) parallelism: fairscale-compatible layers, region functions, vocab-parallel loss,
and sequence parallelism's region pair."""

from .layers import (ColumnParallelLinear, ParallelEmbedding, RowParallelLinear, VocabParallelEmbedding,
                     set_sequence_parallel)
from .loss import vocab_parallel_cross_entropy
from .mappings import (copy_to_region, enter_region, gather_from_region, gather_from_sequence_region, leave_region,
                       reduce_from_region, reduce_scatter_to_sequence_region, scatter_to_region,
                       scatter_to_sequence_region)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ParallelEmbedding",
    "set_sequence_parallel",
    "vocab_parallel_cross_entropy",
    "copy_to_region",
    "reduce_from_region",
    "scatter_to_region",
    "gather_from_region",
    "gather_from_sequence_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_sequence_region",
    "enter_region",
    "leave_region",
]
