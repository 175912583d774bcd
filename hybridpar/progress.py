"""Progress lines for long work (loading a model, converting, preparing data), so that nobody
waits long without a word: one line at most every `every` seconds, and one at the end if any
was printed, from one process (rank 0 by default) to stderr. `note` says what starts or what
comes next (always, from that process); `summary`, when set, ends the closing line.

    with Progress("loading model.safetensors", total=n_bytes, unit="B") as progress:
        for ...:
            progress.update(len(chunk))
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from .files import human_bytes


def hms(seconds: float) -> str:
    """A duration as h:mm:ss ("0:04:05", "27:46:40": hours are not folded into days); "?" when
    it is unknown (NaN, infinite or negative)."""
    if not 0 <= seconds < float("inf"):
        return "?"
    h, rest = divmod(int(round(seconds)), 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"


def _amount(n: float, unit: str) -> str:
    if unit != "B":
        return f"{n:,.0f}{' ' + unit if unit else ''}"
    return human_bytes(n)


def note(text: str, *, enabled: Optional[bool] = None, stream: Optional[TextIO] = None) -> None:
    """One line from the reporting process (rank 0 when `enabled` is None), to stderr."""
    if enabled is None:
        enabled = _rank() == 0
    if enabled:
        print(text, file=stream or sys.stderr, flush=True)


class Progress:
    """Counts work done towards an optional total and reports it now and then (see the module)."""

    def __init__(self, what: str, total: Optional[float] = None, unit: str = "", *, every: float = 5.0,
                 enabled: Optional[bool] = None, stream: Optional[TextIO] = None) -> None:
        self.what, self.total, self.unit, self.every = what, total, unit, every
        self.enabled = _rank() == 0 if enabled is None else enabled
        self.stream = stream
        self.done = 0.0
        self.start = self.last = time.monotonic()
        self.printed = False
        self.summary = ""  # e.g. "1,234 tokens in 5 documents": what the work made, for the closing line
        self.rates: dict[str, float] = {}  # other counts shown per second, e.g. {"tokens": n}

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.finish()

    def note(self, text: str) -> None:
        """One line from the reporting process whatever the timing (what starts, what comes next);
        it does not count as having spoken, so short work still ends without a closing line."""
        note(text, enabled=self.enabled, stream=self.stream)

    def update(self, amount: float = 1) -> None:
        self.done += amount
        now = time.monotonic()
        if self.enabled and now - self.last >= self.every:
            self.last = now
            self._print(self.line(now))

    def line(self, now: Optional[float] = None) -> str:
        elapsed = (now or time.monotonic()) - self.start
        text = f"{self.what}: {_amount(self.done, self.unit)}"
        if self.total:
            text += f" of {_amount(self.total, self.unit)} ({100 * self.done / self.total:.0f}%)"
        if self.rates and elapsed > 0:
            shown = ([f"{human_bytes(self.done / elapsed)}/s"] if self.unit == "B" else []) + \
                [f"{n / elapsed:,.0f} {name}/s" for name, n in self.rates.items()]
            text += ", " + ", ".join(shown)
        if self.total and 0 < self.done < self.total:
            text += f", about {elapsed * (self.total - self.done) / self.done:.0f} s left"
        return text + f" [{elapsed:.0f} s]"

    def finish(self) -> None:
        """The closing line, if any line was printed (short work stays silent)."""
        if self.enabled and self.printed:
            seconds = time.monotonic() - self.start
            summary = f": {self.summary}" if self.summary else ""
            self._print(f"{self.what}: done, {_amount(self.done, self.unit)} in {seconds:.0f} s{summary}")

    def _print(self, text: str) -> None:
        self.printed = True
        print(text, file=self.stream or sys.stderr, flush=True)


def _rank() -> int:
    """This process's rank; 0 without torch.distributed imported (no process group can exist then,
    and a preparation worker or --help need not pay for importing torch)."""
    if "torch.distributed" not in sys.modules:
        return 0
    from .mesh.ranks import rank_and_world

    return rank_and_world()[0]

