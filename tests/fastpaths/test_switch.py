"""HYBRIDPAR_FAST_PATHS=0 runs torch's stock paths with the same results: a checkpoint saved and loaded
either way loads the same bytes (optimizer state included, without the pre-allocation), and an FSDP
training step on FSDP2's own collectives equals the step on the gloo all-to-alls."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from tests.distributed import parallel_dims, rel_err

BOUND = 1e-4  # as tests/train/test_trainer.py


def test_the_switch_reads_the_environment(monkeypatch):
    from hybridpar import fastpaths

    monkeypatch.delenv(fastpaths.ENV, raising=False)
    assert fastpaths.enabled()  # on by default
    for value, on in (("0", False), ("1", True), ("", True)):
        monkeypatch.setenv(fastpaths.ENV, value)
        assert fastpaths.enabled() is on, value


@contextlib.contextmanager
def _fast_paths(on: bool):
    """The switch in a worker process, put back afterwards: the pool serves later tests."""
    before = os.environ.get("HYBRIDPAR_FAST_PATHS")
    os.environ["HYBRIDPAR_FAST_PATHS"] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["HYBRIDPAR_FAST_PATHS"]
        else:
            os.environ["HYBRIDPAR_FAST_PATHS"] = before


def _sharded_model(seed: int, parallel, fast: bool = True):
    from hybridpar.config.sharding import FSDPConfig
    from hybridpar.parallel.fsdp import apply_fsdp
    from hybridpar.models.args import ModelArgs
    from hybridpar.models.llama import Transformer

    args = ModelArgs.from_preset("debug")
    torch.manual_seed(seed)
    model = Transformer(args, parallel)
    with _fast_paths(fast):
        apply_fsdp(model, parallel, FSDPConfig(sharding_strategy="full_shard", param_dtype="float32"))
    return args, model


def _step(model, optimizer, args, seed: int) -> torch.Tensor:
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab_size, (2, 9), generator=g)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _local_state(model, optimizer) -> dict:
    """This rank's shards of every parameter and optimizer state tensor, by name."""
    def local(t):
        return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()

    out = {}
    for name, p in model.named_parameters():
        out[name] = local(p)
        for key, value in optimizer.state.get(p, {}).items():
            out[f"{name}:{key}"] = local(value)
    return out


def _case_checkpoint(folder):
    import hybridpar.checkpoint.dcp as ckpt
    from hybridpar.checkpoint.dcp import Checkpointer, params_dict

    parallel = parallel_dims(mp=1, dp_shard=2)
    args, model = _sharded_model(0, parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, optimizer, args, seed=1)
    saved = _local_state(model, optimizer)
    writers = {}
    for on in (True, False):
        with _fast_paths(on):
            writers[on] = type(Checkpointer._writer(folder)).__name__
            Checkpointer(folder / f"fast{int(on)}", parallel).save(1, model, optimizer, {}, params_dict(args))

    used = []  # (fast reader made, optimizer state pre-allocated) per load
    real_reader, real_allocate = ckpt.FastFileSystemReader, ckpt.allocate_optimizer_state

    class SpyReader(real_reader):
        def __init__(self, *a, **kw):
            used[-1][0] = True
            super().__init__(*a, **kw)

    def spy_allocate(*a):
        used[-1][1] = True
        real_allocate(*a)

    ckpt.FastFileSystemReader, ckpt.allocate_optimizer_state = SpyReader, spy_allocate
    mismatches = []
    try:
        for saved_on in (True, False):
            for load_on in (True, False):
                _, fresh = _sharded_model(2, parallel)
                fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
                used.append([False, False])
                with _fast_paths(load_on):
                    Checkpointer(folder, parallel).load(folder / f"fast{int(saved_on)}" / "step-00000001",
                                                        fresh, fresh_opt, params_dict(args))
                got = _local_state(fresh, fresh_opt)
                where = f"saved fast={saved_on}, loaded fast={load_on}"
                if got.keys() != saved.keys():
                    mismatches.append(f"{where}: {sorted(set(got) ^ set(saved))}")
                mismatches += [f"{where}: {k}" for k in saved if k in got
                               and not (got[k].dtype == saved[k].dtype and torch.equal(got[k], saved[k]))]
    finally:
        ckpt.FastFileSystemReader, ckpt.allocate_optimizer_state = real_reader, real_allocate
    return {"writers": writers, "used": used, "mismatches": mismatches}


def test_checkpoints_with_the_fast_paths_off_load_the_same_bytes(workers, tmp_path):
    for result in workers(2).run(_case_checkpoint, tmp_path / "ckpt"):
        assert result["writers"] == {True: "UncheckedWriter", False: "FileSystemWriter"}, result
        # Loads in the order (saved, loaded) = on on, on off, off on, off off.
        assert result["used"] == [[True, True], [False, False], [True, True], [False, False]], result
        assert not result["mismatches"], result["mismatches"]


def _case_fsdp_step(world: int):
    from bench.comm import CollectiveCounter

    parallel = parallel_dims(mp=1, dp_shard=world)
    results = {}
    for on in (True, False):
        args, model = _sharded_model(0, parallel, fast=on)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        with CollectiveCounter() as counter:
            loss = _step(model, optimizer, args, seed=1)
        kinds = sorted({key.split("/")[0] for key in counter.summary()})
        results[on] = (loss, {n: p.full_tensor() for n, p in model.named_parameters()}, kinds)
    (loss_on, params_on, kinds_on), (loss_off, params_off, kinds_off) = results[True], results[False]
    errors = {n: rel_err(params_off[n], params_on[n]) for n in params_on}
    return {"loss": rel_err(loss_off, loss_on), "worst": max(errors.values()), "kinds": (kinds_on, kinds_off)}


@pytest.mark.parametrize("world", [2, 4])
def test_an_fsdp_step_without_the_gloo_collectives_is_the_same_step(workers, world):
    for result in workers(world).run(_case_fsdp_step, world):
        kinds_on, kinds_off = result["kinds"]
        assert "all_to_all" in kinds_on and "all_gather" not in kinds_on, kinds_on  # the fast path ran...
        assert "all_to_all" not in kinds_off and {"all_gather", "reduce_scatter"} <= set(kinds_off), kinds_off
        assert result["loss"] <= BOUND and result["worst"] <= BOUND, result  # ...and changed nothing
