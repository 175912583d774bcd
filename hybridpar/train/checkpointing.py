"""The trainer's checkpointing: resume from the newest intact checkpoint (or start from
checkpoint.init_from's weights), save, and say what each save wrote (events.jsonl).

    checkpoints = Checkpoints(config, parallel, job, supervisor, model=runner.modules, optimizer=optimizer,
                              args=args, parts={"scheduler": scheduler, "data": loader}, tokenizer=tokenizer)
    step = checkpoints.restore()        # 0, or the step the newest intact checkpoint holds
    checkpoints.prepare_staging()       # after restore and each step: a GPU's async saves' host copy, made early
    checkpoints.save(step, metrics)     # the path written (an async save: its writes complete later)
    checkpoints.close(metrics)          # the last writes completed and reported

`parts` are the objects whose state_dict() goes into train_state.json under their names (and back
into load_state_dict() on resume): the learning-rate schedule and the loader's position. A part
with a true `optional_state` keeps its own state when the checkpoint has none of it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch

from ..checkpoint.dcp import Checkpointer, complete_checkpoints, latest_checkpoint, params_dict, step_dir_name
from ..config import Config, ConfigError
from ..files import refuse_occupied
from ..mesh.device import ParallelDims


class Checkpoints:
    def __init__(self, config: Config, parallel: ParallelDims, job, supervisor, *, model: list[torch.nn.Module],
                 optimizer: torch.optim.Optimizer, args, parts: dict, tokenizer, writes=None) -> None:
        c = config.checkpoint
        self.settings, self.init_from, self.supervisor = c, job.init_from, supervisor
        self.model, self.optimizer, self.parts, self.tokenizer = model, optimizer, parts, tokenizer
        self.writes = writes  # whether this rank's group writes the job's checkpoints (None: it does)
        self.params = params_dict(args)
        self.checkpointer = Checkpointer(config.checkpoint_dir(), parallel, keep=c.keep, async_save=c.async_save)
        self.resumed_from: Optional[Path] = None  # the checkpoint restore() resumed from
        self.elsewhere: Optional[int] = None  # the last step this group left to another to save

    @property
    def folder(self) -> Path:
        return self.checkpointer.folder

    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint in the folder."""
        return latest_checkpoint(self.folder)

    def restore(self) -> int:
        """Resume from the newest complete checkpoint (damaged ones set aside), or take the weights of
        checkpoint.init_from (a hybridpar checkpoint: foreign ones were loaded into the model as it
        was built); the step to continue from."""
        if not self.settings.resume:
            # Its saves would mix with the old run's, and pruning by step could delete the new ones.
            refuse_occupied(self.folder, "checkpoint.resume is false; set checkpoint.resume = true to "
                            "continue that run, or give this run its own output.run_dir or checkpoint.folder",
                            error_type=ConfigError, listing=("checkpoints", complete_checkpoints))
        found = self.checkpointer.load_newest_intact(self.model, self.optimizer, self.params)
        if found is not None:
            self.resumed_from, state = found
            for name, part in self.parts.items():
                if name in state or not getattr(part, "optional_state", False):  # else: saved before it existed
                    part.load_state_dict(state[name])
            return state["step"]
        if self.settings.init_from and self.init_from is None:
            self.checkpointer.load(Path(self.settings.init_from), self.model, None, self.params)
        return 0

    def prepare_staging(self) -> None:
        """Before the first save: a GPU's async saves get their host copy made in the background
        (checkpoint.staging), once the optimizer has its state. Collective; cheap once begun."""
        self.checkpointer.prepare_staging(self.model, self.optimizer)

    def save(self, step: int, metrics) -> Path:
        """Checkpoint `step`; events.jsonl gets how long training waited for it (an async save: only
        the copy to host memory) and each completed save's size and write time. A replica group that
        does not write them (hybridpar.replicas) trains on: the newest checkpoint is returned."""
        if self.writes is not None and not self.writes():
            self.elsewhere = step
            return self.latest()
        train_state = {name: part.state_dict() for name, part in self.parts.items()}
        if getattr(self.tokenizer, "path", None):  # for `convert --to hf`, which writes it beside the weights
            train_state["tokenizer"] = {"path": str(Path(self.tokenizer.path).absolute()),
                                        "sha256": self.tokenizer.sha256}
        begun = time.perf_counter()
        with self.supervisor.checkpointing():  # a large checkpoint's writes are not a hang
            path = self.checkpointer.save(step, self.model, self.optimizer, train_state, self.params)
        # The first async save on a GPU also says how long it waited for its host copy, made in the background.
        metrics.event(step, "checkpoint", blocked_s=round(time.perf_counter() - begun, 3),
                      async_save=self.checkpointer.async_save, **self.checkpointer.last_staging)
        self.report_written(metrics)
        return path

    def save_if_new(self, step: int, metrics) -> Optional[Path]:
        """Checkpoint `step` unless no step was trained, it is the newest checkpoint already, or another
        replica group writes the checkpoints (a group stopped while it waited for a quorum): the path written."""
        newest = self.latest()
        if step == 0 or (newest is not None and newest.name == step_dir_name(step)) or (
                self.writes is not None and not self.writes()):
            return None
        return self.save(step, metrics)

    def report_written(self, metrics) -> None:
        """events.jsonl gets each completed save's size and write time (rank 0 completes them)."""
        for done in self.checkpointer.written:
            metrics.event(done["step"], "checkpoint_written", bytes=done["bytes"], seconds=done["seconds"])
        self.checkpointer.written.clear()

    def close(self, metrics) -> None:
        """The last save's writes completed (and reported). A replica group that left its last save to
        another waits for it a little (half of checkpoint.exit_save_timeout, 10 s at most), so that what
        it says at the end names it; then the newest complete one is the newest."""
        self.checkpointer.close()
        self.report_written(metrics)
        if self.elsewhere is not None:
            done = self.folder / step_dir_name(self.elsewhere) / "train_state.json"
            waited = time.monotonic()
            while not done.exists() and time.monotonic() - waited < min(10.0, self.settings.exit_save_timeout / 2):
                time.sleep(0.2)
