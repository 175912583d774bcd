"""The end-of-run summary's commands name absolute paths: they work from any folder."""

import shlex
from pathlib import Path

from hybridpar.train.summary import summarise


def test_the_summary_commands_name_absolute_paths_whatever_the_run_was_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _, done = summarise(run_dir=Path("run"), steps=(1, 2), skipped=0, tokens=64.0, wall_seconds=1.0,
                        train_seconds=1.0, eval_seconds=0.0, mfu=0.0, peak_memory_gb=0.0, train_loss=1.0,
                        validation=None, checkpoint=Path("run/checkpoints/step-00000002"),
                        tokenizer=Path("tok/tokenizer.model"), config_path=Path("run/config.toml"), train_steps=2)
    argv = {label: shlex.split(command.split("   ")[0]) for label, command in done["commands"].items()}
    assert argv["export to HF"][2:4] == [str(tmp_path / "run/checkpoints/step-00000002"), str(tmp_path / "run/hf")]
    assert argv["export to HF"][-1] == argv["generate"][-3] == str(tmp_path / "tok/tokenizer.model")
    assert str(tmp_path / "run/config.toml") in argv["resume"]
    assert done["run_dir"] == str(tmp_path / "run") and done["checkpoint"] == argv["generate"][3]


def test_a_run_the_data_stopped_is_resumed_with_what_to_change(tmp_path, monkeypatch):
    """After data.on_exhausted = "stop", more steps alone would stop again at once: the resume
    command repeats the data instead; after a damaged store it needs the store, not more steps."""
    from hybridpar.cli import build_parser
    from hybridpar.config import load_config

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    resume = {}
    for stop in ("", "exhausted", "damaged"):
        _, done = summarise(run_dir=Path("run"), steps=(1, 9), skipped=0, tokens=64.0, wall_seconds=1.0,
                            train_seconds=1.0, eval_seconds=0.0, mfu=0.0, peak_memory_gb=0.0, train_loss=1.0,
                            validation=None, checkpoint=Path("run/checkpoints/step-00000009"), tokenizer=None,
                            config_path=Path("run/config.toml"), train_steps=20, data_stop=stop)
        assert done["data_stop"] == (stop or None)
        argv = shlex.split(done["commands"]["resume"].split("   ")[0])
        args, overrides = build_parser().parse_known_args(argv[argv.index("train"):])
        load_config(None, overrides)  # hybridpar takes it: every override a config key with a valid value
        resume[stop] = argv
    assert resume[""][-2:] == ["--train.steps", "40"]
    assert resume["exhausted"][-2:] == ["--data.on_exhausted", "repeat"] and "--train.steps" not in resume["exhausted"]
    assert resume["damaged"][-2:] == ["--checkpoint.resume", "true"]
