"""The checks a training job makes before it starts anything: before any process group, thread or
run folder exists, so that a mistake costs one line and leaves nothing behind.

    preflight(config, world_size)   # ConfigError naming the key and what to change

Every rank makes the same checks on the same config and raises the same error (ConfigError is
marked `every_rank`), so rank 0 alone prints it. `hybridpar train` calls it before the Trainer
(which calls it again when used as a library), `train --dry-run` and `doctor` use its parts.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional

from .config import Config, ConfigError
from .mesh.layout import MeshSizeError, resolve_sizes

_TOKENIZER_KINDS = "a tokenizer.model (sentencepiece, or Meta's Llama 3 tiktoken file), a Hugging Face tokenizer.json"


def preflight(config: Config, world_size: int) -> None:
    """Values, mesh sizes against the world, the model's shape, and the paths the config names."""
    check_paths(config)  # first: the model's shape reads model.params_json and checkpoint.init_from
    check_values(config, world_size)


def check_values(config: Config, world_size: int):
    """The checks that read no data: the values' ranges, the mesh, the model's shape against
    data.seq_len and parallel.mp. Returns the model's args (hybridpar.models.args.ModelArgs)."""
    config.validate()
    p = config.parallel
    try:
        resolve_sizes(world_size, p.mp, p.dp_shard, p.dp_replicate)
    except MeshSizeError as err:
        raise MeshSizeError(f"parallel.mp / parallel.dp_shard / parallel.dp_replicate at {world_size} rank(s) "
                            f"(the launcher's): {err}") from None
    return model_args(config, p.mp)


def check_paths(config: Config) -> None:
    """Every path the config names exists and is the right kind; the folders it writes can be made."""
    d, c = config.data, config.checkpoint
    sources = [("data.source", d.source)] if not d.sources else [
        (f"data.sources ({e['name']!r})", e["source"]) for e in d.sources]
    for key, path in sources + [("data.val_source", d.val_source)]:
        if path and path != "default":
            _exists(key, path)
    if d.tokenizer:
        tokenizer_file(d.tokenizer, "data.tokenizer", "or \"\" to train one on the data")
    if config.model.params_json:
        _exists("model.params_json", config.model.params_json, want_file=True)
    if c.init_from:
        _exists("checkpoint.init_from", c.init_from)
    for key, folder in (("output.run_dir", config.output.run_dir), ("checkpoint.folder", c.folder),
                        ("data.cache_dir", d.cache_dir)):
        if folder:
            writable_folder(folder, key)


def _exists(key: str, path: str, want_file: bool = False) -> None:
    where = Path(path)
    if not where.exists():
        raise ConfigError(f"{key}: {path} does not exist; correct {key}")
    if want_file and not where.is_file():
        raise ConfigError(f"{key}: {path} is a folder, not a file; give the file itself")


def tokenizer_file(path: str, key: str, otherwise: str = "") -> Path:
    """The tokenizer file `path` stands for (itself, or the tokenizer file in a folder); ConfigError
    naming `key` (a config key or a flag) and what to give instead (`otherwise`: another choice)."""
    from .data.bpe import TOKENIZER_FILES

    where = Path(path)
    hint = f"give {_TOKENIZER_KINDS}, or a folder holding one{' (' + otherwise + ')' if otherwise else ''}"
    if not where.exists():
        raise ConfigError(f"{key}: {path} does not exist; {hint}")
    if where.is_dir():
        found = next((where / name for name in TOKENIZER_FILES if (where / name).is_file()), None)
        if found is None:
            raise ConfigError(f"{key}: the folder {path} holds no {' or '.join(TOKENIZER_FILES)}; {hint}")
        return found
    return where


def writable_folder(path: str, key: str) -> None:
    """A folder hybridpar writes into: it is a folder or can be made, and may be written."""
    where = Path(path)
    if where.exists() and not where.is_dir():
        raise ConfigError(f"{key}: {path} is a file, not a folder; choose another {key}")
    existing = where
    while not existing.exists():  # the nearest existing ancestor is where the folders get made
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key}: {existing} is a file, so {path} cannot be made; choose another {key}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: no permission to write in {existing}; choose another {key}")


def world_size_from_env() -> int:
    """The job's number of ranks, from the launcher's variables (torchrun's, else Slurm's), else 1."""
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


def init_from_folder(config: Config) -> Optional[tuple[str, Path]]:
    """(kind, folder) when checkpoint.init_from is a Meta or Hugging Face folder: its shape is the
    model's, and its weights are sliced into the unsharded model before FSDP."""
    folder = config.checkpoint.init_from
    if not folder:
        return None
    from .checkpoint.convert import detect_format

    kind, path = detect_format(Path(folder))
    return (kind, path) if kind in ("meta", "hf") else None


def model_args(c: Config, mp: int, tokenizer_vocab: int = 0):
    """The model's shape for config `c` at model-parallel size mp, checked against data.seq_len and
    mp. A vocab_size of -1 (Llama 2's params.json) becomes `tokenizer_vocab` when given, else it waits
    for the tokenizer (the trainer's _fit_vocab)."""
    from hybridpar.models.args import ModelArgs

    found = init_from_folder(c)
    if found is not None:
        from .checkpoint.convert import read_args

        args = read_args(*found)
    else:
        m = c.model
        overrides = {}
        if m.vocab_size:
            overrides["vocab_size"] = m.vocab_size
        if m.n_layers:
            overrides["n_layers"] = m.n_layers
        args = (ModelArgs.from_params_json(m.params_json, **overrides) if m.params_json
                else ModelArgs.from_preset(m.preset, **overrides))
    if args.vocab_size <= 0 and tokenizer_vocab > 0:
        args = dataclasses.replace(args, vocab_size=tokenizer_vocab)
    if c.data.seq_len > args.max_seq_len:
        raise ConfigError(
            f"data.seq_len = {c.data.seq_len} is larger than the model's max_seq_len = {args.max_seq_len}: "
            "lower data.seq_len"
        )
    # Sequence parallelism splits each sequence's seq_len positions over the mp ranks.
    if c.parallel.sequence_parallel and c.data.seq_len % mp:
        raise ConfigError(
            f"data.seq_len = {c.data.seq_len} is not divisible by parallel.mp = {mp}: sequence parallelism "
            f"gives each model-parallel rank seq_len / mp positions; choose a seq_len that is a multiple of {mp}, "
            "or set parallel.sequence_parallel = false")
    if args.vocab_size > 0:
        args.check(mp)
    return args
