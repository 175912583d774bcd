"""Packed windows, the dp-keyed sampler and the resumable loader: coverage, mp groups, exact resume."""


import pytest
import torch

from hybridpar.data import PackedDataset, build_dataloader, check_dataset_size, check_vocab
from tests.data.stubs import numbered_token_file
from tests.distributed import parallel_dims

SEQ = 4


def numbered_dataset(folder, n_windows, seq_len=SEQ):
    """n_windows windows; window i starts with token i*seq_len + 1, so a batch says which windows it holds."""
    return PackedDataset(numbered_token_file(folder, n_windows * seq_len + 1, name=f"w{n_windows}"), seq_len)


def window_ids(inputs, seq_len=SEQ):
    return [(int(v) - 1) // seq_len for v in inputs[:, 0]]


def epoch_permutation(n, seed, epoch=0):
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def take(loader, n):
    return [next(loader) for _ in range(n)]


def test_packed_windows_overlap_by_one_token(tmp_path):
    tf = numbered_token_file(tmp_path, 23)  # tokens 1..22 then EOS 0
    ds = PackedDataset(tf, 5)
    assert len(ds) == 4  # (23 - 1) // 5
    for i in range(4):
        assert ds[i].dtype == torch.int64 and ds[i].tolist() == list(range(5 * i + 1, 5 * i + 7))
    with pytest.raises(IndexError, match="window 4 is outside the dataset's 4 windows"):
        ds[4]
    assert PackedDataset(tf.folder, 2)[10].tolist() == [21, 22, 0]  # a path works; the last window ends on EOS
    assert len(PackedDataset(tf, 22)) == 1 and len(PackedDataset(tf, 23)) == 0
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        PackedDataset(tf, 0)


def position(loader):
    """(epoch, windows of it consumed) of a single source's loader, from its saved state."""
    (entry,) = loader.state_dict()["sources"].values()
    return entry["epoch"], entry["offset"]


@pytest.mark.parametrize("dp_size", [1, 3])
def test_one_source_reads_in_torchs_distributed_sampler_order(tmp_path, dp_size):
    """The order a single source always had: torch's DistributedSampler (shuffle, drop_last) at each epoch."""
    ds = numbered_dataset(tmp_path, 20)
    for rank in range(dp_size):
        ours = build_dataloader(ds, dp_rank=rank, dp_size=dp_size, micro_batch_size=2, seed=5)
        theirs = []
        for epoch in (0, 1):
            sampler = torch.utils.data.DistributedSampler(ds, num_replicas=dp_size, rank=rank, shuffle=True, seed=5,
                                                          drop_last=True)
            sampler.set_epoch(epoch)
            theirs += [[ds[i][0].item() for i in batch] for batch in
                       torch.utils.data.BatchSampler(sampler, 2, drop_last=True)]
        assert [next(ours)[0][:, 0].tolist() for _ in theirs] == theirs


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_each_window_seen_once_per_epoch_across_dp_ranks(tmp_path, dp_size):
    n = 37
    ds = numbered_dataset(tmp_path, n)
    loaders = [build_dataloader(ds, dp_rank=r, dp_size=dp_size, micro_batch_size=1, seed=11) for r in range(dp_size)]
    orders = []
    for epoch in (0, 1):
        per_rank = [[w for x, _ in take(loader, n // dp_size) for w in window_ids(x)] for loader in loaders]
        seen = [i for r in per_rank for i in r]
        assert len(seen) == len(set(seen)) == dp_size * (n // dp_size)  # no repeats, < dp_size dropped
        assert sorted(seen) == sorted(epoch_permutation(n, 11, epoch)[: len(seen)])
        orders.append(per_rank[0])
    assert orders[0] != orders[1]  # reshuffled each epoch


def test_loader_yields_shifted_int64_batches_forever(tmp_path):
    ds = numbered_dataset(tmp_path, 10)
    loader = build_dataloader(ds, dp_rank=0, dp_size=1, micro_batch_size=4, seed=1)
    inputs, targets = next(loader)
    assert inputs.shape == targets.shape == (4, SEQ) and inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1]) and torch.equal(targets[:, -1], inputs[:, -1] + 1)
    assert inputs.is_contiguous() and targets.is_contiguous()
    assert window_ids(inputs) == epoch_permutation(10, 1)[:4]
    next(loader)  # 10 windows // 4 = 2 batches per epoch
    assert position(loader) == (0, 8)
    third, _ = next(loader)
    assert position(loader) == (1, 4)
    assert window_ids(third) == epoch_permutation(10, 1, epoch=1)[:4]
    assert len(take(loader, 20)) == 20


@pytest.mark.parametrize("num_workers", [0, 2])
def test_restored_loader_yields_exactly_the_next_batches(tmp_path, num_workers):
    ds = numbered_dataset(tmp_path, 26)  # dp 2, batch 3: 4 batches per epoch, the resume crosses an epoch
    kwargs = dict(dp_rank=1, dp_size=2, micro_batch_size=3, seed=7, num_workers=num_workers)
    original = build_dataloader(ds, **kwargs)
    take(original, 3)  # the workers have fetched ahead by now
    state = original.state_dict()
    expected = take(original, 6)
    restored = build_dataloader(ds, **kwargs)
    restored.load_state_dict(state)
    got = take(restored, 6)
    for (xi, yi), (xe, ye) in zip(got, expected):
        assert torch.equal(xi, xe) and torch.equal(yi, ye)
    assert restored.state_dict() == original.state_dict()
    # Rewinding a loader that is mid-iteration drops what its workers fetched ahead.
    original.load_state_dict(state)
    assert all(torch.equal(x, xe) for (x, _), (xe, _) in zip(take(original, 6), expected))
    # A loader restored from the start equals a fresh one.
    fresh, rewound = build_dataloader(ds, **kwargs), build_dataloader(ds, **kwargs)
    rewound.load_state_dict(fresh.state_dict())
    assert torch.equal(next(fresh)[0], next(rewound)[0])


def test_a_dropped_loader_frees_its_workers_at_once(tmp_path):
    """No reference cycle through the loader: dropped, it is freed at once and its DataLoader workers
    exit. Left to the garbage collector, each worker waited 5 s before it was killed (a run's end,
    the test after this one)."""
    import gc
    import multiprocessing
    import time
    import weakref

    others = set(multiprocessing.active_children())
    loader = build_dataloader(numbered_dataset(tmp_path, 26), dp_rank=0, dp_size=1, micro_batch_size=3, seed=7,
                              num_workers=2)
    take(loader, 2)
    workers = set(multiprocessing.active_children()) - others
    assert len(workers) == 2
    freed = weakref.ref(loader)
    gc.disable()  # what frees it must be its last reference going, not a collection
    try:
        del loader
        assert freed() is None, "the loader is part of a reference cycle"
    finally:
        gc.enable()
    start = time.monotonic()
    for worker in workers:
        worker.join(timeout=5)
    assert not any(w.is_alive() for w in workers) and time.monotonic() - start < 3


@pytest.mark.parametrize("new_dp", [4, 1])
def test_position_saved_at_dp2_resumes_at_other_dp_sizes(tmp_path, new_dp):
    n, batch, seed = 60, 2, 3
    ds = numbered_dataset(tmp_path, n)
    perm = epoch_permutation(n, seed)
    old = [build_dataloader(ds, dp_rank=r, dp_size=2, micro_batch_size=batch, seed=seed) for r in range(2)]
    seen = [w for loader in old for x, _ in take(loader, 3) for w in window_ids(x)]
    states = [loader.state_dict() for loader in old]
    assert states[0] == states[1] and position(old[0]) == (0, 12)
    assert sorted(seen) == sorted(perm[:12])

    new = [build_dataloader(ds, dp_rank=r, dp_size=new_dp, micro_batch_size=batch, seed=seed) for r in range(new_dp)]
    rest_per_rank = []
    for loader in new:
        loader.load_state_dict(states[0])
        ids = [w for x, _ in take(loader, (n - 12) // new_dp // batch) for w in window_ids(x)]
        assert position(loader)[0] == 0
        rest_per_rank.append(ids)
    rest = [w for ids in rest_per_rank for w in ids]
    assert len(rest) == len(set(rest)) and not set(rest) & set(seen)
    assert sorted(rest) == sorted(perm[12:])  # exactly the samples of the epoch not yet seen
    assert rest_per_rank[0][: batch] == perm[12 : 12 + batch * new_dp : new_dp]  # rank r reads perm[offset + r :: D]
    next(new[0])
    assert position(new[0])[0] == 1


def test_strict_resume_refuses_other_data_or_seed(tmp_path):
    ds = numbered_dataset(tmp_path, 20)
    state = build_dataloader(ds, dp_rank=0, dp_size=1, micro_batch_size=2, seed=0).state_dict()
    other = build_dataloader(numbered_dataset(tmp_path, 21), dp_rank=0, dp_size=1, micro_batch_size=2, seed=0)
    with pytest.raises(ValueError, match=r"saved data position is for .*'windows': 20.* this run reads .*'windows': 21"):
        other.load_state_dict(state)
    reseeded = build_dataloader(ds, dp_rank=0, dp_size=1, micro_batch_size=2, seed=1)
    with pytest.raises(ValueError, match="with seed 0, this run reads .* with seed 1"):
        reseeded.load_state_dict(state)
    reseeded.load_state_dict({"epoch": 0, "global_offset": 4, "samples_per_epoch": 20, "seed": 0}, strict=False)
    assert position(reseeded) == (0, 4)


def test_dataset_smaller_than_a_global_batch_is_a_clear_error(tmp_path):
    ds = numbered_dataset(tmp_path, 10)
    with pytest.raises(
        ValueError,
        match=r"has 10 windows of seq_len \+ 1 = 5 tokens from 41 tokens, but one global batch needs 16 "
        r"\(micro_batch 2 x grad_accum 4 x dp_size 2\); use more data, a smaller seq_len",
    ):
        check_dataset_size(ds, 16, micro_batch_size=2, grad_accum=4, dp_size=2)
    with pytest.raises(ValueError, match=r"needs 11 \(micro_batch x grad_accum x dp_size\)"):
        check_dataset_size(ds, 11)
    check_dataset_size(ds, 10)
    with pytest.raises(ValueError, match=r"10 windows .* needs 12 \(micro_batch 3 x dp_size 4\)"):
        build_dataloader(ds, dp_rank=0, dp_size=4, micro_batch_size=3, seed=0)


def test_check_vocab_names_both_sizes():
    check_vocab(32000, 32000)
    check_vocab(600, 1024)  # a model vocab padded past the tokenizer's is fine
    with pytest.raises(ValueError, match=r"tokenizer has 32000 tokens but the model's vocab_size is 4096"):
        check_vocab(32000, 4096)


# --- across processes: ranks of one model-parallel group read the same batches ----------------


def _case_batches_per_rank(token_path: str, layout: tuple) -> tuple:
    mp, dp_shard, dp_replicate = layout
    # Only non-default arguments: parallel_dims caches by call signature, so other tests' meshes are reused.
    parallel = parallel_dims(mp=mp, dp_shard=dp_shard, **({"dp_replicate": dp_replicate} if dp_replicate != 1 else {}))
    dataset = PackedDataset(token_path, SEQ)
    loader = build_dataloader(dataset, dp_rank=parallel.dp_rank, dp_size=parallel.dp_size, micro_batch_size=2, seed=9)
    return parallel.dp_rank, [window_ids(x) for x, _ in take(loader, 3)]


@pytest.mark.parametrize("layout", [(2, 2, 1), (1, 2, 2), (4, 1, 1)], ids=["mp2_dp2", "mp1_hybrid2x2", "mp4"])
def test_model_parallel_ranks_get_identical_batches(workers, tmp_path, layout):
    token_path = str(numbered_token_file(tmp_path, 40 * SEQ + 1).folder)
    results = workers(4).run(_case_batches_per_rank, token_path, layout)
    mp = layout[0]
    for rank, (dp_rank, batches) in enumerate(results):
        assert dp_rank == rank // mp
        assert batches == results[dp_rank * mp][1]  # the same as the first rank of its mp group
    distinct = [results[g * mp][1] for g in range(4 // mp)]
    flat = [w for batches in distinct for b in batches for w in b]
    assert len(flat) == len(set(flat))  # dp ranks read disjoint windows
