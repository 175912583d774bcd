"""A stop on request: SIGTERM, SIGINT or SIGUSR1 end a run with a checkpoint, not with lost steps.

Slurm sends SIGTERM at scancel and, asked with --signal, SIGUSR1 ahead of a time limit; torchrun
forwards what it gets to every rank; a terminal sends SIGINT. The handler only takes note: the main
thread may be inside a collective or a checkpoint write, and leaving there would strand the other
ranks or half-write files. The trainer reads the note once per step in a collective every rank
makes anyway, so all ranks stop after the same step, save and exit.

A stop must also end when the step or the save cannot (a hung collective, a slow file system): the
signal also reaches a listener thread (through signal.set_wakeup_fd, so even while the main thread
waits in C code), which tells the watchdog at once and, `timeout` seconds after the first signal,
calls `on_expire` unless `finish()` came first. Later signals only add to `count`.
"""

from __future__ import annotations

import json
import select
import signal
import socket
import threading
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..files import write_text_atomic

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def agreed(votes: Sequence[float]) -> str:
    """The stop signal the summed ballots ask for ("" for none; of several, the first in STOP_SIGNALS)."""
    return next((s.name for s, n in zip(STOP_SIGNALS, votes) if n > 0), "")


class StopRequest:
    """Install on the main thread; `requested` says whether a stop signal came, `signal_name` which."""

    def __init__(self, timeout: float, *, on_signal: Callable[[str], None] = lambda name: None,
                 on_expire: Callable[["StopRequest"], None] = lambda stop: None) -> None:
        self.timeout = timeout
        self.on_signal, self.on_expire = on_signal, on_expire
        self.signum: Optional[int] = None
        self.count = 0
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._previous: dict[int, object] = {}
        self._previous_fd = -1
        self._sockets: Optional[tuple[socket.socket, socket.socket]] = None
        self._listener: Optional[threading.Thread] = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def vote(self) -> list[float]:
        """This rank's ballot, one entry per stop signal; summed over the ranks, `agreed` reads it."""
        return [float(self.signum == s) for s in STOP_SIGNALS]

    # --- installing -----------------------------------------------------------------------------

    def install(self) -> "StopRequest":
        """Catch the stop signals (main thread only: elsewhere Python cannot, and this does nothing)."""
        if threading.current_thread() is not threading.main_thread() or self._sockets is not None:
            return self
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        self._sockets = (r, w)
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        self._listener = threading.Thread(target=self._listen, name="hybridpar-stop-listener", daemon=True)
        self._listener.start()
        return self

    def uninstall(self) -> None:
        """Give the signals back to their previous handlers; a requested stop keeps its deadline."""
        if self._sockets is None or threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        signal.set_wakeup_fd(self._previous_fd)
        r, w = self._sockets
        self._sockets = None
        w.close()  # the listener's select() sees the end of the stream and returns
        if self._listener is not None:
            self._listener.join(timeout=5)
        r.close()

    def finish(self) -> None:
        """The stop (or the run) is complete: the deadline no longer applies."""
        self._finished.set()

    # --- noting a signal ------------------------------------------------------------------------

    def _handle(self, signum: int, frame) -> None:  # the main thread, when it next runs Python
        self._note(signum, counted=True)

    def _note(self, signum: int, counted: bool) -> None:
        with self._lock:
            self.count += counted  # signals the handler has seen (the listener may see one first)
            first = self.signum is None
            if first:
                self.signum = signum
        if first:
            self.on_signal(signal.Signals(signum).name)
            threading.Thread(target=self._deadline, name="hybridpar-stop-deadline", daemon=True).start()

    def _listen(self) -> None:
        """Note stop signals as they arrive, whatever the main thread is doing."""
        r, _ = self._sockets
        while True:
            try:
                select.select([r], [], [])
                data = r.recv(64)
            except BlockingIOError:
                continue
            except (OSError, ValueError):
                return
            if not data:
                return
            for signum in data:
                if signum in STOP_SIGNALS and self.signum is None:
                    self._note(signum, counted=False)

    def _deadline(self) -> None:
        if not self._finished.wait(self.timeout):
            self.on_expire(self)


# --- what a stopped run says and leaves ---------------------------------------------------------

MARKER = "stopped.json"  # in the run folder: how the run's last stop ended (launch/slurm.sh requeues on it)


def stopped_line(signal_name: str, step: int, checkpoint: Path, resume_is_default: bool) -> str:
    how = ("run the same command again" if resume_is_default
           else "run the same command again with --checkpoint.resume true")
    return (f"hybridpar: stopped on {signal_name} after step {step}; checkpoint {checkpoint}. "
            f"To continue, {how}.")


def expired_line(stop: StopRequest, where: str, previous: Optional[Path]) -> str:
    kept = (f"{previous} is intact and a resumed run continues from it" if previous is not None
            else "there is no earlier checkpoint")
    return (f"hybridpar: stopping on {stop.signal_name} did not finish within checkpoint.exit_save_timeout = "
            f"{stop.timeout:g} s (rank 0 was {where}): exiting without a new checkpoint; {kept}")


def write_marker(run_dir: Path, signal_name: str, step: int, checkpoint: Optional[Path]) -> None:
    write_text_atomic(Path(run_dir) / MARKER, json.dumps(
        {"signal": signal_name, "step": step, "checkpoint": str(checkpoint) if checkpoint else None}, indent=1))
