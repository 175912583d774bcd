"""The `hybridpar` command (also `python -m hybridpar`)."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

import os
import sys
from pathlib import Path

from . import __version__
from .mesh import MeshCoords, MeshSizeError, group_ranks, resolve_sizes


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
    try:
        Trainer(config).run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    """Convert a checkpoint between formats (under torchrun for large models; a world of one works)."""
    from .checkpoint.convert import convert
    from .mesh import init_parallel

    parallel = init_parallel(mp=args.load_mp)
    written = convert(Path(args.src), Path(args.dst), args.to, parallel, mp_out=args.mp)
    if parallel.rank == 0:
        print(f"wrote {written} ({args.to})")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from .generate import main_generate

    return main_generate(args)


def build_parser() -> argparse.ArgumentParser:
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
        epilog="Any config key can be overridden: --train.steps 20 --parallel.mp 2 --fsdp.param_dtype float32",
    )
    train.add_argument("--config", default="", help="a TOML file, or a preset name in launch/configs (e.g. local)")
    train.set_defaults(func=_cmd_train)
    convert = sub.add_parser("convert", help="convert a checkpoint: hybridpar (dcp), Meta consolidated, Hugging Face")
    convert.add_argument("src", help="a hybridpar checkpoint (or a folder of them: the newest) or a Meta folder")
    convert.add_argument("dst", help="the folder to write")
    convert.add_argument("--to", required=True, choices=("dcp", "meta", "hf"))
    convert.add_argument("--mp", type=int, default=None, help="model-parallel size of the Meta files written")
    convert.add_argument("--load-mp", type=int, default=1,
                         help="model-parallel size to load at (under torchrun: spreads the work; default 1)")
    convert.set_defaults(func=_cmd_convert)
    gen = sub.add_parser("generate", help="continue prompts with a trained model (greedy or top-p, KV cache)")
    gen.add_argument("--checkpoint", required=True, help="a hybridpar checkpoint (or a folder of them) or a Meta folder")
    gen.add_argument("--tokenizer", required=True, help="the sentencepiece tokenizer.model the model was trained with")
    gen.add_argument("--prompt", action="append", dest="prompts", required=True, help="repeat for a batch")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=0.9)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--mp", type=int, default=1, help="model-parallel size (run under torchrun with that many ranks)")
    gen.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    gen.set_defaults(func=_cmd_generate)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "train":
        args.overrides = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        # Bad input (config, mesh sizes, model shape, data): one clear line instead of a traceback.
        if os.environ.get("HYBRIDPAR_TRACEBACK"):
            raise
        rank = os.environ.get("RANK")
        print(f"hybridpar: error{f' (rank {rank})' if rank else ''}: {err}", file=sys.stderr)
        return 2
