"""A GPU's async saves stage into a host copy made in the background before the first save
(checkpoint.staging): the first save reuses it, writes the bytes a blocking save writes, and says
how long it waited for it. On this CPU nothing is pinned: the tests make the copy unpinned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.runs import make_config


def _unpinned():
    """host_staging as on a GPU, but unpinned (this machine has nothing to pin with)."""
    from hybridpar.checkpoint.staging import HostStaging

    return lambda device: HostStaging(device, pin=False)


def _files(folder: Path) -> dict[str, bytes]:
    return {f.relative_to(folder).as_posix(): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def _case_prepared_copy(folder: str) -> dict:
    """An FSDP2 model on 2 ranks: prepare the copy before any step (refused: no optimizer state),
    after one (begun), save twice asynchronously and once blocking; what each save used."""
    import torch.distributed.checkpoint.staging as torch_staging
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hybridpar.checkpoint.dcp as dcp_module
    from hybridpar.checkpoint.dcp import Checkpointer
    from tests.distributed import parallel_dims

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step() -> None:
        model(torch.randn(4, 16)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    parallel = parallel_dims(mp=1)
    cpu = Checkpointer(Path(folder) / "cpu", parallel, async_save=True)
    out = {"cpu_staging": cpu.staging, "cpu_prepares": cpu.prepare_staging(model, optimizer)}
    cpu.close()
    real_host_staging, real_create = dcp_module.host_staging, torch_staging._create_cpu_state_dict
    dcp_module.host_staging = _unpinned()

    def refuse(*args, **kwargs):
        raise AssertionError("the save made its own host copy")

    try:
        checkpointer = Checkpointer(Path(folder) / "async", parallel, async_save=True)
        out["before_a_step"] = checkpointer.prepare_staging(model, optimizer)
        out["state_after_refusal"] = len(optimizer.state)  # no zero-gradient step was taken for it
        step()
        out["after_a_step"] = checkpointer.prepare_staging(model, optimizer)
        torch_staging._create_cpu_state_dict = refuse  # the stager must not allocate: the copy is made
        checkpointer.save(1, model, optimizer, {}, {})
        out["first"] = dict(checkpointer.last_staging)
        cache = checkpointer.staging.stager.state_dict_cache
        pointers = [t.to_local().data_ptr() for t in cache["model"].values()]
        step()
        checkpointer.save(2, model, optimizer, {}, {})
        out["second"] = dict(checkpointer.last_staging)
        checkpointer.close()
        out["reused"] = checkpointer.staging.stager.state_dict_cache is cache and pointers == [
            t.to_local().data_ptr() for t in cache["model"].values()]
    finally:
        dcp_module.host_staging, torch_staging._create_cpu_state_dict = real_host_staging, real_create
    blocking = Checkpointer(Path(folder) / "sync", parallel, async_save=False)
    blocking.save(2, model, optimizer, {}, {})
    blocking.close()
    return out


def test_the_first_async_save_stages_into_the_copy_made_before_it(workers, tmp_path):
    out = workers(2).run(_case_prepared_copy, str(tmp_path))
    for rank in out:
        # Off CUDA there is no copy to make: DCP stages each save itself, as before.
        assert rank["cpu_staging"] is None and rank["cpu_prepares"] is False
        # Before the first step the optimizer has no state, and getting its state dict would step it.
        assert rank["before_a_step"] is False and rank["state_after_refusal"] == 0
        assert rank["after_a_step"] is True
        # The first save waited for the copy (made in the background) and says so; the next did not wait.
        assert set(rank["first"]) == {"staging_wait_s", "staging_prepared_s"} and rank["second"] == {}, rank
        assert rank["reused"], rank
    # The same bytes as a blocking save of the same state: every shard and RNG file; DCP's .metadata
    # differs only in its StorageMeta (the folder's path and a random save id), and so the manifest.
    saved, blocking = _files(tmp_path / "async" / "step-00000002"), _files(tmp_path / "sync" / "step-00000002")
    assert saved.keys() == blocking.keys() and any(name.endswith(".distcp") for name in saved)
    differ = [name for name in saved if saved[name] != blocking[name]]
    assert sorted(differ) == [".metadata", "checksums.json"], differ
    a, b = (_metadata(tmp_path / kind / "step-00000002") for kind in ("async", "sync"))
    assert a.storage_meta.save_id != b.storage_meta.save_id
    assert (a.state_dict_metadata, a.planner_data, a.storage_data) == (b.state_dict_metadata, b.planner_data,
                                                                       b.storage_data)


def _metadata(folder: Path):
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemReader(str(folder)).read_metadata()


def test_a_copy_of_another_layout_is_dropped_and_the_stager_makes_its_own():
    from hybridpar.checkpoint.staging import HostStaging

    staging = HostStaging(torch.device("cpu"), pin=False)
    staging.prepare({"model": {"w": torch.zeros(4, 2)}, "optimizer": {"lr": 0.1}})
    stager = staging.ready({"model": {"w": torch.zeros(4, 3)}, "optimizer": {"lr": 0.1}})
    assert stager.state_dict_cache is None and set(staging.figures) == {"staging_wait_s", "staging_prepared_s"}
    staging = HostStaging(torch.device("cpu"), pin=False)
    state = {"model": {"w": torch.ones(4, 2), "step": torch.tensor(3.0)}, "optimizer": {"groups": [{"lr": 0.1}]}}
    staging.prepare(state)
    made = staging.ready(state).state_dict_cache
    assert made["model"]["w"].shape == (4, 2) and made["model"]["step"].shape == ()
    assert made["optimizer"] == state["optimizer"] and made["model"]["w"] is not state["model"]["w"]


def _case_train(config, unpinned: bool) -> dict:
    """Train with async saves, the staging copy unpinned (as on a GPU); when it began, in steps."""
    import hybridpar.checkpoint.dcp as dcp_module
    from hybridpar.train import Trainer

    real = dcp_module.host_staging
    if unpinned:
        dcp_module.host_staging = _unpinned()
    try:
        trainer = Trainer(config)
        staging = trainer.checkpointer.staging
        begun = {"at_start": trainer.step if staging is not None and staging.started else None}
        if staging is not None and not staging.started:
            prepare = staging.prepare

            def noted(state):
                begun.setdefault("after_step", trainer.step)
                prepare(state)

            staging.prepare = noted
        trainer.run()
    finally:
        dcp_module.host_staging = real
    return begun


@pytest.mark.slow
def test_training_begins_the_copy_after_the_first_step_or_at_a_resume(workers, corpus, tmp_path):
    folder = tmp_path / "ckpt"
    flags = {"checkpoint.folder": str(folder), "checkpoint.resume": True, "checkpoint.async_save": True,
             "checkpoint.every": 2}
    begun = workers(2).run(_case_train, make_config(corpus, tmp_path / "run", steps=4, **flags), True)
    # A fresh optimizer has its state after step 1: the copy is begun then, before the save at step 2.
    assert all(b == {"at_start": None, "after_step": 1} for b in begun), begun
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    saves = {e["step"]: e for e in events if e["event"] == "checkpoint"}
    assert sorted(saves) == [2, 4] and "staging_wait_s" in saves[2] and "staging_wait_s" not in saves[4], saves
    # Resumed: the loaded optimizer has its state, so the copy is begun before the first step.
    begun = workers(2).run(_case_train, make_config(corpus, tmp_path / "run2", steps=6, **flags), True)
    assert all(b == {"at_start": 4} for b in begun), begun
    # On this CPU, as shipped: no copy is made (nothing to pin), the saves stage as DCP does.
    begun = workers(2).run(_case_train, make_config(corpus, tmp_path / "run3", steps=8, **flags), False)
    assert all(b == {"at_start": None} for b in begun), begun
