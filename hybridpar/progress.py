"""How hybridpar speaks: through `logging`, one logger per module (`logging.getLogger(__name__)`,
all under "hybridpar"), and progress lines for long work (loading a model, converting, preparing
data), so that nobody waits long without a word: one line at most every `every` seconds, and one
at the end if any was printed, from one process (rank 0 by default). `note` says what starts or
what comes next (always, from that process); `summary`, when set, ends the closing line.

    with Progress("loading model.safetensors", total=n_bytes, unit="B") as progress:
        for ...:
            progress.update(len(chunk))

Which rank speaks is decided where a line is logged (rank 0 for information, as `note` does;
every rank for its own warnings and errors); each record carries `record.rank` once it passed
`RankFilter`. A progress note or line is a record marked `progress` (extra={"progress": True}).
The command line calls `log_to_terminal()`: the message alone, flushed at once, warnings, errors
and progress notes on stderr, the rest (a run's report lines) on stdout. A program that embeds
hybridpar and sets up no logging gets Python's default: warnings and errors on stderr.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Optional

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


PROGRESS = {"progress": True}  # extra= of a progress note: log_to_terminal's handler writes it to stderr


def note(text: str, *, enabled: Optional[bool] = None) -> None:
    """One progress note from the reporting process (rank 0 when `enabled` is None), logged at INFO
    by the calling module's logger."""
    if enabled is None:
        enabled = _rank() == 0
    if enabled:
        logging.getLogger(_caller()).info(text, extra=PROGRESS)


def _caller(depth: int = 2) -> str:
    """The logger of the module `depth` frames up (the one that called note or Progress): a module of
    hybridpar's own, else this one's (every record of hybridpar stays under "hybridpar")."""
    name = sys._getframe(depth).f_globals.get("__name__", "")
    return name if name.startswith("hybridpar.") else __name__


class RankFilter(logging.Filter):
    """Sets `record.rank`, this process's rank (0 without a process group); lets every record through."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            record.rank = _rank()
        except Exception:  # noqa: BLE001 - a group torn down under a dying rank: its verdict still goes out
            record.rank = None
        return True


class TerminalHandler(logging.Handler):
    """The command line's handler: each record as its message alone, flushed at once (a dying
    process's verdict must reach the terminal); warnings, errors and progress notes on stderr,
    other information on stdout. The streams are looked up at each record, so a redirected
    sys.stdout (contextlib.redirect_stdout, pytest's capture) gets the lines."""

    def __init__(self) -> None:
        super().__init__()
        self.addFilter(RankFilter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            to_stderr = record.levelno >= logging.WARNING or getattr(record, "progress", False)
            stream = sys.stderr if to_stderr else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own way: report and go on
            self.handleError(record)


def log_to_terminal() -> None:
    """What the command line (and each process it starts) calls once: hybridpar's records from INFO
    up go to a TerminalHandler, as the commands printed them before they logged. Calling it again
    changes nothing. The "hybridpar" logger then does not pass its records on to the root logger,
    which a library may have configured too (each line would show twice)."""
    logger = logging.getLogger("hybridpar")
    if not any(isinstance(h, TerminalHandler) for h in logger.handlers):
        logger.addHandler(TerminalHandler())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.propagate = False


class Progress:
    """Counts work done towards an optional total and reports it now and then (see the module)."""

    def __init__(self, what: str, total: Optional[float] = None, unit: str = "", *, every: float = 5.0,
                 enabled: Optional[bool] = None) -> None:
        self.what, self.total, self.unit, self.every = what, total, unit, every
        self.enabled = _rank() == 0 if enabled is None else enabled
        self.log = logging.getLogger(_caller())  # the module that does the work speaks
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
        if self.enabled:
            self.log.info(text, extra=PROGRESS)

    def update(self, amount: float = 1) -> None:
        self.done += amount
        now = time.monotonic()
        if self.enabled and now - self.last >= self.every:
            self.last = now
            self._say(self.line(now))

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
            self._say(f"{self.what}: done, {_amount(self.done, self.unit)} in {seconds:.0f} s{summary}")

    def _say(self, text: str) -> None:
        self.printed = True
        self.log.info(text, extra=PROGRESS)


def _rank() -> int:
    """This process's rank; 0 without torch.distributed imported (no process group can exist then,
    and a preparation worker or --help need not pay for importing torch)."""
    if "torch.distributed" not in sys.modules:
        return 0
    from .mesh.ranks import rank_and_world

    return rank_and_world()[0]

