"""Tensor-parallel layers with fairscale's constructor arguments and shard layout.

    ColumnParallelLinear   weight [out/mp, in]  Shard(0)   bias [out/mp] Shard(0)
    RowParallelLinear      weight [out, in/mp]  Shard(1)   bias [out]    Replicate
    VocabParallelEmbedding weight [V/mp, D]     Shard(0)
    ParallelEmbedding      weight [V, D/mp]     Shard(1)

Parameters are DTensors on the mp mesh dimension, so FSDP2, torch.distributed.checkpoint and
gradient clipping see the true global tensor. Forward passes work on the local shards with the
region functions of `mappings`, which is cheaper than DTensor dispatch for every op.

`sequence_parallel=True` (Megatron's option): the activations outside the layers are [tokens / mp,
dim] parts of the tokens (batch x seq flattened) over the mp group; column-parallel inputs are
all-gathered ([tokens, dim]) and row-parallel (and embedding) outputs reduce-scattered instead of
all-reduced (mappings).

Initialisation follows fairscale: `init_method` fills the full (master) weight, created alike on
every rank from the global RNG, and each rank keeps its slice. The same seed therefore gives the
same full tensors at any mp. Under `torch.device("meta")` nothing is allocated or initialised.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ..compat.torch import compute_local_shape_and_global_offset
from ..mesh.layout import divide
from ..mesh.device import ParallelDims
from .mappings import (copy_to_region, enter_region, gather_from_region, leave_region, scatter_to_region,
                       scatter_to_sequence_region)

InitMethod = Callable[[torch.Tensor], object]


def _default_device() -> torch.device:
    return torch.empty(()).device


def mp_parameter(
    full_shape: tuple[int, ...],
    placement: Placement,
    parallel: ParallelDims,
    init_method: Optional[InitMethod],
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device] = None,
    *,
    experts: bool = False,
) -> nn.Parameter:
    """A DTensor parameter on the mp mesh: `init_method` fills the full tensor, this rank keeps its
    slice (Shard) or all of it (Replicate). init_method=None leaves zeros (biases). experts: stacked
    experts (dim 0), which expert parallelism splits over the ep ranks too: on parallel.expert_mesh
    (ep, mp), Shard(0) then `placement`.
    """
    device = torch.device(device) if device is not None else _default_device()
    dtype = dtype or torch.get_default_dtype()
    if device.type == "meta":
        full = torch.empty(full_shape, dtype=dtype, device="meta")
    else:
        # Built in fp32 on the CPU, like fairscale's master weight: identical on every rank.
        full = torch.zeros(full_shape, dtype=torch.float32, device="cpu")
        if init_method is not None:
            init_method(full)
    if experts and parallel.ep > 1:
        mesh, placements = parallel.expert_mesh, [Shard(0), placement]
    else:
        mesh, placements = parallel.mp_mesh, [placement]
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    local = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    local = local.to(device=device, dtype=dtype).contiguous()
    return nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False))


def set_sequence_parallel(model: nn.Module, on: bool) -> nn.Module:
    """Turn sequence parallelism on or off in every layer of `model` (the parameters stay as they are:
    generation, for one, runs without it)."""
    for module in model.modules():
        if hasattr(module, "sequence_parallel"):
            module.sequence_parallel = on
    return model


def local_tensor(param: Optional[nn.Parameter]) -> Optional[torch.Tensor]:
    return param.to_local() if isinstance(param, DTensor) else param


def _float8_repr(layer: nn.Module) -> str:
    return f", float8 {layer.float8.recipe}" if layer.float8 is not None else ""


def _check_fairscale_options(stride: int = 1, keep_master_weight_for_test: bool = False) -> None:
    """fairscale's signatures are kept; the options whose behaviour is not implemented are refused."""
    if stride != 1:
        raise ValueError(f"stride={stride} is not supported: only fairscale's default stride=1 layout is")
    if keep_master_weight_for_test:
        raise ValueError("keep_master_weight_for_test=True is not supported: the full weight is "
                         "layer.weight.full_tensor()")


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by output rows: each rank computes out_features/mp outputs."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = True,
        init_method: InitMethod = nn.init.xavier_normal_,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        *,
        parallel: ParallelDims,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        _check_fairscale_options(stride, keep_master_weight_for_test)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.group = parallel.mp_group
        self.output_size_per_partition = divide(out_features, parallel.mp, "out_features")
        self.weight = mp_parameter((out_features, in_features), Shard(0), parallel, init_method, dtype, device)
        self.bias = mp_parameter((out_features,), Shard(0), parallel, None, dtype, device) if bias else None
        self.float8 = None  # F.linear's stand-in in float8 (hybridpar.parallel.float8.convert_to_float8)

    def forward(self, x: torch.Tensor, *, copy_input: bool = True) -> torch.Tensor:
        """copy_input=False: the caller already passed x through enter_region, once for several layers
        reading the same input (wq, wk, wv), so its gradient is reduced once, not per layer."""
        if copy_input:
            x = enter_region(x, self.group, self.sequence_parallel)
        y = (self.float8 or F.linear)(x, local_tensor(self.weight), local_tensor(self.bias))
        return gather_from_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, gather_output={self.gather_output}"
                + (", sequence_parallel" if self.sequence_parallel else "") + _float8_repr(self))


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by input columns: partial products summed across the group."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        init_method: InitMethod = nn.init.xavier_normal_,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        *,
        parallel: ParallelDims,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        _check_fairscale_options(stride, keep_master_weight_for_test)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True (the input "
                             "split on its last dim, as a column-parallel layer leaves it)")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.group = parallel.mp_group
        self.input_size_per_partition = divide(in_features, parallel.mp, "in_features")
        self.weight = mp_parameter((out_features, in_features), Shard(1), parallel, init_method, dtype, device)
        self.bias = mp_parameter((out_features,), Replicate(), parallel, None, dtype, device) if bias else None
        self.float8 = None  # as ColumnParallelLinear's

    def forward(self, x: torch.Tensor, *, reduce: bool = True) -> torch.Tensor:
        """reduce=False: this rank's partial product, for a caller that adds others to it before one
        reduction (the mixture of experts' shared expert); only without a bias."""
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.group)
        y = (self.float8 or F.linear)(x, local_tensor(self.weight))
        if not reduce:
            if self.bias is not None:
                raise ValueError("RowParallelLinear: reduce=False leaves the bias to the caller; build it with bias=False")
            return y
        y = leave_region(y, self.group, self.sequence_parallel)
        # The bias is added once, after the sum, not on every rank's partial product.
        return y + local_tensor(self.bias) if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, input_is_parallel={self.input_is_parallel}"
                + (", sequence_parallel" if self.sequence_parallel else "") + _float8_repr(self))


class VocabParallelEmbedding(nn.Module):
    """Embedding split along the vocabulary: each rank looks up the ids in its own range."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        init_method: InitMethod = nn.init.xavier_normal_,
        *,
        parallel: ParallelDims,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        if max_norm is not None and parallel.mp > 1:
            # Every id outside a rank's range looks up its local row 0, which max_norm would rescale.
            raise ValueError("VocabParallelEmbedding: max_norm is not supported with mp > 1")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = padding_idx, max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
        self.group = parallel.mp_group
        per_rank = divide(num_embeddings, parallel.mp, "num_embeddings (vocab size)")
        self.vocab_start_index = parallel.mp_rank * per_rank
        self.vocab_end_index = self.vocab_start_index + per_rank
        # padding_idx is a global id: only the rank holding its row keeps that row's gradient at zero.
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        owned = padding_idx is not None and self.vocab_start_index <= padding_idx < self.vocab_end_index
        self._local_padding_idx = padding_idx - self.vocab_start_index if owned else None
        self.weight = mp_parameter((num_embeddings, embedding_dim), Shard(0), parallel, init_method, dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local_ids = torch.where(outside, 0, ids - self.vocab_start_index)
        out = F.embedding(
            local_ids, local_tensor(self.weight), self._local_padding_idx, self.max_norm,
            self.norm_type, self.scale_grad_by_freq, self.sparse,
        )
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_region(out, self.group, self.sequence_parallel)


class ParallelEmbedding(nn.Module):
    """Embedding split along the embedding dimension: every rank looks up every id, D/mp columns."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        init_method: InitMethod = nn.init.xavier_normal_,
        keep_master_weight_for_test: bool = False,
        *,
        parallel: ParallelDims,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        _check_fairscale_options(keep_master_weight_for_test=keep_master_weight_for_test)
        self.sequence_parallel = sequence_parallel
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = padding_idx, max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
        self.group = parallel.mp_group
        divide(embedding_dim, parallel.mp, "embedding_dim")
        self.weight = mp_parameter((num_embeddings, embedding_dim), Shard(1), parallel, init_method, dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(
            ids, local_tensor(self.weight), self.padding_idx, self.max_norm,
            self.norm_type, self.scale_grad_by_freq, self.sparse,
        )
        out = gather_from_region(out, self.group)
        return scatter_to_sequence_region(out.flatten(0, -2), self.group) if self.sequence_parallel else out


class ReplicatedHeadLinear(nn.Module):
    """The k or v projection when there are fewer kv heads than model-parallel ranks (mp > n_kv_heads).

    Every rank holds the full weight [n_heads * head_dim, in] (Replicate) and computes only the head
    its group of mp / n_heads ranks shares. Both the input and the weight enter through
    copy_to_region, so their gradients are summed over the ranks that used them: the same values as
    one process computing every head.
    """

    def __init__(
        self,
        in_features: int,
        n_heads: int,
        head_dim: int,
        init_method: InitMethod = nn.init.xavier_normal_,
        *,
        parallel: ParallelDims,
        dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device] = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        if parallel.mp % n_heads:
            raise ValueError(
                f"mp = {parallel.mp} is not a multiple of the {n_heads} heads to replicate; "
                f"choose an mp that divides or is a multiple of {n_heads}"
            )
        self.in_features, self.n_heads, self.head_dim = in_features, n_heads, head_dim
        self.group = parallel.mp_group
        self.head = parallel.mp_rank // (parallel.mp // n_heads)
        self.weight = mp_parameter((n_heads * head_dim, in_features), Replicate(), parallel, init_method, dtype, device)

    def forward(self, x: torch.Tensor, *, copy_input: bool = True) -> torch.Tensor:
        """copy_input as in ColumnParallelLinear."""
        if copy_input:
            x = enter_region(x, self.group, self.sequence_parallel)
        weight = copy_to_region(local_tensor(self.weight), self.group)
        rows = slice(self.head * self.head_dim, (self.head + 1) * self.head_dim)
        return F.linear(x, weight[rows])

    def extra_repr(self) -> str:
        return f"in={self.in_features}, heads={self.n_heads} replicated, head on this rank={self.head}"
