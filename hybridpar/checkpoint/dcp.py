"""Sharded training checkpoints on torch.distributed.checkpoint (DCP), saved atomically.

A checkpoint is a folder `step-00000100/` holding:
    .metadata, __*_*.distcp   model and optimizer state, each rank writing its own shards; DCP
                              records global shapes under the unsplit model's names, so it loads
                              into any (pp, dp_replicate, dp_shard, cp, mp): under pp a rank passes
                              its stage modules (checkpoint.stages) and reads only their tensors
    params.json               the model's shape (ModelArgs), checked before anything is loaded
    train_state.json          step, lr schedule, data position (a global sample offset)
    rng/rank{N}.pt            each rank's RNG state (restored when the world size matches)
    checksums.json            size and CRC-32C of every other file, summed as it was written
                              (checkpoint.checksums); loads check them (checkpoint.verify)

Every rank writes into `step-00000100.partial/`; once all have, rank 0 writes train_state.json and
renames the folder. A crash mid-save leaves the `.partial` folder, which resuming ignores and the
next save removes. Checkpoints beyond `keep` are renamed `*.deleting` (never listed again) and
removed by a background thread. A file system shared by the ranks is assumed, as DCP's storage does.
Resuming loads the newest intact checkpoint: one whose bytes are damaged is renamed `*.damaged` (kept,
never listed or deleted) and the one before it is loaded.

A full disk is said once, on every rank alike (CheckpointDiskFullError): before a save whose size
(space.checkpoint_bytes) exceeds the free space, nothing is written; a save that runs out of space
anyway has its `.partial` folder removed. Either way the previous checkpoint is intact.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from .. import fastpaths
from ..fastpaths.dcp_reader import FastFileSystemReader
from ..fastpaths.dcp_writer import UncheckedWriter
from ..fastpaths.optimizer_state import allocate_optimizer_state
from ..files import (STAGING_SUFFIX, DiskFullError, atomic_output, begin_staging, commit_staged, disk_full_message,
                     free_bytes, fsync_dir, human_bytes, staging_path, write_text_atomic)
from ..mesh.device import ParallelDims
from ..parallel.float8_gather import plain, plain_state_dict, precompute_float8_scales
from ..progress import note
from ..mesh.ranks import broadcast_from_rank0, gather_objects, on_rank0, raise_if_any_failed
from . import checksums
from ..safe_pickle import CheckpointReadError, SafeFileSystemReader
from .matching import check_checkpoint, refuse_incomplete_save
from .reader import CheckpointDamagedError, CheckpointError, SafeLoadPlanner
from .space import checkpoint_bytes, join_dcp_writers, no_space_reasons, remove_folder
from .staging import host_staging
from .stages import Stages, gather_names, one_module, own_empty_groups
from .verify import STEP_DIR, LoadCheck, share_load_failure

DELETING = ".deleting"
DAMAGED = ".damaged"  # a damaged checkpoint set aside; no listing or clean-up matches it


class CheckpointDiskFullError(CheckpointError, DiskFullError):
    """The checkpoint folder's file system has no room for a checkpoint: refused before the save,
    or a save that ran out of space (its partial folder removed). The previous checkpoint is intact."""

    every_rank = True  # raised alike on every rank: hybridpar.mesh.ranks.raised_by_every_rank


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def complete_checkpoints(folder: Path) -> list[Path]:
    """Finished checkpoints in `folder`, oldest first (partial ones are never listed)."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if STEP_DIR.match(p.name) and (p / "train_state.json").exists()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(folder: Path) -> Optional[Path]:
    found = complete_checkpoints(folder)
    return found[-1] if found else None


def past_keep(folder: Path, keep: int, final: Path) -> list[Path]:
    """The complete checkpoints that saving `final` deletes when `keep` are kept: the oldest by step
    number, never `final` itself (even if the folder holds later steps)."""
    found = complete_checkpoints(folder)
    if final not in found:  # before the save: where it will be listed
        found = sorted([*found, final], key=lambda p: int(STEP_DIR.match(p.name).group(1)))
    return [p for p in found[:-keep] if p != final]


class Checkpointer:
    """Save and load one run's checkpoints. Every method is collective: call it on every rank."""

    def __init__(self, folder: Path, parallel: ParallelDims, *, keep: int = 3, async_save: bool = False) -> None:
        if keep < 1:
            raise CheckpointError(f"checkpoint.keep must be >= 1, got {keep}")
        self.folder = Path(folder)
        self.parallel = parallel
        self.keep = keep
        self.async_save = async_save
        self._pending: Optional[tuple[Any, Path, dict]] = None
        self._deleter: Optional[threading.Thread] = None
        self.written: list[dict] = []  # rank 0: {"step", "bytes", "seconds"} of each save completed, for the run's events
        # Background writes run collectives of their own: give them a group apart from training's.
        self._async_group = dist.new_group(backend="gloo") if async_save else None
        # A GPU's saves stage into one pinned host copy, made in the background before the first
        # (prepare_staging) and reused (checkpoint.staging; docs/benchmarks.md).
        self.staging = host_staging(parallel.device) if async_save else None
        self.last_staging: dict = {}  # how long the last save waited for that copy, if it did

    def prepare_staging(self, model: Stages, optimizer: Optional[torch.optim.Optimizer]) -> bool:
        """Start making the host copy a GPU's async saves stage into, in a background thread, once the
        optimizer has its state (after a step or a load: torch's get_state_dict would otherwise make
        it by stepping the optimizer); whether it has started. Cheap once it has; collective."""
        if self.staging is None or self.staging.started:
            return self.staging is not None
        if optimizer is not None and not optimizer.state:
            return False
        self.staging.prepare(_state(one_module(model, optimizer), optimizer))
        return True

    # --- saving ------------------------------------------------------------------------------

    def save(self, step: int, model: Stages, optimizer: Optional[torch.optim.Optimizer],
             train_state: dict, params: dict) -> Path:
        """Write checkpoint `step` (async: start writing and return; it completes at the next save,
        `wait()`, or `close()`). `model`: the model, or under pp the list of this rank's stage
        modules (stages.one_module); the checkpoint holds the unsplit model's names either way."""
        self.wait()
        final = self.folder / step_dir_name(step)
        partial = staging_path(final)
        staged = isinstance(model, (list, tuple)) or getattr(self.parallel, "pp", 1) > 1  # (stubs have no pp)
        model = one_module(model, optimizer)
        state = _state(model, optimizer)
        if staged:  # each rank holds part of the model: the whole of it, and groups naming all of it
            refuse_incomplete_save(final, gather_names(state["model"], state.get("optimizer")), params)
        needed = checkpoint_bytes(state, self.parallel.world_size)

        def prepare() -> None:
            self.folder.mkdir(parents=True, exist_ok=True)
            # Retention: what a crash left of other saves (never trusted), interrupted deletions, and
            # old copies parked by a replace (files.replace_folder) that did not finish.
            for stale in [*self.folder.glob("step-*" + STAGING_SUFFIX), *self.folder.glob("*" + DELETING),
                          *self.folder.glob(".step-*.old")]:
                shutil.rmtree(stale, ignore_errors=True)
            refusal = self._no_room_for(final, needed)  # after the clean-up, which frees space
            if refusal is None:
                (begin_staging(final) / "rng").mkdir()
            return refusal

        refusal = on_rank0(prepare, f"prepare {partial}", error_type=CheckpointError)
        if refusal is not None:  # every rank raises it alike
            raise CheckpointDiskFullError(refusal)
        meta = {"train_state": {**train_state, "step": step, "world_size": self.parallel.world_size},
                "params": params, "needed": needed, "begun": time.perf_counter()}

        def write() -> None:
            error = None
            try:
                with atomic_output(partial / "rng" / f"rank{self.parallel.rank}.pt") as f:  # fsynced, as DCP's are
                    torch.save(torch.get_rng_state(), f)
            except Exception as err:  # noqa: BLE001 - shared below, so every rank fails alike
                error = err
            raise_if_any_failed(error, f"write {partial}", error_type=CheckpointError)
            writer = self._writer(partial)
            if self.async_save:
                stager = self.staging.ready(state) if self.staging is not None else None
                self.last_staging = self.staging.figures if self.staging is not None else {}
                future = dcp.async_save(state, storage_writer=writer, process_group=self._async_group,
                                        async_stager=stager)
                future.add_done_callback(lambda _: meta.setdefault("written_at", time.perf_counter()))
                self._pending = (future, partial, meta, writer)
            else:
                dcp.save(state, storage_writer=writer)
                self._finish(partial, meta, writer)

        self._said_if_full(partial, needed, write)
        return final

    @staticmethod
    def _writer(folder: Path) -> dcp.FileSystemWriter:
        # Two writer threads per rank: one file is serialised while another is flushed.
        writer = UncheckedWriter if fastpaths.enabled() else dcp.FileSystemWriter
        return checksums.summing(writer(str(folder), thread_count=2))

    def wait(self) -> None:
        """Complete a pending asynchronous save and the deletion of old checkpoints."""
        if self._pending is not None:
            future, partial, meta, writer = self._pending
            self._pending = None

            def complete() -> None:
                future.result()
                self._finish(partial, meta, writer)

            self._said_if_full(partial, meta["needed"], complete)
        self._join_deleter()

    # --- a full disk ---------------------------------------------------------------------------

    def _no_room_for(self, final: Path, needed: int) -> Optional[str]:
        """Rank 0, before anything of the save is written: why it is refused, if the folder has less room than it takes."""
        free = free_bytes(self.folder)
        return self._no_room(final, "not saved: nothing was written", needed, free) if free < needed else None

    def _no_room(self, final: Path, what: str, needed: int, free: int) -> str:
        """The one wording of a checkpoint without room: what happened, needed/free, the previous
        checkpoint, the checkpoints `keep` deletes after this save, and what to change."""
        done = [p for p in complete_checkpoints(self.folder) if p != final]
        intact = f"; {done[-1].name} is intact" if done else ""
        doomed = [p.name for p in past_keep(self.folder, self.keep, final)]
        deletes = (f"checkpoint.keep = {self.keep} deletes {', '.join(doomed)} after this save (removing them by "
                   "hand now frees their space); or " if doomed else "")
        advice = f"{deletes}free space there, lower checkpoint.keep, or point checkpoint.folder elsewhere"
        return disk_full_message(self.folder, f"checkpoint {final.name} {what}{intact}", needed=needed, free=free,
                                 advice=advice)

    def _said_if_full(self, partial: Path, needed: int, writes: Callable[[], None]) -> None:
        """Run a save's writes (collective: every failure in them reaches every rank). When a rank ran out
        of space, rank 0 removes the partial folder once every rank has stopped writing, and every rank
        raises the same CheckpointDiskFullError; any other failure is re-raised as it was."""
        try:
            writes()
        except (Exception, CheckpointException) as err:  # DCP's is a BaseException
            join_dcp_writers()  # DCP leaves its other writer threads running when one fails
            reasons = no_space_reasons(err)  # none after a lost peer: re-raised as it is
            if not reasons:
                raise
            final = partial.with_name(partial.name[: -len(STAGING_SUFFIX)])

            def discard() -> str:
                remove_folder(partial)
                what = f"not saved: writing it ran out of space ({reasons[0]}), the partial folder was removed"
                return self._no_room(final, what, needed, free_bytes(self.folder))

            raise CheckpointDiskFullError(on_rank0(discard, f"remove {partial}", error_type=CheckpointError)) from err

    def _finish(self, partial: Path, meta: dict, writer: dcp.FileSystemWriter) -> None:
        # The gather waits for every rank: all shards are on disk, and their checksums reach rank 0.
        summed = {name: entry for files in gather_objects(self._summed(partial, writer)) for name, entry in files.items()}

        def commit() -> None:
            for name in ("params", "train_state"):
                text = json.dumps(meta[name], indent=2)
                write_text_atomic(partial / f"{name}.json", text)
                summed[f"{name}.json"] = checksums.entry_of(text.encode())
            checksums.write_manifest(partial, summed)
            # The same step saved again (a re-run) replaces the old copy, which is parked aside first.
            final = partial.with_name(partial.name[: -len(STAGING_SUFFIX)])
            commit_staged(partial, final)
            size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
            seconds = meta.get("written_at", time.perf_counter()) - meta["begun"]  # async: when the writes ended
            self.written.append({"step": meta["train_state"]["step"], "bytes": size, "seconds": round(seconds, 3)})
            note(f"checkpoint {final.name}: {human_bytes(size)} written in {seconds:.1f} s "
                 f"({size / seconds / 1e9:.2f} GB/s)")
            # Out of the listing at once; freeing the blocks can wait.
            doomed = [path.rename(path.with_name(path.name + DELETING)) for path in past_keep(self.folder, self.keep, final)]
            if doomed:
                fsync_dir(self.folder)  # commit_staged made the new one durable; these renames too
            self._delete_in_background(doomed)

        # Nobody looks for the checkpoint before it exists.
        on_rank0(commit, f"complete {partial}", error_type=CheckpointError)

    def _summed(self, partial: Path, writer: dcp.FileSystemWriter) -> dict[str, dict]:
        """This rank's files and their checksums: DCP's, summed as written, and its RNG file (a few KiB,
        summed from the page cache)."""
        files = checksums.written(writer)
        rng = f"rng/rank{self.parallel.rank}.pt"
        if checksums.enabled():
            files[rng] = checksums.file_checksum(partial / rng)
        return files

    def _delete_in_background(self, paths: list[Path]) -> None:
        # Freeing a large checkpoint's blocks is a noticeable share of a save (bench/README.md).
        self._join_deleter()
        if paths:
            self._deleter = threading.Thread(
                target=lambda: [shutil.rmtree(p, ignore_errors=True) for p in paths],
                name="hybridpar-checkpoint-delete", daemon=True)
            self._deleter.start()

    def _join_deleter(self) -> None:
        if self._deleter is not None:
            self._deleter.join()
            self._deleter = None

    def close(self) -> None:
        self.wait()
        if self.staging is not None:
            self.staging.close()
        if self._async_group is not None:
            dist.destroy_process_group(self._async_group)
            self._async_group = None

    # --- loading -----------------------------------------------------------------------------

    def load(self, path: Path, model: Stages, optimizer: Optional[torch.optim.Optimizer],
             params: dict) -> dict:
        """Load model (and optimizer) state from checkpoint `path` into this layout; returns train_state.
        `model`: as save's (a checkpoint saved at any pp loads at any other)."""
        path = Path(path)
        model = one_module(model, optimizer)
        check, error = None, None
        try:  # the shared small files first (.metadata's bytes before it is unpickled), on every rank
            check = LoadCheck(path, self.parallel.rank, self.parallel.world_size)
            metadata = check_checkpoint(path, params, model, needs_optimizer=optimizer is not None)
        except CheckpointError as err:
            error = err
        share_load_failure(error, f"load {path}")  # every rank takes the same way on
        if optimizer is not None and fastpaths.enabled():
            allocate_optimizer_state(model, optimizer, metadata, plain)
        state = _state(model, optimizer)  # optimizer None: weights only, e.g. to start a new run from them
        self._read(path, state, check)
        # DCP reads into the tensors it is given; when those are the parameters themselves (FSDP2's
        # sharded state dict), copying them over again would only cost time.
        if not _is_parameter_storage(state["model"], model):
            set_model_state_dict(model, state["model"])
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, own_empty_groups(optimizer, state["optimizer"]))
        precompute_float8_scales([model])  # new weights: new float8 scales for the all-gathers (if any)
        train_state = json.loads((path / "train_state.json").read_text())
        rng = path / "rng" / f"rank{self.parallel.rank}.pt"
        if train_state.get("world_size") == self.parallel.world_size and rng.exists():
            torch.set_rng_state(torch.load(rng, weights_only=True))
        return train_state

    def _read(self, path: Path, state: dict, check: LoadCheck) -> None:
        """dcp.load without its planning collectives: DCP's default load plan involves no coordination
        (each rank reads what its own state dict asks for), so ranks plan alone. The files this rank
        checks are summed meanwhile. One all-reduce afterwards makes every rank fail together when any
        rank could not read or found damage, naming the damaged file."""
        error: Optional[BaseException] = None
        if fastpaths.enabled():  # it sums what it reads: no second read of the files
            sums: Optional[dict] = {}
            reader = FastFileSystemReader(path, thread_count=2, seeds=check.seeds(), sums=sums)
        else:
            sums, reader = None, SafeFileSystemReader(path)
        check.start(sums)
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
        except CheckpointException as err:  # DCP's wrapper around what failed in planning or reading
            error = next(iter(err.failures.values()))[0] if err.failures else RuntimeError(str(err))
        except Exception as err:  # noqa: BLE001 - shared with the other ranks below, then re-raised
            error = err
        damage = check.join()
        if damage is not None:  # the cause: whatever the read made of those bytes is a symptom
            error = damage
        elif isinstance(error, CheckpointReadError):  # a damaged file: a refusal, the same on every rank
            refusal = CheckpointDamagedError(str(error))
            refusal.__cause__, error = error, refusal
        share_load_failure(error, f"load {path}")

    def load_newest_intact(self, model: Stages, optimizer: Optional[torch.optim.Optimizer],
                           params: dict) -> Optional[tuple[Path, dict]]:
        """Load the newest complete checkpoint whose bytes are intact: (its path, train_state), or None
        when there is none. A damaged one is renamed `*.damaged` (kept, never deleted) and the previous
        one is loaded in full, overwriting all that the failed load wrote."""
        refused = []
        # Rank 0's listing: a rank that listed after rank 0 set a damaged one aside would load another.
        for path in reversed(broadcast_from_rank0(complete_checkpoints(self.folder))):
            try:
                return path, self.load(path, model, optimizer, params)
            except CheckpointDamagedError as err:
                reason = str(err)
                on_rank0(lambda: _set_aside(path, reason), f"set {path} aside", error_type=CheckpointError)
                refused.append(f"{path.name}: {reason}")
        if refused:
            raise CheckpointError(f"no intact checkpoint in {self.folder}; each was set aside as *{DAMAGED}, newest "
                                  "first:\n  " + "\n  ".join(refused))
        return None


def _state(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> dict:
    """What DCP writes or reads: the model's state (weights FSDP gathers in float8 as their plain
    values: no float8, no tensor subclass in a file) and the optimizer's, unless None."""
    if optimizer is None:
        return {"model": plain_state_dict(get_model_state_dict(model))}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": plain_state_dict(model_sd), "optimizer": optim_sd}


def _set_aside(path: Path, reason: str) -> Path:
    """Rename damaged checkpoint `path` out of every listing, with the reason beside its files; say so once."""
    target, n = path.with_name(path.name + DAMAGED), 1
    while target.exists():  # the same step damaged before
        target, n = path.with_name(f"{path.name}{DAMAGED}-{n}"), n + 1
    path.rename(target)
    fsync_dir(path.parent)
    write_text_atomic(target / "damaged.txt", reason + "\n")
    note(f"warning: checkpoint {path} is damaged, moved aside to {target.name} (kept, not deleted): {reason}")
    return target


def _is_parameter_storage(state: dict, model: torch.nn.Module) -> bool:
    own = plain_state_dict(dict(model.named_parameters()))
    own.update(model.named_buffers())

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    return state.keys() == own.keys() and all(
        local(v).data_ptr() == local(own[k]).data_ptr() and local(v).shape == local(own[k]).shape
        for k, v in state.items()
    )


def params_dict(args) -> dict:
    return dataclasses.asdict(args)
