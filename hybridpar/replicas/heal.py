"""What a replica group that returns receives from a live group (torchft's checkpoint transport, over
the network): the model's and optimizer's local shards, the schedule, the step and every group's data
position. Peers at the same rank of their groups hold the same shards, so no resharding happens."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..parallel.layers import local_tensor


def _plain(tree):
    """A state dict's DTensors as their local shards: what a peer at the same rank holds."""
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_plain(v) for v in tree)
    return local_tensor(tree).detach() if isinstance(tree, torch.Tensor) else tree


def group_state(params, optimizer, scheduler, step: int, windows: list[int]) -> dict:
    """This rank's part of its group's state, as a live group sends it."""
    return {"model": [local_tensor(p).detach() for p in params], "optimizer": _plain(optimizer.state_dict()),
            "scheduler": scheduler.state_dict(), "step": step, "windows": list(windows)}


def load_group_state(state: dict, params, optimizer, scheduler) -> tuple[int, list[int]]:
    """Load a live group's state (group_state) into this rank's parameters, optimizer and schedule; its
    step and every group's data position."""
    with torch.no_grad():
        for p, value in zip(params, state["model"], strict=True):
            local_tensor(p).copy_(value)
    sent = state["optimizer"]
    ordered = [p for group in optimizer.param_groups for p in group["params"]]  # the state's numbering
    for index, entry in sent["state"].items():  # each state tensor shaped as its parameter: sharded alike
        p = ordered[int(index)]
        if isinstance(p, DTensor):
            sent["state"][index] = {
                k: DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride()) if v.shape == local_tensor(p).shape and v.dim() else v
                for k, v in entry.items()}
    optimizer.load_state_dict(sent)
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"]), [int(w) for w in state["windows"]]
