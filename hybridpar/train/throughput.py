"""The trainer's measure of speed: MFU's denominator (the peak FLOP/s per device), the model's FLOPs
per token, each step's rates, and the run's peak memory (the largest rank's).

    throughput = Throughput(config, parallel, args)   # collective: the peak may be measured here
    throughput.rates(tokens, seconds)   # {"tokens_per_s", "mfu", "memory_gb"[, "memory_reserved_gb"]} of one step
    throughput.peak_memory_gb(history)  # collective: the largest rank's peak
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist

from ..config import Config
from ..mesh.device import ParallelDims
from ..plan.hardware import peak_flops_of
from ..progress import note
from .metrics import flops_per_token, measure_matmul_peak, memory_bytes, memory_figures


def peak_flops(setting: float, device: torch.device, measure: Callable[[], float]) -> float:
    """MFU's denominator per device: train.peak_flops `setting` when set; else a GPU's dense bf16 peak
    from its name (plan/hardware.py); else measure() (a CPU, or a card of unknown name: said)."""
    if setting:
        return setting
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    peak = peak_flops_of(name) if name else None
    if peak is not None:
        note(f"MFU against {name}'s dense bf16 peak {peak / 1e12:.0f} TFLOP/s (from its name; "
             "train.peak_flops sets another)")
        return peak
    peak = measure()
    if name:
        note(f"MFU against the measured bf16 matmul rate {peak / 1e12:.0f} TFLOP/s (card name {name!r} unknown: "
             "set train.peak_flops to its datasheet's dense bf16 peak)")
    return peak


def measure_peak(device: torch.device) -> float:
    """The matmul rate every rank measures in the same window, under the same contention as training.
    Within it the scheduler shares the cores unevenly, so the per-rank peak is the mean over ranks.
    Collective."""
    gpu = dict(size=8192, dtype=torch.bfloat16) if device.type == "cuda" else {}
    rate = measure_matmul_peak(seconds=0.5, start_together=dist.barrier, device=device, **gpu)
    peak = torch.tensor([rate], dtype=torch.float64, device=device)  # nccl reduces GPU tensors only
    dist.all_reduce(peak)
    return peak.item() / dist.get_world_size()


class Throughput:
    def __init__(self, config: Config, parallel: ParallelDims, args) -> None:
        self.parallel, self.device = parallel, parallel.device
        self.peak_flops = peak_flops(config.train.peak_flops, self.device, functools.partial(measure_peak, self.device))
        self.flops_per_token = flops_per_token(args, config.data.seq_len)

    def rates(self, tokens: float, seconds: float) -> dict:
        """One step's tokens per second, MFU (over every device of the world) and this rank's peak memory
        (on a GPU, allocated and reserved: metrics.memory_figures)."""
        tokens_per_s = tokens / seconds
        return {"tokens_per_s": tokens_per_s,
                "mfu": self.flops_per_token * tokens_per_s / (self.peak_flops * self.parallel.world_size),
                **memory_figures(self.device)}

    def peak_memory_gb(self, history: list[dict]) -> float:
        """The largest rank's peak memory over the steps of `history` (now, without a step). Collective."""
        peak = torch.tensor([max((m["memory_gb"] for m in history), default=memory_bytes(self.device) / 1e9)],
                            dtype=torch.float64, device=self.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return peak.item()
