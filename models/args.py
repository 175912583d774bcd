"""ModelArgs: the fields of Meta's params.json plus hybridpar's own (Llama 4's among them), the presets,
and Meta's feed-forward rule. hybridpar.models.llama builds the network from them (and re-exports every
name here)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

from hybridpar.mesh.layout import divide
from hybridpar.mesh.ranks import mark_every_rank

from .fields import check_field, read_json_object

PRESETS_DIR = Path(__file__).parent / "presets"
# The fields that give the model's shape: a params.json states them, no default stands in.
REQUIRED_FIELDS = ("dim", "n_layers", "n_heads", "vocab_size")


class ModelArgsError(ValueError):
    """Model fields (a model file's, or the values given) that describe no model."""

    every_rank = True  # every rank reads the same fields: hybridpar.mesh.ranks.raised_by_every_rank


@dataclasses.dataclass
class ModelArgs:
    """The fields of Meta's params.json (and Meta's ModelArgs), plus hybridpar's `embedding_split`."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None
    vocab_size: int = -1  # -1 in Llama 2's params.json: the tokenizer decides
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # Llama 2's value; Llama 3's params.json says 500000
    use_scaled_rope: bool = False
    max_batch_size: int = 32
    max_seq_len: int = 2048
    # "dim": ParallelEmbedding as in Llama 2; "vocab": VocabParallelEmbedding as in Llama 3;
    # "auto": "vocab" for the Llama 3 family (rope_theta >= 500000), else "dim".
    embedding_split: str = "auto"
    # Not in Meta's params.json (hybridpar's, for what Hugging Face configs state):
    # the feed-forward size as given (None: Meta's rule from multiple_of and ffn_dim_multiplier);
    ffn_hidden_size: Optional[int] = None
    # Llama 3's rescaling of the RoPE frequencies, used when use_scaled_rope (Meta's code fixes
    # Llama 3.1's values below; Llama 3.2 1B/3B were trained with factor 32);
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    # the output head reads the token embedding's weight (Llama 3.2 1B and 3B).
    tie_embeddings: bool = False
    # Llama 4 (Hugging Face's Llama4TextConfig; hybridpar.checkpoint.hf_llama4 maps the names): each
    # mixture-of-experts layer routes a token to experts_per_token of its n_experts experts
    # (num_local_experts, num_experts_per_tok; 0 experts: a dense model) and adds a shared expert;
    # moe_layers lists those layers (None: every layer), the others are dense (ffn_hidden_size, HF's
    # intermediate_size_mlp); each expert's hidden size is expert_hidden_size (intermediate_size; None:
    # ffn_hidden_dim).
    n_experts: int = 0
    experts_per_token: int = 1
    moe_layers: Optional[list] = None
    expert_hidden_size: Optional[int] = None
    # Attention: nope_layers have no RoPE (no_rope_layers' zeros), their queries scaled by
    # 1 + attn_scale * log(1 + floor((position + 1) / floor_scale)) when attn_temperature_tuning; the
    # RoPE layers normalise q and k (RMS, no weight) when use_qk_norm and see only the keys of their own
    # chunk of attention_chunk_size positions (None: the whole sequence).
    nope_layers: Optional[list] = None
    attn_temperature_tuning: bool = False
    floor_scale: int = 8192
    attn_scale: float = 0.1
    use_qk_norm: bool = False
    attention_chunk_size: Optional[int] = None

    @classmethod
    def from_dict(cls, params: dict, **overrides) -> "ModelArgs":
        params = {**params, **overrides}
        refuse_unknown(params, "ModelArgs")
        return cls(**params)

    @classmethod
    def from_params_json(cls, path: Union[str, Path], **overrides) -> "ModelArgs":
        """Read Meta's params.json (or a preset, or a hybridpar checkpoint's): the shape's fields
        required, every field of its JSON type and in its range (check_fields, check_values), before
        any model is built; `overrides` (e.g. vocab_size=32000 for Llama 2) win."""
        path = Path(path)
        params = read_json_object(path, ModelArgsError, "correct it (or point at another params.json)")
        check_fields(params, path)
        args = cls.from_dict(params, **overrides)
        try:
            args.check_values()
        except ModelArgsError as err:
            raise ModelArgsError(f"{path}: {err}") from err
        return args

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ModelArgs":
        path = PRESETS_DIR / f"{name}.json"
        if not path.exists():
            raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(preset_names())}")
        return cls.from_params_json(path, **overrides)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """ffn_hidden_size when given, else Meta's rule (meta_ffn_rule)."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return meta_ffn_rule(self.dim, self.multiple_of, self.ffn_dim_multiplier)

    @property
    def expert_hidden_dim(self) -> int:
        """Each routed expert's (and the shared expert's) hidden size: expert_hidden_size, else ffn_hidden_dim."""
        return self.expert_hidden_size if self.expert_hidden_size is not None else self.ffn_hidden_dim

    @property
    def llama4(self) -> bool:
        """Llama 4's architecture (Hugging Face's Llama4ForCausalLM): experts or any of its attention's features."""
        return self.n_experts > 0 or bool(self.nope_layers) or self.use_qk_norm or self.attention_chunk_size is not None

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_experts > 0 and (self.moe_layers is None or layer in self.moe_layers)

    def uses_rope(self, layer: int) -> bool:
        return layer not in (self.nope_layers or ())

    @property
    def rope_scaling(self) -> Optional[RopeScaling]:
        """The RoPE rescaling in use (None: plain RoPE)."""
        if not self.use_scaled_rope:
            return None
        return RopeScaling(self.rope_scaling_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                           self.rope_original_context)

    @property
    def resolved_embedding_split(self) -> str:
        if self.embedding_split == "auto":
            return "vocab" if self.rope_theta >= 500000 else "dim"
        return self.embedding_split

    def num_params(self, active: bool = False) -> int:
        """Every parameter; active=True: those one token uses (its experts_per_token routed experts
        of each MoE layer, not all n_experts)."""
        d, kv = self.dim, self.kv_heads * self.head_dim
        attention = d * d * 2 + d * kv * 2 + 2 * d  # wq, wo; wk, wv; two norms
        experts = self.experts_per_token if active else self.n_experts
        moe = (experts + 1) * 3 * d * self.expert_hidden_dim + self.n_experts * d  # + the shared expert, router
        ffn = sum(moe if self.is_moe_layer(i) else 3 * d * self.ffn_hidden_dim for i in range(self.n_layers))
        heads = 1 if self.tie_embeddings else 2  # the embedding, and the output head unless it is the same
        return self.n_layers * attention + ffn + heads * self.vocab_size * d + d  # + the final norm

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token as MFU counts them (PaLM's formula): 6 per parameter of the
        matrix multiplies a token goes through (its active parameters: num_params(active=True)),
        forward and backward (the output head counts, the embedding lookup is free), plus
        12 * n_layers * dim * seq_len for the attention scores; no recomputation."""
        # The output head is a matmul even when it shares the embedding's weight.
        matmul_params = self.num_params(active=True) - (0 if self.tie_embeddings else self.vocab_size * self.dim)
        return 6.0 * matmul_params + 12.0 * self.n_layers * self.dim * seq_len

    def check_values(self) -> None:
        """Raise ModelArgsError naming the field when a value is out of its range, whatever the mp
        and the tokenizer (vocab_size -1 passes: Llama 2's params.json leaves it to the tokenizer)."""
        positive = ["dim", "n_layers", "n_heads", "multiple_of", "max_batch_size", "max_seq_len"]
        positive += [f for f in ("n_kv_heads", "ffn_hidden_size", "expert_hidden_size", "attention_chunk_size")
                     if getattr(self, f) is not None]
        for name in positive:
            if getattr(self, name) < 1:
                raise ModelArgsError(f"{name} = {getattr(self, name)} must be positive")
        for name in ("norm_eps", "rope_theta", "ffn_dim_multiplier"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):  # NaN fails too
                raise ModelArgsError(f"{name} = {value} must be a positive number")
        if self.vocab_size < 1 and self.vocab_size != -1:
            raise ModelArgsError(f"vocab_size = {self.vocab_size} must be positive (or -1: the tokenizer decides)")
        if self.embedding_split not in ("auto", "dim", "vocab"):
            raise ModelArgsError(f"embedding_split must be 'auto', 'dim' or 'vocab', got {self.embedding_split!r}")
        if self.dim % self.n_heads:
            raise ModelArgsError(f"dim = {self.dim} is not divisible by n_heads = {self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ModelArgsError(f"n_heads = {self.n_heads} is not a multiple of n_kv_heads = {self.kv_heads}")
        if self.head_dim % 2:
            raise ModelArgsError(f"head_dim = dim / n_heads = {self.head_dim} must be even for RoPE")
        if self.use_scaled_rope:
            s = self.rope_scaling
            # Equal factors (Llama 4 Scout's 1 and 1): no band between the kept and the slowed frequencies.
            if not (s.factor > 0 and 0 < s.low_freq_factor <= s.high_freq_factor and s.original_context > 0):
                raise ModelArgsError(
                    f"RoPE scaling needs rope_scaling_factor > 0, 0 < rope_low_freq_factor <= rope_high_freq_factor "
                    f"and rope_original_context > 0; got {s}"
                )
        self._check_llama4()

    def _check_llama4(self) -> None:
        if self.n_experts < 0:
            raise ModelArgsError(f"n_experts = {self.n_experts} must be 0 (a dense model) or more")
        if self.n_experts and not 1 <= self.experts_per_token <= self.n_experts:
            raise ModelArgsError(f"experts_per_token = {self.experts_per_token} must be between 1 and n_experts = "
                                 f"{self.n_experts}")
        if self.moe_layers is not None and not self.n_experts:
            raise ModelArgsError("moe_layers needs experts: set n_experts (or remove moe_layers)")
        for name in ("moe_layers", "nope_layers"):
            layers = getattr(self, name) or []
            bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layers]
            if bad or len(set(layers)) != len(layers):
                raise ModelArgsError(f"{name} = {layers} must list distinct layer indices from 0 to n_layers - 1 = "
                                     f"{self.n_layers - 1}")
        if not 0 <= self.attn_scale < float("inf"):
            raise ModelArgsError(f"attn_scale = {self.attn_scale} must be a number of 0 or more")
        if self.floor_scale < 1:
            raise ModelArgsError(f"floor_scale = {self.floor_scale} must be positive")

    def check(self, mp: int = 1, ep: int = 1) -> None:
        """Raise ModelArgsError naming the numbers when this shape cannot run at model-parallel size mp
        and expert-parallel size ep (which splits the experts)."""
        self.check_values()
        if ep > 1 and not self.n_experts:
            raise ModelArgsError(f"expert parallelism (ep = {ep}) splits the experts, and this model has none "
                                 "(n_experts = 0, a dense model): use ep = 1")
        if ep > 1 and self.n_experts % ep:
            raise ModelArgsError(f"n_experts = {self.n_experts} is not divisible by the expert-parallel size "
                                 f"ep = {ep}; choose an ep that divides {self.n_experts}")
        if self.vocab_size <= 0:
            raise ModelArgsError(
                f"vocab_size is {self.vocab_size}: Llama 2's params.json leaves it to the tokenizer; "
                "pass vocab_size=<tokenizer vocabulary size>"
            )
        if self.tie_embeddings and self.resolved_embedding_split != "vocab":
            raise ModelArgsError(
                "tie_embeddings needs the embedding split on the vocabulary like the output head "
                "(embedding_split = 'vocab', the Llama 3 layout)"
            )
        try:
            self._check_split(mp)
        except ValueError as err:  # divide's: the same on every rank, as the rest of the checks
            raise ModelArgsError(str(err)) from err

    def _check_split(self, mp: int) -> None:
        divide(self.n_heads, mp, "n_heads")
        if self.kv_heads % mp and mp % self.kv_heads:
            raise ValueError(
                f"n_kv_heads = {self.kv_heads} and mp = {mp}: one must divide the other "
                f"(kv heads are split when mp divides them and replicated when mp is a multiple)"
            )
        divide(self.ffn_hidden_dim, mp, "the feed-forward hidden size (from dim, multiple_of, ffn_dim_multiplier)")
        if self.n_experts:
            divide(self.expert_hidden_dim, mp, "expert_hidden_size (each expert's hidden size)")
        if self.resolved_embedding_split == "vocab":
            divide(self.vocab_size, mp, "vocab_size (split by VocabParallelEmbedding)")
        else:
            divide(self.dim, mp, "dim (split by ParallelEmbedding)")


def field_types() -> dict[str, tuple[type, bool]]:
    """{field: (its JSON type, may it be null)} from ModelArgs' annotations: Optional ones (Meta's
    n_kv_heads and ffn_dim_multiplier, hybridpar's ffn_hidden_size) may be null."""
    types = {}
    for name, hint in typing.get_type_hints(ModelArgs).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        types[name] = (args[0], True) if args else (hint, False)
    return types


def refuse_unknown(fields: dict, where: Any = None, error: type[Exception] = ModelArgsError) -> None:
    known = sorted(f.name for f in dataclasses.fields(ModelArgs))
    unknown = sorted(set(fields) - set(known))
    if unknown:
        prefix = f"{where}: " if where is not None else ""
        raise mark_every_rank(error(f"{prefix}unknown model fields {unknown}; valid fields are {known}. "
                    "Remove the unknown ones (or fix their spelling)"))


def check_fields(params: dict, where: Any, error: type[Exception] = ModelArgsError) -> None:
    """A params.json's fields (`where` names the file): no unknown one, the shape's (REQUIRED_FIELDS)
    present, each of its JSON type; raise `error` naming the field otherwise."""
    refuse_unknown(params, where, error)
    missing = [f for f in REQUIRED_FIELDS if f not in params]
    if missing:
        raise mark_every_rank(error(
            f"{where}: required field(s) {missing} missing; a params.json states the model's shape "
            f"{list(REQUIRED_FIELDS)}: add them with the values the model has (or is to have)"))
    types = field_types()
    for name, value in params.items():
        kind, nullable = types[name]
        check_field(where, name, value, kind, nullable=nullable, error=error)


def meta_ffn_rule(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]) -> int:
    """Meta's feed-forward size: 2/3 of 4 * dim, times ffn_dim_multiplier, rounded up to multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def local_param_shapes(args: ModelArgs, mp: int) -> dict[str, list[tuple[int, ...]]]:
    """Each FSDP unit's parameters as this mp rank holds them (before FSDP), as in models/llama.py; a
    dense model's (every block alike)."""
    if args.n_experts:
        raise ModelArgsError(f"local_param_shapes covers dense models (every block alike); this one has "
                             f"{args.n_experts} experts")
    d, hd, v, f = args.dim, args.head_dim, args.vocab_size, args.ffn_hidden_dim
    q = args.n_heads * hd // mp
    # wk/wv: ColumnParallelLinear slices when mp divides the kv heads, else every rank has them all.
    kv = args.kv_heads * hd // mp if args.kv_heads % mp == 0 else args.kv_heads * hd
    embedding = (v // mp, d) if args.resolved_embedding_split == "vocab" else (v, d // mp)
    block = [(q, d), (kv, d), (kv, d), (d, q), (f // mp, d), (f // mp, d), (d, f // mp), (d,), (d,)]
    # Tied: the head reads the embedding's weight (hybridpar.models.llama.TiedOutput) and has none of its own.
    output = [] if args.tie_embeddings else [(v // mp, d)]
    return {"embedding": [embedding], "block": block, "output": output, "root": [(d,)]}


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


class RopeScaling(NamedTuple):
    """Llama 3's rescaling of the RoPE frequencies (Hugging Face's rope_type "llama3"); the defaults
    are Llama 3.1's, which Meta's code fixes."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192
