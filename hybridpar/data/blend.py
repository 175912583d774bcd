"""Which source gives each sequence of a weighted blend, deterministically.

The sequences of the run are numbered g = 0, 1, 2, ... across the whole data-parallel group. The
next one comes from the source furthest behind its weight (Megatron's rule): the largest
weight x (g + 1) - count so far, the first such source on a tie. After every sequence each
source's count is within one of weight x sequences so far. Source s's k-th sequence is window
perm_s,e[k mod n_s] of its own data, e = k // n_s its epoch, the permutation seeded by (seed, s, e).
So the counts alone are the position: the same at every layout, saved in the checkpoint.

The loader (loader.py's ResumableDataLoader, one for a single source and a blend alike) hands each
rank its micro-batch of the group's next micro_batch x dp_size sequences: rank r takes positions
r, r + dp_size, ...
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["describe_blend", "next_sources"]


def next_sources(weights: Sequence[float], counts: list[int], n: int) -> list[int]:
    """The source of each of the next `n` sequences by the rule above; `counts` is updated."""
    chosen = []
    total = sum(counts)
    for _ in range(n):
        total += 1
        deficits = [w * total - c for w, c in zip(weights, counts)]
        s = deficits.index(max(deficits))
        counts[s] += 1
        chosen.append(s)
    return chosen


def describe_blend(loader) -> list[dict]:
    """summary.json's "sources": name, weight and tokens trained on, per source ([] for one source)."""
    if len(loader.sources) < 2:
        return []
    return [{"name": n, "weight": w, "tokens": t, "epochs": round(e, 6)}
            for n, w, t, e in zip(loader.names, loader.weights, loader.tokens, loader.epochs)]
