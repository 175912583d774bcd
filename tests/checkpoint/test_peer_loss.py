"""A checkpoint collective that lost its peer (a rank died mid-save or mid-load) ends the rank's part
without another collective: the agreement the error paths make otherwise (is the disk full? which
rank found damage?) cannot complete, and on the survivors it met the peers' next save collective,
which the watchdog read as collectives out of step: "the program's own fault (mismatch)" instead of
the dead rank's node (tests/launch/test_heal.py's kill, seen once under heavy load)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

LOST = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.3]:29500"


def _issued() -> int:
    import torch.distributed as dist

    from hybridpar.compat.torch import sequence_number

    return sequence_number(dist.group.WORLD)


def _case_save_loses_a_peer(folder: str) -> tuple[str, int]:
    """Both ranks' DCP save raise a peer loss (a third rank vanished): what the save raised, and the
    collectives this rank issued after."""
    import torch.distributed.checkpoint as dcp

    from hybridpar.checkpoint.dcp import Checkpointer
    from tests.distributed import parallel_dims

    model = torch.nn.Linear(4, 4)
    checkpointer = Checkpointer(Path(folder), parallel_dims(mp=1), keep=2)
    at_loss = []

    def lost(*args, **kwargs):
        at_loss.append(_issued())
        raise RuntimeError(LOST)

    save, dcp.save = dcp.save, lost
    try:
        checkpointer.save(1, model, torch.optim.AdamW(model.parameters()), {}, {})
        raised = "no error"
    except Exception as err:  # noqa: BLE001 - returned to the test
        raised = f"{type(err).__name__}: {err}"
    finally:
        dcp.save = save
    return raised, _issued() - at_loss[0]


def _case_load_agreement_loses_a_peer() -> tuple[str, int]:
    from hybridpar.checkpoint import verify

    before = _issued()

    def lost(*args, **kwargs):
        raise RuntimeError(LOST)

    agree, verify.raise_if_any_failed = verify.raise_if_any_failed, lost
    try:
        verify.share_load_failure(None, "load step-00000001")
        raised = "no error"
    except Exception as err:  # noqa: BLE001 - returned to the test
        raised = f"{type(err).__name__}: {err}"
    finally:
        verify.raise_if_any_failed = agree
    return raised, _issued() - before


@pytest.mark.parametrize("case", ["save", "load"])
def test_a_rank_that_lost_a_peer_issues_no_further_collective(workers, tmp_path, case):
    results = (workers(2).run(_case_save_loses_a_peer, str(tmp_path)) if case == "save" else
               workers(2).run(_case_load_agreement_loses_a_peer))
    print(f"\n{case}: {results}")
    for raised, issued_after in results:
        assert raised == f"RuntimeError: {LOST}" and issued_after == 0, results
