"""One loader for one source and a blend: positions saved before the loaders were one resume with
the same next batches, a blend reads in DataLoader workers (data.num_workers), one class for both."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridpar.data import PackedDataset, ResumableDataLoader, build_dataloader

# Written by main at 0ce63af with its ResumableDataLoader (one source) and BlendedLoader (a blend):
# each built on the corpus below, advanced `steps_before` batches on both dp ranks; its state_dict()
# and the next 10 batches of each rank (each row: the window, inputs + the last target).
FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "old_loader_states.json").read_text())
SEQ = 4


class Tokens:
    """(arange(n) * 7919 + salt) % 10007: every window different, known without a store."""

    def __init__(self, n: int, salt: int) -> None:
        self.tokens = (np.arange(n, dtype=np.int64) * 7919 + salt) % 10007
        self.n_tokens = n


def windows(n: int, salt: int) -> PackedDataset:
    return PackedDataset(Tokens(n * SEQ + 1, salt), SEQ)


def _rows(batch) -> list[list[int]]:
    inputs, targets = batch
    return [row + [int(t[-1])] for row, t in zip(inputs.tolist(), targets)]


def _loader(case: str, rank: int, **kwargs) -> ResumableDataLoader:
    f = FIXTURE[case]
    data = (windows(f["windows"], f["salt"]) if case == "single" else
            [(name, weight, windows(n, salt)) for name, weight, n, salt in f["sources"]])
    return build_dataloader(data, dp_rank=rank, dp_size=2, micro_batch_size=3, seed=5, **kwargs)


@pytest.mark.parametrize("case", ["single", "blend"])
def test_a_position_saved_by_the_old_loaders_resumes_with_the_same_next_batches(case):
    f = FIXTURE[case]
    for rank in range(2):
        loader = _loader(case, rank)
        loader.load_state_dict(f["state"])
        assert [_rows(next(loader)) for _ in range(10)] == f[f"rank{rank}"]
        # and the new loader, run from the start, reaches the same position and batches
        fresh = _loader(case, rank)
        for _ in range(f["steps_before"]):
            next(fresh)
        assert [_rows(next(fresh)) for _ in range(10)] == f[f"rank{rank}"]
    with pytest.raises(ValueError, match="resume with the same data.source or data.sources"):
        _loader("blend" if case == "single" else "single", 0).load_state_dict(f["state"])


def test_the_new_position_resumes_a_fresh_loader_exactly():
    loader = _loader("blend", 1)
    for _ in range(7):
        next(loader)
    state = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint keeps it
    expected = [_rows(next(loader)) for _ in range(6)]
    resumed = _loader("blend", 1)
    resumed.load_state_dict(state)
    assert [_rows(next(resumed)) for _ in range(6)] == expected


class PidTokens(Tokens):
    """Tokens that note the process of every read made in a DataLoader worker."""

    def __init__(self, n: int, salt: int, folder: Path) -> None:
        super().__init__(n, salt)
        self.folder, self._tokens = folder, self.tokens
        self.tokens = self

    def __getitem__(self, key):
        if torch.utils.data.get_worker_info() is not None:
            (self.folder / str(os.getpid())).touch()
        return self._tokens[key]


def test_a_blend_reads_in_worker_processes_and_one_source_shares_its_class(tmp_path):
    sources = [("a", 0.6, PackedDataset(PidTokens(40 * SEQ + 1, 1, tmp_path), SEQ)),
               ("b", 0.4, PackedDataset(PidTokens(30 * SEQ + 1, 2, tmp_path), SEQ))]
    in_workers = build_dataloader(sources, dp_rank=0, dp_size=1, micro_batch_size=4, seed=0, num_workers=2)
    in_process = build_dataloader(sources, dp_rank=0, dp_size=1, micro_batch_size=4, seed=0)
    for _ in range(30):  # past both sources' first epochs
        assert _rows(next(in_workers)) == _rows(next(in_process))
    pids = {int(p.name) for p in tmp_path.iterdir()}
    assert len(pids) == 2 and os.getpid() not in pids
    one = build_dataloader(windows(40, 1), dp_rank=0, dp_size=1, micro_batch_size=4, seed=0)
    assert type(one) is type(in_workers) is ResumableDataLoader
