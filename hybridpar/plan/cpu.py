"""`hybridpar plan --gpu cpu`: this machine, measured, as a Hardware for N CPU ranks of one thread
(how the trainer runs them on gloo).

Measured in this process, one thread: the fp32 matmul rate (the peak), flash attention's rate,
and the rate of the elementwise chains the planner counts (models/llama.py's RMSNorm, RoPE, the
SwiGLU product, the loss), as the planner's bytes per second. Measured in N processes on one gloo
group: the host time of one op of the real model (build_model with FSDP, at tiny sizes,
where kernels take nothing), the CPU time per byte and per call of gloo's collectives, and the
time a synchronising collective waits when N processes share the cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types

from ..diagnostics.env import allowed_cpus
from .inputs import Hardware

# Work between two synchronising calls in the measurement: about what a small model's rank does
# between two tensor-parallel collectives. Waiting for a peer that is off a core costs up to a
# scheduler slice, so the wait grows with it.
SYNC_INTERVAL = 2e-3


def _rate(fn, work: float, seconds: float) -> float:
    """work per CPU-second of fn (process time: other load on the machine changes it little)."""
    fn()  # warm-up: allocation and dispatch set-up
    runs, start = 0, time.process_time()
    while (elapsed := time.process_time() - start) < seconds or runs < 3:
        fn()
        runs += 1
    return runs * work / elapsed


def _kernel_rates(seconds: float) -> tuple[float, float, float]:
    """(matmul FLOP/s, attention FLOP/s, elementwise bytes/s) on one thread."""
    import torch
    import torch.nn.functional as F

    from hybridpar.models.llama import RMSNorm, apply_rope, rope_frequencies

    from .compute import elementwise_bytes, loss_bytes

    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    matmul = _rate(lambda: torch.mm(a, b), 2.0 * n**3, seconds)

    bh, s, hd = 16, 256, 64
    q, k, v = (torch.randn(1, bh, s, hd, requires_grad=True) for _ in range(3))
    attention = _rate(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(),
                      3.5 * 2.0 * bh * s * s * hd, seconds)  # executed: causal half, backward 2.5x

    t, d, heads, f, vocab = 1024, 256, 8, 704, 4096
    norm = types.SimpleNamespace(eps=1e-5, weight=torch.ones(d, requires_grad=True), sequence_parallel=False)
    x = torch.randn(t, d, requires_grad=True)
    xq = torch.randn(1, t, heads, d // heads, requires_grad=True)
    freqs = rope_frequencies(d // heads, torch.arange(t), 10000.0, None)
    h1, h3 = torch.randn(t, f, requires_grad=True), torch.randn(t, f, requires_grad=True)
    logits, targets = torch.randn(t, vocab, requires_grad=True), torch.randint(0, vocab, (t,))

    def chains():  # forward and backward of each, as the model runs them
        out = RMSNorm.forward(norm, x).sum() + apply_rope(xq, freqs).sum() + (F.silu(h1) * h3).sum()
        (out + F.cross_entropy(logits, targets)).backward()

    per = elementwise_bytes(4, compiled=False)
    counted = (sum(per["norm"]) * t * d + sum(per["rope"]) * t * d + sum(per["swiglu"]) * t * f
               + loss_bytes(4) * t * vocab)
    return matmul, attention, _rate(chains, counted, seconds)


def measure_cpu(gpus: int, seconds: float = 0.25, **overrides) -> Hardware:
    """Hardware for `gpus` CPU ranks on this machine (a few seconds; more with many ranks)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        matmul, attention, elementwise = _kernel_rates(seconds)
    finally:
        torch.set_num_threads(threads)
    ranks = measure_ranks(max(gpus, 2))
    cores = len(allowed_cpus())
    fields = dict(
        gpu_mem_gib=64.0, gpus_per_node=max(gpus, 1), peak_flops=matmul, gemm_efficiency=1.0,
        attention_efficiency=attention / matmul, memory_bw=elementwise, memory_efficiency=1.0,
        op_overhead=ranks["op_seconds"], sync_wait=ranks["sync_wait"],
        cores=cores, intra_node_busbw=ranks["wire_rate"], inter_node_busbw=ranks["wire_rate"], reserve_gib=0.0,
        allocator_overhead=0.0,  # no caching allocator (the figure is a GPU's: plan.inputs.ALLOCATOR_OVERHEAD)
        name=(f"cpu, measured: {cores} cores, {matmul / 1e9:.0f} GFLOP/s float32 matmul per core, elementwise "
              f"{elementwise / 1e9:.1f} GB/s, {ranks['op_seconds'] * 1e6:.0f} us per op; gloo at {max(gpus, 2)} ranks: "
              f"{ranks['wire_rate'] / 1e9:.2f} GB/s of wire per CPU-second, {ranks['sync_wait'] * 1e3:.2f} ms per "
              "synchronising call"),
    )
    return Hardware(gpus=gpus, **{**fields, **overrides})


def _op_seconds() -> float:
    """Host seconds per dispatched op of the real model and FSDP, at sizes where kernels take nothing:
    build_model's Transformer under FSDP on a fake process group of one rank."""
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from hybridpar.compat.torch import init_fake_process_group
    from hybridpar.mesh.device import init_parallel
    from hybridpar.config.sharding import FSDPConfig
    from hybridpar.build import build_model
    from hybridpar.models.args import ModelArgs

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    torch.set_flush_denormal(True)  # a fake collective leaves its buffers as they were allocated
    init_fake_process_group(0, 1)
    try:
        parallel = init_parallel(mp=1, dp_shard=1, dp_replicate=1)
        args = ModelArgs.from_preset("tiny", dim=32, n_heads=2, n_kv_heads=1, n_layers=2, vocab_size=64,
                                     multiple_of=16)
        model = build_model(args, parallel, fsdp=FSDPConfig(param_dtype="float32"))
        tokens = torch.randint(0, 64, (1, 8))

        def step():
            model(tokens).sum().backward()

        step()
        with Count():
            step()
        return 1.0 / _rate(step, Count.ops, 0.3)
    finally:
        dist.destroy_process_group()


def _rank_main(rank: int, world: int, port: int) -> dict:
    """One of measure_ranks' processes."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = {"op_seconds": _op_seconds()} if rank == 0 else {}  # the others wait in the rendezvous
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        cores = len(allowed_cpus())
        small, a = torch.zeros(1), torch.randn(128, 128)
        per_mm = 1.0 / _rate(lambda: torch.mm(a, a), 1.0, 0.1)
        reps = max(1, int(SYNC_INTERVAL / per_mm))  # the work between two synchronising calls
        for _ in range(10):
            dist.all_reduce(small)
        dist.barrier()
        iterations, wall = 40, time.perf_counter()
        for _ in range(iterations):
            for _ in range(reps):
                torch.mm(a, a)
            dist.all_reduce(small)
        share = max(1.0, world / cores)
        out["sync_wait"] = max(0.0, (time.perf_counter() - wall) / iterations - share * reps * per_mm)
        nbytes, repeats = 8 << 20, 5
        send = torch.zeros(nbytes // 4)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        cpu = time.process_time()
        for _ in range(repeats):
            dist.all_to_all_single(recv, send)
        out["wire_rate"] = repeats * nbytes * (world - 1) / world / max(time.process_time() - cpu, 1e-6)
        return out
    finally:
        dist.destroy_process_group()


def measure_ranks(world: int, timeout: float = 120.0) -> dict:
    """Start `world` processes on one gloo group and measure what ranks sharing this machine pay:
    op_seconds, wire_rate (bytes per CPU-second) and sync_wait (what a synchronising call adds to a
    rank's wall time beyond its share of the cores, between spells of work)."""
    import json

    from ..mesh.layout import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "hybridpar.plan.cpu", str(r), str(world), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    try:
        results = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, results):
        if p.returncode:
            raise RuntimeError(f"measuring {world} gloo ranks on this machine failed: {err.strip()[-800:]}")
    ranks = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    mean = lambda key: sum(r[key] for r in ranks) / len(ranks)  # noqa: E731
    return {"op_seconds": ranks[0]["op_seconds"], "wire_rate": mean("wire_rate"), "sync_wait": ranks[0]["sync_wait"]}


if __name__ == "__main__":
    import json

    print(json.dumps(_rank_main(*(int(x) for x in sys.argv[1:4]))))
