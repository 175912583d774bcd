"""Converting between hybridpar, Meta and Hugging Face checkpoints, and starting training from Meta weights."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import rel_err
from tests.runs import make_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained(workers, corpus, tmp_path_factory):
    """A hybridpar checkpoint of a few steps at mp 2 x dp 2 (the trained weights differ from the init)."""
    root = tmp_path_factory.mktemp("convert")
    config = make_config(corpus, root / "run", mp=2, dp_shard=2, strategy="full_shard", dp=2, steps=3,
                         **{"checkpoint.at_end": True, "checkpoint.folder": str(root / "ckpt")})
    workers(4).run(_case_train, config)
    return root


def _case_train(config):
    from hybridpar.train import Trainer

    Trainer(config).run()


def _case_round_trip(root: str, load_mp: int) -> dict:
    """dcp -> meta (MP 2) -> dcp, each step loaded at `load_mp`: the logits never change."""
    from hybridpar.checkpoint.convert import convert, load_model
    from tests.distributed import parallel_dims

    root = Path(root)
    parallel = parallel_dims(mp=load_mp)
    convert(root / "ckpt", root / f"meta{load_mp}", "meta", parallel, mp_out=2)
    convert(root / f"meta{load_mp}", root / f"dcp{load_mp}", "dcp", parallel)
    tokens = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))
    logits = {}
    for name in ("ckpt", f"meta{load_mp}", f"dcp{load_mp}"):
        model, _ = load_model(root / name, parallel)
        with torch.no_grad():
            logits[name] = model(tokens, gather_logits=True)
    return {name: rel_err(value, logits["ckpt"]) for name, value in logits.items() if name != "ckpt"}


@pytest.mark.parametrize("load_mp", [1, 4])
def test_round_trip_through_meta_keeps_the_logits(workers, check_close, trained, load_mp):
    check_close(f"dcp->meta->dcp at mp{load_mp}", workers(4).run(_case_round_trip, str(trained), load_mp), 1e-5)
    assert sorted(p.name for p in (trained / f"meta{load_mp}").iterdir()) == [
        "consolidated.00.pth", "consolidated.01.pth", "params.json"]


def _case_init_from(config, reference: str) -> dict:
    from hybridpar.checkpoint.convert import load_model
    from hybridpar.parallel.state import full_state_dict
    from hybridpar.train import Trainer
    from tests.distributed import parallel_dims

    trainer = Trainer(config)
    started = full_state_dict(trainer.model)
    expected = full_state_dict(load_model(Path(reference), parallel_dims(mp=1))[0])
    errors = {name: rel_err(started[name], value) for name, value in expected.items()}
    trainer.run()
    return errors


def test_training_starts_from_meta_weights(workers, check_close, trained, corpus, tmp_path):
    meta = trained / "meta1"
    if not meta.exists():
        pytest.skip("made by the round-trip test")
    config = make_config(corpus, tmp_path, mp=2, dp_shard=-1, dp_replicate=2, strategy="hybrid_shard", dp=2,
                         steps=2, **{"checkpoint.init_from": str(meta)})
    check_close("init_from meta", workers(4).run(_case_init_from, config, str(trained / "ckpt")), 0.0)


def test_convert_and_generate_commands(trained, corpus, tmp_path):
    """The CLI as a user runs it, a world of one: convert to Meta at MP 2, generate from it."""
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    run = lambda *argv: subprocess.run([sys.executable, "-m", "hybridpar", *argv], cwd=ROOT, env=env,  # noqa: E731
                                       capture_output=True, text=True, timeout=300)
    out = run("convert", str(trained / "ckpt"), str(tmp_path / "meta"), "--to", "meta", "--mp", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"wrote {tmp_path / 'meta'} (meta)" in out.stdout
    tokenizer = next(Path(corpus["cache_dir"]).glob("tokenizer-*.model"))
    out = run("generate", "--checkpoint", str(tmp_path / "meta"), "--tokenizer", str(tokenizer),
              "--prompt", "Return the", "--max-new-tokens", "8")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("Return the\n> ")
    out = run("convert", str(tmp_path / "nothing"), str(tmp_path / "x"), "--to", "hf")
    assert out.returncode == 2 and "does not exist" in out.stderr
