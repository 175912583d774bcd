"""The straggler across replica groups: a whole group slower than the others, which every other group
waits for in the groups' all-reduce. A group's own straggler detector (diagnostics/stragglers.py)
compares its ranks only, and they are all slow alike.

torchft does not say which group reached the all-reduce last, so each rank measures its group's own
work of the step (from its quorum to its gradients: the forward, backward and everything inside the
group) and how long it then waited in the groups' all-reduce, and both travel in that all-reduce (the
wait a step late: it is known only once the all-reduce is done). Rank r of each group sees rank r's
numbers of every group; the ranks of a group synchronise inside the step, so these are the group's.
Every diagnostics.straggler_every steps the medians over the window's committed steps are judged as
stragglers.py judges ranks (analyse: the slowest against the others' median, over
diagnostics.straggler_threshold); a group over it in two reports in a row is named, with the others'
measured wait.
"""

from __future__ import annotations

import statistics
from typing import Optional, Sequence

from ..diagnostics.stragglers import analyse


class Laggards:
    """group, groups: this group and the job's; every: diagnostics.straggler_every (0: never judged);
    threshold: diagnostics.straggler_threshold."""

    def __init__(self, group: int, groups: int, every: int, threshold: float) -> None:
        self.group, self.groups, self.every, self.threshold = group, groups, every, threshold
        self.rows: list[tuple[int, dict[int, tuple[float, float]]]] = []  # (step, {group: (own, waited)})
        self.over: Optional[int] = None  # the group over the threshold in the last report

    def tail(self, own: float, waited: float) -> list[float]:
        """This group's slots of the all-reduce: its own seconds of the step, then its last wait."""
        slots = [0.0] * (2 * self.groups)
        slots[self.group], slots[self.groups + self.group] = own, waited
        return slots

    def add(self, step: int, members: Sequence[int], summed: Sequence[float]) -> Optional[dict]:
        """Committed step `step`, its groups and the summed slots: at the end of a window, the straggler
        across groups (two reports in a row) as {"group", "step", "waited_s", "own_s", "others_s", "ratio",
        "first"}, else None."""
        if not self.every:
            return None
        self.rows.append((step, {g: (summed[g], summed[self.groups + g]) for g in members}))
        if step % self.every:
            return None
        rows, self.rows = self.rows, []
        present = sorted({g for _, row in rows for g in row})
        if len(present) < 2:
            self.over = None
            return None
        own = [statistics.median(row[g][0] for _, row in rows if g in row) for g in present]
        waited = [statistics.median(row[g][1] for _, row in rows if g in row) for g in present]
        previous = present.index(self.over) if self.over in present else None
        verdict = analyse(own, waited, self.threshold, previous=previous)
        self.over = present[verdict.rank] if verdict.over else None
        if not verdict.straggler:
            return None
        others = [w for i, w in enumerate(waited) if i != verdict.rank]
        return {"group": present[verdict.rank], "step": step, "waited_s": round(statistics.median(others), 3),
                "own_s": round(verdict.compute, 3), "others_s": round(verdict.median_compute, 3),
                "ratio": round(verdict.ratio, 2), "first": rows[0][0]}


def line(found: dict) -> str:
    """The warning a group's rank 0 says of the straggler across groups."""
    return (f"hybridpar: replica group {found['group']} is the straggler across groups: the others waited "
            f"{found['waited_s']:.2f} s for it at step {found['step']} (their measured wait in the groups' all-reduce; "
            f"its own work per step {found['own_s']:.2f} s against the others' {found['others_s']:.2f} s, "
            f"{found['ratio']:.2f}x; medians of steps {found['first']}-{found['step']})")
