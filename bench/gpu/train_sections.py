"""The GPU check's first sections (bench/gpu/first_light.py runs them): the machine, the tests marked
gpu, the layers that fit, training with hybridpar and with torchtitan at the same shape."""

from __future__ import annotations

import json
import re
import shutil
import statistics
import sys
from pathlib import Path

from .check import CONFIG, ROOT, TIMED_STEPS, TINY, WARMUP_STEPS, Check, json_line, last_lines

# The float8 settings the check trains with (bench/gpu/float8_sections.py): a name -> (recipe,
# fsdp_all_gather). Rowwise, and tensorwise with FSDP's float8 all-gather, as torchtitan runs them.
FLOAT8 = {"rowwise": ("rowwise", False), "tensorwise": ("tensorwise", True)}


def probe(check: Check) -> dict:
    code, text, _ = check.run("probe", [sys.executable, "-m", "bench.gpu.probe", "--device", check.args.device,
                                        "--work", str(check.work)] + (["--tiny"] if check.tiny else []), 120)
    found = json_line(text, "PROBE_JSON")
    return {"ok": True, **found} if found else {"ok": False, "why": f"exit {code}: {last_lines(text)}"}


def gpu_tests(check: Check) -> dict:
    code, text, seconds = check.run("gpu tests", [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q",
                                                  "-rfEs", "-p", "no:cacheprovider"], 180)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", text)}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)
    return {"ok": code in (0, 5) and not failed, "counts": counts, "failed": failed, "seconds": seconds,
            "why": "" if code in (0, 5) else f"exit {code}: " + (" ".join(failed) or last_lines(text))}


# The share of the card's usable memory the planned memory may take. It includes the caching allocator's
# reserve (plan.inputs.ALLOCATOR_OVERHEAD) since the first light, whose 20 layers planned 0.88 of it.
PLANNED_SHARE = 0.9


def layers_that_fit(check: Check) -> dict:
    """The most layers of Llama 3 8B's shape whose planned memory (hybridpar's planner, selective AC
    every 2nd block) stays under PLANNED_SHARE of the card's usable memory."""
    if check.tiny:
        return {"ok": True, "n_layers": 4, "why": "tiny shape"}
    from hybridpar.models.args import ModelArgs

    memory = check.results.get("probe", {}).get("memory_gib") or 80.0
    hardware = planner_hardware(check, memory)
    best = None
    for n in range(1, 33):
        est = plan_estimate(ModelArgs.from_preset("llama3_8b", n_layers=n), hardware, compile=False)
        if est is None or est.memory.total > PLANNED_SHARE * est.usable_bytes:
            break
        best = n
    return {"ok": best is not None, "n_layers": best or 1, "card_gib": memory,
            "why": "" if best else "not even one layer fits the planner's memory"}


def planner_hardware(check: Check, memory_gib: float):
    from hybridpar.plan.hardware import GPUS, spec

    card = str(check.results.get("probe", {}).get("card", ""))
    name = "h200" if "H200" in card and "h200" in GPUS else "h100"
    overrides = {"gpu_mem_gib": memory_gib}
    if "H200" in card and name == "h100":
        overrides["memory_bw"] = 4.8e12  # the H200's HBM3e; the H100's chip and rates otherwise
    return spec(name, 1, **overrides)


def plan_estimate(args, hardware, *, compile: bool, float8: str = ""):
    from hybridpar.plan import Workload, make_plan

    recipe, gather = FLOAT8.get(float8, ("none", False))
    plan = make_plan(args, Workload(seq_len=8192, micro_batch=1, compile=compile, float8=recipe,
                                    float8_all_gather=gather), hardware, ac_every=2)
    found = plan.find(1, 1, 1, "selective")
    return found[0] if found else None


def train(check: Check, compile: bool) -> dict:
    """hybridpar's training at the chosen layers; out of memory, once more at 60% of them (and the
    layers the later sections use with it): the planner's memory has not met a card before."""
    out = _train(check, compile)
    layers = check.results.get("layers", {})
    if out.get("oom") and not check.tiny and layers.get("n_layers", 1) > 1 and check.left() > 60:
        layers["n_layers_planned"], layers["n_layers"] = layers["n_layers"], max(1, int(0.6 * layers["n_layers"]))
        out = {**_train(check, compile), "first_try": out}
    return out


def _train(check: Check, compile: bool, float8: str = "") -> dict:
    """One training run of hybridpar at the chosen layers, in bf16 or with a float8 setting of FLOAT8."""
    n_layers = check.results.get("layers", {}).get("n_layers", 1)
    mode = "compiled" if compile else "eager"
    run_dir = check.work / (f"float8-{float8}-{mode}" if float8 else mode)
    shutil.rmtree(run_dir, ignore_errors=True)
    shape = TINY + ["--train.steps", "8"] if check.tiny else ["--model.n_layers", str(n_layers)]
    flags = []
    if float8:
        recipe, gather = FLOAT8[float8]
        flags = ["--float8.recipe", recipe, "--float8.fsdp_all_gather", str(gather).lower()]
    command = [sys.executable, "-m", "hybridpar", "train", "--config", str(CONFIG), *shape, *check.cache, *flags,
               "--train.compile", str(compile).lower(), "--output.run_dir", str(run_dir)]
    code, text, seconds = check.run(f"float8 {float8} {mode}" if float8 else f"train {mode}", command,
                                    420 if compile else 240)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    timed = [r for r in rows if r.get("step", 0) > (2 if check.tiny else WARMUP_STEPS) and "tokens_per_s" in r]
    if code != 0 or not timed:
        return {"ok": False, "n_layers": n_layers, "why": f"exit {code}: {last_lines(text)}",
                "oom": "out of memory" in text.lower()}
    out = {"ok": True, "n_layers": n_layers, "steps_timed": len(timed), "seconds": seconds,
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
           "mfu_logged": statistics.median(r["mfu"] for r in timed),
           "peak_memory_gib": max(r["memory_gb"] for r in rows) * 1e9 / 2 ** 30,
           # what the caching allocator held (a GPU's rows have it): what the planner's memory must cover
           "reserved_memory_gib": max((r.get("memory_reserved_gb", 0.0) for r in rows), default=0.0) * 1e9 / 2 ** 30,
           "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
           "losses": [r["loss"] for r in rows if "loss" in r],
           "mfu_against": next((line for line in text.splitlines() if "MFU against" in line), "")}
    out.update(mfu_figures(check, out["tokens_per_s"], n_layers))
    if not check.tiny:
        out["planner"] = planner_prediction(check, n_layers, compile, float8)
        if out["planner"].get("tokens_per_s"):
            out["measured_over_planned"] = out["tokens_per_s"] / out["planner"]["tokens_per_s"]
        if out["planner"].get("memory_gib") and out["reserved_memory_gib"]:
            out["planned_over_reserved"] = out["planner"]["memory_gib"] / out["reserved_memory_gib"]
    return out


def mfu_figures(check: Check, tokens_per_s: float, n_layers: int) -> dict:
    """MFU of `tokens_per_s` against the measured matmul rate and the card's nominal peak, with the
    trainer's own FLOPs per token (the same numerator for hybridpar and torchtitan)."""
    from hybridpar.models.args import ModelArgs
    from hybridpar.train.metrics import flops_per_token

    args = ModelArgs.from_preset("tiny") if check.tiny else ModelArgs.from_preset("llama3_8b", n_layers=n_layers)
    flops = flops_per_token(args, 128 if check.tiny else 8192) * tokens_per_s
    probe_ = check.results.get("probe", {})
    measured, nominal = probe_.get("matmul_tflops") or 0, probe_.get("nominal_tflops") or 0
    return {"tflops": flops / 1e12, "mfu_measured": flops / (measured * 1e12) if measured else None,
            "mfu_nominal": flops / (nominal * 1e12) if nominal else None}


def planner_prediction(check: Check, n_layers: int, compile: bool, float8: str = "") -> dict:
    from hybridpar.models.args import ModelArgs

    hardware = planner_hardware(check, check.results.get("probe", {}).get("memory_gib") or 80.0)
    est = plan_estimate(ModelArgs.from_preset("llama3_8b", n_layers=n_layers), hardware, compile=compile,
                        float8=float8)
    if est is None:
        return {"why": "the planner has no selective-AC layout"}
    return {"tokens_per_s": est.tokens_per_s_per_gpu, "mfu": est.mfu(hardware.peak_flops),
            "memory_gib": est.memory.total / 2 ** 30, "allocator_gib": est.memory.allocator / 2 ** 30,
            "hardware": hardware.name.split(" (")[0]}


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def titan(check: Check, compile: bool, float8: str = "") -> dict:
    """torchtitan's own Llama 3 at the same shape (bench/gpu/titan.py), in bf16 or with torchtitan's
    float8 at a setting of FLOAT8; against hybridpar's run of the same settings."""
    n_layers = check.results.get("layers", {}).get("n_layers", 1)
    mode = "compiled" if compile else "eager"
    shape = (["--dim", "256", "--n-layers", "4", "--n-heads", "8", "--n-kv-heads", "4", "--vocab", "4096",
              "--seq", "128", "--warmup", "2", "--steps", "4"] if check.tiny else
             ["--dim", "4096", "--n-layers", str(n_layers), "--n-heads", "32", "--n-kv-heads", "8", "--vocab", "128256",
              "--seq", "8192", "--warmup", str(WARMUP_STEPS), "--steps", str(TIMED_STEPS)])
    path = check.work / (f"titan-float8-{float8}-{mode}.json" if float8 else f"titan-{mode}.json")
    code, text, seconds = check.run(f"torchtitan float8 {float8} {mode}" if float8 else f"torchtitan {mode}",
                                    # --ac 2: hybridpar's selective AC (every 2nd block recomputed), not titan's op level
                                    [sys.executable, str(ROOT / "bench/gpu/titan.py"), "--device", check.args.device,
                                     *shape, "--ac", "2", "--json", str(path)] + (["--compile"] if compile else [])
                                    + (["--float8", float8] if float8 else []), 360 if compile else 200)
    found = json_line(text, "TITAN_JSON")
    if not found:
        return {"ok": False, "why": f"exit {code}: {last_lines(text)}"}
    if found.get("ok"):
        found.update(mfu_figures(check, found["tokens_per_s"], n_layers))
        ours = check.results.get(f"float8 {float8} {mode}" if float8 else f"train {mode}", {})
        if ours.get("tokens_per_s"):
            found["hybridpar_over_titan"] = ours["tokens_per_s"] / found["tokens_per_s"]
    return found
