"""The machine under the GPU check, as one JSON line: versions, the card, its bf16 matmul rate
measured, and the disk's write rate (bench/gpu/first_light.py runs it first).

    python -m bench.gpu.probe --device cuda --work /tmp/first_light
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import time
from pathlib import Path

import torch

from hybridpar.train.metrics import measure_matmul_peak


def disk_write_gbs(folder: Path, nbytes: int) -> float:
    """GB/s of one file of `nbytes` written in 64 MiB blocks and fsynced: the ceiling a checkpoint
    save is compared with."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "disk-probe.bin"
    block = os.urandom(64 << 20)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    size = path.stat().st_size
    path.unlink()
    return size / seconds / 1e9


def nominal_peak(name: str) -> tuple[float, str]:
    """The card's dense bf16 peak from its name (hybridpar's own table), or 0 with why not."""
    try:
        from hybridpar.plan.hardware import peak_flops_of
    except ImportError as err:  # the table arrived with issue 40; an older tree has none
        return 0.0, f"no name table ({err})"
    peak = peak_flops_of(name)
    return (peak or 0.0), ("" if peak else f"{name!r} is not in hybridpar's table")


def torchao_version():
    """torchao's version (float8 training's library), or None when it is not installed."""
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    device = torch.device(args.device)
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": os.sys.version.split()[0],
           "torchao": torchao_version()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(card=props.name, memory_gib=props.total_memory / 2 ** 30, sms=props.multi_processor_count,
                   nccl=".".join(map(str, torch.cuda.nccl.version())), capability=f"{props.major}.{props.minor}")
    else:
        out.update(card=f"CPU ({os.cpu_count()} cores)", memory_gib=0.0, nccl=None)
    # The trainer's own measurement: dense bf16 on a GPU (random data: zeros run faster), waited for.
    gpu = device.type == "cuda"
    out["matmul_tflops"] = measure_matmul_peak(seconds=1.0, size=512 if args.tiny else 8192, device=device,
                                               dtype=torch.bfloat16 if gpu else torch.float32) / 1e12
    out["nominal_tflops"], out["nominal_note"] = (x / 1e12 if isinstance(x, float) else x
                                                  for x in nominal_peak(out["card"]))
    out["disk_gbs"] = disk_write_gbs(args.work, (64 << 20) if args.tiny else (4 << 30))
    print("PROBE_JSON " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
