"""Helpers for the launch-script tests: small training overrides, script environments, dry runs."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import torch

from hybridpar.mesh.layout import free_port  # noqa: F401 - the launch tests take it from here

ROOT = Path(__file__).resolve().parents[2]
SLURM_SH = ROOT / "launch" / "slurm.sh"
MP8_DP16_SH = ROOT / "launch" / "mp8_dp16.sh"
LLAMA3_8B_128K_SH = ROOT / "launch" / "llama3_8b_128k.sh"
LLAMA3_405B_SH = ROOT / "launch" / "llama3_405b.sh"

# One rank's view of the mesh, as the preflight prints it (ParallelDims.describe() after the node).
LAYOUT_LINE = re.compile(
    r"layout: node (?P<node>\S+) node_rank (?P<node_rank>\d+) local_rank (?P<local_rank>\d+) "
    r"rank (?P<rank>\d+)/(?P<world>\d+): mp (?P<mp_rank>\d+)/(?P<mp>\d+), (?:cp (?P<cp_rank>\d+)/(?P<cp>\d+), )?dp (?P<dp_rank>\d+)/(?P<dp>\d+) "
    r"\(replicate (?P<replicate>\d+)/(?P<dp_replicate>\d+), shard (?P<shard>\d+)/(?P<dp_shard>\d+)\)"
)
MESH_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s*$")


def tiny_overrides(corpus: dict, steps: int, every: int) -> list[str]:
    """The debug model on the test corpus: seconds per run on CPU, fp32, every step logged."""
    flags = {
        "model.preset": "debug", "model.vocab_size": 512, "fsdp.param_dtype": "float32",
        "data.source": corpus["source"], "data.cache_dir": corpus["cache_dir"], "data.tokenizer_vocab_size": 512,
        "data.seq_len": 32, "data.micro_batch_size": 4, "train.steps": steps, "train.log_every": 1,
        "train.peak_flops": 1e12, "optim.warmup_steps": 2, "checkpoint.every": every,
        "output.tensorboard": "false", "output.plot": "false",
        "data.val_fraction": 0, "train.eval_every": 0, "train.eval_steps": 0,  # local.toml validates; not here
    }
    return [f"--{k}={v}" for k, v in flags.items()]


def script_env(**extra) -> dict:
    """The test's environment outside any Slurm job or launcher, plus `extra`."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "RUN_DIR",
            "MP", "CP", "DP_SHARD", "DP_REPLICATE", "NODES", "PROCS_PER_NODE", "CONFIG", "RDZV_HOST", "RDZV_PORT",
            "MAX_RESTARTS", "DRY_RUN", "PREFLIGHT", "REHEARSE", "DRY_RUN_RANK", "DRY_RUN_JSON")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "TORCHELASTIC_")) and k not in drop}
    # The repository, importable from any folder (the CI installs it editable; this also covers a plain checkout).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env["REHEARSE"] = "0"  # the commands and the mesh only; tests/launch/test_scripts.py rehearses one job
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_script(script: Path, *args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def printed_command(stdout: str, label: str) -> list[str]:
    """The argv a dry run printed on its `label: ...` line."""
    lines = [line for line in stdout.splitlines() if line.startswith(f"{label}: ")]
    assert len(lines) == 1, f"expected one '{label}:' line in:\n{stdout}"
    return shlex.split(lines[0][len(label) + 2:])


def printed_env(stdout: str) -> dict[str, str]:
    """The variables a dry run says every rank gets (its `env: NAME=value ...` line)."""
    return dict(word.split("=", 1) for word in printed_command(stdout, "env"))


def mesh_table(stdout: str) -> list[tuple[int, ...]]:
    """Rows (rank, node, mp_rank, dp_rank, replicate, shard) of a `hybridpar mesh` table."""
    return [tuple(int(x) for x in m.groups()) for m in map(MESH_ROW.match, stdout.splitlines()) if m]


def documented_coords(rank: int, mp: int, dp_shard: int) -> dict:
    """docs/api.md's layout: rank = (replicate * dp_shard + shard) * mp + mp_rank."""
    dp_rank, mp_rank = divmod(rank, mp)
    replicate, shard = divmod(dp_rank, dp_shard)
    return {"mp_rank": mp_rank, "dp_rank": dp_rank, "replicate": replicate, "shard": shard}


def metrics_by_step(job_dir: Path) -> dict[int, dict]:
    """metrics.jsonl rows by step; a step logged twice (before a crash and after the restart): the last."""
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows}


def load_checkpoint(folder: Path, scratch: Path) -> dict:
    """A complete DCP checkpoint as one dict of full tensors, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder), str(scratch))
    return torch.load(scratch, weights_only=True)


def flat_tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {}
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(flat_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 4 is the parent id; the command name (field 2) may contain spaces, so split after ')'.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def environ_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def stop_session(proc: subprocess.Popen) -> None:
    """Kill a process started with start_new_session=True and everything it started."""
    try:  # the group outlives its leader: orphaned workers are killed too
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
