"""The hang watchdog's monitor: rank 0 reads every rank's heartbeat (rank 1 when rank 0's stops).

It acts when
  - no rank has made progress (step, phase or collective count) for the timeout: a hang;
  - a rank's heartbeat stopped: the process is gone (killed, crashed, os._exit), or a rank never
    started beating within the timeout (stuck before training);
  - a rank raised and the others are stuck without it.
A rank stopping on request (a stop signal: hybridpar.train.stop) is none of these: it is active and
progressing while it finishes its step and saves, and a rank that leaves on purpose says "stopped"
(or "done") first. The launcher's teardown after a failure is told by the failure itself.
Then it asks every live rank for its trace, runs `flight.analyse`, prints one report, writes
`hang_report.json` in the run folder and tells every rank to exit with HANG_EXIT_CODE.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

from ..files import write_text_atomic
from ..mesh.layout import MeshCoords
from ..mesh.ranks import restart_count
from . import flight
from .heartbeat import HANG_EXIT_CODE, Heartbeat
from .liveness import is_peer_loss, process_stopped
from .node_fault import describe as describe_fault, node_fault
from .traces import RankTrace

log = logging.getLogger(__name__)


LEFT = ("done", "stopped", "paused")  # the states of a rank that ended (or paused) on purpose: not watched


def verdict_time(quiet_s: float) -> dict:
    """A verdict's when: the wall clock now, how long the culprits had been quiet, torchrun's restart."""
    return {"time": time.time(), "quiet_s": round(quiet_s, 3), "attempt": restart_count()}


def save_report(run_dir: Path, text: Optional[str], report: dict) -> None:
    """Print `text` (if any) and write `report` as the run's hang_report.json (the verdict launch/slurm.sh reads)."""
    report_path = Path(run_dir) / "hang_report.json"
    if text:
        log.error("\n" + text + f"\nreport: {report_path}\n")
    try:
        write_text_atomic(report_path, json.dumps(report, indent=1))
    except OSError as err:
        log.error(f"hybridpar watchdog: could not write {report_path}: {err}")


class Monitor:
    """Watches everyone's heartbeat through this rank's (`beat`, its store connection and clock):
    rank 0's acts, rank 1's takes over when rank 0's stops. `exit_fn` ends the process after a verdict."""

    def __init__(self, beat: Heartbeat, *, run_dir: Path, exit_fn: Callable[[int], None] = os._exit) -> None:
        self.beat = beat
        self.rank, self.world_size = beat.rank, beat.world_size
        self.run_dir = Path(run_dir)
        self._exit = exit_fn
        # rank -> (last value, monitor time it last changed)
        self._beats: dict[int, tuple[object, float]] = {}
        self._progress: dict[int, tuple[object, float]] = {}
        self._last: dict[int, dict] = {}  # rank -> its last heartbeat
        self._all_beating = False
        self.dead: list[int] = []
        self.died: list[int] = []  # of those, the ranks whose process is known to be gone
        self.frozen: dict[int, int] = {}  # of those, rank -> pid of the stopped processes on this host
        self._waiting: dict[int, tuple[object, float]] = {}  # rank -> (its wait, monitor time it was first seen)
        self._waits_said: Optional[float] = None  # when the wait last said (to say it once) began
        self._gone: set[int] = set()  # ranks a neighbour saw die (liveness.py)
        self.started = time.time()  # a hang_report.json older than this is an earlier attempt's
        # For a mixture of experts' run: why a rank computes more (the ep rank holding the last step's
        # hot experts, hybridpar.train.experts), else None; a culprit's is said in the verdict.
        self.hot: Optional[Callable[[int], Optional[str]]] = None

    def rank0_gone(self) -> bool:
        """Rank 1's question before it takes over: has rank 0 died, or its heartbeat stopped?"""
        if 0 in self._seen_dead():
            return True
        if not self.beat.has("beat/0"):  # rank 0 is still setting up: a get would block until it beats
            return False
        beat = json.loads(self.beat.get_many(["beat/0"])[0])
        now = self.beat.clock.monotonic()
        last = self._beats.get(0)
        if last is None or last[0] != beat["beat"]:
            self._beats[0] = (beat["beat"], now)
            return False
        return beat["state"] not in LEFT and now - last[1] > self.beat.dead_after()

    # --- reading the heartbeats -----------------------------------------------------------------

    def _read_beats(self) -> dict[int, dict]:
        names = [f"beat/{r}" for r in range(self.world_size)]
        if not self._all_beating:  # until every rank has beaten once: one check each
            present = [n for n in names if self.beat.store.check([self.beat.key(n)])]
            self._all_beating = len(present) == len(names)
        else:  # then one round trip for all (a beat key is never deleted)
            present = names
        values = self.beat.get_many(present) if present else []
        return {int(n.split("/")[1]): json.loads(v) for n, v in zip(present, values)}

    def _observe(self, now: float) -> None:
        """Note, per rank, when its beat and its progress last changed."""
        beats = self._read_beats()
        for r in range(self.world_size):
            b = beats.get(r)
            if b is None:
                self._beats.setdefault(r, (None, now))
                self._progress.setdefault(r, (None, now))
                continue
            self._last[r] = b
            if self._beats.get(r, (None,))[0] != b["beat"]:
                self._beats[r] = (b["beat"], now)
            progress = (b["step"], b["phase"], tuple(sorted(b["seqs"].items())))
            if self._progress.get(r, (None,))[0] != progress:
                self._progress[r] = (progress, now)
            if b["state"] != "waiting":  # a wait is timed from when it was first seen, whatever it does meanwhile
                self._waiting.pop(r, None)
            elif self._waiting.get(r, (None,))[0] != b.get("waits"):
                self._waiting[r] = (b.get("waits"), now)

    def _seen_dead(self) -> set[int]:
        """Ranks a neighbour saw die: one round trip while there are none."""
        count = self.beat.store.add(self.beat.key("gone_count"), 0)
        if count > len(self._gone):
            self._gone |= {r for r in range(self.world_size) if r not in self._gone and self.beat.has(f"gone/{r}")}
        return self._gone

    def _states(self, state: str, ranks: list[int]) -> list[int]:
        return [r for r in ranks if self._last.get(r, {}).get("state") == state]

    # --- deciding -------------------------------------------------------------------------------

    def check(self) -> Optional[str]:
        """The reason to report now, or None."""
        now = self.beat.clock.monotonic()
        self._observe(now)
        active = [r for r in range(self.world_size) if self._last.get(r, {}).get("state") not in LEFT]
        if not active:
            return None
        failed = self._states("failed", active)
        timeout = max(self._last.get(r, {}).get("timeout", self.beat.timeout) for r in active)
        # A rank waiting for something outside the job (the replica groups' quorum) is not hung however
        # long; the ranks that are not waiting are judged as ever, and a waiting rank's death still counts.
        waiting = self._states("waiting", active)
        judged = [r for r in active if r not in waiting] or active
        idle = now - max(self._progress[r][1] for r in judged)
        # A failed rank stops beating once it has published its error and trace: not a death.
        died = sorted(r for r in self._seen_dead() if r in active and r not in failed)
        # A silent heartbeat is only a guess (C code holding the GIL through a long set-up step looks
        # the same): for ranks on this host the process itself is looked at instead.
        # A stopped process (SIGSTOP, a debugger) is alive but will not progress: its silence counts.
        neighbours = self.beat.neighbours or {}
        frozen = {r for r, pid in neighbours.items() if process_stopped(pid)}
        local = set(neighbours) - frozen
        silent = [r for r in active if r not in failed and r not in died
                  and self._beats[r][0] is not None and now - self._beats[r][1] > self.beat.dead_after()]
        stopped = [r for r in silent if r not in local and r not in frozen]
        frozen = sorted(r for r in silent if r in frozen)
        if self.rank == 1 and 0 not in stopped + failed:  # rank 1 monitors only when rank 0 is gone
            stopped.append(0)
        # A rank that never beat may still be setting up (building the model, loading a checkpoint)
        # without any collective: it gets the whole timeout.
        unstarted = [r for r in active if self._beats[r][0] is None and now - self._beats[r][1] > timeout]
        self.dead = sorted(set(died + stopped + frozen + unstarted))
        self.died = died
        self.frozen = {r: neighbours[r] for r in frozen}
        reasons = []
        if died:
            reasons.append(f"rank(s) {died} died (the process is gone: it exited, was killed or crashed)")
        if stopped:
            reasons.append(f"rank(s) {sorted(stopped)} stopped sending heartbeats (process gone)")
        if frozen:
            reasons.append(f"rank(s) {frozen} are stopped (SIGSTOP, a debugger): alive, their heartbeat silent")
        if unstarted:
            reasons.append(f"rank(s) {unstarted} have not started their watchdog within {timeout:g} s "
                           "(not reached training: stuck in set-up, or never started)")
        if reasons:
            return "; ".join(reasons)
        # A rank failed, and the others are stuck without it, or already know it: a collective of
        # theirs lost it, or the launcher's teardown (a stop signal) reached them.
        knowing = [r for r in active if self._last.get(r, {}).get("state") in ("lost_peer", "stopping")]
        if failed and (knowing or idle > self.beat.dead_after()):
            notes = "; ".join(f"rank {r} {self._last[r]['note']}" for r in failed[:3])
            return f"rank(s) {failed} failed: {notes}"
        if len(waiting) == len(active):
            self._waited(now, waiting, timeout)
        elif idle > timeout:
            return f"no progress on any rank for {idle:.1f} s (timeout {timeout:g} s)"
        return None

    def _waited(self, now: float, waiting: list[int], timeout: float) -> None:
        """Every rank waits outside the job: said once a wait has lasted longer than the timeout."""
        since = max(self._waiting[r][1] for r in waiting)
        if now - since <= timeout or self._waits_said == since:
            return
        self._waits_said = since
        what = self._last[waiting[0]].get("note") or "something outside the job"
        log.warning(f"{self._who()}: every rank has waited {now - since:.0f} s for {what}, longer than the "
                    f"watchdog's no-progress limit ({timeout:g} s): not a hang; training goes on when the wait ends")

    # --- reporting ------------------------------------------------------------------------------

    def report(self, reason: str) -> None:
        """Collect the traces, print and write the verdict, and make every rank exit."""
        self.beat.put("dump", reason)
        self.beat.answer_dump_request()
        dead = list(self.dead)
        traces = self._collect(dead)
        gone = sorted(set(dead) | (set(range(self.world_size)) - set(traces)))
        for r, t in traces.items():
            last = self._last.get(r)
            if last and last.get("note") and not t.note:
                t.note = last["note"]
        text = self._write(reason, traces, gone)
        self.beat.put("verdict", text)
        self.beat.put("abort", "1")
        self._end_stopped()
        self._exit(HANG_EXIT_CODE)

    def _end_stopped(self) -> None:
        """A stopped process cannot obey the verdict, and its launcher would wait its grace (torchrun's
        30 s) before killing it: the ranks of this host stopped end now, so that the launcher restarts the job."""
        for r, pid in sorted(self.frozen.items()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError as err:  # gone meanwhile, or not ours to end
                log.warning(f"{self._who()}: could not end stopped rank {r} (pid {pid}): {err}")
            else:
                log.error(f"{self._who()}: rank {r} (pid {pid}) was stopped and cannot exit by itself: killed")

    def _write(self, reason: str, traces: dict[int, RankTrace], gone: list[int]) -> str:
        """Analyse, print the report and write hang_report.json; the report's text."""
        last_issued = {r: self._last.get(r, {}).get("seqs", {}) for r in gone}
        step = max((last.get("step", 0) for last in self._last.values()), default=0)
        headline = f"{self._who()} at step {step}: {reason}"
        try:
            verdict = flight.analyse(traces, gone, last_issued)
            verdict.gone = self._gone_info(gone)
            fault = node_fault(verdict.findings, self.died, self._nodes(), self.world_size)
            text = (flight.format_report(verdict, headline, self.world_size) + "\n"
                    + describe_fault(fault, self.beat.group))
            report = {"reason": reason, "step": step, "node_fault": fault, **self._when(verdict.culprits),
                      **verdict.to_json()}
            hot = self._hot(verdict.culprits or self.dead)
            if hot:
                text += f"\n{hot}"
                report["hot_experts"] = hot
        except Exception:  # a bug in the analysis must not cost the report, nor the other ranks' exit
            error = traceback.format_exc()
            text = f"{headline}\nthe analysis of the traces failed:\n{error}"
            report = {"reason": reason, "step": step, "analysis_error": error,
                      "node_fault": {"nodes": [], "why": "the analysis failed"}}
        report_path = self.run_dir / "hang_report.json"
        text += (f"\nreport: {report_path}; per-rank traces: {self.beat.trace_dir} on each node "
                 f"(`hybridpar hang-report DIR` after collecting them)\nthe ranks exit with code {HANG_EXIT_CODE}")
        log.error("\n" + text + "\n")
        self._save(None, report)
        return text

    def _hot(self, ranks: list[int]) -> Optional[str]:
        """The hot experts' line of the first of `ranks` that holds them (None: none does, or no experts)."""
        if self.hot is None:
            return None
        return next((line for line in map(self.hot, ranks) if line), None)

    def store_lost(self, seconds: float, error: BaseException) -> str:
        """This rank has not reached the job's store for `seconds`: its host, rank 0, is frozen or
        gone, and with it the monitor. The lowest rank off rank 0's node says so for the launcher,
        unless a verdict of this attempt is there already (rank 0's own error, written as it failed).
        What it did, for the rank's last line."""
        nodes = dict(self.beat.nodes)
        if 0 not in nodes:
            return "rank 0's node is not known: no verdict"
        if self.beat.state in ("done", "stopped"):
            return f"this rank is {self.beat.state}: no verdict"  # rank 0 may have ended before it
        writer = min((r for r, n in nodes.items() if n != nodes[0]), default=None)
        if writer != self.rank:
            return f"rank {writer} names rank 0's node" if writer is not None else "every rank is on rank 0's node"
        path = self.run_dir / "hang_report.json"
        if path.exists() and path.stat().st_mtime >= self.started:
            return f"{path} says why"
        gone = is_peer_loss(error)  # the connection broke: the process is gone, not frozen
        reason = (f"the job's store (rank 0's, on node {nodes[0]}) has not answered rank {self.rank} for "
                  f"{seconds:.0f} s ({error}): rank 0 is {'gone' if gone else 'frozen'}")
        fault = {"kind": "death" if gone else "stall", "nodes": [nodes[0]], "ranks": [0]}
        self._save(f"{self._who()} at step {self.beat.step}: {reason}\n{describe_fault(fault, self.beat.group)}",
                   {"reason": reason, "step": self.beat.step, "node_fault": fault, **verdict_time(seconds)})
        return f"{path} names node {nodes[0]}"

    def own_failure(self, error: BaseException) -> None:
        """Rank 0 raised (the program's fault, not its node's): said in the report before its store goes
        away with it, so that the others' store_lost does not blame its node."""
        reason = f"rank 0 raised {type(error).__name__}: {error}"
        self._save(None, {"reason": reason, "step": self.beat.step, **self._when([0]),
                          "node_fault": {"nodes": [], "why": "the program's own fault (failed): rank 0 raised"}})

    def _who(self) -> str:
        """Who gives the verdict: the watchdog, of replica group G in a fault-tolerant job."""
        group = self.beat.group
        return "hybridpar watchdog" + (f" of replica group {group}" if group is not None else "")

    def _save(self, text: Optional[str], report: dict) -> None:
        if self.beat.group is not None:
            report = {**report, "group": self.beat.group}
        save_report(self.run_dir, text, report)

    def _when(self, culprits: list[int]) -> dict:
        """When the verdict came (wall clock), how long the culprits (else every rank) had been quiet
        by then, and which of torchrun's restarts this is."""
        now = self.beat.clock.monotonic()
        quiet = [now - self._progress[r][1] for r in (culprits or range(self.world_size)) if r in self._progress]
        return verdict_time(max(quiet, default=0.0))

    def _nodes(self) -> dict[int, str]:
        """rank -> node of every rank that registered."""
        nodes = dict(self.beat.nodes)
        for r in range(self.world_size):
            if r in nodes:
                continue
            try:
                if self.beat.store.check([self.beat.who_key(r)]):
                    who = self.beat.whos([r])[0]
                    nodes[r] = who.get("node", who["host"])
            except Exception:  # the store is going away with the job
                break
        return nodes

    def _gone_info(self, gone: list[int]) -> dict[int, dict]:
        """Where the ranks without a trace ran and what their last heartbeat said."""
        p, info = self.beat.parallel, {}
        for r in gone:
            entry = {}
            entry["coords"] = MeshCoords.of(r, *p.sizes).describe(self.beat.group)  # its stage too, under pp
            last = self._last.get(r, {})
            entry.update({k: last[k] for k in ("step", "phase") if k in last})
            try:
                if self.beat.store.check([self.beat.who_key(r)]):
                    entry.update(self.beat.whos([r])[0])
            except Exception:  # the store is going away with the job: the coordinates still help
                pass
            info[r] = entry
        return info

    def _collect(self, dead: list[int]) -> dict[int, RankTrace]:
        """Traces of every live rank; those that do not answer within a few seconds are left out."""
        wanted = [r for r in range(self.world_size) if r not in dead]
        deadline = self.beat.clock.monotonic() + max(5.0, 4 * self.beat.interval)
        traces: dict[int, RankTrace] = {}
        while True:
            for r in wanted:
                if r not in traces and self.beat.has(f"trace/{r}"):
                    traces[r] = RankTrace.from_json(json.loads(self.beat.get_many([f"trace/{r}"])[0]))
            if len(traces) == len(wanted) or self.beat.clock.monotonic() > deadline:
                return traces
            self.beat.clock.sleep(0.1)
