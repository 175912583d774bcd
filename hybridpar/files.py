"""File helpers shared by the data modules: atomic writes, cross-process locks, hashes.

Every rank of a job may prepare the same tokenizer or token file in the same cache folder at the
same moment, and a job can be killed at any point, so outputs are written to a temporary file in
the destination folder and renamed into place (readers see the old file or the new one, never a
half-written one), and whoever prepares holds a lock that the others wait on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import IO, Iterator, Optional, Union

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

_LOCK_POLL_SECONDS = 0.1
# Errors by which a file system says it has no flock (some NFS and Lustre mounts).
_NO_FLOCK_ERRNOS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


@contextlib.contextmanager
def atomic_output(path: PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside `path`; on success it replaces `path`, on error it is removed."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_output writes whole files: mode must be 'wb' or 'w', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same folder as the target: os.replace is only atomic within one file system.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp makes 0600; a normal file respects the umask
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def umask() -> int:
    """The process umask, read without changing it (os.umask would, briefly, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def fsync_dir(path: PathLike) -> None:
    """Make a folder's entries (names created, renamed or removed in it) durable, as fsync does a file's data."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_folder(new: PathLike, target: PathLike) -> None:
    """Rename the finished folder `new` (its files already fsynced) to `target` (same file system),
    durably. An existing `target` is moved aside first and deleted after, so one complete copy exists
    at every moment."""
    new, target = Path(new), Path(target)
    # The files' names in `new`, then the rename in the parent: without these a crash can leave the
    # final name missing, or present with files missing, although every file was fsynced.
    fsync_dir(new)
    if not target.exists():
        os.replace(new, target)
        fsync_dir(target.parent)
        return
    # A directory rename needs a free name: park the old one under a unique hidden name.
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent)) / target.name
    os.replace(target, aside)
    os.replace(new, target)
    fsync_dir(target.parent)
    shutil.rmtree(aside.parent, ignore_errors=True)


def write_bytes_atomic(path: PathLike, data: bytes) -> None:
    with atomic_output(path, "wb") as f:
        f.write(data)


def write_text_atomic(path: PathLike, text: str) -> None:
    with atomic_output(path, "w") as f:
        f.write(text)


def sha256_file(path: PathLike, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@contextlib.contextmanager
def file_lock(path: PathLike, *, timeout: Optional[float] = None, purpose: str = "") -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if needed) across processes and hosts.

    flock is released by the kernel when its holder dies, so a crashed job never leaves a stale
    lock; on file systems without flock an O_EXCL marker file is used instead. `timeout` (seconds,
    None = wait as long as it takes) bounds the wait; `purpose` names the work in messages.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _wait(lambda: _try_flock(fd), path, timeout, purpose)
    except OSError as e:
        os.close(fd)
        if e.errno not in _NO_FLOCK_ERRNOS:
            raise
        fd = -1
    if fd < 0:
        with _exclusive_marker(path.with_name(path.name + ".excl"), timeout, purpose):
            yield
        return
    try:
        yield
    finally:
        os.close(fd)  # releases the flock; the lock file itself stays (unlinking it would race)


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


@contextlib.contextmanager
def _exclusive_marker(marker: Path, timeout: Optional[float], purpose: str) -> Iterator[None]:
    def try_create() -> bool:
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{socket.gethostname()} pid {os.getpid()}\n")
        return True

    _wait(try_create, marker, timeout, purpose, stale_hint=True)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(marker)


def _wait(try_acquire, path: Path, timeout: Optional[float], purpose: str, stale_hint: bool = False) -> None:
    start = time.monotonic()
    announced = False
    while not try_acquire():
        waited = time.monotonic() - start
        what = f" ({purpose})" if purpose else ""
        if timeout is not None and waited >= timeout:
            hint = f"; if no other job is running, delete {path}" if stale_hint else ""
            raise TimeoutError(
                f"waited {waited:.0f} s for the lock {path}{what}, held by another process that is still "
                f"preparing the same file; raise the timeout or wait for that process{hint}"
            )
        if not announced:
            log.info("waiting for %s%s: another process is preparing it", path, what)
            announced = True
        time.sleep(_LOCK_POLL_SECONDS)
