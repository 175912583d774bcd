"""Training throughput: hybridpar against the seed recipe (Meta's Llama on fairscale + FSDP1), on the CPU.

    python3 bench/run.py                                 # the full table: tiny and small, 4 layouts, weak scaling
    python3 bench/run.py --shapes tiny --layouts 2:2:1 --repeats 3 --weak ""
    python3 bench/run.py --engines hybridpar,variant --fsdp gloo_all_to_all=0    # A/B of an option
    python3 bench/run.py --baseline /tmp/hybridpar-before --engines hybridpar,baseline   # A/B of two versions
    python3 bench/run.py --compile hybridpar             # hybridpar with train.compile = true
    python3 bench/run.py --engines hybridpar,variant --sequence-parallel 0   # without sequence parallelism

Each run starts `world` fresh processes (OMP_NUM_THREADS=1, gloo, a free port), so peak memory and
process-global state (fairscale's groups) never leak between runs. 4-8 ranks on 2 shared cores vary
by 30% or more between runs, so engines that can share processes (hybridpar, recipe, variant) are
built side by side in one run and take turns step by step (A B, B A, ...); "baseline" (hybridpar
from another folder) runs alone, interleaved run by run. Each engine also runs alone once, for its
peak memory. Compare ratios, not absolute figures.

Per (shape, layout, engine) it reports
  tokens/s and step time   median over the timed steps (after warm-up) of the slowest rank's step
  tokens per CPU-second    process CPU time summed over ranks (gloo does not spin while waiting):
                           the work done, much less sensitive to other load than wall time
  MFU                      flops_per_token x tokens/s / (matmul peak x world); the peak is measured
                           by every rank at once at the start of the same run (same contention);
                           CPU MFU: model FLOPs per CPU-second over the peak per CPU-second
  state / ideal            per-rank bytes of parameters + gradients + AdamW moments (distinct
                           storages, read after backward of a counted step) against 4 x 4 bytes x
                           parameters / (mp x dp_shard)
  comm / analytic          wire bytes per rank of one step, counted by wrapping torch.distributed
                           (bench/comm.py), against the layout's analytic minimum
  peak RSS                 the largest rank's peak resident set during training (VmHWM reset after
                           set-up), and over the whole process
  losses                   every step's loss; hybridpar and the recipe start from the same full
                           weights and read the same batches, so they should agree
and hybridpar / recipe ratios. Weak scaling: hybridpar at mp 1 x full_shard over 1, 2, 4, 8 ranks
with the tokens per rank fixed. Writes bench/results/train.json (or --out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The small shape: ~50M parameters (6 x 6.3M in the blocks, 12.6M in the embeddings and head).
SMALL = {"dim": 768, "n_layers": 6, "n_heads": 12, "n_kv_heads": 4, "vocab_size": 8192, "multiple_of": 256,
         "norm_eps": 1e-5, "rope_theta": 10000.0, "max_seq_len": 512, "embedding_split": "vocab"}
# The same with Llama 2's vocabulary (32,000): ~87M parameters, 49M of them in the embeddings and head,
# the proportion of a real small Llama, where the cost of full logits shows.
SMALL_32K = {**SMALL, "vocab_size": 32000}
SHAPES = {"small": SMALL, "small32k": SMALL_32K}
BATCH = {"tiny": (4, 128), "small": (2, 256), "small32k": (2, 256), "debug": (2, 32)}  # (micro-batch per dp rank, seq_len)
OPTIM = {"lr": 1e-3, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "grad_clip": 1.0}
DEFAULT_LAYOUTS = "1:4:1,2:2:1,2:2:2,4:1:1"

from bench.run_cases import launch, summarise  # noqa: E402


def shape_dict(name: str) -> dict:
    if name in SHAPES:
        return dict(SHAPES[name])
    from hybridpar.models.args import PRESETS_DIR

    path = PRESETS_DIR / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"unknown shape {name!r}: use {' or '.join(SHAPES)} or a preset of models/presets")
    return json.loads(path.read_text())


def parse_layout(text: str) -> tuple[int, int, int]:
    try:
        mp, shard, rep = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"layout {text!r}: write MP:DP_SHARD:DP_REPLICATE, e.g. 2:2:1") from None
    if min(mp, shard, rep) < 1:
        raise SystemExit(f"layout {text!r}: sizes must be >= 1")
    return mp, shard, rep


def layout_label(mp: int, shard: int, rep: int) -> str:
    if rep > 1:
        return f"mp{mp} x hybrid {rep}x{shard}"
    if mp == 1:
        return f"mp1 x full_shard dp{shard}"
    return f"mp{mp} x dp{shard}"


def strategy_for(shard: int, rep: int) -> str:
    return "hybrid_shard" if rep > 1 else "full_shard"


def rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def median_of(runs: list[dict], key: str):
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def fmt_bytes(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,small", help="comma list: small or model presets (tiny, debug)")
    parser.add_argument("--layouts", default=DEFAULT_LAYOUTS, help="comma list of MP:DP_SHARD:DP_REPLICATE")
    parser.add_argument("--engines", default="hybridpar,recipe",
                        help="comma list of hybridpar, recipe, baseline (hybridpar from --baseline), "
                             "variant (hybridpar with --fsdp / --optimizer)")
    parser.add_argument("--baseline", default="", help="a folder holding another hybridpar/ and models/ (A/B)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds per layout")
    parser.add_argument("--mode", default="paired", choices=("paired", "separate"),
                        help="paired: hybridpar and the recipe in the same processes, alternating step by step; "
                             "separate: one run per engine, interleaved (always so with baseline)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--micro-batch", type=int, default=0, help="per data-parallel rank (0: per-shape default)")
    parser.add_argument("--seq-len", type=int, default=0, help="0: per-shape default")
    parser.add_argument("--weak", default="1,2,4,8", help="world sizes for weak scaling (empty: skip)")
    parser.add_argument("--weak-shape", default="tiny")
    parser.add_argument("--fsdp", default="", help="extra FSDPConfig fields for hybridpar, e.g. forward_prefetch=0")
    parser.add_argument("--peak-seconds", type=float, default=1.0, help="matmul peak measurement per run")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "train.json"))
    parser.add_argument("--optimizer", default="trainer", choices=("trainer", "foreach"),
                        help="variant's AdamW: as Trainer builds it (fused), or torch's foreach")
    parser.add_argument("--compile", default="", help="comma list of hybridpar engines (hybridpar, variant, "
                        "baseline) that torch.compile their blocks, as train.compile = true does")
    parser.add_argument("--sequence-parallel", type=int, default=1, choices=(0, 1),
                        help="variant's parallel.sequence_parallel (hybridpar runs the trainer's default, on)")
    parser.add_argument("--precision", default="float32", choices=("float32", "bfloat16"),
                        help="compute dtype of both engines (FSDP param_dtype; gradients reduce in fp32)")
    opts = parser.parse_args(argv)
    # A SIGTERM unwinds like Ctrl-C, so launch() still stops the ranks it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from hybridpar.models.args import ModelArgs

    from hybridpar.files import write_text_atomic

    engines = [e for e in opts.engines.split(",") if e]
    bad = sorted(set(engines) - {"hybridpar", "recipe", "baseline", "variant"})
    if bad:
        raise SystemExit(f"unknown engines {bad}: choose from hybridpar, recipe, baseline, variant")
    if "baseline" in engines and not (Path(opts.baseline) / "hybridpar").is_dir():
        raise SystemExit("--engines baseline needs --baseline DIR with a hybridpar/ folder in it")
    fsdp_extra = {}
    for item in filter(None, opts.fsdp.split(",")):
        key, _, value = item.partition("=")
        fsdp_extra[key] = int(value) if value.lstrip("-").isdigit() else value

    def spec(engine: str) -> dict:
        if engine == "recipe":
            return {"name": "recipe", "engine": "recipe"}
        # Options under test (--fsdp, --optimizer) apply to "variant" only: hybridpar of this tree
        # with them, against "hybridpar" with the defaults, in the same processes.
        compiled = engine in opts.compile.split(",")
        if engine == "variant":
            return {"name": "variant", "engine": "hybridpar", "fsdp": fsdp_extra, "optimizer": opts.optimizer,
                    "compile": compiled, "sequence_parallel": bool(opts.sequence_parallel)}
        out = {"name": engine, "engine": "hybridpar", "fsdp": {}, "optimizer": "trainer", "compile": compiled}
        if engine == "hybridpar":  # a baseline checkout may predate the option
            out["sequence_parallel"] = True
        return out

    def make_case(names, shape_name, mp, shard, rep, micro, seq, steps, warmup):
        case = {
            "engines": [spec(e) for e in names], "shape_name": shape_name,
            "shape": shape_dict(shape_name), "mp": mp, "dp_shard": shard, "dp_replicate": rep,
            "strategy": strategy_for(shard, rep), "label": layout_label(mp, shard, rep),
            "micro_batch": micro, "seq_len": seq, "steps": steps, "warmup": warmup, "seed": opts.seed,
            "optim": OPTIM, "peak_seconds": opts.peak_seconds, "precision": opts.precision,
        }
        if "baseline" in names:
            case["hybridpar_path"] = str(Path(opts.baseline).resolve())
        return case

    def run(names, shape_name, mp, shard, rep, micro, seq, steps, warmup, args_obj) -> dict:
        case = make_case(names, shape_name, mp, shard, rep, micro, seq, steps, warmup)
        ranks = launch(case, mp * shard * rep, opts.timeout)
        return {name: summarise(case, ranks, name, args_obj) for name in names}

    import torch

    def write_report(complete: bool) -> None:
        """The JSON so far: written after every layout, so a stopped run keeps what it measured."""
        report = {
            "benchmark": "training throughput: hybridpar vs the seed recipe (fairscale + FSDP1)",
            "complete": complete, "started": started.isoformat(timespec="seconds"),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                        "python": platform.python_version()},
            "options": vars(opts), "optim": OPTIM, "cases": cases_out, "ratios": ratio_rows, "weak_scaling": weak,
        }
        out = Path(opts.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out, json.dumps(report, indent=1) + "\n")
        if complete:
            print(f"\nwrote {out}")

    weak: list[dict] = []
    # Engines that can share processes take turns step by step in one run (paired); "baseline" is
    # another copy of hybridpar, so it needs processes of its own (interleaved run by run).
    paired = opts.mode == "paired" and "baseline" not in engines and len(engines) > 1
    started = datetime.datetime.now(datetime.timezone.utc)
    cases_out, ratio_rows = [], []
    print(f"training throughput, {os.cpu_count()} cores, engines {engines}, {opts.repeats} rounds "
          f"({'paired: engines alternate step by step in one run' if paired else 'one run per engine, A B B A'}), "
          f"{opts.warmup} warm-up + {opts.steps} timed steps", flush=True)
    for shape_name in filter(None, opts.shapes.split(",")):
        micro, seq = BATCH.get(shape_name, (2, 128))
        micro, seq = opts.micro_batch or micro, opts.seq_len or seq
        args_obj = ModelArgs.from_dict(shape_dict(shape_name))
        for layout in filter(None, opts.layouts.split(",")):
            mp, shard, rep = parse_layout(layout)
            world = mp * shard * rep
            label = layout_label(mp, shard, rep)
            timing: dict[str, list[dict]] = {e: [] for e in engines}
            memory: dict[str, dict] = {}
            for round_ in range(opts.repeats):
                if paired:
                    batch = [engines if round_ % 2 == 0 else engines[::-1]]
                else:  # A B, B A: neither always goes first
                    batch = [[e] for e in (engines if round_ % 2 == 0 else engines[::-1])]
                for names in batch:
                    for name, s in run(names, shape_name, mp, shard, rep, micro, seq, opts.steps, opts.warmup,
                                       args_obj).items():
                        timing[name].append(s)
                        if len(names) == 1:
                            memory.setdefault(name, s)
                        print(f"  {shape_name:<6} {label:<22} {name:<10} round {round_ + 1}: "
                              f"{s['tokens_per_s']:>9,.0f} tok/s  {s['tokens_per_cpu_s']:>7,.0f} tok/cpu-s  "
                              f"step {1000 * s['step_time']:>8.1f} ms  mfu {100 * s['mfu']:5.1f}% "
                              f"(cpu {100 * s['mfu_cpu']:5.1f}%)  loss {s['losses'][-1]:.5f}", flush=True)
            for name in engines:  # peak memory needs a run of each engine alone
                if name not in memory:
                    memory[name] = run([name], shape_name, mp, shard, rep, micro, seq, 1, 1, args_obj)[name]
            for name in engines:
                rs = timing[name]
                mem = memory[name]
                cases_out.append({
                    "shape": shape_name, "params": args_obj.num_params(), "layout": label,
                    "mp": mp, "dp_shard": shard, "dp_replicate": rep, "world": world, "engine": name,
                    "micro_batch": micro, "seq_len": seq,
                    "median": {k: median_of(rs, k) for k in ("tokens_per_s", "tokens_per_cpu_s", "step_time", "mfu",
                                                            "mfu_cpu")},
                    "memory_run": {k: mem[k] for k in ("state_bytes", "state_ideal", "state_ratio", "comm_wire_bytes",
                                                        "comm_analytic", "comm_ratio", "comm_by_op_rank0",
                                                        "comm_calls_rank0", "comm_cpu_share", "peak_rss_train_max",
                                                        "peak_rss_lifetime_max", "losses")},
                    "runs": rs,
                })
            pairs = [("hybridpar", e) for e in engines if e not in ("hybridpar", "variant")]
            if "variant" in engines and "hybridpar" in engines:
                pairs.append(("variant", "hybridpar"))
            for mine, other in (pairs if "hybridpar" in engines else []):
                a, mem_a = timing[mine], memory[mine]
                b, mem_b = timing[other], memory[other]
                per_round = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(a, b)]
                ratio_rows.append({
                    "shape": shape_name, "layout": label, "engine": mine, "vs": other, "paired": paired,
                    "tokens_per_s": median_of(a, "tokens_per_s") / median_of(b, "tokens_per_s"),
                    "per_round_tokens_per_s": per_round,
                    "median_of_round_ratios": statistics.median(per_round),
                    "tokens_per_cpu_s": median_of(a, "tokens_per_cpu_s") / median_of(b, "tokens_per_cpu_s"),
                    "peak_rss_train": (mem_a["peak_rss_train_max"] / mem_b["peak_rss_train_max"]
                                       if mem_b["peak_rss_train_max"] else None),
                    "state_bytes": sum(mem_a["state_bytes"].values()) / sum(mem_b["state_bytes"].values()),
                    "comm_wire_bytes": (mem_a["comm_wire_bytes"] / mem_b["comm_wire_bytes"]
                                        if mem_b["comm_wire_bytes"] else None),
                    "loss_max_rel_diff": max(rel_diff(x["losses"], y["losses"]) for x, y in zip(a + [mem_a], b + [mem_b])),
                })
            write_report(False)

    worlds = [int(w) for w in opts.weak.split(",") if w]
    if worlds and "hybridpar" in engines:
        micro, seq = BATCH.get(opts.weak_shape, (2, 128))
        micro, seq = opts.micro_batch or micro, opts.seq_len or seq
        args_obj = ModelArgs.from_dict(shape_dict(opts.weak_shape))
        per_world: dict[int, list[dict]] = {w: [] for w in worlds}
        for round_ in range(opts.repeats):
            for w in (worlds if round_ % 2 == 0 else worlds[::-1]):
                s = run(["hybridpar"], opts.weak_shape, 1, w, 1, micro, seq, opts.steps, opts.warmup, args_obj)["hybridpar"]
                per_world[w].append(s)
                print(f"  weak {opts.weak_shape} world {w}: {s['tokens_per_s']:,.0f} tok/s  "
                      f"{s['tokens_per_cpu_s']:,.0f} tok/cpu-s  mfu {100 * s['mfu']:.1f}%  "
                      f"peak/rank {s['peak_flops_per_rank'] / 1e9:.1f} GFLOP/s", flush=True)
        base = per_world[worlds[0]]
        base_tok = median_of(base, "tokens_per_s") / worlds[0]
        base_peak = median_of(base, "peak_flops_per_rank")
        base_cpu = median_of(base, "tokens_per_cpu_s")
        for w in worlds:
            rs = per_world[w]
            tok = median_of(rs, "tokens_per_s")
            weak.append({
                "world": w, "tokens_per_s": tok, "tokens_per_s_per_rank": tok / w,
                "efficiency": tok / w / base_tok, "mfu": median_of(rs, "mfu"), "mfu_cpu": median_of(rs, "mfu_cpu"),
                "peak_flops_per_rank": median_of(rs, "peak_flops_per_rank"),
                "peak_share": median_of(rs, "peak_flops_per_rank") / base_peak,
                "efficiency_vs_peak": (tok / w / base_tok) / (median_of(rs, "peak_flops_per_rank") / base_peak),
                "cpu_efficiency": median_of(rs, "tokens_per_cpu_s") / base_cpu,
                "comm_share_of_step": statistics.median(r["comm_seconds_max"] / r["counted_step_time_max"] for r in rs),
                "comm_wire_bytes": rs[0]["comm_wire_bytes"], "runs": rs,
            })

    # --- the table --------------------------------------------------------------------------------
    print()
    header = (f"{'shape':<6} {'layout':<22} {'engine':<9} {'tok/s':>8} {'tok/cpu-s':>9} {'step ms':>8} {'MFU':>6} "
              f"{'cpu MFU':>7} {'state/ideal':>11} {'comm MiB':>9} {'comm/min':>8} {'RSS MiB':>8} {'loss':>9}")
    print(header)
    print("-" * len(header))
    for c in cases_out:
        m, mem = c["median"], c["memory_run"]
        print(f"{c['shape']:<6} {c['layout']:<22} {c['engine']:<9} {m['tokens_per_s']:>8,.0f} {m['tokens_per_cpu_s']:>9,.0f} "
              f"{1000 * m['step_time']:>8.1f} {100 * m['mfu']:>5.1f}% {100 * m['mfu_cpu']:>6.1f}% "
              f"{mem['state_ratio']['total']:>11.4f} {fmt_bytes(mem['comm_wire_bytes']):>9} "
              f"{(mem['comm_ratio'] or 0):>8.3f} {fmt_bytes(mem['peak_rss_train_max']):>8} {mem['losses'][-1]:>9.5f}")
    if ratio_rows:
        print()
        print("ratios engine / vs: tok/s is the ratio of medians (per round: each round's ratio); "
              "tok/cpu-s the same for tokens per CPU-second")
        print(f"{'shape':<6} {'layout':<22} {'engine / vs':<19} {'tok/s':>6} {'per round':>24} {'tok/cpu-s':>9} {'RSS':>6} "
              f"{'state':>6} {'comm':>6} {'loss rel diff':>13}")
        for r in ratio_rows:
            rounds = " ".join(f"{x:.2f}" for x in r["per_round_tokens_per_s"])
            rss = "-" if r["peak_rss_train"] is None else f"{r['peak_rss_train']:.3f}"
            comm = "-" if r["comm_wire_bytes"] is None else f"{r['comm_wire_bytes']:.3f}"
            print(f"{r['shape']:<6} {r['layout']:<22} {r['engine'] + ' / ' + r['vs']:<19} {r['tokens_per_s']:>6.3f} {rounds:>24} "
                  f"{r['tokens_per_cpu_s']:>9.3f} {rss:>6} {r['state_bytes']:>6.3f} {comm:>6} "
                  f"{r['loss_max_rel_diff']:>13.2e}")
    if weak:
        print()
        print(f"weak scaling, hybridpar, {opts.weak_shape}, mp1 x full_shard, {micro} x {seq} tokens per rank per step "
              f"(efficiency = tok/s per rank against world {worlds[0]}; peak = the matmul peak per rank, same run)")
        print(f"{'world':>5} {'tok/s':>9} {'tok/s/rank':>10} {'efficiency':>10} {'peak/rank':>10} {'eff/peak':>9} "
              f"{'cpu eff':>8} {'MFU':>6} {'comm share':>10}")
        for w in weak:
            print(f"{w['world']:>5} {w['tokens_per_s']:>9,.0f} {w['tokens_per_s_per_rank']:>10,.0f} "
                  f"{w['efficiency']:>10.3f} {w['peak_share']:>10.3f} {w['efficiency_vs_peak']:>9.3f} "
                  f"{w['cpu_efficiency']:>8.3f} {100 * w['mfu']:>5.1f}% {w['comm_share_of_step']:>10.3f}")

    write_report(True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
