"""Nothing hybridpar reads runs code: a checkpoint's `.metadata` and flight-recorder dumps crafted to
run a command are refused on every path that reads them (resume, init_from, convert, generate,
verify, hang-report), naming the global, and the command never runs; genuine files still load exactly."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.checkpoint.test_dcp import HALF, _config, _straight_and_half
from tests.checkpoint.test_verify import _case_resume
from tests.distributed import child_pythonpath
from tests.untrusted import TOUCH_THEN, RunsCode, never_ran, payloads

ROOT = Path(__file__).resolve().parents[2]


def _genuine(checkpoint: Path):
    """The checkpoint's own Metadata: what a crafted `.metadata` gives once its payload has run."""
    from hybridpar.safe_pickle import read_dcp_metadata

    return read_dcp_metadata(checkpoint / ".metadata")


def _live(cases: dict[str, bytes], marker: Path) -> dict[str, tuple[object, bool]]:
    """Each pickle of `cases` unpickled without restriction, one after the other in one process of
    their own: {case: (what it gave, whether it made the marker)} (the marker removed after each)."""
    code = ("import os, pickle, sys; marker, cases = pickle.loads(sys.stdin.buffer.read()); out = {}\n"
            "for case, data in cases.items():\n"
            "    out[case] = (pickle.loads(data), os.path.exists(marker))\n"
            "    os.path.exists(marker) and os.unlink(marker)\n"
            "sys.stdout.buffer.write(pickle.dumps(out, protocol=2))")
    done = subprocess.run([sys.executable, "-c", code], input=pickle.dumps((str(marker), cases)), check=True,
                          capture_output=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": child_pythonpath()})
    return pickle.loads(done.stdout)


def test_the_payloads_are_live(tmp_path):
    """Unpickled without restriction, each payload creates its marker and still gives the genuine
    object: the tests below can fail, and fail on the marker, not on a broken result."""
    from torch.distributed.checkpoint.metadata import Metadata

    marker = tmp_path / "marker"
    genuine = Metadata(state_dict_metadata={})
    cases = {**payloads(marker, genuine), "RunsCode": (TOUCH_THEN, pickle.dumps(RunsCode(marker, genuine)))}
    live = _live({case: data for case, (_, data) in cases.items()}, marker)
    assert sorted(live) == sorted(cases)
    for case, (gave, made_marker) in live.items():
        assert gave == genuine, case
        assert made_marker, case


def test_refused_naming_the_global(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata

    from hybridpar.safe_pickle import UnsafePickleError, read_dcp_metadata

    marker, path = tmp_path / "marker", tmp_path / ".metadata"
    for case, (name, data) in payloads(marker, Metadata(state_dict_metadata={})).items():
        path.write_bytes(data)
        refused = never_ran(marker, lambda: read_dcp_metadata(path), UnsafePickleError)
        print(f"\n{case}: {refused}")
        assert refused.global_name == name and f"import {name}," in str(refused)


# --- checkpoints ----------------------------------------------------------------------------------

@pytest.fixture
def runs(workers, corpus, tmp_path_factory):
    """test_dcp's mp2 x dp2 runs (made once per session): step 5 of a stopped run, step 10 straight."""
    return _straight_and_half((2, 2, 1), workers, corpus, tmp_path_factory)


def craft(checkpoint: Path, data: bytes, manifest: bool) -> None:
    """Replace `.metadata` with `data`; `manifest`: record its checksum too (as an attacker who also
    rewrote checksums.json would), else leave the manifest saying what was saved."""
    from hybridpar.checkpoint import checksums

    (checkpoint / ".metadata").write_bytes(data)
    if manifest:
        recorded = json.loads((checkpoint / checksums.MANIFEST).read_text())
        recorded["files"][".metadata"] = checksums.entry_of(data)
        (checkpoint / checksums.MANIFEST).write_text(json.dumps(recorded))


def _newest_crafted(source: Path, folder: Path, data: bytes, manifest: bool) -> None:
    """folder/step-00000005 genuine, folder/step-00000006 its copy with a crafted .metadata."""
    shutil.copytree(source, folder / "step-00000005")
    crafted = folder / "step-00000006"
    shutil.copytree(source, crafted)
    craft(crafted, data, manifest)


def test_every_layout_reads_as_dcp_reads_it(runs, workers, corpus, tmp_path_factory):
    """The restricted reader returns exactly DCP's Metadata for every checkpoint this session saved:
    mp x dp with optimizer state (and mp x hybrid dp when test_dcp made it), weights only."""
    import warnings

    from torch.distributed.checkpoint import FileSystemReader

    from hybridpar.safe_pickle import read_dcp_metadata
    from tests.checkpoint.test_dcp import _RUNS

    folders = [p for r in _RUNS.values() for p in sorted(r["root"].rglob(".metadata"))]
    assert len(folders) >= 2, folders
    for path in folders:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = FileSystemReader(str(path.parent)).read_metadata()
        ours = read_dcp_metadata(path)
        assert ours.state_dict_metadata == theirs.state_dict_metadata, path
        assert ours.storage_data == theirs.storage_data and ours.planner_data == theirs.planner_data, path
        assert any(k.startswith("optimizer.") for k in ours.state_dict_metadata), path
    print(f"\n{len(folders)} checkpoints read alike")


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest-rewritten", "manifest-as-saved"])
def test_resume_never_runs_a_crafted_metadata(runs, workers, corpus, tmp_path, manifest):
    """Newest checkpoint crafted. With its checksum recorded, every rank refuses it naming the global
    and nothing is set aside; with the manifest as saved, its bytes are damaged: set aside unread and
    the genuine checkpoint before it resumes the run, bit-equal to the straight run."""
    marker = tmp_path / "marker"
    genuine = runs["folder"] / f"step-{HALF:08d}"
    name, data = payloads(marker, _genuine(genuine))["os.system"]  # run, it would resume as the genuine one
    folder = tmp_path / "ckpt"
    _newest_crafted(genuine, folder, data, manifest)
    results = workers(4).run(_case_resume, _config(corpus, folder, tmp_path / "run", (2, 2, 1)), True)
    assert not marker.exists()
    if manifest:
        print(f"\n{results[0]['error']}")
        for result in results:
            assert "error" in result and f"import {name}," in result["error"], result
            assert "step-00000006" in result["error"] and "move it aside" in result["error"]
        assert sorted(p.name for p in folder.iterdir()) == ["step-00000005", "step-00000006"]
    else:
        assert all("error" not in r for r in results), results[0]
        assert results[0]["start"] == HALF
        assert results[0]["losses"] == runs["straight"]["losses"][HALF:]
        assert (folder / "step-00000006.damaged").is_dir()


def test_the_refusal_is_marked_for_every_rank():
    """Every rank reads .metadata itself and raises alike: the CLI prints the error once."""
    from hybridpar.checkpoint.reader import UnsafeCheckpointError
    from hybridpar.mesh.ranks import raised_by_every_rank

    assert raised_by_every_rank(UnsafeCheckpointError("x"))


def _hybridpar(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": child_pythonpath()}
    env.pop("HYBRIDPAR_TRACEBACK", None)
    return subprocess.run([sys.executable, "-m", "hybridpar", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def _one_refusal(result: subprocess.CompletedProcess, name: str) -> str:
    errors = [line for line in result.stderr.splitlines() if line.startswith("hybridpar: error")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-3000:]
    assert f"import {name}," in errors[0] and "Traceback" not in result.stderr, result.stderr[-3000:]
    return errors[0]


def _tokenizer(corpus) -> Path:
    found = sorted(Path(corpus["cache_dir"]).rglob("*.model"))
    assert found, f"no tokenizer in {corpus['cache_dir']}"
    return found[0]


@pytest.mark.slow
def test_init_from_convert_generate_and_verify_refuse(runs, corpus, tmp_path):
    """The commands that read a checkpoint, each in a process of its own, on a crafted one: exit
    non-zero, one line naming the global, the marker never made. Genuine: convert and verify work."""
    from tests.runs import make_config  # noqa: F401 - the flags below are make_config's

    marker = tmp_path / "marker"
    genuine = runs["folder"] / f"step-{HALF:08d}"
    name, data = payloads(marker, _genuine(genuine))["os.system"]
    crafted = tmp_path / "crafted"
    shutil.copytree(genuine, crafted)
    craft(crafted, data, manifest=True)
    flags = [f"--{k}={v}" for k, v in {
        "model.preset": "debug", "model.vocab_size": 512, "parallel.mp": 1, "parallel.dp_shard": 1,
        "data.source": corpus["source"], "data.cache_dir": corpus["cache_dir"], "data.tokenizer_vocab_size": 512,
        "data.seq_len": 32, "data.micro_batch_size": 2, "data.val_fraction": 0, "train.steps": 1,
        "fsdp.param_dtype": "float32", "output.run_dir": str(tmp_path / "run"), "output.tensorboard": False,
        "output.plot": False, "checkpoint.at_end": False, "checkpoint.init_from": str(crafted)}.items()]
    commands = {
        "init_from": ["train", *flags],
        "convert": ["convert", str(crafted), str(tmp_path / "hf"), "--to", "hf"],
        "generate": ["generate", "--checkpoint", str(crafted), "--tokenizer", str(_tokenizer(corpus)),
                     "--prompt", "hello", "--max-new-tokens", "2"],
        "verify": ["verify", str(crafted)],
    }
    # The processes run side by side (each reads the crafted folder, none writes where another reads).
    with ThreadPoolExecutor(len(commands)) as pool:
        results = dict(zip(commands, pool.map(lambda command: _hybridpar(*command, cwd=tmp_path), commands.values())))
    for case, result in results.items():
        if case == "verify":  # a verdict per file: the .metadata line names the global
            lines = [line for line in result.stdout.splitlines() if line.startswith(".metadata: refused")]
            assert result.returncode == 1 and len(lines) == 1 and f"import {name}," in lines[0], result.stdout
            print(f"\n{case}: {lines[0]}")
        else:
            print(f"\n{case}: {_one_refusal(result, name)}")
    assert not marker.exists(), f"one of {list(results)} ran the crafted checkpoint's code"
    # verify without a manifest (saved before checksums): the same refusal, from the structure check
    (crafted / "checksums.json").unlink()
    # ... and the genuine checkpoint beside it: verified, and converted (side by side, as above)
    with ThreadPoolExecutor(3) as pool:
        result, verified, converted = pool.map(lambda command: _hybridpar(*command, cwd=tmp_path), [
            ["verify", str(crafted)], ["verify", str(genuine)],
            ["convert", str(genuine), str(tmp_path / "hf"), "--to", "hf"]])
    assert result.returncode == 1 and f".metadata: refused: unpickling it would import {name}," in result.stdout
    assert not marker.exists()
    assert verified.returncode == 0, verified.stdout[-3000:]
    assert converted.returncode == 0, converted.stderr[-3000:]


def _case_load_weights(folder: str) -> dict:
    import torch.distributed as dist

    from hybridpar.checkpoint.convert import load_model
    from hybridpar.mesh.device import init_parallel
    from hybridpar.parallel.state import full_state_dict

    model, _ = load_model(Path(folder), init_parallel(mp=1))
    params = full_state_dict(model)
    return params if dist.get_rank() == 0 else None


def test_a_genuine_checkpoint_beside_a_crafted_one_loads_bit_exact(runs, workers, tmp_path):
    marker = tmp_path / "marker"
    genuine = runs["folder"] / f"step-{HALF:08d}"
    _newest_crafted(genuine, tmp_path / "ckpt", payloads(marker, _genuine(genuine))["exec"][1], True)
    loaded = workers(1).run(_case_load_weights, str(tmp_path / "ckpt" / "step-00000005"))[0]
    saved = runs["half"]["params"]
    assert loaded.keys() == saved.keys()
    same = [k for k in saved if loaded[k].dtype == saved[k].dtype and loaded[k].equal(saved[k])]
    print(f"\n{len(same)} of {len(saved)} tensors bit-equal to the run that saved them")
    assert len(same) == len(saved) and not marker.exists()
