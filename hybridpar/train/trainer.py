"""The training loop: tensor parallelism inside model-parallel groups, FSDP across data-parallel ranks.

One optimizer step:
  1. fetch `grad_accum` micro-batches and count the targets of the whole global batch (one all-reduce over dp:
     the count, and whether any rank's data stopped, a damaged store or a source run out: data_stop.py);
  2. forward + backward each micro-batch with loss = sum of token losses / global target count,
     through the step runner (hybridpar.pipeline.runner: the whole model, or this rank's pipeline
     stages); gradients are synchronised only after the last micro-batch (train.grad_sync = "last",
     the default; "every" reduce-scatters after each one);
  3. clip by the norm of the whole model's gradient (across mp and dp);
  4. AdamW step, learning-rate schedule step, metrics.

Normalising by the global target count makes the result independent of how the batch is split over ranks
and micro-batches: any layout computes the gradient of the same mean loss.

The Trainer composes its parts, each made once what it needs exists: the supervisor (diagnostics, stop
signals), the replica groups (hybridpar.replicas), the data, Throughput (MFU's terms), the model's stages
and their runner, ExpertBalance (a mixture of experts' load), the optimizer and schedule, Checkpoints
(restore, save), the metrics, Evaluations (validation and the [eval] tasks) and the profiler.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import time
from pathlib import Path
from typing import Optional, Union

import torch
import torch.distributed as dist

from ..config import Config, profile_range
from ..data import build_training_data, check_vocab
from ..data.streams import DataFormatError
from ..mesh.device import ParallelDims, init_parallel
from ..mesh.ranks import wait_for_every_rank
from ..pipeline.runner import make_runner
from ..pipeline.schedules import StageLayout
from ..pipeline.cutting import build_stages
from ..preflight import Job, as_job, world_size_from_env
from ..replicas import QuorumStopped, make_replicas
from . import data_stop, stop as stopping
from .checkpointing import Checkpoints
from .clock import StepClock
from .downstream import Downstream, Evaluations
from .experts import ExpertBalance
from .metrics import MetricsWriter, WandbSettings, require_wandb
from .optim import apply_update, build_optimizer, grad_norm_and_clip, lr_lambda
from .profile import StepProfiler
from .step import context_parts, count_targets, gradient_scale
from .run_log import RunLog
from .supervisor import Supervisor
from .throughput import Throughput

log = logging.getLogger(__name__)


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
            self.parallel = p = parallel or init_parallel(
                mp=c.parallel.mp, dp_shard=c.parallel.dp_shard, dp_replicate=c.parallel.dp_replicate, cp=c.parallel.cp,
                pp=c.parallel.pp, ep=c.parallel.ep, timeout=c.parallel.init_timeout, backend=c.parallel.backend or None)
            self.is_main, self.device = p.rank == 0, p.device
            self.global_batch = c.data.micro_batch_size * c.train.grad_accum * p.dp_size
            self.supervisor.start(p)  # from here on a rank that dies or hangs is reported
            self._set_up(c, p)
        except BaseException as err:
            self.supervisor.close(err)
            raise
        self.supervisor.set_up(self.start_step, self.runner.modules, stages=self.runner.stage_ids)

    def _phase(self, name: str) -> None:
        self.supervisor.phase(f"set-up: {name}")

    def _set_up(self, c: Config, p: ParallelDims) -> None:
        # Checked by resolve_job; a vocab_size of -1 (Llama 2's) waits for the tokenizer: _fit_vocab.
        self.args = self.job.args
        if c.output.wandb:
            require_wandb()
        self.downstream = Downstream(c, p, self.supervisor)  # the [eval] tasks read and checked
        self.replicas = make_replicas(c, self.stop)  # the other replica groups, if any
        self._phase("data")
        self._set_up_data(c, p)
        # Before the model is built and compiled: the compiler's start-up takes a share of the cores,
        # and a peak measured then comes out low.
        self._phase("peak flops")
        self.throughput = Throughput(c, p, self.args)
        self._phase("model")
        self.layout = StageLayout.of_config(c.parallel, self.args, p)
        # The same full weights on every rank, whatever the layout, then sharded by FSDP.
        torch.manual_seed(c.train.seed)
        stages = build_stages(self.args, p, self.layout, device=self.device, load=self.job.init_loader(p),
                              sequence_parallel=c.parallel.sequence_parallel, fsdp=c.fsdp, compile=c.train.compile,
                              float8=c.float8)
        self.runner = make_runner(stages, self.layout, p, grad_sync=c.train.grad_sync)
        self.params = [param for part in self.runner.modules for param in part.parameters()]
        self.balance = ExpertBalance(c, p, self.runner.modules, self.supervisor)  # a mixture of experts' load balance
        self.optimizer = build_optimizer(self.runner.modules, c.optim)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(c.optim.warmup_steps, c.train.steps, c.optim.min_lr_ratio))
        self.checkpoints = Checkpoints(c, p, self.job, self.supervisor, model=self.runner.modules,
                                       optimizer=self.optimizer, args=self.args, tokenizer=self.tokenizer,
                                       parts={"scheduler": self.scheduler, "data": self.loader, **self.replicas.parts,
                                              **self.balance.parts},
                                       writes=self.replicas.writes_checkpoints)
        self._phase("checkpoint")
        self.step = self.start_step = self.checkpoints.restore()  # 0, or the step a resumed run continues from
        self.checkpoints.prepare_staging()  # a resumed optimizer has its state: the first save's host copy, begun now
        self.run_dir = Path(c.output.run_dir)
        wandb = WandbSettings(c.output.wandb_project, c.output.wandb_mode, c.to_dict()) if c.output.wandb else None
        self.metrics = MetricsWriter(self.run_dir, enabled=self.is_main, tensorboard=c.output.tensorboard,
                                     start_step=self.step, wandb=wandb)
        self.replicas.connect(p, self.runner.modules, self.optimizer, self.scheduler, self.loader, step=self.step,
                              metrics=self.metrics, at=self.supervisor.phase, waiting=self.supervisor.waiting)
        self.run_log = RunLog(c, self.metrics, self.loader, self.downstream, self.replicas, is_main=self.is_main)
        self.history = self.run_log.history  # every step's numbers (run() returns them)
        self.evaluations = Evaluations(c, p, self.runner, self.val_dataset, self.downstream, self.supervisor,
                                       global_batch=self.global_batch, tokenizer=self.tokenizer, args=self.args)
        self.profiler = StepProfiler(profile_range(c.train.profile_steps), self.run_dir, p)

    def _set_up_data(self, c: Config, p: ParallelDims) -> None:
        # A preparation's progress changes the phase: the watchdog sees progress, not a hang. The
        # sources were walked by resolve_job: the data takes them from the job.
        try:
            self.tokenizer, self.loader, self.val_dataset = build_training_data(
                c, p, on_tokenizer=self._fit_vocab, on_progress=lambda text: self._phase(f"data: {text}"),
                walked_sources=self.job.sources, data_rank=self.replicas.data_rank(p))
        except DataFormatError:  # every rank meets it; the last out removes the store: none leaves first
            wait_for_every_rank("data")
            raise
        self._phase("data: waiting for every rank's data")
        wait_for_every_rank("data")  # nodes preparing into caches of their own may finish minutes apart

    def _fit_vocab(self, tokenizer) -> None:
        """Before the loader is built: a vocab_size of -1 (Llama 2's params.json) becomes the
        tokenizer's, and the tokenizer's ids must fit the model's embedding."""
        if self.args.vocab_size <= 0:
            self.args = dataclasses.replace(self.args, vocab_size=tokenizer.vocab_size)
            self.args.check(self.parallel.mp)
        check_vocab(tokenizer.vocab_size, self.args.vocab_size)

    # What tests, benchmarks and users read of a trainer, held by its parts. model: the whole model at
    # pp 1, None under pipeline parallelism (no rank holds it); model_parts: this rank's stage modules.
    model = property(operator.attrgetter("runner.model"))
    model_parts = property(operator.attrgetter("runner.modules"))
    checkpointer = property(operator.attrgetter("checkpoints.checkpointer"))
    resumed_from = property(operator.attrgetter("checkpoints.resumed_from"))
    peak_flops = property(operator.attrgetter("throughput.peak_flops"))
    validation = property(operator.attrgetter("evaluations.validation"))
    eval_seconds = property(operator.attrgetter("evaluations.seconds"))
    validator = property(operator.attrgetter("evaluations.validator"))

    def validate(self) -> dict:
        """The validation loss now (every rank takes part): {"val_loss", "val_ppl", "val_tokens"}."""
        return self.evaluations.validate()

    def save_checkpoint(self) -> Path:
        return self.checkpoints.save(self.step, self.metrics)

    # --- the loop -------------------------------------------------------------------------------

    def train_step(self) -> Optional[dict]:  # None: the replica groups did not commit the step
        c, p = self.config, self.parallel
        start = time.perf_counter()
        self.step = self.replicas.begin_step(self.step)  # a group that was away continues at the others' step
        self.supervisor.phase("data", step=self.step + 1)  # the step in progress
        batches, data_error = data_stop.fetch(self.loader, c.train.grad_accum)
        # Before the forward: did any rank's data stop (a damaged chunk, a source run out)? Then none trains.
        local = context_parts(batches, p)  # this cp rank's chunks; the guard hashes the whole sequences
        global_targets, data_stops = count_targets(local, p, self.device,
                                                   also_sum=[float(data_error is not None)]).tolist()
        if data_stops:
            raise data_stop.DataStopped(data_stop.agreed_error(data_error))
        guard_seconds = self.supervisor.guard(self.step + 1, batches)
        loss_sum = self.runner.forward_backward(local, scale=gradient_scale(p, global_targets),
                                                at=self.supervisor.phase)
        self.supervisor.phase("loss")
        mean_loss = self.runner.total(loss_sum).item() / global_targets

        self.supervisor.phase("optimizer")
        votes = self.replicas.average(self.params, self.stop.vote())  # the groups' mean gradient, their stop votes
        grad_norm, votes = grad_norm_and_clip(self.params, c.optim.grad_clip, self.device, also_sum=votes)
        self.stop_signal = stopping.agreed(votes)
        lr = self.scheduler.get_last_lr()[0]
        if not self.replicas.commit():  # a group failed in it: the same data again
            self.optimizer.zero_grad(set_to_none=True)
            self.balance.discard()
            return None
        skipped = apply_update(self.optimizer, self.scheduler, mean_loss, grad_norm, on_nonfinite=c.train.on_nonfinite,
                               step=self.step + 1)
        self.step += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        return {"step": self.step, "loss": mean_loss, "lr": lr, "grad_norm": grad_norm, "skipped": skipped,
                "tokens": global_targets, "step_time": elapsed, **self.throughput.rates(global_targets, elapsed),
                "data_guard_s": guard_seconds, **self.replicas.row(), **self.balance.finish_step(skipped)}

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
            self.replicas.close()
            self.supervisor.close(error)

    def _run(self) -> list[dict]:
        c = self.config
        if self.is_main:
            self.run_log.begin(self.args, self.parallel, self.global_batch, has_validation=self.validator is not None,
                                resumed_from=self.resumed_from, step=self.step)
        if self.resumed_from is not None:
            self.metrics.event(self.step, "resumed", checkpoint=str(self.resumed_from))  # marked on the dashboard
        saved_at = self._train_loop(self.step if self.resumed_from is not None else None)
        if c.checkpoint.at_end and saved_at != self.step and self.data_stopped is None:
            self.save_checkpoint()
        self.checkpoints.close(self.metrics)
        self.metrics.close()
        self.profiler.close()
        if self.is_main:
            self.run_log.end(self.profiler)
        if self.stop_signal and self.is_main and self.data_stopped is None:  # the data's stop: said after the summary
            self.supervisor.say_stopped(self.step, self.checkpoints.latest(), self.stop_signal,
                                        waited=self.replicas.stopped, writes=self.replicas.writes_checkpoints())
        self._summary()
        if self.data_stopped is not None:  # an error every rank raises alike, or the end asked for
            data_stop.finish(self.data_stopped, self.step, self.checkpoints.latest() if self.step else None,
                             said=self.is_main)
        return self.history

    def _summary(self) -> None:
        """The end-of-run block (rank 0) and summary.json; the peak memory is the largest rank's."""
        peak_memory_gb = self.throughput.peak_memory_gb(self.history)
        if self.is_main:
            self.run_log.summary(
                steps=(self.start_step + 1, self.step), started=self.started, evaluations=self.evaluations,
                peak_memory_gb=peak_memory_gb, checkpoint=self.checkpoints.latest(), tokenizer=self.tokenizer,
                stopped=self.stop_signal, data_stopped=self.data_stopped, has_validation=self.validator is not None)

    def _train_loop(self, saved_at: Optional[int]) -> Optional[int]:
        """Train to train.steps: log, report stragglers, evaluate, save checkpoints; the step last saved."""
        c = self.config
        run_log = self.run_log
        clock = run_log.clock = StepClock(self.started, self.step)  # the step line's elapsed time and ETA
        while self.step < c.train.steps:
            try:
                with self.supervisor.step(self.step + 1) as found, self.profiler.step(self.step + 1):
                    m = self.train_step()
                if m is None:  # not committed by the replica groups: done again
                    continue
            except data_stop.DataStopped as stopped:  # every rank, before the step trained: save the last one
                self.data_stopped, self.stop_signal = stopped.error, "the data"
                break
            except QuorumStopped as stopped:  # every rank of the group, waiting for a quorum: save what it holds
                self.stop_signal, self.step, saved_at = stopped.signal_name, stopped.step, stopped.step
                stopped.saved = self.checkpoints.save_if_new(self.step, self.metrics)
                break
            clock.step_done(self.step)
            self.checkpoints.prepare_staging()  # a fresh optimizer has its state after the first step
            row = dict(found)  # the straggler report's, when one was due
            if self.supervisor.excluding is not None:  # every rank agrees: save, stop, name the node
                self.stop_signal = self.stop_signal or "a straggler"
            if not self.stop_signal:  # no evaluation after a stop
                with clock.pause():
                    evaluated, self.data_stopped = self.evaluations.after_step(self.step)
                row.update(evaluated)
                self.stop_signal = "the data" if self.data_stopped is not None else ""  # held-out data damaged
            run_log.record(m, row)
            if self.stop_signal or (c.checkpoint.every and self.step % c.checkpoint.every == 0):
                with clock.pause():
                    self.save_checkpoint()
                saved_at = self.step
            if self.stop_signal:
                break
        if self.data_stopped is not None and saved_at != self.step and self.step > 0:
            with clock.pause():
                self.save_checkpoint()  # the data stopped before a step trained: the last one saved
            saved_at = self.step
        return saved_at
