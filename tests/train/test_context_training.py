"""Training with context parallelism against single-process math: the same global batch and steps at
cp 2 (world 2), cp 2 x mp 2 with sequence parallelism, cp 2 x dp 2 and cp 4 (world 4) give every
step's loss and gradient norm, the final parameters and the validation loss of the run at world 1."""

import pytest
import torch

from tests.distributed import rel_err
from tests.runs import make_config

BOUND = 1e-5
# Long enough for cp 4 x ... to cut (seq % (2 cp [x mp]) == 0); validation once, after the last step.
COMMON = {"data.seq_len": 64, "data.val_fraction": 0.1, "train.eval_every": 5}


def _case_train(config):
    import torch.distributed as dist

    from hybridpar.parallel.state import full_state_dict
    from hybridpar.train import Trainer

    trainer = Trainer(config)
    history = trainer.run()
    params = full_state_dict(trainer.model)
    return {"history": history, "params": params, "validation": trainer.validation} if dist.get_rank() == 0 \
        else None


@pytest.fixture(scope="module")
def reference(workers, corpus, tmp_path_factory):
    return workers(1).run(_case_train, make_config(corpus, tmp_path_factory.mktemp("ref"), **COMMON))[0]


LAYOUTS = {
    # name: (world, make_config keyword arguments)
    "cp2": (2, dict(**{"parallel.cp": 2})),
    "cp2-mp2-sequence_parallel": (4, dict(mp=2, strategy="hybrid_shard", **{"parallel.cp": 2})),
    "cp2-dp2": (4, dict(dp_shard=2, dp=2, **{"parallel.cp": 2})),
    "cp4": (4, dict(**{"parallel.cp": 4})),
    # Compiled blocks (the K/V all-gather traced) and activation checkpointing over them.
    "cp2-compile-ac_full": (2, dict(**{"parallel.cp": 2, "train.compile": True,
                                       "fsdp.activation_checkpointing": "full"})),
}


def _errors(result, reference) -> dict:
    ref_hist, hist = reference["history"], result["history"]
    assert len(hist) == len(ref_hist) == 5
    assert [m["tokens"] for m in hist] == [m["tokens"] for m in ref_hist]  # the global batch's targets
    errors = {}
    for a, b in zip(hist, ref_hist):
        errors[f"loss step {a['step']}"] = rel_err(torch.tensor(a["loss"]), torch.tensor(b["loss"]))
        errors[f"grad_norm step {a['step']}"] = rel_err(torch.tensor(a["grad_norm"]), torch.tensor(b["grad_norm"]))
    errors["val_loss"] = rel_err(torch.tensor(result["validation"]["val_loss"]),
                                 torch.tensor(reference["validation"]["val_loss"]))
    assert result["validation"]["val_tokens"] == reference["validation"]["val_tokens"]
    for name, value in reference["params"].items():
        errors[f"param {name}"] = rel_err(result["params"][name], value)
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_training_matches_single_process(workers, check_close, corpus, reference, tmp_path, layout):
    world, kwargs = LAYOUTS[layout]
    result = workers(world).run(_case_train, make_config(corpus, tmp_path, **{**COMMON, **kwargs}))[0]
    print(f"\n{layout} loss curve: {[round(m['loss'], 6) for m in result['history']]}")
    print(f"{'world-1':>{len(layout)}} loss curve: {[round(m['loss'], 6) for m in reference['history']]}")
    assert reference["history"][0]["grad_norm"] > 0.5, "clipping must be active for the norm comparison to mean something"
    check_close(f"train {layout}", _errors(result, reference), BOUND)
