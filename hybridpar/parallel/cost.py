"""What a collective costs on the wire, as nccl-tests defines it: shared by `hybridpar doctor`
(measured bus bandwidth) and `hybridpar plan` (predicted time)."""

from __future__ import annotations

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for a collective over n ranks: the fraction of the whole buffer that each
    rank's link carries in a ring (2(n-1)/n for all_reduce, (n-1)/n for the other two); all_to_all's
    (n-1)/n is the share of the buffer that leaves the rank (the rest stays on it)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    raise ValueError(f"unknown collective {op!r}; choose from {', '.join(COLLECTIVES)}")


def collective_seconds(op: str, nbytes: float, n: int, busbw: float) -> float:
    """Time of one collective over a buffer of `nbytes` (the whole, unsharded size) at `busbw` B/s."""
    return 0.0 if n <= 1 else nbytes * bus_factor(op, n) / busbw
