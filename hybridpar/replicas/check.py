"""The replica check across fault-tolerant groups: at the start of a step every group of the quorum
holds the same parameters (rank r of each group the same shards). hybridpar.diagnostics.replicas
compares the copies inside a job; this compares the groups, after each change of the quorum (a group
healed from a live one, or gone) and every diagnostics.replica_check_every steps.

Each rank takes its shards' checksums (the integer sums of their bits, diagnostics.replicas.checksums)
into its group's row of a [groups, n + 1, 2] table, the last entry (1, healed in this step); one sum
over torchft's managed process group gives every group every group's row. The groups whose rows
differ from the reference (what most groups hold; a tie goes to the groups not healed in this step,
then to the lowest index) raise ReplicaMismatchError on every rank of theirs, so that their launcher
restarts them and they are healed again; the others say so and train on.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

import torch
from torch.distributed import ReduceOp

from ..diagnostics.replicas import ReplicaMismatchError, checksums
from ..mesh.ranks import gather_objects

SHOWN = 8  # parameter names a message lists


def table_row(modules: Sequence[torch.nn.Module], group: int, groups: int, healed: bool) -> tuple[list[str], torch.Tensor]:
    """(parameter names, this group's [groups, n + 1, 2] table: its own row filled, the others zero)."""
    names, _, _, sums = checksums(modules)
    table = torch.zeros((groups, len(names) + 1, 2), dtype=torch.int64, device=sums.device)
    table[group, :-1] = sums
    table[group, -1] = torch.tensor([1, int(healed)])
    return names, table


def differing(table: torch.Tensor, names: list[str]) -> tuple[Optional[int], dict[int, list[str]]]:
    """(the reference group, {group: the parameters where it differs from the reference}) of a summed
    table; (None, {}) when no group took part."""
    present = [g for g in range(table.shape[0]) if table[g, -1, 0] == 1]
    if not present:
        return None, {}
    healed = {g for g in present if table[g, -1, 1] == 1}
    rows = {g: table[g, :-1].cpu().numpy().tobytes() for g in present}
    counts = Counter(rows.values())
    reference = min(present, key=lambda g: (-counts[rows[g]], g in healed, g))
    found = {}
    for g in present:
        if rows[g] != rows[reference]:
            differ = (table[g, :-1] != table[reference, :-1]).any(dim=1).tolist()
            found[g] = [name for name, d in zip(names, differ) if d]
    return reference, found


def mismatch_text(step: int, reference: int, found: dict[int, list[str]], healed: set[int]) -> str:
    parts = []
    for g, names in sorted(found.items()):
        shown = ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
        parts.append(f"replica group {g}{' (healed from a live group in this step)' if g in healed else ''} holds "
                     f"other parameters than group {reference}: {shown}")
    return f"replica check across groups, step {step}: " + "; ".join(parts)


def check_groups(manager, modules: Sequence[torch.nn.Module], *, group: int, groups: int, healed: bool,
                 step: int) -> Optional[dict]:
    """Collective over the quorum's groups (and over this group's ranks): None when the all-reduce
    failed (the step is then not committed), else {"groups", "healed", "differ": {group: names},
    "text"}; raises ReplicaMismatchError on every rank of a group that differs."""
    names, table = table_row(modules, group, groups, healed)
    manager.allreduce(table, reduce_op=ReduceOp.SUM).wait()
    if manager.errored() is not None:
        return None
    table = table.cpu()
    reference, found = differing(table, names)
    # Each rank compared its own shards: the group agrees on the union of what its ranks found.
    views = gather_objects(found)
    merged: dict[int, list[str]] = {}
    for view in views:
        for g, differ in view.items():
            merged.setdefault(g, [])
            merged[g] += [n for n in differ if n not in merged[g]]
    present = [g for g in range(groups) if table[g, -1, 0] == 1]
    were_healed = {g for g in present if table[g, -1, 1] == 1}
    text = mismatch_text(step, reference, merged, were_healed) if merged else ""
    if group in merged:
        raise ReplicaMismatchError(f"{text}; replica group {group} leaves the job: its launcher restarts it and it "
                                   "is healed again from a live group")
    return {"groups": present, "healed": sorted(were_healed), "differ": merged, "text": text}
