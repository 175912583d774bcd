"""FastFileSystemReader: loads exactly what torch's FileSystemReader loads (same layout, resharded,
optimizer state), and names a damaged file instead of loading garbage."""

from __future__ import annotations

import dataclasses
import types
import warnings

import pytest
import torch

from tests.distributed import parallel_dims


def _varied_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "rows": torch.randn(40, 16, generator=g),
        "transposed": torch.randn(16, 30, generator=g).t(),  # stored with its strides: not contiguous
        "half": torch.randn(9, 7, generator=g).to(torch.bfloat16),
        "ints": torch.randint(-5, 5, (11,), generator=g, dtype=torch.int64),
        "flags": torch.rand(13, generator=g) > 0.5,
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "step": 7,  # not a tensor: stored as bytes, read by the stock reader
        "nested": {"lr": 0.25, "w": torch.arange(6.0).reshape(2, 3)},
    }


def _zeros_like(state) -> dict:
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else None


def _assert_same(actual, expected, where="") -> None:
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for k in expected:
            _assert_same(actual[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), where
    else:
        assert actual == expected, where


def _save_single(folder, state) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def _load_single(folder, target, reader, planner=None) -> dict:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=reader, planner=planner, no_dist=True)
    return target


@pytest.mark.parametrize("threads", [1, 3])
def test_loads_what_the_stock_reader_loads(tmp_path, threads):
    import torch.distributed.checkpoint as dcp

    from hybridpar.checkpoint.reader import SafeLoadPlanner
    from hybridpar.fastpaths.dcp_reader import FastFileSystemReader

    saved = _varied_state()
    _save_single(tmp_path, saved)
    stock = _load_single(tmp_path, {**_zeros_like(saved), "step": 0, "nested": {"lr": 0.0, "w": torch.zeros(2, 3)}},
                         dcp.FileSystemReader(tmp_path))
    target = {**_zeros_like(saved), "step": 0, "nested": {"lr": 0.0, "w": torch.zeros(2, 3)}}
    rows = target["rows"]
    fast = _load_single(tmp_path, target, FastFileSystemReader(tmp_path, thread_count=threads), SafeLoadPlanner())
    _assert_same(stock, saved)
    _assert_same(fast, saved)
    assert fast["rows"] is rows  # read into the tensor it was given


def test_casts_and_strided_destinations_like_the_stock_reader(tmp_path):
    import torch.distributed.checkpoint as dcp

    from hybridpar.fastpaths.dcp_reader import FastFileSystemReader

    saved = {"a": torch.randn(20, 6, generator=torch.Generator().manual_seed(1)), "b": torch.arange(24.0).reshape(4, 6)}
    _save_single(tmp_path, saved)

    def target():  # a float64 destination, and one that is a transposed view
        return {"a": torch.zeros(20, 6, dtype=torch.float64), "b": torch.zeros(6, 4).t()}

    stock = _load_single(tmp_path, target(), dcp.FileSystemReader(tmp_path))
    fast = _load_single(tmp_path, target(), FastFileSystemReader(tmp_path))
    _assert_same(fast, stock)
    assert torch.equal(fast["a"], saved["a"].double()) and torch.equal(fast["b"], saved["b"])


def test_other_byte_order_is_left_to_the_stock_reader(tmp_path, monkeypatch):
    import hybridpar.fastpaths.dcp_reader as reader

    saved = {"a": torch.randn(5, 3), "b": torch.arange(4)}
    _save_single(tmp_path, saved)
    # As on a big-endian machine: every stored (little-endian) tensor must be byte-swapped, which only
    # the stock reader does; the in-place path must not run at all.
    monkeypatch.setattr(reader, "sys", types.SimpleNamespace(byteorder="big"))

    def no_in_place_reads(*args):
        raise AssertionError("read in place despite the byte order")

    monkeypatch.setattr(reader, "_pread_exact", no_in_place_reads)
    fast = _load_single(tmp_path, _zeros_like(saved), reader.FastFileSystemReader(tmp_path))
    _assert_same(fast, saved)


@dataclasses.dataclass
class _NotPlainData:
    x: int


@pytest.mark.parametrize("case", ["a dataclass", "a call"])
def test_values_that_are_not_plain_data_are_refused(tmp_path, case):
    from torch.distributed.checkpoint.api import CheckpointException

    from hybridpar.checkpoint.reader import SafeLoadPlanner
    from hybridpar.fastpaths.dcp_reader import FastFileSystemReader
    from tests.untrusted import RunsCode, never_ran

    marker = tmp_path / "marker"
    # a call: run, it makes the marker and gives 3, plain data, and the load would go on
    _save_single(tmp_path / "ckpt", {"a": torch.ones(2), "obj": _NotPlainData(3) if case == "a dataclass"
                                     else RunsCode(marker, 3)})
    # torch's default planner would unpickle it (running whatever the pickle names); this one refuses
    refused = never_ran(marker, lambda: _load_single(tmp_path / "ckpt", {"a": torch.zeros(2), "obj": None},
                                                     FastFileSystemReader(tmp_path / "ckpt"), SafeLoadPlanner()),
                        CheckpointException)
    assert "obj: the checkpoint stores a value that is not plain data" in str(refused), refused


def _distcp_file(folder):
    files = sorted(folder.glob("*.distcp"))
    assert len(files) == 1, files
    return files[0]


def test_truncated_file_is_named(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    from hybridpar.fastpaths.dcp_reader import FastFileSystemReader

    saved = {"a": torch.randn(64, 64), "b": torch.randn(64, 64)}
    _save_single(tmp_path, saved)
    data = _distcp_file(tmp_path)
    data.write_bytes(data.read_bytes()[:-5000])  # the second tensor's bytes are cut short
    with pytest.raises(CheckpointException, match=r"__0_0\.distcp is truncated: it has \d+ bytes but . is stored at"):
        _load_single(tmp_path, _zeros_like(saved), FastFileSystemReader(tmp_path))


def test_damaged_record_is_named(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    from hybridpar.fastpaths.dcp_reader import FastFileSystemReader

    saved = {"a": torch.randn(64, 64)}
    _save_single(tmp_path, saved)
    data = _distcp_file(tmp_path)
    raw = bytearray(data.read_bytes())
    raw[:200] = bytes(200)  # the archive's header is overwritten: the file is the right size but not a tensor
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException, match=r"cannot read a at bytes .* the checkpoint file is damaged"):
        _load_single(tmp_path, _zeros_like(saved), FastFileSystemReader(tmp_path))


# --- several ranks: resharded loads and optimizer state --------------------------------------------

def _full_tensors() -> dict:
    g = torch.Generator().manual_seed(5)
    return {
        "a": torch.randn(12, 10, generator=g),
        "b": torch.randn(8, 12, generator=g),
        "c": torch.randn(6, 5, generator=g).to(torch.bfloat16),
        "uneven": torch.randn(18, 3, generator=g),  # 5, 5, 5, 3 rows over four ranks
        "ids": torch.arange(14),
    }


def _case_reshard(folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hybridpar.fastpaths.dcp_reader import FastFileSystemReader

    line = parallel_dims(mp=1, dp_shard=4).mesh["dp_shard"]
    square = parallel_dims(mp=2, dp_shard=2).mesh["dp_shard", "mp"]
    full = _full_tensors()
    saved_at = {"a": (line, [Shard(0)]), "b": (line, [Shard(1)]), "c": (line, [Replicate()]),
                "uneven": (line, [Shard(0)]), "ids": (line, [Shard(0)])}
    state = {k: distribute_tensor(full[k], *saved_at[k]) for k in full}
    dcp.save({**state, "step": 3}, checkpoint_id=str(folder))
    # Other layouts: column slices of row-sharded chunks (strided reads), rows of column-sharded ones,
    # replicated from sharded and back, a 2-D mesh.
    load_at = {"a": (square, [Shard(1), Shard(0)]), "b": (line, [Shard(0)]), "c": (square, [Shard(0), Shard(1)]),
               "uneven": (square, [Shard(0), Replicate()]), "ids": (line, [Replicate()])}
    results = {}
    for name, reader in (("stock", dcp.FileSystemReader(folder)), ("fast", FastFileSystemReader(folder))):
        target = {k: distribute_tensor(torch.zeros_like(full[k]), *load_at[k]) for k in full}
        target["step"] = 0
        dcp.load(target, storage_reader=reader)
        results[name] = target
    mismatches = []
    for k in full:
        fast, stock = results["fast"][k], results["stock"][k]
        if not torch.equal(fast.to_local(), stock.to_local()):
            mismatches.append(f"{k}: local shard differs from the stock reader's")
        if not torch.equal(fast.full_tensor(), full[k]):
            mismatches.append(f"{k}: full tensor differs from the saved one")
    if results["fast"]["step"] != 3:
        mismatches.append("step")
    return mismatches


def test_resharded_loads_equal_the_stock_reader(workers, tmp_path):
    for rank, mismatches in enumerate(workers(4).run(_case_reshard, tmp_path / "ckpt")):
        assert not mismatches, f"rank {rank}: {mismatches}"


def _tiny_model(mesh, placements, seed):
    from torch.distributed.tensor import distribute_tensor

    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Module()
    for i, shape in enumerate([(16, 8), (8, 12), (20, 4)]):
        full = torch.randn(*shape, generator=g)
        model.register_parameter(f"w{i}", torch.nn.Parameter(distribute_tensor(full, mesh, placements)))
    return model


def _case_optimizer(folder):
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    from hybridpar.checkpoint.dcp import Checkpointer

    line = parallel_dims(mp=1, dp_shard=4).mesh["dp_shard"]
    square = parallel_dims(mp=2, dp_shard=2).mesh["dp_shard", "mp"]
    stub = types.SimpleNamespace(rank=dist.get_rank(), world_size=dist.get_world_size(), device=torch.device("cpu"))
    model = _tiny_model(line, [Shard(0)], seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(3):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.1 * (step + 1))
        optimizer.step()
    Checkpointer(folder, stub).save(3, model, optimizer, {}, {})
    expected = {n: p.full_tensor() for n, p in model.named_parameters()}
    expected.update({f"{n}.{k}": v.full_tensor() if k != "step" else v
                     for n, p in model.named_parameters() for k, v in optimizer.state[p].items()})

    mismatches = []
    for placements in ([Shard(0), Shard(1)], [Shard(1), Shard(0)]):  # another mesh and split than saved
        fresh = _tiny_model(square, placements, seed=2)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
        Checkpointer(folder, stub).load(folder / "step-00000003", fresh, fresh_opt, {})
        got = {n: p.full_tensor() for n, p in fresh.named_parameters()}
        got.update({f"{n}.{k}": v.full_tensor() if k != "step" else v
                    for n, p in fresh.named_parameters() for k, v in fresh_opt.state[p].items()})
        if got.keys() != expected.keys():
            mismatches.append(f"{placements}: keys {sorted(got)} != {sorted(expected)}")
        mismatches += [f"{placements}: {k}" for k in expected if k in got and not torch.equal(got[k], expected[k])]
    return mismatches


def test_optimizer_state_round_trips_at_another_layout(workers, tmp_path):
    for rank, mismatches in enumerate(workers(4).run(_case_optimizer, tmp_path / "ckpt")):
        assert not mismatches, f"rank {rank}: {mismatches}"


def _case_truncated(folder):
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    from hybridpar.checkpoint.dcp import CheckpointError, Checkpointer

    line = parallel_dims(mp=1, dp_shard=4).mesh["dp_shard"]
    stub = types.SimpleNamespace(rank=dist.get_rank(), world_size=dist.get_world_size(), device=torch.device("cpu"))
    model = _tiny_model(line, [Shard(0)], seed=1)
    checkpointer = Checkpointer(folder, stub)
    path = checkpointer.save(1, model, None, {}, {})
    if dist.get_rank() == 0:
        with open(path / "__2_0.distcp", "r+b") as f:  # rank 2's shards, cut short (a partial copy)
            f.truncate(f.seek(0, 2) - 100)
    dist.barrier()
    try:
        checkpointer.load(path, model, None, {})
    except CheckpointError as err:
        return str(err)
    return "loaded without an error"


def test_truncated_checkpoint_is_refused_on_every_rank(workers, tmp_path):
    messages = workers(4).run(_case_truncated, tmp_path / "ckpt")
    for message in messages:  # DCP shares the failure with every rank
        assert "__2_0.distcp is truncated" in message and "load another one" in message, message
