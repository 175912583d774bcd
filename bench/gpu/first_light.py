"""The GPU check of issue 40 (bench/gpu/first_light.sh runs it): one command, within one call of a lent
GPU, leaving its figures in files.

Sections run one after the other, each as its own processes under a time limit, the most important
first; a section that fails, or that the time left cannot hold, is a line of the table, not the end
of the check. On a CPU (`--device cpu --tiny`) the same sections run on tiny shapes: CI runs it so.
--float8 trains in bf16 (the pair the float8 runs are compared with), then runs the float8 sections
(float8_sections.py) in place of the others, so that they fit one 10-minute call of a lent GPU;
without it the check is the bf16 one, float8 never taking its time.
Everything goes to --out: first_light.json (every figure), first_light.md (the table for
docs/benchmarks.md), log.txt (every section's output) and fast_tier.log; runs and checkpoints go to
--work, which must have room for two checkpoints (about 40 GB on a GPU).
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from . import float8_sections as float8
from . import save_sections as saves
from . import train_sections as train
from .check import ROOT, Check

TRAINING = ("probe", "layers", "train eager", "train compiled")  # what --float8 keeps of the bf16 sections


def _pct(x) -> str:
    return f"{100 * x:.0f}%" if x else "-"


def _num(x, fmt: str = ",.0f") -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def rows(r: dict) -> list[tuple[str, str]]:
    """(what, figure) lines of the table, from the results."""
    out = []
    p = r.get("probe", {})
    if p.get("ok"):
        out.append(("machine", f"{p['card']} {p['memory_gib']:.0f} GiB, torch {p['torch']}, CUDA {p['cuda']}, "
                               f"NCCL {p['nccl']}, Python {p['python']}, torchao {p.get('torchao') or 'not installed'}"))
        out.append(("bf16 matmul", f"{p['matmul_tflops']:.0f} TFLOP/s measured; nominal "
                                   f"{_num(p['nominal_tflops'])} {p.get('nominal_note') or ''}".strip()))
        out.append(("disk", f"{p['disk_gbs']:.2f} GB/s written (fsynced)"))
    for name in ("gpu tests", "layers"):
        if name in r:
            out.append((name, _describe(r[name])))
    if "float8" in r:
        out.append(("float8", _describe(r["float8"])))
    trained = ["train eager", "train compiled", "torchtitan eager", "torchtitan compiled"]
    for name in trained + [n for n, _, _ in float8.sections(tiny=False) if n != "loss"]:
        t = r.get(name)
        if t is None:
            continue
        if not t.get("ok"):
            out.append((name, _describe(t)))
            continue
        line = (f"{_num(t['tokens_per_s'])} tok/s, {_num(t.get('tflops'), '.0f')} TFLOP/s, MFU {_pct(t.get('mfu_measured'))} "
                f"of measured / {_pct(t.get('mfu_nominal'))} of nominal, peak {_num(t.get('peak_memory_gib') or t.get('peak_mem_gib'), '.1f')} GiB")
        reserved = t.get("reserved_memory_gib") or t.get("reserved_mem_gib_timed")
        if reserved:
            line += f" allocated, {reserved:.1f} GiB reserved"
        plan = t.get("planner") or {}
        if plan.get("tokens_per_s"):
            line += (f"; planner {_num(plan['tokens_per_s'])} tok/s, {plan['memory_gib']:.1f} GiB "
                     f"(measured/planned {t['measured_over_planned']:.2f}"
                     + (f"; planned/reserved {t['planned_over_reserved']:.2f})" if t.get("planned_over_reserved") else ")"))
        if t.get("hybridpar_over_titan"):
            line += f"; hybridpar/torchtitan {t['hybridpar_over_titan']:.2f}"
        if t.get("float8_over_bf16"):
            line += f"; float8/bf16 {t['float8_over_bf16']:.2f}"
        out.append((name, line))
    if "loss" in r:
        out.append(("loss", _loss(r["loss"])))
    s = r.get("saves", {})
    if s.get("ok"):
        a, b = s["async"], s["blocking"]
        model = f"{s['n_layers']} layers of Llama 3 8B's shape, with AdamW's state: " if s.get("n_layers") else ""
        again = s.get("async_again") or {}
        staged = (f" ({a['staging_wait_s']:.1f} s of it waiting for its pinned host copy, begun after step 1 and "
                  f"made in {a['staging_prepared_s']:.1f} s in the background)" if "staging_wait_s" in a else "")
        out.append(("async save", f"{model}training blocked {a['blocked_s']:.1f} s at the first save{staged}, "
                                  f"{_num(again.get('blocked_s'), '.1f')} s at the next; {a['bytes'] / 1e9:.1f} GB "
                                  f"written in {a['written_s']:.1f} s"))
        out.append(("blocking save", f"{b['bytes'] / 1e9:.1f} GB in {b['written_s']:.1f} s = {b['gbs']:.2f} GB/s "
                                     f"({_pct(s.get('blocking_over_disk'))} of the disk's)"))
    elif s:
        out.append(("saves", _describe(s)))
    for name in ("verify", "export hf", "generate", "fast tier"):
        if name in r:
            out.append((name, _describe(r[name])))
    return out


def _loss(d: dict) -> str:
    if not d.get("ok"):
        return _describe(d)
    return (f"{d['steps']} steps on the same batches: bf16 {d['bf16'][0]:.3f} -> {d['bf16'][1]:.3f}, float8 rowwise "
            f"{d['float8'][0]:.3f} -> {d['float8'][1]:.3f}; float8 {100 * d['gap_last']:+.2f}% at the last step, "
            f"{100 * d['gap_last5']:+.2f}% over the last 5")


def _describe(d: dict) -> str:
    if d.get("skipped"):
        return d["why"]
    if not d.get("ok"):
        return f"NOT OK: {d.get('why') or {k: v for k, v in d.items() if k != 'ok'}}"
    if "counts" in d:
        return ", ".join(f"{n} {k}" for k, n in d["counts"].items()) + (f"; failed: {' '.join(d['failed'])}" if d.get("failed") else "")
    if "rel_error" in d:
        return (f"{d['bytes'] / 1e9:.1f} GB in {d['export_s']:.0f} s; checkpoint loaded in {d['load_s']:.1f} s; "
                f"logits vs transformers on the device: rel error {d['rel_error']:.1e}")
    if "n_layers" in d:
        why = d.get("why") or f"the planner: {train.PLANNED_SHARE:.0%} of usable memory, with the allocator's reserve"
        return f"{d['n_layers']} layers of Llama 3 8B's shape ({why})"
    if "gbs" in d:
        return f"{d['seconds']:.1f} s ({_num(d['gbs'], '.2f')} GB/s read and summed)"
    return f"{d.get('seconds', 0):.1f} s: {d.get('text', '')}"


def table(results: dict, title: str) -> str:
    lines = [f"### {title}", "", "| what | figure |", "|---|---|"]
    lines += [f"| {what} | {figure.replace('|', '/')} |" for what, figure in rows(results)]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/gpu/first_light.sh", description="the GPU check (issue 40)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny shapes: the same code path in seconds (CI, on a CPU)")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/first_light")
    p.add_argument("--work", type=Path, default=Path("/tmp/first_light"))
    p.add_argument("--budget", type=float, default=500.0, help="seconds for every section together")
    p.add_argument("--fast-tier", action="store_true", help="also run the fast tier on the CPU cores, in the background")
    p.add_argument("--skip", default="", help="comma-separated sections to leave out (torchtitan, saves, ...)")
    p.add_argument("--float8", action="store_true",
                   help="the bf16 training pair, then the float8 sections in place of the others (--tiny: they run anyway)")
    return p


def plan(args: argparse.Namespace) -> list:
    """The bf16 sections: (name, seconds it needs to start, body), most important first."""
    found = [("probe", 30, train.probe), ("gpu tests", 40, train.gpu_tests), ("layers", 1, train.layers_that_fit),
             ("train eager", 60, lambda c: train.train(c, compile=False)),
             ("torchtitan eager", 60, lambda c: train.titan(c, compile=False)),
             ("train compiled", 90, lambda c: train.train(c, compile=True)),
             ("saves", 60, saves.saves), ("verify", 15, saves.verify), ("export hf", 40, saves.export_hf),
             ("generate", 15, saves.generate),
             ("torchtitan compiled", 90, lambda c: train.titan(c, compile=True))]
    return [s for s in found if s[0] in TRAINING] if args.float8 else found


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    check = Check(args)
    skip = set(filter(None, args.skip.split(",")))
    fast = saves.start_fast_tier(check) if args.fast_tier else None
    for name, needs, body in plan(args):
        if not any(word in name for word in skip):
            check.section(name, 5 if args.tiny else needs, body)
    if args.float8 or args.tiny:  # after the bf16 sections, whose figures they are compared with
        float8.run(check, skip)
    if fast is not None:
        check.results["fast tier"] = saves.finish_fast_tier(check, fast, check.left())
        check.save()
    title = f"First light, {datetime.date.today()}: {check.results.get('probe', {}).get('card', args.device)}"
    text = table(check.results, title)
    (check.out / "first_light.md").write_text(text)
    print("\n" + text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
