"""A checkpoint of any kind hybridpar reads, loaded for evaluation (as `hybridpar generate` loads it), with
its tokenizer and its training step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple, Optional

from ..config import dtypes
from ..config.options import ConfigError


class Loaded(NamedTuple):
    """A model ready to evaluate: load's result."""
    model: Any
    parallel: Any
    tokenizer: Any
    args: Any  # the model's ModelArgs
    step: Optional[int]  # the checkpoint's training step (None for Meta and Hugging Face folders)


def checkpoint_tokenizer(checkpoint: str | Path, tokenizer: Optional[str] = None) -> Path:
    """The tokenizer file to evaluate with: `tokenizer` if given; else the one a hybridpar checkpoint's
    run recorded (still there, unchanged), or the one in a Meta or Hugging Face folder."""
    from ..checkpoint.convert import detect_format, run_tokenizer
    from ..preflight import tokenizer_file

    if tokenizer:
        return tokenizer_file(tokenizer, "--tokenizer")
    kind, path = detect_format(Path(checkpoint))
    found = run_tokenizer(path) if kind == "dcp" else None
    if found is None and kind != "dcp":
        try:
            found = tokenizer_file(str(path), "--tokenizer")
        except ConfigError:
            found = None
    if found is None:
        raise ConfigError(f"{checkpoint} names no tokenizer to evaluate with: give the model's with --tokenizer "
                          "(a tokenizer.model, a tokenizer.json or their folder)")
    return Path(found)


def checkpoint_step(checkpoint: str | Path) -> Optional[int]:
    """The training step a hybridpar checkpoint was saved at; None for a Meta or Hugging Face folder."""
    from ..checkpoint.convert import detect_format

    kind, path = detect_format(Path(checkpoint))
    if kind != "dcp":
        return None
    return int(json.loads((path / "train_state.json").read_text())["step"])


def load(checkpoint: str | Path, *, tokenizer: Optional[str] = None, mp: int = 1, ep: int = 1,
         dtype: Optional[str] = None, parallel=None):
    """A Loaded (hybridpar.evaluate.backend) of `checkpoint` at model-parallel size mp (the rest of the
    world data-parallel, ep of those ranks splitting a mixture of experts' experts): the model in eval
    mode, its tokenizer, its args and step. Collective: rank 0 finds the tokenizer (said once; a
    checkpoint that is not there, refused once)."""
    from ..checkpoint.convert import load_model
    from ..data import Tokenizer, check_vocab
    from ..mesh.device import init_parallel
    from ..mesh.ranks import on_rank0

    if dtype:
        dtypes.check(dtype, "dtype")
    parallel = parallel or init_parallel(mp=mp, ep=ep)
    path = on_rank0(lambda: checkpoint_tokenizer(checkpoint, tokenizer), "find the tokenizer", error_type=ConfigError)
    tok = Tokenizer(path)
    dtype = dtype or ("bfloat16" if parallel.device.type == "cuda" else "float32")
    model, args = load_model(Path(checkpoint), parallel, dtype=dtypes.parse(dtype).torch, vocab_size=tok.vocab_size)
    check_vocab(tok.vocab_size, args.vocab_size)
    model.eval()
    return Loaded(model, parallel, tok, args, checkpoint_step(checkpoint))
