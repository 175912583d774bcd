"""The data guard catches the two classic data-parallel mistakes at step 1 (and every data_guard_every steps
after) and lets a correct setup pass."""

import pytest

from hybridpar.diagnostics.data_guard import find_problems
from tests.runs import make_config

# --- the rules on hand-made tables (world 8 = dp_replicate 2 x dp_shard 2 x mp 2) ----------------


def test_correct_table_passes():
    # mp groups [0,1] [2,3] [4,5] [6,7] share a batch; the four dp ranks differ.
    assert find_problems([10, 10, 11, 11, 12, 12, 13, 13], 1, 2, 2, 1, 2) == []


def test_global_rank_sampler_splits_model_parallel_groups():
    problems = find_problems([10, 11, 12, 13, 14, 15, 16, 17], 1, 2, 2, 1, 2)
    assert len(problems) == 1
    assert "model-parallel group got different batches: [0, 1], [2, 3], [4, 5], [6, 7]" in problems[0]
    assert "sampler was built with the global rank" in problems[0]


def test_identical_batches_everywhere_is_no_data_parallelism():
    problems = find_problems([7] * 8, 1, 2, 2, 1, 2)
    assert len(problems) == 1
    assert "dp ranks [0, 1, 2, 3] (global ranks [0, 2, 4, 6]" in problems[0]
    assert "every data-parallel rank reads the same data: no DistributedSampler" in problems[0]


def test_some_duplicated_dp_ranks_are_named():
    problems = find_problems([1, 1, 2, 2, 1, 1, 3, 3], 1, 2, 2, 1, 2)
    assert len(problems) == 1 and "dp ranks [0, 2] (global ranks [0, 4]" in problems[0]


# World 8 = dp_shard 2 x cp 2 x mp 2: a dp coordinate is a cp x mp block of 4 ranks that read the
# same sequences (each cp rank takes its chunks after the fingerprint); the two blocks differ.


def test_with_cp_the_cp_peers_share_a_batch_and_the_dp_ranks_differ():
    assert find_problems([10, 10, 10, 10, 11, 11, 11, 11], 1, 1, 2, 2, 2) == []


def test_with_cp_a_cp_rank_reading_other_sequences_is_caught():
    problems = find_problems([10, 10, 12, 12, 11, 11, 11, 11], 1, 1, 2, 2, 2)
    assert len(problems) == 1
    assert "data-parallel coordinate (its mp, cp and pp peers) got different batches: [0, 1, 2, 3]" in problems[0]


def test_with_cp_identical_dp_ranks_are_named_by_their_blocks():
    problems = find_problems([7] * 8, 1, 1, 2, 2, 2)
    assert len(problems) == 1 and "dp ranks [0, 1] (global ranks [0, 4]" in problems[0]


# World 8 = pp 2 x dp_shard 2 x mp 2: stage 0 is ranks 0-3, stage 1 ranks 4-7; the stages of a dp
# coordinate (ranks 0, 1, 4, 5 and 2, 3, 6, 7) read the same batch: the first needs the tokens, the last the targets.


def test_with_pp_the_stages_of_a_dp_coordinate_share_a_batch():
    assert find_problems([10, 10, 11, 11, 10, 10, 11, 11], 2, 1, 2, 1, 2) == []


def test_with_pp_a_stage_reading_another_batch_is_caught():
    # A sampler built with the global rank: stage 1 reads other batches than stage 0.
    problems = find_problems([10, 10, 11, 11, 12, 12, 13, 13], 2, 1, 2, 1, 2)
    assert len(problems) == 1
    assert "(its mp, cp and pp peers) got different batches: [0, 1, 4, 5], [2, 3, 6, 7]" in problems[0]
    problems = find_problems([7] * 8, 2, 1, 2, 1, 2)
    assert len(problems) == 1 and "dp ranks [0, 1] (global ranks [0, 2]" in problems[0]


# --- in training, on 4 processes (mp 2 x dp 2) -------------------------------------------------


def _case_first_step(config, mistake):
    import torch.distributed as dist

    from hybridpar.data import build_dataloader
    from hybridpar.diagnostics.data_guard import DataGuardError
    from hybridpar.train import Trainer

    trainer = Trainer(config)
    common = dict(micro_batch_size=config.data.micro_batch_size, seed=0)
    if mistake == "global rank":  # the classic: torch's sampler given dist.get_rank() / world size
        trainer.loader = build_dataloader(trainer.loader.sources[0].dataset, dp_rank=dist.get_rank(), dp_size=dist.get_world_size(), **common)
    elif mistake == "no sampler":  # every rank reads the whole dataset in the same order
        trainer.loader = build_dataloader(trainer.loader.sources[0].dataset, dp_rank=0, dp_size=1, **common)
    try:
        trainer.train_step()  # step 1: the guard runs here
    except DataGuardError as err:
        return {"error": str(err)}
    later = [trainer.train_step()["step_time"] for _ in range(2)]  # steady state, no guard
    return {"guard_s": _median_guard_seconds(trainer), "step_s": min(later)}


def _median_guard_seconds(trainer, repeats=9):
    """The guard's own cost: hashing one step's batch + one all-gather, timed after a barrier so
    waiting for slower ranks (skew the next collective would absorb anyway) is not counted."""
    import statistics
    import time

    import torch.distributed as dist

    from hybridpar.diagnostics.data_guard import batch_fingerprint, check_data

    batch = next(trainer.loader)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        check_data(batch_fingerprint(*batch), trainer.parallel, trainer.step)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@pytest.mark.parametrize(
    "mistake,expected",
    [("global rank", "model-parallel group got different batches: [0, 1], [2, 3]"),
     ("no sampler", "every data-parallel rank reads the same data")],
)
def test_mistakes_are_caught_at_step_1(workers, corpus, tmp_path, mistake, expected):
    config = make_config(corpus, tmp_path, mp=2, dp_shard=2, dp=2)
    results = workers(4).run(_case_first_step, config, mistake)
    print(f"\n{mistake}: {results[0]['error']}")
    assert all(r["error"].startswith("data guard, step 1: ") and expected in r["error"] for r in results)


class _SameBatchFrom:
    """The trainer's loader until `step` (one micro-batch per step), then the same batch on every
    rank: a sampler that breaks after the first step's check."""

    def __init__(self, loader, step: int) -> None:
        self.loader, self.step, self.calls = loader, step, 0

    def __next__(self):
        import torch

        inputs, targets = next(self.loader)
        self.calls += 1
        if self.calls < self.step:
            return inputs, targets
        return torch.full_like(inputs, 5), torch.full_like(targets, 5)

    def __getattr__(self, name):  # state_dict, load_state_dict, ...
        return getattr(self.loader, name)


def _case_broken_later(config, step):
    from hybridpar.diagnostics.data_guard import DataGuardError
    from hybridpar.train import Trainer

    trainer = Trainer(config)
    trainer.loader = _SameBatchFrom(trainer.loader, step)
    try:
        trainer.run()
    except DataGuardError as err:
        return {"error": str(err), "step": trainer.step}
    return {"step": trainer.step}


@pytest.mark.parametrize("every", [2, 0])
def test_data_guard_every_catches_a_sampler_broken_after_step_1(workers, corpus, tmp_path, every):
    """From step 3 on every data-parallel rank reads the same batch. diagnostics.data_guard_every 2
    checks step 4 and stops the run there, on every rank; 0 (step 1 only) lets it train on."""
    config = make_config(corpus, tmp_path, mp=2, dp_shard=2, dp=2, steps=5,
                         **{"diagnostics.data_guard_every": every})
    results = workers(4).run(_case_broken_later, config, 3)
    if every:
        print(f"\n{results[0].get('error')}")
        assert all(r.get("error", "").startswith("data guard, step 4: ") and r["step"] == 3 for r in results), results
        assert all("every data-parallel rank reads the same data" in r["error"] for r in results)
    else:
        assert all(r == {"step": 5} for r in results), results


@pytest.mark.slow
def test_correct_setup_passes_and_the_guard_is_cheap(workers, corpus, tmp_path):
    config = make_config(corpus, tmp_path, mp=2, dp_shard=2, dp=2, **{"model.preset": "tiny", "model.vocab_size": 0,
                                                                      "data.seq_len": 128})
    results = workers(4).run(_case_first_step, config, None)
    assert all("error" not in r for r in results)
    cost = max(r["guard_s"] for r in results)
    step = min(r["step_s"] for r in results)
    print(f"\ndata guard: {cost * 1e3:.2f} ms = {100 * cost / step:.2f}% of a {step * 1e3:.0f} ms step")
    # Typically 0.2-1% here; the bound only catches a guard that grew into real work (hashing weights,
    # a collective per tensor), not timing noise of 4 ranks on 2 shared cores.
    assert cost < 0.1 * step
