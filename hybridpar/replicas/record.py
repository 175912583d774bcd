"""What a replica group keeps of its run for the step line, the summary and summary.json: the steps
committed with fewer groups (which steps, by which groups, and the seconds until every group was
back), its heals, and with fault_tolerance.record_windows the loader's record of the windows each step
read and which groups committed each step (windows.jsonl, for the count of the windows trained)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional


class Membership:
    """The groups of each committed step, as this group saw them (one that was away did not see them)."""

    def __init__(self, groups: int) -> None:
        self.groups = groups
        self.members: Optional[list[int]] = None  # the groups of the last committed step
        self.fewer: list[dict] = []  # runs of steps committed with fewer groups: first, last, groups
        self.fewer_since: Optional[float] = None  # when the groups last became fewer
        self.heals: list[dict] = []  # this start's heals: at step, from step, seconds

    @property
    def fewer_steps(self) -> int:
        return sum(run["last"] - run["first"] + 1 for run in self.fewer)

    def committed(self, step: int, members: list[int]) -> Optional[dict]:
        """Step `step` was committed by `members`: the "groups" event's fields when the groups changed."""
        if len(members) < self.groups:
            last = self.fewer[-1] if self.fewer else None
            if last is not None and last["last"] == step - 1 and last["groups"] == members:
                last["last"] = step
            else:
                self.fewer.append({"first": step, "last": step, "groups": members})
        was, self.members = self.members, members
        if members == was or (was is None and len(members) == self.groups):  # every group from the start
            return None
        event = {"groups": members, "was": was}
        if len(members) < self.groups:
            self.fewer_since = self.fewer_since or time.monotonic()
        elif self.fewer_since is not None:
            event["seconds_fewer"] = round(time.monotonic() - self.fewer_since, 1)
            self.fewer[-1]["all_back_s"] = event["seconds_fewer"]  # the run that ended with every group back
            self.fewer_since = None
        return event

    def report(self, group: int, windows: list[int]) -> dict:
        """summary.json's "replica_groups"."""
        return {"group": group, "groups": self.groups, "steps_with_fewer_groups": self.fewer_steps,
                "fewer_groups": [dict(run) for run in self.fewer], "heals": list(self.heals), "windows": list(windows)}


def summary_lines(report: dict) -> list[str]:
    """The summary block's lines for a fault-tolerant run (its "replica groups" rows)."""
    head = f"group {report['group']} of {report['groups']}"
    for heal in report["heals"]:
        head += (f"; healed from a live group at step {heal['step']} (this start was at step {heal['from_step']}) "
                 f"in {heal['seconds']:.1f} s")
    runs = report["fewer_groups"]
    if not runs:
        return [head, "steps committed with fewer groups: none that this group saw"]
    listed = ", ".join((f"{r['first']}-{r['last']}" if r["last"] > r["first"] else f"{r['first']}")
                       + f" by {_groups(r['groups'])}"
                       + (f" (all back {r['all_back_s']:.1f} s after the groups became fewer)" if "all_back_s" in r
                          else "") for r in runs)
    tail = "" if "all_back_s" in runs[-1] else "; not all back by the end"
    return [head, f"steps committed with fewer groups: {report['steps_with_fewer_groups']}: {listed}{tail}"]


def _groups(members: list[int]) -> str:
    return ("group " if len(members) == 1 else "groups ") + ", ".join(map(str, members))


class WindowsRecord:
    """windows.jsonl in the group's run folder (its rank 0): {"step", "read"} the group's (source, window)
    pairs one attempt of a step read, {"step", "committed"} the groups that committed it (a debug record:
    every window of the group's share, counted, is in it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = None

    def write(self, **line) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)  # a line at a time: a killed group keeps its lines
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
