"""Pipeline parallelism: tokens/s, the bubble against (p - 1) / (v m + p - 1), and per-rank activation
memory against `hybridpar plan`'s, measured on the real model through hybridpar.pipeline.engine's
PipelineEngine (torch.distributed.pipelining), at pp 2 and 4 on this machine.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 4 bench/pipeline.py [--rounds 5]

Model: the tiny preset (dim 256, vocab 4,096) with --layers 15 (17 units with the embedding and the
head: stages [8, 7] at pp 2, [4, 4, 4, 3] at pp 4 and pp 2 x v 2, [2, ..., 2, 1] at pp 4 x v 2), fp32, micro-batches
of --micro-batch sequences of --seq-len tokens. At this shape the head and its loss cost about one
layer and the embedding almost nothing, so torchtitan's split leaves the stages even (the formula
assumes it), and a stage's forward and backward of one micro-batch take 45 ms (pp 4) to 190 ms
(pp 2) of CPU against the 256 KiB activation (or gradient) each stage boundary sends. A layout
is (pp, schedule, m): pp x 1 stages (1F1B, GPipe) or pp x 2 (Interleaved1F1B, v 2). At pp 2 one
pipeline runs (ranks 0 and 2; 1 and 3 sleep in a collective), so it fits the 2 cores; at pp 4 four
ranks share them. Every layout is built once and run once per round, layouts interleaved by round.

  tokens/s   m x micro-batch x seq_len over the step: first rank's start to last rank's end, all
             ranks released by one barrier. Median of --rounds.
  bubble     per rank, the wall time it waits in the pipeline's P2P (every torch.distributed.pipelining
             wait goes through schedules._wait_batch_p2p, timed here) plus the time between its own
             schedule's end and the step's (the last stage finishes (p - 1) backwards early; in
             training it waits there in the gradient norm's all-reduce), over the step. Mean and
             worst rank; median over rounds. "formula": (p - 1) / (v m + p - 1) (plan.bubble_fraction).
  replay     the same bubble on a core per rank: each forward (with the loss) and backward costs its
             thread CPU time (time.thread_time), and the recorded order of every rank is replayed
             with F(s, i) after F(s-1, i), B(s, i) after B(s+1, i) and P2P free. The critical path
             of the schedule as it ran, without time-sharing.
  even       the replay with every forward at the mean forward's cost and every backward at the
             mean backward's: torch's order on even stages, where the formula's premise holds; the
             replay's excess over it is the stages' unevenness (each stage's mean costs: stage_costs).
  shared     the same replay with the ranks ready to compute sharing --cores cores (default this
             machine's): what the wall bubble should read here if time-sharing is all that differs.
  slowdown   wall over thread CPU time inside forward/backward: 1 when each rank has a core.
  memory     the distinct non-parameter storages autograd holds saved (a saved-tensors hook whose
             packed handle releases them when backward frees it) over one step: the peak per rank,
             the worst rank against plan.estimate(...).memory.activations (the rank holding most
             units, the micro-batches in flight per schedule). "in flight" = the peak over one
             micro-batch's saves (the step's total / m), against plan.pipeline_cost.in_flight. Not counted:
             the stage's output kept for backward, the P2P receive buffers, and the logits of every
             micro-batch the last stage keeps until the step returns (`held` column).

Limits. Waiting in a receive is time the rank is idle only when each rank has a core: at pp 4 on
2 cores, a rank whose peer is ready may still wait for the CPU, and while some ranks idle the busy
ones run faster (the bubble's time is lent to them), so the wall bubble at pp 4 is not the
formula's quantity; the replay is, to the accuracy of thread CPU time (cache sharing inflates it a
little), and at pp 2 (a core per rank) the two can be compared. Each hand-off also costs the
receiver's wake-up (gloo's thread, then the waiting one, each needing a core): milliseconds per
wait with a core per rank, 10-20 ms at pp 4 on 2 cores (bench/README). Other jobs on the machine
inflate the wall figures: the load average is recorded with every round. Prints a table and writes
bench/results/pipeline.json (--out).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MIB = 2**20

from bench.pipeline_replay import evened, p2p_bubble, replay, stage_costs, summarise, wall_bubble  # noqa: E402


# --- instrumentation ----------------------------------------------------------------------------------

class Recorder:
    """Times every P2P wait of torch.distributed.pipelining (its schedules wait through the module's
    _wait_batch_p2p) and every forward, loss and backward of the stages it watches."""

    def __init__(self) -> None:
        from torch.distributed.pipelining import schedules

        self.waits, self.n_waits = 0.0, 0
        self.actions: list[dict] = []
        original = schedules._wait_batch_p2p

        def timed_wait(work):
            began = time.perf_counter()
            try:
                return original(work)
            finally:
                self.waits += time.perf_counter() - began
                self.n_waits += 1

        schedules._wait_batch_p2p = timed_wait

    def reset(self) -> None:
        self.waits, self.n_waits, self.actions = 0.0, 0, []

    def watch(self, engine) -> None:
        for stage in engine.stages:
            stage.forward_one_chunk = self._timed(stage.forward_one_chunk, "F", stage.stage_index)
            stage.backward_one_chunk = self._timed(stage.backward_one_chunk, "B", stage.stage_index)
        loss = engine.schedule._maybe_compute_loss

        def timed_loss(stage, output, target_mbs, mb_index, *rest, **kw):  # the loss: part of the last F
            began, cpu = time.perf_counter(), time.thread_time()
            out = loss(stage, output, target_mbs, mb_index, *rest, **kw)
            if stage.is_last:
                last = self.actions[-1]
                last["wall"] += time.perf_counter() - began
                last["cost"] += time.thread_time() - cpu
            return out

        engine.schedule._maybe_compute_loss = timed_loss

    def _timed(self, method, kind: str, stage: int):
        def timed(mb, *args, **kwargs):
            began, cpu = time.perf_counter(), time.thread_time()
            out = method(mb, *args, **kwargs)
            self.actions.append({"kind": kind, "stage": stage, "mb": mb, "wall": time.perf_counter() - began,
                                 "cost": time.thread_time() - cpu})
            return out
        return timed


class SavedBytes:
    """The distinct non-parameter storages autograd holds saved, now and at the peak, and all it saved."""

    def __init__(self, params) -> None:
        from torch.distributed.tensor import DTensor

        self.params = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr() for p in params}
        self.live: dict[int, list[int]] = {}  # storage -> [bytes, handles]
        self.now = self.peak = self.total = 0

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.params or not storage.nbytes():
            return t
        if ptr in self.live:
            self.live[ptr][1] += 1
        else:
            self.live[ptr] = [storage.nbytes(), 1]
            self.now += storage.nbytes()
            self.total += storage.nbytes()
            self.peak = max(self.peak, self.now)
        return _Held(self, ptr, t)

    def release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if not entry[1]:
            self.now -= entry[0]
            del self.live[ptr]


class _Held:
    """A saved tensor's handle: autograd drops it when backward has used it (or the graph dies)."""
    __slots__ = ("owner", "ptr", "tensor")

    def __init__(self, owner: SavedBytes, ptr: int, tensor: torch.Tensor) -> None:
        self.owner, self.ptr, self.tensor = owner, ptr, tensor

    def __del__(self) -> None:
        self.owner.release(self.ptr)


def _unpack(held):
    return held.tensor if isinstance(held, _Held) else held


# --- the run ------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Layout:
    pp: int
    schedule: str
    m: int
    v: int
    engine: object = None  # this rank's PipelineEngine; None on a rank outside the pipeline

    @property
    def name(self) -> str:
        return f"pp{self.pp} {self.schedule}{f' v{self.v}' if self.v > 1 else ''} m{self.m}"


def build(args, parallel, layout: Layout):
    from hybridpar.pipeline.engine import PipelineEngine
    from hybridpar.pipeline.schedules import stage_ids, stage_layer_counts
    from hybridpar.pipeline.cutting import build_stage

    counts = stage_layer_counts(args.n_layers, layout.pp * layout.v)
    ids = stage_ids(parallel.pp_rank, layout.pp, layout.v, layout.schedule)
    stages = []
    for s in ids:
        torch.manual_seed(0)
        stages.append(build_stage(args, parallel, s, counts))
    return PipelineEngine(stages, ids, parallel.pp_group, layout.schedule, layout.m, torch.device("cpu"),
                          parallel.mp_group)


def run_step(layout: Layout, batch, recorder: Recorder, saved: SavedBytes = None) -> dict:
    """One step of every pipeline rank, all ranks released by one barrier; this rank's figures."""
    tokens, targets, scale = batch
    dist.barrier()
    recorder.reset()
    if layout.engine is None:
        return {}
    start = time.perf_counter()  # CLOCK_MONOTONIC on Linux: one clock for every process of the machine
    if saved is None:
        layout.engine.step(tokens, targets, scale)
    else:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, _unpack):
            layout.engine.step(tokens, targets, scale)
    end = time.perf_counter()
    held = sum(sum(o.numel() * o.element_size() for o in _tensors(s.output_chunks)) for s in layout.engine.stages)
    for s in layout.engine.stages:
        s.submod.zero_grad(set_to_none=True)
    return {"start": start, "end": end, "waits": recorder.waits, "n_waits": recorder.n_waits,
            "actions": recorder.actions, "held": held,
            "compute_wall": sum(a["wall"] for a in recorder.actions),
            "compute_cpu": sum(a["cost"] for a in recorder.actions)}


def _tensors(chunks):
    for c in chunks:
        if isinstance(c, torch.Tensor):
            yield c
        elif isinstance(c, (list, tuple)):
            yield from _tensors(c)


def gather(mine: dict) -> dict[int, dict]:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {r: e for r, e in enumerate(every) if e}


def planned(args, layout: Layout, micro_batch: int, seq_len: int) -> dict:
    from hybridpar.plan import Hardware, Layout as PlanLayout, Workload, estimate
    from hybridpar.plan.pipeline_cost import bubble_fraction, in_flight

    plan = estimate(args, PlanLayout(mp=1, dp_shard=1, pp=layout.pp, pp_schedule=layout.schedule, v=layout.v),
                    Workload(seq_len=seq_len, micro_batch=micro_batch, global_batch=layout.m * micro_batch,
                             param_dtype="float32"), Hardware(gpus=layout.pp, gpu_mem_gib=80))
    return {"activations": plan.memory.activations, "in_flight": in_flight(layout.schedule, layout.pp, layout.v,
                                                                           layout.m),
            "bubble": bubble_fraction(layout.pp, layout.v, layout.m)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--layers", type=int, default=15)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per pipeline micro-batch")
    parser.add_argument("--pps", default="2,4")
    parser.add_argument("--schedules", default="1F1B,Interleaved1F1B,GPipe")
    parser.add_argument("--microbatches", default="4,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cores", type=int, default=os.cpu_count(),
                        help="the cores the shared replay gives the ranks (default: this machine's)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "pipeline.json"))
    opts = parser.parse_args()

    import hybridpar
    from hybridpar.pipeline.schedules import MULTI_STAGE
    from hybridpar.models.args import ModelArgs

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    args = dataclasses.replace(ModelArgs.from_preset(opts.preset), n_layers=opts.layers,
                               max_seq_len=max(opts.seq_len, ModelArgs.from_preset(opts.preset).max_seq_len))
    pps = [int(p) for p in opts.pps.split(",")]
    if any(world % p for p in pps):
        raise SystemExit(f"bench/pipeline.py: --pps {opts.pps} must divide the world ({world} ranks)")
    meshes = {p: hybridpar.init_parallel(mp=1, pp=p, dp_shard=world // p) for p in pps}
    layouts = [Layout(p, s, m, 2 if s in MULTI_STAGE else 1) for p, s, m in
               itertools.product(pps, opts.schedules.split(","), [int(m) for m in opts.microbatches.split(",")])]
    recorder = Recorder()
    batches = {}
    for layout in layouts:
        parallel = meshes[layout.pp]
        if parallel.dp_rank == 0:  # one pipeline per layout; the other ranks wait in the barrier
            layout.engine = build(args, parallel, layout)
            recorder.watch(layout.engine)
        g = torch.Generator().manual_seed(1)
        data = torch.randint(0, args.vocab_size, (layout.m * opts.micro_batch, opts.seq_len + 1), generator=g)
        batches[layout.name] = (data[:, :-1], data[:, 1:], 1.0 / data[:, 1:].numel())
    rank0 = dist.get_rank() == 0
    for layout in layouts:  # warm-up: the stages' shapes and buffers are set up on the first step
        run_step(layout, batches[layout.name], recorder)
        if rank0:
            print(f"warm-up: {layout.name}, load average {os.getloadavg()[0]:.1f}", flush=True)
    steps: dict[str, list] = {layout.name: [] for layout in layouts}
    loads = []
    for k in range(opts.rounds):
        loads.append(os.getloadavg()[0])
        for layout in layouts:
            steps[layout.name].append(gather(run_step(layout, batches[layout.name], recorder)))
        if rank0:
            print(f"round {k + 1}/{opts.rounds} done, load average {loads[-1]:.1f}", flush=True)
    rows = []
    for layout in layouts:
        params = [p for s in layout.engine.stages for p in s.submod.parameters()] if layout.engine else []
        saved = SavedBytes(params)
        mine = run_step(layout, batches[layout.name], recorder, saved)
        memory = gather({"peak": saved.peak, "total": saved.total, "held": mine["held"]} if mine else {})
        rows.append(analyse(layout, steps[layout.name], memory, planned(args, layout, opts.micro_batch,
                                                                        opts.seq_len), opts))
    if rank0:
        report(rows, {"preset": opts.preset, "n_layers": opts.layers, "seq_len": opts.seq_len,
                      "micro_batch": opts.micro_batch, "world": world, "rounds": opts.rounds, "cores": os.cpu_count(),
                      "load_average": {"rounds": loads, "end": os.getloadavg()[0]}, "torch": torch.__version__},
               Path(opts.out))
    dist.destroy_process_group()


def analyse(layout: Layout, rounds: list[dict], memory: dict, plan: dict, opts) -> dict:
    n_stages = layout.pp * layout.v
    walls = [wall_bubble(r) for r in rounds]
    replays = [replay({k: v["actions"] for k, v in r.items()}, n_stages) for r in rounds]
    shared = [replay({k: v["actions"] for k, v in r.items()}, n_stages, opts.cores) for r in rounds]
    even = [replay(evened({k: v["actions"] for k, v in r.items()}), n_stages) for r in rounds]
    costs = [stage_costs({k: v["actions"] for k, v in r.items()}) for r in rounds]
    med = statistics.median
    step = med(w["step"] for w in walls)
    peak = max(m["peak"] for m in memory.values())
    per_micro_batch = {k: m["total"] / layout.m for k, m in memory.items()}
    return {
        "layout": layout.name, "pp": layout.pp, "schedule": layout.schedule, "v": layout.v, "m": layout.m,
        "step_seconds": step, "steps": [w["step"] for w in walls],
        "tokens_per_s": layout.m * opts.micro_batch * opts.seq_len / step,
        "bubble_formula": plan["bubble"],
        "bubble_wall": {key: med(summarise(w["bubble"])[key] for w in walls) for key in ("mean", "worst")},
        "bubble_p2p_only": {key: med(summarise(p2p_bubble(r))[key] for r in rounds) for key in ("mean", "worst")},
        "bubble_replay": {key: med(summarise(r["bubble"])[key] for r in replays) for key in ("mean", "worst")},
        "replay_step_seconds": med(r["step"] for r in replays),
        "rounds_mean_bubble": {"wall": [summarise(w["bubble"])["mean"] for w in walls],
                               "replay": [summarise(r["bubble"])["mean"] for r in replays]},
        "bubble_shared": {key: med(summarise(r["bubble"])[key] for r in shared) for key in ("mean", "worst")},
        "bubble_even": {key: med(summarise(r["bubble"])[key] for r in even) for key in ("mean", "worst")},
        "stage_costs": {s: {k: med(c[s][k] for c in costs) for k in ("F", "B")} for s in costs[0]},
        "shared_step_seconds": med(r["step"] for r in shared), "cores": opts.cores,
        "wall_bubble_per_rank": {k: med(w["bubble"][k] for w in walls) for k in walls[0]["bubble"]},
        "p2p_waits_per_rank": {k: med(r[k]["n_waits"] for r in rounds) for k in rounds[0]},
        "compute_cpu_per_rank": {k: med(r[k]["compute_cpu"] for r in rounds) for k in rounds[0]},
        "slowdown": med(sum(v["compute_wall"] for v in r.values()) / sum(v["compute_cpu"] for v in r.values())
                        for r in rounds),
        "activations_per_rank": {k: m["peak"] for k, m in memory.items()}, "activations": peak,
        "activations_planned": plan["activations"],
        "in_flight": max(memory[k]["peak"] / per_micro_batch[k] for k in memory),
        "in_flight_planned": plan["in_flight"],
        "held_outputs": max(m["held"] for m in memory.values()),
    }


def report(rows: list[dict], meta: dict, out: Path) -> None:
    loads = meta["load_average"]["rounds"]
    print(f"pipeline parallelism, preset {meta['preset']} x {meta['n_layers']} layers, micro-batch "
          f"{meta['micro_batch']} x {meta['seq_len']} tokens, fp32, {meta['world']} ranks on {meta['cores']} cores, "
          f"median of {meta['rounds']} rounds, load average {min(loads):.1f}-{max(loads):.1f}")
    print(f"bubble: formula; wall (P2P waits + ends), mean and worst rank, mean / formula; shared: the replay on "
          f"{rows[0]['cores']} cores; replay on a core per rank, mean, worst, mean / formula; even: the replay with every "
          f"F and every B at their means (the schedule where stages are even). slow: compute wall / CPU")
    print(f"{'layout':<28} {'tokens/s':>8} {'step s':>7} {'formula':>7} {'wall':>6} {'worst':>6} {'ratio':>6} "
          f"{'shared':>6} {'replay':>6} {'worst':>6} {'ratio':>6} {'even':>6} {'slow':>5} {'act MiB':>8} {'plan':>7} {'flight':>6} "
          f"{'plan':>5} {'held':>6}")
    for r in rows:
        f, w, p = r["bubble_formula"], r["bubble_wall"], r["bubble_replay"]
        print(f"{r['layout']:<28} {r['tokens_per_s']:>8.0f} {r['step_seconds']:>7.3f} {f:>7.3f} {w['mean']:>6.3f} "
              f"{w['worst']:>6.3f} {w['mean'] / f:>6.2f} {r['bubble_shared']['mean']:>6.3f} "
              f"{p['mean']:>6.3f} {p['worst']:>6.3f} {p['mean'] / f:>6.2f} {r['bubble_even']['mean']:>6.3f} "
              f"{r['slowdown']:>5.2f} {r['activations'] / MIB:>8.1f} {r['activations_planned'] / MIB:>7.1f} "
              f"{r['in_flight']:>6.2f} {r['in_flight_planned']:>5.2f} {r['held_outputs'] / MIB:>6.1f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
