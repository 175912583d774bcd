"""What each `hybridpar` command does, given the parsed arguments (hybridpar.cli builds the parser).
A command returns its exit code (0, or 1 where its checks found a fault); a mistake or a failure it raises,
for hybridpar.cli to report in one line (RunFailed where the run has a folder for the tracebacks).

Importing this module imports no torch: each command imports what it needs when it runs, so
`--help`, `hybridpar mesh` and a refused start stay fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from ..config import dtypes
from ..mesh.layout import MeshCoords, group_ranks, resolve_sizes, sizes_text


class RunFailed(Exception):
    """A command failed once its run had a folder: `error`, and `log_dir`, the folder where hybridpar.cli
    writes each rank's traceback (its one-line message names it). Anything else a command raises has none."""

    def __init__(self, error: Exception, log_dir: Path):
        super().__init__(f"{type(error).__name__}: {error} (tracebacks: {log_dir})")
        self.error, self.log_dir = error, log_dir


def cmd_mesh(args: argparse.Namespace) -> int:
    """Print the rank layout a job of this shape would use, without starting any process."""
    sizes = resolve_sizes(args.world, args.mp, args.dp_shard, args.dp_replicate, args.cp, args.pp)
    pp, cp, mp, ep = sizes[0], *sizes[3:], args.ep
    groups = group_ranks(*sizes, ep=ep)  # refuses an ep not dividing dp_shard
    per_node = args.procs_per_node
    print(f"world {args.world} = {sizes_text(*sizes, ep=ep)}")
    if per_node and mp > per_node:
        print(f"warning: mp={mp} spans nodes of {per_node} processes: tensor-parallel traffic leaves the node")
    elif per_node and cp * mp > per_node:
        print(f"note: a cp x mp block of {cp * mp} ranks spans nodes of {per_node} processes: the key/value "
              "all-gathers of context parallelism leave the node")
    cp_head = f" {'cp_rank':>8}" if cp > 1 else ""
    pp_head = f" {'pp_rank':>8}" if pp > 1 else ""
    ep_head = f" {'ep_rank':>8}" if ep > 1 else ""
    print(f"{'rank':>5} {'node':>5}{pp_head} {'mp_rank':>8}{cp_head} {'dp_rank':>8} {'replicate':>10} {'shard':>6}{ep_head}")
    for rank in range(args.world):
        c = MeshCoords.of(rank, *sizes)
        node = rank // per_node if per_node else 0
        cp_cell = f" {c.cp_rank:>8}" if cp > 1 else ""
        pp_cell = f" {c.pp_rank:>8}" if pp > 1 else ""
        ep_cell = f" {c.shard_idx % ep:>8}" if ep > 1 else ""  # the share of the experts it holds
        print(f"{rank:>5} {node:>5}{pp_cell} {c.mp_rank:>8}{cp_cell} {c.dp_rank:>8} {c.replicate_idx:>10} "
              f"{c.shard_idx:>6}{ep_cell}")
    for kind, groups in groups.items():
        shown = groups if len(groups) <= 8 else groups[:4] + ["..."] + groups[-2:]
        print(f"{kind} groups ({len(groups)}): {' '.join(str(g) for g in shown)}")
    return 0


def _load_config(args: argparse.Namespace):
    from ..config import find_config, load_config

    return load_config(find_config(args.config) if args.config else None, args.overrides)


def cmd_train(args: argparse.Namespace) -> int:
    """Train under torchrun/srun (or as a world of one): hybridpar train --config local --train.steps 20."""
    from ..preflight import resolve_job, world_size_from_env

    config = _load_config(args)
    if args.dry_run:
        return _dry_run(args, config)
    if args.json:
        raise ValueError("--json goes with --dry-run (the rehearsal's report); a training run writes "
                         "<output.run_dir>/summary.json")
    # Before any process group, thread or folder: a mistake leaves nothing behind (the dry run makes
    # the same checks, preflight.check_config).
    job = resolve_job(config, world_size_from_env())
    import torch.distributed as dist

    from ..train import Trainer

    try:
        trainer = Trainer(job)
        trainer.run()
    except Exception as err:  # the run has its folder now: its logs/ takes each rank's traceback
        raise RunFailed(err, Path(config.output.run_dir) / "logs") from err
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if trainer.stop_signal:
        # Stopped on request and saved: the launcher is counting down to SIGKILL, and the
        # interpreter's teardown (collecting a torch process's objects) can take many seconds on a
        # loaded node. Everything is written and closed: leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(trainer.supervisor.exit_code)
    return 0


def _dry_run(args: argparse.Namespace, config) -> int:
    """hybridpar train --dry-run: one process plays one rank of the whole world (hybridpar.cli.dryrun)."""
    from ..config import ConfigError
    from .dryrun import dry_run
    from ..files import write_text_atomic

    world = args.world or int(os.environ.get("WORLD_SIZE", 0))
    p = config.parallel
    if not world and p.dp_shard > 0 and p.dp_replicate > 0:
        world = p.pp * p.dp_replicate * p.dp_shard * p.cp * p.mp
    if not world:
        raise ConfigError("the dry run needs the world size: give --world N (the job's number of ranks), "
                          "or set parallel.dp_shard and parallel.dp_replicate")
    run = dry_run(config, world, args.dry_run_rank, gpu_mem_gib=args.gpu_mem_gb, gpus_per_node=args.gpus_per_node,
                  gpu=args.gpu)
    print(run.text(), flush=True)
    if args.json:
        write_text_atomic(args.json, json.dumps(run.to_dict(), indent=1) + "\n")
    return 0 if run.ok else 1


def cmd_convert(args: argparse.Namespace) -> int:
    """Convert a checkpoint between formats (under torchrun for large models; a world of one works)."""
    # The user's mistakes before any process group: one line naming the flag.
    if args.dtype is not None:
        dtypes.check(args.dtype, "--dtype")
    if args.max_shard_size is not None:
        from ..checkpoint.hf_shards import parse_shard_size

        parse_shard_size(args.max_shard_size, "--max-shard-size")
    import torch.distributed as dist

    from ..checkpoint.convert import convert
    from ..mesh.device import init_parallel

    made_group = not dist.is_initialized()  # a caller's own process group is left to the caller
    parallel = init_parallel(mp=args.mp, ep=args.ep)
    try:
        written = convert(Path(args.src), Path(args.dst), args.to, parallel, mp_out=args.meta_files,
                          bos_id=args.bos_id, eos_id=args.eos_id, max_seq_len=args.max_seq_len,
                          tokenizer=args.tokenizer, overwrite=args.overwrite,
                          dtype=args.dtype and dtypes.parse(args.dtype, "--dtype").torch,
                          max_shard_size=args.max_shard_size)
        if parallel.rank == 0:
            print(f"wrote {written} ({args.to})")
    finally:
        if made_group and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Check a checkpoint folder's (a folder of checkpoints', or a token store's) files against its
    checksums, offline."""
    from ..data.sources import is_store

    takes = "give a checkpoint folder (checkpoints/step-00000100), a run's checkpoints/ folder or a token store"
    if not Path(args.path).exists():
        raise FileNotFoundError(f"hybridpar verify {args.path}: no such file or folder; {takes}")
    if not Path(args.path).is_dir():  # every checkpoint and store is a folder
        raise ValueError(f"hybridpar verify {args.path}: a file, neither a checkpoint nor a token store; {takes} "
                         "(hybridpar prepare's --out)")
    if is_store(args.path):
        from ..data.store.integrity import verify_store

        return verify_store(Path(args.path))
    from ..checkpoint.verify import verify_path

    return verify_path(Path(args.path))


def cmd_prepare(args: argparse.Namespace) -> int:
    """Tokenise corpus files into a token store (on every core; a share of it with --part), or with
    --merge write the manifest of one prepared in parts."""
    from ..data.store.manifest_write import skipped_records
    from ..data.store.prepare import MIN_UNIT_MB, merge_store, prepare_store
    from ..data.store.unit_plan import check_part
    from ..data.tokenizer import Tokenizer

    if args.merge:
        store = merge_store(args.out)
        print(f"{store.folder}: complete, {store.n_tokens:,} tokens")
        return 0
    if not args.sources or not args.tokenizer:
        raise ValueError("hybridpar prepare needs the source files or folders and --tokenizer (or --merge --out STORE)")
    try:
        index, parts = (int(x) for x in args.part.split("/"))
    except ValueError:
        raise ValueError(f"--part {args.part}: give I/N, e.g. --part 0/4 for the first of four parts") from None
    check_part(index, parts)
    if args.workers < 0:
        raise ValueError(f"--workers {args.workers}: give a number of processes, or 0 for every core")
    if not args.unit_mb >= MIN_UNIT_MB:  # (NaN too)
        raise ValueError(f"--unit-mb {args.unit_mb:g}: give at least {MIN_UNIT_MB} (16 KiB): smaller units cost more "
                         "in files and bookkeeping than they spread work (the default, 64, suits most corpora)")
    store = prepare_store(list(args.sources), Tokenizer(args.tokenizer), args.out, text_field=args.text_field,
                          val_fraction=args.val_fraction, on_bad_record=args.on_bad_record,
                          workers=args.workers or None, part=(index, parts), report=True,
                          unit_bytes=int(args.unit_mb * 2**20), max_document_bytes=args.max_document_bytes,
                          max_bad_records=args.max_bad_records)
    if store is not None:
        skipped = skipped_records(store.meta)
        print(f"{store.folder}: complete, {store.n_tokens:,} tokens in {store.n_documents:,} documents"
              + (f" ({skipped:,} bad records skipped)" if skipped else "")
              + f"; train on it with --data.source {store.folder}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Load a checkpoint, continue each prompt, rank 0 prints (under torchrun with mp ranks, or alone).

    args (an argparse namespace or anything with these attributes): checkpoint (a hybridpar
    checkpoint, a folder of them, or a Meta folder with params.json and consolidated.NN.pth),
    tokenizer (what Tokenizer reads: a tokenizer.model, a tokenizer.json or a folder holding one),
    prompts (list of str), max_new_tokens, temperature, top_p, mp; optional seed (0) and dtype
    ("float32" on CPU, "bfloat16" on GPU when absent).
    """
    from ..preflight import tokenizer_file

    # The user's mistakes before any process group: one line naming the flag.
    tokenizer_path = tokenizer_file(args.tokenizer, "--tokenizer", "the model's: a run's summary names it")
    if getattr(args, "dtype", None):
        dtypes.check(args.dtype, "--dtype")
    import torch.distributed as dist

    from ..checkpoint.convert import load_model
    from ..data import Tokenizer, check_vocab
    from ..generate import generate_text
    from ..mesh.device import init_parallel

    made_group = not dist.is_initialized()  # a caller's own process group is left to the caller
    try:
        prompts = [args.prompts] if isinstance(args.prompts, str) else list(args.prompts)
        parallel = init_parallel(mp=args.mp)
        tokenizer = Tokenizer(tokenizer_path)
        dtype_name = getattr(args, "dtype", None) or ("bfloat16" if parallel.device.type == "cuda" else "float32")
        model, model_args = load_model(Path(args.checkpoint), parallel, dtype=dtypes.parse(dtype_name).torch,
                                       vocab_size=tokenizer.vocab_size)
        check_vocab(tokenizer.vocab_size, model_args.vocab_size)
        model.eval()
        completions = generate_text(
            model, parallel, tokenizer, prompts, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_p=args.top_p, seed=getattr(args, "seed", 0),
        )
        if parallel.rank == 0:
            for prompt, completion in zip(prompts, completions):
                print(f"{prompt}\n> {completion}\n", flush=True)
        return 0
    finally:
        if made_group and dist.is_initialized():
            dist.destroy_process_group()


def cmd_eval(args: argparse.Namespace) -> int:
    """Score a checkpoint on lm-evaluation-harness tasks; rank 0 prints the harness's table (and writes --json).
    Without lm-eval, with a task unknown or whose data cannot be read here: one line, before any model loads."""
    from ..config.evaluation import require_lm_eval

    require_lm_eval()
    if args.dtype:
        dtypes.check(args.dtype, "--dtype")
    import torch.distributed as dist

    from ..evaluate.run import evaluate_checkpoint, results_json, results_table
    from ..files import write_text_atomic

    made_group = not dist.is_initialized()  # a caller's own process group is left to the caller
    try:
        output = evaluate_checkpoint(args.checkpoint, args.tasks, mp=args.mp, ep=args.ep, tokenizer=args.tokenizer,
                                     include_path=args.include_path, limit=args.limit, num_fewshot=args.num_fewshot,
                                     dtype=args.dtype)
        if output is not None:
            step = "" if output["step"] is None else f" (step {output['step']})"
            print(f"{args.checkpoint}{step}\n{results_table(output)}", flush=True)
            if args.json:
                write_text_atomic(args.json, json.dumps(results_json(output), indent=1, default=str) + "\n")
        return 0
    finally:
        if made_group and dist.is_initialized():
            dist.destroy_process_group()


def _model_from_json(path: Path, overrides: dict):
    """Meta's params.json, or a Hugging Face config.json (told by its model_type)."""
    from hybridpar.models.args import ModelArgs, ModelArgsError
    from hybridpar.models.fields import read_json_object

    fields = read_json_object(path, ModelArgsError, "correct it (or point at another file)")
    if "model_type" in fields:
        from ..checkpoint.hf_read import args_from_hf_config

        return args_from_hf_config(fields, path, **overrides)
    return ModelArgs.from_params_json(path, **overrides)


def _plan_hardware(args: argparse.Namespace):
    """--gpu's spec (or this CPU, measured), with any figure given on the command line instead."""
    from ..plan.cpu import measure_cpu
    from ..plan.hardware import spec

    given = {"gpu_mem_gib": args.gpu_mem_gb, "gpus_per_node": args.gpus_per_node,
             "reserve_gib": args.reserve_gb, "allocator_overhead": args.allocator_overhead,
             "gemm_efficiency": args.gemm_efficiency,
             "attention_efficiency": args.attention_efficiency,
             "peak_flops": args.peak_tflops and args.peak_tflops * 1e12,
             "float8_peak_flops": None if args.float8_tflops is None else args.float8_tflops * 1e12,
             "memory_bw": args.memory_gbs and args.memory_gbs * 1e9, "sms": args.sms,
             "intra_node_busbw": args.intra_node_gbs and args.intra_node_gbs * 1e9,
             "inter_node_busbw": args.inter_node_gbs and args.inter_node_gbs * 1e9}
    overrides = {k: v for k, v in given.items() if v is not None}
    if overrides.get("allocator_overhead", 0) < 0:
        raise ValueError(f"--allocator-overhead {args.allocator_overhead:g} is negative: give a fraction of the "
                         "tensors' bytes, 0 or more (0.063 was measured on an H200)")
    if args.gpu == "cpu":
        print(f"measuring this machine: kernel rates, then {max(args.gpus, 2)} gloo ranks (a few seconds)", flush=True)
        return measure_cpu(args.gpus, **overrides)
    return spec(args.gpu, args.gpus, **overrides)


def _plan_model(args: argparse.Namespace):
    """(ModelArgs, the train flags that build that model) for --model."""
    from hybridpar.models.args import ModelArgs

    overrides = {"vocab_size": args.vocab_size} if args.vocab_size else {}
    vocab = f" --model.vocab_size {args.vocab_size}" if args.vocab_size else ""
    if Path(args.model).is_dir():  # a checkpoint, Meta or Hugging Face folder: its shape (and weights)
        from ..checkpoint.convert import detect_format, read_args

        kind, path = detect_format(Path(args.model))
        model = dataclasses.replace(read_args(kind, path), **overrides)
        # Meta and Hugging Face folders give the trainer the model's shape; a hybridpar checkpoint its params.json.
        shape = f"--model.params_json {path / 'params.json'}{vocab} " if kind == "dcp" else ""
        return model, f"{shape}--checkpoint.init_from {args.model}"
    if args.model.endswith(".json") or os.sep in args.model:
        model = _model_from_json(Path(args.model), overrides)
        if Path(args.model).name == "config.json":  # Hugging Face's: the folder with its weights
            return model, f"--checkpoint.init_from {Path(args.model).parent}"
        return model, f"--model.params_json {args.model}{vocab}"
    return ModelArgs.from_preset(args.model, **overrides), f"--model.preset {args.model}{vocab}"


def cmd_plan(args: argparse.Namespace) -> int:
    """Per-GPU memory and step time of every (pp, mp, cp, dp_shard, ep, dp_replicate, AC) layout; 1 when none fits."""
    from ..plan import Workload, format_plan, make_plan, parse_global_batch, plan_json

    if args.published:
        from ..plan.published import compare, format_table

        print(format_table(compare()))
        return 0
    if not args.model or not args.gpus:
        raise ValueError("hybridpar plan needs --model and --gpus (or --published)")
    model, model_flags = _plan_model(args)
    if model.vocab_size <= 0:
        raise ValueError(f"{args.model} leaves vocab_size to the tokenizer ({model.vocab_size}): "
                         "pass --vocab-size N (32000 for Llama 2's tokenizer)")
    seq_len = args.seq_len or min(model.max_seq_len, 8192)
    workload = Workload(
        seq_len=seq_len, micro_batch=args.micro_batch,
        global_batch=parse_global_batch(args.global_batch, seq_len) if args.global_batch else 0,
        param_dtype=dtypes.check(args.param_dtype, "--param-dtype"),
        reduce_dtype=dtypes.check(args.reduce_dtype, "--reduce-dtype"), grad_sync=args.grad_sync,
        compile=args.compile, float8=args.float8, float8_all_gather=args.float8_all_gather,
    )
    hardware = _plan_hardware(args)
    plan = make_plan(model, workload, hardware, allow_cross_node_mp=args.allow_cross_node_mp,
                     zero2=args.zero2, ac_every=args.ac_every, sequence_parallel=not args.no_sequence_parallel,
                     cp=args.cp, pp=args.pp, ep=args.ep)
    print(format_plan(plan, top=args.top, model_name=Path(args.model).name, model_flags=model_flags))
    if args.json:
        from ..files import write_text_atomic

        write_text_atomic(args.json, json.dumps(plan_json(plan, Path(args.model).name, model_flags), indent=1) + "\n")
    return 0 if plan.fitting else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    """Check layout, environment, bandwidth per mesh dim and (with --config) the data pipeline; 1 on errors."""
    from ..preflight import resolve_job, world_size_from_env

    config = _load_config(args)
    for key in ("mp", "dp_shard", "dp_replicate"):
        if getattr(args, key) is not None:
            setattr(config.parallel, key, getattr(args, key))
    job = resolve_job(config, world_size_from_env(), training=False)  # the config's own mistakes, one line, before any group
    import torch.distributed as dist

    from ..diagnostics.doctor import DoctorOptions, parse_sizes, run_doctor
    from ..diagnostics.timeouts import apply_env_defaults
    from ..mesh.device import init_parallel

    options = DoctorOptions(sizes=parse_sizes(args.sizes), iters=args.iters, warmup=args.warmup,
                            ops=[op for op in args.ops.split(",") if op], busbw=not args.no_busbw,
                            data_guard=bool(args.config), out=Path(args.json) if args.json else None)
    launched = dict(os.environ)  # checked as the user set it, before hybridpar's defaults
    apply_env_defaults()  # then run the collectives with the settings training would use
    c = config.parallel
    parallel = init_parallel(mp=c.mp, dp_shard=c.dp_shard, dp_replicate=c.dp_replicate, cp=c.cp, pp=c.pp,
                             timeout=c.init_timeout, backend=c.backend or None)
    try:
        return run_doctor(job, parallel, options, environ=launched)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def cmd_hang_report(args: argparse.Namespace) -> int:
    """The watchdog's analysis, offline, over flight-recorder dumps collected from every node."""
    from ..diagnostics.flight import analyse, format_report
    from ..diagnostics.traces import load_dumps
    from ..files import write_text_atomic

    traces, world, skipped = load_dumps(Path(args.dir))
    for path in skipped:
        print(f"hybridpar hang-report: skipped {path}: not a flight-recorder dump", file=sys.stderr)
    if not traces:
        raise FileNotFoundError(f"no flight-recorder dumps in {args.dir} (the watchdog's flight_recorder_rank_R.json, "
                                "or torch's TORCH_FR_DUMP_TEMP_FILE dumps, whose names end in the rank number)")
    world = max(world, args.world, max(traces) + 1)
    missing = sorted(set(range(world)) - set(traces))
    verdict = analyse(traces, dead=missing)
    print(format_report(verdict, f"hybridpar hang-report: {len(traces)} of {world} ranks' dumps in {args.dir}", world))
    if args.json:
        write_text_atomic(args.json, json.dumps(verdict.to_json(), indent=1))
    return 0


def cmd_lighthouse(args: argparse.Namespace) -> int:
    """torchft's lighthouse for fault_tolerance.enabled jobs, until SIGTERM or Ctrl-C."""
    from ..config import ConfigError
    from ..config.fault_tolerance import require_torchft
    from ..replicas.lighthouse import serve

    require_torchft()
    if args.min_groups < 1:
        raise ConfigError(f"--min-groups must be >= 1, got {args.min_groups}")
    return serve(args.port, args.min_groups, args.join_timeout, args.heartbeat_timeout)
