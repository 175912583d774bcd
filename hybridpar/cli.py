"""The `hybridpar` command (also `python -m hybridpar`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from . import __version__, dtypes
from .mesh import MeshCoords, MeshSizeError, group_ranks, resolve_sizes

# hybridpar.plan.hardware.GPUS's names (tests/test_plan.py holds them equal): the parser is built
# without importing the planner, which imports torch.
GPU_NAMES = ("a100", "h100", "h100-500w")


def _cmd_mesh(args: argparse.Namespace) -> int:
    """Print the rank layout a job of this shape would use, without starting any process."""
    try:
        dp_replicate, dp_shard, mp = resolve_sizes(args.world, args.mp, args.dp_shard, args.dp_replicate)
    except MeshSizeError as err:
        print(f"hybridpar: error: {err}", file=sys.stderr)
        return 2
    per_node = args.procs_per_node
    print(f"world {args.world} = dp_replicate {dp_replicate} x dp_shard {dp_shard} x mp {mp}")
    if per_node and mp > per_node:
        print(f"warning: mp={mp} spans nodes of {per_node} processes: tensor-parallel traffic leaves the node")
    print(f"{'rank':>5} {'node':>5} {'mp_rank':>8} {'dp_rank':>8} {'replicate':>10} {'shard':>6}")
    for rank in range(args.world):
        c = MeshCoords.of(rank, dp_replicate, dp_shard, mp)
        node = rank // per_node if per_node else 0
        print(f"{rank:>5} {node:>5} {c.mp_rank:>8} {c.dp_rank:>8} {c.replicate_idx:>10} {c.shard_idx:>6}")
    for kind, groups in group_ranks(dp_replicate, dp_shard, mp).items():
        shown = groups if len(groups) <= 8 else groups[:4] + ["..."] + groups[-2:]
        print(f"{kind} groups ({len(groups)}): {' '.join(str(g) for g in shown)}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    """Train under torchrun/srun (or as a world of one): hybridpar train --config local --train.steps 20."""
    import torch.distributed as dist

    from .config import find_config, load_config
    from .train import Trainer

    config = load_config(find_config(args.config) if args.config else None, args.overrides)
    if args.dry_run:
        return _dry_run(args, config)
    args.log_dir = Path(config.output.run_dir) / "logs"  # where main() puts a failing rank's traceback
    try:
        trainer = Trainer(config)
        trainer.run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if trainer.stop_signal:
        # Stopped on request and saved: the launcher is counting down to SIGKILL, and the
        # interpreter's teardown (collecting a torch process's objects) can take many seconds on a
        # loaded node. Everything is written and closed: leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _dry_run(args: argparse.Namespace, config) -> int:
    """hybridpar train --dry-run: one process plays one rank of the whole world (hybridpar.dryrun)."""
    from .config import ConfigError
    from .dryrun import dry_run
    from .files import write_text_atomic

    world = args.world or int(os.environ.get("WORLD_SIZE", 0))
    p = config.parallel
    if not world and p.dp_shard > 0 and p.dp_replicate > 0:
        world = p.mp * p.dp_shard * p.dp_replicate
    if not world:
        raise ConfigError("the dry run needs the world size: give --world N (the job's number of ranks), "
                          "or set parallel.dp_shard and parallel.dp_replicate")
    run = dry_run(config, world, args.dry_run_rank, gpu_mem_gib=args.gpu_mem_gb, gpus_per_node=args.gpus_per_node,
                  gpu=args.gpu)
    print(run.text(), flush=True)
    if args.dry_run_json:
        import json

        write_text_atomic(args.dry_run_json, json.dumps(run.to_dict(), indent=1) + "\n")
    return 0 if run.ok else 1


def _cmd_convert(args: argparse.Namespace) -> int:
    """Convert a checkpoint between formats (under torchrun for large models; a world of one works)."""
    import torch.distributed as dist

    from .checkpoint.convert import convert
    from .mesh import init_parallel

    parallel = init_parallel(mp=args.load_mp)
    try:
        written = convert(Path(args.src), Path(args.dst), args.to, parallel, mp_out=args.mp,
                          bos_id=args.bos_id, eos_id=args.eos_id, max_seq_len=args.max_seq_len,
                          tokenizer=args.tokenizer)
        if parallel.rank == 0:
            print(f"wrote {written} ({args.to})")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    """Check a checkpoint folder's (or a token store's) files against its checksums, offline."""
    from .data.store import is_store, verify_store

    if is_store(args.path):
        return verify_store(Path(args.path))
    from .checkpoint.verify import verify_folder

    return verify_folder(Path(args.path))


def _cmd_prepare(args: argparse.Namespace) -> int:
    """Tokenise corpus files into a token store (on every core; a share of it with --part)."""
    from .data.store_build import prepare_command

    return prepare_command(args)


def _cmd_generate(args: argparse.Namespace) -> int:
    """Load a checkpoint, continue each prompt, rank 0 prints (under torchrun with mp ranks, or alone).

    args (an argparse namespace or anything with these attributes): checkpoint (a hybridpar
    checkpoint, a folder of them, or a Meta folder with params.json and consolidated.NN.pth),
    tokenizer (what Tokenizer reads: a tokenizer.model, a tokenizer.json or a folder holding one),
    prompts (list of str), max_new_tokens, temperature, top_p, mp; optional seed (0) and dtype
    ("float32" on CPU, "bfloat16" on GPU when absent).
    """
    import torch.distributed as dist

    from .checkpoint.convert import load_model
    from .data import Tokenizer, check_vocab
    from .generate import generate_text
    from .mesh import init_parallel

    made_group = not dist.is_initialized()  # a caller's own process group is left to the caller
    try:
        prompts = [args.prompts] if isinstance(args.prompts, str) else list(args.prompts)
        parallel = init_parallel(mp=args.mp)
        tokenizer = Tokenizer(args.tokenizer)
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


def _model_from_json(path: Path, overrides: dict):
    """Meta's params.json, or a Hugging Face config.json (told by its model_type)."""
    from models.args import ModelArgs, ModelArgsError
    from models.fields import read_json_object

    fields = read_json_object(path, ModelArgsError, "correct it (or point at another file)")
    if "model_type" in fields:
        from .checkpoint.hf_read import args_from_hf_config

        return args_from_hf_config(fields, path, **overrides)
    return ModelArgs.from_params_json(path, **overrides)


def _plan_hardware(args: argparse.Namespace):
    """--gpu's spec (or this CPU, measured), with any figure given on the command line instead."""
    from .plan.cpu import measure_cpu
    from .plan.hardware import spec

    given = {"gpu_mem_gib": args.gpu_mem_gb, "gpus_per_node": args.gpus_per_node,
             "reserve_gib": args.reserve_gb, "gemm_efficiency": args.gemm_efficiency,
             "attention_efficiency": args.attention_efficiency,
             "peak_flops": args.peak_tflops and args.peak_tflops * 1e12,
             "memory_bw": args.memory_gbs and args.memory_gbs * 1e9,
             "intra_node_busbw": args.intra_node_gbs and args.intra_node_gbs * 1e9,
             "inter_node_busbw": args.inter_node_gbs and args.inter_node_gbs * 1e9}
    overrides = {k: v for k, v in given.items() if v is not None}
    if args.gpu == "cpu":
        print(f"measuring this machine: kernel rates, then {max(args.gpus, 2)} gloo ranks (a few seconds)", flush=True)
        return measure_cpu(args.gpus, **overrides)
    return spec(args.gpu, args.gpus, **overrides)


def _cmd_plan(args: argparse.Namespace) -> int:
    """Per-GPU memory and step time of every (mp, dp_shard, dp_replicate, AC) layout; 1 when none fits."""
    from models.llama import ModelArgs

    from .plan import Workload, format_plan, make_plan, parse_global_batch

    if args.published:
        from .plan.published import compare, format_table

        print(format_table(compare()))
        return 0
    if not args.model or not args.gpus:
        raise ValueError("hybridpar plan needs --model and --gpus (or --published)")
    overrides = {"vocab_size": args.vocab_size} if args.vocab_size else {}
    if Path(args.model).is_dir():  # a checkpoint, Meta or Hugging Face folder: its shape
        from .checkpoint.convert import detect_format, read_args

        model = dataclasses.replace(read_args(*detect_format(Path(args.model))), **overrides)
    elif args.model.endswith(".json") or os.sep in args.model:
        model = _model_from_json(Path(args.model), overrides)
    else:
        model = ModelArgs.from_preset(args.model, **overrides)
    if model.vocab_size <= 0:
        raise ValueError(f"{args.model} leaves vocab_size to the tokenizer ({model.vocab_size}): "
                         "pass --vocab-size N (32000 for Llama 2's tokenizer)")
    seq_len = args.seq_len or min(model.max_seq_len, 8192)
    workload = Workload(
        seq_len=seq_len, micro_batch=args.micro_batch,
        global_batch=parse_global_batch(args.global_batch, seq_len) if args.global_batch else 0,
        param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype, grad_sync=args.grad_sync,
        compile=args.compile,
    )
    hardware = _plan_hardware(args)
    plan = make_plan(model, workload, hardware, allow_cross_node_mp=args.allow_cross_node_mp,
                     zero2=args.zero2, ac_every=args.ac_every, sequence_parallel=not args.no_sequence_parallel)
    print(format_plan(plan, top=args.top, model_name=Path(args.model).name))
    return 0 if plan.fitting else 1


def _cmd_doctor(args: argparse.Namespace) -> int:
    """Check layout, environment, bandwidth per mesh dim and (with --config) the data pipeline; 1 on errors."""
    import torch.distributed as dist

    from .config import find_config, load_config
    from .diagnostics.doctor import DoctorOptions, parse_sizes, run_doctor
    from .diagnostics.timeouts import apply_env_defaults
    from .mesh import init_parallel

    config = load_config(find_config(args.config) if args.config else None, args.overrides)
    for key in ("mp", "dp_shard", "dp_replicate"):
        if getattr(args, key) is not None:
            setattr(config.parallel, key, getattr(args, key))
    options = DoctorOptions(sizes=parse_sizes(args.sizes), iters=args.iters, warmup=args.warmup,
                            ops=[op for op in args.ops.split(",") if op], busbw=not args.no_busbw,
                            data_guard=bool(args.config), out=Path(args.out) if args.out else None)
    launched = dict(os.environ)  # checked as the user set it, before hybridpar's defaults
    apply_env_defaults()  # then run the collectives with the settings training would use
    c = config.parallel
    parallel = init_parallel(mp=c.mp, dp_shard=c.dp_shard, dp_replicate=c.dp_replicate, timeout=c.init_timeout,
                             backend=c.backend or None)
    try:
        return run_doctor(config, parallel, options, environ=launched)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _cmd_hang_report(args: argparse.Namespace) -> int:
    """The watchdog's analysis, offline, over flight-recorder dumps collected from every node."""
    import json

    from .diagnostics.flight import analyse, format_report, load_dumps
    from .files import write_text_atomic

    traces, world, skipped = load_dumps(Path(args.dir))
    for path in skipped:
        print(f"hybridpar hang-report: skipped {path}: not a flight-recorder dump", file=sys.stderr)
    if not traces:
        print(f"hybridpar: error: no flight-recorder dumps in {args.dir} (the watchdog's flight_recorder_rank_R.json, "
              "or torch's TORCH_FR_DUMP_TEMP_FILE dumps, whose names end in the rank number)", file=sys.stderr)
        return 2
    world = max(world, args.world, max(traces) + 1)
    missing = sorted(set(range(world)) - set(traces))
    verdict = analyse(traces, dead=missing)
    print(format_report(verdict, f"hybridpar hang-report: {len(traces)} of {world} ranks' dumps in {args.dir}", world))
    if args.json:
        write_text_atomic(args.json, json.dumps(verdict.to_json(), indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .config import describe  # every config key, for `train --help`
    from .data.formats import BAD_RECORD_CHOICES  # one list of choices with data.on_bad_record
    parser = argparse.ArgumentParser(prog="hybridpar", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hybridpar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    mesh = sub.add_parser("mesh", help="print the rank layout of a (dp_replicate, dp_shard, mp) mesh")
    mesh.add_argument("--world", type=int, required=True, help="number of ranks")
    mesh.add_argument("--mp", type=int, default=1)
    mesh.add_argument("--dp-shard", type=int, default=-1, help="-1: the remaining ranks")
    mesh.add_argument("--dp-replicate", type=int, default=1)
    mesh.add_argument("--procs-per-node", type=int, default=0, help="to show node boundaries")
    mesh.set_defaults(func=_cmd_mesh)
    train = sub.add_parser(
        "train", help="train a model (under torchrun or srun; a world of one without)",
        epilog="Any config key can be overridden: --train.steps 20 --parallel.mp 2 --fsdp.param_dtype float32.\n"
               "The keys, their types and defaults:\n\n" + describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", default="", help="a TOML file, or a named config of hybridpar/configs (local, llama2_70b)")
    train.add_argument("--dry-run", action="store_true",
                       help="rehearse the job in this one process, as one rank of the whole world on a fake process "
                            "group: the real model building, sharding and one step on fake tensors; reports the "
                            "placements, per-rank bytes, the step's collectives, memory, the checkpoint's files and "
                            "the checks (exit 1 when one fails). No GPU, data or launcher needed")
    train.add_argument("--world", type=int, default=0, help="--dry-run: the job's number of ranks (default: "
                                                            "WORLD_SIZE, or mp x dp_shard x dp_replicate)")
    train.add_argument("--dry-run-rank", type=int, default=0, help="--dry-run: the rank to play (default 0)")
    train.add_argument("--dry-run-json", default="", help="--dry-run: also write the report as JSON here")
    train.add_argument("--gpu-mem-gb", type=float, default=80.0,
                       help="--dry-run: GiB per GPU, for the memory check (default 80)")
    train.add_argument("--gpus-per-node", type=int, default=8, help="--dry-run: GPUs per node (default 8)")
    train.add_argument("--gpu", default="a100", choices=GPU_NAMES,
                       help="--dry-run: the GPU of the planner's step-time estimate (default a100)")
    train.set_defaults(func=_cmd_train)
    convert = sub.add_parser("convert", help="convert a checkpoint: hybridpar (dcp), Meta consolidated, Hugging Face")
    convert.add_argument("src", help="a hybridpar checkpoint (or a folder of them: the newest), a Meta folder or a Hugging Face folder")
    convert.add_argument("dst", help="the folder to write")
    convert.add_argument("--to", required=True, choices=("dcp", "meta", "hf"))
    convert.add_argument("--mp", type=int, default=None, help="model-parallel size of the Meta files written")
    convert.add_argument("--load-mp", type=int, default=1,
                         help="model-parallel size to load at (under torchrun: spreads the work; default 1)")
    convert.add_argument("--tokenizer", default=None,
                         help="--to hf: the model's tokenizer (a tokenizer.model, tokenizer.json or their folder): "
                              "its files are copied into the folder and its bos/eos ids go into config.json")
    convert.add_argument("--bos-id", type=int, default=None,
                         help="--to hf: config.json's bos_token_id (default: the tokenizer's, a Hugging Face source's, "
                              "else 128000 for Llama 3's 128256-token vocabulary and Llama 2's 1 otherwise)")
    convert.add_argument("--eos-id", type=int, default=None,
                         help="--to hf: config.json's eos_token_id (default: as --bos-id: 128001 or Llama 2's 2)")
    convert.add_argument("--max-seq-len", type=int, default=None,
                         help="--to hf/dcp: the context length recorded (max_position_embeddings); default: the "
                              "source's max_seq_len (2048 for a Meta folder, whose params.json has none)")
    convert.set_defaults(func=_cmd_convert)
    verify = sub.add_parser("verify", help="check a checkpoint folder's (or a token store's) files against the "
                                           "checksums saved with it")
    verify.add_argument("path", help="one checkpoint folder, e.g. checkpoints/step-00000100, or a token store")
    verify.set_defaults(func=_cmd_verify)
    prep = sub.add_parser("prepare", help="tokenise corpus files (parquet, datasets folders, jsonl[.gz|.zst], txt) "
                                          "into a token store that data.source accepts")
    prep.add_argument("sources", nargs="*", help="files or folders, read in the order given (folders sorted by path)")
    prep.add_argument("--tokenizer", help="a tokenizer.model, tokenizer.json or their folder")
    prep.add_argument("--out", required=True, help="the store folder")
    prep.add_argument("--workers", type=int, default=0, help="processes (default: every core this process may use)")
    prep.add_argument("--part", default="0/1", help="I/N: prepare share I of N (a Slurm array, several nodes)")
    prep.add_argument("--merge", action="store_true", help="write the manifest once every part is done")
    prep.add_argument("--unit-mb", type=float, default=64.0,
                      help="input per unit of work, in MB: a parquet row group or arrow batch at least (default 64)")
    prep.add_argument("--text-field", default="text", help="the jsonl field or table column holding the text")
    prep.add_argument("--val-fraction", type=float, default=0.0,
                      help="this share of the documents, whole, goes to the store's validation part")
    prep.add_argument("--on-bad-record", default="error", choices=BAD_RECORD_CHOICES,
                      help="a record whose text is missing, null or not a string: stop naming it, or skip and count it")
    prep.set_defaults(func=_cmd_prepare)
    gen = sub.add_parser("generate", help="continue prompts with a trained model (greedy or top-p, KV cache)")
    gen.add_argument("--checkpoint", required=True, help="a hybridpar checkpoint (or a folder of them), a Meta folder or a Hugging Face folder")
    gen.add_argument("--tokenizer", required=True,
                     help="the tokenizer the model was trained with: a tokenizer.model (sentencepiece, or Llama 3's "
                          "tiktoken file), a Hugging Face tokenizer.json, or a folder holding one")
    gen.add_argument("--prompt", action="append", dest="prompts", required=True, help="repeat for a batch")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=0.9)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--mp", type=int, default=1, help="model-parallel size (run under torchrun with that many ranks)")
    gen.add_argument("--dtype", choices=dtypes.NAMES, default=None)
    gen.set_defaults(func=_cmd_generate)
    doctor = sub.add_parser(
        "doctor", help="check mesh layout, NCCL/gloo environment, bus bandwidth per mesh dim and the data pipeline",
        epilog="Run under the job's launcher (torchrun, srun); exit code 1 when a check finds an error. "
               "Config keys can be overridden as for train: --parallel.mp 2",
    )
    doctor.add_argument("--config", default="",
                        help="the training config (TOML or preset name): its mesh, timeouts and data pipeline are checked")
    doctor.add_argument("--mp", type=int, default=None, help="shorthand for --parallel.mp")
    doctor.add_argument("--dp-shard", type=int, default=None, help="shorthand for --parallel.dp_shard")
    doctor.add_argument("--dp-replicate", type=int, default=None, help="shorthand for --parallel.dp_replicate")
    doctor.add_argument("--sizes", default="4K:64M",
                        help="buffer sizes: MIN:MAX[:FACTOR] (default factor 4) or a list, e.g. 4K,1M (default 4K:64M)")
    doctor.add_argument("--iters", type=int, default=5, help="timed iterations per size (default 5)")
    doctor.add_argument("--warmup", type=int, default=2, help="untimed iterations per size (default 2)")
    doctor.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter", help="collectives to time")
    doctor.add_argument("--no-busbw", action="store_true", help="skip the bandwidth measurement")
    doctor.add_argument("--out", default="", help="also write the report as JSON here (rank 0)")
    doctor.set_defaults(func=_cmd_doctor)
    hang = sub.add_parser("hang-report", help="explain a hang from the flight-recorder dumps of every rank")
    hang.add_argument("dir", help="a folder with one dump per rank (e.g. the run folder's flight_recorder/)")
    hang.add_argument("--world", type=int, default=0, help="number of ranks, if the dumps do not say (nccl dumps)")
    hang.add_argument("--json", default="", help="also write the verdict as JSON here")
    hang.set_defaults(func=_cmd_hang_report)
    plan = sub.add_parser(
        "plan", help="estimate per-GPU memory and step time of every layout, best first",
        epilog="Example: hybridpar plan --model llama3_70b --gpus 128 --gpu h100 --global-batch 4Mtok. "
               "Measure your bandwidths with `hybridpar doctor`. Exit code 1 when no layout fits.",
    )
    plan.add_argument("--published", action="store_true",
                      help="print the planner against published training runs (torchtitan, Llama 3) and exit")
    plan.add_argument("--model", help="a preset name (llama3_70b, ...), Meta's params.json, a Hugging Face config.json, or a checkpoint "
                           "folder of any format")
    plan.add_argument("--vocab-size", type=int, default=0, help="for a params.json with vocab_size -1 (Llama 2)")
    plan.add_argument("--gpus", type=int, help="number of GPUs (the world size)")
    plan.add_argument("--gpu", default="a100", choices=(*GPU_NAMES, "cpu"),
                      help="the accelerator: its peak, memory, bandwidths and sustained fractions "
                           "(hybridpar/plan/hardware.py states each); cpu measures this machine (default a100)")
    plan.add_argument("--gpu-mem-gb", type=float, help="memory per GPU in GiB (default: --gpu's; 80 for 80 GB cards)")
    plan.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 8; cpu: all on one node)")
    plan.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (default: max_seq_len, at most 8192)")
    plan.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch per dp rank (default 1)")
    plan.add_argument("--global-batch", default="",
                      help="per step: sequences (512) or tokens (4Mtok); default: one micro-batch per dp rank")
    plan.add_argument("--param-dtype", default="bf16", choices=dtypes.ALIASES,
                      help="FSDP compute dtype; master weights, gradients and AdamW stay fp32 (default bf16)")
    plan.add_argument("--grad-sync", default="last", choices=("last", "every"),
                      help="train.grad_sync: with accumulation, reduce-scatter after the last micro-batch "
                           "(keeps unsharded gradients) or after every one (sharded, more traffic)")
    plan.add_argument("--reduce-dtype", default="fp32", choices=dtypes.ALIASES,
                      help="gradient reduction dtype (default fp32)")
    plan.add_argument("--compile", action="store_true", help="plan with train.compile (fused elementwise chains)")
    plan.add_argument("--peak-tflops", type=float, help="dense bf16 TFLOP/s per GPU, the MFU denominator")
    plan.add_argument("--gemm-efficiency", type=float, help="fraction of the peak large matmuls sustain")
    plan.add_argument("--attention-efficiency", type=float, help="fraction of the peak flash attention sustains")
    plan.add_argument("--memory-gbs", type=float, help="device memory bandwidth, GB/s")
    plan.add_argument("--intra-node-gbs", type=float,
                      help="bus bandwidth inside a node, GB/s as nccl-tests reports it (hybridpar doctor measures it)")
    plan.add_argument("--inter-node-gbs", type=float, help="bus bandwidth between nodes per GPU, GB/s")
    plan.add_argument("--reserve-gb", type=float,
                      help="GiB per GPU kept free for the CUDA context, NCCL and fragmentation (default 4)")
    plan.add_argument("--allow-cross-node-mp", action="store_true", help="also consider mp > GPUs per node")
    plan.add_argument("--zero2", action="store_true", help="also consider not resharding after forward (ZeRO-2)")
    plan.add_argument("--no-sequence-parallel", action="store_true",
                      help="plan without sequence parallelism (parallel.sequence_parallel = false)")
    plan.add_argument("--ac-every", type=int, default=2, help="selective AC: checkpoint every k-th block (default 2)")
    plan.add_argument("--top", type=int, default=10, help="layouts to list (default 10)")
    plan.set_defaults(func=_cmd_plan)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command in ("train", "doctor"):
        args.overrides = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except Exception as err:  # noqa: BLE001 - reported below, then the exit code says it failed
        if os.environ.get("HYBRIDPAR_TRACEBACK"):
            raise
        return _report_error(err, getattr(args, "log_dir", None))


def _report_error(error: Exception, log_dir: Optional[Path]) -> int:
    """One screen per failure. An error every rank raises alike (bad config, mesh sizes, a refusal,
    the data guard, a non-finite loss) is printed once, by rank 0, as its message; bad input raised
    by some ranks only, with the rank; anything else with its traceback. Every rank's traceback
    goes to `<run_dir>/logs/rank-R.log`, which the message names."""
    from .ranks import raised_by_every_rank

    rank = os.environ.get("RANK")
    log = _log_traceback(error, log_dir, rank or "0")
    where = f" (tracebacks: {log.parent / 'rank-*.log'})" if log else " (HYBRIDPAR_TRACEBACK=1 shows the traceback)"
    if raised_by_every_rank(error):
        if rank in (None, "0"):
            print(f"hybridpar: error: {error}{where}", file=sys.stderr, flush=True)
        return 2
    if isinstance(error, (ValueError, FileNotFoundError)):  # bad input: one clear line
        print(f"hybridpar: error{f' (rank {rank})' if rank else ''}: {error}{where}", file=sys.stderr, flush=True)
        return 2
    raise error


def _log_traceback(error: Exception, log_dir: Optional[Path], rank: str) -> Optional[Path]:
    import traceback

    from .files import write_text_atomic

    if log_dir is None:
        return None
    path = log_dir / f"rank-{rank}.log"
    text = f"hybridpar {' '.join(sys.argv[1:])}\n" + "".join(traceback.format_exception(error))
    try:
        write_text_atomic(path, text)
    except OSError:
        return None
    return path
