"""Sharded checkpoints: bit-exact resume in new processes, resharding to other layouts, crash safety."""

import io
import json
import re
import shutil

import pytest
import torch

from tests.distributed import WorkerPool, rel_err
from tests.runs import make_config

STEPS, HALF = 10, 5


def _case_run(config, stop_after=None):
    """Train (resuming if configured); optionally stop after `stop_after` steps and save there."""
    import torch.distributed as dist

    from hybridpar.parallel.state import full_state_dict
    from hybridpar.train import Trainer

    trainer = Trainer(config)
    start = trainer.step
    if stop_after is not None:
        config.train.steps = stop_after
    history = trainer.run()
    params = full_state_dict(trainer.model)
    return {"start": start, "losses": [m["loss"] for m in history], "params": params if dist.get_rank() == 0 else None}


def _config(corpus, folder, run_dir, layout, **overrides):
    mp, dp_shard, dp_replicate = layout
    dp = dp_shard * dp_replicate
    strategy = "hybrid_shard" if dp_replicate > 1 or dp_shard == 1 else "full_shard"
    return make_config(corpus, run_dir, mp=mp, dp_shard=dp_shard, dp_replicate=dp_replicate, strategy=strategy, dp=dp,
                       steps=STEPS, **{"checkpoint.folder": str(folder), "checkpoint.resume": True,
                                       "checkpoint.at_end": True, "optim.warmup_steps": 3, **overrides})


def write_params(checkpoint, params: dict) -> None:
    """Rewrite a checkpoint's params.json as another writer (an older hybridpar, a converter) saved it,
    its manifest entry included: these tests are about what the fields say, not about damaged bytes."""
    from hybridpar.checkpoint import checksums

    text = json.dumps(params)
    (checkpoint / "params.json").write_text(text)
    manifest = json.loads((checkpoint / checksums.MANIFEST).read_text())
    manifest["files"]["params.json"] = checksums.entry_of(text.encode())
    (checkpoint / checksums.MANIFEST).write_text(json.dumps(manifest))


_RUNS: dict = {}  # layout -> its runs, made once per test session


def _straight_and_half(layout, workers, corpus, tmp_path_factory) -> dict:
    """A 10-step run straight through, and a run stopped and saved at step 5, both at one layout."""
    if layout not in _RUNS:
        world = layout[0] * layout[1] * layout[2]
        root = tmp_path_factory.mktemp("ckpt")
        straight = workers(world).run(_case_run, _config(corpus, root / "straight", root / "run0", layout))[0]
        half = workers(world).run(_case_run, _config(corpus, root / "half", root / "run1", layout), HALF)[0]
        _RUNS[layout] = {"layout": layout, "world": world, "folder": root / "half", "straight": straight,
                         "half": half, "root": root}
    return _RUNS[layout]


@pytest.fixture(params=[(2, 2, 1), (2, 2, 2)], ids=["mp2-dp2", "mp2-hybrid2x2"])
def straight_and_half(request, workers, corpus, tmp_path_factory):
    return _straight_and_half(request.param, workers, corpus, tmp_path_factory)


@pytest.fixture
def mp2_dp2_runs(workers, corpus, tmp_path_factory):
    """The mp2 x dp2 runs: the source of the resharding, async and wrong-model checks."""
    return _straight_and_half((2, 2, 1), workers, corpus, tmp_path_factory)


@pytest.mark.slow
def test_resume_is_bit_exact_in_new_processes(straight_and_half, check_close, corpus):
    s = straight_and_half
    assert s["half"]["losses"] == s["straight"]["losses"][:HALF]
    pool = WorkerPool(s["world"])  # new processes: nothing survives but the files
    try:
        resumed = pool.run(_case_run, _config(corpus, s["folder"], s["root"] / "run2", s["layout"]))[0]
    finally:
        pool.close()
    assert resumed["start"] == HALF
    print(f"\nstraight {s['straight']['losses'][HALF:]}\nresumed  {resumed['losses']}")
    assert resumed["losses"] == s["straight"]["losses"][HALF:], "losses after resume differ"
    errors = {name: rel_err(resumed["params"][name], value) for name, value in s["straight"]["params"].items()}
    check_close("bit-exact resume", errors, 0.0)


RESHARD = {"mp1-dp4": (1, 4, 1), "mp4-dp1": (4, 1, 1), "mp2-hybrid2x2": (2, 2, 2)}


@pytest.mark.parametrize("target", list(RESHARD))
def test_resume_at_another_layout(mp2_dp2_runs, check_close, workers, corpus, tmp_path, target):
    s = mp2_dp2_runs
    layout = RESHARD[target]
    # Copy the checkpoint so each target resumes from step 5, not from the others' step 10.
    folder = tmp_path / "ckpt"
    shutil.copytree(s["folder"] / "step-00000005", folder / "step-00000005")
    world = layout[0] * layout[1] * layout[2]
    resumed = workers(world).run(_case_run, _config(corpus, folder, tmp_path / "run", layout))[0]
    assert resumed["start"] == HALF
    expected = s["straight"]["losses"][HALF:]
    # Every step after the resume is compared, and so is every parameter at the end: a run that
    # trained fewer steps, or none, cannot pass on an empty comparison.
    assert len(resumed["losses"]) == len(expected) == STEPS - HALF, (len(resumed["losses"]), len(expected))
    errors = {f"loss step {HALF + 1 + i}": rel_err(torch.tensor(a), torch.tensor(b))
              for i, (a, b) in enumerate(zip(resumed["losses"], expected))}
    straight = s["straight"]["params"]
    assert sorted(resumed["params"]) == sorted(straight)
    errors.update({name: rel_err(resumed["params"][name], value) for name, value in straight.items()})
    check_close(f"mp2-dp2 -> {target}", errors, 1e-5)


def test_keeps_the_last_k(workers, corpus, tmp_path):
    config = _config(corpus, tmp_path / "ckpt", tmp_path / "run", (2, 2, 1),
                     **{"checkpoint.every": 1, "checkpoint.keep": 2, "train.steps": 4})
    stale = tmp_path / "ckpt" / "step-00000000.deleting"  # a background deletion a crash cut short
    stale.mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(b"x")
    workers(4).run(_case_run, config)
    # Old checkpoints leave the listing at once and are deleted in the background; close() waits.
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000003", "step-00000004"]


def test_async_save_resumes_like_sync(mp2_dp2_runs, workers, corpus, tmp_path):
    s = mp2_dp2_runs
    config = _config(corpus, tmp_path / "ckpt", tmp_path / "run", (2, 2, 1),
                     **{"checkpoint.async_save": True, "checkpoint.every": 2})
    workers(4).run(_case_run, config, HALF)
    resumed = workers(4).run(_case_run, _config(corpus, tmp_path / "ckpt", tmp_path / "run2", (2, 2, 1)))[0]
    assert resumed["start"] == HALF and resumed["losses"] == s["straight"]["losses"][HALF:]
    # The background writes summed their files too: every checkpoint's manifest matches its bytes.
    from hybridpar.checkpoint.verify import verify_folder

    for step in sorted((tmp_path / "ckpt").glob("step-*")):
        assert verify_folder(step, io.StringIO()) == 0, step
    # The run's events say how long training waited for each save and how long its writes took.
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    saved = {e["step"]: e for e in events if e["event"] == "checkpoint"}
    written = {e["step"]: e for e in events if e["event"] == "checkpoint_written"}
    assert sorted(saved) == sorted(written) == [2, 4, HALF], events
    assert all(e["async_save"] and e["blocked_s"] >= 0 for e in saved.values())
    kept = [f for f in sorted((tmp_path / "ckpt").glob("step-*")) if int(f.name.split("-")[1]) in written]
    assert kept  # the resumed run saved step 10 into the same folder
    for folder in kept:  # the ones checkpoint.keep left
        e = written[int(folder.name.split("-")[1])]
        assert e["bytes"] == sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) > 0, (folder, e)
        assert e["seconds"] > 0


def _case_die_during_save(config, die_at_step):
    """Rank 1 dies (os._exit) in the middle of saving checkpoint `die_at_step`."""
    import os

    import torch.distributed as dist

    import hybridpar.checkpoint.dcp as ckpt
    from hybridpar.train import Trainer

    trainer = Trainer(config)
    save = ckpt.dcp.save

    def dying_save(state, **kwargs):
        result = save(state, **kwargs)  # every shard and DCP's .metadata are written...
        if trainer.step == die_at_step and dist.get_rank() == 1:
            os._exit(9)  # ...but the rank dies before the checkpoint is committed
        return result

    ckpt.dcp.save = dying_save
    try:
        trainer.run()
    finally:
        ckpt.dcp.save = save


@pytest.mark.slow
def test_rank_killed_mid_save_leaves_the_previous_checkpoint(workers, corpus, tmp_path):
    from hybridpar.checkpoint.dcp import latest_checkpoint
    from tests.distributed import WorkerError

    folder = tmp_path / "ckpt"
    config = _config(corpus, folder, tmp_path / "run", (2, 2, 1), **{"checkpoint.every": 2, "train.steps": 6})
    # The shared pool: the death ends it (the survivors hang in a collective: 2 s for their errors,
    # then they are killed too), and workers(4) starts the next one, which the resume below uses.
    with pytest.raises(WorkerError, match="worker died"):
        workers(4).run(_case_die_during_save, config, 4, timeout=120, grace=2.0)
    names = sorted(p.name for p in folder.iterdir())
    print(f"\nafter the crash: {names}")
    assert "step-00000002" in names and "step-00000004" not in names
    assert (folder / "step-00000004.partial" / ".metadata").exists()  # written, never committed
    assert latest_checkpoint(folder).name == "step-00000002"
    resumed = workers(4).run(_case_run, config)[0]  # new processes: the old ones died with the pool
    assert resumed["start"] == 2 and len(resumed["losses"]) == 4
    # The retried step-4 save replaced the partial folder the crash left.
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000002", "step-00000004", "step-00000006"]


def _case_load_error(config):
    from hybridpar.train import Trainer

    try:
        Trainer(config)
    except ValueError as err:
        return str(err)
    return "no error"


def test_checkpoint_of_another_model_is_refused(mp2_dp2_runs, workers, corpus, tmp_path):
    s = mp2_dp2_runs
    config = _config(corpus, s["folder"], tmp_path / "run", (2, 2, 1), **{"model.n_layers": 3})
    message = workers(4).run(_case_load_error, config)[0]
    assert "was saved for a different model (n_layers: checkpoint 2, this model 3)" in message, message


def test_a_fresh_run_into_a_folder_of_checkpoints_is_refused(mp2_dp2_runs, workers, corpus, tmp_path):
    # Its saves would mix with the old run's, and pruning by step number could delete the new ones.
    s = mp2_dp2_runs
    config = _config(corpus, s["folder"], tmp_path / "run", (2, 2, 1), **{"checkpoint.resume": False})
    message = workers(4).run(_case_load_error, config)[0]
    assert re.search(rf"{re.escape(str(s['folder']))} already holds checkpoints \(newest step-\d{{8}}\)", message), message
    assert "set checkpoint.resume = true" in message, message


def test_settings_that_do_not_shape_the_weights_do_not_block_a_load(mp2_dp2_runs, workers, corpus, tmp_path):
    # A checkpoint converted from Meta's folder records Meta's max_seq_len and a resolved embedding
    # split; the preset says otherwise, and the weights are the same either way.
    s = mp2_dp2_runs
    source = next(s["folder"].glob("step-*"))
    copy = tmp_path / source.name
    shutil.copytree(source, copy)
    params = json.loads((copy / "params.json").read_text())
    params.update(max_seq_len=params["max_seq_len"] * 2, embedding_split="vocab")
    write_params(copy, params)
    config = _config(corpus, tmp_path / "ckpt", tmp_path / "run", (2, 2, 1), **{"checkpoint.init_from": str(copy)})
    assert workers(4).run(_case_load_error, config)[0] == "no error"


def _case_rank0_cannot_write(config):
    import torch.distributed as dist

    import hybridpar.checkpoint.dcp as dcp_module
    from hybridpar.train import Trainer

    def full_disk(path, text):
        raise OSError(28, "No space left on device", str(path))

    real = dcp_module.write_text_atomic
    if dist.get_rank() == 0:
        dcp_module.write_text_atomic = full_disk
    try:
        Trainer(config).run()
    except Exception as err:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(err).__name__}: {err}"
    finally:
        dcp_module.write_text_atomic = real  # the worker processes serve later tests
    return "no error"


def test_a_save_rank_0_cannot_finish_fails_on_every_rank(workers, corpus, tmp_path):
    # Rank 0 alone writes the checkpoint's last files and renames it: if that fails, the other ranks
    # must raise too rather than wait for it until the collectives time out.
    config = _config(corpus, tmp_path / "ckpt", tmp_path / "run", (1, 2, 1),
                     **{"train.steps": 1, "checkpoint.every": 1})
    errors = workers(2).run(_case_rank0_cannot_write, config)
    print(errors)
    # A full disk, said alike on every rank (tests/checkpoint/test_disk_full.py), the partial folder removed.
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("CheckpointDiskFullError: checkpoint step-00000001 not saved: writing it ran out of "
                                "space (No space left on device), the partial folder was removed: "), errors
    assert not list((tmp_path / "ckpt").glob("step-*")), "no checkpoint, complete or partial, may be left"


def _case_tie_mismatch(folder: str) -> list:
    """Save debug tied and untied (weights only), load each into the other; and an untied checkpoint
    whose params.json predates the hybridpar-only fields into the same model."""
    from pathlib import Path

    import torch.distributed as dist

    from hybridpar.checkpoint.dcp import Checkpointer, CheckpointError, params_dict
    from hybridpar.models.args import ModelArgs
    from hybridpar.models.llama import Transformer
    from tests.distributed import parallel_dims

    parallel = parallel_dims(mp=2)
    outcomes = []
    for saved_tied in (True, False):
        args, other = (ModelArgs.from_preset("debug", tie_embeddings=tied) for tied in (saved_tied, not saved_tied))
        checkpointer = Checkpointer(Path(folder) / f"tied_{saved_tied}", parallel)
        path = checkpointer.save(0, Transformer(args, parallel), None, {}, params_dict(args))
        try:
            checkpointer.load(path, Transformer(other, parallel), None, params_dict(other))
            outcomes.append("no error")
        except CheckpointError as err:
            outcomes.append(str(err))
    dist.barrier()  # every rank has read params.json before rank 0 rewrites it
    if dist.get_rank() == 0:
        params = json.loads((path / "params.json").read_text())
        for field in ("ffn_hidden_size", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                      "rope_original_context", "tie_embeddings"):
            del params[field]
        write_params(path, params)
    dist.barrier()
    untied = ModelArgs.from_preset("debug")
    checkpointer.load(path, Transformer(untied, parallel), None, params_dict(untied))
    return outcomes


def test_tie_embeddings_mismatch_is_refused_with_what_to_change(workers, tmp_path):
    results = workers(4).run(_case_tie_mismatch, str(tmp_path))
    assert all(r == results[0] for r in results), results
    into_untied, into_tied = results[0]
    assert ("step-00000000 was saved with tie_embeddings = True (no output.weight: its head reads tok_embeddings), "
            "this model has tie_embeddings = False: build the model with tie_embeddings = True "
            '("tie_embeddings": true in its params.json or preset) to load it') in into_untied, into_untied
    assert ("was saved with tie_embeddings = False (an output.weight of its own), this model has tie_embeddings = "
            'True: build the model with tie_embeddings = False ("tie_embeddings": false in') in into_tied, into_tied
