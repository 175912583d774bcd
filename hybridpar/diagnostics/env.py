"""Environment checks for `hybridpar doctor`: pure functions over mappings, so every rule is testable.

Each check returns Findings: a level, the check's name, and a message saying what is wrong and what
to change. Error: the job fails or silently ignores what its environment asks; warning: it runs,
slower or less protected than intended.

Facts relied on (torch 2.13's c10d ProcessGroupNCCL.hpp, FlightRecorder.hpp, Utils.hpp, libtorch_cpu.so):
  - a renamed variable is read under both spellings; when both are set the new spelling wins
    (getCvarInt/getCvarBool read the list backwards);
  - boolean variables accept y/yes/t/true/1 and n/no/f/false/0, anything else raises "Invalid
    value for environment variable" when the process group is created; integers go through std::stoi;
  - torchrun sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1 in every worker unless it is already set,
    and hybridpar's trainer sets the variables in timeouts.ENV_DEFAULTS that are still unset;
  - with TORCH_NCCL_BLOCKING_WAIT on, ProcessGroupNCCL starts no watchdog thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections import defaultdict
from typing import Iterable, Mapping, Optional, Sequence

from .timeouts import apply_env_defaults

ERROR, WARNING, OK = "error", "warning", "ok"
_SEVERITY = {ERROR: 0, WARNING: 1, OK: 2}


@dataclasses.dataclass(frozen=True)
class Finding:
    level: str  # ERROR, WARNING or OK
    check: str  # a short name: "deprecated-env", "timeouts", ...
    message: str  # what is wrong and what to change (or what was verified)
    ranks: tuple[int, ...] = ()  # the ranks it concerns, when not all

    def line(self) -> str:
        where = f" [ranks {format_ranks(self.ranks)}]" if self.ranks else ""
        return f"{self.level:<8} {self.check}{where}: {self.message}"

    def to_dict(self) -> dict:
        return {"level": self.level, "check": self.check, "message": self.message, "ranks": list(self.ranks)}


def format_ranks(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    ranks = sorted(set(ranks))
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(parts)


def sort_findings(findings: Iterable[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: _SEVERITY[f.level])


# --- the variables --------------------------------------------------------------------------------

# Deprecated spelling -> the spelling torch 2.13 prefers (it still reads both, with a warning).
RENAMED = {
    "NCCL_ASYNC_ERROR_HANDLING": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_BLOCKING_WAIT": "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_DESYNC_DEBUG": "TORCH_NCCL_DESYNC_DEBUG",
    "NCCL_ENABLE_TIMING": "TORCH_NCCL_ENABLE_TIMING",
    "NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_CPP_STACK": "TORCH_FR_CPP_STACK",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "TORCH_FR_DUMP_TEMP_FILE",
}

# Parsed by getCvarBool / getCvarInt: a value they cannot parse stops process-group creation.
BOOL_VARS = ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_DESYNC_DEBUG", "TORCH_NCCL_ENABLE_TIMING",
             "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_ENABLE_MONITORING", "TORCH_FR_CPP_STACK",
             "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK")
INT_VARS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
            "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC")
_TRUE, _FALSE = {"y", "yes", "t", "true", "1"}, {"n", "no", "f", "false", "0"}

# Timeout-looking variables that torch or NCCL really read; others of that shape are read by nobody.
KNOWN_TIMEOUT_VARS = {
    "NCCL_IB_TIMEOUT",  # NCCL: InfiniBand verbs retry timeout, not a collective timeout
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC",
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
}
_FAKE_TIMEOUT = re.compile(r"^(NCCL_TIMEOUT|(TORCH_NCCL|TORCH_FR|GLOO|TORCH_GLOO|TORCH_DIST\w*|C10D)_\w*TIMEOUT)")

# The variables compared across ranks (and gathered to rank 0).
RELEVANT_PREFIXES = ("NCCL_", "TORCH_", "GLOO_", "MASTER_", "C10D_")
RELEVANT_NAMES = ("OMP_NUM_THREADS",)


def relevant_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in sorted(environ.items()) if k.startswith(RELEVANT_PREFIXES) or k in RELEVANT_NAMES}


def env_digest(env: Mapping[str, str]) -> str:
    """A short hash of the variables and their values, equal on ranks with equal settings."""
    text = "\n".join(f"{k}={v}" for k, v in sorted(env.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def effective_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What the trainer's process groups will read: the environment plus hybridpar's defaults."""
    env = dict(environ)
    apply_env_defaults(None, env)
    return env


def _who_set(name: str, environ: Mapping[str, str]) -> str:
    if name not in environ:
        return "hybridpar's default, applied because it was unset"
    if name == "TORCH_NCCL_ASYNC_ERROR_HANDLING" and environ[name] == "1":
        return "torchrun sets it to 1 in every worker unless it is already set"
    return "set in the environment"


# --- single-rank checks ---------------------------------------------------------------------------


def check_deprecated(environ: Mapping[str, str]) -> list[Finding]:
    """Old spellings: still read alone (warning), ignored when the new spelling also has a value (error)."""
    effective = effective_env(environ)
    findings = []
    for old, new in RENAMED.items():
        if old not in environ:
            continue
        value = environ[old]
        if new not in effective:
            findings.append(Finding(WARNING, "deprecated-env",
                                    f"{old}={value} is a deprecated spelling (torch still reads it, with a warning): "
                                    f"rename it to {new}={value}"))
        elif effective[new] == value:
            findings.append(Finding(WARNING, "deprecated-env",
                                    f"{old}={value} is redundant: {new} has the same value; remove {old}"))
        else:
            findings.append(Finding(ERROR, "deprecated-env",
                                    f"{old}={value} is ignored: {new}={effective[new]} takes precedence "
                                    f"({_who_set(new, environ)}); to get {value}, set {new}={value} and remove {old}"))
    if not findings:
        findings.append(Finding(OK, "deprecated-env", "no deprecated NCCL/flight-recorder variable spellings"))
    return findings


def _as_int(value: Optional[str]) -> Optional[int]:
    """The integer std::stoi reads (leading blanks, a sign, digits; the rest ignored), else None."""
    match = re.match(r"\s*([+-]?\d+)", value or "")
    return int(match.group(1)) if match else None


def check_values(environ: Mapping[str, str]) -> list[Finding]:
    """Values torch cannot parse (process-group creation fails) or that disable the hang protection."""
    findings = []
    reverse = defaultdict(list)
    for old, new in RENAMED.items():
        reverse[new].append(old)
    for name in BOOL_VARS:
        for spelling in (name, *reverse[name]):
            value = environ.get(spelling)
            if value is not None and value.strip().lower() not in _TRUE | _FALSE:
                findings.append(Finding(ERROR, "env-values",
                                        f"{spelling}={value!r} is not a boolean: torch raises 'Invalid value for "
                                        f"environment variable' when it creates the process group; use 1 or 0"))
    for name in INT_VARS:
        for spelling in (name, *reverse[name]):
            value = environ.get(spelling)
            if value is not None and _as_int(value) is None:
                findings.append(Finding(ERROR, "env-values",
                                        f"{spelling}={value!r} is not an integer: torch raises 'Invalid value for "
                                        f"environment variable' when it creates the process group"))
    handling = effective_env(environ).get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "")
    mode = _as_int(handling)
    if mode is not None:
        if not 0 <= mode <= 3:
            findings.append(Finding(ERROR, "env-values",
                                    f"TORCH_NCCL_ASYNC_ERROR_HANDLING={handling} is not a mode torch knows (0-3): "
                                    "use 3 (tear the process down on a timeout, hybridpar's default) or 1"))
        elif mode == 0:
            findings.append(Finding(WARNING, "env-values",
                                    "TORCH_NCCL_ASYNC_ERROR_HANDLING=0: a timed-out NCCL collective does not stop the "
                                    "process, so a hang stays a hang; set it to 3 (hybridpar's default) or 1"))
    if not findings:
        findings.append(Finding(OK, "env-values", "NCCL and flight-recorder variables parse"))
    return findings


def _truthy(value: Optional[str]) -> bool:
    return value is not None and value.strip().lower() in _TRUE


def check_timeouts(environ: Mapping[str, str], init_timeout: Optional[float] = None,
                   train_timeout: Optional[float] = None) -> list[Finding]:
    """Settings that contradict each other or hybridpar's timeouts, and timeout variables nobody reads."""
    env = effective_env(environ)
    findings = []
    if _truthy(env.get("TORCH_NCCL_BLOCKING_WAIT")):
        findings.append(Finding(
            WARNING, "timeouts",
            f"TORCH_NCCL_BLOCKING_WAIT is on: ProcessGroupNCCL then starts no watchdog thread, so "
            f"TORCH_NCCL_ASYNC_ERROR_HANDLING={env.get('TORCH_NCCL_ASYNC_ERROR_HANDLING', 'unset')} and "
            "TORCH_NCCL_DUMP_ON_TIMEOUT do nothing and a timeout surfaces only in a wait() call (every collective "
            "also blocks the CPU); unset TORCH_NCCL_BLOCKING_WAIT to keep hybridpar's fail-fast timeouts"))
    if _truthy(env.get("TORCH_NCCL_DUMP_ON_TIMEOUT")):
        size = env.get("TORCH_FR_BUFFER_SIZE", env.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0"))
        if (_as_int(size) or 0) <= 0:
            findings.append(Finding(WARNING, "timeouts",
                                    f"TORCH_NCCL_DUMP_ON_TIMEOUT is on but TORCH_FR_BUFFER_SIZE={size}: the flight "
                                    "recorder keeps nothing to dump; set TORCH_FR_BUFFER_SIZE=2000"))
        if env.get("TORCH_NCCL_ENABLE_MONITORING", "1").strip().lower() in _FALSE:
            findings.append(Finding(WARNING, "timeouts",
                                    "TORCH_NCCL_DUMP_ON_TIMEOUT needs TORCH_NCCL_ENABLE_MONITORING=1, which is set "
                                    "to 0: unset TORCH_NCCL_ENABLE_MONITORING"))
    for name in sorted(environ):
        if _FAKE_TIMEOUT.match(name) and name not in KNOWN_TIMEOUT_VARS:
            findings.append(Finding(WARNING, "timeouts",
                                    f"{name}={environ[name]} is read by neither torch 2.13 nor NCCL: collective "
                                    "timeouts come from init_process_group(timeout=); set parallel.init_timeout and "
                                    f"diagnostics.train_timeout instead, and remove {name}"))
    if init_timeout is not None and train_timeout is not None:
        if train_timeout > init_timeout:
            findings.append(Finding(WARNING, "timeouts",
                                    f"diagnostics.train_timeout = {train_timeout:g} s is longer than "
                                    f"parallel.init_timeout = {init_timeout:g} s: after step 1 a hang would be "
                                    "detected later than during start-up; make train_timeout the shorter one"))
        elif init_timeout < 60:
            findings.append(Finding(WARNING, "timeouts",
                                    f"parallel.init_timeout = {init_timeout:g} s: rendezvous, data preparation and "
                                    "the first step often take minutes on a cluster; use 600 or more"))
    if not findings:
        both = init_timeout is not None and train_timeout is not None
        shown = f" (init {init_timeout:g} s, train {train_timeout:g} s)" if both else ""
        findings.append(Finding(OK, "timeouts", f"timeout settings are consistent{shown}"))
    return findings


def _nccl_matches(spec: str, interfaces: Sequence[str]) -> list[str]:
    """The interfaces NCCL_SOCKET_IFNAME selects: a comma list of name prefixes; a leading '^'
    excludes them, and a leading '=' (after any '^') makes every name in the list an exact match."""
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    items = [s for s in (spec[1:] if exact else spec).split(",") if s]

    def hit(iface: str) -> bool:
        return any(iface == s if exact else iface.startswith(s) for s in items)

    return [i for i in interfaces if hit(i) != exclude]


def check_interfaces(environ: Mapping[str, str], *, n_hosts: int, backend: str,
                     interfaces: Optional[Sequence[str]] = None) -> list[Finding]:
    """Socket interface settings: needed when the job spans hosts, and must name this host's interfaces."""
    findings = []
    uses_nccl = "nccl" in backend
    wanted = "NCCL_SOCKET_IFNAME" if uses_nccl else "GLOO_SOCKET_IFNAME"
    listed = f" (this host has: {', '.join(interfaces)})" if interfaces else ""
    if n_hosts > 1 and not environ.get(wanted):
        findings.append(Finding(WARNING, "interfaces",
                                f"the job spans {n_hosts} hosts and {wanted} is unset: {backend} picks an interface "
                                f"by itself, often the wrong one (docker0, a management or loopback network) on "
                                f"multi-homed nodes; set {wanted} to the high-speed interface{listed}"))
    if interfaces is not None:
        gloo = environ.get("GLOO_SOCKET_IFNAME")
        if gloo:
            missing = [name for name in gloo.split(",") if name and name not in interfaces]
            if missing:
                findings.append(Finding(ERROR, "interfaces",
                                        f"GLOO_SOCKET_IFNAME={gloo}: no interface {', '.join(missing)} on this host, "
                                        f"gloo fails to create its process group{listed}"))
        nccl = environ.get("NCCL_SOCKET_IFNAME")
        if nccl and not _nccl_matches(nccl, interfaces):
            findings.append(Finding(ERROR if uses_nccl else WARNING, "interfaces",
                                    f"NCCL_SOCKET_IFNAME={nccl} selects none of this host's interfaces, NCCL finds "
                                    f"no socket interface{listed}"))
    if not findings:
        what = f"{n_hosts} hosts" if n_hosts > 1 else "one host"
        findings.append(Finding(OK, "interfaces", f"socket interface settings fit ({what}, {backend})"))
    return findings


def check_env(environ: Mapping[str, str], *, n_hosts: int = 1, backend: str = "gloo",
              interfaces: Optional[Sequence[str]] = None, init_timeout: Optional[float] = None,
              train_timeout: Optional[float] = None) -> list[Finding]:
    """Every single-rank check on one rank's environment."""
    return [*check_deprecated(environ), *check_values(environ),
            *check_timeouts(environ, init_timeout, train_timeout),
            *check_interfaces(environ, n_hosts=n_hosts, backend=backend, interfaces=interfaces)]


# --- checks across ranks --------------------------------------------------------------------------


def check_rank_envs(envs: Sequence[Mapping[str, str]]) -> list[Finding]:
    """The relevant variables (relevant_env) of every rank, by rank: they should be identical."""
    names = sorted(set().union(*envs)) if envs else []
    differing = []
    for name in names:
        by_value: dict[Optional[str], list[int]] = defaultdict(list)
        for rank, env in enumerate(envs):
            by_value[env.get(name)].append(rank)
        if len(by_value) > 1:
            shown = "; ".join(f"{'unset' if v is None else repr(v)} on ranks {format_ranks(r)}"
                              for v, r in sorted(by_value.items(), key=lambda item: item[1][0]))
            differing.append(f"{name}: {shown}")
    if differing:
        return [Finding(WARNING, "env-consistency",
                        f"{len(differing)} variable(s) differ between ranks: " + " | ".join(differing)
                        + "; set them identically on every rank (export them in the job script, before srun "
                        "or torchrun)")]
    digest = env_digest(envs[0]) if envs else "-"
    return [Finding(OK, "env-consistency",
                    f"{len(names)} NCCL_/TORCH_/GLOO_/MASTER_ variables identical on all {len(envs)} ranks "
                    f"(digest {digest})")]


def allowed_cpus() -> list[int]:
    """The cores this process may run on (a Slurm allocation or taskset binds fewer than the host has)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _host_cores(infos: Sequence[Mapping]) -> int:
    """The cores a host's ranks may use: the union of their CPU affinities."""
    return len(set().union(*(i["cpu_ids"] for i in infos)))


def check_threads(ranks: Sequence[Mapping]) -> list[Finding]:
    """CPU oversubscription per host. Each item: host, threads (torch.get_num_threads()), cpu_ids
    (the cores the process may run on, os.sched_getaffinity)."""
    by_host: dict[str, list[Mapping]] = defaultdict(list)
    for info in ranks:
        by_host[info["host"]].append(info)
    findings = []
    for host, infos in by_host.items():
        n, cpus = len(infos), _host_cores(infos)
        threads = sum(i["threads"] for i in infos)
        if threads <= cpus:
            continue
        if all(i["threads"] == 1 for i in infos):
            findings.append(Finding(WARNING, "threads",
                                    f"host {host}: {n} processes on {cpus} cores, one thread each: CPU work "
                                    f"(data loading, CPU training) runs slower than it could; run at most {cpus} "
                                    "processes per host"))
        else:
            per_rank = sorted({i["threads"] for i in infos})
            findings.append(Finding(WARNING, "threads",
                                    f"host {host}: {n} processes x {'/'.join(map(str, per_rank))} threads = {threads} "
                                    f"> {cpus} cores: set OMP_NUM_THREADS={max(1, cpus // n)}"))
    if not findings:
        summary = ", ".join(f"{h}: {sum(i['threads'] for i in v)} threads on {_host_cores(v)} cores"
                            for h, v in by_host.items())
        findings.append(Finding(OK, "threads", f"no CPU oversubscription ({summary})"))
    return findings


def merge_findings(per_rank: Sequence[Sequence[Finding]]) -> list[Finding]:
    """One finding per distinct (level, check, message), with the ranks it came from (none: all ranks)."""
    seen: dict[tuple[str, str, str], list[int]] = {}
    for rank, findings in enumerate(per_rank):
        for f in findings:
            seen.setdefault((f.level, f.check, f.message), []).append(rank)
    merged = [Finding(level, check, message, () if len(ranks) == len(per_rank) else tuple(ranks))
              for (level, check, message), ranks in seen.items()]
    return sort_findings(merged)


__all__ = ["ERROR", "WARNING", "OK", "Finding", "RENAMED", "relevant_env", "env_digest",
           "effective_env", "check_deprecated", "check_values", "check_timeouts", "check_interfaces", "check_env",
           "check_rank_envs", "check_threads", "merge_findings", "format_ranks", "sort_findings"]
