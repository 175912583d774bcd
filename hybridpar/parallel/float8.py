"""Float8 matmuls in the tensor-parallel linears, through torchao: its recipes, casts, scales and
float8 matmul (emulated in fp32 off CUDA); no float8 kernel of hybridpar's own.

    names = convert_to_float8(model, parallel, config.float8, device=parallel.device)

sets each ColumnParallelLinear's and RowParallelLinear's `float8` (a Float8Matmul, which the layer
calls instead of F.linear) unless float8.skip names it or its slice has a dimension that is not a
multiple of 16. The parameters stay as they are: master weights, optimizer state and checkpoints
hold no float8 tensor.

A linear's three matmuls cast six tensors (torchao's Float8LinearConfig: input, weight and
grad_output, each for two matmuls), each scaled by the amax of the tensor (tensorwise) or of each
row or column (axiswise, along one dimension). A rank holds a slice of some of them, so an amax
taken along a split dimension is reduced (MAX) over the group that splits it, and every scale is
the one of the unsplit tensor: float8 at any layout computes what it computes at world 1.

    the tensors, 2-D      tokens    in       out
    input    [tokens, in]   cp       row: mp
    weight.t [in, out]               row: mp  column: mp
    grad_out [tokens, out]  cp                column: mp

(Sequence parallelism gathers the tokens before a column-parallel linear and scatters them after a
row-parallel one: inside the linear they are whole over mp. Context parallelism gives each rank
part of every sequence's tokens.)

No amax is reduced twice: the backward takes the amaxes the forward reduced where they give its
casts' (tensorwise: the input's and the weight's; rowwise_with_gw_hp: its tensorwise weight cast,
the max of the forward's per-column amaxes), tensorwise's two casts of the output gradient share
one, and the amaxes one pass of a linear reduces over one group go in one all-reduce
(tests/parallel/test_float8_collectives.py counts them per block).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..config.low_precision import MULTIPLE, Float8Config, names_skipped
from ..mesh.device import ParallelDims
from .layers import ColumnParallelLinear, RowParallelLinear, local_tensor

# Each cast of torchao's config: (the tensor it casts, the dimension an axiswise amax is taken along).
_CASTS = {
    "cast_config_input": ("input", -1),
    "cast_config_weight": ("weight", 0),
    "cast_config_grad_output": ("grad_output", -1),
    "cast_config_weight_for_grad_input": ("weight", -1),
    "cast_config_grad_output_for_grad_weight": ("grad_output", 0),
    "cast_config_input_for_grad_weight": ("input", 0),
}
_AXES = {"input": ("tokens", "in"), "weight": ("in", "out"), "grad_output": ("tokens", "out")}


def torchao_float8():
    """torchao.float8, imported quietly: off CUDA torchao logs a warning for each kernel library it
    cannot load, and torch one for an enum torchao registers; neither touches float8 training."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8
        import torchao.float8.float8_training_tensor
        import torchao.float8.float8_utils
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return torchao.float8


def recipe_config(recipe: str, *, emulate: bool):
    """torchao's Float8LinearConfig of `recipe` (a float8.recipe other than "none"); emulate: its
    float8 matmuls in fp32, off CUDA."""
    config = torchao_float8().Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate)


@dataclasses.dataclass(frozen=True)
class _Cast:
    config: object  # torchao's CastConfig
    role: object  # its GemmInputRole
    dim: Optional[int]  # the axiswise amax's dimension; None: tensorwise
    groups: tuple  # the process groups the amax is reduced over

    def follows(self, earlier: "_Cast") -> bool:
        """Its amax follows from `earlier`'s reduced amax of the same tensor: along the same axis it
        is that amax; a tensorwise one is the max of its rows' (or columns') maxima."""
        return self.dim == earlier.dim or self.dim is None

    def amax_from(self, earlier: "_Cast", amax: torch.Tensor) -> tuple:
        """(its amax, the groups still to reduce it over: the other axis's) from `earlier`'s (follows)."""
        if self.dim == earlier.dim:
            return amax, ()
        return amax.amax(), tuple(g for g in self.groups if not any(g is e for e in earlier.groups))


@dataclasses.dataclass(frozen=True, eq=False)
class Float8Matmul:
    """One linear's float8 matmul: torchao's config of the recipe, and for each of its casts the
    groups its amax is reduced over. Called as F.linear: (x, weight, bias=None)."""

    recipe: str
    config: object  # torchao's Float8LinearConfig
    mm_config: object  # torchao's LinearMMConfig
    casts: dict  # a _CASTS name -> _Cast, None where the recipe keeps that tensor in high precision

    @classmethod
    def of(cls, recipe: str, splits: dict, *, emulate: bool) -> "Float8Matmul":
        """splits: "tokens", "in", "out" -> the process groups splitting that dimension of the layer."""
        ao = torchao_float8()
        training = ao.float8_training_tensor
        config = recipe_config(recipe, emulate=emulate)
        mm = training.LinearMMConfig(*(training.ScaledMMConfig(emulate, gemm.use_fast_accum, False, config.pad_inner_dim)
                                       for gemm in (config.gemm_config_output, config.gemm_config_grad_input,
                                                    config.gemm_config_grad_weight)))
        roles = {"input": training.GemmInputRole.INPUT, "weight": training.GemmInputRole.WEIGHT,
                 "grad_output": training.GemmInputRole.GRAD_OUTPUT}
        casts = {}
        for name, (tensor, dim) in _CASTS.items():
            cast = getattr(config, name)
            if cast.scaling_type is ao.config.ScalingType.DISABLED:
                casts[name] = None
                continue
            axiswise = cast.scaling_granularity is ao.config.ScalingGranularity.AXISWISE
            # An axiswise amax runs along one dimension; a tensorwise one along both.
            along = [_AXES[tensor][dim]] if axiswise else _AXES[tensor]
            groups = tuple(g for axis in along for g in splits.get(axis, ()))
            casts[name] = _Cast(cast, roles[tensor], dim if axiswise else None, groups)
        return cls(recipe, config, mm, casts)

    @property
    def reused(self) -> tuple:
        """The tensors ("input", "weight") whose forward amax a backward cast takes (_Cast.follows)."""
        ahead = {"input": "cast_config_input", "weight": "cast_config_weight"}
        return tuple(tensor for tensor, first in ahead.items() if self.casts[first] is not None and any(
            _CASTS[name][0] == tensor and cast is not None and cast.follows(self.casts[first])
            for name, cast in self.casts.items() if name != first))

    def cast(self, tensors: dict, known: Optional[dict] = None) -> dict:
        """The tensors of one pass ({cast name: tensor}) cast as torchao's casts of those names
        (Float8TrainingTensors; a tensor as it is where the recipe keeps it in high precision or it
        is float8 already), each amax that of the unsplit tensor: from `known` ({tensor: (_Cast,
        reduced amax)} of an earlier pass) or a cast of the same tensor before it in this pass where
        it follows (_Cast.follows), else taken here and reduced, this pass's amaxes over one group
        in one all-reduce. Adds this pass's reduced amaxes to `known`."""
        # torchao is imported by now (Float8Matmul.of): no logger to quieten inside torch.compile's trace
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

        known = {} if known is None else known
        amaxes, groups, same = {}, {}, {}
        for name, t in tensors.items():
            cast, tensor = self.casts[name], _CASTS[name][0]
            # float8 already: FSDP gathered the weight in float8 with the whole weight's tensorwise
            # scale (float8.fsdp_all_gather): the same cast
            if cast is None or isinstance(t, Float8TrainingTensor):
                continue
            twin = next((n for n in amaxes if _CASTS[n][0] == tensor and self.casts[n].dim == cast.dim), None)
            if twin is not None:  # this pass casts the tensor twice alike (tensorwise's output gradient)
                same[name] = twin
                continue
            earlier = known.get(tensor)
            taken = cast.amax_from(*earlier) if earlier is not None and cast.follows(earlier[0]) else None
            amaxes[name], groups[name] = taken or (tensor_to_amax(
                t, scaling_granularity=cast.config.scaling_granularity, axiswise_dim=cast.dim), cast.groups)
        amaxes = _reduced(amaxes, groups)
        amaxes.update({name: amaxes[twin] for name, twin in same.items()})
        out = {}
        for name, t in tensors.items():
            if name not in amaxes:
                out[name] = t
                continue
            cast = self.casts[name]
            known[_CASTS[name][0]] = (cast, amaxes[name])
            scale = amax_to_scale(amaxes[name], cast.config.target_dtype, self.config.round_scales_to_power_of_2)
            out[name] = hp_tensor_and_scale_to_float8(t, scale, cast.config.target_dtype, self.mm_config, cast.role,
                                                      cast.dim)
        return out

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = _Float8Linear.apply(x, weight.t(), self)
        return y if bias is None else y + bias.to(y.dtype)


def _reduced(amaxes: dict, groups: dict) -> dict:
    """amaxes ({name: tensor}) each reduced (MAX) over its groups ({name: process groups}): one
    all-reduce per group of the amaxes it reduces, flattened into one buffer (MAX is elementwise:
    exact), the groups in the order they first appear."""
    amaxes = {name: a.float() if groups[name] else a for name, a in amaxes.items()}  # exact; gloo reduces no bfloat16
    order = []
    for name in amaxes:
        order += [g for g in groups[name] if not any(g is o for o in order)]
    for group in order:
        names = [name for name in amaxes if any(g is group for g in groups[name])]
        buffer = torch.cat([amaxes[name].reshape(-1) for name in names])  # a fresh tensor: reduced in place
        dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=group)
        for name, part in zip(names, buffer.split([amaxes[name].numel() for name in names])):
            amaxes[name] = part.reshape(amaxes[name].shape)
    return amaxes


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _Float8Linear(torch.autograd.Function):
    """y = x @ weight_t through `plan`'s casts: torchao's three float8 matmuls of a linear. As
    torchao's matmul_with_hp_or_float8_args it keeps the input and weight in high precision for the
    backward, which casts them again; the amaxes of those the forward reduced (a scalar each,
    tensorwise; rowwise a row, of which only rowwise_with_gw_hp's weight is read) are kept too, so
    the backward reduces none of them again."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight_t: torch.Tensor, plan: Float8Matmul) -> torch.Tensor:
        known = {}
        cast = plan.cast({"cast_config_input": _rows(x), "cast_config_weight": weight_t}, known)
        kept = [known[tensor][1] if tensor in known and tensor in plan.reused else None for tensor in ("input", "weight")]
        ctx.save_for_backward(x, weight_t, *kept)
        ctx.plan = plan
        y = torch.mm(cast["cast_config_input"], cast["cast_config_weight"])
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight_t, x_amax, weight_amax = ctx.saved_tensors
        plan = ctx.plan
        known = {tensor: (plan.casts[name], amax) for tensor, name, amax in
                 (("input", "cast_config_input", x_amax), ("weight", "cast_config_weight", weight_amax))
                 if amax is not None}
        g, xs = _rows(grad), _rows(x)
        cast = plan.cast({"cast_config_grad_output": g, "cast_config_weight_for_grad_input": weight_t,
                          "cast_config_grad_output_for_grad_weight": g, "cast_config_input_for_grad_weight": xs}, known)
        grad_x = torch.mm(cast["cast_config_grad_output"], cast["cast_config_weight_for_grad_input"].t())
        grad_w = torch.mm(cast["cast_config_grad_output_for_grad_weight"].t(), cast["cast_config_input_for_grad_weight"])
        return grad_x.reshape(*x.shape[:-1], grad_x.shape[-1]), grad_w.t(), None


def layer_splits(layer: nn.Module, parallel: ParallelDims) -> dict:
    """Which process groups split each dimension of `layer`'s matmul (the module's table)."""
    mp = (parallel.mp_group,) if parallel.mp > 1 else ()
    splits = {"tokens": (parallel.cp_group,) if parallel.cp > 1 else ()}
    splits["out" if isinstance(layer, ColumnParallelLinear) else "in"] = mp
    return splits


def skipped(name: str, layer: nn.Module, patterns) -> bool:
    """float8.skip names the layer (a pattern matching its name or the end of it), or its slice's
    dimensions are not multiples of 16."""
    if names_skipped(name, patterns):
        return True
    return any(n % MULTIPLE for n in local_tensor(layer.weight).shape)


def convert_to_float8(model: nn.Module, parallel: ParallelDims, config: Float8Config, *,
                      device: Optional[torch.device] = None) -> list[str]:
    """Give each Column/RowParallelLinear of `model` not skipped its Float8Matmul of config.recipe
    (emulated unless `device`, else parallel.device, is a CUDA device); returns their names."""
    if not config.enabled:
        return []
    emulate = torch.device(device if device is not None else parallel.device).type != "cuda"
    names = []
    for name, layer in model.named_modules():
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)) and not skipped(name, layer, config.skip):
            layer.float8 = Float8Matmul.of(config.recipe, layer_splits(layer, parallel), emulate=emulate)
            names.append(name)
    return names


def emulated_note(device: torch.device) -> Optional[str]:
    """The line a run on `device` says once when float8 is emulated there, else None."""
    if torch.device(device).type == "cuda":
        return None
    return (f"float8: no CUDA device here ({torch.device(device).type}), so torchao emulates the float8 matmuls "
            "in fp32: float8's numbers, slower than bf16")


def experts_note(n_experts: int) -> Optional[str]:
    """The line a run with float8 says once when its model has routed experts (which no float8
    matmul runs: they are grouped GEMMs, not linears), else None."""
    if not n_experts:
        return None
    return (f"float8: the {n_experts} routed experts and their router stay in high precision (fsdp.param_dtype); "
            "float8 runs in the linears of attention, the shared experts and the dense feed-forward layers")
