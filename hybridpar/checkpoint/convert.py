"""Between formats: hybridpar (DCP) checkpoints, Meta consolidated folders, Hugging Face folders.

    hybridpar convert SRC DST --to {dcp,meta,hf} [--mp N] [--meta-files N] [--overwrite]
                      [--tokenizer PATH | --bos-id N --eos-id N] [--max-seq-len N]
                      [--dtype float32|bfloat16|float16] [--max-shard-size 5GB]

The source format is detected from the folder's files. The model is built at model-parallel size
`--mp` (default 1; more under torchrun spreads the work) and the weights resharded on the way
in, so any source MP converts to any target MP (`--meta-files N`: Meta's files for mp N).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional, Union

import torch

from hybridpar.models.args import ModelArgs
from hybridpar.models.llama import Transformer

from ..files import OCCUPIED_ADVICE, begin_staging, commit_staged, refuse_occupied, staging_path
from ..mesh.device import ParallelDims
from ..build import build_model
from ..mesh.ranks import on_rank0
from .dcp import Checkpointer, CheckpointError, latest_checkpoint, params_dict
from .hf_shards import DEFAULT_MAX_SHARD_SIZE, parse_shard_size

FORMATS = ("dcp", "meta", "hf")


def detect_format(path: Path) -> tuple[str, Path]:
    """('dcp', checkpoint folder), ('meta', folder) or ('hf', folder); a run's checkpoint folder means
    its newest checkpoint."""
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
    from .hf_read import is_hf_folder

    if is_hf_folder(path):
        return "hf", path
    raise CheckpointError(
        f"{path} is neither a hybridpar checkpoint (.metadata + params.json, or a folder of step-* checkpoints), "
        "a Meta consolidated folder (params.json + consolidated.NN.pth) nor a Hugging Face folder "
        "(config.json + model.safetensors, or model.safetensors.index.json and its shards)"
    )


def read_config(kind: str, path: Path) -> Optional[dict]:
    """The JSON a Meta ({"params.json", "hybridpar.json"}) or Hugging Face ({"config.json"}) folder
    describes its model with, read once: read_args and load_into take it instead of reading again
    (a job's every rank reads it, on a shared file system). None for a hybridpar checkpoint."""
    if kind == "meta":
        from .meta_read import read_meta_json

        return read_meta_json(path)
    if kind == "hf":
        from .hf_read import CONFIG_JSON, read_hf_json

        return {CONFIG_JSON: read_hf_json(path)}
    return None


def read_args(kind: str, path: Path, parsed: Optional[dict] = None) -> ModelArgs:
    """The ModelArgs a checkpoint of this kind (detect_format's) records; `parsed`: read_config's."""
    if kind == "meta":
        from .meta import read_meta_params

        return read_meta_params(path, parsed=parsed)
    if kind == "hf":
        from .hf_read import CONFIG_JSON, args_from_hf_config, read_hf_config

        return read_hf_config(path) if parsed is None else args_from_hf_config(parsed[CONFIG_JSON], path / CONFIG_JSON)
    return ModelArgs.from_params_json(path / "params.json")  # hybridpar's: every field, checked alike


def load_into(kind: str, path: Path, model: Transformer, parallel: ParallelDims, parsed: Optional[dict] = None) -> None:
    """Fill a model built (before FSDP) from read_args(kind, path) with the checkpoint's weights;
    `parsed`: read_config's."""
    if kind == "meta":
        from .meta import load_meta_checkpoint

        load_meta_checkpoint(path, model, parallel, parsed=parsed)
    elif kind == "hf":
        from .hf_read import CONFIG_JSON, load_hf_checkpoint

        load_hf_checkpoint(path, model, parallel, config=None if parsed is None else parsed[CONFIG_JSON])
    else:
        Checkpointer(path.parent, parallel).load(path, model, None, params_dict(model.args))


def load_model(path: Path, parallel: ParallelDims, *, dtype: Optional[torch.dtype] = None,
               vocab_size: Optional[int] = None, max_seq_len: Optional[int] = None) -> tuple[Transformer, ModelArgs]:
    """A Transformer at this job's mp holding the weights of checkpoint `path` (any format).

    vocab_size fills in Llama 2's -1 (the tokenizer decides) when the checkpoint cannot tell;
    max_seq_len, when given, replaces the checkpoint's (Meta's params.json has none: 2048 then).
    """
    kind, path = detect_format(path)
    args = read_args(kind, path)
    if args.vocab_size <= 0 and vocab_size:
        args = dataclasses.replace(args, vocab_size=vocab_size)
    if max_seq_len is not None:
        args = dataclasses.replace(args, max_seq_len=max_seq_len)
    # Built without memory, then allocated once: the checkpoint overwrites every weight anyway.
    model = build_model(args, parallel, device=torch.device("meta"), dtype=dtype)
    model.to_empty(device=parallel.device)
    load_into(kind, path, model, parallel)
    return model, args


def _tokenizer_files(tokenizer: Path, vocab_size: int) -> tuple[int, int, dict[str, Path]]:
    """(bos, eos, {name in the HF folder: file}) of a tokenizer Tokenizer reads, checked against the
    model's vocabulary."""
    from ..data import check_vocab
    from ..data.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer)
    check_vocab(tok.vocab_size, vocab_size)
    if tok.kind != "huggingface":
        return tok.bos_id, tok.eos_id, {"tokenizer.model": tok.path}
    beside = ("tokenizer_config.json", "special_tokens_map.json")
    files = {"tokenizer.json": tok.path, **{n: tok.path.parent / n for n in beside if (tok.path.parent / n).is_file()}}
    return tok.bos_id, tok.eos_id, files


def run_tokenizer(src: Path) -> Optional[Path]:
    """The tokenizer a hybridpar checkpoint's run trained with (its train_state.json records it),
    if its file is still there with the same sha256; said in one line either way."""
    from ..data.tokenizer import Tokenizer
    from ..progress import note

    kind, path = detect_format(src)
    if kind != "dcp":
        return None
    try:
        recorded = json.loads((path / "train_state.json").read_text()).get("tokenizer")
    except (OSError, ValueError):
        recorded = None
    if not recorded:
        note(f"{path} does not record its run's tokenizer: the export has none (give --tokenizer to add it)")
        return None
    found, sha = Path(recorded["path"]), recorded["sha256"]
    try:
        same = found.exists() and Tokenizer(found).sha256 == sha
    except ValueError:  # not a tokenizer any more
        same = False
    if not same:
        state = "is gone" if not found.exists() else "now holds another tokenizer"
        note(f"the run's tokenizer {found} {state} (sha256 {sha[:12]} was trained with): the export has no "
             "tokenizer; give --tokenizer the run's to add it")
        return None
    note(f"tokenizer: {found}, the run's (recorded in {path.name}; --tokenizer chooses another)")
    return found


def _source_token_ids(src: Path) -> tuple[Optional[int], Optional[Union[int, list[int]]]]:
    """A Hugging Face source's own bos/eos ids (None for the formats that do not record them): its text
    model's for a Llama 4 multimodal folder; the eos ids a list where the source lists several."""
    from .hf_read import text_config

    kind, path = detect_format(src)
    if kind != "hf":
        return None, None
    config = text_config(json.loads((path / "config.json").read_text()), path / "config.json")[0]
    ids = [config.get(k) for k in ("bos_token_id", "eos_token_id")]
    one = lambda i: isinstance(i, int) and not isinstance(i, bool)  # noqa: E731
    eos = ids[1] if one(ids[1]) or (isinstance(ids[1], list) and ids[1] and all(map(one, ids[1]))) else None
    return (ids[0] if one(ids[0]) else None), eos


def convert(src: Path, dst: Path, to: str, parallel: ParallelDims, mp_out: Optional[int] = None, *,
            bos_id: Optional[int] = None, eos_id: Optional[int] = None, max_seq_len: Optional[int] = None,
            tokenizer: Optional[Path] = None, overwrite: bool = False, dtype: Optional[torch.dtype] = None,
            max_shard_size: Optional[Union[int, str]] = None) -> Path:
    """Write the weights of `src` to `dst` in format `to`; returns what was written.

    tokenizer (hf, meta): its files are copied into the folder (a hybridpar checkpoint's recorded
    tokenizer when not given: run_tokenizer); Meta's folders keep a sentencepiece or tiktoken file as
    tokenizer.model. bos_id / eos_id (hf only): config.json's token ids; default the tokenizer's,
    else a Hugging Face source's own, else hf.default_token_ids. max_seq_len (hf, dcp): the context length recorded, default the source's.
    overwrite: replace an existing `dst` (the old folder goes once the new one is complete).
    dtype, max_shard_size (hf only): export_hf's, default bfloat16 and 5GB shards.
    """
    if to not in FORMATS:
        raise ValueError(f"--to must be one of {FORMATS}, got {to!r}")
    # Option mistakes before the (long) load.
    if mp_out is not None and to != "meta":
        raise ValueError("--meta-files applies to --to meta only: dcp and hf checkpoints load at any "
                         "model-parallel size")
    if (bos_id is not None or eos_id is not None) and to != "hf":
        raise ValueError("--bos-id / --eos-id apply to --to hf only: the other formats do not record token ids")
    if tokenizer is not None and (to == "dcp" or bos_id is not None or eos_id is not None):
        raise ValueError("--tokenizer applies to --to hf and meta only, without --bos-id / --eos-id (it gives them)")
    if max_seq_len is not None and to == "meta":
        raise ValueError("--max-seq-len applies to --to hf and dcp only: Meta's params.json does not record it")
    if (dtype is not None or max_shard_size is not None) and to != "hf":
        raise ValueError("--dtype / --max-shard-size apply to --to hf only: the other formats keep the source's "
                         "dtype and their own files")
    if max_shard_size is not None:
        parse_shard_size(max_shard_size, "--max-shard-size")
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"--max-seq-len must be a positive number of tokens, got {max_seq_len}")
    dst = Path(dst)
    if to == "meta":  # refused from the source's config, before its weights load
        from .meta_write import refuse_llama4

        refuse_llama4(read_args(*detect_format(Path(src))))
    if to == "dcp":  # rank 0 looks (one view of the file system); every rank refuses alike
        on_rank0(lambda: refuse_occupied(dst, OCCUPIED_ADVICE, error_type=CheckpointError, overwrite=overwrite),
                 f"check {dst}", error_type=CheckpointError)
    model, args = load_model(src, parallel, max_seq_len=max_seq_len)
    # The tokenizer goes with a Meta or Hugging Face export: the one given, else the one the run recorded.
    files: dict[str, Path] = {}
    if to != "dcp" and tokenizer is None and bos_id is None and eos_id is None:
        tokenizer = run_tokenizer(src)
    if tokenizer is not None:
        bos_id, eos_id, files = _tokenizer_files(Path(tokenizer), args.vocab_size)
    if to == "meta":
        from .meta import save_meta_checkpoint

        save_meta_checkpoint(model, dst, parallel, mp_out or parallel.mp, overwrite=overwrite, extra_files=files)
        return dst
    if to == "hf":
        from .hf import export_hf

        if bos_id is None and eos_id is None:
            bos_id, eos_id = _source_token_ids(src)
        export_hf(model, dst, parallel, bos_token_id=bos_id, eos_token_id=eos_id, extra_files=files,
                  overwrite=overwrite, dtype=dtype or torch.bfloat16,
                  max_shard_size=DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)
        return dst
    # A weights-only hybridpar checkpoint (step 0): start training from it with checkpoint.init_from.
    if not (overwrite and dst.exists()):
        return Checkpointer(dst, parallel).save(0, model, None, {}, params_dict(args))
    # Replacing: written beside it, then swapped in, so a failed conversion leaves the old folder.
    staged = on_rank0(lambda: begin_staging(dst), f"prepare {staging_path(dst)}", error_type=CheckpointError)
    saved = Checkpointer(staged, parallel).save(0, model, None, {}, params_dict(args))
    on_rank0(lambda: commit_staged(staged, dst), f"replace {dst}", error_type=CheckpointError)
    return dst / saved.name
