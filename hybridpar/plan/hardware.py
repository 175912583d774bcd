"""Named hardware for `hybridpar plan --gpu NAME` (`--gpu cpu` measures this machine: plan/cpu.py).

Each GPU entry states its datasheet figures (dense bf16 peak, memory and its bandwidth, SMs, NVLink
and the network per GPU) and the fraction of each that kernels sustain. The fractions are properties
of the kernels on that chip, not of any one model: cuBLAS on large bf16 matrices, FlashAttention-2
(what scaled_dot_product_attention runs on these GPUs), and elementwise kernels streaming memory.
Bus bandwidths are what nccl-tests reports for rings of 8 GPUs over NVLink and between nodes.

DENSE_BF16_PEAKS is every card's datasheet peak by what torch.cuda.get_device_name() says: the
trainer's MFU denominator when train.peak_flops is not set, and the planner's GPUs' peaks.
DENSE_FLOAT8_PEAKS is the same for float8 matmuls (H100 and later, Ada, MI300): a card it does not
name (A100 and older) has none, and the planner refuses a float8 plan for it.
"""

from __future__ import annotations

import re
from typing import Optional

from .inputs import Hardware

# (words all found in the device name, dense bf16 FLOP/s without sparsity), the first match wins:
# a variant before its family. Datasheet figures (torchtitan's get_peak_flops quotes the same).
DENSE_BF16_PEAKS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("gb200",), 2.5e15), (("b200",), 2.25e15), (("b100",), 1.8e15),
    (("h100", "nvl"), 835e12), (("h100", "pcie"), 756e12), (("h100",), 989e12),  # "H100 80GB HBM3": SXM
    (("h200", "nvl"), 836e12), (("h200",), 989e12), (("gh200",), 989e12),
    (("h800", "pcie"), 756e12), (("h800",), 989e12),  # the SXM H800 is an H100 with less NVLink
    (("a100",), 312e12), (("a800",), 312e12), (("a40",), 149.7e12), (("a30",), 165e12), (("a10",), 125e12),
    (("l40s",), 362e12), (("l40",), 181e12), (("l4",), 121e12),
    (("mi355x",), 2.5e15), (("mi325x",), 1307.4e12), (("mi300x",), 1307.4e12), (("mi250x",), 191.5e12),  # per GCD
)


# The same for float8 (e4m3/e5m2) without sparsity: half the datasheets' sparse figure.
DENSE_FLOAT8_PEAKS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("gb200",), 5e15), (("b200",), 4.5e15), (("b100",), 3.5e15),
    (("h100", "nvl"), 1671e12), (("h100", "pcie"), 1513e12), (("h100",), 1979e12),
    (("h200", "nvl"), 1671e12), (("h200",), 1979e12), (("gh200",), 1979e12),
    (("h800", "pcie"), 1513e12), (("h800",), 1979e12),
    (("l40s",), 733e12), (("l40",), 362e12), (("l4",), 242e12),
    (("mi325x",), 2614.9e12), (("mi300x",), 2614.9e12),
)


def _lookup(table: tuple[tuple[tuple[str, ...], float], ...], device_name: str) -> Optional[float]:
    """The first entry whose words are all whole words of the name: "L4" is not "L40S", "A10" not "A100"."""
    words = set(re.split(r"[^a-z0-9]+", device_name.lower()))
    return next((peak for needed, peak in table if words.issuperset(needed)), None)


def peak_flops_of(device_name: str) -> Optional[float]:
    """The card's dense bf16 FLOP/s from its name ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"),
    or None for a card not in DENSE_BF16_PEAKS."""
    return _lookup(DENSE_BF16_PEAKS, device_name)


def float8_peak_flops_of(device_name: str) -> float:
    """The card's dense float8 FLOP/s from its name; 0.0 for one without float8 matmuls (or unknown)."""
    return _lookup(DENSE_FLOAT8_PEAKS, device_name) or 0.0


# The clock of an H100 under a power cap. NVIDIA's H100 datasheet rates the same 132 SMs at two
# clocks: the NVL board at its 400 W (configurable 350-400 W) 835 dense bf16 TFLOP/s, the SXM board at
# its 700 W 989. torchtitan's note puts its 500 W card's peak between the two; read off the line through
# them at the cap (not their midpoint, which is the line at 550 W), 886/989 of the SXM's clock.
H100_RATED_WATTS = (400, 700)  # the NVL's and the SXM's board power at the datasheet's figures


def h100_clock_at(watts: float) -> float:
    """The fraction of the 700 W SXM's clock an H100 board holds capped at `watts` (linear between the
    NVL's and the SXM's rated figures)."""
    (w0, w1), f0, f1 = H100_RATED_WATTS, peak_flops_of("H100 NVL"), peak_flops_of("H100 SXM")
    return (f0 + (f1 - f0) * (watts - w0) / (w1 - w0)) / f1


H100_500W_CLOCK = h100_clock_at(500)


# name -> (description, Hardware fields). gpus and gpu_mem_gib's use are filled in by `spec`.
GPUS: dict[str, tuple[str, dict]] = {
    "a100": ("A100 SXM4 80 GB (400 W): 312 TFLOP/s bfloat16, no float8 matmuls, HBM2e 2.04 TB/s, NVLink3 "
             "300 GB/s per direction, one 200 Gb/s NIC per GPU", dict(
                 gpu_mem_gib=80, peak_flops=peak_flops_of("A100"), float8_peak_flops=float8_peak_flops_of("A100"),
                 gemm_efficiency=0.85, attention_efficiency=0.55, sms=108,
                 memory_bw=2.04e12, memory_efficiency=0.8, intra_node_busbw=230e9, inter_node_busbw=23e9)),
    "h100": ("H100 SXM5 80 GB (700 W): 989 TFLOP/s bfloat16, 1,979 float8, HBM3 3.35 TB/s, NVLink4 450 GB/s per "
             "direction, one 400 Gb/s NIC per GPU", dict(
                 gpu_mem_gib=80, peak_flops=peak_flops_of("H100 SXM"), float8_peak_flops=float8_peak_flops_of("H100 SXM"),
                 gemm_efficiency=0.7, attention_efficiency=0.35, sms=132,
                 memory_bw=3.35e12, memory_efficiency=0.8, intra_node_busbw=370e9, inter_node_busbw=45e9)),
    # Meta's Grand Teton hosts, where torchtitan measured (docs/performance.md): the same SXM board
    # with 96 GB of HBM2e at 2.4 TB/s (torchtitan's benchmarks/llama3_h100_202412_torchtitan.md),
    # capped at 500 W. The 700 W card's kernel fractions, at the clock of the cap (H100_500W_CLOCK).
    "h100-500w": ("H100 SXM5 96 GB HBM2e capped at 500 W (Grand Teton): 989 TFLOP/s bfloat16 (1,979 float8) "
                  f"on paper, about {H100_500W_CLOCK * 989:.0f}/989 of it at the cap's clock; HBM2e 2.4 TB/s, "
                  "NVLink4, one 400 Gb/s NIC per GPU", dict(
                      gpu_mem_gib=94, peak_flops=peak_flops_of("H100 SXM"),
                      float8_peak_flops=float8_peak_flops_of("H100 SXM"), gemm_efficiency=0.7 * H100_500W_CLOCK,
                      attention_efficiency=0.35 * H100_500W_CLOCK, sms=132, memory_bw=2.4e12, memory_efficiency=0.8,
                      intra_node_busbw=370e9, inter_node_busbw=45e9)),
}


def spec(name: str, gpus: int, **overrides) -> Hardware:
    """The named GPU's Hardware for `gpus` of them; overrides (gpu_mem_gib, busbw, ...) win."""
    if name not in GPUS:
        raise ValueError(f"unknown --gpu {name!r}: choose from {', '.join([*GPUS, 'cpu'])}")
    description, fields = GPUS[name]
    return Hardware(gpus=gpus, **{**fields, "name": f"{name} ({description})", **overrides})

