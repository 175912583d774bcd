"""Atomic writes and the cross-process lock that the tokenizer and token caches rely on."""

import multiprocessing
import time

import pytest

from hybridpar.files import atomic_output, file_lock, write_text_atomic


def test_atomic_output_replaces_only_when_complete(tmp_path):
    target = tmp_path / "out.txt"
    write_text_atomic(target, "old")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_output(target, "w") as f:
            f.write("half of the new cont")
            raise RuntimeError("disk full")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]  # the temporary file is gone
    with atomic_output(target, "wb") as f:
        f.write(b"new")
        assert target.read_text() == "old"  # readers still see the old file while writing
    assert target.read_text() == "new"


def _hold_lock(path: str, seconds: float, ready) -> None:
    with file_lock(path):
        ready.set()
        time.sleep(seconds)


def test_file_lock_excludes_other_processes_and_times_out_clearly(tmp_path):
    lock = tmp_path / "x.lock"
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(lock), 1.0, ready))
    holder.start()
    try:
        assert ready.wait(10)
        with pytest.raises(TimeoutError, match=r"waited 0 s for the lock .*x.lock \(testing\), held by another process"):
            with file_lock(lock, timeout=0.2, purpose="testing"):
                pass
        start = time.monotonic()
        with file_lock(lock, timeout=10):  # granted once the holder lets go
            assert time.monotonic() - start > 0.3
    finally:
        holder.join(10)
    assert holder.exitcode == 0


def test_replace_folder_swaps_in_the_new_one_and_removes_the_old(tmp_path):
    from hybridpar.files import replace_folder

    target, new = tmp_path / "ckpt", tmp_path / "ckpt.partial"
    new.mkdir()
    (new / "a").write_text("first")
    replace_folder(new, target)
    assert (target / "a").read_text() == "first" and not new.exists()
    new.mkdir()
    (new / "b").write_text("second")
    replace_folder(new, target)
    assert sorted(p.name for p in target.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing parked is left behind


def test_atomic_files_get_the_umask_mode_not_mkstemps_0600(tmp_path):
    import os

    from hybridpar.files import umask

    write_text_atomic(tmp_path / "report.json", "{}")
    assert (tmp_path / "report.json").stat().st_mode & 0o777 == 0o666 & ~umask()
    assert umask() == os.umask(umask())  # read without changing it


def test_replace_folder_fsyncs_the_new_folder_then_the_parent(tmp_path, monkeypatch):
    import os

    from hybridpar.files import replace_folder

    target, new = tmp_path / "ckpt", tmp_path / "ckpt.partial"
    synced, real_fsync = [], os.fsync

    def fsync(fd):  # which folder, and what the final name held at that moment
        held = [p.name for p in target.iterdir()] if target.exists() else None
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), held))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    for name, before in (("a", None), ("b", ["a"])):  # a fresh target, then one replaced
        new.mkdir()
        (new / name).write_text(name)
        synced.clear()
        replace_folder(new, target)
        assert synced == [(os.path.realpath(new), before), (os.path.realpath(tmp_path), [name])]
