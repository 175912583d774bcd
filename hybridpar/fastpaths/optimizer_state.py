"""A fresh optimizer's state allocated from a checkpoint's metadata before the load (a fast path).

torch's get_state_dict gives an optimizer without state its state tensors by running a step on
zero gradients; the load then overwrites them. This allocates them uninitialised instead, from the
shapes and dtypes the checkpoint stores, matched to parameters by name: it relies on the module
names torch's wrappers (activation checkpointing, FSDP1, torch.compile) insert into parameter names.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

# Module names that wrappers insert into parameter names and state-dict keys leave out.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def allocate_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, metadata: dict,
                             like: Callable[[torch.Tensor], torch.Tensor] = lambda param: param) -> None:
    """Give a fresh optimizer the state tensors the checkpoint will be read into, uninitialised.
    like(param): the plain tensor a parameter-shaped state is made like (a parameter of a tensor
    subclass would pass its subclass on to the state).

    Otherwise get_state_dict creates them by running an optimizer step on zero gradients: every
    state tensor zeroed, then updated, which costs more than reading the state. DCP overwrites every
    tensor made here (it refuses a checkpoint that lacks one). Done only when every trainable
    parameter's stored state is parameter-shaped or a scalar (Adam's kind); otherwise torch's way
    runs unchanged."""
    if optimizer.state:
        return
    stored: dict[str, dict[str, Any]] = {}
    for key, entry in metadata.items():
        if key.startswith("optimizer.state."):
            fqn, _, name = key[len("optimizer.state."):].rpartition(".")  # state names have no dots
            stored.setdefault(fqn, {})[name] = entry
    names = {id(p): n for n, p in model.named_parameters()}
    made: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not param.requires_grad:
                continue  # never stepped, so no state either way
            fqn = names.get(id(param), "")
            for part in _WRAPPER_PARTS:
                fqn = fqn.replace(part, "")
            entries = stored.get(fqn)
            if not entries:
                return
            state = {}
            for name, entry in entries.items():
                if not isinstance(entry, TensorStorageMetadata):
                    return
                dtype = entry.properties.dtype
                if tuple(entry.size) == tuple(param.shape):
                    state[name] = torch.empty_like(like(param), dtype=dtype, requires_grad=False)
                elif len(entry.size) == 0:  # a step count
                    state[name] = torch.zeros((), dtype=dtype)
                else:
                    return
            made[param] = state
    optimizer.state.update(made)
