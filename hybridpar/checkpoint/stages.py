"""A rank's pipeline stage modules, seen by the checkpoint code as the one model they are parts of.

Under pipeline parallelism a rank holds one stage module, or several (Interleaved1F1B, the V
schedules), each built by hybridpar.pipeline.cutting.build_stage: its layers under their own names
(`layers.37` stays `layers.37`), the embedding on the first stage, the final norm and head on the
last. Checkpoints store the unsplit model's names, so none depends on pp:

    model = one_module(stages, optimizer)   # one module whose parameter names are the stages' together
    held(model, "layers.5.attention.wq.weight")   # does this model (a stage, or whole) hold it?
    names = gather_names(model_sd, optim_sd)   # every rank's; param groups made to name the whole model's
    own_empty_groups(optimizer, optim_sd)   # a loaded group empty where this rank's is (torch needs it)
    missing_text(names)                     # "layers 3-5, output.weight": what a set of names lacks
"""

from __future__ import annotations

import re
from typing import Iterable, Optional, Sequence, Union

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..mesh.ranks import gather_objects, mark_every_rank
from .reader import CheckpointError

Stages = Union[nn.Module, Sequence[nn.Module]]
_ADVICE = "pass every stage module this rank holds (a list), with the one optimizer over all their parameters"


class StageUnion(nn.Module):
    """The stage modules of one rank under the unsplit Transformer's names: the same submodules
    (not copies), registered as one Transformer registers them, so torch's state-dict functions
    (and FSDP2's hooks, which sit on the modules holding parameters) see one model."""

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        for stage in stages:
            if next(stage.named_parameters(recurse=False), None) is not None or \
                    next(stage.named_buffers(recurse=False), None) is not None:
                raise CheckpointError(f"a stage module ({type(stage).__name__}) holds tensors of its own, outside "
                                      "its submodules: give the stages of a hybridpar Transformer (build_stage)")
            for name, child in stage.named_children():
                if name == "layers":
                    for key, block in child.items():
                        if key in self.layers:
                            raise CheckpointError(f"layers.{key} is in two of the stage modules given: give each "
                                                  "stage once")
                        self.layers[key] = block
                elif name in self._modules:
                    raise CheckpointError(f"{name} is in two of the stage modules given: give each stage once")
                else:
                    self.add_module(name, child)
        self.args = getattr(stages[0], "args", None)


def one_module(model: Stages, optimizer: Optional[torch.optim.Optimizer] = None) -> nn.Module:
    """`model` as the one module the checkpoint code saves and loads: a module as it is, a list of
    stage modules (one per stage this rank holds) as their StageUnion. The optimizer must hold
    parameters of these modules only (else CheckpointError saying what to pass)."""
    if isinstance(model, (list, tuple)):
        if not model:
            raise CheckpointError(f"no model given to the checkpoint: {_ADVICE}")
        model = model[0] if len(model) == 1 else StageUnion(model)
    if optimizer is not None:
        # A forward without backward (validation) leaves FSDP's root unit gathered, its registered
        # parameters the unsharded ones: back to the shards the optimizer holds (and DCP saves).
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        own = {id(p) for p in model.parameters()}
        strays = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
        if strays:
            raise CheckpointError(f"the optimizer holds {strays} parameters that are in none of the modules given "
                                  f"to the checkpoint: {_ADVICE}")
    return model


def held(model: nn.Module, name: str) -> bool:
    """Does `model` (a Transformer, or a stage of one) hold parameter `name` of the unsplit model?
    Whole units count: `layers.N` and the top-level modules (tok_embeddings, norm, output)."""
    parts = name.split(".")
    module: Optional[nn.Module] = model
    for part in parts[:2] if parts[0] == "layers" else parts[:1]:
        module = getattr(module, part, None)
        if module is None:
            return False
    return True


def gather_names(model_sd: dict, optim_sd: Optional[dict]) -> set[str]:
    """The model names of every rank's `model_sd` together; and, when `optim_sd` is given, each of
    its param groups made (in place) to name that group's parameters on every rank, in rank order.

    DCP stores a value every rank holds once (one rank's copy). Under pp each rank's groups name
    only its stages' parameters, so a load would find its own names in none of the stored groups and
    lose their hyperparameters (lr, betas, weight decay). Collective: one all-gather of names."""
    groups = None if optim_sd is None else [list(group["params"]) for group in optim_sd["param_groups"]]
    every = gather_objects((list(model_sd), groups))
    if groups is not None:
        counts = sorted({len(g) for _, g in every})
        if len(counts) > 1:
            raise mark_every_rank(CheckpointError(
                f"the optimizers of the ranks have different numbers of param groups ({counts}): build the same "
                "optimizer on every rank"))
        for i, group in enumerate(optim_sd["param_groups"]):
            group["params"] = list(dict.fromkeys(name for _, g in every for name in g[i]))
    return {name for names, _ in every for name in names}


def own_empty_groups(optimizer: torch.optim.Optimizer, optim_sd: dict) -> dict:
    """The loaded optimizer state `optim_sd` with each param group this rank's optimizer holds no
    parameter of naming none either (in place; returned). A stage can lack a group's parameters (the
    first stage holding the embedding alone has no norm), and torch's set_optimizer_state_dict maps
    an empty group only to a stored group that is empty too; the stored one names other stages'."""
    for mine, stored in zip(optimizer.param_groups, optim_sd["param_groups"]):
        if not mine["params"]:
            stored["params"] = []
    return optim_sd


_LAYER = re.compile(r"^layers\.(\d+)\.")


def missing_text(names: Iterable[str]) -> str:
    """Parameter names as a person reads them: the layers they fall in as ranges ("layers 3-5"),
    the other names as they are."""
    names = sorted(set(names))
    layers = sorted({int(m.group(1)) for n in names if (m := _LAYER.match(n))})
    ranges: list[str] = []
    for i in layers:
        if ranges and ranges[-1][1] == i - 1:
            ranges[-1] = (ranges[-1][0], i)
        else:
            ranges.append((i, i))
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in ranges]
    others = [n for n in names if not _LAYER.match(n)]
    text = (f"layer{'s' if len(layers) > 1 else ''} {', '.join(parts)}" if parts else "")
    return ", ".join(filter(None, [text, *others]))
