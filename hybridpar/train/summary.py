"""The end of a run in one block: what it did, what it reached, where its checkpoint is and the
commands that continue from it (printed by rank 0, and kept as summary.json in the run folder)."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Optional

from .. import incidents
from ..files import write_text_atomic
from .metrics import scores_text


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def launch_command(config_path: Path, run_dir: Path, environ=os.environ) -> list[str]:
    """The command that starts a job of this shape again on `config_path` (the run's resolved
    config.toml): launch/slurm.sh's when this process came from it, torchrun's, or the plain one."""
    train = ["-m", "hybridpar", "train", "--config", str(config_path)]
    local = environ.get("LOCAL_WORLD_SIZE", "1")
    nodes = max(1, int(environ.get("WORLD_SIZE", "1")) // max(1, int(local)))
    if environ.get("SLURM_JOB_ID") and environ.get("LAYOUT_FILE"):  # launch/slurm.sh: RUN_DIR/job-<id>
        layout = [f"{k}={environ[k]}" for k in ("MP", "DP_SHARD", "DP_REPLICATE") if k in environ]
        return ["env", f"RUN_DIR={Path(run_dir).parent}", *layout, f"PROCS_PER_NODE={local}",
                f"CONFIG={config_path}", "sbatch", "--nodes", str(nodes), "launch/slurm.sh", "--"]
    if environ.get("TORCHELASTIC_RUN_ID"):  # torchrun
        where = ["--standalone"] if nodes == 1 else ["--nnodes", str(nodes), "--rdzv-backend", "c10d",
                                                      "--rdzv-endpoint", "<first host>:29500"]
        return ["torchrun", *where, "--nproc_per_node", local, *train]
    return ["python3", *train]


def summarise(*, run_dir: Path, steps: tuple[int, int], skipped: int, tokens: float, wall_seconds: float,
              train_seconds: float, eval_seconds: float, mfu: float, peak_memory_gb: float,
              train_loss: Optional[float], validation: Optional[dict], checkpoint: Optional[Path],
              tokenizer: Optional[Path], config_path: Path, train_steps: int,
              sources: Optional[list] = None, data_stop: str = "",
              downstream: Optional[dict] = None) -> tuple[str, dict]:
    """(the printed block, the same as a dict for summary.json). `data_stop`: "exhausted" or
    "damaged" when the data stopped the run (data_stop.py): the resume command says what to change.
    `downstream`: the last downstream scores ({"eval/<task>/<metric>": value}, train/downstream.py)."""
    # Absolute: the commands printed must work from any folder, whatever the run was started with.
    run_dir, config_path = Path(run_dir).absolute(), Path(config_path).absolute()
    checkpoint = Path(checkpoint).absolute() if checkpoint is not None else None
    tokenizer = Path(tokenizer).absolute() if tokenizer else None
    first, last = steps
    done = {
        "run_dir": str(run_dir), "first_step": first, "last_step": last, "skipped_steps": skipped,
        "tokens": tokens, "wall_seconds": wall_seconds, "train_seconds": train_seconds,
        "eval_seconds": eval_seconds, "tokens_per_s": tokens / train_seconds if train_seconds else 0.0,
        "mfu": mfu, "peak_memory_gb": peak_memory_gb, "train_loss": train_loss,
        "val_loss": validation["val_loss"] if validation else None,
        "val_ppl": validation["val_ppl"] if validation else None,
        "checkpoint": str(checkpoint) if checkpoint else None,
        "sources": sources or [],  # a blend's: name, weight, tokens trained on
        "data_stop": data_stop or None,  # what stopped the data: "exhausted" or "damaged"
        "downstream": dict(downstream or {}),  # the last [eval] scores
    }
    trained = (f"steps {first}-{last}" if last >= first else "no steps") + (f", {skipped} skipped" if skipped else "")
    by_source = sum(s["tokens"] for s in sources or []) or 1
    rows = [
        ("wall time", f"{_duration(wall_seconds)} ({_duration(train_seconds)} training"
                      + (f", {_duration(eval_seconds)} {'evaluation' if downstream else 'validation'}"
                         if eval_seconds else "") + f"); {trained}"),
        ("tokens seen", f"{tokens:,.0f} this run" + ("; by source (all runs): " + ", ".join(
            f"{s['name']} {s['tokens']:,} ({s['tokens'] / by_source:.1%}, weight "
            f"{s['weight']:.1%})" for s in sources) if sources else "")),
        ("throughput", f"{done['tokens_per_s']:,.0f} tokens/s, MFU {100 * mfu:.1f}% (means over the steps)"),
        ("peak memory", f"{peak_memory_gb:.2f} GB (the largest rank)"),
        ("final loss", (f"training {train_loss:.4f} (the last log_every steps)" if train_loss is not None
                        else "training -")
                       + (f", validation {validation['val_loss']:.4f} (perplexity {validation['val_ppl']:.1f})"
                          if validation else ", validation - (set data.val_fraction or data.val_source)")),
    ]
    if downstream:
        rows.append(("downstream", scores_text(downstream, ", ")))
    if checkpoint is not None:
        resume = launch_command(config_path, run_dir) + ["--checkpoint.resume", "true"]
        resume, why = {
            "exhausted": (resume + ["--data.on_exhausted", "repeat"], "   (or give the source more data)"),
            "damaged": (resume, "   (once the token store is prepared again)"),
        }.get(data_stop, (resume + ["--train.steps", str(2 * train_steps)], f"   (any train.steps above {last})"))
        commands = {"resume": shlex.join(resume) + why}
        if tokenizer is not None:
            commands["generate"] = shlex.join(["hybridpar", "generate", "--checkpoint", str(checkpoint),
                                               "--tokenizer", str(tokenizer), "--prompt", "def "])
        export = ["hybridpar", "convert", str(checkpoint), str(Path(run_dir) / "hf"), "--to", "hf"]
        commands["export to HF"] = shlex.join(export + (["--tokenizer", str(tokenizer)] if tokenizer else []))
        rows += [("checkpoint", str(checkpoint)), *commands.items()]
        done["commands"] = commands
    else:
        rows.append(("checkpoint", "none saved (checkpoint.at_end = false and no checkpoint.every)"))
    path = os.environ.get(incidents.INCIDENTS_ENV)
    events = incidents.read(Path(path)) if path else []
    if events:  # the faults this run healed from (launch/slurm.sh)
        lines = incidents.summary_lines(events)
        rows += [("incidents", f"{len(lines)} in {path}"), *(("", line) for line in lines)]
        done["incidents"] = incidents.fold(events)
    width = max(len(k) for k, _ in rows)
    text = "\n".join([f"=== run summary: {run_dir} ==="] + [f"  {k:<{width}}  {v}" for k, v in rows])
    return text, done


def write_summary(run_dir: Path, done: dict) -> None:
    write_text_atomic(Path(run_dir) / "summary.json", json.dumps(done, indent=1) + "\n")
