"""bench/pipeline.py's arithmetic, torch-free (tested by hand in tests/bench/test_pipeline_bench.py): the
schedule as it ran replayed on its measured costs (a core per rank, or shared cores), the same with even
stages, each stage's mean costs, and the wall and P2P bubbles from each rank's timings."""

from __future__ import annotations

import statistics
from typing import Optional


def replay(actions: dict[int, list[dict]], n_stages: int, cores: Optional[int] = None) -> dict:
    """The schedule as it ran, replayed: `actions[rank]` in executed order, each {"kind": "F" | "B",
    "stage", "mb", "cost"}; F(s, i) starts after F(s-1, i), B(s, i) after B(s+1, i) (the last stage's
    after its F), each rank one action at a time, P2P free. `cores`: None, a core per rank; n, the
    ranks ready to compute share n cores equally (each at min(1, n / ready) of a core's speed).
    {"step", "bubble": {rank: the share of the step it was not ready (waiting, or done)}}."""
    def dep(a: dict) -> Optional[tuple]:
        s, mb = a["stage"], a["mb"]
        if a["kind"] == "F":
            return ("F", s - 1, mb) if s > 0 else None
        return ("B", s + 1, mb) if s < n_stages - 1 else ("F", s, mb)

    done: set[tuple] = set()
    at = dict.fromkeys(actions, 0)
    left = {r: todo[0]["cost"] for r, todo in actions.items() if todo}  # cost left of each rank's current action
    idle, now = dict.fromkeys(actions, 0.0), 0.0
    while left:
        ready = [r for r in left if dep(actions[r][at[r]]) in done | {None}]
        if not ready:
            raise ValueError(f"the recorded order cannot run: ranks stop at {at}")
        speed = min(1.0, cores / len(ready)) if cores else 1.0
        dt = min(left[r] for r in ready) / speed
        now += dt
        for r in actions:
            if r not in ready:
                idle[r] += dt
        for r in ready:
            left[r] -= dt * speed
            if left[r] <= 1e-12 * (1 + now):
                a = actions[r][at[r]]
                done.add((a["kind"], a["stage"], a["mb"]))
                at[r] += 1
                if at[r] < len(actions[r]):
                    left[r] = actions[r][at[r]]["cost"]
                else:
                    del left[r]
    return {"step": now, "bubble": {r: idle[r] / now for r in actions}}


def evened(actions: dict[int, list[dict]]) -> dict[int, list[dict]]:
    """The same order with every forward costing the mean forward and every backward the mean backward:
    replayed, the schedule's own bubble where the formula's even stages hold (its excess over the
    replay of the measured costs is the stages' unevenness)."""
    every = [a for todo in actions.values() for a in todo]
    mean = {k: statistics.fmean(a["cost"] for a in every if a["kind"] == k) for k in ("F", "B")}
    return {r: [{**a, "cost": mean[a["kind"]]} for a in todo] for r, todo in actions.items()}


def stage_costs(actions: dict[int, list[dict]]) -> dict[int, dict]:
    """Each stage's mean forward (loss included) and backward cost of one micro-batch, in seconds."""
    every = [a for todo in actions.values() for a in todo]
    return {s: {k: statistics.fmean(a["cost"] for a in every if a["stage"] == s and a["kind"] == k)
                for k in ("F", "B")} for s in sorted({a["stage"] for a in every})}


def wall_bubble(ranks: dict[int, dict]) -> dict:
    """From each rank's {"start", "end", "waits" (seconds in P2P waits), "compute_wall", "compute_cpu"}:
    the step (first start to last end) and each rank's bubble, (waits + the time outside its own
    start..end) / step."""
    first, last = min(r["start"] for r in ranks.values()), max(r["end"] for r in ranks.values())
    step = last - first
    return {"step": step, "bubble": {k: (r["waits"] + (r["start"] - first) + (last - r["end"])) / step
                                     for k, r in ranks.items()}}


def p2p_bubble(ranks: dict[int, dict]) -> dict:
    """Each rank's P2P waits alone over the step (without the time outside its own schedule)."""
    step = max(r["end"] for r in ranks.values()) - min(r["start"] for r in ranks.values())
    return {k: r["waits"] / step for k, r in ranks.items()}


def summarise(values: dict) -> dict:
    return {"mean": statistics.fmean(values.values()), "worst": max(values.values())}
