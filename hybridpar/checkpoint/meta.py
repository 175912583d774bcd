"""Meta's consolidated Llama checkpoints: the format, imported from and exported to any model-parallel size.

A folder of params.json (Meta's ModelArgs fields) and consolidated.00.pth ... consolidated.{MP-1:02d}.pth,
each a flat {name: tensor} dict of every parameter under Meta's name (= hybridpar.models.llama's), split evenly
across the files along split_dim(): dim 0 for wq/wk/wv, w1/w3 and output (column-parallel), dim 1
for wo and w2 (row-parallel), tok_embeddings on dim 1 in the Llama 2 layout and dim 0 in the Llama 3
layout; norms whole in every file; Llama 2 files also hold `rope.freqs` (unused). params.json has
only Meta's keys (meta_params_json; vocab_size -1 in the Llama 2 layout, as Meta's releases), the
feed-forward size stated through multiple_of and ffn_dim_multiplier. What those keys cannot state
goes to hybridpar.json (hybridpar_json): RoPE factors other than Meta's fixed ones, and tied
embeddings (output.weight still written, a copy of tok_embeddings as in Meta's Llama 3.2).

API (reading in meta_read, writing in meta_write): read_meta_params, load_meta_checkpoint,
save_meta_checkpoint, MetaCheckpointError.
"""

from __future__ import annotations

import importlib
import math
import re
import zipfile
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from hybridpar.models.args import ModelArgs, meta_ffn_rule

from .foreign import ForeignCheckpointError
from .pth_check import cut_short, unsafe_global

PARAMS_JSON = "params.json"
SIDECAR_JSON = "hybridpar.json"
SHARD_FILE = re.compile(r"^consolidated\.(\d+)\.pth$")
ROPE_FREQS = "rope.freqs"

# hybridpar's fields that Meta's params.json cannot state (hybridpar.json).
_ROPE_FACTORS = ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_context")
SIDECAR_FIELDS = (*_ROPE_FACTORS, "tie_embeddings")

_COLUMN = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
           "feed_forward.w1.weight", "feed_forward.w3.weight")
_ROW = ("attention.wo.weight", "feed_forward.w2.weight")
_NORMS = ("attention_norm.weight", "ffn_norm.weight")


class MetaCheckpointError(ForeignCheckpointError):
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


def rope_inverse_frequencies(args: ModelArgs) -> torch.Tensor:
    """The `rope.freqs` entry of Llama 2 files: theta^(-2i / head_dim) for each pair i, [head_dim / 2] fp32.

    Always the unscaled frequencies, as in Meta's Llama 2 files (Llama 3.1's scaling never met this
    layout in Meta's releases; the entry is informational: Meta's code does not read it).
    """
    half = torch.arange(0, args.head_dim, 2)[: args.head_dim // 2].float()
    return 1.0 / (args.rope_theta ** (half / args.head_dim))


# Opening a consolidated file is part of the format: weights only, memory-mapped.
def _load_file(path: Path, verify_checksums: bool = False) -> dict[str, torch.Tensor]:
    """Open one consolidated file without reading its tensors into memory (mmap), weights only."""
    short = cut_short(path)  # from the zip's own records, before torch.load maps bytes that are not there
    if short is not None:
        raise MetaCheckpointError(f"{path} cannot be read (cut short: {short}): the file is truncated or corrupt; "
                                  "copy or download it again")
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
        if (named := unsafe_global(err)) is not None:
            raise MetaCheckpointError(
                f"{path}: unsafe pickle refused: loading it would import and run {named}, which a file of "
                "weights never needs; use only files from a source you trust (Meta's consolidated files hold "
                "tensors alone)") from err
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
    """params.json as Meta's `ModelArgs(**params)` accepts it: Meta's keys only, the feed-forward size
    through multiple_of and ffn_dim_multiplier (meta_ffn_fields). Not max_seq_len or max_batch_size
    (Meta's Llama.build passes them as keywords too: a duplicate would fail) nor embedding_split
    (read back from the shard shapes); hybridpar's own fields go to hybridpar.json (hybridpar_json)."""
    llama2 = args.resolved_embedding_split == "dim"
    params: dict[str, Any] = {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads}
    if args.n_kv_heads is not None:
        params["n_kv_heads"] = args.n_kv_heads
    params["vocab_size"] = -1 if llama2 else args.vocab_size
    params["multiple_of"], multiplier = meta_ffn_fields(args)
    if multiplier is not None:
        params["ffn_dim_multiplier"] = multiplier
    params["norm_eps"] = args.norm_eps
    # Llama 2's ModelArgs has no rope_theta (Code Llama's has): write it only when it is not the default.
    if not llama2 or args.rope_theta != ModelArgs.rope_theta:
        params["rope_theta"] = args.rope_theta
    if args.use_scaled_rope:  # Llama 3.1's field; older code does not know it
        params["use_scaled_rope"] = True
    return params


def meta_ffn_fields(args: ModelArgs) -> tuple[int, Optional[float]]:
    """(multiple_of, ffn_dim_multiplier) that give args.ffn_hidden_dim under Meta's rule.

    In this order: the args' own values; no multiplier with the args' multiple_of or a power of two
    up to 1024 (the largest that works); a multiplier of the fewest decimals (the one nearest the
    exact ratio among those) with the largest power of two up to 1024 dividing the size. Every
    choice is checked with meta_ffn_rule. Raises MetaCheckpointError when none reproduces it.
    """
    size, dim = args.ffn_hidden_dim, args.dim
    if args.multiple_of >= 1 and meta_ffn_rule(dim, args.multiple_of, args.ffn_dim_multiplier) == size:
        return args.multiple_of, args.ffn_dim_multiplier
    powers = [2 ** k for k in range(_MAX_MULTIPLE_OF.bit_length() - 1, -1, -1)]
    for multiple_of in [args.multiple_of, *powers]:
        if multiple_of >= 1 and meta_ffn_rule(dim, multiple_of, None) == size:
            return multiple_of, None
    multiple_of = next(p for p in powers if size % p == 0)
    multiplier = _short_multiplier(dim, size, multiple_of)
    if multiplier is None:
        raise MetaCheckpointError(
            f"ffn_hidden_size = {size} (dim = {dim}) cannot be stated in Meta's params.json: no multiple_of and "
            f"ffn_dim_multiplier of up to {_MAX_DECIMALS} decimals give it under Meta's rule; export to hf or "
            "dcp instead (hybridpar convert --to hf or --to dcp)"
        )
    return multiple_of, multiplier


_MAX_MULTIPLE_OF = 1024
_MAX_DECIMALS = 6


def _short_multiplier(dim: int, size: int, multiple_of: int, max_decimals: int = _MAX_DECIMALS) -> Optional[float]:
    """The ffn_dim_multiplier of the fewest decimals that gives `size` with `multiple_of` (None: none)."""
    base = meta_ffn_rule(dim, 1, None)  # int(2 * 4 * dim / 3)
    if size < 1 or size % multiple_of or base < 1:
        return None
    # Rounding up to multiple_of gives size when int(multiplier * base) lies in (size - multiple_of, size].
    low, high = (size - multiple_of + 1) / base, (size + 1) / base
    for decimals in range(max_decimals + 1):
        scale = 10 ** decimals
        # One step either side of the bounds: float rounding is settled by meta_ffn_rule itself.
        found = [round(n / scale, decimals) for n in range(math.floor(low * scale) - 1, math.ceil(high * scale) + 2)]
        found = [m for m in found if m > 0 and meta_ffn_rule(dim, multiple_of, m) == size]
        if found:
            return float(min(found, key=lambda m: (abs(m - size / base), m)))
    return None


def hybridpar_json(args: ModelArgs) -> dict[str, Any]:
    """hybridpar.json: the fields of `args` that Meta's params.json cannot state, {} when there are none.

    The RoPE factors when scaled RoPE is on and they are not Meta's fixed ones (Llama 3.1's: the
    ModelArgs defaults), and tie_embeddings when true."""
    fields: dict[str, Any] = {}
    if args.use_scaled_rope:
        fields.update({f: getattr(args, f) for f in _ROPE_FACTORS if getattr(args, f) != getattr(ModelArgs, f)})
    if args.tie_embeddings:
        fields["tie_embeddings"] = True
    return fields


# The API lives in meta_read and meta_write, which build on the format above: imported on first
# use (PEP 562), so that importing either of them first works too.
_API = {"read_meta_params": "meta_read", "load_meta_checkpoint": "meta_read", "save_meta_checkpoint": "meta_write"}

__all__ = ["MetaCheckpointError", "hybridpar_json", "meta_ffn_fields", "meta_params_json",
           "rope_inverse_frequencies", "shard_name", "split_dim", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(f".{_API[name]}", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
