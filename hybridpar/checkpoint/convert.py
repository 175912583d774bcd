"""Between formats: hybridpar (DCP) checkpoints, Meta consolidated folders, Hugging Face export.

    hybridpar convert SRC DST --to {dcp,meta,hf} [--mp N]

The source format is detected from the folder's files. The model is built at the job's model-
parallel size (1 without a launcher) and the weights resharded on the way in, so any source MP
converts to any target MP.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import torch

from models.llama import ModelArgs, Transformer

from ..mesh import ParallelDims
from .dcp import Checkpointer, CheckpointError, latest_checkpoint, params_dict

FORMATS = ("dcp", "meta", "hf")


def detect_format(path: Path) -> tuple[str, Path]:
    """('dcp', checkpoint folder) or ('meta', folder); a run's checkpoint folder means its newest checkpoint."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if (path / ".metadata").exists() and (path / "params.json").exists():
        return "dcp", path
    latest = latest_checkpoint(path)
    if latest is not None:
        return "dcp", latest
    if (path / "params.json").exists() and any(path.glob("consolidated.*.pth")):
        return "meta", path
    raise CheckpointError(
        f"{path} is neither a hybridpar checkpoint (.metadata + params.json, or a folder of step-* checkpoints) "
        "nor a Meta consolidated folder (params.json + consolidated.NN.pth)"
    )


def load_model(path: Path, parallel: ParallelDims, *, dtype: Optional[torch.dtype] = None,
               vocab_size: Optional[int] = None) -> tuple[Transformer, ModelArgs]:
    """A Transformer at this job's mp holding the weights of checkpoint `path` (either format).

    vocab_size fills in Llama 2's -1 (the tokenizer decides) when the checkpoint cannot tell.
    """
    kind, path = detect_format(path)
    if kind == "meta":
        from .meta import load_meta_checkpoint, read_meta_params

        args = read_meta_params(path)
    else:
        args = ModelArgs.from_dict(json.loads((path / "params.json").read_text()))
    if args.vocab_size <= 0 and vocab_size:
        args = dataclasses.replace(args, vocab_size=vocab_size)
    # Built without memory, then allocated once: the checkpoint overwrites every weight anyway.
    with torch.device("meta"):
        model = Transformer(args, parallel, dtype=dtype)
    model.to_empty(device=parallel.device)
    if kind == "meta":
        load_meta_checkpoint(path, model, parallel)
    else:
        Checkpointer(path.parent, parallel).load(path, model, None, params_dict(args))
    return model, args


def convert(src: Path, dst: Path, to: str, parallel: ParallelDims, mp_out: Optional[int] = None) -> Path:
    """Write the weights of `src` to `dst` in format `to`; returns what was written."""
    if to not in FORMATS:
        raise ValueError(f"--to must be one of {FORMATS}, got {to!r}")
    model, args = load_model(src, parallel)
    dst = Path(dst)
    if to == "meta":
        from .meta import save_meta_checkpoint

        save_meta_checkpoint(model, dst, parallel, mp_out or parallel.mp)
        return dst
    if mp_out is not None:
        raise ValueError("--mp applies to --to meta only: dcp and hf checkpoints load at any model-parallel size")
    if to == "hf":
        from .hf import export_hf

        export_hf(model, dst, parallel)
        return dst
    # A weights-only hybridpar checkpoint (step 0): start training from it with checkpoint.init_from.
    return Checkpointer(dst, parallel).save(0, model, None, {}, params_dict(args))
