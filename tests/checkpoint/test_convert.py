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


@pytest.mark.slow
@pytest.mark.parametrize("load_mp", [1, 4])
def test_round_trip_through_meta_keeps_the_logits(workers, check_close, trained, load_mp):
    check_close(f"dcp->meta->dcp at mp{load_mp}", workers(4).run(_case_round_trip, str(trained), load_mp), 1e-5)
    assert sorted(p.name for p in (trained / f"meta{load_mp}").iterdir()) == [
        "consolidated.00.pth", "consolidated.01.pth", "params.json", "tokenizer.model"]  # the run's tokenizer


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


def _case_to_meta(root: str) -> None:
    from hybridpar.checkpoint.convert import convert
    from tests.distributed import parallel_dims

    convert(Path(root) / "ckpt", Path(root) / "meta-init", "meta", parallel_dims(mp=1), mp_out=2)


def test_training_starts_from_meta_weights(workers, check_close, trained, corpus, tmp_path):
    meta = trained / "meta-init"  # its own Meta folder: the test runs alone or in any order
    if not meta.exists():
        workers(1).run(_case_to_meta, str(trained))
    config = make_config(corpus, tmp_path, mp=2, dp_shard=-1, dp_replicate=2, strategy="hybrid_shard", dp=2,
                         steps=2, **{"checkpoint.init_from": str(meta)})
    check_close("init_from meta", workers(4).run(_case_init_from, config, str(trained / "ckpt")), 0.0)


@pytest.mark.slow
def test_convert_and_generate_commands(trained, corpus, tmp_path):
    """The CLI as a user runs it, a world of one: convert to Meta at MP 2, generate from it."""
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    run = lambda *argv: subprocess.run([sys.executable, "-m", "hybridpar", *argv], cwd=ROOT, env=env,  # noqa: E731
                                       capture_output=True, text=True, timeout=300)
    out = run("convert", str(trained / "ckpt"), str(tmp_path / "meta"), "--to", "meta", "--meta-files", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"wrote {tmp_path / 'meta'} (meta)" in out.stdout
    tokenizer = next(Path(corpus["cache_dir"]).glob("tokenizer-*.model"))
    out = run("generate", "--checkpoint", str(tmp_path / "meta"), "--tokenizer", str(tokenizer),
              "--prompt", "Return the", "--max-new-tokens", "8")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("Return the\n> ")
    out = run("convert", str(tmp_path / "nothing"), str(tmp_path / "x"), "--to", "hf")
    assert out.returncode == 2 and "does not exist" in out.stderr


@pytest.mark.parametrize("to,options,message", [
    ("hf", {"mp_out": 2}, "--meta-files applies to --to meta only"),
    ("dcp", {"bos_id": 1}, "--bos-id / --eos-id apply to --to hf only"),
    ("meta", {"max_seq_len": 4096}, "--max-seq-len applies to --to hf and dcp only"),
    ("hf", {"max_seq_len": 0}, "--max-seq-len must be a positive number"),
    ("dcp", {"tokenizer": "tok"}, "--tokenizer applies to --to hf and meta only"),
    ("hf", {"tokenizer": "tok", "bos_id": 1}, "without --bos-id / --eos-id"),
    ("meta", {"dtype": torch.float32}, "--dtype / --max-shard-size apply to --to hf only"),
    ("hf", {"max_shard_size": "5XB"}, "--max-shard-size 5XB: not a size; write a byte count"),
])
def test_option_mistakes_are_refused_before_loading(tmp_path, to, options, message):
    from hybridpar.checkpoint.convert import convert

    # A missing source: loading first would fail with "does not exist" instead (no process group needed).
    with pytest.raises(ValueError, match=message):
        convert(tmp_path / "nothing", tmp_path / "out", to, None, **options)


def _case_convert_options(root: str) -> tuple:
    """From a Meta folder: hf with given token ids and context length; dcp into an occupied folder,
    then into an empty one, then over the occupied one with overwrite."""
    from hybridpar.checkpoint.convert import convert
    from hybridpar.checkpoint.dcp import CheckpointError
    from hybridpar.checkpoint.meta import save_meta_checkpoint
    from hybridpar.models.args import ModelArgs
    from hybridpar.models.llama import Transformer
    from tests.distributed import parallel_dims

    root = Path(root)
    parallel = parallel_dims(mp=2)
    save_meta_checkpoint(Transformer(ModelArgs.from_preset("debug"), parallel), root / "meta", parallel, 2)
    convert(root / "meta", root / "hf", "hf", parallel, bos_id=5, eos_id=6, max_seq_len=96)
    try:
        convert(root / "meta", root / "occupied", "dcp", parallel)
        refused = None
    except CheckpointError as err:
        refused = str(err)
    written = str(convert(root / "meta", root / "empty", "dcp", parallel, max_seq_len=96))
    return refused, written, str(convert(root / "meta", root / "occupied", "dcp", parallel, overwrite=True))


def test_convert_options_reach_the_output_and_dcp_refuses_an_occupied_folder(workers, tmp_path):
    import json

    (tmp_path / "occupied" / "step-00000000").mkdir(parents=True)
    (tmp_path / "occupied" / "step-00000000" / "mine.txt").write_text("keep")
    (tmp_path / "empty").mkdir()
    results = workers(4).run(_case_convert_options, str(tmp_path))
    assert all(r == results[0] for r in results), results
    refused, written, replaced = results[0]
    assert refused == (f"{tmp_path / 'occupied'} already exists and is not an empty folder: choose a new folder, "
                       "or replace it with --overwrite (overwrite=True from Python)")
    # Replaced whole: the old folder's file went with it, once the new checkpoint was complete.
    assert replaced == str(tmp_path / "occupied" / "step-00000000")
    assert not (tmp_path / "occupied" / "step-00000000" / "mine.txt").exists()
    assert (tmp_path / "occupied" / "step-00000000" / "params.json").is_file()
    assert not list(tmp_path.glob("*.partial")) and not list(tmp_path.glob(".occupied.*"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["max_position_embeddings"]) == (5, 6, 96)
    assert written == str(tmp_path / "empty" / "step-00000000")
    assert json.loads((tmp_path / "empty" / "step-00000000" / "params.json").read_text())["max_seq_len"] == 96


def test_commands_leave_the_process_group_they_made(tmp_path):
    """convert and generate destroy their process group, as train and doctor do, also when they fail."""
    nothing = str(tmp_path / "nothing")
    script = (
        "import torch.distributed as dist\n"
        "from hybridpar.cli import main\n"
        f"print(main(['convert', {nothing!r}, {nothing!r}, '--to', 'hf']), dist.is_initialized())\n"
        f"print(main(['generate', '--checkpoint', {nothing!r}, '--tokenizer', {nothing!r}, '--prompt', 'a']),"
        " dist.is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n") == ["2 False", "2 False", ""], (out.stdout, out.stderr[-2000:])


@pytest.mark.slow
def test_an_export_of_a_run_carries_the_run_tokenizer(trained, tmp_path):
    """`convert CHECKPOINT DST --to hf` without --tokenizer writes the tokenizer the run recorded in
    the checkpoint: transformers' AutoTokenizer loads the export and encodes as hybridpar does."""
    import json

    from transformers import AutoTokenizer

    from hybridpar.data.tokenizer import Tokenizer

    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "hybridpar", "convert", str(trained / "ckpt"), str(tmp_path / "hf"),
                          "--to", "hf"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    newest = sorted((trained / "ckpt").glob("step-*"))[-1]
    recorded = json.loads((newest / "train_state.json").read_text())["tokenizer"]
    assert f"tokenizer: {recorded['path']}, the run's" in out.stderr, out.stderr
    ours = Tokenizer(recorded["path"])
    theirs = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n"
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode_batch([text])[0]
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_id, ours.eos_id)


def test_an_export_says_when_the_run_tokenizer_is_gone(tmp_path, capsys):
    import json

    from hybridpar.checkpoint.convert import run_tokenizer

    step = tmp_path / "ckpt" / "step-00000003"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (step / "params.json").write_text("{}")
    (step / "train_state.json").write_text(json.dumps({"step": 3, "tokenizer": {"path": str(tmp_path / "tok.model"),
                                                                                 "sha256": "ab" * 32}}))
    assert run_tokenizer(tmp_path / "ckpt") is None
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{tmp_path / 'tok.model'} is gone" in err and "give --tokenizer" in err, err
    (tmp_path / "tok.model").write_text("not the one")
    assert run_tokenizer(step) is None
    assert "now holds another tokenizer" in capsys.readouterr().err


def _case_run_to_meta(root: str, tokenizer: str) -> dict:
    """A model saved as a run saves it (recording the run's tokenizer), exported to Meta's format in 2
    files without naming a tokenizer; Meta's code (tests.checkpoint.meta_reference) builds from the
    folder the logits of the model saved."""
    from hybridpar.checkpoint.convert import convert
    from hybridpar.checkpoint.dcp import Checkpointer, params_dict
    from hybridpar.data import Tokenizer
    from hybridpar.models.args import ModelArgs
    from hybridpar.models.llama import Transformer
    from hybridpar.parallel.fairscale import use_mesh
    from tests.checkpoint import meta_reference
    from tests.distributed import parallel_dims

    tok, root = Tokenizer(tokenizer), Path(root)
    args = ModelArgs.from_preset("debug", vocab_size=tok.vocab_size)
    parallel = parallel_dims(mp=2)
    torch.manual_seed(0)
    model = Transformer(args, parallel)
    recorded = {"tokenizer": {"path": str(tok.path), "sha256": tok.sha256}}
    Checkpointer(root / "ckpt", parallel).save(3, model, None, recorded, params_dict(args))
    convert(root / "ckpt", root / "meta", "meta", parallel, mp_out=2)
    tokens = torch.randint(0, tok.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(tokens, gather_logits=True)
        with use_mesh(parallel):
            theirs = meta_reference.build(root / "meta", llama_version=3, vocab_size=args.vocab_size)(tokens)
    return {"Meta's code on the export vs the model saved": rel_err(theirs, ours)}


def test_a_meta_export_of_a_run_carries_the_run_tokenizer_where_meta_keeps_it(workers, check_close, tmp_path):
    """`convert CHECKPOINT DST --to meta` writes the tokenizer the run recorded as DST/tokenizer.model, as
    Meta's releases ship it: `hybridpar eval` of the folder finds it there (no --tokenizer), and Meta's
    code still loads the folder."""
    from hybridpar.data import default_corpus_documents, train_tokenizer
    from hybridpar.evaluate.loading import checkpoint_tokenizer

    tokenizer = train_tokenizer(list(default_corpus_documents(max_documents=100)), 600, tmp_path / "run.model")
    check_close("meta export", workers(2).run(_case_run_to_meta, str(tmp_path), str(tokenizer.path)), 1e-5)
    meta = tmp_path / "meta"
    assert sorted(p.name for p in meta.iterdir()) == ["consolidated.00.pth", "consolidated.01.pth", "params.json",
                                                      "tokenizer.model"]
    assert (meta / "tokenizer.model").read_bytes() == tokenizer.path.read_bytes()
    assert checkpoint_tokenizer(meta) == meta / "tokenizer.model"
