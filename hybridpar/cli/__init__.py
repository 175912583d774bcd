"""The `hybridpar` command (also `python -m hybridpar`): the parser, and one way of reporting a failure.

Parsing imports no torch (`--help` stays fast); hybridpar.cli.commands holds what each command does."""

from __future__ import annotations

import argparse
import difflib
import os
from typing import Callable, NamedTuple, Optional, Sequence

from .. import __version__
from ..config import dtypes
from ..reporting import let_rank_0_speak, report_error
from .commands import (cmd_convert, cmd_doctor, cmd_eval, cmd_generate, cmd_hang_report, cmd_lighthouse, cmd_mesh, cmd_plan,
                       cmd_prepare, cmd_train, cmd_verify, RunFailed)

# hybridpar.plan.hardware.GPUS's names (tests/test_plan.py holds them equal): the parser is built
# without importing the planner, which imports torch.
GPU_NAMES = ("a100", "h100", "h100-500w")


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line, naming where the flags are listed (no usage block),
    and which keeps the flags it was given (`flags`: a mistyped one is matched against them)."""

    def __init__(self, *args, **kwargs):
        self.flags: list[str] = []  # before argparse's own __init__, which adds -h/--help through add_argument
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        # (an argument group's add_argument is its own: give the flags to the parser, as every command does)
        action = super().add_argument(*args, **kwargs)
        self.flags.extend(action.option_strings)
        return action

    def error(self, message: str):
        # Under a launcher every rank parses the same argv: rank 0 alone says what is wrong.
        if os.environ.get("RANK", "0") == "0":
            self.exit(2, f"{self.prog}: error: {message} (the flags: {self.prog} --help)\n")
        let_rank_0_speak()
        self.exit(2)


class _Parsers(NamedTuple):
    """The `hybridpar` parser, and each command's own by name (in --help's order), whose errors name the command."""
    main: _Parser
    commands: dict[str, _Parser]


def build_parser() -> argparse.ArgumentParser:
    """The `hybridpar` parser: `parse_known_args(argv)` gives the namespace whose `func` runs the command, and
    the words left for train's and doctor's config overrides."""
    return _build().main


def command_names() -> tuple[str, ...]:
    """The commands `hybridpar` takes, in --help's order."""
    return tuple(_build().commands)


def _build() -> _Parsers:
    from ..config import describe  # every config key, for `train --help`
    from ..config import BAD_RECORD_CHOICES, MAX_BAD_RECORDS, MAX_DOCUMENT_BYTES  # the [data] keys' own
    parser = _Parser(prog="hybridpar", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"hybridpar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    commands: dict[str, _Parser] = {}

    def command(name: str, func: Callable[[argparse.Namespace], int], **kwargs) -> _Parser:
        """A command's parser, registered by name; `func(args)` runs it and returns the exit code."""
        commands[name] = sub.add_parser(name, **kwargs)
        commands[name].set_defaults(func=func)
        return commands[name]

    mesh = command("mesh", cmd_mesh, help="print the rank layout of a (pp, dp_replicate, dp_shard, cp, mp) mesh")
    mesh.add_argument("--world", type=int, required=True, help="number of ranks")
    mesh.add_argument("--mp", type=int, default=1)
    mesh.add_argument("--dp-shard", type=int, default=-1, help="-1: the remaining ranks")
    mesh.add_argument("--dp-replicate", type=int, default=1)
    mesh.add_argument("--cp", type=int, default=1, help="context-parallel ranks per sequence")
    mesh.add_argument("--pp", type=int, default=1, help="pipeline stages (the outermost dimension)")
    mesh.add_argument("--ep", type=int, default=1, help="expert-parallel ranks, taken from dp_shard (a mixture of "
                                                        "experts: each holds n_experts / ep of them)")
    mesh.add_argument("--procs-per-node", type=int, default=0, help="to show node boundaries")
    train = command(
        "train", cmd_train, help="train a model (under torchrun or srun; a world of one without)",
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
    train.add_argument("--json", default="", metavar="PATH", help="--dry-run: also write the report as JSON here")
    train.add_argument("--gpu-mem-gb", type=float, default=80.0,
                       help="--dry-run: GiB per GPU, for the memory check (default 80)")
    train.add_argument("--gpus-per-node", type=int, default=8, help="--dry-run: GPUs per node (default 8)")
    train.add_argument("--gpu", default="a100", choices=GPU_NAMES,
                       help="--dry-run: the GPU of the planner's step-time estimate (default a100)")
    convert = command("convert", cmd_convert,
                      help="convert a checkpoint: hybridpar (dcp), Meta consolidated, Hugging Face")
    convert.add_argument("src", help="a hybridpar checkpoint (or a folder of them: the newest), a Meta folder or a Hugging Face folder")
    convert.add_argument("dst", help="the folder to write")
    convert.add_argument("--to", required=True, choices=("dcp", "meta", "hf"))
    convert.add_argument("--mp", type=int, default=1,
                         help="model-parallel size to load at (under torchrun with that many ranks: spreads the work; "
                              "default 1)")
    convert.add_argument("--ep", type=int, default=1,
                         help="expert-parallel size to load a mixture of experts at: its experts split over that many "
                              "of the ranks --mp leaves (default 1)")
    convert.add_argument("--meta-files", type=int, default=None, metavar="N",
                         help="--to meta: the number of consolidated.NN.pth files written, the model-parallel size "
                              "Meta's code loads them at (default: --mp)")
    convert.add_argument("--overwrite", action="store_true", help="replace DST if it exists (it goes only once the "
                                                                  "new folder is complete)")
    convert.add_argument("--tokenizer", default=None,
                         help="--to hf or meta: the model's tokenizer (a tokenizer.model, tokenizer.json or their "
                              "folder; default: the one the run recorded), copied into the folder; for hf its bos/eos "
                              "ids go into config.json")
    convert.add_argument("--bos-id", type=int, default=None,
                         help="--to hf: config.json's bos_token_id (default: the tokenizer's, a Hugging Face source's, "
                              "else 128000 for Llama 3's 128256-token vocabulary and Llama 2's 1 otherwise)")
    convert.add_argument("--eos-id", type=int, default=None,
                         help="--to hf: config.json's eos_token_id (default: as --bos-id: 128001 or Llama 2's 2)")
    convert.add_argument("--max-seq-len", type=int, default=None,
                         help="--to hf/dcp: the context length recorded (max_position_embeddings); default: the "
                              "source's max_seq_len (2048 for a Meta folder, whose params.json has none)")
    convert.add_argument("--dtype", default=None, metavar="{" + ",".join(dtypes.NAMES) + "}",
                         help="--to hf: the weights' dtype (default bfloat16, as Llama is published)")
    convert.add_argument("--max-shard-size", default=None, metavar="SIZE",
                         help="--to hf: the largest safetensors file, as transformers' save_pretrained: 5GB (the "
                              "default; 10^9 bytes a GB), 500MB, 2GiB or a byte count; a larger tensor gets a file "
                              "of its own")
    verify = command("verify", cmd_verify, help="check a checkpoint folder's (or a token store's) files against "
                                                "the checksums saved with it")
    verify.add_argument("path", help="one checkpoint folder (checkpoints/step-00000100), a run's checkpoints/ "
                                     "folder (each checkpoint in it), or a token store")
    prep = command("prepare", cmd_prepare, help="tokenise corpus files (parquet, datasets folders, jsonl[.gz|.zst], "
                                                "txt) into a token store that data.source accepts")
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
                      help="a record whose text is missing, null, not a string or not Unicode text, or a .jsonl line "
                           "that is not a JSON object: stop naming it, or skip and count it")
    prep.add_argument("--max-bad-records", type=float, default=MAX_BAD_RECORDS, metavar="N",
                      help="with --on-bad-record skip, the most bad records a source file may hold: a share of its "
                           f"records below 1, else a number (data.max_bad_records; default {MAX_BAD_RECORDS:g})")
    prep.add_argument("--max-document-bytes", type=int, default=MAX_DOCUMENT_BYTES,
                      help="a record longer than this is a bad record (data.max_document_bytes; default 64 MiB)")
    gen = command("generate", cmd_generate, help="continue prompts with a trained model (greedy or top-p, KV cache)")
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
    gen.add_argument("--dtype", default=None, metavar="{" + ",".join(dtypes.NAMES) + "}",
                     help="the weights' dtype (default float32 on CPU, bfloat16 on GPU)")
    ev = command("eval", cmd_eval, help="score a checkpoint on lm-evaluation-harness tasks (under torchrun with mp x dp "
                                         "ranks, or alone); needs the eval extra")
    ev.add_argument("checkpoint", help="a hybridpar checkpoint (or a folder of them: the newest), a Meta folder or a "
                                       "Hugging Face folder")
    ev.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated (local ones with --include-path)")
    ev.add_argument("--mp", type=int, default=1, help="model-parallel size (run under torchrun: the other ranks share "
                                                     "the requests; default 1)")
    ev.add_argument("--ep", type=int, default=1, help="expert-parallel size: a mixture of experts' experts split over "
                                                     "that many of the data-parallel ranks (default 1)")
    ev.add_argument("--include-path", default=None, metavar="DIR", help="a folder of lm-eval task files (YAML) of your own")
    ev.add_argument("--limit", type=float, default=None, metavar="N",
                    help="at most N examples per task (a fraction below 1: that share of them)")
    ev.add_argument("--num-fewshot", type=int, default=None, metavar="K", help="examples shown before each question "
                                                                                "(default: the task's own)")
    ev.add_argument("--tokenizer", default=None, help="the model's tokenizer (default: the one the run recorded, or "
                                                      "the one in a Meta or Hugging Face folder)")
    ev.add_argument("--dtype", default=None, metavar="{" + ",".join(dtypes.NAMES) + "}",
                    help="the weights' dtype (default float32 on CPU, bfloat16 on GPU)")
    ev.add_argument("--json", default="", metavar="PATH",
                    help="also write the harness's results (every metric with its stderr), the task versions and "
                         "the checkpoint's step here")
    doctor = command(
        "doctor", cmd_doctor,
        help="check mesh layout, NCCL/gloo environment, bus bandwidth per mesh dim and the data pipeline",
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
    doctor.add_argument("--json", default="", metavar="PATH", help="also write the report as JSON here (rank 0)")
    lighthouse = command("lighthouse", cmd_lighthouse,
                         help="keep the quorum of a fault-tolerant job's replica groups (torchft's lighthouse)")
    lighthouse.add_argument("--port", type=int, default=29510, help="the port to listen on (0: any free one)")
    lighthouse.add_argument("--min-groups", type=int, default=1, help="the fewest replica groups of a quorum")
    lighthouse.add_argument("--join-timeout", type=float, default=10.0,
                            help="seconds a quorum waits for a live group that has not asked to join yet: above a "
                                 "step's time (a returning group meets the others' next quorum), below the groups' "
                                 "fault_tolerance.timeout (they go on without a hung group after it)")
    lighthouse.add_argument("--heartbeat-timeout", type=float, default=5.0,
                            help="seconds of silence after which a group is out of the quorum")
    hang = command("hang-report", cmd_hang_report, help="explain a hang from the flight-recorder dumps of every rank")
    hang.add_argument("dir", help="a folder with one dump per rank (e.g. the run folder's flight_recorder/)")
    hang.add_argument("--world", type=int, default=0, help="number of ranks, if the dumps do not say (nccl dumps)")
    hang.add_argument("--json", default="", metavar="PATH", help="also write the verdict as JSON here")
    plan = command(
        "plan", cmd_plan, help="estimate per-GPU memory and step time of every layout, best first",
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
    plan.add_argument("--param-dtype", default="bfloat16", metavar="{" + ",".join(dtypes.NAMES) + "}",
                      help="fsdp.param_dtype, the compute dtype; master weights, gradients and AdamW stay float32 "
                           "(default bfloat16)")
    plan.add_argument("--grad-sync", default="last", choices=("last", "every"),
                      help="train.grad_sync: with accumulation, reduce-scatter after the last micro-batch "
                           "(keeps unsharded gradients) or after every one (sharded, more traffic)")
    plan.add_argument("--reduce-dtype", default="float32", metavar="{" + ",".join(dtypes.NAMES) + "}",
                      help="fsdp.reduce_dtype, the gradient reduction dtype (default float32)")
    plan.add_argument("--compile", action="store_true", help="plan with train.compile (fused elementwise chains)")
    plan.add_argument("--float8", nargs="?", const="tensorwise", default="none", metavar="RECIPE",
                      help="plan with float8.recipe RECIPE: the blocks' linears in float8 at the card's float8 rate, "
                           "plus their casts; tensorwise (alone: the default), rowwise or rowwise_with_gw_hp")
    plan.add_argument("--float8-all-gather", action="store_true",
                      help="plan with float8.fsdp_all_gather: FSDP all-gathers those weights in float8 (tensorwise)")
    plan.add_argument("--peak-tflops", type=float, help="dense bfloat16 TFLOP/s per GPU, the MFU denominator")
    plan.add_argument("--float8-tflops", type=float, help="dense float8 TFLOP/s per GPU (default: --gpu's; 0: none)")
    plan.add_argument("--gemm-efficiency", type=float, help="fraction of the peak large matmuls sustain")
    plan.add_argument("--attention-efficiency", type=float, help="fraction of the peak flash attention sustains")
    plan.add_argument("--memory-gbs", type=float, help="device memory bandwidth, GB/s")
    plan.add_argument("--sms", type=int, help="SMs per GPU (default: --gpu's): NCCL's kernels hold 16 of them while "
                                              "FSDP's collectives overlap compute; 0: not priced")
    plan.add_argument("--intra-node-gbs", type=float,
                      help="bus bandwidth inside a node, GB/s as nccl-tests reports it (hybridpar doctor measures it)")
    plan.add_argument("--inter-node-gbs", type=float, help="bus bandwidth between nodes per GPU, GB/s")
    plan.add_argument("--reserve-gb", type=float,
                      help="GiB per GPU kept free for the CUDA context and NCCL (default 4)")
    plan.add_argument("--allocator-overhead", type=float,
                      help="what the caching allocator reserves beyond the tensors, as a fraction of them "
                           "(default 0.063, measured on an H200; cpu: 0)")
    plan.add_argument("--allow-cross-node-mp", action="store_true", help="also consider mp > GPUs per node")
    plan.add_argument("--zero2", action="store_true", help="also consider not resharding after forward (ZeRO-2)")
    plan.add_argument("--no-sequence-parallel", action="store_true",
                      help="plan without sequence parallelism (parallel.sequence_parallel = false)")
    plan.add_argument("--cp", type=int, default=0,
                      help="context parallelism: plan with this cp only (1: none); default: every cp the sequence "
                           "allows, when its activations need it (long sequences)")
    plan.add_argument("--pp", type=int, default=0,
                      help="pipeline parallelism: plan with this many stages only (1: none); default: pipeline "
                           "stages are considered when no layout fits without them")
    plan.add_argument("--ep", type=int, default=0,
                      help="expert parallelism (a mixture of experts): plan with this ep only (1: every GPU holds all "
                           "the experts); default: every ep dividing the experts and dp_shard")
    plan.add_argument("--ac-every", type=int, default=2, help="selective AC: checkpoint every k-th block (default 2)")
    plan.add_argument("--top", type=int, default=10, help="layouts to list (default 10)")
    plan.add_argument("--json", default="", metavar="PATH",
                      help="also write every layout's estimate and the best one's config as JSON here")
    return _Parsers(parser, commands)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command argv names; its exit code (a failure reported as one line: 2 for bad input, 1 internal)."""
    from ..progress import log_to_terminal

    log_to_terminal()  # the library logs; the command line shows its lines as they were always printed
    parsers = _build()
    args, extra = parsers.main.parse_known_args(argv)
    command = parsers.commands[args.command]
    if args.command in ("train", "doctor"):
        for flag in (a.split("=")[0] for a in extra if a.startswith("--")):
            if "." not in flag:  # not a config key (section.key): a mistyped flag of the command's own
                near = difflib.get_close_matches(flag, command.flags, n=1)
                command.error(f"unrecognized argument {flag}" + (f": did you mean {near[0]}?" if near else
                              "; config keys look like --train.steps 20"))
        args.overrides = extra
    elif extra:
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    # A command answers with its exit code, or raises: RunFailed once the run has a folder for tracebacks.
    try:
        return args.func(args)
    except RunFailed as failed:
        return report_error(failed.error, failed.log_dir)
    except Exception as err:  # noqa: BLE001 - reported below, then the exit code says it failed
        return report_error(err, None)
