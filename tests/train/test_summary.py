"""The end-of-run summary: its commands name absolute paths and continue the same run, and each
row's reason is the run's own (issue 48: a resume row that doubled train.steps after a stop, and
reasons that were the same text whatever happened)."""

import json
import shlex
from pathlib import Path

import pytest

from hybridpar.cli import build_parser
from hybridpar.config import ConfigError, load_config
from hybridpar.train.summary import summarise


@pytest.fixture(autouse=True)
def _plain_launch(tmp_path, monkeypatch):
    """The plain launch command, from tmp_path (the runs are named relative to it)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


def _summary(steps=(1, 9), checkpoint="run/checkpoints/step-00000009", config=None, **kwargs) -> tuple[str, dict]:
    config = config or load_config(None, ["--train.steps=20"])
    given = dict(run_dir=Path("run"), steps=steps, skipped=0, tokens=64.0, wall_seconds=1.0, train_seconds=1.0,
                 eval_seconds=0.0, mfu=0.0, peak_memory_gb=0.0, train_loss=1.0, validation=None,
                 checkpoint=Path(checkpoint) if checkpoint else None, tokenizer=None,
                 config_path=Path("run/config.toml"), config=config)
    return summarise(**{**given, **kwargs})


def _row(text: str, label: str) -> str:
    return next(line.split(label, 1)[1].strip() for line in text.splitlines() if line.strip().startswith(label))


def _resume(done: dict) -> tuple[list[str], str]:
    """The resume row's argv (checked to be a command hybridpar takes) and its note."""
    command, note = done["commands"]["resume"].split("   ")
    argv = shlex.split(command)
    args, overrides = build_parser().parse_known_args(argv[argv.index("train"):])
    load_config(None, overrides)  # every override a config key with a valid value
    return argv, note


def test_the_summary_commands_name_absolute_paths_whatever_the_run_was_given(tmp_path):
    _, done = _summary(steps=(1, 2), checkpoint="run/checkpoints/step-00000002",
                       tokenizer=Path("tok/tokenizer.model"), config=load_config(None, ["--train.steps=2"]))
    argv = {label: shlex.split(command.split("   ")[0]) for label, command in done["commands"].items()}
    assert argv["export to HF"][2:4] == [str(tmp_path / "run/checkpoints/step-00000002"), str(tmp_path / "run/hf")]
    assert argv["export to HF"][-1] == argv["generate"][-3] == str(tmp_path / "tok/tokenizer.model")
    assert str(tmp_path / "run/config.toml") in argv["resume"]
    assert done["run_dir"] == str(tmp_path / "run") and done["checkpoint"] == argv["generate"][3]


@pytest.mark.parametrize("stopped", ["SIGTERM", "SIGUSR1", "a straggler"])
def test_a_run_stopped_before_its_steps_is_resumed_as_the_same_run(stopped):
    """Stopped at step 9 of 20: the resume row is the same command, train.steps untouched (doubling
    it stretched the learning-rate schedule under the run's feet)."""
    text, done = _summary(stopped=stopped)
    argv, note = _resume(done)
    assert "--train.steps" not in argv and argv[-2:] == ["--checkpoint.resume", "true"]
    assert note == "(the same run: on to step 20 on the same learning-rate schedule)"
    assert done["stopped"] == stopped


def test_only_a_run_that_finished_its_steps_is_offered_more_and_told_the_schedule_changes():
    _, done = _summary(steps=(1, 20))
    argv, note = _resume(done)
    assert argv[-2:] == ["--train.steps", "40"]
    assert note.startswith("(to train on: any train.steps above 20;") and "learning-rate schedule" in note


def test_a_run_the_data_stopped_is_resumed_with_what_to_change():
    """After data.on_exhausted = "stop", the same steps would stop again at once: the resume command
    repeats the data instead; after a damaged store it needs the store, not more steps."""
    exhausted, _ = _resume(_summary(stopped="the data", data_stop="exhausted")[1])
    damaged, _ = _resume(_summary(stopped="the data", data_stop="damaged")[1])
    assert exhausted[-2:] == ["--data.on_exhausted", "repeat"] and "--train.steps" not in exhausted
    assert damaged[-2:] == ["--checkpoint.resume", "true"]


def test_a_run_stopped_before_step_1_says_so_not_the_checkpoint_keys():
    """A damaged store before step 1 with checkpoint.at_end = true: no step trained is the reason."""
    text, done = _summary(steps=(1, 0), checkpoint=None, stopped="the data", data_stop="damaged",
                          config=load_config(None, ["--checkpoint.at_end=true", "--data.val_fraction=0.05"]))
    assert _row(text, "checkpoint") == "none saved (no step trained: the token store is damaged)"
    assert _row(text, "final loss").endswith("validation - (no step trained: the token store is damaged)")
    assert "commands" not in done


@pytest.mark.parametrize("flags,reason", [
    ([], "checkpoint.at_end = false and no checkpoint.every"),
    (["--checkpoint.every=50"], "checkpoint.at_end = false, and steps 1-9 reached no multiple of checkpoint.every = 50"),
])
def test_no_checkpoint_names_the_keys_that_saved_none(flags, reason):
    text, _ = _summary(checkpoint=None, config=load_config(None, ["--checkpoint.at_end=false", *flags]))
    assert _row(text, "checkpoint") == f"none saved ({reason})"


def test_a_stop_before_the_first_validation_says_so_not_to_set_validation_data():
    config = load_config(None, ["--data.val_fraction=0.05", "--train.eval_every=50"])
    text, _ = _summary(stopped="SIGTERM", config=config)
    assert _row(text, "final loss").endswith(
        "validation - (stopped on SIGTERM after step 9, before this run's first validation (train.eval_every = 50))")


def test_no_validation_data_is_said_with_what_gives_some():
    from hybridpar.train.validation import missing_validation

    text, _ = _summary(no_validation=missing_validation(load_config(None, [])))
    assert _row(text, "final loss").endswith("validation - (set data.val_fraction (e.g. 0.05) or data.val_source)")


# --- advice on validation that the job takes ---------------------------------------------------


def test_under_a_v_schedule_the_advice_is_not_validation_data_which_would_be_refused():
    """The documented ZBV command (--data.val_fraction 0): setting validation data gets it refused."""
    from hybridpar.config import find_config
    from hybridpar.preflight import resolve_job
    from hybridpar.train.validation import missing_validation

    zbv = ["--parallel.mp=1", "--parallel.pp=2", "--parallel.pp_schedule=ZBVZeroBubble", "--parallel.pp_microbatches=2"]
    why = missing_validation(load_config(find_config("local"), [*zbv, "--data.val_fraction=0"]))
    assert why == ("parallel.pp_schedule = ZBVZeroBubble cannot validate: torch's V schedules run no forward-only "
                   "pass (1F1B and Interleaved1F1B can)")
    with pytest.raises(ConfigError, match="cannot run the validation forward"):  # what the old advice led to
        resolve_job(load_config(find_config("local"), [*zbv, "--data.val_fraction=0.05"]), 4)


def test_with_a_token_store_the_advice_is_the_split_it_was_prepared_with(tmp_path):
    """A store prepared with --val-fraction 0.1 takes data.val_fraction = 0.1 only; one prepared without
    a split takes none: set data.val_source."""
    from hybridpar.data import default_corpus_documents, train_tokenizer
    from hybridpar.data.store.token_store import given_store
    from hybridpar.data.store.prepare import prepare_store
    from hybridpar.train.validation import missing_validation

    docs = list(default_corpus_documents(max_documents=300))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokenizer = train_tokenizer(docs, 600, tmp_path / "tokenizer.model")
    for name, fraction in (("split", 0.1), ("whole", 0.0)):
        prepare_store(str(tmp_path / "docs.jsonl"), tokenizer, tmp_path / name, val_fraction=fraction, workers=1,
                      report=False)

    split = missing_validation(load_config(None, [f"--data.source={tmp_path / 'split'}"]))
    assert split == "set data.val_fraction = 0.1, the token store's split, or data.val_source"
    assert given_store(tmp_path / "split", tokenizer, 0.1)[1] is not None  # the advice, taken
    whole = missing_validation(load_config(None, [f"--data.source={tmp_path / 'whole'}"]))
    assert whole == f"the token store {tmp_path / 'whole'} was prepared without a validation split: set data.val_source"
    with pytest.raises(ValueError, match="prepared without a validation split"):  # what "set data.val_fraction" led to
        given_store(tmp_path / "whole", tokenizer, 0.05)


def test_a_replica_group_says_the_steps_it_trained_its_heal_and_the_steps_with_fewer_groups(tmp_path):
    """A group restarted at step 10 and healed to its peers' step 26 trained steps 27-40 in this start,
    not 1-40; its checkpoints are the job's, and the resume command names the job's run folder."""
    config = load_config(None, ["--train.steps=40"])
    config.fault_tolerance.enabled, config.fault_tolerance.groups, config.fault_tolerance.group = True, 2, 1
    report = {"group": 1, "groups": 2, "steps_with_fewer_groups": 0, "fewer_groups": [],
              "heals": [{"step": 26, "from_step": 10, "seconds": 0.5}], "windows": [40, 22]}
    text, done = _summary(steps=(27, 40), ranges=[(27, 40)], replica_groups=report, config=config,
                          run_dir=Path("run/group-1"), config_path=Path("run/group-1/config.toml"))
    assert _row(text, "wall time").endswith("; steps 27-40") and done["first_step"] == 27
    assert _row(text, "replica groups") == ("group 1 of 2; healed from a live group at step 26 (this start was at "
                                            "step 10) in 0.5 s")
    assert "steps committed with fewer groups: none that this group saw" in text
    assert done["replica_groups"] == report
    assert _row(text, "checkpoint").endswith("(the job's newest; the first group of each step's quorum writes them)")
    argv, note = _resume(done)
    assert argv[argv.index("--output.run_dir") + 1] == str(tmp_path / "run") and "--fault_tolerance.group" in note
    # A group healed mid-run without a restart: both runs of steps.
    text, _ = _summary(steps=(1, 40), ranges=[(1, 8), (27, 40)], config=config)
    assert _row(text, "wall time").endswith("; steps 1-8, 27-40")
