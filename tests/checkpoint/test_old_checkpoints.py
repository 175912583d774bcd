"""A training checkpoint written by hybridpar before the one data path (commit 0ce63af: one source through
ResumableDataLoader, a blend through BlendedLoader) resumes on today's code with the same next batches
and losses as that code trained after resuming it (tests/checkpoint/fixtures/make_old_checkpoints.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.checkpoint.fixtures import make_old_checkpoints as old

FIXTURE = old.OUT
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
BOUND = 1e-6


def _case_resume(case: str, root: str) -> dict:
    work = Path(root)
    saved = FIXTURE / case / f"step-{old.STEPS:08d}"
    shutil.copytree(saved, work / "checkpoints" / saved.name, dirs_exist_ok=True)
    return old.train(old.flags(case, FIXTURE / "data", work), None)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["single", "blend"])
def test_a_checkpoint_of_the_old_loaders_resumes_with_the_same_batches_and_losses(workers, tmp_path, case):
    expected = EXPECTED[case]
    results = workers(2).run(_case_resume, case, str(tmp_path))
    assert results[0]["start"] == EXPECTED["steps"]
    for rank, result in enumerate(results):
        assert result["batches"] == expected["batches"][f"rank{rank}"], f"rank {rank}: other batches"
    losses = results[0]["losses"]
    errors = [abs(a - b) / abs(b) for a, b in zip(losses, expected["losses"], strict=True)]
    print(f"\n{case}: resumed losses {losses}\n  old code's {expected['losses']}\n  relative errors {errors}")
    assert max(errors) <= BOUND, errors
