"""The training loop: tensor parallelism inside model-parallel groups, FSDP across data-parallel ranks.

One optimizer step:
  1. fetch `grad_accum` micro-batches and count the targets of the whole global batch (one
     all-reduce of two numbers over the dp group: the count, and whether any rank's data stopped,
     a damaged store or a source run out, which stops every rank here: data_stop.py);
  2. forward + backward each micro-batch with loss = sum of token losses / global target count;
     gradients are synchronised only after the last micro-batch (train.grad_sync = "last", the
     default; "every" reduce-scatters after each one);
  3. clip by the norm of the whole model's gradient (across mp and dp);
  4. AdamW step, learning-rate schedule step, metrics.

Normalising by the global target count makes the result independent of how the batch is split
over ranks and micro-batches: any layout computes the gradient of the same mean loss.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from pathlib import Path
from typing import Optional, Union

import torch
import torch.distributed as dist

from ..checkpoint.convert import load_into
from ..checkpoint.dcp import Checkpointer, complete_checkpoints, latest_checkpoint, params_dict
from ..config import Config, ConfigError, dump_toml, profile_range
from ..data import build_training_data, check_vocab
from ..data.streams import DataFormatError
from ..data.blend import describe_blend
from ..files import refuse_occupied, write_text_atomic
from ..mesh.device import ParallelDims, init_parallel
from ..mesh.layout import sizes_text
from ..build import build_stages
from ..plan.hardware import peak_flops_of
from ..preflight import Job, as_job, world_size_from_env
from ..progress import note
from ..mesh.ranks import mark_every_rank, wait_for_every_rank
from . import data_stop, downstream, stop as stopping
from .evaluate import Validator, missing_validation
from .clock import StepClock
from .dashboard import plot_dashboard
from .metrics import (MetricsWriter, WandbSettings, flops_per_token, measure_matmul_peak, memory_bytes, log_row,
                      progress_line, require_wandb, validation_text)
from .optim import build_optimizer, grad_norm_and_clip, lr_lambda
from .profile import StepProfiler
from .step import (context_parts, count_targets, forward_backward, gradient_scale, pipeline_engine,
                   pipeline_forward_backward, sum_loss)
from .summary import summarise, write_summary
from .supervisor import Supervisor

log = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    every_rank = True  # raised alike on every rank: hybridpar.mesh.ranks.raised_by_every_rank


class Trainer:
    def __init__(self, job: Union[Job, Config], parallel: Optional[ParallelDims] = None) -> None:
        # Every mistake the config can show without a process group, before anything is made; the
        # files the config names are read here, once (hybridpar.preflight.resolve_job).
        world = parallel.world_size if parallel else dist.get_world_size() if dist.is_initialized() else None
        self.job = as_job(job, world or world_size_from_env())
        self.config = c = self.job.config
        self.started = time.perf_counter()  # the summary's wall time counts set-up too
        # Before init_parallel makes the process group: NCCL reads some tracing variables when a
        # group is created, and a stop signal from here on ends the run with a checkpoint.
        self.supervisor = Supervisor(c).open()
        self.stop = self.supervisor.stop
        self.stop_signal = ""  # the stop signal every rank agreed on (at the end of a step), if any
        self.data_stopped: Optional[Exception] = None  # what stopped the data, agreed by every rank (data_stop.py)
        try:
            self.parallel = parallel or init_parallel(
                mp=c.parallel.mp, dp_shard=c.parallel.dp_shard, dp_replicate=c.parallel.dp_replicate,
                cp=c.parallel.cp, pp=c.parallel.pp, timeout=c.parallel.init_timeout,
                backend=c.parallel.backend or None,
            )
            p = self.parallel
            self.is_main = p.rank == 0
            self.device = p.device
            self.global_batch = c.data.micro_batch_size * c.train.grad_accum * p.dp_size
            self.supervisor.start(p)  # from here on a rank that dies or hangs is reported
            self._set_up(c, p)
        except BaseException as err:
            self.supervisor.close(err)
            raise
        self.supervisor.set_up(self.start_step, self.modules)

    def _set_up(self, c: Config, p: ParallelDims) -> None:
        def phase(name: str) -> None:
            self.supervisor.phase(f"set-up: {name}")

        # Checked by resolve_job; a vocab_size of -1 (Llama 2's) waits for the tokenizer: _fit_vocab.
        self.args = self.job.args
        if c.output.wandb:
            require_wandb()
        self.downstream = downstream.Downstream(c, p, self.supervisor)  # the [eval] tasks read and checked
        phase("data")
        # A preparation's progress changes the phase: the watchdog sees progress, not a hang. The
        # sources were walked by resolve_job: the data takes them from the job.
        try:
            self.tokenizer, self.loader, self.val_dataset = build_training_data(
                c, p, on_tokenizer=self._fit_vocab, on_progress=lambda text: phase(f"data: {text}"),
                walked_sources=self.job.sources)
        except DataFormatError:  # every rank meets it; the last out removes the store: none leaves first
            wait_for_every_rank("data")
            raise
        phase("data: waiting for every rank's data")
        wait_for_every_rank("data")  # nodes preparing into caches of their own may finish minutes apart
        # Before the model is built and compiled: the compiler's start-up takes a share of the cores,
        # and a peak measured then comes out low.
        phase("peak flops")
        self.peak_flops = self._peak()
        phase("model")
        # The whole model at parallel.pp = 1; under pipeline parallelism model is None and this rank's
        # stages (model_parts, in the schedule's order; [model] at pp 1) run by `engine` (None at pp 1).
        self.model_parts, stage_ids = self._build_model()
        self.model = self.model_parts[0] if p.pp == 1 else None
        self.engine = pipeline_engine(self.model_parts, stage_ids, p, c.parallel)
        self.params = [param for part in self.model_parts for param in part.parameters()]
        self.optimizer = build_optimizer(self.model_parts, c.optim)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(c.optim.warmup_steps, c.train.steps, c.optim.min_lr_ratio)
        )
        self.step = 0
        self.history: list[dict] = []
        self.run_dir = Path(c.output.run_dir)
        self.checkpointer = Checkpointer(
            c.checkpoint_dir(), p,
            keep=c.checkpoint.keep, async_save=c.checkpoint.async_save,
        )
        phase("checkpoint")
        self.resumed_from = self._restore()
        self.start_step = self.step  # 0, or the step a resumed run continues from
        wandb = WandbSettings(c.output.wandb_project, c.output.wandb_mode, c.to_dict()) if c.output.wandb else None
        self.metrics = MetricsWriter(self.run_dir, enabled=self.is_main, tensorboard=c.output.tensorboard,
                                     start_step=self.step, wandb=wandb)
        self.flops_per_token = flops_per_token(self.args, c.data.seq_len)
        evaluation = dict(micro_batch_size=c.data.micro_batch_size, eval_steps=c.train.eval_steps,
                          global_batch=self.global_batch, at=self.supervisor.phase)
        self.validator = None if self.val_dataset is None else Validator(self.val_dataset, p, **evaluation)
        self.validation: Optional[dict] = None  # the last validation result
        self.eval_seconds = 0.0
        self.profiler = StepProfiler(profile_range(c.train.profile_steps), self.run_dir, p)

    # --- set-up ---------------------------------------------------------------------------------

    @property
    def init_from_folder(self) -> Optional[tuple[str, Path]]:
        return self.job.init_from

    def _restore(self) -> Optional[Path]:
        """Resume from the newest complete checkpoint, or take the weights of checkpoint.init_from."""
        c = self.config.checkpoint
        params = params_dict(self.args)
        if not c.resume:
            # Its saves would mix with the old run's, and pruning by step could delete the new ones.
            refuse_occupied(self.checkpointer.folder, "checkpoint.resume is false; set checkpoint.resume = true to "
                            "continue that run, or give this run its own output.run_dir or checkpoint.folder",
                            error_type=ConfigError, listing=("checkpoints", complete_checkpoints))
        found = self.checkpointer.load_newest_intact(self.modules, self.optimizer, params)  # sets damaged ones aside
        if found is not None:
            latest, state = found
            self.step = state["step"]
            self.scheduler.load_state_dict(state["scheduler"])
            self.loader.load_state_dict(state["data"])
            return latest
        if c.init_from and self.init_from_folder is None:
            self.checkpointer.load(Path(c.init_from), self.modules, None, params)
        return None

    def save_checkpoint(self) -> Path:
        train_state = {"scheduler": self.scheduler.state_dict(), "data": self.loader.state_dict()}
        if getattr(self.tokenizer, "path", None):  # for `convert --to hf`, which writes it beside the weights
            train_state["tokenizer"] = {"path": str(Path(self.tokenizer.path).absolute()),
                                        "sha256": self.tokenizer.sha256}
        begun = time.perf_counter()
        with self.supervisor.checkpointing():  # a large checkpoint's writes are not a hang
            path = self.checkpointer.save(self.step, self.modules, self.optimizer, train_state, params_dict(self.args))
        # How long training waited (an async save: only the copy to host memory); the writes' own time follows.
        self.metrics.event(self.step, "checkpoint", blocked_s=round(time.perf_counter() - begun, 3),
                           async_save=self.checkpointer.async_save)
        self._saves_written()
        return path

    def _saves_written(self) -> None:
        """events.jsonl gets each completed save's size and write time (rank 0 completes them)."""
        for done in self.checkpointer.written:
            self.metrics.event(done["step"], "checkpoint_written", bytes=done["bytes"], seconds=done["seconds"])
        self.checkpointer.written.clear()

    def _fit_vocab(self, tokenizer) -> None:
        """Before the loader is built: a vocab_size of -1 (Llama 2's params.json) becomes the
        tokenizer's, and the tokenizer's ids must fit the model's embedding."""
        if self.args.vocab_size <= 0:
            self.args = dataclasses.replace(self.args, vocab_size=tokenizer.vocab_size)
            self.args.check(self.parallel.mp)
        check_vocab(tokenizer.vocab_size, self.args.vocab_size)

    @property
    def modules(self) -> Union[torch.nn.Module, list[torch.nn.Module]]:
        """What the checkpointer and the supervisor take: the model, or under pp this rank's stages."""
        return self.model if self.engine is None else self.model_parts

    def _build_model(self) -> tuple[list[torch.nn.Module], list[int]]:
        """The same full weights on every rank, whatever the layout, then sharded by FSDP: (this rank's
        pipeline stages of them, their stage ids); ([model], [0]) at pp 1."""
        c, p = self.config, self.parallel
        torch.manual_seed(c.train.seed)
        load = None
        if self.init_from_folder is not None:
            kind, folder = self.init_from_folder
            load = functools.partial(load_into, kind, folder, parallel=p, parsed=self.job.init_config)
        return build_stages(self.args, p, c.parallel.pp_schedule, c.parallel.pp_layers, device=self.device, load=load,
                            sequence_parallel=c.parallel.sequence_parallel, fsdp=c.fsdp, compile=c.train.compile)

    def _peak(self) -> float:
        """MFU's denominator per device: train.peak_flops; else a GPU's dense bf16 peak from its name
        (plan/hardware.py); else a matmul rate measured here (a CPU, or a card of unknown name)."""
        if self.config.train.peak_flops:
            return self.config.train.peak_flops
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else ""
        peak = peak_flops_of(name) if name else None
        if peak is not None:
            note(f"MFU against {name}'s dense bf16 peak {peak / 1e12:.0f} TFLOP/s (from its name; "
                 "train.peak_flops sets another)")
            return peak
        peak = self._measure_peak()
        if name:
            note(f"MFU against the measured bf16 matmul rate {peak / 1e12:.0f} TFLOP/s (card name {name!r} unknown: "
                 "set train.peak_flops to its datasheet's dense bf16 peak)")
        return peak

    def _measure_peak(self) -> float:
        # Every rank measures the same window, under the same contention as training. Within it the
        # scheduler shares the cores unevenly, so the per-rank peak is the mean over ranks.
        gpu = dict(size=8192, dtype=torch.bfloat16) if self.device.type == "cuda" else {}
        rate = measure_matmul_peak(seconds=0.5, start_together=dist.barrier, device=self.device, **gpu)
        peak = torch.tensor([rate], dtype=torch.float64, device=self.device)  # nccl reduces GPU tensors only
        dist.all_reduce(peak)
        return peak.item() / dist.get_world_size()

    # --- the loop -------------------------------------------------------------------------------

    def train_step(self) -> dict:
        c, p = self.config, self.parallel
        start = time.perf_counter()
        self.supervisor.phase("data", step=self.step + 1)  # the step in progress
        batches, data_error = data_stop.fetch(self.loader, c.train.grad_accum)
        # Before the forward: did any rank's data stop (a damaged chunk, a source run out)? Then none trains.
        local = context_parts(batches, p)  # this cp rank's chunks; the guard hashes the whole sequences
        global_targets, data_stops = count_targets(local, p, self.device,
                                                   also_sum=[float(data_error is not None)]).tolist()
        if data_stops:
            raise data_stop.DataStopped(data_stop.agreed_error(data_error))
        guard_seconds = self.supervisor.guard(self.step + 1, batches)
        scale = gradient_scale(p, global_targets)
        if self.engine is None:
            loss_sum = forward_backward(self.model, local, p, scale=scale, grad_sync=c.train.grad_sync,
                                        device=self.device, at=self.supervisor.phase)
        else:
            loss_sum = pipeline_forward_backward(self.engine, local, scale=scale, device=self.device,
                                                 at=self.supervisor.phase)
        self.supervisor.phase("loss")
        sum_loss(loss_sum, p)
        mean_loss = loss_sum.item() / global_targets

        self.supervisor.phase("optimizer")
        grad_norm, votes = grad_norm_and_clip(self.params, c.optim.grad_clip, self.device,
                                              also_sum=self.stop.vote())
        self.stop_signal = stopping.agreed(votes)
        lr = self.scheduler.get_last_lr()[0]
        skipped = not (math.isfinite(mean_loss) and math.isfinite(grad_norm))
        if skipped and c.train.on_nonfinite == "stop":
            raise NonFiniteLossError(
                f"step {self.step + 1}: loss {mean_loss}, gradient norm {grad_norm}: training stopped. "
                "Lower optim.lr, check the data, or set train.on_nonfinite = \"skip\" to skip such steps"
            )
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        tokens_per_s = global_targets / elapsed
        return {
            "step": self.step, "loss": mean_loss, "lr": lr, "grad_norm": grad_norm, "skipped": skipped,
            "tokens": global_targets, "step_time": elapsed, "tokens_per_s": tokens_per_s,
            "mfu": self.flops_per_token * tokens_per_s / (self.peak_flops * p.world_size),
            "memory_gb": memory_bytes(self.device) / 1e9, "data_guard_s": guard_seconds,
        }

    def run(self) -> list[dict]:
        error = None
        try:
            self.supervisor.running(self.step)
            return self._run()
        except BaseException as err:
            error = err
            raise
        finally:
            self.profiler.close()  # a run that fails or stops inside the profiled steps keeps its trace
            self.supervisor.close(error)

    def _run(self) -> list[dict]:
        c = self.config
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.run_dir / "config.toml", dump_toml(c))
            (self.run_dir / stopping.MARKER).unlink(missing_ok=True)  # it told of an earlier run's end
            log.info(
                f"hybridpar: {self.args.num_params() / 1e6:.1f}M parameters, {self.parallel.world_size} ranks = "
                f"{sizes_text(*self.parallel.sizes)}, "
                f"{c.fsdp.sharding_strategy}, global batch {self.global_batch} x {c.data.seq_len} tokens, "
                f"{self.loader.windows} sequences in the data")
        if self.validator is None and (c.train.eval_every or c.train.eval_steps) and self.is_main:
            log.warning("hybridpar: warning: train.eval_every / train.eval_steps are set, but the run has no "
                        f"validation data: {missing_validation(c)}")
        if self.resumed_from is not None:
            self.metrics.event(self.step, "resumed", checkpoint=str(self.resumed_from))  # marked on the dashboard
        if self.resumed_from is not None and self.is_main:
            log.info(f"resumed from {self.resumed_from} at step {self.step}")
            if self.step >= c.train.steps:
                log.info(f"already at step {self.step} of {c.train.steps}: nothing to train "
                         "(raise train.steps to continue)")
        saved_at = self._train_loop(self.step if self.resumed_from is not None else None)
        if c.checkpoint.at_end and saved_at != self.step and self.data_stopped is None:
            self.save_checkpoint()
        self.checkpointer.close()
        self._saves_written()
        self.metrics.close()
        self.profiler.close()
        if self.is_main and self.profiler.rows:
            log.info(self.profiler.describe())
        if self.is_main and c.output.plot and self.metrics.jsonl_path.exists():
            plot_dashboard(self.metrics.jsonl_path, self.run_dir / "loss.png", grad_clip=c.optim.grad_clip)
        if self.stop_signal and self.is_main:
            path = latest_checkpoint(self.checkpointer.folder)
            if self.data_stopped is not None:
                pass  # said by every rank below, after the summary
            elif self.supervisor.excluding is not None:
                self.supervisor.straggler_stop(self.step, path)
            else:
                stopping.write_marker(self.run_dir, self.stop_signal, self.step, path)
                log.info(stopping.stopped_line(self.stop_signal, self.step, path, c.checkpoint.resume))
        self._summary()
        if self.data_stopped is not None:
            self._data_stopped()
        return self.history

    def _data_stopped(self) -> None:
        """The data stopped the run (every rank, checkpoint saved): a damaged store is an error every
        rank raises alike; a source run out with data.on_exhausted = "stop" is the end asked for."""
        path = latest_checkpoint(self.checkpointer.folder) if self.step else None
        text = data_stop.stopped_text(self.data_stopped, self.step, path)
        if isinstance(self.data_stopped, data_stop.StoreDamagedError):
            raise mark_every_rank(data_stop.StoreDamagedError(text))
        if self.is_main:
            log.info(text)

    def _source_tokens(self) -> dict:
        """A blend's tokens trained on so far, per source: {"tokens/<name>": n} ({} for one source)."""
        return {f"tokens/{s['name']}": s["tokens"] for s in describe_blend(self.loader)}

    def _summary(self) -> None:
        """The end-of-run block (rank 0) and summary.json; the peak memory is the largest rank's."""
        peak = torch.tensor([max((m["memory_gb"] for m in self.history), default=memory_bytes(self.device) / 1e9)],
                            dtype=torch.float64, device=self.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if not self.is_main:
            return
        h = self.history
        seconds = sum(m["step_time"] for m in h)
        text, done = summarise(
            run_dir=self.run_dir, steps=(self.start_step + 1, self.step), skipped=sum(m["skipped"] for m in h),
            tokens=sum(m["tokens"] for m in h), wall_seconds=time.perf_counter() - self.started,
            train_seconds=seconds, eval_seconds=self.eval_seconds,
            mfu=sum(m["mfu"] * m["step_time"] for m in h) / seconds if seconds else 0.0,
            peak_memory_gb=peak.item(), train_loss=log_row(h[-self.config.train.log_every:])["loss"] if h else None,
            validation=self.validation, checkpoint=latest_checkpoint(self.checkpointer.folder),
            tokenizer=getattr(self.tokenizer, "path", None), config_path=self.run_dir / "config.toml",
            config=self.config, stopped=self.stop_signal,
            no_validation="" if self.validator is not None else missing_validation(self.config),
            sources=describe_blend(self.loader),
            data_stop=data_stop.kind(self.data_stopped), downstream=self.downstream.scores)
        write_summary(self.run_dir, done)
        log.info(text)

    def validate(self) -> dict:
        """The validation loss now (every rank takes part): {"val_loss", "val_ppl", "val_tokens"}."""
        start = time.perf_counter()
        self.validation = self.validator(self.model if self.engine is None else self.engine)
        self.eval_seconds += time.perf_counter() - start
        self.supervisor.phase("validated")
        return self.validation

    def _train_loop(self, saved_at: Optional[int]) -> Optional[int]:
        """Train to train.steps: log, report stragglers, save checkpoints; the step last saved."""
        c = self.config
        window: list[dict] = []  # the steps since the last log line
        clock = StepClock(self.started, self.step)  # the step line's elapsed time and ETA
        while self.step < c.train.steps:
            try:
                with self.supervisor.step(self.step + 1) as found, self.profiler.step(self.step + 1):
                    m = self.train_step()
            except data_stop.DataStopped as stopped:  # every rank, before the step trained: save the last one
                self.data_stopped, self.stop_signal = stopped.error, "the data"
                if saved_at != self.step and self.step > 0:
                    with clock.pause():
                        self.save_checkpoint()
                    saved_at = self.step
                break
            clock.step_done(self.step)
            self.history.append(m)
            window.append(m)
            if m["skipped"]:
                self.metrics.event(m["step"], "skipped", loss=m["loss"], grad_norm=m["grad_norm"])  # on the dashboard
                if self.is_main:
                    log.info(f"step {m['step']}: non-finite loss {m['loss']} or gradient norm: step skipped")
            row = dict(found)  # the straggler report's, when one was due
            if self.supervisor.excluding is not None:  # every rank agrees: save, stop, name the node
                self.stop_signal = self.stop_signal or "a straggler"
            with clock.pause():
                downstream.after_step(self, row)  # validation and the [eval] tasks, when due
            if m["step"] % c.train.log_every == 0 or m["step"] in (1, c.train.steps):
                summary = {**log_row(window), **self._source_tokens()}
                self.metrics.write(m["step"], {**summary, **row})
                if self.is_main:
                    log.info(progress_line(m["step"], c.train.steps, {**summary, **row}, clock.elapsed(),
                                           clock.eta(self.step, c.train.steps)))
                window = []
            elif row:
                self.metrics.write(m["step"], row)
                if self.is_main and validation_text(row):
                    log.info(f"step {m['step']:>5}/{c.train.steps}{validation_text(row)}")
            if self.stop_signal or (c.checkpoint.every and self.step % c.checkpoint.every == 0):
                with clock.pause():
                    self.save_checkpoint()
                saved_at = self.step
            if self.stop_signal:
                break
        return saved_at
