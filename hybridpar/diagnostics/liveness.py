"""Positive evidence that a rank died, faster than its heartbeat going silent.

Every rank registers its host and pid through the job's store; each beat, a rank looks at the
processes of the other ranks on its own host and, when one is gone (exited, killed, or a zombie
its launcher has not reaped yet), says so through the store. The monitor then names the dead
rank at once, before the launcher's teardown (SIGTERM within a fraction of a second) ends the
job. A rank alone on its host is still caught by its heartbeat going silent (monitor.py).

is_peer_loss tells a collective that failed because a peer vanished (gloo's "Connection reset
by peer", NCCL's aborted communicator) from an error of the rank's own making.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from ..mesh.ranks import raised_by_every_rank

# Substrings of the errors gloo and nccl raise on the surviving side of a lost connection.
_PEER_LOSS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
              "remote process exited", "communicator was aborted", "socket timeout", "no route to host")


def _state(pid: int) -> bytes:
    """The process's state letter from /proc ('R', 'S', 'T' stopped, 'Z' zombie...); b'' where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ')'.
            return f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return b""  # no /proc (not Linux): existence is all we can tell


def process_alive(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie (dead, waiting to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return _state(pid) not in (b"Z", b"X")


def process_stopped(pid: int) -> bool:
    """True if process `pid` is stopped (SIGSTOP, a debugger): alive, but it will not progress."""
    return _state(pid) in (b"T", b"t")


def is_peer_loss(error: BaseException) -> bool:
    """Did this error come from a collective whose peer went away (rather than from this rank)?"""
    if isinstance(error, (dist.DistBackendError, dist.DistNetworkError)):
        return True
    return says_peer_loss(str(error))


def lost_in_collective(error: BaseException) -> bool:
    """Did a collective of this rank's fail because a peer went away (is_peer_loss), as opposed to an
    error the ranks agreed on (hybridpar.mesh.ranks.raised_by_every_rank)? After it, a collective
    this rank issues cannot complete, and it would meet whatever the surviving peers issue next:
    error paths that share errors skip their agreement then (the watchdog read such a pair as
    collectives out of step, the program's own fault, not the dead rank's node)."""
    return is_peer_loss(error) and not raised_by_every_rank(error)


def says_peer_loss(text: str) -> bool:
    """Does an error's text say that a collective's peer went away?"""
    return any(marker in text.lower() for marker in _PEER_LOSS)
