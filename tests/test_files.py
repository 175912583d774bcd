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


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_atomic_files_get_the_umask_mode_not_mkstemps_0600(tmp_path, mask):
    """Whatever writes the file: atomic_output, or a writer given atomic_path's name that replaces
    the file (safetensors' save_file does, with 0600: exported model*.safetensors were unreadable to others)."""
    import os

    import torch
    from safetensors.torch import save_file

    from hybridpar.files import atomic_path, umask

    old = os.umask(mask)
    try:
        assert umask() == mask  # read without changing it
        write_text_atomic(tmp_path / "report.json", "{}")
        with atomic_path(tmp_path / "model.safetensors") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp))
    finally:
        os.umask(old)
    for name in ("report.json", "model.safetensors"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~mask, name


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


# --- staged folders and the occupied-destination check ------------------------------------------


def test_staged_folder_commits_only_a_complete_folder(tmp_path):
    from hybridpar.files import staged_folder, staging_path

    target = tmp_path / "out"
    with staged_folder(target) as staged:
        assert staged == staging_path(target) == tmp_path / "out.partial"
        (staged / "a").write_text("first")
        assert not target.exists()  # nothing under the final name until the block ends
    assert (target / "a").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    with pytest.raises(RuntimeError, match="disk full"):
        with staged_folder(target) as staged:
            (staged / "b").write_text("half")
            raise RuntimeError("disk full")
    assert sorted(p.name for p in target.iterdir()) == ["a"]  # the old folder is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # and the staging folder is gone


def test_staged_folder_removes_what_an_interrupted_write_left(tmp_path):
    from hybridpar.files import staged_folder

    target = tmp_path / "out"
    (tmp_path / "out.partial").mkdir()
    (tmp_path / "out.partial" / "stale").write_text("from a crash")
    (tmp_path / ".out.x1y2.old" / "out").mkdir(parents=True)  # parked by a replace that did not finish
    (tmp_path / "other.partial").mkdir()  # another target's: not ours to remove
    with staged_folder(target) as staged:
        assert list(staged.iterdir()) == []
        (staged / "new").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.partial", "out"]


class Refused(ValueError):
    pass


@pytest.mark.parametrize("setup,options,problem", [
    ("missing", {}, None),
    ("empty", {}, None),
    ("empty", {"empty_ok": False}, "already exists"),
    ("full", {}, "already exists and is not an empty folder"),
    ("full", {"overwrite": True}, None),
    ("file", {}, "already exists and is not a folder"),
    ("file", {"overwrite": True}, "already exists and is not a folder"),
])
def test_refuse_occupied(tmp_path, setup, options, problem):
    from hybridpar.files import refuse_occupied

    path = tmp_path / "out"
    if setup == "file":
        path.write_text("x")
    elif setup != "missing":
        path.mkdir()
        if setup == "full":
            (path / "mine.txt").write_text("keep")
    if problem is None:
        refuse_occupied(path, "choose a new folder", error_type=Refused, **options)
        return
    with pytest.raises(Refused) as info:
        refuse_occupied(path, "choose a new folder", error_type=Refused, **options)
    advice = "move or delete it, or choose another path" if setup == "file" else "choose a new folder"  # not --overwrite
    assert str(info.value) == f"{path} {problem}: {advice}"


def test_refuse_occupied_with_a_listing(tmp_path):
    from hybridpar.files import refuse_occupied

    def steps(folder):
        return sorted(folder.glob("step-*"))

    (tmp_path / "notes.txt").write_text("not a checkpoint")
    refuse_occupied(tmp_path, "resume instead", listing=("checkpoints", steps))  # nothing listed: free
    refuse_occupied(tmp_path / "missing", "resume instead", listing=("checkpoints", steps))
    (tmp_path / "step-1").mkdir()
    (tmp_path / "step-2").mkdir()
    with pytest.raises(FileExistsError) as info:  # the default error type
        refuse_occupied(tmp_path, "resume instead", listing=("checkpoints", steps))
    assert str(info.value) == f"{tmp_path} already holds checkpoints (newest step-2): resume instead"


def test_refuse_occupied_when_the_folder_cannot_be_looked_at(tmp_path):
    from hybridpar.files import refuse_occupied

    def denied(folder):
        raise PermissionError(13, "Permission denied", str(folder))

    with pytest.raises(Refused) as info:
        refuse_occupied(tmp_path, "choose another folder", error_type=Refused, listing=("checkpoints", denied))
    assert str(info.value) == (f"{tmp_path} cannot be checked (PermissionError: [Errno 13] Permission denied: "
                               f"'{tmp_path}'): choose another folder")
