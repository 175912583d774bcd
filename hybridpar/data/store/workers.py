"""The work on a share of a store's units (unit_plan.part_of): each built here or in worker
processes (unit_build.build_unit, claimed one at a time under its lock), units that other
processes hold waited for (and built here if their holder dies), and the progress of it all."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import time
from typing import Callable, Optional, Sequence

from hybridpar.data.store.token_store import MANIFEST, PLAN, StoreError
from hybridpar.data.store.unit_build import claim_and_build, unit_holder, unit_record
from hybridpar.data.store.unit_plan import Plan, read_plan
from hybridpar.progress import Progress, note

_POLL = 0.5  # seconds between looks at units other processes hold
_TELL_EVERY = 0.5  # seconds between a worker's words on what it read and made inside a unit
# A preparation waiting for units that other processes hold (they are alive: their locks are held)
# says which and who every SAY_WAITING_EVERY seconds, and gives up once none of them has finished
# for WAIT_WITHOUT_PROGRESS seconds (a 64 MB unit takes a minute or two; docs/data.md).
SAY_WAITING_EVERY = 30.0
WAIT_WITHOUT_PROGRESS = 1800.0


# --- worker processes ----------------------------------------------------------------------------

class _Worker:
    """A worker process's state for its life, given when it starts: the plan, the tokenizer, the
    units it shares with the other workers (`taken`: how many of them are taken, a counter they
    share) and the queue it tells the parent on: ("read", i, bytes, tokens) while unit i is built, at
    most every _TELL_EVERY s (a unit can take minutes), then ("built", i, the record, or None where
    another process holds the unit) or ("failed", i, the error), after which it takes no more."""

    def __init__(self, plan: Plan, units: Sequence[int], tokenizer, taken, heard) -> None:
        self.plan, self.units, self.tokenizer, self.taken, self.heard = plan, list(units), tokenizer, taken, heard
        self.parent = os.getpid()  # made in the parent

    def __call__(self) -> None:
        from hybridpar.data.tokenizer import limit_threads

        os.environ.setdefault("OMP_NUM_THREADS", "1")
        limit_threads(self.tokenizer, 1)  # the workers are the parallelism
        while (index := self._take()) is not None:
            try:
                self.heard.put(("built", index, self._build(index)))
            except BaseException as err:  # noqa: BLE001 - the parent raises it
                self.heard.put(("failed", index, _portable(err)))
                return

    def _take(self) -> Optional[int]:
        """The next unit nobody took, or None (all taken, the parent stopped the work, or it is gone)."""
        if os.getppid() != self.parent:  # killed: nobody hears, and its next run redoes what is left
            return None
        with self.taken.get_lock():
            k = self.taken.value
            if k >= len(self.units):
                return None
            self.taken.value = k + 1
        return self.units[k]

    def _build(self, index: int) -> Optional[dict]:
        counts, told = [0, 0], [time.monotonic()]

        def count(which: int, n: int) -> None:
            counts[which] += n
            if time.monotonic() - told[0] >= _TELL_EVERY:
                tell()

        def tell() -> None:
            if counts != [0, 0]:
                self.heard.put(("read", index, *counts))
                counts[:] = [0, 0]
            told[0] = time.monotonic()

        try:
            return claim_and_build(self.plan, index, self.tokenizer, lambda n: count(0, n), lambda n: count(1, n))
        finally:
            tell()


def _portable(err: BaseException) -> BaseException:
    """The error as the queue can carry it: itself, or its text where it does not pickle (the queue
    would drop it, and the parent never hear of the failure)."""
    try:
        pickle.dumps(err)
        return err
    except Exception:  # noqa: BLE001 - whatever stops it pickling
        return StoreError(f"{type(err).__name__}: {err}")


def work_on(plan: Plan, mine: Sequence[int], tokenizer, *, workers: int, wait: bool, report: Optional[bool],
            progress_every: float, on_progress: Optional[Callable[[str], None]], what: str) -> None:
    """Build the units `mine` of `plan` that are not done, in this process (`workers` 1) or in
    `workers` processes; with `wait`, also those other processes hold, once they finish or die.
    `what` names the work in the first line."""
    if (plan.folder / MANIFEST).is_file():
        return
    todo = [i for i in mine if unit_record(plan, i) is None]
    progress = _StoreProgress(plan, mine, report, progress_every, on_progress)
    progress.done = sum(plan.units[i].read_bytes for i in mine if i not in todo)
    if todo:
        done_before = len(mine) - len(todo)
        progress.note(what + (f"; {done_before} units were done before" if done_before else ""))
    with progress:
        counted, pooled = _Counted(plan, progress), workers > 1 and len(todo) > 1
        if pooled:
            _in_workers(plan, todo, tokenizer, workers, counted)
        if wait or not pooled:  # after the workers: the units other processes held, waited for
            _here(plan, [i for i in todo if i not in counted.closed], tokenizer, counted, wait)
        progress.summary = f"{progress.rates['tokens']:,.0f} tokens"


class _StoreProgress(Progress):
    """Bytes of a share's units done (by this process or another), tokens/s, and a word to
    `on_progress` whenever the count moves (throttled)."""

    def __init__(self, plan: Plan, units: Sequence[int], report: Optional[bool], every: float,
                 on_progress: Optional[Callable[[str], None]]) -> None:
        super().__init__(f"preparing {plan.folder}", total=sum(plan.units[i].read_bytes for i in units), unit="B",
                         enabled=report, every=every)
        self.rates["tokens"] = 0
        self._on_progress, self._told = on_progress, 0.0

    def update(self, amount: float = 1) -> None:
        super().update(amount)
        self._tell()

    def made(self, tokens: int) -> None:
        """Tokens made here: they move the work on even inside one long unit."""
        self.rates["tokens"] += tokens
        if self.done < (self.total or 0):  # a line is due even when no byte was counted (bytes are told late)
            self.update(0)
        else:
            self._tell()

    def _tell(self) -> None:
        now = time.monotonic()
        if self._on_progress is not None and now - self._told >= 1.0:
            self._told = now
            self._on_progress(f"preparing data, {self.done / max(self.total or 1, 1):.1%} of the input, "
                              f"{self.rates['tokens']:,.0f} tokens made here")


class _Counted:
    """The bytes of units being built, counted as they are read (here or by a worker), then whole
    once the unit is done (by anyone): a worker's word arriving after its result adds none."""

    def __init__(self, plan: Plan, progress: _StoreProgress) -> None:
        self.plan, self.progress, self.made = plan, progress, progress.made
        self.seen: dict[int, int] = {}
        self.closed: set[int] = set()

    def read(self, i: int, n: int) -> None:
        if i not in self.closed:
            self.seen[i] = self.seen.get(i, 0) + n
            self.progress.update(n)

    def done(self, i: int) -> None:
        self.closed.add(i)
        planned = self.plan.units[i].read_bytes - self.seen.pop(i, 0)  # what the reads did not count
        if planned:
            self.progress.update(planned)


def _in_workers(plan: Plan, todo: list[int], tokenizer, workers: int, counted: _Counted) -> None:
    """Build the units `todo` in `workers` processes (those another process holds are left to it),
    each taking the next unit until none is left. A unit that fails stops the taking: its error is
    raised here once the others have finished the units in hand; a worker that dies (killed, out
    of memory) ends the others at once (a unit cut short is made again by the next run)."""
    context = multiprocessing.get_context("spawn")  # no fork: the caller may hold threads (a training job)
    taken, heard = context.Value("q", 0), context.Queue()
    processes = [context.Process(target=_Worker(plan, todo, tokenizer, taken, heard), name=f"hybridpar prepare {n}")
                 for n in range(min(workers, len(todo)))]
    failed: list[BaseException] = []

    def stop() -> None:
        with taken.get_lock():
            taken.value = len(todo)

    def hear(timeout: float) -> None:
        try:
            word = heard.get(timeout=timeout)
            while True:
                kind, i, *said = word
                if kind == "read":
                    counted.read(i, said[0])
                    counted.made(said[1])
                elif kind == "built" and said[0] is not None:
                    counted.done(i)
                elif kind == "failed":
                    failed.append(said[0])
                    stop()
                word = heard.get_nowait()
        except queue.Empty:
            return

    try:
        for process in processes:
            process.start()
        while any(process.is_alive() for process in processes):
            hear(_TELL_EVERY)
            died = next((p for p in processes if p.exitcode not in (None, 0)), None)
            if died is not None:
                code = died.exitcode
                raise StoreError(f"{plan.folder}: a preparation worker (pid {died.pid}) died: "
                                 + (f"killed by signal {-code} (out of memory?)" if code < 0 else
                                    f"exit code {code} (its error is above)")
                                 + "; run again: it goes on where it stopped")
        hear(0)  # their last words
    except BaseException:
        stop()
        for process in processes:
            if process.is_alive():
                process.terminate()
        raise
    finally:
        for process in processes:
            if process.pid is not None:
                process.join()
    if failed:
        raise failed[0]


def _here(plan: Plan, units: list[int], tokenizer, counted: _Counted, wait: bool) -> None:
    """Build the units `units` in this process, one after another (those another process holds are
    left to it); with `wait`, until every one is done: units another process holds are waited for,
    said every SAY_WAITING_EVERY s (which, and who holds them), and one whose holder died (its lock
    released, no record) is built here. Gives up, in one line, when none has finished in
    WAIT_WITHOUT_PROGRESS s."""
    left = list(units)
    moved = said = time.monotonic()
    while left:
        for i in left:
            if claim_and_build(plan, i, tokenizer, lambda n, i=i: counted.read(i, n), counted.made) is not None:
                counted.done(i)
        still = [i for i in left if i not in counted.closed]
        now = time.monotonic()
        moved = now if len(still) < len(left) else moved
        if not still or not wait:
            return
        if len(still) == len(left):
            counted.progress.update(0)  # a word to on_progress every round: waiting for others is work too
        left = still
        if (read_plan(plan.folder) or {}).get("key") != plan.key:
            raise StoreError(f"{plan.folder / PLAN} changed while this process waited for units of it: another "
                             "preparation replaced it; run this one again")
        if now - moved >= WAIT_WITHOUT_PROGRESS:
            raise StoreError(f"{plan.folder}: waited {now - moved:.0f} s for {_held(plan, left)}, and none finished: "
                             "if those processes are stuck, stop them and run again (it goes on where it stopped)")
        if now - said >= SAY_WAITING_EVERY:
            said = now
            note(f"{plan.folder}: waiting for {_held(plan, left)} ({now - moved:.0f} s without one finishing; "
                 f"gives up after {WAIT_WITHOUT_PROGRESS:.0f} s)", enabled=counted.progress.enabled)
        time.sleep(_POLL)


def _held(plan: Plan, units: Sequence[int]) -> str:
    """'units 3, 5 held by host pid 12 (3), host pid 14 (5)': the holders their lock files name."""
    holders: dict[str, list[int]] = {}
    for i in units:
        holders.setdefault(unit_holder(plan, i) or "another process", []).append(i)
    shown = ", ".join(str(i) for i in units[:10]) + (" ..." if len(units) > 10 else "")
    return f"unit{'s' if len(units) > 1 else ''} {shown} held by " + "; ".join(
        f"{who} ({', '.join(str(i) for i in held[:5])}{' ...' if len(held) > 5 else ''})" for who, held in holders.items())
