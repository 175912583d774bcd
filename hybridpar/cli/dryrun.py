"""`hybridpar train --dry-run`: rehearse a job of any size in one process, before the queue.

One process plays one rank (`--dry-run-rank`) of the configured world on torch's fake process
group, whose collectives return at once. The real code runs: the mesh, the model built on the meta
device, tensor parallelism, activation checkpointing and FSDP; then one training step (forward,
backward, gradient clipping, the optimizer) on fake tensors, which have shapes and no memory. What
it reports is what that code did, not a formula: every parameter's placement and local shape,
this rank's bytes of parameters, gradients and optimizer state, and the collectives of the step per
mesh dimension (counted as they were issued, hybridpar.diagnostics.collectives). The planner adds
what a step on real tensors would hold besides (activations, gathered parameters), and the
checkpoint's files follow from the state.

The job it rehearses runs on GPUs unless parallel.backend is "gloo": the CPU fast paths
(hybridpar.fastpaths) are then off, so the collectives are the ones nccl would run. torch.compile is
not rehearsed (it compiles kernels, not layouts). A mixture of experts is routed balanced (fake tensors
have no values to route by: models.moe.balance_routing), and the report says so.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import os
import re
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..checkpoint.stages import one_module
from ..config import Config, ConfigError
from .dryrun_report import Check, DryRun, routing_text
from ..files import human_bytes
from ..mesh.layout import sizes_text
from ..progress import note

if TYPE_CHECKING:
    from ..preflight import Job

PARAM_BYTES = 4  # the trainer keeps fp32 master parameters (plan.MASTER_BYTES)


def _check(run: DryRun, name: str, fn: Callable[[], str], warn_only: bool = False) -> bool:
    """Run one check: its detail on success, the error's message on failure (a warning only, when
    `warn_only`: the run goes on)."""
    try:
        run.checks.append(Check(name, True, fn() or "ok"))
        return True
    except (ValueError, ConfigError, FileNotFoundError) as err:
        run.checks.append(Check(name, False, str(err), warning=warn_only))
        return warn_only


def dry_run(config: Union[Config, "Job"], world: Optional[int] = None, rank: int = 0, *, gpu_mem_gib: float = 80.0,
            gpus_per_node: int = 8, gpu: str = "a100", progress: bool = True) -> DryRun:
    """Rehearse `config` as rank `rank` of `world` ranks. Needs a process with no process group
    (it makes a fake one and destroys it at the end). `gpu` names the planner's hardware for the
    step-time estimate of a GPU job (hybridpar.plan.hardware). `config` may be a Job
    (hybridpar.preflight.resolve_job's): its model shape and data sources are taken as resolved,
    and `world` defaults to its world size. A config the job would refuse raises the job's error
    (hybridpar.preflight.check_config: ConfigError or MeshSizeError, one line); what only the
    rehearsal finds are checks of the report. `progress`: notes of what it does
    (hybridpar.progress.note, whatever rank it plays)."""
    from ..compat.torch import init_fake_process_group
    from ..preflight import check_config

    started = time.perf_counter()
    job = None if isinstance(config, Config) else config
    c = config if job is None else job.config
    world = world or (job.world_size if job is not None else 0)
    target = "cpu" if c.parallel.backend == "gloo" else "gpu"
    run = DryRun(world=world, rank=rank, target=target)

    def say(text: str) -> None:
        note(f"dry run: {text} [{time.perf_counter() - started:.0f} s]", enabled=progress)

    if not 0 <= rank < world:
        raise ConfigError(f"--dry-run-rank {rank} is outside the world of {world} ranks (0 to {world - 1})")
    if dist.is_initialized():
        raise RuntimeError("the dry run makes its own (fake) process group: run it outside torchrun")
    c = _the_rest(c, world)
    # The job's own checks, before anything is built: what the job would refuse is refused in its words.
    sizes, args = check_config(c, world, _shape(c, job))
    pp, dr, ds, cp, mp = sizes
    run.checks.append(Check("mesh", True, sizes_text(*sizes, ep=c.parallel.ep)))
    run.layout = f"{sizes_text(*sizes, ep=c.parallel.ep)} = {world} ranks, {c.fsdp.sharding_strategy}"
    run.pp = pp
    run.checks.append(Check("model shape", True, f"{args.num_params() / 1e9:.2f}B parameters, {args.n_heads} heads, "
                                                 f"{args.kv_heads} kv heads"))
    run.model = f"{args.num_params() / 1e9:.2f}B parameters ({args.n_layers} layers, dim {args.dim})"
    _check(run, "model parallelism inside a node",
           lambda: _inside_node(mp, gpus_per_node) if target == "gpu" else "CPU run: not applicable")
    _check(run, "batch", lambda: _batch_detail(c, ds * dr))
    # The job's nodes may see paths (and an lm-eval) this machine does not: a warning here.
    _check(run, "data", lambda: _data_detail(c, job), warn_only=True)
    if c.eval.tasks:
        _check(run, "downstream evaluation", lambda: _eval_detail(c), warn_only=True)

    init_fake_process_group(rank, world)
    try:
        with _fast_paths(target == "cpu"):
            _rehearse(run, c, world, list(sizes), args, target, gpu_mem_gib, gpus_per_node, gpu, say)
    finally:
        dist.destroy_process_group()
    return _finish(run, started)


def _the_rest(c: Config, world: int) -> Config:
    """`c` with parallel.dp_replicate = -1 (launch/slurm.sh's "the rest") resolved for `world` ranks."""
    p = c.parallel
    block = p.pp * p.mp * p.cp * p.dp_shard
    if p.dp_replicate != -1 or p.dp_shard <= 0 or world % block:
        return c
    c = copy.deepcopy(c)
    c.parallel.dp_replicate = world // block
    return c


def _rehearse(run: DryRun, c: Config, world: int, sizes: list[int], args, target: str, gpu_mem_gib: float,
              gpus_per_node: int, gpu: str, say: Callable[[str], None]) -> None:
    """The part on the fake process group: model, sharding, one step, and what they show."""
    from ..compat.torch import fake_tensors
    from ..diagnostics.collectives import CollectiveCounter, mesh_dims
    from ..mesh.device import init_parallel
    from ..parallel.fsdp import dp_mesh_for
    from ..pipeline.runner import make_runner
    from ..pipeline.schedules import StageLayout
    from ..pipeline.cutting import build_stages

    pp, dr, ds, cp, mp = sizes
    say(f"mesh of {world} ranks on a fake process group")
    parallel = init_parallel(mp=mp, dp_shard=ds, dp_replicate=dr, cp=cp, pp=pp, ep=c.parallel.ep)
    if not _check(run, "sharding strategy",
                  lambda: _strategy_detail(dp_mesh_for(c.fsdp.sharding_strategy, parallel))):
        return
    layout = StageLayout.of_config(c.parallel, args, parallel)
    what = f"this rank's pipeline stages of {run.model}" if pp > 1 else run.model
    say(f"building {what} on the meta device, tensor parallel {mp}, FSDP over {ds * dr}")
    stages = build_stages(args, parallel, layout, device=torch.device("meta"),
                          sequence_parallel=c.parallel.sequence_parallel, fsdp=c.fsdp, float8=c.float8)
    runner = make_runner(stages, layout, parallel, grad_sync=c.train.grad_sync)
    run.parameters = [row for stage in stages for row in _placements(stage)]
    if args.n_experts:
        from hybridpar.models.moe import balance_routing

        balance_routing(stages, grouped=c.fsdp.param_dtype == "bfloat16")  # fake tensors have no values to route by
        run.routing = routing_text(args, c.data.micro_batch_size * c.data.seq_len, parallel.ep)
    say("one training step on fake tensors (forward, backward, optimizer)")
    with fake_tensors(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        model = one_module(stages)  # the one model the checkpoint saves: this rank's stages under their names
        model.to_empty(device="cpu")
        with CollectiveCounter(label=mesh_dims(parallel)) as counter:
            optimizer, grads = _step(c, runner, model, parallel)
        run.state_bytes = state_bytes(model, optimizer, grads)
        run.checkpoint = _checkpoint_files(c, model, optimizer, world)
    run.collectives = counter.by_dim_and_op()
    run.expected_bytes = _expected(args, mp * pp, ds * cp)
    run.memory = _memory(c, args, parallel, gpu_mem_gib, gpus_per_node, gpu if target == "gpu" else "")
    if target == "gpu":
        _check(run, "memory", lambda: _fits(run.memory))
        if c.float8.enabled:
            _check(run, "float8 matmuls", lambda: _float8_card(c, run.memory), warn_only=True)
        if "step_s" in run.memory:
            _check(run, "communication hidden", lambda: _hidden(run.memory), warn_only=True)
    say("done")


@contextlib.contextmanager
def _fast_paths(on: bool) -> Iterator[None]:
    """The CPU fast paths for a CPU job; off for a GPU job, whose collectives are nccl's."""
    from .. import fastpaths

    before = os.environ.get(fastpaths.ENV)
    os.environ[fastpaths.ENV] = "1" if on and before != "0" else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(fastpaths.ENV, None)
        else:
            os.environ[fastpaths.ENV] = before


def _finish(run: DryRun, started: float) -> DryRun:
    run.seconds = time.perf_counter() - started
    return run


def _inside_node(mp: int, gpus_per_node: int) -> str:
    if gpus_per_node % mp:
        raise ValueError(f"mp = {mp} does not divide the {gpus_per_node} GPUs of a node: some tensor-parallel "
                         "groups span two nodes, and their every-layer traffic leaves the node")
    return f"mp {mp} divides the {gpus_per_node} GPUs of a node"


def _batch_detail(c: Config, dp: int) -> str:
    d, t = c.data, c.train
    sequences = d.micro_batch_size * t.grad_accum * dp
    return (f"global batch {sequences} sequences = micro_batch_size {d.micro_batch_size} x grad_accum {t.grad_accum} "
            f"x dp {dp}, {sequences * d.seq_len:,} tokens per step")


def _shape(c: Config, job: Optional["Job"]):
    """The model's shape: the job's (read once, by resolve_job), else the config's; a vocab_size the
    tokenizer gives (Llama 2's -1) from the tokenizer."""
    from ..preflight import model_shape

    args = job.args if job is not None else model_shape(c)
    return args if args.vocab_size > 0 else dataclasses.replace(args, vocab_size=_vocab(c))


def _data_detail(c: Config, job: Optional["Job"] = None) -> str:
    """The sources and tokenizer the config names, found (not read: no tokenizing here); with a
    job, the complete token stores it found."""
    from ..data.sources import resolve_sources, source_key, source_name
    from ..data.sources import is_store
    from ..preflight import check_paths

    def named(source: str) -> str:
        if is_store(source):
            return f"the token store {source}"
        files = job.sources[source_key(source)] if job is not None else resolve_sources(source)
        store = job.stores.get(source_key(source)) if job is not None else None
        return source_name(files) + (f", its token store {store} complete" if store else "")

    if job is None:
        check_paths(c)  # the paths the job names, as the trainer checks them first (resolve_job did)
    d = c.data
    blend = ", ".join(f"{e['name']} {e['weight']:g} ({named(e['source'])})" for e in d.sources)
    found = [f"a blend of {blend}" if d.sources else named(d.source)]
    if d.val_source:
        found.append(f"validation {named(d.val_source)}")
    found.append(f"tokenizer {d.tokenizer}" if d.tokenizer else
                 f"a {d.tokenizer_vocab_size:,}-token tokenizer trained on the source")
    return "; ".join(found)


def _eval_detail(c: Config) -> str:
    """What the [eval] section needs of the machine (lm-eval, eval.include_path), as the job checks it."""
    from ..preflight import check_eval_setup

    check_eval_setup(c)
    return f"{len(c.eval.tasks)} task(s) in the loop: lm-eval installed"


def _vocab(c: Config) -> int:
    """The tokenizer's vocabulary, for a model whose vocab_size comes from it (Llama 2's -1)."""
    if c.data.tokenizer and Path(c.data.tokenizer).exists():
        from ..data import Tokenizer

        return Tokenizer(c.data.tokenizer).vocab_size
    return c.data.tokenizer_vocab_size  # the trainer trains one of this size


def _strategy_detail(mesh) -> str:
    return f"FSDP over the {'x'.join(str(s) for s in mesh.mesh.shape)} mesh {mesh.mesh_dim_names}"


def _step(c: Config, runner, model: torch.nn.Module, parallel) -> tuple[torch.optim.Optimizer, list]:
    """The trainer's step (hybridpar.train.step, the runner's rehearsal) on fake tensors; (optimizer, the
    gradients after backward). The batch has no ignored targets, so its target count is known
    without reading it."""
    from ..train import stop
    from ..train.optim import build_optimizer, clip_gradients
    from ..train.step import context_parts, count_targets, gradient_scale

    d, t = c.data, c.train
    optimizer = build_optimizer(runner.modules, c.optim)
    tokens = torch.zeros(d.micro_batch_size, d.seq_len, dtype=torch.long)
    batches = context_parts([(tokens, tokens)] * t.grad_accum, parallel)
    count_targets(batches, parallel, parallel.device, also_sum=[0.0])  # the data stop's flag
    global_targets = d.micro_batch_size * d.seq_len * t.grad_accum * parallel.dp_size
    runner.total(runner.rehearse(batches, scale=gradient_scale(parallel, global_targets)))
    # The step's end: clipping over every rank (the stop vote riding on it), the optimizer.
    params = list(model.parameters())
    clip_gradients(params, c.optim.grad_clip, parallel.device, also_sum=[0.0] * len(stop.STOP_SIGNALS))
    grads = [p.grad for p in params if p.grad is not None]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer, grads


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grads: list) -> dict:
    """This rank's bytes of parameters, gradients (as backward left them) and optimizer state: the
    local shards' elements; the same count for a real run and a dry one."""
    optimizer_state = [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {"parameters": _nbytes(model.parameters()), "gradients": _nbytes(grads),
            "optimizer": _nbytes(optimizer_state)}


def _expected(args, mp: int, ds: int) -> dict:
    """The ideal share: the model's fp32 state divided over mp x ds ranks, ds = dp_shard x cp (FSDP's
    shards; AdamW: two moments); at pp > 1 mp is pp x mp (each stage holds its share of the layers)."""
    total = args.num_params() * PARAM_BYTES
    share = total / (mp * ds)
    return {"parameters": share, "gradients": share, "optimizer": 2 * share}


_LAYER = re.compile(r"^layers\.(\d+)\.")


def _placements(model: torch.nn.Module) -> list[dict]:
    """Every parameter's global shape, placement per mesh dimension and local shape; the blocks'
    alike parameters grouped (layers.*.attention.wq.weight, and which layers)."""
    groups: dict[tuple, dict] = collections.OrderedDict()
    for name, param in model.named_parameters():
        layer = _LAYER.match(name)
        pattern = _LAYER.sub("layers.*.", name)
        if isinstance(param, DTensor):
            dims = param.device_mesh.mesh_dim_names or tuple(str(i) for i in range(param.device_mesh.ndim))
            placement = ", ".join(f"{dim}: {_placement(pl)}" for dim, pl in zip(dims, param.placements))
            local = tuple(param.to_local().shape)
        else:
            placement, local = "not distributed", tuple(param.shape)
        key = (pattern, tuple(param.shape), placement, local, str(param.dtype))
        row = groups.setdefault(key, {"name": pattern, "global_shape": list(param.shape), "placement": placement,
                                      "local_shape": list(local), "dtype": str(param.dtype).replace("torch.", ""),
                                      "layers": []})
        if layer:
            row["layers"].append(int(layer.group(1)))
    return list(groups.values())


def _placement(pl) -> str:
    if pl.is_replicate():
        return "replicate"
    dim = getattr(pl, "dim", None)
    if dim is None:
        return str(pl)
    # FSDP's shard of a tensor-parallel parameter split on the same dim: strided (_StridedShard)
    return f"shard(dim {dim}{', strided' if 'Strided' in type(pl).__name__ else ''})"


def _checkpoint_files(c: Config, model, optimizer, world: int) -> dict:
    """The files a checkpoint of this run holds (checkpoint.dcp): this rank's .distcp file from its
    share of the state DCP saves, the folder's total from every rank's (taken as this rank's)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ..checkpoint.space import BYTES_PER_RANK, BYTES_PER_TENSOR, MARGIN, local_share

    model_sd, optim_sd = get_state_dict(model, optimizer)
    share, tensors = local_share({"model": model_sd, "optimizer": optim_sd}, world)
    per_rank = share + BYTES_PER_TENSOR * tensors
    folder = c.checkpoint_dir()
    return {"folder": f"{folder}/step-<8 digits>/", "per_rank_file": int(per_rank), "files": world + 5,
            "total": int(MARGIN * world * per_rank + BYTES_PER_RANK * world),
            "layout": [".metadata", f"__0_0.distcp ... __{world - 1}_0.distcp (one per rank)", "params.json",
                       "train_state.json", f"rng/rank0.pt ... rng/rank{world - 1}.pt", "checksums.json"]}


def _memory(c: Config, args, parallel, gpu_mem_gib: float, gpus_per_node: int, gpu: str) -> dict:
    """The planner's per-rank estimate for this layout (float8 included: hybridpar.plan prices it):
    the state above, plus what a step holds, plus a GPU's caching allocator's reserve; for a GPU job,
    also its step time on `gpu`, unless float8 is on and `gpu` has no float8 matmuls."""
    from ..plan import GIB, Layout, Workload, estimate
    from ..plan.hardware import spec

    from ..pipeline.schedules import StageLayout

    p = c.parallel
    pipeline = StageLayout.of_config(p, args, parallel)
    stages, m = pipeline.n_stages, pipeline.microbatches  # the pipeline's micro-batches: the planner's
    layout = Layout(mp=parallel.mp, dp_shard=parallel.dp_shard, dp_replicate=parallel.dp_replicate, cp=parallel.cp,
                    ac=c.fsdp.activation_checkpointing, ac_every=c.fsdp.ac_every,
                    reshard_after_forward=c.fsdp.sharding_strategy in ("full_shard", "hybrid_shard"),
                    sequence_parallel=p.sequence_parallel, pp=p.pp, pp_schedule=p.pp_schedule, v=stages // p.pp,
                    ep=parallel.ep)
    workload = Workload(seq_len=c.data.seq_len, micro_batch=c.data.micro_batch_size // m,
                        global_batch=c.data.micro_batch_size * c.train.grad_accum * parallel.dp_size,
                        param_dtype=c.fsdp.param_dtype, reduce_dtype=c.fsdp.reduce_dtype,
                        grad_sync=c.train.grad_sync, compile=c.train.compile, float8=c.float8.recipe,
                        float8_all_gather=c.float8.fsdp_all_gather)
    # A CPU job's memory has no caching allocator's reserve.
    hw = spec(gpu or "a100", parallel.world_size, gpu_mem_gib=gpu_mem_gib, gpus_per_node=gpus_per_node,
              **({} if gpu else {"allocator_overhead": 0.0}))
    timed = bool(gpu) and (workload.float8 == "none" or hw.float8_peak_flops > 0)
    if workload.float8 != "none" and not hw.float8_peak_flops:
        # The memory does not depend on the float8 rate (a CPU emulates it; a card without it gets no time).
        hw = dataclasses.replace(hw, float8_peak_flops=hw.peak_flops)
    est = estimate(args, layout, workload, hw)
    m = est.memory
    out = {"activations": m.activations, "gathered_params": m.gathered_params, "grad_buffers": m.grad_buffers,
           "accumulated_grads": m.accumulated_grads, "transient": m.transient, "allocator": m.allocator,
           "total": m.total, "usable": hw.usable_bytes, "gpu_mem_gib": gpu_mem_gib, "reserve_gib": hw.reserve_gib,
           "total_gib": m.total / GIB, "gpu": gpu, "float8": workload.float8,
           "float8_gathered": workload.float8_gathered(layout.fsdp_shard)}
    if args.n_experts:  # the routed experts' share (hybridpar.plan.experts)
        x = est.experts
        out.update(experts_per_rank=x.experts_per_rank, expert_state=x.sharded * 4 * PARAM_BYTES,
                   all_to_all_bytes=x.all_to_all_mb * est.grad_accum, all_to_all_leaving=x.leaving_share)
    if timed:
        out.update(all_to_all_s=est.time.ep_comm, step_s=est.time.step, tp_s=est.time.tp_comm, fsdp_exposed_s=est.time.dp_exposed,
                   tokens_per_s_per_gpu=est.tokens_per_s_per_gpu, mfu=est.mfu(hw.peak_flops))
    return out


def _float8_card(c: Config, memory: dict) -> str:
    """A warning when float8 is on and the card the planner prices (--gpu) has no float8 matmuls."""
    if "step_s" not in memory:
        raise ValueError(f"float8.recipe = \"{c.float8.recipe}\" and {memory['gpu']} (--gpu) has no float8 matmuls: "
                         "the job would be refused on it, and its step time is not priced; --gpu names the job's "
                         "card (h100, h100-500w)")
    return f"{memory['gpu']} has them: the blocks' linears priced at its float8 rate"


def _fits(memory: dict) -> str:
    total, usable = memory["total"], memory["usable"]
    if total > usable:
        raise ValueError(f"the estimated peak of {human_bytes(total)} per GPU exceeds the {human_bytes(usable)} "
                         f"usable of {memory['gpu_mem_gib']:g} GiB: turn on activation checkpointing, shard over "
                         "more ranks (parallel.dp_shard) or lower data.micro_batch_size")
    return f"estimated peak {human_bytes(total)} of {human_bytes(usable)} usable per GPU"


EXPOSED_WARNING = 0.2  # of the step waiting on FSDP's traffic: worth changing the layout for


def _hidden(memory: dict) -> str:
    """A warning when the planner expects much of the step to wait on FSDP's collectives."""
    exposed, step = memory["fsdp_exposed_s"], memory["step_s"]
    if exposed > EXPOSED_WARNING * step:
        raise ValueError(f"the planner expects {exposed:.2f} s of the {step:.2f} s step on {memory['gpu']} to wait "
                         f"for FSDP's all-gathers and reduce-scatters ({100 * exposed / step:.0f}%): more compute per "
                         "gather hides them (a larger data.micro_batch_size), or fewer gathers (shard_grad_op / "
                         f"hybrid_shard_zero2 if memory allows); `hybridpar plan --gpu {memory['gpu']}` ranks the layouts")
    return f"FSDP's traffic all but {exposed:.2f} s hidden behind compute on {memory['gpu']}"
