"""Weighted blends of several sources: which source gives each sequence, deterministically, and a
loader for one data-parallel rank that resumes exactly at any (mp, dp).

The sequences of the run are numbered g = 0, 1, 2, ... across the whole data-parallel group. The
next one comes from the source furthest behind its weight (Megatron's rule): the largest
weight x (g + 1) - count so far, the first such source on a tie. After every sequence each
source's count is within one of weight x sequences so far. Source s's k-th sequence is window
perm_s,e[k mod n_s] of its own data, e = k // n_s its epoch, the permutation seeded by (seed, s, e).
So the counts alone are the position: the same at every layout, saved in the checkpoint.

As the single-source loader (loader.py), each call hands this rank its micro-batch of the group's
next micro_batch x dp_size sequences: rank r takes positions r, r + dp_size, ...
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

from hybridpar.data.loader import EXHAUSTED_CHOICES, PackedDataset, SourceExhaustedError, _inputs_and_targets, exhausted
from hybridpar.progress import note

__all__ = ["BlendSource", "BlendedLoader", "SourceExhaustedError", "blend_loader", "describe_blend", "next_sources"]


@dataclasses.dataclass(frozen=True)
class BlendSource:
    name: str
    weight: float  # normalised: the weights sum to 1
    dataset: PackedDataset


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


class BlendedLoader:
    """Endless (inputs [B, S], targets [B, S]) int64 micro-batches of a blend for one data-parallel
    rank; `sequences` / `tokens` count what the whole group has consumed from each source."""

    def __init__(self, sources: Sequence[BlendSource], *, dp_rank: int, dp_size: int, micro_batch_size: int,
                 seed: int, on_exhausted: str = "repeat") -> None:
        if on_exhausted not in EXHAUSTED_CHOICES:
            raise ValueError(f"data.on_exhausted must be one of {', '.join(EXHAUSTED_CHOICES)}, got {on_exhausted!r}")
        for s in sources:
            if len(s.dataset) == 0:
                raise ValueError(f"data source {s.name!r} has {s.dataset.n_tokens} tokens, fewer than one sequence of "
                                 f"data.seq_len + 1 = {s.dataset.seq_len + 1}: give it more text or drop it")
        self.sources = list(sources)
        self.weights = [s.weight for s in sources]
        self.dp_rank, self.dp_size, self.micro_batch_size = dp_rank, dp_size, micro_batch_size
        self.seed, self.on_exhausted = seed, on_exhausted
        self.counts = [0] * len(sources)  # sequences the whole group consumed, per source
        self._permutations: dict[tuple[int, int], np.ndarray] = {}
        self._said = [False] * len(sources)

    def __iter__(self) -> "BlendedLoader":
        return self

    def __len__(self) -> int:
        """Sequences in all sources together (what the trainer's banner counts)."""
        return sum(len(s.dataset) for s in self.sources)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    @property
    def tokens(self) -> list[int]:
        """Tokens trained on so far, per source (targets: seq_len per sequence)."""
        return [c * s.dataset.seq_len for c, s in zip(self.counts, self.sources)]

    def _check_epoch(self, s: int, k: int) -> None:
        """Sequence k of source s is past its data: said once (rank 0; later epochs are counted in
        `epochs`), or the end with "stop". Asked for every sequence of the group, so every rank
        stops at the same step."""
        n = len(self.sources[s].dataset)
        if k < n:
            return
        if self.on_exhausted == "stop":
            raise exhausted(self.sources[s].name, n, blend=True)
        if not self._said[s]:
            self._said[s] = True
            note(f"data: source {self.sources[s].name!r} ran out after {n:,} sequences; repeating it in a new order "
                 "(its epochs are counted in summary.json)")

    @property
    def epochs(self) -> list[float]:
        """Passes through each source's data so far (1.5: once and a half)."""
        return [c / len(s.dataset) for c, s in zip(self.counts, self.sources)]

    def _window(self, s: int, k: int) -> torch.Tensor:
        n = len(self.sources[s].dataset)
        epoch, position = divmod(k, n)
        key = (s, epoch)
        if key not in self._permutations:
            if len(self._permutations) > 2 * len(self.sources):  # keep the epochs in use
                self._permutations = {k: v for k, v in self._permutations.items() if k[1] >= epoch - 1}
            self._permutations[key] = np.random.default_rng([self.seed, s, epoch]).permutation(n)
        return self.sources[s].dataset[int(self._permutations[key][position])]

    def positions(self, n: int) -> list[tuple[int, int]]:
        """(source, its sequence number) of the group's next `n` sequences, without consuming them."""
        counts = list(self.counts)
        chosen = next_sources(self.weights, counts, n)
        seen = list(self.counts)
        out = []
        for s in chosen:
            out.append((s, seen[s]))
            seen[s] += 1
        return out

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        group = self.positions(self.micro_batch_size * self.dp_size)
        for s, k in group:
            self._check_epoch(s, k)
        mine = group[self.dp_rank::self.dp_size]
        batch = _inputs_and_targets([self._window(s, k) for s, k in mine])
        for s, _ in group:
            self.counts[s] += 1
        return batch

    def state_dict(self) -> dict:
        """The same on every rank: the group's counts per source (the position at any layout)."""
        return {"blend": {name: count for name, count in zip(self.names, self.counts)},
                "weights": dict(zip(self.names, self.weights)), "seed": self.seed}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        saved = state.get("blend")
        if saved is None:
            raise ValueError("the saved data position is a single source's, this run reads a blend of "
                             f"{', '.join(self.names)}: resume with the same data settings")
        if strict and (set(saved) != set(self.names) or state.get("seed") != self.seed
                       or any(abs(state["weights"][n] - w) > 1e-12 for n, w in zip(self.names, self.weights))):
            raise ValueError(f"the saved data position is for the blend {state['weights']} with seed {state.get('seed')}, "
                             f"this run reads {dict(zip(self.names, self.weights))} with seed {self.seed}: resume with "
                             "the same data.sources and data.seed")
        self.counts = [int(saved.get(n, 0)) for n in self.names]


def blend_loader(sources: Sequence[tuple[str, float, PackedDataset]], **kwargs) -> BlendedLoader:
    """A BlendedLoader over (name, weight, dataset) triples; the weights are normalised."""
    total = sum(w for _, w, _ in sources)
    return BlendedLoader([BlendSource(n, w / total, d) for n, w, d in sources], **kwargs)


def describe_blend(loader) -> list[dict]:
    """summary.json's "sources": name, weight and tokens trained on, per source ([] unless a blend)."""
    if not isinstance(loader, BlendedLoader):
        return []
    return [{"name": n, "weight": w, "tokens": t, "epochs": round(e, 6)}
            for n, w, t, e in zip(loader.names, loader.weights, loader.tokens, loader.epochs)]
