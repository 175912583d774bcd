"""Foreign checkpoint formats (Meta's consolidated files, Hugging Face folders) behind one interface.

In: a format's adapter opens and checks a folder into a ForeignSource: its ModelArgs (which fix every
tensor's name and full shape: model_shapes) and a block of a named tensor in hybridpar.models.llama's layout.
load_foreign checks a model against any source and plans every rank's blocks before copying one,
each rank reading only its own (a pipeline stage: only its own layers and ends). Out: a
ForeignTarget says what file j holds of a parameter and how a file is written; export_foreign
stages, gathers and completes the folder.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path
from typing import Mapping, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hybridpar.models.llama import ModelArgs

from ..files import OCCUPIED_ADVICE, begin_staging, commit_staged, refuse_occupied, staging_path
from ..parallel.state import block, gather_to, local_box
from ..progress import Progress
from ..mesh.ranks import gather_objects, on_rank0, raise_if_any_failed, rank_and_world
from .stages import held

# Fields that change the numbers but not the shapes: a model built with other values would load
# without a shape error and compute something else, so the loader compares them.
BEHAVIOUR_FIELDS = ("norm_eps", "rope_theta", "rope_scaling", "experts_per_token", "nope_layers",
                    "attn_temperature_tuning", "floor_scale", "attn_scale", "use_qk_norm", "attention_chunk_size")


class ForeignCheckpointError(ValueError):
    """A foreign checkpoint (or a model for one) that cannot be read, loaded or written; per format a subclass."""


def model_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter of hybridpar.models.llama's Transformer of `args` (Meta's names), with its full shape; a
    tied model has no output head."""
    d, q, kv, hidden = args.dim, args.n_heads * args.head_dim, args.kv_heads * args.head_dim, args.ffn_hidden_dim
    e, f = args.n_experts, args.expert_hidden_dim
    shapes = {"tok_embeddings.weight": (args.vocab_size, d)}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attention.wq.weight": (q, d), p + "attention.wk.weight": (kv, d),
            p + "attention.wv.weight": (kv, d), p + "attention.wo.weight": (d, q),
        })
        if args.is_moe_layer(i):  # models.moe's: the router, the stacked experts, the shared expert
            shapes.update({
                p + "feed_forward.router.weight": (e, d), p + "feed_forward.experts.w1": (e, f, d),
                p + "feed_forward.experts.w2": (e, d, f), p + "feed_forward.experts.w3": (e, f, d),
                p + "feed_forward.shared_expert.w1.weight": (f, d), p + "feed_forward.shared_expert.w2.weight": (d, f),
                p + "feed_forward.shared_expert.w3.weight": (f, d),
            })
        else:
            shapes.update({p + "feed_forward.w1.weight": (hidden, d), p + "feed_forward.w2.weight": (d, hidden),
                           p + "feed_forward.w3.weight": (hidden, d)})
        shapes.update({p + "attention_norm.weight": (d,), p + "ffn_norm.weight": (d,)})
    shapes["norm.weight"] = (d,)
    if not args.tie_embeddings:
        shapes["output.weight"] = (args.vocab_size, d)
    return shapes


def natural(key: str) -> list:
    """Sort key putting layers.2 before layers.10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


class ForeignSource:
    """An opened, checked folder. `config`: the file its fields come from; `reader`: the call giving a
    matching model's ModelArgs (named in the advice); `tied_by`: where tie_embeddings comes from."""

    error: type[ForeignCheckpointError] = ForeignCheckpointError

    def __init__(self, folder: Path, args: ModelArgs, config: Path, reader: str, tied_by: str) -> None:
        self.folder, self.args, self.config, self.reader, self.tied_by = folder, args, config, reader, tied_by

    def tie_mismatch(self, model_tied: bool) -> str:
        tied = self.args.tie_embeddings
        return (f"the checkpoint in {self.folder} has tie_embeddings = {tied} (from {self.tied_by}), the model "
                f"tie_embeddings = {model_tied}: build the model with tie_embeddings = {tied}, from {self.reader}")

    def check_block(self, name: str, offset: Sequence[int], shape: Sequence[int]) -> None:
        """Refuse (self.error) a block of `name` this source cannot give; any block by default."""

    def read_into(self, name: str, offset: Sequence[int], out: torch.Tensor) -> None:
        """Copy block [offset, offset + out.shape) of tensor `name` (hybridpar.models.llama's layout) into `out`."""
        raise NotImplementedError


def check_model(source: ForeignSource, model: nn.Module) -> None:
    """The model ties its embeddings as the checkpoint does, and computes with its norm_eps and RoPE."""
    args, model_args = source.args, getattr(model, "args", None)
    if not isinstance(model_args, ModelArgs):
        return
    if model_args.tie_embeddings != args.tie_embeddings:
        raise source.error(source.tie_mismatch(model_args.tie_embeddings))
    differ = [f for f in BEHAVIOUR_FIELDS if getattr(model_args, f) != getattr(args, f)]
    if differ:
        detail = ", ".join(f"{f} = {getattr(args, f)!r} (model: {getattr(model_args, f)!r})" for f in differ)
        raise source.error(f"{source.config} has {detail}: build the model from {source.reader}")


def _plan(source: ForeignSource, model: nn.Module) -> list[tuple[str, torch.Tensor, tuple[int, ...]]]:
    """(name, local tensor, offset) for every parameter of the model, all checked. A pipeline stage
    (pipeline.cutting.build_stage) is checked against, and later reads, its own layers and ends only."""
    own, error = model.state_dict(), source.error
    shapes = {name: shape for name, shape in model_shapes(source.args).items() if held(model, name)}
    missing, unexpected = sorted(set(shapes) - set(own), key=natural), sorted(set(own) - set(shapes), key=natural)
    if missing or unexpected:
        raise error(
            f"the model does not match the checkpoint in {source.folder} (n_layers = {source.args.n_layers}): "
            f"checkpoint keys the model lacks {missing[:8]}, model keys the checkpoint lacks {unexpected[:8]}; "
            f"build the model from {source.reader}"
        )
    plan = []
    for name, target in own.items():
        if tuple(target.shape) != shapes[name]:
            raise error(f"{name}: the model's full shape is {list(target.shape)}, the checkpoint in {source.folder} "
                        f"holds {list(shapes[name])}; build the model from {source.reader}")
        local = target.to_local() if isinstance(target, DTensor) else target
        if local.device.type == "meta":
            raise error(f"{name} is on the meta device: allocate the model first (model.to_empty(device=...))")
        offset, shape = local_box(target, name, error)
        if tuple(local.shape) != tuple(shape):
            raise error(f"{name}: local shard {list(local.shape)} is not the block {list(shape)} its placement "
                        "implies; load before apply_fsdp")
        source.check_block(name, offset, shape)
        plan.append((name, local, offset))
    return plan


@torch.no_grad()
def load_foreign(source: ForeignSource, model: nn.Module) -> ModelArgs:
    """Fill `model` (a hybridpar.models.llama.Transformer at any mp, before FSDP) from `source`. Collective: one
    flag after the checks of each rank's blocks. Returns the source's ModelArgs."""
    check_model(source, model)
    plan, failed = [], None
    try:
        plan = _plan(source, model)
    except ForeignCheckpointError as err:
        failed = err
    raise_if_any_failed(failed, f"load {source.folder}", error_type=source.error)
    with Progress(f"loading {source.folder.name}", total=sum(t.nbytes for _, t, _ in plan), unit="B") as progress:
        for name, local, offset in plan:
            source.read_into(name, offset, local)
            progress.update(local.nbytes)
    return source.args


# --- the way out ------------------------------------------------------------------------------------


def refuse_target(folder: Path, overwrite: bool, error_type: type[Exception] = FileExistsError) -> None:
    """An export's folder must not exist, unless overwrite (then it is replaced once complete)."""
    advice = "choose a new folder" if overwrite else OCCUPIED_ADVICE
    refuse_occupied(folder, advice, error_type=error_type, overwrite=overwrite, empty_ok=False)


def model_args(model: nn.Module, error: type[Exception], what: str) -> ModelArgs:
    args = getattr(model, "args", None)
    if not isinstance(args, ModelArgs):
        raise error(f"{what} needs a hybridpar.models.llama.Transformer (a model with .args)")
    return args


class ForeignTarget:
    """A format's writer of `n_files` files, file j by rank j % world size; `dtype` None: the parameters'.
    extra_files: {name: file} copied into the folder as they are (the tokenizer's)."""

    error: type[ForeignCheckpointError] = ForeignCheckpointError

    def __init__(self, args: ModelArgs, n_files: int, dtype: Optional[torch.dtype],
                 extra_files: Optional[Mapping[str, Path]] = None) -> None:
        self.args, self.n_files, self.dtype = args, n_files, dtype
        self.extra_files = dict(extra_files or {})

    def copy_extra_files(self, staged: Path) -> None:
        for name, source in self.extra_files.items():
            shutil.copyfile(source, staged / name)

    def begin(self, folder: Path, overwrite: bool) -> None:
        """Rank 0, before any gather: refuse what cannot be written (an occupied folder)."""
        refuse_target(folder, overwrite, self.error)

    def order(self) -> list[str]:
        """The parameters (hybridpar.models.llama's names) in the order every rank gathers them."""
        return list(model_shapes(self.args))

    def last_piece(self, j: int) -> str:
        """The parameter after whose gather file j has all its pieces and is written (freed)."""
        return self.order()[-1]

    def owner(self, name: str) -> Optional[int]:
        """The one file holding parameter `name` (then only its writer receives it whole), or None
        when several files hold pieces of it (then every rank gathers it: DTensor.full_tensor)."""
        return None

    def pieces(self, name: str, full: torch.Tensor, j: int) -> dict[str, torch.Tensor]:
        """{stored name: tensor} that file j holds of parameter `name` (hybridpar.models.llama's), given whole."""
        raise NotImplementedError

    def write_file(self, staged: Path, j: int, tensors: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def finish(self, staged: Path) -> None:
        """Rank 0, once every file is written: what completes the folder (its config files)."""


def _check_state(target: ForeignTarget, state: Mapping[str, torch.Tensor]) -> None:
    """The model holds exactly the parameters of target.args, at their full shapes. Every rank holds
    the same model, so every rank raises alike, before any gather or write."""
    args, shapes = target.args, model_shapes(target.args)
    unexpected = [name for name in state if name not in shapes]
    if unexpected:
        problem = f"{unexpected[0]} is not a parameter of Meta's Llama format (tie_embeddings = {args.tie_embeddings})"
    else:
        wrong = [name for name, tensor in state.items() if tuple(tensor.shape) != shapes[name]]
        lacking = [name for name in shapes if name not in state]
        problem = (f"{wrong[0]} has shape {list(state[wrong[0]].shape)}, its ModelArgs imply {list(shapes[wrong[0]])}"
                   if wrong else f"the model has no {lacking[0]} (tie_embeddings = {args.tie_embeddings})"
                   if lacking else None)
    if problem:
        raise target.error(f"{problem}: save a hybridpar.models.llama.Transformer built from its own ModelArgs")


def write_files(target: ForeignTarget, state: Mapping[str, torch.Tensor], staged: Path, mine: Sequence[int]) -> None:
    """Write files `mine` of `state` (full tensors, or DTensors: then collective, every rank calling
    with the same state) into `staged`. Every parameter is gathered in target.order(), to its one
    writer when it has one (target.owner), each rank keeping only its files' pieces and writing each
    file once its last piece is in: a rank holds the files it is filling and one gathered parameter."""
    _check_state(target, state)
    order, world = target.order(), rank_and_world()[1]
    owners = {name: target.owner(name) for name in order if isinstance(state[name], DTensor)}
    # Where every rank's block lies, exchanged once: a writer needs them to place what it receives.
    sent = {name: block(state[name]) for name, j in owners.items() if j is not None}
    blocks = gather_objects(sent) if sent else []  # (plain tensors: no collective at all)
    last = {j: target.last_piece(j) for j in mine}
    filling: dict[int, dict[str, torch.Tensor]] = {j: {} for j in mine}
    written = {name: math.prod(state[name].shape) * (target.dtype or state[name].dtype).itemsize for name in order}
    failed: Optional[Exception] = None
    with torch.no_grad(), Progress(f"writing {staged}", total=sum(written.values()), unit="B",
                                   every=20.0) as progress:
        for name in order:
            tensor = state[name]
            if target.dtype is not None:  # cast before the gather: the same numbers, fewer bytes sent and held
                tensor = tensor.to(target.dtype)
            if not isinstance(tensor, DTensor):
                full = tensor
            elif owners[name] is None:
                full = tensor.full_tensor()
            else:
                full = gather_to(tensor, owners[name] % world, [b[name] for b in blocks])
            for j in list(filling) if full is not None and failed is None else []:  # the files not yet written
                filling[j].update(target.pieces(name, full, j))
                if last[j] == name:
                    try:
                        target.write_file(staged, j, filling.pop(j))  # its tensors freed once written
                    except Exception as err:  # noqa: BLE001 - raised after the last gather: the others wait in them
                        failed = err
                        filling.clear()
                        break
            del full, tensor
            progress.update(written[name])
    if failed is not None:
        raise failed


def export_foreign(target: ForeignTarget, model: nn.Module, folder: Path, overwrite: bool) -> Path:
    """Write `model` (plain or FSDP2-wrapped) through `target`; collective, every rank returns or raises.
    Written into `<folder>.partial`, renamed once complete (removed if any rank failed)."""

    def begin() -> Path:
        target.begin(folder, overwrite)
        return begin_staging(folder)

    staged = on_rank0(begin, f"prepare {staging_path(folder)}", error_type=target.error)
    try:
        error: Optional[Exception] = None
        try:
            rank, world = rank_and_world()
            write_files(target, model.state_dict(), staged, [j for j in range(target.n_files) if j % world == rank])
        except Exception as err:  # noqa: BLE001 - every rank raises below, not only this one
            error = err
        raise_if_any_failed(error, f"write {folder}", error_type=target.error)
        # overwrite: the old folder goes only once the new one is in place
        on_rank0(lambda: (target.finish(staged), commit_staged(staged, folder)), f"complete {folder}",
                 error_type=target.error)
    except BaseException:
        if rank_and_world()[0] == 0:  # every rank is past its writes: all raise together above
            shutil.rmtree(staged, ignore_errors=True)
        raise
    return folder
