"""torchtitan's own Llama 3 at a given shape, trained for a few timed steps: the reference beside hybridpar.

Standalone (hybridpar never imports it; it imports nothing of hybridpar). It builds the model with
torchtitan's code and applies torchtitan's own functions in the order its `parallelize_llama` does:
selective activation checkpointing (`apply_ac`, op level: torchtitan's save list, every second
matmul recomputed), per-TransformerBlock `torch.compile` (`apply_compile`, fullgraph, inductor; the
loss compiled too, torchtitan's default components) and FSDP2 (`apply_fsdp`, MixedPrecisionPolicy
param bfloat16 / reduce float32) on a world-1 mesh. torchtitan itself skips FSDP at world 1 and
uses autocast instead; FSDP is applied here so that both sides run the same wrapping. Then meta
init, `to_empty`, `init_weights`, and torchtitan's step: cross-entropy summed over all tokens /
token count, backward, `clip_grad_norm_` (1.0), AdamW from `build_optimizers` (lr 3e-4, fused).
Inputs are random token ids (one fixed batch, so the loss falls when training works).

Last line printed, also written to --json:  TITAN_JSON {"ok": true, "tokens_per_s": ..., ...}
Any failure (no torchtitan, another API, out of memory) ends the same way with exit 0:
  TITAN_JSON {"ok": false, "why": "<stage>: <exception type>: <message>"}
--ac N takes torchtitan's layer-selective AC instead (every Nth block fully recomputed).
--float8 RECIPE first converts the model on meta with torchtitan's own float8 converter (the
`quantize.linear.float8` model converter of its Trainer, torchao's Float8Linear, its llama3
configs' filter: `output` stays bf16), set as torchtitan's float8 docs run each recipe: rowwise by
recipe name; tensorwise with FSDP's float8 all-gather and the scales precomputed by the
converter's hook after each optimizer step. torchtitan enables that all-gather only where it
shards (dp_shard > 1); FSDP is applied here at world 1, and the all-gather with it. Off CUDA the
converter emulates the float8 matmuls, eagerly only (it refuses compile there).
Written for torchtitan 0.2.2 (Feb 2026, its CI on the torch nightlies that became 2.11; run here on
torch 2.13 CPU). Importing its llama3 package needs, besides what the GPU machine has: tyro,
docstring-parser, typeguard, torchdata, datasets 4.7, dill, multiprocess (carried as wheels), triton.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta


FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--n-layers", type=int, default=32)
    p.add_argument("--n-heads", type=int, default=32)
    p.add_argument("--n-kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--ffn-dim-multiplier", type=float, default=1.3)
    p.add_argument("--multiple-of", type=int, default=1024)
    p.add_argument("--rope-theta", type=float, default=500000.0)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1, help="micro batch (sequences a step)")
    p.add_argument("--ac", default="op",
                   help="activation checkpointing: 'op' (selective, op level), N (selective, every Nth "
                        "block), 'full' or 'none'")
    p.add_argument("--compile", action="store_true", help="torch.compile each block and the loss")
    p.add_argument("--float8", choices=FLOAT8_RECIPES, default="none",
                   help="torchtitan's float8 training: rowwise, or tensorwise with FSDP's float8 all-gather")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--json", default=None, help="also write the JSON object here")
    args = p.parse_args(argv)
    if not (args.ac in ("op", "full", "none") or args.ac.isdigit()):
        p.error(f"--ac {args.ac!r}: give 'op', 'full', 'none' or a block count such as 2")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    return args


class Stage:
    """The step under way, named in the failure line."""
    name = "start"


def one_line(err: BaseException, limit: int = 400) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:limit]}"


def init_process_group(torch, device: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "MASTER_PORT" not in os.environ:  # world 1: any free local port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    backend = "nccl" if device == "cuda" else "gloo"
    kwargs = {"device_id": torch.device("cuda", 0)} if device == "cuda" else {}
    dist.init_process_group(backend, rank=0, world_size=1, timeout=timedelta(seconds=120), **kwargs)


def accepted(fn, **kwargs) -> dict:
    """The keyword arguments that `fn` takes (torchtitan's signatures move between releases)."""
    import inspect

    names = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in names}


def wrapped(model) -> dict:
    """How many blocks torchtitan's functions wrapped: evidence that AC, compile and FSDP took."""
    from torch._dynamo.eval_frame import OptimizedModule
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    def count(cls) -> int:  # isinstance: fully_shard renames each class it wraps (FSDP<name>)
        return sum(isinstance(m, cls) for m in model.modules())

    return {"blocks": len(model.layers), "checkpointed": count(CheckpointWrapper),
            "compiled": count(OptimizedModule), "fsdp_units": count(FSDPModule)}


class _ShardedDims:
    """torchtitan's ParallelDims as its float8 converter reads it, with FSDP sharding: it gathers
    weights in float8 only where dp_shard > 1, and here FSDP is applied at world 1 too."""

    dp_shard_enabled = True

    def __init__(self, dims) -> None:
        self._dims = dims

    def __getattr__(self, name: str):
        return getattr(self._dims, name)


def convert_float8(args, job, model, parallel_dims):
    """torchtitan's float8 converter applied to `model` (on meta) as its Trainer applies
    `model.converters`; (the converters, what they did)."""
    import torchtitan.components.quantization  # noqa: F401 - registers torchtitan's converters
    from torchtitan.protocols.model_converter import build_model_converters

    job.model.converters = ["quantize.linear.float8"]
    float8 = job.quantize.linear.float8
    float8.filter_fqns = ["output"]  # torchtitan's llama3 train configs
    float8.emulate = args.device != "cuda"
    if args.float8 == "rowwise":
        float8.recipe_name = "rowwise"
    else:  # tensorwise: torchao's default config, as torchtitan builds it without a recipe name
        float8.enable_fsdp_float8_all_gather = True
        float8.precompute_float8_dynamic_scale_for_fsdp = True
    converters = build_model_converters(job, _ShardedDims(parallel_dims))
    converters.convert(model)
    found = [c for c in converters.converters if hasattr(c, "config")]
    config = found[0].config if found else None
    return converters, {
        "recipe": args.float8, "emulate": float8.emulate, "filter_fqns": list(float8.filter_fqns),
        "linears": sum(type(m).__name__ == "Float8Linear" for m in model.modules()),
        "fsdp_float8_all_gather": bool(getattr(config, "enable_fsdp_float8_all_gather", False)),
        "precompute_scales": bool(getattr(found[0], "precompute_scale", False)) if found else False}


def build(args, torch, stage: Stage):
    """torchtitan's model, parallelized the way its parallelize_llama does; (model, loss_fn, optimizers, info)."""
    stage.name = "import torchtitan's llama3"
    import torchtitan
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import JobConfig
    from torchtitan.config.job_config import ActivationCheckpoint, Compile, Optimizer
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import clip_grad_norm_
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs
    from torchtitan.models.llama3.infra import parallelize as titan_par
    from torch.distributed.device_mesh import init_device_mesh

    stage.name = "model args"
    model_args = TransformerModelArgs(
        dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
        vocab_size=args.vocab, ffn_dim_multiplier=args.ffn_dim_multiplier, multiple_of=args.multiple_of,
        rope_theta=args.rope_theta, max_seq_len=args.seq)
    job = JobConfig()
    job.compile = Compile(enable=args.compile, components=["model", "loss"], backend="inductor")
    job.activation_checkpoint = ActivationCheckpoint(
        mode="selective" if args.ac == "op" or args.ac.isdigit() else args.ac,
        selective_ac_option=args.ac if args.ac != "full" and args.ac != "none" else "2")
    job.training.seq_len = args.seq
    model_args.update_from_config(job)

    stage.name = "build on meta"
    with torch.device("meta"):
        model = Transformer(model_args)
    dims = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    parallel_dims = ParallelDims(**accepted(ParallelDims, **dims))
    converters, info = None, {}
    if args.float8 != "none":  # where torchtitan's Trainer converts: on meta, before parallelizing
        stage.name = "float8 conversion"
        converters, info["float8"] = convert_float8(args, job, model, parallel_dims)
    n_params, flops_per_token = model_args.get_nparams_and_flops(model, args.seq)

    # the order of torchtitan's parallelize_llama: AC, then per-block compile, then FSDP
    if job.activation_checkpoint.mode != "none":
        stage.name = "apply_ac"
        titan_par.apply_ac(model, job.activation_checkpoint, **accepted(
            titan_par.apply_ac, model_compile_enabled=args.compile,
            op_sac_save_list=getattr(titan_par, "_op_sac_save_list", None), base_folder=""))
    if args.compile:
        stage.name = "apply_compile"
        titan_par.apply_compile(model, job.compile)
    stage.name = "apply_fsdp"
    mesh = init_device_mesh(args.device, (1,), mesh_dim_names=("fsdp",))
    titan_par.apply_fsdp(model, mesh, **accepted(
        titan_par.apply_fsdp, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, pp_enabled=False,
        cpu_offload=False, reshard_after_forward_policy="default"))

    info["wrapped"] = wrapped(model)
    stage.name = "init weights"
    model.to_empty(device=args.device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()

    stage.name = "optimizer"
    job.optimizer = Optimizer(name="AdamW", lr=args.lr, implementation="fused")
    optimizers = build_optimizers(**accepted(build_optimizers, model_parts=[model],
                                             optimizer_config=job.optimizer, parallel_dims=parallel_dims))
    if converters is not None:  # the Trainer's hook: the float8 scales precomputed after each step
        optimizers.register_step_post_hook(lambda *_, **__: converters.post_optimizer_hook([model]))
    loss_fn = build_cross_entropy_loss(job)
    info.update(torchtitan_version=getattr(torchtitan, "__version__", "unknown"), n_params=int(n_params),
                flops_per_token_titan=float(flops_per_token))
    return model, loss_fn, optimizers, clip_grad_norm_, info


def train(args, torch, stage: Stage) -> dict:
    stage.name = "process group"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
        torch.cuda.set_device(0)
    init_process_group(torch, args.device)
    torch.manual_seed(0)
    model, loss_fn, optimizers, clip_grad_norm_, info = build(args, torch, stage)

    stage.name = "data"
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=args.device,
                        generator=torch.Generator(args.device).manual_seed(0))
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    n_tokens = labels.numel()
    params = [p for p in model.parameters() if p.requires_grad]

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    def step():  # torchtitan's train_step at one micro batch, no pipeline
        optimizers.zero_grad()
        pred = model(inputs)
        loss = loss_fn(pred, labels) / n_tokens
        del pred
        loss.backward()
        clip_grad_norm_(params, 1.0, foreach=True)
        optimizers.step()
        return loss.detach()

    times, losses, warmup_peak = [], [], 0
    total = args.warmup + args.steps
    for i in range(total):
        stage.name = f"step {i + 1} of {total}" + (" (warm-up)" if i < args.warmup else "")
        if i == args.warmup and args.device == "cuda":  # warm-up's peak kept; the timed steps' alone next
            warmup_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        loss = step()
        sync()
        took = time.perf_counter() - start
        losses.append(float(loss.item()))
        if i >= args.warmup:
            times.append(took)
        print(f"titan: {stage.name}: {took:.3f} s, loss {losses[-1]:.4f}", file=sys.stderr, flush=True)

    median = statistics.median(times)
    if "float8" in info:  # evidence of the converter's hook: the weights whose scale it precomputed
        info["float8"]["precomputed_scales"] = sum(
            getattr(getattr(m.weight, "_local_tensor", None), "_precomputed_scale", None) is not None
            for m in model.modules() if type(m).__name__ == "Float8Linear")
    cuda = args.device == "cuda"
    timed_peak = torch.cuda.max_memory_allocated() if cuda else 0
    return {"ok": True, **info, "torch": torch.__version__, "device": args.device,
            "card": torch.cuda.get_device_name(0) if cuda else "cpu",
            "tokens_per_s": args.batch * args.seq / median, "step_s_median": median,
            "step_s": times, "peak_mem_gib": max(warmup_peak, timed_peak) / 2 ** 30,  # the whole run, as hybridpar's
            "peak_mem_gib_timed": timed_peak / 2 ** 30,
            "reserved_mem_gib_timed": torch.cuda.max_memory_reserved() / 2 ** 30 if cuda else 0.0,
            "loss_first": losses[0], "loss_last": losses[-1], "compile": args.compile,
            "shape": {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads,
                      "n_kv_heads": args.n_kv_heads, "vocab": args.vocab, "seq": args.seq, "batch": args.batch,
                      "ffn_dim_multiplier": args.ffn_dim_multiplier, "multiple_of": args.multiple_of,
                      "rope_theta": args.rope_theta},
            "settings": {"ac": "none" if args.ac == "none" else "full" if args.ac == "full" else
                         "selective op" if args.ac == "op" else f"selective every {args.ac} blocks",
                         "compile": "per TransformerBlock (fullgraph, inductor) + loss" if args.compile else "eager",
                         "mixed_precision": "FSDP2 param bfloat16, reduce float32", "mesh": "world 1, FSDP2",
                         "float8": args.float8,
                         "optimizer": f"AdamW fused, lr {args.lr}, betas (0.9, 0.95), wd 0.1, clip 1.0",
                         "warmup": args.warmup, "steps": args.steps}}


def emit(result: dict, path) -> None:
    line = "TITAN_JSON " + json.dumps(result)
    if path:
        try:
            with open(path, "w") as f:
                f.write(json.dumps(result, indent=1) + "\n")
        except OSError as err:  # the printed line still carries the result
            print(f"titan: cannot write {path}: {one_line(err)}", file=sys.stderr)
    print(line, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    stage = Stage()
    result: dict
    try:
        stage.name = "import torch"
        import torch

        result = train(args, torch, stage)
    except (Exception, KeyboardInterrupt) as err:  # the caller's table shows this one line
        result = {"ok": False, "why": f"{stage.name}: {one_line(err)}", "compile": args.compile}
        if args.float8 != "none":
            result["float8"] = {"recipe": args.float8}
        if "torch" in sys.modules:
            result["torch"] = sys.modules["torch"].__version__
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # shutting down: the result is already made
            pass
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
