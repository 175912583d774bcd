"""Mixture of experts on this CPU: training at ep 1 against ep 2, the all-to-all's share of a step,
and the experts' grouped GEMM against a loop over the experts (issue 52).

    OMP_NUM_THREADS=1 python3 bench/experts.py [--pairs 2] [--steps 3]

training  A tiny Llama 4 (--shape: "moe", below, or a preset such as debug_llama4) trained at world 2
          as dp_shard 2 x ep 1 (A: every weight sharded by FSDP over both ranks) and dp_shard 2 x
          ep 2 (B: each rank holds half the experts, the tokens travel to them by all-to-all; the
          rest sharded by FSDP as in A), each run its own 2 processes (bench/run.py's launch,
          bench/worker.py's trainer step), runs interleaved A B A B (--pairs pairs), the first
          --warmup steps of a run left out. Per run: tokens/s of the world (the slowest rank's step),
          each rank's parameter bytes (all, and the experts'), gradients and AdamW moments (distinct
          local storages), peak resident memory during training (VmHWM reset after set-up),
          collective bytes per step, and the losses, which A and B should share (same weights, data).
exchange  At ep 2, the seconds each rank spends in expert parallelism's token exchange over its
          step: the forward's dispatch and combine whole (the counts' all-to-all, the tokens'
          all-to-all, the regrouping by expert) and the backward's two all-to-alls, timed around
          them (ExchangeTimer). It includes waiting for the other rank to arrive.
gemm      GroupedExperts' forward + backward (three expert matmuls: w1, w3, w2) with torch._grouped_mm
          against the loop of one matmul per expert, in one process on one thread, fp32 and bf16,
          for several expert and token counts (tokens routed uniformly at random), interleaved,
          the median of --gemm-repeats; the output's and every gradient's largest difference.
Prints the tables and writes bench/results/experts.json (--out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Llama 4's layout, small enough for this CPU: every layer a mixture of 8 experts, top 2, with the
# shared expert; one RoPE-less layer; chunked attention shorter than the sequence.
MOE = {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 4096, "ffn_hidden_size": 512,
       "norm_eps": 1e-5, "rope_theta": 500000.0, "max_seq_len": 256, "embedding_split": "vocab",
       "n_experts": 8, "experts_per_token": 2, "expert_hidden_size": 512, "nope_layers": [3],
       "attn_temperature_tuning": True, "floor_scale": 8, "attn_scale": 0.1, "use_qk_norm": True,
       "attention_chunk_size": 64}
OPTIM = {"lr": 1e-3, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "grad_clip": 1.0}
MIB = 2**20


class ExchangeTimer:
    """Seconds spent in expert parallelism's token exchange while entered: hybridpar.models.moe's
    dispatch and combine (forward, whole) and hybridpar.parallel.experts' all-to-all outside them
    (the backward's). Patches the module attributes those calls look up; restores them on exit."""

    def __init__(self) -> None:
        self.seconds = self.cpu_seconds = 0.0  # wall time; this process's CPU time (gloo does not spin)
        self._inside = False
        self._saved: list = []

    def _timed(self, fn, outer: bool):
        def wrapper(*args, **kwargs):
            if self._inside:  # the forward's all-to-all, inside dispatch or combine: counted there
                return fn(*args, **kwargs)
            self._inside = outer
            began, cpu_began = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - began
                self.cpu_seconds += time.process_time() - cpu_began
                self._inside = False
        return wrapper

    def __enter__(self) -> "ExchangeTimer":
        from hybridpar.models import moe
        from hybridpar.parallel import experts

        self.seconds = self.cpu_seconds = 0.0
        for module, name, outer in ((moe, "dispatch", True), (moe, "combine", True), (experts, "_exchange", False)):
            original = getattr(module, name)
            self._saved.append((module, name, original))
            setattr(module, name, self._timed(original, outer))
        return self

    def __exit__(self, *exc) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()


# --- training at ep 1 and ep 2 ---------------------------------------------------------------------


def _case(opts, shape: dict, ep: int) -> dict:
    return {"engines": [{"name": "hybridpar", "engine": "hybridpar", "fsdp": {}, "optimizer": "trainer"}],
            "engine": "hybridpar", "label": f"dp_shard 2 x ep {ep}", "shape": shape, "mp": 1, "dp_shard": 2,
            "dp_replicate": 1, "ep": ep, "strategy": "full_shard", "micro_batch": opts.micro_batch,
            "seq_len": opts.seq_len, "steps": opts.steps, "warmup": opts.warmup, "seed": 0, "optim": OPTIM,
            "peak_seconds": 0.1, "precision": "float32", "time_exchange": ep > 1}


def _summarise(case: dict, ranks: list[dict]) -> dict:
    """One run's figures from its ranks' results (bench/worker.py's)."""
    mine = [r["engines"]["hybridpar"] for r in ranks]
    timed = range(case["warmup"], case["warmup"] + case["steps"])
    slowest = [max(r["step_times"][i] for r in mine) for i in timed]
    step = statistics.median(slowest)
    # CPU seconds of both ranks per step: the work, much less sensitive to the machine's other load
    cpu = statistics.median(sum(r["cpu_times"][i] for r in mine) for i in timed)
    tokens = case["micro_batch"] * case["seq_len"] * case["dp_shard"]
    out = {"ep": case["ep"], "step_s": step, "step_times_slowest_rank": slowest, "tokens_per_s": tokens / step,
           "cpu_s_per_step": cpu, "tokens_per_cpu_s": tokens / cpu,
           "state_bytes": [r["state_bytes"] for r in mine], "peak_rss_train": [r["peak_rss_train"] for r in ranks],
           "comm_wire_bytes": [r["comm_wire"] for r in mine], "comm_rank0": mine[0]["comm"],
           "losses": mine[0]["losses"]}
    if case["time_exchange"]:
        # Each rank's exchange seconds over its own step seconds, summed over the timed steps.
        out["exchange_share"] = [sum(r["exchange_times"][i] for i in timed) / sum(r["step_times"][i] for i in timed)
                                 for r in mine]
        out["exchange_s"] = [statistics.median(r["exchange_times"][i] for i in timed) for r in mine]
        out["exchange_cpu_share"] = [sum(r["exchange_cpu_times"][i] for i in timed) / sum(r["cpu_times"][i] for i in timed)
                                     for r in mine]
    return out


def train_pairs(opts, shape: dict) -> list[dict]:
    from bench.run import launch

    runs = []
    for pair in range(opts.pairs):
        for ep in (1, 2):
            case = _case(opts, shape, ep)
            runs.append({"pair": pair, **_summarise(case, launch(case, 2, opts.timeout))})
            print(f"  pair {pair + 1} ep {ep}: {runs[-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    return runs


# --- grouped GEMM against the loop -----------------------------------------------------------------


def _experts_step(experts, x, counts, grouped: bool):
    """Forward + backward of the experts on x; (seconds, [output, x's grad, w1's, w3's, w2's])."""
    import torch

    experts.grouped = grouped
    experts.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    began = time.perf_counter()
    y = experts(x, counts)
    y.backward(torch.full_like(y, 1.0 / y.shape[0]))  # the gradient of a mean: bf16 sums stay in range
    took = time.perf_counter() - began
    return took, [y.detach(), x.grad] + [w.grad for w in (experts.w1, experts.w3, experts.w2)]


def gemm_rows(opts) -> list[dict]:
    import torch

    import hybridpar
    from hybridpar.models.moe import GroupedExperts, grouped_mm_allowed

    torch.set_num_threads(1)
    parallel = hybridpar.init_parallel(backend="gloo")  # a world of one: the experts whole
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for n_experts in (int(e) for e in opts.gemm_experts.split(",")):
            for tokens in (int(t) for t in opts.gemm_tokens.split(",")):
                torch.manual_seed(0)
                experts = GroupedExperts(n_experts, opts.gemm_dim, opts.gemm_hidden, parallel, 0.02, 0.02, dtype=dtype)
                g = torch.Generator().manual_seed(1)
                counts = torch.bincount(torch.randint(0, n_experts, (tokens,), generator=g), minlength=n_experts)
                x = torch.randn(tokens, opts.gemm_dim, generator=g).to(dtype)
                assert grouped_mm_allowed(x, experts.w1) and grouped_mm_allowed(x, experts.w2), (dtype, opts.gemm_dim)
                times, results = {True: [], False: []}, {}
                for r in range(opts.gemm_repeats + 1):  # round 0: warm-up, and the results compared
                    for grouped in ((True, False) if r % 2 == 0 else (False, True)):
                        took, results[grouped] = _experts_step(experts, x, counts, grouped)
                        if r:
                            times[grouped].append(took)
                diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(results[True], results[False])]
                grouped_s, loop_s = statistics.median(times[True]), statistics.median(times[False])
                rows.append({"dtype": str(dtype).replace("torch.", ""), "experts": n_experts, "tokens": tokens,
                             "dim": opts.gemm_dim, "hidden": opts.gemm_hidden, "grouped_s": grouped_s,
                             "loop_s": loop_s, "loop_over_grouped": loop_s / grouped_s,
                             "max_abs_diff": max(diffs), "max_abs_diff_output": diffs[0],
                             "max_abs_output": results[False][0].float().abs().max().item(),
                             "grouped_times": times[True], "loop_times": times[False]})
                print(f"  {rows[-1]['dtype']} {n_experts} experts {tokens} tokens: loop / grouped "
                      f"{rows[-1]['loop_over_grouped']:.2f}x, max abs diff {max(diffs):.2e}", flush=True)
    return rows


# --- the report --------------------------------------------------------------------------------------


def report(opts, shape: dict, runs: list[dict], gemm: list[dict]) -> dict:
    by_ep = {ep: [r for r in runs if r["ep"] == ep] for ep in (1, 2)}
    pairs = list(zip(by_ep[1], by_ep[2]))
    summary = {}
    for ep, mine in by_ep.items():
        state = mine[0]["state_bytes"]
        summary[ep] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
            "step_s": statistics.median(r["step_s"] for r in mine),
            "tokens_per_cpu_s": statistics.median(r["tokens_per_cpu_s"] for r in mine),
            "parameters_per_rank": [s["parameters"] for s in state],
            "expert_parameters_per_rank": [s["expert_parameters"] for s in state],
            "state_per_rank": [s["parameters"] + s["gradients"] + s["optimizer"] for s in state],
            "peak_rss_train_per_rank": [max(r["peak_rss_train"][k] for r in mine) for k in range(2)],
            "comm_wire_bytes_per_rank": mine[0]["comm_wire_bytes"],
        }
        for key in ("exchange_share", "exchange_cpu_share"):
            if key in mine[0]:
                summary[ep][key + "_per_rank"] = [statistics.median(r[key][k] for r in mine) for k in range(2)]
    loss_diff = max((abs(x - y) / abs(x) for a, b in pairs for x, y in zip(a["losses"], b["losses"])), default=None)
    return {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
            "options": vars(opts), "shape": shape, "runs": runs, "summary": summary,
            "pair_ratios": [b["tokens_per_s"] / a["tokens_per_s"] for a, b in pairs],
            "pair_ratios_cpu": [b["tokens_per_cpu_s"] / a["tokens_per_cpu_s"] for a, b in pairs],
            "loss_max_rel_diff_ep1_ep2": loss_diff, "gemm": gemm}


def _per_rank(values, scale: float, digits: int) -> str:
    return "/".join(f"{x / scale:.{digits}f}" for x in values)


def training_table(rep: dict) -> list[str]:
    o = rep["options"]
    lines = [f"MoE training at world 2 ({o['shape']}: {rep['shape']['n_experts']} experts, top "
             f"{rep['shape']['experts_per_token']}; {o['micro_batch']} x {o['seq_len']} tokens per rank, fp32), "
             f"{o['pairs']} pairs of runs A B, {o['steps']} timed steps each; per rank: rank 0/rank 1",
             f"{'layout':<18} {'tokens/s':>9} {'s/step':>7} {'tokens/CPU-s':>13} {'params MiB':>12} {'experts':>12} "
             f"{'state MiB':>12} {'peak RSS MiB':>13} {'wire MiB':>10} {'all-to-all share wall | CPU':>28}"]
    for ep, row in rep["summary"].items():
        share = " | ".join(_per_rank(row[k], 0.01, 1) + " %" for k in ("exchange_share_per_rank",
                                                                      "exchange_cpu_share_per_rank") if k in row)
        lines.append(f"{'dp_shard 2 x ep ' + str(ep):<18} {row['tokens_per_s']:>9.0f} {row['step_s']:>7.3f} "
                     f"{row['tokens_per_cpu_s']:>13.0f} {_per_rank(row['parameters_per_rank'], MIB, 2):>12} "
                     f"{_per_rank(row['expert_parameters_per_rank'], MIB, 2):>12} "
                     f"{_per_rank(row['state_per_rank'], MIB, 1):>12} {_per_rank(row['peak_rss_train_per_rank'], MIB, 0):>13} "
                     f"{_per_rank(row['comm_wire_bytes_per_rank'], MIB, 1):>10} {share or '-':>28}")
    ratios = ", ".join(f"{x:.3f}" for x in rep["pair_ratios"])
    ratios_cpu = ", ".join(f"{x:.3f}" for x in rep["pair_ratios_cpu"])
    lines.append(f"ep 2 / ep 1 per pair: tokens/s {ratios}; tokens per CPU-second {ratios_cpu}; "
                 f"losses ep 1 vs ep 2: max relative difference {rep['loss_max_rel_diff_ep1_ep2']:.1e}")
    return lines


def gemm_table(rep: dict) -> list[str]:
    first = rep["gemm"][0]
    lines = [f"experts' forward + backward (dim {first['dim']}, hidden {first['hidden']}), one thread, "
             f"median of {rep['options']['gemm_repeats']}",
             f"{'dtype':<9} {'experts':>7} {'tokens':>7} {'grouped ms':>11} {'loop ms':>9} "
             f"{'loop / grouped':>15} {'max abs diff':>13}"]
    lines += [f"{g['dtype']:<9} {g['experts']:>7} {g['tokens']:>7} {g['grouped_s'] * 1e3:>11.2f} {g['loop_s'] * 1e3:>9.2f} "
              f"{g['loop_over_grouped']:>14.2f}x {g['max_abs_diff']:>13.1e}" for g in rep["gemm"]]
    return lines


def table(rep: dict) -> str:
    lines = training_table(rep) + (["", *gemm_table(rep)] if rep["gemm"] else [])
    lines.append("(this CPU: gloo all-to-all between 2 processes on shared cores, and the CPU's _grouped_mm; "
                 "not a GPU's NCCL or grouped-GEMM kernels)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="moe", help='"moe" (this file\'s MOE) or a preset with experts')
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=2, help="runs A (ep 1) B (ep 2), this many times")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each run")
    parser.add_argument("--warmup", type=int, default=1, help="steps of each run left out")
    parser.add_argument("--gemm-experts", default="4,16,64")
    parser.add_argument("--gemm-tokens", default="256,2048", help="token slots (tokens x top-k) routed")
    parser.add_argument("--gemm-dim", type=int, default=256)
    parser.add_argument("--gemm-hidden", type=int, default=512)
    parser.add_argument("--gemm-repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600, help="seconds for one run's 2 processes")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "experts.json"))
    opts = parser.parse_args(argv)

    from bench.run import shape_dict

    shape = dict(MOE) if opts.shape == "moe" else shape_dict(opts.shape)
    if not shape.get("n_experts"):
        raise SystemExit(f"--shape {opts.shape}: a dense model (no n_experts); use moe or debug_llama4")
    print("training, runs interleaved A B:", flush=True)
    runs = train_pairs(opts, shape)
    print("grouped GEMM against the loop:", flush=True)
    gemm = gemm_rows(opts) if opts.gemm_experts else []
    rep = report(opts, shape, runs, gemm)
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(rep, indent=1) + "\n")
    os.replace(tmp, out)
    print(table(rep))
    print(f"wrote {out}")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
