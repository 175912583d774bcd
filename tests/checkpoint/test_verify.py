"""Verified checkpoint bytes: checksums summed while writing, checked on load (same layout and
resharded, fast paths on and off), a damaged newest checkpoint set aside on resume, `hybridpar verify`."""

import io
import shutil
import warnings
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from tests.checkpoint.test_dcp import HALF, _case_run, _config, _straight_and_half
from tests.distributed import rel_err


@pytest.fixture
def runs(workers, corpus, tmp_path_factory):
    """The mp2 x dp2 runs of test_dcp (made once per session): step 5 of a stopped run, step 10 of a straight one."""
    return _straight_and_half((2, 2, 1), workers, corpus, tmp_path_factory)


def flip_bit(checkpoint: Path, name: str, where: float = 0.5) -> str:
    """Flip one bit of the largest tensor stored in file `name`, at fraction `where` of its stored
    bytes (0.5: in its data; its last byte: the archive's directory); returns that tensor's name."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(checkpoint)).read_metadata().storage_data
    index, info = max(((i, s) for i, s in storage.items() if s.relative_path == name), key=lambda x: x[1].length)
    path = checkpoint / name
    data = bytearray(path.read_bytes())
    data[info.offset + min(int(info.length * where), info.length - 1)] ^= 0x10
    path.write_bytes(data)
    return index.fqn


def _case_resume(config, fast: bool):
    """Resume (fast paths on or off); the run's outcome, or the error every rank raised."""
    import os

    from hybridpar import fastpaths

    before = os.environ.get(fastpaths.ENV)
    os.environ[fastpaths.ENV] = "1" if fast else "0"
    try:
        return _case_run(config)
    except ValueError as err:
        return {"error": str(err)}
    finally:  # the worker processes serve later tests
        if before is None:
            os.environ.pop(fastpaths.ENV)
        else:
            os.environ[fastpaths.ENV] = before


# (layout, fast paths, the damaged file, where in the tensor's stored bytes): the file that rank 1
# wrote, checked by rank 1 at the same layout (from the bytes its read holds); resharded to mp1 x dp2,
# rank 3's file is checked by rank 1 and read in parts by both ranks. The archive's last byte is
# outside the tensor's data (what the fast reader reads on its own for the sum).
CASES = {"mp2-dp2": ((2, 2, 1), True, "__1_0.distcp", 0.5),
         "mp2-dp2-archive-end": ((2, 2, 1), True, "__1_0.distcp", 1.0),
         "mp2-dp2-stock-reader": ((2, 2, 1), False, "__1_0.distcp", 0.5),
         "resharded-mp1-dp2": ((1, 2, 1), True, "__3_0.distcp", 0.5)}


@pytest.mark.parametrize("case", list(CASES))
def test_a_flipped_bit_is_refused_naming_file_and_tensor(runs, workers, corpus, tmp_path, case):
    layout, fast, name, where = CASES[case]
    folder = tmp_path / "ckpt"
    shutil.copytree(runs["folder"] / "step-00000005", folder / "step-00000005")
    tensor = flip_bit(folder / "step-00000005", name, where)
    world = layout[0] * layout[1] * layout[2]
    results = workers(world).run(_case_resume, _config(corpus, folder, tmp_path / "run", layout), fast)
    print(f"\n{results[0]['error']}")
    for result in results:  # every rank fails, with the cause
        assert "error" in result, result
        assert f"no intact checkpoint in {folder}" in result["error"]
        assert f"{name}: checksum mismatch in bytes" in result["error"] and tensor in result["error"], result
    # Set aside, not deleted: the reason beside its files.
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000005.damaged"]
    assert f"{name}: checksum mismatch" in (folder / "step-00000005.damaged" / "damaged.txt").read_text()


def test_resume_sets_the_damaged_newest_aside_and_ends_equal(runs, workers, corpus, tmp_path, check_close):
    # The newest (step 10, a different state from step 5) is loaded in part before its damage is found:
    # step 5's full reload must overwrite all of it for the run to end as the uninterrupted run did.
    folder = tmp_path / "ckpt"
    shutil.copytree(runs["folder"] / "step-00000005", folder / "step-00000005")
    shutil.copytree(runs["root"] / "straight" / "step-00000010", folder / "step-00000010")
    tensor = flip_bit(folder / "step-00000010", "__2_0.distcp")
    resumed = workers(4).run(_case_resume, _config(corpus, folder, tmp_path / "run", (2, 2, 1)), True)[0]
    assert "error" not in resumed, resumed
    assert resumed["start"] == HALF
    assert resumed["losses"] == runs["straight"]["losses"][HALF:], "losses after resume differ"
    errors = {name: rel_err(resumed["params"][name], value) for name, value in runs["straight"]["params"].items()}
    check_close("resume past a damaged checkpoint", errors, 0.0)
    note = (folder / "step-00000010.damaged" / "damaged.txt").read_text()
    assert "__2_0.distcp: checksum mismatch" in note and tensor in note, note
    assert (folder / "step-00000010" / "checksums.json").exists()  # the run's own save at its end


def _case_init_from(config):
    from hybridpar.train import Trainer

    Trainer(config)
    return "loaded"


def test_a_checkpoint_saved_without_checksums_still_loads(runs, workers, corpus, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(runs["folder"] / "step-00000005", old)
    (old / "checksums.json").unlink()
    config = _config(corpus, tmp_path / "ckpt", tmp_path / "run", (2, 2, 1), **{"checkpoint.init_from": str(old)})
    assert workers(4).run(_case_init_from, config) == ["loaded"] * 4


def _verify(path: Path) -> tuple[int, str]:
    from hybridpar.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["verify", str(path)])
    return code, out.getvalue()


def test_verify_cli_verdicts(runs, tmp_path):
    ckpt = tmp_path / "step-00000005"
    shutil.copytree(runs["folder"] / "step-00000005", ckpt)
    code, out = _verify(ckpt)
    print(out)
    assert code == 0 and out.rstrip().endswith("all ok"), out
    assert "__0_0.distcp: ok" in out and ".metadata: ok" in out and "rng/rank3.pt: ok" in out and "params.json: ok" in out
    flip_bit(ckpt, "__0_0.distcp")
    cut = ckpt / "__1_0.distcp"
    cut.write_bytes(cut.read_bytes()[:-100])
    (ckpt / "rng" / "rank3.pt").unlink()
    (ckpt / "stray.bin").write_bytes(b"?")
    code, out = _verify(ckpt)
    print(out)
    assert code == 1, out
    assert "__0_0.distcp: damaged: checksum mismatch in bytes" in out
    assert "__1_0.distcp: damaged: truncated (size differs: " in out
    assert "rng/rank3.pt: missing" in out
    assert "stray.bin: not in manifest" in out
    assert "NOT OK: __0_0.distcp, __1_0.distcp, rng/rank3.pt, stray.bin" in out


def test_verify_cli_without_a_manifest_checks_the_structure(runs, tmp_path):
    ckpt = tmp_path / "step-00000005"
    shutil.copytree(runs["folder"] / "step-00000005", ckpt)
    (ckpt / "checksums.json").unlink()
    code, out = _verify(ckpt)
    assert code == 0 and "no checksums.json" in out and "__2_0.distcp: ok (size only" in out, out
    cut = ckpt / "__2_0.distcp"
    cut.write_bytes(cut.read_bytes()[:-100])
    code, out = _verify(ckpt)
    print(out)
    assert code == 1 and "__2_0.distcp: damaged: truncated (size differs: " in out, out


@pytest.mark.parametrize("fast", [True, False], ids=["fast-writer", "stock-writer"])
def test_both_writers_sum_what_they_write(tmp_path, fast):
    import torch.distributed.checkpoint as dcp

    from hybridpar.checkpoint import checksums
    from hybridpar.fastpaths.dcp_writer import UncheckedWriter

    writer = checksums.summing((UncheckedWriter if fast else dcp.FileSystemWriter)(str(tmp_path), thread_count=2))
    state = {"a": torch.randn(300, 40), "b": torch.randn(7), "c": {"lr": 0.1}, "d": torch.randn(50, 50)}
    with warnings.catch_warnings():  # no process group: DCP says it saves in one process
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer)
    summed = checksums.written(writer)
    assert sorted(summed) == sorted(p.name for p in tmp_path.iterdir())  # .metadata included, under its final name
    for name, entry in summed.items():
        assert checksums.same(checksums.file_checksum(tmp_path / name), entry), name
    # The marks fall on the items' edges: a difference is placed in one item's bytes.
    storage = dcp.FileSystemReader(str(tmp_path)).read_metadata().storage_data
    for name in (n for n in summed if n.endswith(".distcp")):
        edges = {s.offset for s in storage.values() if s.relative_path == name} - {0}
        assert edges == {pos for pos, _ in summed[name]["marks"]}, name


def _case_reread(folder: str):
    """Save sharded weights with an optimizer's state, load them at the same layout; the bytes the
    check read again (beside the load's own reads) and the bytes of this rank's .distcp files."""
    import torch.distributed as dist

    from bench.checkpoint import _ParallelStub, sharded_state
    from hybridpar.checkpoint import verify
    from hybridpar.checkpoint.dcp import Checkpointer

    rank, world = dist.get_rank(), dist.get_world_size()
    model = sharded_state(0.02, world)
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # state to save: exp_avg, exp_avg_sq, step
    checkpointer = Checkpointer(Path(folder), _ParallelStub(rank, world), keep=2)
    checkpointer.save(1, model, optimizer, {}, {})
    checkpointer.wait()
    reread, summed_whole = [], []
    sum_range, file_checksum = verify.sum_range, verify.file_checksum
    verify.sum_range = lambda f, a, b, v: (reread.append(b - a), sum_range(f, a, b, v))[1]
    verify.file_checksum = lambda path, *a: (summed_whole.append(path.name), file_checksum(path, *a))[1]
    try:
        checkpointer.load(Path(folder) / "step-00000001", model, optimizer, {})
    finally:
        verify.sum_range, verify.file_checksum = sum_range, file_checksum
    mine = sum(p.stat().st_size for p in (Path(folder) / "step-00000001").glob(f"__{rank}_*.distcp"))
    return {"reread": sum(reread), "distcp": mine, "summed_whole": summed_whole}


def test_a_load_at_the_same_layout_reads_the_tensors_once(workers, tmp_path):
    # The fast reader sums each item it reads whole; the check reads again only what no read covered
    # (the optimizer's hyperparameters and the like: bytes values), never a whole .distcp file.
    for rank, result in enumerate(workers(2).run(_case_reread, str(tmp_path))):
        print(f"rank {rank}: read again {result['reread']} of its {result['distcp']} .distcp bytes; "
              f"summed whole: {result['summed_whole']}")
        assert result["distcp"] > 4_000_000
        assert result["reread"] < 0.01 * result["distcp"]
        assert not [n for n in result["summed_whole"] if n.endswith(".distcp")]
