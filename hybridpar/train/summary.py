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
from ..config import Config
from ..replicas.record import summary_lines as replica_lines
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
        groups = int(environ.get("FT_GROUPS", "0"))  # launch/slurm.sh --ft: RUN_DIR/job-<id>/group-<g>, a group's nodes
        if groups:
            return ["env", f"RUN_DIR={Path(run_dir).parent.parent}", *layout, f"PROCS_PER_NODE={local}", "FT=1",
                    f"GROUP_NODES={nodes}", f"CONFIG={config_path}", "sbatch", "--nodes", str(nodes * groups),
                    "--no-kill", "launch/slurm.sh", "--"]
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
              tokenizer: Optional[Path], config_path: Path, config: Config, stopped: str = "",
              no_validation: str = "", sources: Optional[list] = None, data_stop: str = "",
              downstream: Optional[dict] = None, ranges: Optional[list[tuple[int, int]]] = None,
              replica_groups: Optional[dict] = None) -> tuple[str, dict]:
    """(the printed block, the same as a dict for summary.json). `config`: the run's; `stopped`: what
    ended it before its train.steps ("SIGTERM", "a straggler", "the data": the trainer's stop_signal),
    "" for none; `no_validation`: why the run has no validation data (evaluate.missing_validation),
    "" when it has some. `data_stop`: "exhausted" or "damaged" when the data stopped the run
    (data_stop.py): the resume command says what to change. Each row's reason is derived from these.
    `downstream`: the last downstream scores ({"eval/<task>/<metric>": value}, train/downstream.py).
    `ranges`: the runs of steps trained when not one (a replica group healed to its peers' step trains
    steps 1-8, 27-40); `replica_groups`: a fault-tolerant group's record (hybridpar.replicas.record)."""
    # Absolute: the commands printed must work from any folder, whatever the run was started with.
    run_dir, config_path = Path(run_dir).absolute(), Path(config_path).absolute()
    checkpoint = Path(checkpoint).absolute() if checkpoint is not None else None
    tokenizer = Path(tokenizer).absolute() if tokenizer else None
    first, last = steps
    how = _ended_early(stopped, data_stop)
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
        "stopped": stopped or None,  # what ended the run before its train.steps
        "downstream": dict(downstream or {}),  # the last [eval] scores
    }
    ranges = ranges or ([(first, last)] if last >= first else [])
    trained = (("steps " + ", ".join(f"{a}-{b}" for a, b in ranges)) if ranges else "no steps") + (
        f", {skipped} skipped" if skipped else "")
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
                       + _validation_text(validation, no_validation, config, steps, how)),
    ]
    if downstream:
        rows.append(("downstream", scores_text(downstream, ", ")))
    if replica_groups is not None:
        head, *more = replica_lines(replica_groups)
        rows += [("replica groups", head), *(("", line) for line in more)]
        done["replica_groups"] = replica_groups
    if checkpoint is not None:
        command = launch_command(config_path, run_dir)
        if replica_groups is not None:  # the group's config.toml names its own folder: the job's is above it
            command += ["--output.run_dir", str(run_dir.parent)]
        resume, why = _resume(command + ["--checkpoint.resume", "true"], config.train.steps, last, data_stop)
        if replica_groups is not None:
            why = why[:-1] + "; every replica group so, each with its own --fault_tolerance.group, the lighthouse running)"
        commands = {"resume": shlex.join(resume) + why}
        if tokenizer is not None:
            commands["generate"] = shlex.join(["hybridpar", "generate", "--checkpoint", str(checkpoint),
                                               "--tokenizer", str(tokenizer), "--prompt", "def "])
        export = ["hybridpar", "convert", str(checkpoint), str(Path(run_dir) / "hf"), "--to", "hf"]
        commands["export to HF"] = shlex.join(export + (["--tokenizer", str(tokenizer)] if tokenizer else []))
        shared = " (the job's newest; the first group of each step's quorum writes them)" if replica_groups else ""
        rows += [("checkpoint", f"{checkpoint}{shared}"), *commands.items()]
        done["commands"] = commands
    elif replica_groups is not None and config.checkpoint.at_end:
        rows.append(("checkpoint", f"none in {config.checkpoint_dir()} when this group ended (the first group of each "
                                   "step's quorum writes the job's checkpoints)"))
    else:
        rows.append(("checkpoint", _no_checkpoint(config, steps, how)))
    path = os.environ.get(incidents.INCIDENTS_ENV)
    events = incidents.read(Path(path)) if path else []
    if events:  # the faults this run healed from (launch/slurm.sh)
        lines = incidents.summary_lines(events)
        rows += [("incidents", f"{len(lines)} in {path}"), *(("", line) for line in lines)]
        done["incidents"] = incidents.fold(events)
    width = max(len(k) for k, _ in rows)
    text = "\n".join([f"=== run summary: {run_dir} ==="] + [f"  {k:<{width}}  {v}" for k, v in rows])
    return text, done


def _ended_early(stopped: str, data_stop: str) -> str:
    """What ended the run before its train.steps, as the rows' reasons say it ("" for nothing)."""
    if data_stop == "damaged":
        return "the token store is damaged"
    if data_stop == "exhausted":
        return 'the data ran out (data.on_exhausted = "stop")'
    if stopped == "a straggler":
        return "stopped to leave a straggler's node out"
    return f"stopped on {stopped}" if stopped else ""


def _validation_text(validation: Optional[dict], no_validation: str, config: Config, steps: tuple[int, int],
                     how: str) -> str:
    """The final loss row's validation part, with why there is none."""
    first, last = steps
    if validation:
        return f", validation {validation['val_loss']:.4f} (perplexity {validation['val_ppl']:.1f})"
    if no_validation:
        return f", validation - ({no_validation})"
    if last < first:
        return f", validation - (no step trained{': ' + how if how else ''})"
    every = config.train.eval_every
    when = f"train.eval_every = {every}" if every else "train.eval_every = 0: after the last step"
    return f", validation - ({how or 'the run ended'} after step {last}, before this run's first validation ({when}))"


def _no_checkpoint(config: Config, steps: tuple[int, int], how: str) -> str:
    """The checkpoint row of a run that saved none, with why."""
    first, last = steps
    c = config.checkpoint
    if last < first:
        return f"none saved (no step trained{': ' + how if how else ''})"
    if not c.at_end and c.every:
        return (f"none saved (checkpoint.at_end = false, and steps {first}-{last} reached no multiple of "
                f"checkpoint.every = {c.every})")
    if not c.at_end:
        return "none saved (checkpoint.at_end = false and no checkpoint.every)"
    return f"none saved ({how})" if how else "none saved"


def _resume(command: list[str], train_steps: int, last: int, data_stop: str) -> tuple[list[str], str]:
    """The command that continues the run, and what it does: a run stopped before its train.steps
    goes on with the same train.steps, so the same learning-rate schedule; only a run that finished
    may be given more steps, and that changes the schedule."""
    if data_stop == "exhausted":
        return command + ["--data.on_exhausted", "repeat"], "   (or give the source more data)"
    if data_stop == "damaged":
        return command, "   (once the token store is prepared again)"
    if last < train_steps:
        return command, f"   (the same run: on to step {train_steps} on the same learning-rate schedule)"
    return (command + ["--train.steps", str(2 * train_steps)],
            f"   (to train on: any train.steps above {last}; the learning-rate schedule is then spread over the "
            "new train.steps, so the rate rises again)")


def write_summary(run_dir: Path, done: dict) -> None:
    write_text_atomic(Path(run_dir) / "summary.json", json.dumps(done, indent=1) + "\n")
