"""One way of saying that a command failed: one line per mistake, printed once (by rank 0 when every
rank made it), the exit code telling bad input (2) from an internal error (1). The `hybridpar`
command and lm-evaluation-harness's command line with hybridpar's model (`python -m
hybridpar.evaluate`) both report through it."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

# How long a rank other than 0 waits before leaving on an error every rank makes alike.
RANK_0_SPEAKS_S = 10.0


def let_rank_0_speak() -> None:
    """A rank that stays silent on an error rank 0 reports must not leave first: the launcher would
    stop rank 0 (torchrun sends SIGTERM to the others when one rank exits) before it has printed.
    Rank 0's exit ends this wait, as the launcher then stops this rank."""
    if os.environ.get("WORLD_SIZE", "1") != "1":
        import time

        time.sleep(RANK_0_SPEAKS_S)


def report_error(error: Exception, log_dir: Optional[Path]) -> int:
    """One line per mistake. An error every rank raises alike (bad config, mesh sizes, a refusal, the
    data guard, a non-finite loss) is printed once, by rank 0; bad input some ranks only raise (a
    ValueError, or an OSError about a path), with the rank. Anything else is an internal error: its
    traceback is shown, or named where it was logged. Every rank's traceback goes to
    `<run_dir>/logs/rank-R.log` once the run has a folder, which the message names.
    HYBRIDPAR_TRACEBACK=1 raises the error instead, with its own traceback."""
    from .mesh.ranks import raised_by_every_rank

    if os.environ.get("HYBRIDPAR_TRACEBACK"):
        raise error from None  # its own traceback, not the handler's that caught it

    rank = os.environ.get("RANK")
    log = _log_traceback(error, log_dir, rank or "0")
    if os.environ.get("WORLD_SIZE", "1") == "1":
        rank = None  # a world of one: "(rank 0)" would say nothing
    where = f" (tracebacks: {log.parent / 'rank-*.log'})" if log else ""
    if raised_by_every_rank(error):
        if rank in (None, "0"):
            print(f"hybridpar: error: {_one_line(error)}{where}", file=sys.stderr, flush=True)
        else:
            let_rank_0_speak()
        return 2
    if isinstance(error, (ValueError, *_PATH_ERRORS)):  # bad input: one clear line
        print(f"hybridpar: error{f' (rank {rank})' if rank else ''}: {_one_line(error)}{where}", file=sys.stderr,
              flush=True)
        return 2
    if log is None:
        raise error  # an internal error: its traceback
    print(f"hybridpar: internal error{f' (rank {rank})' if rank else ''}: {type(error).__name__}: {error} "
          f"(traceback: {log}; HYBRIDPAR_TRACEBACK=1 prints it here)", file=sys.stderr, flush=True)
    return 1


# What an OSError about a path the user gave looks like: a folder for a file, a file in the way, no permission.
_PATH_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError)


# What to do about a system's path error, said after it ("afile: file exists" alone leaves the user guessing).
_PATH_ADVICE = {
    FileExistsError: "something is in the way there: move or delete it, or give another path",
    NotADirectoryError: "a part of that path is a file, not a folder: give another path",
}


def _one_line(error: Exception) -> str:
    """The message, on one line: an OSError from the system as "<path>: <what is wrong>; <what to do>"."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        advice = next((a for kind, a in _PATH_ADVICE.items() if isinstance(error, kind)), "")
        return (f"{error.filename}: {error.strerror.lower()}" + (f" ({error.filename2})" if error.filename2 else "")
                + (f"; {advice}" if advice else ""))
    return " ".join(str(error).split("\n"))


def _log_traceback(error: Exception, log_dir: Optional[Path], rank: str) -> Optional[Path]:
    import traceback

    from .files import write_text_atomic

    if log_dir is None:
        return None
    path = log_dir / f"rank-{rank}.log"
    text = f"hybridpar {' '.join(sys.argv[1:])}\n" + "".join(traceback.format_exception(error))
    try:
        write_text_atomic(path, text)
    except OSError:
        return None
    return path
