"""Point fairscale's model-parallel state at a hybridpar mesh.

Code written on `fairscale.nn.model_parallel` (Meta's Llama reference, for one) finds its groups
through module globals that `initialize_model_parallel` fills in. `use_mesh(parallel)` fills them
with the mesh's own groups instead, so that code runs unchanged next to hybridpar's layers:

    with use_mesh(parallel):
        layer = fairscale.nn.model_parallel.layers.ColumnParallelLinear(...)

The mesh's layout is fairscale's (`arange(world).reshape(dp, mp)`, mp innermost), so fairscale's
getters, including `get_model_parallel_src_rank`, which assumes contiguous model-parallel ranks,
give the mesh's coordinates. There is no pipeline parallelism: the pipeline group is this rank alone.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from ..mesh.device import ParallelDims

# fairscale.nn.model_parallel.initialize's globals, in the order this module reads and writes them.
_STATE = ("_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "_PIPELINE_PARALLEL_GROUP", "_PIPELINE_PARALLEL_RANKS")


def _initialize_module():
    try:
        from fairscale.nn.model_parallel import initialize
    except ImportError as err:
        raise ImportError("hybridpar.parallel.fairscale needs fairscale: pip install fairscale") from err
    return initialize


def _read() -> tuple:
    module = _initialize_module()
    return tuple(getattr(module, name) for name in _STATE)


def _write(state: tuple) -> None:
    module = _initialize_module()
    for name, value in zip(_STATE, state):
        setattr(module, name, value)


def _describe(state: tuple) -> str:
    """The state's ranks, for error messages."""

    def ranks(group: Any) -> object:
        try:
            return dist.get_process_group_ranks(group) if group is not None else None
        except (KeyError, ValueError, RuntimeError):  # a destroyed group: name it anyway
            return group

    mp_group, dp_group, _, pipeline_ranks = state
    return (
        f"model-parallel ranks {ranks(mp_group)}, data-parallel ranks {ranks(dp_group)}, "
        f"pipeline ranks {pipeline_ranks}"
    )


class FairscaleMesh:
    """fairscale's state pointed at one mesh. `release()`, or leaving a `with` block, restores the
    state found before `use_mesh` (nothing, unless it replaced someone else's)."""

    def __init__(self, parallel: ParallelDims, installed: tuple, previous: tuple) -> None:
        self.parallel = parallel
        self._installed: Optional[tuple] = installed
        self._previous = previous

    @property
    def active(self) -> bool:
        return self._installed is not None

    def release(self) -> None:
        """Undo `use_mesh`. Safe to call twice; refuses if fairscale's state changed hands since."""
        if self._installed is None:
            return
        current = _read()
        if any(a is not b for a, b in zip(current, self._installed)):
            # Restoring now would clobber whoever replaced our state (or bring back a stale one).
            raise RuntimeError(
                "fairscale's model-parallel state was changed after use_mesh() installed this mesh "
                f"(it now holds {_describe(current)}); release meshes in the reverse order of use_mesh()"
            )
        _write(self._previous)
        _, _, pipeline_group, _ = self._installed
        # The pipeline group was created for this mesh handle alone: free its backend.
        dist.destroy_process_group(pipeline_group)
        self._installed = None

    def __enter__(self) -> "FairscaleMesh":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def use_mesh(parallel: ParallelDims, *, replace: bool = False) -> FairscaleMesh:
    """Make fairscale's model-parallel getters and layers use `parallel`'s mp and flattened dp groups.

    Raises RuntimeError if fairscale's state is already set (by `initialize_model_parallel` or an
    unreleased `use_mesh`) unless `replace=True`; the replaced state comes back on release. Every
    rank should call it (fairscale's layers then run collectives on these groups), but it runs no
    collective itself.
    """
    previous = _read()
    if any(value is not None for value in previous) and not replace:
        raise RuntimeError(
            f"fairscale's model-parallel state is already initialised ({_describe(previous)}), by "
            "fairscale's initialize_model_parallel() or a use_mesh() not yet released; call "
            "destroy_model_parallel() or release() first, or pass replace=True to override it until release"
        )
    rank = dist.get_rank()
    # A one-rank group needs only its member: with use_local_synchronization the other ranks do not
    # have to call new_group for it, so this costs one local group instead of `world` collective ones.
    pipeline_group = dist.new_group([rank], use_local_synchronization=True)
    installed = (parallel.mp_group, parallel.dp_group, pipeline_group, [rank])
    _write(installed)
    return FairscaleMesh(parallel, installed, previous)
