"""The GPU check's later sections (bench/gpu/first_light.py runs them): checkpoints of Llama 3 8B's
shape (an async save's blocked time, a blocking save against the disk, verify, a load), the Hugging
Face export compared with transformers on the device, generation; and the fast tier on the
machine's torch, run in the background on the cores training leaves."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .check import CONFIG, TINY, Check, json_line, last_lines
from .train_sections import read_jsonl

SAVE_LAYERS = 2  # at most: Llama 3 8B's embedding, head and two blocks, 1.5B parameters, 18 GB with AdamW's state


def save_layers(free_bytes: int) -> int:
    """The most blocks (up to SAVE_LAYERS) whose two checkpoints (float32 weights and AdamW's two
    moments: 12 bytes a parameter) and float32 Hugging Face export fit in 90% of the free space;
    0 when not even one does."""
    from hybridpar.models.args import ModelArgs

    def needs(n: int) -> float:
        return 28 * ModelArgs.from_preset("llama3_8b", n_layers=n).num_params()

    return max((n for n in range(1, SAVE_LAYERS + 1) if needs(n) <= 0.9 * free_bytes), default=0)


def _save_run(check: Check, steps: int, async_save: bool, every: int = 0) -> tuple[int, str, list[dict]]:
    run_dir = check.work / "saves"
    shape = TINY if check.tiny else ["--model.n_layers", str(check.results["save layers"])]
    command = [sys.executable, "-m", "hybridpar", "train", "--config", str(CONFIG), *shape, *check.cache,
               "--train.steps", str(steps), "--optim.warmup_steps", "1", "--checkpoint.at_end", "true",
               "--checkpoint.keep", "1", "--checkpoint.resume", "true", "--checkpoint.every", str(every),
               "--checkpoint.async_save",
               str(async_save).lower(), "--output.run_dir", str(run_dir)]
    code, text, _ = check.run(f"{'async' if async_save else 'blocking'} save", command, 300)
    return code, text, read_jsonl(run_dir / "events.jsonl")


def _save_figures(events: list[dict], step: int) -> dict:
    blocked = [e for e in events if e["event"] == "checkpoint" and e["step"] == step]
    written = [e for e in events if e["event"] == "checkpoint_written" and e["step"] == step]
    if not blocked or not written:
        return {}
    w, b = written[-1], blocked[-1]
    # On a GPU the first async save also says how long it waited for its pinned host copy, made in
    # the background from step 1 on (checkpoint.staging), and how long making it took.
    staging = {k: b[k] for k in ("staging_wait_s", "staging_prepared_s") if k in b}
    return {"blocked_s": b["blocked_s"], **staging, "bytes": w["bytes"], "written_s": w["seconds"],
            "gbs": w["bytes"] / max(w["seconds"], 1e-9) / 1e9}


def saves(check: Check) -> dict:
    """Async saves at steps 2 and 4 (the second reuses the first's staging memory), then a run resumed
    from step 4 (a load) that trains step 5 and saves it blocking; each save's blocked and written
    time from the run's events.jsonl."""
    shutil.rmtree(check.work / "saves", ignore_errors=True)
    free = shutil.disk_usage(check.work).free
    check.results["save layers"] = layers = save_layers(free)
    if not check.tiny and not layers:
        return {"ok": False, "why": f"skipped: {free / 1e9:.0f} GB free in {check.work}, too little for two checkpoints"}
    code, text, events = _save_run(check, 4, async_save=True, every=2)
    first, again = _save_figures(events, 2), _save_figures(events, 4)
    if code != 0 or not first or not again:
        return {"ok": False, "why": f"async saves: exit {code}: {last_lines(text)}"}
    code, text, events = _save_run(check, 5, async_save=False)
    second = _save_figures(events, 5)
    if code != 0 or not second:
        return {"ok": False, "async": first, "async_again": again,
                "why": f"resume and blocking save: exit {code}: {last_lines(text)}"}
    disk = check.results.get("probe", {}).get("disk_gbs")
    return {"ok": True, "n_layers": None if check.tiny else layers, "free_gb": free / 1e9, "async": first,
            "async_again": again, "blocking": second,
            "resumed": "resumed from" in text, "blocking_over_disk": second["gbs"] / disk if disk else None}


def verify(check: Check) -> dict:
    folder = check.work / "saves" / "checkpoints"
    code, text, seconds = check.run("verify", [sys.executable, "-m", "hybridpar", "verify", str(folder)], 240)
    size = check.results.get("saves", {}).get("blocking", {}).get("bytes") or 0
    return {"ok": code == 0, "seconds": seconds, "gbs": size / seconds / 1e9 if size else None,
            "why": "" if code == 0 else last_lines(text)}


def export_hf(check: Check) -> dict:
    hf = check.work / "hf"
    code, text, seconds = check.run("export hf", [sys.executable, "-m", "hybridpar", "convert",
                                                  str(check.work / "saves" / "checkpoints"), str(hf), "--to", "hf",
                                                  "--dtype", "float32", "--overwrite"], 240)
    if code != 0:
        return {"ok": False, "why": f"exit {code}: {last_lines(text)}"}
    code, text, _ = check.run("logits", [sys.executable, "-m", "bench.gpu.hf_logits", "--checkpoint",
                                         str(check.work / "saves" / "checkpoints"), "--hf", str(hf),
                                         "--device", check.args.device], 240)
    found = json_line(text, "LOGITS_JSON")
    if not found:
        return {"ok": False, "export_s": seconds, "why": f"logits: exit {code}: {last_lines(text)}"}
    # float32 on both sides with TF32 off: only the order of sums differs.
    return {"ok": found["rel_error"] < 1e-4, "export_s": seconds, **found,
            "bytes": sum(f.stat().st_size for f in hf.glob("*.safetensors"))}


def generate(check: Check) -> dict:
    hf = check.work / "hf"
    new = 64
    code, text, seconds = check.run("generate", [sys.executable, "-m", "hybridpar", "generate", "--checkpoint", str(hf),
                                                 "--tokenizer", str(hf), "--prompt", "Return the", "--max-new-tokens",
                                                 str(new)], 180)
    return {"ok": code == 0, "seconds": seconds, "max_new_tokens": new, "text": last_lines(text, 1)[:160],
            "why": "" if code == 0 else last_lines(text)}


def start_fast_tier(check: Check) -> subprocess.Popen:
    """The fast tier on this machine's torch, on the CPU (gloo), on the cores the GPU sections leave."""
    cores = max(1, len(os.sched_getaffinity(0)) // 2)
    log = open(check.out / "fast_tier.log", "w")
    pin = ["taskset", "-c", f"{cores}-{2 * cores - 1}"] if shutil.which("taskset") and cores > 1 else []
    spread = ["-n", str(max(1, cores // 2))] if importlib.util.find_spec("xdist") else []
    command = [*pin, "nice", sys.executable, "-m", "pytest", "-m", "fast", "-q", "-p", "no:cacheprovider", *spread,
               "--timeout", "300"]
    check.say(f"--- fast tier in the background: {' '.join(command)} > {log.name}")
    return subprocess.Popen(command, cwd=check.env["PYTHONPATH"].split(":")[0], stdout=log, stderr=subprocess.STDOUT,
                            env={**check.env, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})


def finish_fast_tier(check: Check, proc: subprocess.Popen, wait: float) -> dict:
    try:
        proc.wait(timeout=max(1.0, wait))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    text = Path(check.out / "fast_tier.log").read_text(errors="replace")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", text.splitlines()[-1] if text else "")}
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+?)(?: - |$)", text, re.M)))
    return {"ok": proc.returncode == 0, "exit": proc.returncode, "counts": counts, "failed": failed[:40]}
