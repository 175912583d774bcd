"""One rank of one training-throughput case (started by bench/run.py, one process per rank).

    python3 -m bench.worker CASE.json OUT_DIR     (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the env)

Builds either engine on the same full weights (hybridpar's seeded init; the recipe gets this rank's
slices of them) and the same token batches, measures the matmul peak with every rank at once,
trains warm-up + timed steps, then one more step with the collective counter on (its state bytes
are read after backward, before the optimizer step), and writes `rank<N>.json` into OUT_DIR.
A case may hold several engines: they are built side by side and take turns step by step.
Nothing from hybridpar is imported at module level: bench/run.py may point PYTHONPATH at another
checkout of hybridpar (an A/B of two versions).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS counter (VmHWM) so the next peak covers training only."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def unique_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one flat buffer count once)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def batches(case: dict, dp_rank: int, count: int):
    """Deterministic token windows per (step, data-parallel rank): both engines read the same ones."""
    b, s, v = case["micro_batch"], case["seq_len"], case["shape"]["vocab_size"]
    out = []
    for step in range(count):
        g = torch.Generator().manual_seed(case["seed"] * 1_000_003 + step * 7919 + dp_rank)
        window = torch.randint(0, v, (b, s + 1), generator=g)
        out.append((window[:, :-1].contiguous(), window[:, 1:].contiguous()))
    return out


class HybridparEngine:
    """The model, FSDP2 and optimizer built as hybridpar.train.Trainer builds them; its step's math."""

    def __init__(self, args, parallel, case: dict) -> None:
        from hybridpar.config import OptimConfig
        from hybridpar.train.optim import build_optimizer

        self.parallel = parallel
        torch.manual_seed(case["seed"])
        self.model = _build_model(args, parallel, case)
        self.params = list(self.model.parameters())
        optim = OptimConfig(**case["optim"])
        # "foreach": the A/B of the trainer's fused AdamW against torch's multi-tensor one
        self.optimizer = build_optimizer(self.model, optim, fused=case.get("optimizer", "trainer") != "foreach")
        self.grad_clip = case["optim"]["grad_clip"]

    def step(self, inputs, targets, probe=None) -> float:
        from hybridpar.parallel import vocab_parallel_cross_entropy
        from hybridpar.train.optim import grad_norm_and_clip

        p = self.parallel
        counts = torch.tensor([float((targets != -100).sum())])
        dist.all_reduce(counts, group=p.dp_group)
        global_targets = counts.item()
        scale = p.dp_size / global_targets
        self.model.set_requires_gradient_sync(True)
        loss = vocab_parallel_cross_entropy(self.model(inputs), targets, parallel=p, reduction="sum")
        (loss * scale).backward()
        loss_sum = loss.detach().clone()
        dist.all_reduce(loss_sum, group=p.dp_group)
        grad_norm_and_clip(self.params, self.grad_clip)
        if probe is not None:
            probe(self)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum.item() / global_targets


def _build_model(args, parallel, case: dict):
    """hybridpar.build.build_model, as the trainer calls it; a baseline checkout from before it
    (bench/run.py --baseline) assembled the same steps by hand."""
    try:
        from hybridpar.config.sharding import FSDPConfig
        from hybridpar.build import build_model
    except ImportError:
        build_model = None
        from hybridpar.parallel.fsdp import FSDPConfig, apply_fsdp
        from hybridpar.models.llama import Transformer

    sp = {"sequence_parallel": case["sequence_parallel"]} if "sequence_parallel" in case else {}
    fsdp = FSDPConfig(sharding_strategy=case["strategy"], param_dtype=case.get("precision", "float32"),
                      reduce_dtype="float32", **case.get("fsdp", {}))
    if build_model is not None:
        return build_model(args, parallel, device=parallel.device, fsdp=fsdp, compile=bool(case.get("compile")), **sp)
    model = Transformer(args, parallel, device=parallel.device, **sp)
    # Only when asked: a baseline checkout from before train.compile has no such argument.
    return apply_fsdp(model, parallel, fsdp, **({"compile_blocks": True} if case.get("compile") else {}))


def state_tensors(engine):
    """(parameters, gradients, AdamW moments) of either engine, as lists of the tensors holding them."""
    params = list(engine.model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    moments = [v for st in engine.optimizer.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
    return params, grads, moments


def _local_shards(args, parallel, seed: int) -> dict[str, torch.Tensor]:
    """hybridpar's seeded model, unsharded over dp: this rank's mp slices by Meta's names."""
    from hybridpar.parallel.layers import local_tensor
    from hybridpar.models.llama import Transformer

    torch.manual_seed(seed)
    model = Transformer(args, parallel)
    return {name: local_tensor(p).detach().clone() for name, p in model.named_parameters()}


def cpu_matmul_peak(seconds: float, size: int = 1024) -> float:
    """FLOPs per CPU-second (process time) of the same square matmul: the peak while on a core."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    runs, start = 0, time.process_time()
    while time.process_time() - start < seconds:
        torch.mm(a, b)
        runs += 1
    return runs * 2.0 * size**3 / (time.process_time() - start)


def build_engine(spec: dict, args, parallel, case: dict):
    if spec["engine"] == "recipe":
        from bench.recipe import RecipeTrainer

        shards = _local_shards(args, parallel, case["seed"])
        o = case["optim"]
        return RecipeTrainer(args, case["mp"], case["dp_shard"], case["dp_replicate"], shards,
                             lr=o["lr"], weight_decay=o["weight_decay"], betas=(o["beta1"], o["beta2"]),
                             eps=o["eps"], grad_clip=o["grad_clip"], precision=case.get("precision", "float32"))
    return HybridparEngine(args, parallel, {**case, **spec})


def run_case(case: dict) -> dict:
    """Every engine of case["engines"] in this one process group; with several, steps alternate
    between them (A B, B A, ...), so both see the same machine load, step by step."""
    import hybridpar
    from hybridpar.train.metrics import measure_matmul_peak
    from hybridpar.models.args import ModelArgs

    from bench.comm import CollectiveCounter

    torch.set_num_threads(1)
    args = ModelArgs.from_dict(case["shape"])
    ep = {"ep": case["ep"]} if case.get("ep", 1) > 1 else {}  # a baseline checkout may predate parallel.ep
    parallel = hybridpar.init_parallel(mp=case["mp"], dp_shard=case["dp_shard"], dp_replicate=case["dp_replicate"], **ep)
    dist.barrier()
    peak = measure_matmul_peak(seconds=case.get("peak_seconds", 1.0))  # every rank at once: same contention
    peak_cpu = cpu_matmul_peak(case.get("peak_seconds", 1.0) / 2)

    specs = case["engines"]
    engines, setup = {}, {}
    for spec in specs:
        start = time.perf_counter()
        engines[spec["name"]] = build_engine(spec, args, parallel, case)
        setup[spec["name"]] = time.perf_counter() - start
    n_steps = case["warmup"] + case["steps"]
    data = batches(case, parallel.dp_rank, n_steps + 1)
    gc.collect()
    dist.barrier()
    hwm_reset = reset_peak_rss()
    rss_after_setup = _vm("VmRSS")

    out = {spec["name"]: {"losses": [], "step_times": [], "cpu_times": [], "exchange_times": [], "exchange_cpu_times": [],
                          "setup_s": setup[spec["name"]]} for spec in specs}
    names = [spec["name"] for spec in specs]
    # case["time_exchange"]: the seconds of each step in expert parallelism's token exchange
    exchange = None
    if case.get("time_exchange"):
        from bench.experts import ExchangeTimer

        exchange = ExchangeTimer()
    for i in range(n_steps):
        for name in (names if i % 2 == 0 else names[::-1]):
            r = out[name]
            start, cpu_start = time.perf_counter(), time.process_time()
            with exchange or contextlib.nullcontext():  # entering it zeroes its seconds
                r["losses"].append(engines[name].step(*data[i]))
            r["step_times"].append(time.perf_counter() - start)
            # CPU seconds of this process (all its threads): the work, without the wait for a core.
            r["cpu_times"].append(time.process_time() - cpu_start)
            if exchange is not None:
                r["exchange_times"].append(exchange.seconds)
                r["exchange_cpu_times"].append(exchange.cpu_seconds)

    for name in names:
        state = {}

        def probe(eng) -> None:
            params, grads, moments = state_tensors(eng)
            state.update(parameters=unique_bytes(params), gradients=unique_bytes(grads), optimizer=unique_bytes(moments),
                         expert_parameters=unique_bytes(p for n, p in eng.model.named_parameters() if ".experts." in n))

        with CollectiveCounter() as counter:
            start, cpu_start = time.perf_counter(), time.process_time()
            out[name]["losses"].append(engines[name].step(*data[-1], probe=probe))
            out[name]["counted_step_time"] = time.perf_counter() - start
            cpu = time.process_time() - cpu_start
        out[name].update(state_bytes=state, comm=counter.summary(), comm_wire=counter.wire_bytes(),
                         comm_payload=counter.payload_bytes(), comm_calls=len(counter.records),
                         comm_seconds=counter.seconds(), comm_cpu_seconds=counter.cpu_seconds())
        # The counted step's own CPU time, to set the collectives' CPU time against.
        out[name]["counted_step_cpu"] = cpu
    return {
        "rank": dist.get_rank(), "hybridpar_file": hybridpar.__file__, "peak_flops": peak, "peak_flops_cpu": peak_cpu,
        "engines": out,
        "peak_rss_train": _vm("VmHWM") if hwm_reset else None, "rss_after_setup": rss_after_setup,
        "peak_rss_lifetime": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "dp_rank": parallel.dp_rank, "mp_rank": parallel.mp_rank,
    }


def main() -> None:
    case = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    if case.get("hybridpar_path"):  # another checkout of hybridpar and models/, for an A/B of versions
        sys.path.insert(0, case["hybridpar_path"])
    try:
        result = {"ok": True, **run_case(case)}
    except BaseException:  # noqa: BLE001 - reported to the parent, which names the rank
        result = {"ok": False, "rank": rank, "error": traceback.format_exc()}
    tmp = out_dir / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out_dir / f"rank{rank}.json")
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a failed peer may have left the group already
            pass
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
