"""File helpers: atomic files, staged folders, the occupied-destination check, a full disk said
plainly, locks, hashes.

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
from typing import IO, Callable, Iterator, Optional, Union

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

_LOCK_POLL_SECONDS = 0.1
# Errors by which a file system says it has no flock (some NFS and Lustre mounts).
NO_FLOCK_ERRNOS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
# Errors by which a file system says it is full (ENOSPC) or the user's quota is used up (EDQUOT).
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """A temporary file's path beside `path`, for writers that take a file name (safetensors); on
    success it is fsynced and replaces `path`, on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with full_disk_said(path.parent, f"{path.name} could not be written"):
        # Same folder as the target: os.replace is only atomic within one file system.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            os.close(fd)
            yield Path(tmp)
            # mkstemp makes 0600, and so may a writer that replaces the file it is given (safetensors
            # does): the file gets the mode any file would, the umask's, once written.
            os.chmod(tmp, 0o666 & ~umask())
            fsync_file(tmp)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise


@contextlib.contextmanager
def atomic_output(path: PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside `path`; on success it replaces `path`, on error it is removed."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_output writes whole files: mode must be 'wb' or 'w', got {mode!r}")
    with atomic_path(path) as tmp, open(tmp, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as f:
        yield f


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


def fsync_file(path: PathLike) -> None:
    """Make a file's data durable (a no-op for data already fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: PathLike) -> None:
    """Make a folder's entries (names created, renamed or removed in it) durable, as fsync does a file's data."""
    fsync_file(path)  # a folder opened read-only gives a descriptor fsync takes


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


# --- staged folders: a folder of files that appears complete or not at all ---------------------

STAGING_SUFFIX = ".partial"


def staging_path(target: PathLike) -> Path:
    """Where the files of `target` are written before it exists: `<target>.partial` beside it (one
    name every rank can compute; a crash leaves it there, and the next attempt removes it)."""
    target = Path(target)
    return target.with_name(target.name + STAGING_SUFFIX)


def remove_stale(target: PathLike) -> None:
    """Remove what an interrupted write of `target` left: its staging folder and old copies parked
    by replace_folder."""
    target = Path(target)
    for stale in [staging_path(target), *target.parent.glob(f".{target.name}.*.old")]:
        shutil.rmtree(stale, ignore_errors=True)


def begin_staging(target: PathLike) -> Path:
    """Create the (empty) staging folder of `target`, after removing stale ones; returns it."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(target)
    staged = staging_path(target)
    staged.mkdir()  # os.mkdir honours the umask (mkdtemp's 0700 would become the folder's mode)
    return staged


def commit_staged(staged: PathLike, target: PathLike) -> Path:
    """fsync every file under `staged` (a no-op for files their writers fsynced, as writers on other
    hosts of a shared file system must), then rename it to `target` durably (replace_folder)."""
    staged, target = Path(staged), Path(target)
    for path in sorted(staged.rglob("*")):
        if path.is_file():
            fsync_file(path)
        elif path.is_dir():
            fsync_dir(path)
    replace_folder(staged, target)
    return target


@contextlib.contextmanager
def staged_folder(target: PathLike) -> Iterator[Path]:
    """One process writes a folder: files go into the yielded staging folder, which becomes
    `target` (replacing an old one) only when the block ends without an error; on an error it is
    removed and `target` is untouched."""
    staged = begin_staging(target)
    try:
        yield staged
        commit_staged(staged, target)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise


# What to do about an output folder that exists: `hybridpar convert`'s flag, the writers' argument.
OCCUPIED_ADVICE = "choose a new folder, or replace it with --overwrite (overwrite=True from Python)"


def refuse_occupied(path: PathLike, advice: str, *, error_type: type[Exception] = FileExistsError,
                    overwrite: bool = False, empty_ok: bool = True,
                    listing: Optional[tuple[str, Callable[[Path], list[Path]]]] = None) -> None:
    """Raise `error_type("<path> <what is there>: <advice>")` when `path` cannot take new output:
    a file; a folder with anything in it (any folder when empty_ok=False) unless overwrite=True;
    or, with listing=(noun, lister), a folder where lister(path) finds something (e.g. checkpoints)."""
    path = Path(path)
    try:
        problem = _occupant(path, overwrite, empty_ok, listing)
    except OSError as err:
        problem = f"cannot be checked ({type(err).__name__}: {err})"
    if problem:
        if path.exists() and not path.is_dir():  # --overwrite replaces folders only
            advice = "move or delete it, or choose another path"
        raise error_type(f"{path} {problem}: {advice}")


def _occupant(path: Path, overwrite: bool, empty_ok: bool, listing) -> Optional[str]:
    if not path.exists():
        return None
    if not path.is_dir():
        return "already exists and is not a folder"
    if listing is not None:
        noun, lister = listing
        found = lister(path)
        return f"already holds {noun} (newest {found[-1].name})" if found else None
    if overwrite:
        return None
    if not empty_ok:
        return "already exists"
    return "already exists and is not an empty folder" if any(path.iterdir()) else None


# --- a full disk, said once: where, how much, what to change -----------------------------------


class DiskFullError(ValueError, OSError):
    """A file system without room for what must be written. Its message names the folder, the
    space needed and free, and what to change: one line, not a traceback (a ValueError, as bad
    input is). Still an OSError with the original errno, for code that handles those."""


def human_bytes(n: float) -> str:
    for scale, name in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return f"{n / scale:.1f} {name}"
    return f"{n:.0f} B"


def free_bytes(folder: PathLike) -> int:
    """Bytes a write into `folder` (or, before it exists, its nearest existing parent) can still use."""
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def out_of_space(error: Optional[BaseException]) -> Optional[OSError]:
    """The ENOSPC or EDQUOT OSError that `error` is or was raised from (its causes and contexts), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno in NO_SPACE_ERRNOS:
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def disk_full_message(folder: PathLike, what: str, *, needed: Optional[int] = None, free: Optional[int] = None,
                      advice: str = "free space there or write elsewhere") -> str:
    """'<what>: <folder> has no room (needs N, M free): <advice>', the one wording of a full disk."""
    free = free_bytes(folder) if free is None else free
    figures = (f"needs {human_bytes(needed)}, {human_bytes(free)} free" if needed is not None
               else f"{human_bytes(free)} free")
    return f"{what}: {folder} has no room ({figures}): {advice}"


@contextlib.contextmanager
def full_disk_said(folder: PathLike, what: str, advice: str = "free space there or write elsewhere",
                   error_type: type[DiskFullError] = DiskFullError) -> Iterator[None]:
    """Turn an ENOSPC/EDQUOT raised in the block into one `error_type` naming the folder and its
    free space (the OSError stays its __cause__, for the rank's log)."""
    try:
        yield
    except OSError as err:
        if isinstance(err, DiskFullError) or out_of_space(err) is None:
            raise
        said = error_type(disk_full_message(folder, f"{what} ({err.strerror})", advice=advice))
        said.errno = err.errno
        raise said from err


def write_bytes_atomic(path: PathLike, data: bytes) -> None:
    with atomic_output(path, "wb") as f:
        f.write(data)


def write_text_atomic(path: PathLike, text: str) -> None:
    with atomic_output(path, "w") as f:
        f.write(text)


def made_once(path: PathLike, make: Callable[[], bytes], *, timeout: Optional[float] = None, purpose: str = "") -> Path:
    """`path`, written atomically with `make()`'s bytes unless it is there: the first of the
    processes that ask at once makes it under a lock (PATH.lock), the others wait, then find it."""
    path = Path(path)
    if not path.exists():
        with file_lock(path.with_name(path.name + ".lock"), timeout=timeout, purpose=purpose):
            if not path.exists():  # (another made it while we waited)
                write_bytes_atomic(path, make())
    return path


def sha256_file(path: PathLike, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


CRC_CHUNK = 8 << 20  # bytes read at a time when summing a file: large enough to keep the disk streaming


def crc32c_file(path: PathLike, progress: Optional[Callable[[int], object]] = None) -> tuple[int, int]:
    """(size, CRC-32C) of the file at `path` as it is now, read once front to back; `progress(n)`
    hears of each chunk (checkpoint checksums, token store shards)."""
    import crc32c

    value, size = 0, 0
    buf = bytearray(CRC_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := f.readinto(buf):
            value = crc32c.crc32c(view[:n], value)  # releases the GIL: reader threads go on meanwhile
            size += n
            if progress is not None:
                progress(n)
    return size, value


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
        if e.errno not in NO_FLOCK_ERRNOS:
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
