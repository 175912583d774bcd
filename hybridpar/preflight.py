"""The checks a training job makes before it starts anything: before any process group, thread or
run folder exists, so that a mistake costs one line and leaves nothing behind.

    job = resolve_job(config, world_size)   # ConfigError naming the key and what to change

Every rank makes the same checks on the same config and raises the same error (ConfigError is
marked `every_rank`), so rank 0 alone prints it. resolve_job checks and resolves a config once into
a Job (the model's shape, the init_from folder read once, the mesh sizes, the data sources walked
once and whether their token stores are complete): `hybridpar train` makes it before the Trainer,
which takes it (or makes it from a config, for a library user); the dry run and doctor take one too.
`check_config(config, world_size)` is every refusal of those that reads no data file (the values, the
mesh, the model's shape, the pipeline, what training cannot run): the job makes it inside resolve_job
and `hybridpar train --dry-run` makes it before its rehearsal, so a refusal reads the same from both.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
from pathlib import Path
from typing import Callable, Mapping, Optional, Union

from .config import Config, ConfigError
from .config.fault_tolerance import require_torchft
from .config.llama4 import check_experts, check_llama4
from .pipeline.schedules import check_pipeline, check_untied, check_validation
from .mesh.layout import MeshSizeError, resolve_sizes

FLOAT8_CAPABILITY = (8, 9)  # the CUDA cards with float8 matmuls
_TOKENIZER_KINDS = "a tokenizer.model (sentencepiece, or Meta's Llama 3 tiktoken file), a Hugging Face tokenizer.json"


@dataclasses.dataclass(frozen=True)
class Job:
    """A config resolved once, before any process group: what a start reads instead of the files
    the config names. Made by resolve_job."""

    config: Config
    world_size: int
    sizes: tuple[int, int, int, int, int]  # (pp, dp_replicate, dp_shard, cp, mp), layout.resolve_sizes'
    args: object  # hybridpar.models.args.ModelArgs; a vocab_size of -1 (Llama 2's) waits for the tokenizer
    init_from: Optional[tuple[str, Path]] = None  # (kind, folder) of a Meta or Hugging Face checkpoint.init_from
    init_config: Optional[dict] = None  # that folder's JSON, read once (checkpoint.convert.read_config)
    # Each raw data source (data.source, data.sources' and data.val_source; data.sources.source_key) ->
    # its files in reading order (the data pipeline takes them: build_training_data's walked_sources)...
    sources: Mapping = dataclasses.field(default_factory=dict)
    # ...and -> the folder of its complete token store (a store given as the source, or the cache's),
    # None when it is still to be prepared or cannot be told yet (a tokenizer not trained yet).
    stores: Mapping = dataclasses.field(default_factory=dict)

    def init_loader(self, parallel) -> Optional[Callable]:
        """build_model's `load` for a Meta or Hugging Face checkpoint.init_from (its weights sliced into
        this rank's model or stage, hybridpar.checkpoint.convert.load_into), or None."""
        if self.init_from is None:
            return None
        from .checkpoint.convert import load_into

        kind, folder = self.init_from
        return functools.partial(load_into, kind, folder, parallel=parallel, parsed=self.init_config)


def resolve_job(config: Config, world_size: int, *, training: bool = True) -> Job:
    """Every check of check_config, the files the config names, and what the start needs from them,
    each read once: raises ConfigError (or a ValueError naming the source) in one line.
    training=False: a job that runs no step (the doctor), which may use a mesh the trainer cannot run yet."""
    check_paths(config)  # first: the model's shape reads model.params_json and checkpoint.init_from
    found = init_from_folder(config)
    parsed = None
    if found is not None:
        from .checkpoint.convert import read_config

        parsed = read_config(*found)
    sizes, args = check_config(config, world_size, model_shape(config, init_from=found, parsed=parsed),
                               training=training)
    if training:
        check_eval_setup(config)
        config = group_config(config)
    sources, stores = _data_sources(config)
    return Job(config, world_size, sizes, args, found, parsed, sources, stores)


def as_job(job: Union[Job, Config], world_size: int) -> Job:
    """`job` as it is, or a config resolved (resolve_job) for `world_size` ranks."""
    if isinstance(job, Config):
        return resolve_job(job, world_size)
    if job.world_size != world_size:
        raise ConfigError(f"the job was resolved for {job.world_size} rank(s), but this process group has "
                          f"{world_size}: resolve it again (resolve_job(config, {world_size}))")
    return job


def check_config(config: Config, world_size: int, args=None, *, training: bool = True) -> tuple[tuple, object]:
    """Every refusal of a job that reads no data file and needs no process group, in the job's order:
    the values' ranges, the mesh against the world, what float8 needs of the machine, the model's shape against data.seq_len, mp and
    cp, the pipeline against the model's layers and the batch; for training (not the doctor) also
    what the trainer cannot run (validation under a V schedule, evaluation in the loop at pp or cp
    above 1). `args`: the model's shape when already read (model_shape), else read from the config.
    The job (resolve_job) and the dry run both make these checks. Returns (the mesh sizes, args)."""
    sizes = _checked_sizes(config, world_size)
    check_float8_setup(config)
    pp, cp, mp = sizes[0], sizes[3], sizes[4]
    args = check_shape(config, model_shape(config) if args is None else args, mp, cp)
    check_llama4(args, cp)
    check_experts(config, args, sizes[2])
    check_float8_gather(config, args, mp, sizes[2] * cp)
    p, d = config.parallel, config.data
    check_pipeline(pp, p.pp_schedule, p.pp_layers, p.pp_microbatches, args.n_layers, d.micro_batch_size)
    check_untied(pp, args.tie_embeddings)
    check_validation(pp, p.pp_schedule, training and bool(d.val_fraction or d.val_source))
    check_fault_tolerance(config, sizes)
    if training and config.eval.tasks and (pp > 1 or cp > 1):
        raise ConfigError(f"evaluation in the loop runs at pp 1 and cp 1, and this job has pp {pp}, cp {cp}; use "
                          "hybridpar eval on a checkpoint (or empty eval.tasks)")
    return sizes, args


def check_values(config: Config, world_size: int):
    """check_config's checks that any job makes (a doctor's too): the values, the mesh, the model's
    shape, the pipeline. Returns the model's args (hybridpar.models.args.ModelArgs)."""
    return check_config(config, world_size, training=False)[1]


def check_fault_tolerance(config: Config, sizes) -> None:
    """What fault_tolerance.enabled needs: one replica per group, a lighthouse, torchft, and a step wait
    for a silent group that ends before the watchdog would call the waiting group hung."""
    ft = config.fault_tolerance
    if not ft.enabled:
        return
    if sizes[1] > 1:
        raise ConfigError(f"fault_tolerance.enabled replicates the model over the groups: parallel.dp_replicate must be "
                          f"1 inside a group, got {sizes[1]}; make each replica a group (fault_tolerance.groups = "
                          f"{sizes[1] * ft.groups}) or set fault_tolerance.enabled = false")
    ft.address()
    require_torchft()
    d = config.diagnostics
    if d.watchdog and d.train_timeout and ft.timeout >= d.train_timeout:
        raise ConfigError(f"fault_tolerance.timeout ({ft.timeout:g} s) must be below diagnostics.train_timeout "
                          f"({d.train_timeout:g} s): a group waiting for a silent one would be called hung first")


def group_config(config: Config) -> Config:
    """A replica group's own copy of the config: its logs in <output.run_dir>/group-<g>, the job's
    checkpoints shared (the first group of the quorum writes them), and resuming always on: a group
    that restarts continues from its peers or the newest checkpoint."""
    if not config.fault_tolerance.enabled:
        return config
    config = copy.deepcopy(config)
    config.checkpoint.folder = str(config.checkpoint_dir())
    config.output.run_dir = config.fault_tolerance.group_run_dir(config.output.run_dir)
    config.checkpoint.resume = True
    return config


def check_float8_setup(config: Config) -> None:
    """What a float8.recipe needs of this machine: torchao, and on CUDA a card with float8 matmuls."""
    if not config.float8.enabled:
        return
    from .config.low_precision import require_torchao

    require_torchao()
    import torch

    from .mesh.device import default_backend

    # On CUDA (nccl, as init_parallel picks it) the matmuls are torch._scaled_mm's: Ada, Hopper and later.
    if not torch.cuda.is_available() or "nccl" not in (config.parallel.backend or default_backend()):
        return
    capability = torch.cuda.get_device_capability()
    if capability < FLOAT8_CAPABILITY:
        raise ConfigError(f"float8.recipe needs float8 matmuls (compute capability {FLOAT8_CAPABILITY[0]}."
                          f"{FLOAT8_CAPABILITY[1]} or above: L4, H100, H200, B200), and this "
                          f"{torch.cuda.get_device_name()} has compute capability {capability[0]}.{capability[1]}; "
                          "set float8.recipe = \"none\"")


# A block's linears in the order hybridpar.models.args.local_param_shapes lists their shapes.
_BLOCK_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
                  "feed_forward.w3", "feed_forward.w2")


def check_float8_gather(config: Config, args, mp: int, shards: int) -> None:
    """float8.fsdp_all_gather: torchao's float8 weight hands FSDP its shard unpadded, so the rows
    (dim 0) of each float8 linear's mp slice must split evenly over FSDP's dp_shard x cp shards."""
    f8 = config.float8
    if not (f8.enabled and f8.fsdp_all_gather) or shards == 1:
        return
    from hybridpar.models.args import local_param_shapes

    from .config.low_precision import MULTIPLE, names_skipped

    shapes = local_param_shapes(args, mp)
    # wk and wv replicated over mp (mp above the kv heads) are no tensor-parallel linears: never float8
    block = [(name, shape) for name, shape in zip(_BLOCK_LINEARS, shapes["block"])
             if args.kv_heads % mp == 0 or name not in ("attention.wk", "attention.wv")]
    linears = [(f"layers.{i}.{name}", shape) for i in range(args.n_layers) for name, shape in block]
    if args.vocab_size > 0:  # else the tokenizer gives it, later
        linears += [("output", shape) for shape in shapes["output"]]
    for name, (rows, cols) in linears:
        float8 = not (rows % MULTIPLE or cols % MULTIPLE or names_skipped(name, f8.skip))  # convert_to_float8's
        if float8 and rows % shards:
            short = name.split(".", 2)[-1] if name.startswith("layers.") else name
            raise ConfigError(
                f"float8.fsdp_all_gather needs each float8 linear's rows split evenly over the {shards} FSDP shards "
                f"(dp_shard x cp), and {short} has {rows} per mp rank; choose a parallel.dp_shard x parallel.cp "
                f"dividing {rows}, add \"{short.split('.')[-1]}\" to float8.skip, or set "
                "float8.fsdp_all_gather = false")


def check_eval_setup(config: Config) -> None:
    """What the [eval] section needs of this machine (lm-eval, eval.include_path's folder); its tasks
    are read at the start (hybridpar.train.downstream)."""
    e = config.eval
    if not e.tasks:
        return
    from .config.evaluation import require_lm_eval

    require_lm_eval("the [eval] section")
    if e.include_path and not Path(e.include_path).is_dir():
        raise ConfigError(f"eval.include_path: {e.include_path} is not a folder; give the folder holding your task "
                          "files")


def _checked_sizes(config: Config, world_size: int) -> tuple[int, int, int, int, int]:
    config.validate()
    p = config.parallel
    try:
        return resolve_sizes(world_size, p.mp, p.dp_shard, p.dp_replicate, p.cp, p.pp)
    except MeshSizeError as err:
        cp = " / parallel.cp" if p.cp != 1 else ""
        pp = "parallel.pp / " if p.pp != 1 else ""
        raise MeshSizeError(f"{pp}parallel.mp{cp} / parallel.dp_shard / parallel.dp_replicate at {world_size} "
                            f"rank(s): {err}") from None


def _data_sources(config: Config) -> tuple[dict, dict]:
    """Job.sources and Job.stores: each raw source walked once, and each store's completeness told
    from its manifest and plan.json and a stat of each source file (none is opened)."""
    from .data.training_data import source_entries, tokenizer_choice
    from .data.sources import describe_input, is_store, resolve_sources, source_key

    d = config.data
    train = [(e["source"], e.get("text_field", d.text_field)) for e in source_entries(d)]
    named = [(source, field, d.val_fraction) for source, field in train]
    if d.val_source:
        named.append((d.val_source, d.text_field, 0.0))
    sources = {source_key(s): tuple(resolve_sources(s)) for s, _, _ in named if not is_store(s)}
    try:  # the data's own errors are the pipeline's to report
        inputs = [describe_input(s, field, sources) for s, field, _ in named]
    except (OSError, ValueError):
        return sources, {source_key(s): None for s, _, _ in named}
    try:
        sha = tokenizer_choice(d, inputs[:len(train)]).sha256()  # the pipeline's tokenizer, not loaded
    except (OSError, ValueError):  # (a store's StoreError too)
        sha = None
    stores = {source_key(s): _store_of(d, input, fraction, sha) for (s, _, fraction), input in zip(named, inputs)}
    return sources, stores


def _store_of(d, input, val_fraction: float, sha: Optional[str]) -> Optional[Path]:
    """The complete store the input (sources.Input) is read from (data.training_data's choice), or None;
    `sha`: the sha256 of the run's tokenizer (None: not trained yet)."""
    from .data.training_data import cache_dir
    from .data.store.token_store import MANIFEST
    from .data.store.unit_plan import cache_folder, finished_store

    if input.store is not None:  # a store itself
        return input.store if (input.store / MANIFEST).is_file() else None
    if sha is None:
        return None
    options = dict(val_fraction=val_fraction, on_bad_record=d.on_bad_record, max_document_bytes=d.max_document_bytes)
    folder = cache_folder(input, sha, cache_dir(d), **options)
    return folder if finished_store(folder, input, sha, **options) else None


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
    check_model_paths(config)
    for key, folder in (("output.run_dir", config.output.run_dir), ("checkpoint.folder", c.folder),
                        ("data.cache_dir", d.cache_dir)):
        if folder:
            writable_folder(folder, key)


def check_model_paths(config: Config) -> None:
    """The files the model's shape is read from (model.params_json, checkpoint.init_from) exist."""
    if config.model.params_json:
        _exists("model.params_json", config.model.params_json, want_file=True)
    if config.checkpoint.init_from:
        _exists("checkpoint.init_from", config.checkpoint.init_from)


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


_FIND = object()  # model_shape's init_from not given: found from the config


def model_shape(c: Config, *, init_from=_FIND, parsed: Optional[dict] = None):
    """The model's shape config `c` names, unchecked (check_shape checks it at a layout): from
    checkpoint.init_from's folder, model.params_json or the preset, with model.vocab_size and
    model.n_layers. A vocab_size of -1 (Llama 2's params.json) waits for the tokenizer (the trainer's
    _fit_vocab). `init_from` and `parsed`: init_from_folder(c) and its JSON, when already read
    (resolve_job); else the paths are checked (check_model_paths) and read here."""
    from hybridpar.models.args import ModelArgs

    if init_from is _FIND:
        check_model_paths(c)
        init_from = init_from_folder(c)
    if init_from is not None:
        from .checkpoint.convert import read_args

        return read_args(*init_from, parsed=parsed)
    m = c.model
    overrides = {}
    if m.vocab_size:
        overrides["vocab_size"] = m.vocab_size
    if m.n_layers:
        overrides["n_layers"] = m.n_layers
    return (ModelArgs.from_params_json(m.params_json, **overrides) if m.params_json
            else ModelArgs.from_preset(m.preset, **overrides))


def check_shape(c: Config, args, mp: int, cp: int = 1):
    """The model's shape `args` against data.seq_len, the model-parallel size mp and the
    context-parallel size cp (and its vocabulary against mp, once known); returns args."""
    if c.data.seq_len > args.max_seq_len:
        raise ConfigError(
            f"data.seq_len = {c.data.seq_len} is larger than the model's max_seq_len = {args.max_seq_len}: "
            "lower data.seq_len"
        )
    if cp > 1:
        # Context parallelism cuts each sequence into 2 x cp chunks; sequence parallelism then splits
        # each rank's 2 chunks over mp.
        unit = 2 * cp * (mp if c.parallel.sequence_parallel else 1)
        if c.data.seq_len % unit:
            sp = " x mp" if c.parallel.sequence_parallel and mp > 1 else ""
            raise ConfigError(
                f"data.seq_len = {c.data.seq_len} is not divisible by 2 x cp{sp} = {unit}: context parallelism cuts "
                f"each sequence into 2 x cp = {2 * cp} chunks{' split again over mp' if sp else ''}; choose a "
                f"seq_len that is a multiple of {unit}, or a smaller parallel.cp")
    # Sequence parallelism splits each sequence's seq_len positions over the mp ranks.
    elif c.parallel.sequence_parallel and c.data.seq_len % mp:
        raise ConfigError(
            f"data.seq_len = {c.data.seq_len} is not divisible by parallel.mp = {mp}: sequence parallelism "
            f"gives each model-parallel rank seq_len / mp positions; choose a seq_len that is a multiple of {mp}, "
            "or set parallel.sequence_parallel = false")
    if args.vocab_size > 0:
        args.check(mp)
    return args
