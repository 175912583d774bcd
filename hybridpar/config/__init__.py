"""Training configuration: dataclasses, loaded from TOML, overridden by dotted flags.

    hybridpar train --config configs/local.toml --train.steps 20 --parallel.mp 2

Every key must exist: a misspelt key is an error that lists the valid ones, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from .evaluation import EvalConfig
from .experts import MoEConfig
from .sharding import FSDPConfig
from .fault_tolerance import FaultToleranceConfig
from .low_precision import Float8Config
from .options import ConfigError, description, option, parse_pp_layers
from .data_sources import blend_sources

# A record (a .jsonl line, a table's text) longer than this is refused, or skipped: data.max_document_bytes.
MAX_DOCUMENT_BYTES = 64 << 20
BAD_RECORD_CHOICES = ("error", "skip")  # data.on_bad_record
# Skipped bad records a source file may hold (data.max_bad_records): below 1 a share of its records,
# else a number. Above it the preparation stops: a file of the wrong format is not skipped whole.
MAX_BAD_RECORDS = 0.01


@dataclasses.dataclass
class ModelConfig:
    preset: str = option("tiny", "a model preset of models/presets, or \"\" to use params_json")
    params_json: str = option("", "Meta's params.json (wins over preset when set)")
    vocab_size: int = option(0, "0: the preset's (for Llama 2's -1, the tokenizer's)")
    n_layers: int = option(0, "0: the preset's; fewer for quick experiments")


@dataclasses.dataclass
class ParallelConfig:
    mp: int = option(1, "model (tensor) parallel size, inside a node")
    dp_shard: int = option(-1, "FSDP sharding ranks (-1: the remaining ranks)")
    dp_replicate: int = option(1, "replicas across nodes (hybrid sharding)")
    cp: int = option(1, "context-parallel ranks per sequence (long context): each holds 1/cp of every sequence")
    pp: int = option(1, "pipeline stages' ranks, the outermost dimension: each holds a share of the layers")
    ep: int = option(1, "expert-parallel ranks, taken from dp_shard (no ranks of their own): each holds n_experts / ep "
                        "of a mixture-of-experts model's experts; must divide dp_shard and n_experts")
    pp_layers: list = option(list, "each stage's transformer layers, in order, e.g. [4, 4, 3] or \"4,4,3\" "
                                   "(empty: split evenly, the embedding and the output counted as a layer each)")
    pp_schedule: str = option("1F1B", "1F1B, GPipe, Interleaved1F1B (2 stages per rank unless pp_layers says), "
                                      "ZBVZeroBubble or DualPipeV (2 per rank)")
    pp_microbatches: int = option(0, "micro-batches each data.micro_batch_size is cut into (0: one per stage)")
    backend: str = option("", "\"\": nccl with GPUs, gloo without")
    init_timeout: float = option(600.0, "seconds a collective may wait before the first step is done")
    # Norm and residual activations / mp; all-gather + reduce-scatter instead of all-reduce.
    sequence_parallel: bool = option(True, "with mp > 1, split the activations between tensor-parallel regions "
                                           "along the sequence over the mp group")


@dataclasses.dataclass
class DataConfig:
    source: str = option("default", "\"default\" (the embedded corpus), a token store (hybridpar prepare), a "
                                    ".txt, .jsonl(.gz/.zst), .parquet or .arrow file, a datasets folder, or a folder of them")
    sources: list = option(list, "a weighted blend instead of data.source: [[data.sources]] tables (name, source, "
                                 "weight; optional text_field) or on the command line "
                                 "\"web=/data/web@0.7,code=/data/code@0.3\"")
    on_exhausted: str = option("repeat", "data.source, or a blend's source, that runs out: \"repeat\" it (epochs "
                                         "counted) or \"stop\" the run, saving the last step that trained")
    text_field: str = option("text", "the jsonl field or table column holding the text")
    on_bad_record: str = option("error", "a record whose text is missing, null, not a string or not Unicode text, or "
                                         "a .jsonl line that is not a JSON object: \"error\" naming it, or \"skip\" "
                                         "it (counted in the store's manifest)")
    max_bad_records: float = option(MAX_BAD_RECORDS, "with on_bad_record = \"skip\", the most bad records a source "
                                                     "file may hold: a share of its records (below 1) or a number")
    max_document_bytes: int = option(MAX_DOCUMENT_BYTES, "a longer record (.jsonl line, table text) is a bad record")
    val_source: str = option("", "held-out validation text, a source like data.source (\"\": none)")
    val_fraction: float = option(0.0, "or this share of the source's documents, whole, held out for validation "
                                      "(0: none)")
    tokenizer: str = option("", "a tokenizer.model, tokenizer.json or their folder; \"\": train one on the source")
    tokenizer_vocab_size: int = option(4096, "vocabulary of a tokenizer trained on the source")
    seq_len: int = option(128, "tokens per sequence")
    micro_batch_size: int = option(2, "sequences per data-parallel rank per micro-batch")
    num_workers: int = option(0, "DataLoader worker processes")
    seed: int = option(0, "shuffling seed, shared by every rank")
    cache_dir: str = option("", "tokenizers and token files (\"\": ~/.cache/hybridpar)")


@dataclasses.dataclass
class OptimConfig:
    lr: float = option(3e-3, "peak learning rate (AdamW)")
    min_lr_ratio: float = option(0.1, "cosine decay ends at lr x min_lr_ratio")
    warmup_steps: int = option(10, "linear warm-up steps")
    weight_decay: float = option(0.1, "on matrices and embeddings, not norms")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    eps: float = option(1e-8, "AdamW epsilon")
    grad_clip: float = option(1.0, "max global gradient norm; 0 disables clipping (the norm is still logged)")


@dataclasses.dataclass
class TrainConfig:
    steps: int = option(100, "optimizer steps")
    grad_accum: int = option(1, "micro-batches per optimizer step")
    # "last": one reduce-scatter per step; "every": sharded accumulation, 1/dp_shard of the gradient
    # memory for grad_accum times the traffic.
    grad_sync: str = option("last", "with accumulation: \"last\" keeps unsharded gradients until the last "
                                    "micro-batch, \"every\" reduce-scatters each one")
    seed: int = option(0, "model initialisation seed")
    on_nonfinite: str = option("stop", "a NaN/inf loss: \"stop\" naming the step, or \"skip\" the step")
    log_every: int = option(10, "steps between progress lines and metrics rows")
    eval_every: int = option(0, "with a validation split, steps between validation losses (0: at the end only)")
    eval_steps: int = option(0, "validation batches of the global batch size per evaluation, always the first "
                                "ones of the split (0: the whole split)")
    profile_steps: str = option("", "steps to trace with torch.profiler, e.g. \"20-22\" or \"5\" "
                                    "(into <output.run_dir>/profile; \"\": none)")
    peak_flops: float = option(0.0, "per-device peak FLOP/s for MFU (0: a GPU's dense bf16 peak from its name, "
                                    "else a matmul rate measured at start-up)")
    # Start-up costs tens of seconds on a CPU, which also needs a C++ compiler; bench/README.md has the gain.
    compile: bool = option(False, "torch.compile each transformer block (fused element-wise kernels)")


@dataclasses.dataclass
class CheckpointConfig:
    folder: str = option("", "where checkpoints go (\"\": <output.run_dir>/checkpoints)")
    every: int = option(0, "save every N steps (0: only at the end)")
    at_end: bool = option(True, "save after the last step")
    keep: int = option(3, "complete checkpoints kept (older ones are deleted)")
    async_save: bool = option(False, "write in the background while training continues")
    resume: bool = option(False, "continue from the newest complete checkpoint in folder, if any")
    init_from: str = option("", "start from these weights: a hybridpar checkpoint, a Meta or a Hugging Face folder")
    # A stop still unfinished this long after the signal exits without saving (the previous checkpoint
    # stays intact). Keep it inside the launcher's grace: torchrun's --shutdown-timeout, Slurm's KillWait.
    exit_save_timeout: float = option(25.0, "seconds a stop on SIGTERM/SIGINT/SIGUSR1 may take to finish its "
                                            "step and save")


@dataclasses.dataclass
class DiagnosticsConfig:
    data_guard: bool = option(True, "check at step 1 that mp groups share batches and dp ranks differ")
    data_guard_every: int = option(0, "and every N steps after (0: step 1 only)")
    replica_check_every: int = option(0, "every N steps, check that replicated parameters agree (0: never)")
    train_timeout: float = option(300.0, "seconds no rank may progress once step 1 is done (0: init_timeout)")
    watchdog: bool = option(True, "name who is to blame when no rank progresses for train_timeout, then exit 124")
    watchdog_interval: float = option(0.0, "seconds between heartbeats (0: train_timeout / 20, within 0.2-5 s)")
    straggler_every: int = option(50, "every N steps, compare the ranks' compute time and name the slowest "
                                      "(0: never)")
    straggler_threshold: float = option(1.5, "warn when its compute exceeds the others' median by this factor")
    straggler_exclude: float = option(3.0, "a rank this many times the median in straggler_exclude_reports reports "
                                           "in a row: save, stop and name its node (launch/slurm.sh excludes it; "
                                           "0: never)")
    straggler_exclude_reports: int = option(3, "reports in a row over straggler_exclude before the run stops")


@dataclasses.dataclass
class OutputConfig:
    run_dir: str = option("runs/default", "metrics.jsonl, TensorBoard events, loss.png, logs")
    tensorboard: bool = option(True, "write TensorBoard events")
    plot: bool = option(True, "plot the dashboard loss.png at the end")
    wandb: bool = option(False, "also log the metrics to Weights & Biases (needs the wandb package)")
    wandb_project: str = option("hybridpar", "the W&B project")
    wandb_mode: str = option("offline", "\"offline\" (files in <run_dir>/wandb, `wandb sync` later; no network) "
                                        "or \"online\"")


@dataclasses.dataclass
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    fsdp: FSDPConfig = dataclasses.field(default_factory=FSDPConfig)
    float8: Float8Config = dataclasses.field(default_factory=Float8Config)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)  # a mixture of experts' load balance
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    diagnostics: DiagnosticsConfig = dataclasses.field(default_factory=DiagnosticsConfig)
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)  # downstream tasks in the loop
    fault_tolerance: FaultToleranceConfig = dataclasses.field(default_factory=FaultToleranceConfig)

    def checkpoint_dir(self) -> Path:
        """Where the run's checkpoints go: checkpoint.folder, else <output.run_dir>/checkpoints."""
        return Path(self.checkpoint.folder) if self.checkpoint.folder else Path(self.output.run_dir) / "checkpoints"

    def validate(self) -> None:
        """The values' own ranges and choices (hybridpar.preflight checks them against the world and the disk)."""
        try:
            self.fsdp.validate()
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self.eval.validate()
        self.float8.validate()
        self.fault_tolerance.validate()
        if self.train.grad_sync not in ("last", "every"):
            raise ConfigError(f"train.grad_sync must be 'last' or 'every', got {self.train.grad_sync!r}")
        if self.train.on_nonfinite not in ("stop", "skip"):
            raise ConfigError(f"train.on_nonfinite must be 'stop' or 'skip', got {self.train.on_nonfinite!r}")
        if self.data.on_bad_record not in BAD_RECORD_CHOICES:
            raise ConfigError(f"data.on_bad_record must be 'error' or 'skip', got {self.data.on_bad_record!r}")
        if self.data.on_exhausted not in ("repeat", "stop"):
            raise ConfigError(f"data.on_exhausted must be 'repeat' or 'stop', got {self.data.on_exhausted!r}")
        self.data.sources = blend_sources(self.data.sources)
        self.parallel.pp_layers = parse_pp_layers(self.parallel.pp_layers)
        if self.data.sources and self.data.source != DataConfig.source:
            raise ConfigError("data.source and data.sources are both set: data.source is the one-source shorthand; "
                              "list every source in data.sources, or drop data.sources")
        d = self.diagnostics
        if d.straggler_every < 0:
            raise ConfigError(f"diagnostics.straggler_every must be >= 0 (0: never), got {d.straggler_every}")
        if d.straggler_exclude and not d.straggler_exclude > d.straggler_threshold:
            raise ConfigError(f"diagnostics.straggler_exclude must be 0 (never) or above straggler_threshold "
                              f"({d.straggler_threshold}), got {d.straggler_exclude}")
        if d.straggler_exclude_reports < 1:
            raise ConfigError(f"diagnostics.straggler_exclude_reports must be >= 1, got {d.straggler_exclude_reports}")
        if not d.straggler_threshold > 1:
            raise ConfigError("diagnostics.straggler_threshold must be > 1 (a ratio to the median compute), "
                              f"got {d.straggler_threshold}")
        if not self.checkpoint.exit_save_timeout > 0:
            raise ConfigError("checkpoint.exit_save_timeout must be > 0 seconds, "
                              f"got {self.checkpoint.exit_save_timeout}")
        if not 0 <= self.data.val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be at least 0 and below 1 (a share of the documents), "
                              f"got {self.data.val_fraction}")
        if self.data.val_fraction > 0 and self.data.val_source:
            raise ConfigError("data.val_source and data.val_fraction are both set: validate on a held-out source "
                              "or on a share of data.source, not both")
        for key in ("train.eval_every", "train.eval_steps"):
            if get_value(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0, got {get_value(self, key)}")
        profile_range(self.train.profile_steps)  # raises on a malformed range
        if self.output.wandb_mode not in ("offline", "online"):
            raise ConfigError(f"output.wandb_mode must be 'offline' or 'online', got {self.output.wandb_mode!r}")
        for key, low, high in _RANGES:
            value = get_value(self, key)
            fits_high = high is None or (value <= high if isinstance(high, int) else value < high)
            if not (value >= low if isinstance(low, int) else value > low) or not fits_high:
                above = f">= {low}" if isinstance(low, int) else f"> {low:g}"
                below = "" if high is None else f" and {'<=' if isinstance(high, int) else '<'} {high:g}"
                raise ConfigError(f"{key} must be {above}{below}, got {value}; change {key}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# (key, low, high or None): an int bound includes itself, a float bound does not.
_RANGES = tuple((key, 1, None) for key in ("train.steps", "train.grad_accum", "train.log_every", "data.seq_len",
                                           "data.micro_batch_size", "checkpoint.keep", "data.tokenizer_vocab_size",
                                           "data.max_document_bytes")) + (
    ("optim.lr", 0.0, None), ("optim.eps", 0.0, None), ("optim.beta1", 0, 1.0), ("optim.beta2", 0, 1.0),
    ("optim.min_lr_ratio", 0, 1), ("optim.warmup_steps", 0, None), ("optim.weight_decay", 0, None),
    ("optim.grad_clip", 0, None), ("data.num_workers", 0, None), ("data.max_bad_records", 0, None),
    ("checkpoint.every", 0, None), ("train.peak_flops", 0, None), ("parallel.init_timeout", 0.0, None), ("diagnostics.train_timeout", 0, None),
    ("diagnostics.data_guard_every", 0, None), ("diagnostics.replica_check_every", 0, None),
    ("moe.router_aux_loss_coef", 0, None), ("moe.bias_update_rate", 0, None), ("moe.hot_ratio", 1.0, None))

def profile_range(text: str) -> Optional[range]:
    """train.profile_steps as the steps it names: "20-22" -> 20, 21, 22; "5" -> 5; "" -> None."""
    text = text.strip()
    if not text:
        return None
    first, dash, last = text.partition("-")
    try:
        start, stop = int(first), int(last if dash else first)
    except ValueError:
        start = stop = 0
    if not 1 <= start <= stop:
        raise ConfigError(f"train.profile_steps must be a step or a range of steps like \"20-22\", got {text!r}")
    return range(start, stop + 1)


def _sections(obj: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}


def get_value(config: Config, dotted: str) -> Any:
    section, _, key = dotted.partition(".")
    return getattr(getattr(config, section), key)


_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def _convert(value: Any, annotation: Any, key: str) -> Any:
    """Coerce a TOML value or a command-line string to the field's type (annotations are strings here)."""
    target = _TYPES.get(annotation if isinstance(annotation, str) else getattr(annotation, "__name__", ""))
    if target is None:
        return value
    if target is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected {target.__name__}, got {value!r}")
    if target is float and isinstance(value, int):
        return float(value)
    if isinstance(value, target):
        return value
    if isinstance(value, str):
        try:
            return target(value)
        except ValueError:
            pass
    raise ConfigError(f"{key}: expected {target.__name__}, got {value!r}")


def set_value(config: Config, dotted: str, value: Any) -> None:
    """Set `section.key`; unknown sections or keys raise ConfigError listing the valid ones."""
    section, _, key = dotted.partition(".")
    sections = _sections(config)
    if section not in sections or not key:
        raise ConfigError(f"unknown config key {dotted!r}{_did_you_mean(config, dotted)}; sections are "
                          f"{sorted(sections)} (keys look like train.steps)")
    target = getattr(config, section)
    fields = _sections(target)
    if key not in fields:
        raise ConfigError(f"unknown config key {dotted!r}{_did_you_mean(config, dotted)}; valid keys in [{section}] "
                          f"are {sorted(fields)}")
    setattr(target, key, _convert(value, fields[key].type, dotted))


def _did_you_mean(config: Config, dotted: str) -> str:
    """The valid key a mistyped or section-less one most likely meant ('run_dir' -> 'output.run_dir')."""
    valid = [f"{s}.{k}" for s in _sections(config) for k in _sections(getattr(config, s))]
    name = dotted.rpartition(".")[2]
    same_name = [v for v in valid if v.endswith("." + name)]
    close = same_name or difflib.get_close_matches(dotted, valid, n=1, cutoff=0.75)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def load_config(path: Union[str, Path, None] = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the TOML file, then `--section.key value` (or `--section.key=value`) overrides."""
    config = Config()
    if path:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config {path} {'is a folder' if path.is_dir() else 'does not exist'}: "
                              "give a TOML file, or a named config (local, llama2_70b)")
        try:
            data = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"--config {path} is not a TOML file ({err})") from None
        except OSError as err:
            raise ConfigError(f"--config {path}: {err.strerror}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: {section!r} must be a [section] table, e.g. [{section}]")
            for key, value in table.items():
                set_value(config, f"{section}.{key}", value)
    for dotted, value in _parse_overrides(overrides):
        set_value(config, dotted, value)
    config.validate()
    return config


def _parse_overrides(args: Sequence[str]) -> list[tuple[str, str]]:
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"expected an override like --train.steps 20, got {arg!r}")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} has no value")
            key, value = arg[2:], args[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def dump_toml(config: Config) -> str:
    """The resolved configuration as TOML (written into the run folder)."""
    lines: list[str] = []
    for section, values in config.to_dict().items():
        lines.append(f"[{section}]")
        # [[section.key]] after the plain keys; a list of plain values (parallel.pp_layers) is one key.
        tables = {k: v for k, v in values.items() if isinstance(v, list) and any(isinstance(e, dict) for e in v)}
        for key, value in values.items():
            if key not in tables:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
        for key, entries in tables.items():
            for entry in entries:
                lines += [f"[[{section}.{key}]]"] + [f"{k} = {_toml_value(v)}" for k, v in entry.items()] + [""]
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def find_config(name_or_path: str, search: Optional[Path] = None) -> Path:
    """A config path as given, or a named config shipped in the package ("local" -> hybridpar/configs/local.toml:
    it works from an installed wheel too)."""
    path = Path(name_or_path)
    if path.exists():
        return path
    folder = search or Path(__file__).resolve().parents[1] / "configs"
    candidate = folder / f"{name_or_path}.toml"
    if candidate.exists():
        return candidate
    presets = sorted(p.stem for p in folder.glob("*.toml")) if folder.exists() else []
    raise ConfigError(f"config {name_or_path!r} is neither a file nor a preset in {folder} ({', '.join(presets)})")


def describe(config: Optional[Config] = None) -> str:
    """Every key of every section: `--section.key TYPE (default X)  what it does`, from the fields."""
    config = config or Config()
    lines = []
    for section, field in _sections(config).items():
        lines.append(f"[{section}]")
        for name, sub in _sections(getattr(config, section)).items():
            kind = sub.type if isinstance(sub.type, str) else sub.type.__name__
            default = getattr(getattr(config, section), name)
            lines.append(f"  --{section}.{name} {kind} (default {json.dumps(default)})  {description(sub)}")
    return "\n".join(lines)

