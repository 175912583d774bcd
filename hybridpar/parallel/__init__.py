"""Tensor (model) parallelism: fairscale-compatible layers, region functions, vocab-parallel loss."""

from .layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear, VocabParallelEmbedding
from .loss import vocab_parallel_cross_entropy
from .mappings import copy_to_region, gather_from_region, reduce_from_region, scatter_to_region

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "copy_to_region",
    "reduce_from_region",
    "scatter_to_region",
    "gather_from_region",
]
