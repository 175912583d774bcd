"""Meta's consolidated Llama checkpoints: the format, imported from and exported to any model-parallel size.

A folder of params.json (Meta's ModelArgs fields) and consolidated.00.pth ... consolidated.{MP-1:02d}.pth,
each a flat {name: tensor} dict of every parameter under Meta's name (= models.llama's), split evenly
across the files along split_dim(): dim 0 for wq/wk/wv, w1/w3 and output (column-parallel), dim 1
for wo and w2 (row-parallel), tok_embeddings on dim 1 in the Llama 2 layout and dim 0 in the Llama 3
layout; norms whole in every file. Llama 2 files also hold `rope.freqs` (the RoPE inverse
frequencies, which Meta's code never uses): written in that layout, checked on import.
params.json holds only fields Meta's code accepts: not max_seq_len or max_batch_size (Meta passes
them as keywords too: a duplicate would fail) nor embedding_split (read back from the shard shapes);
vocab_size is -1 in the Llama 2 layout, as in Meta's releases, and the real size in the Llama 3 one.

Reading lives in meta_read, writing in meta_write; import the API from here:
read_meta_params, load_meta_checkpoint, save_meta_checkpoint, MetaCheckpointError.
"""

from __future__ import annotations

import importlib
import re
import zipfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

from models.llama import ModelArgs

PARAMS_JSON = "params.json"
SHARD_FILE = re.compile(r"^consolidated\.(\d+)\.pth$")
ROPE_FREQS = "rope.freqs"

# Fields every params.json Meta published has; the others have Meta's defaults.
REQUIRED_FIELDS = ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "norm_eps")
_INT_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "max_batch_size", "max_seq_len")
_FLOAT_FIELDS = ("ffn_dim_multiplier", "norm_eps", "rope_theta")
# Fields that change the numbers but not the shapes: a model built with other values would load
# without a shape error and compute something else, so load_meta_checkpoint compares them.
_BEHAVIOUR_FIELDS = ("norm_eps", "rope_theta", "use_scaled_rope")

_COLUMN = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
           "feed_forward.w1.weight", "feed_forward.w3.weight")
_ROW = ("attention.wo.weight", "feed_forward.w2.weight")
_NORMS = ("attention_norm.weight", "ffn_norm.weight")


class MetaCheckpointError(ValueError):
    """A Meta checkpoint folder (or a model meant for it) that cannot be read, loaded or written."""


def shard_name(index: int) -> str:
    return f"consolidated.{index:02d}.pth"


def split_dim(name: str, embedding_split: str) -> Optional[int]:
    """The dimension Meta splits parameter `name` along across consolidated files (None: whole in each)."""
    if name == "tok_embeddings.weight":
        return 1 if embedding_split == "dim" else 0
    if name == "output.weight" or name.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def meta_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter of the Meta checkpoint of `args`, with its full (unsplit) shape."""
    d, q, kv, hidden = args.dim, args.n_heads * args.head_dim, args.kv_heads * args.head_dim, args.ffn_hidden_dim
    shapes = {"tok_embeddings.weight": (args.vocab_size, d)}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attention.wq.weight": (q, d), p + "attention.wk.weight": (kv, d),
            p + "attention.wv.weight": (kv, d), p + "attention.wo.weight": (d, q),
            p + "feed_forward.w1.weight": (hidden, d), p + "feed_forward.w2.weight": (d, hidden),
            p + "feed_forward.w3.weight": (hidden, d),
            p + "attention_norm.weight": (d,), p + "ffn_norm.weight": (d,),
        })
    shapes.update({"norm.weight": (d,), "output.weight": (args.vocab_size, d)})
    return shapes


def rope_inverse_frequencies(args: ModelArgs) -> torch.Tensor:
    """The `rope.freqs` entry of Llama 2 files: theta^(-2i / head_dim) for each pair i, [head_dim / 2] fp32.

    Always the unscaled frequencies, as in Meta's Llama 2 files (Llama 3.1's scaling never met this
    layout in Meta's releases; the entry is informational: Meta's code does not read it).
    """
    half = torch.arange(0, args.head_dim, 2)[: args.head_dim // 2].float()
    return 1.0 / (args.rope_theta ** (half / args.head_dim))


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


# Opening a consolidated file is part of the format: weights only, memory-mapped.
def _load_file(path: Path, verify_checksums: bool = False) -> dict[str, torch.Tensor]:
    """Open one consolidated file without reading its tensors into memory (mmap), weights only."""
    try:
        if zipfile.is_zipfile(path):
            if verify_checksums:
                # torch.load never checks the zip's CRC-32s: flipped bytes inside a tensor load silently.
                with zipfile.ZipFile(path) as archive:
                    bad = archive.testzip()
                if bad is not None:
                    raise MetaCheckpointError(
                        f"{path}: entry {bad} fails its CRC-32 check: the file is corrupt; copy or download it again"
                    )
            state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        else:
            # torch.save's legacy (non-zip) format cannot be memory-mapped; a truncated zip lands here
            # too (its directory is at the end) and fails to unpickle below.
            state = torch.load(path, weights_only=True, map_location="cpu")
    except MetaCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure to parse means a damaged file
        # The first sentence only: torch's own advice (e.g. "retry with weights_only=False") does not apply.
        first_line = (str(err).strip().splitlines() or [""])[0].split(". ")[0][:200]
        raise MetaCheckpointError(
            f"{path} cannot be read ({type(err).__name__}: {first_line}): the file is truncated or corrupt; "
            "copy or download it again"
        ) from err
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise MetaCheckpointError(f"{path} does not hold a flat {{name: tensor}} dict as Meta's consolidated files do")
    return dict(state)


def meta_params_json(args: ModelArgs) -> dict[str, Any]:
    """params.json as Meta's code accepts it (see the module docstring for what is left out and why)."""
    llama2 = args.resolved_embedding_split == "dim"
    params: dict[str, Any] = {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads}
    if args.n_kv_heads is not None:
        params["n_kv_heads"] = args.n_kv_heads
    params["vocab_size"] = -1 if llama2 else args.vocab_size
    params["multiple_of"] = args.multiple_of
    if args.ffn_dim_multiplier is not None:
        params["ffn_dim_multiplier"] = args.ffn_dim_multiplier
    params["norm_eps"] = args.norm_eps
    # Llama 2's ModelArgs has no rope_theta (Code Llama's has): write it only when it is not the default.
    if not llama2 or args.rope_theta != ModelArgs.rope_theta:
        params["rope_theta"] = args.rope_theta
    if args.use_scaled_rope:  # Llama 3.1's field; older code does not know it
        params["use_scaled_rope"] = True
    return params


# The API lives in meta_read and meta_write, which build on the format above: imported on first
# use (PEP 562), so that importing either of them first works too.
_API = {"read_meta_params": "meta_read", "load_meta_checkpoint": "meta_read", "save_meta_checkpoint": "meta_write"}

__all__ = ["MetaCheckpointError", "meta_params_json", "meta_shapes", "rope_inverse_frequencies", "shard_name",
           "split_dim", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(f".{_API[name]}", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
