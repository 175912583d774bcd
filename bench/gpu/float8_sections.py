"""The GPU check's float8 sections (bench/gpu/first_light.py runs them after the bf16 ones, with
--float8, and always with --tiny): hybridpar's float8 training at the bf16 runs' shape, rowwise and
tensorwise with FSDP's float8 all-gather, compiled and eager; torchtitan's float8 at the same
recipe, compiled (torchtitan's docs call compile required for float8's speed); and the loss of
bf16 and float8 rowwise over the same 30 steps. A CUDA card without float8 matmuls makes them one
line. Seconds each on one H100 (8 layers of Llama 3 8B's shape), estimated: a compiled run about
55, an eager one about 40, the loss none (it reads two runs).

--tiny runs one of each recipe (rowwise compiled, tensorwise eager), every code path once: each
tiny run costs CI about 30-45 s.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

from . import train_sections as train
from .check import Check

# Which section a --tiny run leaves out: the same code as another section's, at another setting.
_NOT_TINY = ("float8 tensorwise compiled", "float8 rowwise eager")
LOSS_RUNS = ("train compiled", "float8 rowwise compiled")  # the same 30 batches, bf16 and float8


def sections(tiny: bool) -> list[tuple[str, float, Callable[[Check], dict]]]:
    """(name, seconds it needs to start, body), most important first: the compiled runs and their
    torchtitan peers, then the eager runs, then the loss."""
    found = []
    for name in train.FLOAT8:
        found += [(f"float8 {name} compiled", 90, lambda c, n=name: against_bf16(c, n, compile=True)),
                  (f"torchtitan float8 {name} compiled", 90, lambda c, n=name: train.titan(c, True, float8=n))]
    found += [(f"float8 {name} eager", 60, lambda c, n=name: against_bf16(c, n, compile=False)) for name in train.FLOAT8]
    found.append(("loss", 1, loss))
    return [s for s in found if not (tiny and s[0] in _NOT_TINY)]


def run(check: Check, skip: set) -> None:
    """The float8 sections, or the one line saying why this card cannot run them."""
    why = unsupported(check)
    if why:
        check.results["float8"] = {"ok": False, "skipped": True, "why": why}
        check.say(f"=== float8: {why}")
        check.save()
        return
    for name, needs, body in sections(check.tiny):
        if not any(word in name for word in skip):
            check.section(name, 5 if check.tiny else needs, body)


def unsupported(check: Check) -> Optional[str]:
    """Why this CUDA card has no float8 matmuls (the probe's compute capability), else None; off
    CUDA torchao emulates them, and without a probe hybridpar's own preflight says what is wrong."""
    from hybridpar.preflight import FLOAT8_CAPABILITY

    probe = check.results.get("probe", {})
    found = probe.get("capability")
    if check.args.device != "cuda" or not found:
        return None
    capability = tuple(int(x) for x in str(found).split("."))
    if capability >= FLOAT8_CAPABILITY:
        return None
    need = ".".join(map(str, FLOAT8_CAPABILITY))
    return (f"skipped: {probe.get('card', 'this card')} has compute capability {found}, and float8 matmuls "
            f"need {need} or above (L4, H100, H200, B200)")


def against_bf16(check: Check, name: str, compile: bool) -> dict:
    """hybridpar's float8 run of FLOAT8[name], with its tokens/s over the bf16 run's of the same
    mode and layers. No second try at fewer layers (bf16's): its figures would not compare."""
    out = train._train(check, compile, float8=name)
    bf16 = check.results.get(f"train {'compiled' if compile else 'eager'}", {})
    if out.get("ok") and bf16.get("ok") and bf16.get("n_layers") == out["n_layers"]:
        out["float8_over_bf16"] = out["tokens_per_s"] / bf16["tokens_per_s"]
    return out


def loss(check: Check) -> dict:
    """bf16's and float8 rowwise's loss over the same steps (the compiled runs: the check's config,
    the embedded corpus, the same batches): first and last of each, and float8's relative gap at
    the last step and over the last five."""
    runs = [check.results.get(name, {}) for name in LOSS_RUNS]
    missing = [name for name, r in zip(LOSS_RUNS, runs) if not r.get("ok") or not r.get("losses")]
    if missing:
        return {"ok": False, "why": f"needs the losses of {' and '.join(missing)}, which did not train"}
    bf16, f8 = (r["losses"] for r in runs)
    if len(bf16) != len(f8):
        return {"ok": False, "why": f"{len(bf16)} bf16 steps against {len(f8)} float8 steps"}
    tail, finite = min(5, len(bf16)), all(map(math.isfinite, bf16 + f8))
    return {"ok": finite, "steps": len(bf16), "runs": list(LOSS_RUNS), "bf16": [bf16[0], bf16[-1]],
            "float8": [f8[0], f8[-1]], "gap_last": f8[-1] / bf16[-1] - 1,
            "gap_last5": sum(f8[-tail:]) / sum(bf16[-tail:]) - 1, "why": "" if finite else "a loss is not finite"}
