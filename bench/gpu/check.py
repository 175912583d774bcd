"""What every section of the GPU check shares (bench/gpu/first_light.py): where things go, the time
left, running a command under a limit into the log, and the results so far."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).with_name("first_light.toml")
TIMED_STEPS = 25  # as the hybridpar runs: 30 steps (first_light.toml), 5 of warm-up
WARMUP_STEPS = 5
# The tiny shape of --tiny: the same code, seconds on a CPU.
TINY = ["--model.preset", "tiny", "--data.seq_len", "128", "--fsdp.param_dtype", "float32"]


class Check:
    """The check's state: where things go, the time left, the log, and the results so far."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out, self.work = args.out, args.work
        self.deadline = time.monotonic() + args.budget
        self.results: dict = {}
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.log = open(self.out / "log.txt", "a", buffering=1)
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4"), "PYTHONUNBUFFERED": "1",
                    }
        self.cache = ["--data.cache_dir", str(self.work / "cache")]  # the tokenizer and store, made once

    @property
    def tiny(self) -> bool:
        return self.args.tiny

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, command: list[str], limit: float, env: Optional[dict] = None) -> tuple[int, str, float]:
        """Run `command` under min(limit, the time left); (exit code, its output, seconds). 124: out of time."""
        limit = max(1.0, min(limit, self.left()))
        self.say(f"--- {name}: {' '.join(command)} (limit {limit:.0f} s)")
        start = time.monotonic()
        try:
            done = subprocess.run(command, cwd=ROOT, env={**self.env, **(env or {})}, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=limit)
            code, text = done.returncode, done.stdout
        except subprocess.TimeoutExpired as err:
            code, text = 124, (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        seconds = time.monotonic() - start
        self.log.write(text)
        self.say(f"--- {name}: exit {code} after {seconds:.1f} s")
        return code, text, seconds

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")

    def section(self, name: str, needs: float, body: Callable[["Check"], dict]) -> None:
        """Run one section when at least `needs` seconds are left; its dict (or why not) into the results."""
        if self.left() < needs:
            self.results[name] = {"ok": False, "why": f"skipped: {self.left():.0f} s left, it needs about {needs:.0f}"}
        else:
            try:
                self.results[name] = body(self)
            except Exception as err:  # noqa: BLE001 - one section's failure is a line of the table
                self.results[name] = {"ok": False, "why": f"{type(err).__name__}: {err}"}
        self.say(f"=== {name}: {json.dumps(self.results[name])}")
        self.save()

    def save(self) -> None:
        (self.out / "first_light.json").write_text(json.dumps(self.results, indent=1) + "\n")


def json_line(text: str, tag: str) -> Optional[dict]:
    """The last `TAG {json}` line of a section's output."""
    found = [line[len(tag) + 1:] for line in text.splitlines() if line.startswith(tag + " ")]
    return json.loads(found[-1]) if found else None


def last_lines(text: str, n: int = 3) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-n:])[-400:]


