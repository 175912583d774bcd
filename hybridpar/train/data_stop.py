"""A run that stops for its data: a damaged chunk of a token store (StoreDamagedError) or a source
that ran out with data.on_exhausted = "stop" (SourceExhaustedError).

Each rank fetches its step's micro-batches first; what it met rides as a flag on the step's first
all-reduce (step.count_targets), before the forward. Only the ranks that read the damaged window
meet the damage, so every rank learns of it there, at the same step: none trains it. The trainer
then takes the stop path the other agreed stops take (a stop signal, a straggler's exclusion):
it saves the last step that trained and leaves the loop. The damaged window's text (file and
offset) is gathered from the ranks that met it, so every rank raises the same one-line error.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from ..data.loader import SourceExhaustedError
from ..data.store.token_store import StoreDamagedError
from ..mesh.ranks import gather_objects, mark_every_rank

log = logging.getLogger(__name__)

DATA_ERRORS = (StoreDamagedError, SourceExhaustedError)


def fetch(loader, n: int) -> tuple[list, Optional[Exception]]:
    """(the next `n` micro-batches, None), or ([], what stopped the data) with the loader back where
    it was: its position is then the last step that trained (the checkpoint saves it)."""
    position = loader.state_dict()
    try:
        return [next(loader) for _ in range(n)], None
    except DATA_ERRORS as err:
        loader.load_state_dict(position)
        return [], err


def _text(error: Exception) -> str:
    """The error's line; a DataLoader worker's error arrives as "Caught ... Traceback ...": its last line."""
    text = str(error)
    if "\n" in text:
        text = text.rstrip().splitlines()[-1].split(f"{type(error).__name__}: ", 1)[-1]
    return text


def agreed_error(mine: Optional[Exception]) -> Exception:
    """Every rank, once the flag said some rank's data stopped: the same error on every rank (a
    damage wins over an exhaustion; the lowest rank's text), marked as raised by every rank."""
    met = gather_objects((isinstance(mine, StoreDamagedError), _text(mine)) if mine is not None else None)
    damaged, text = max((m for m in met if m is not None), key=lambda m: m[0])  # the first of the most severe
    return mark_every_rank((StoreDamagedError if damaged else SourceExhaustedError)(text))


def kind(error: Optional[Exception]) -> str:
    """"damaged", "exhausted", or "" when the data did not stop the run (the summary's resume hint)."""
    if error is None:
        return ""
    return "damaged" if isinstance(error, StoreDamagedError) else "exhausted"


def stopped_text(error: Exception, step: int, checkpoint: Optional[Path]) -> str:
    """The run's last line: what stopped it, and the checkpoint of the last step that trained."""
    if isinstance(error, StoreDamagedError):
        kept = (f"step {step} is saved in {checkpoint}, and a run started again resumes from it"
                if checkpoint is not None else "no step had trained, nothing is saved")
        return f"{error}. Stopped before step {step + 1} trained; {kept}"
    kept = f"step {step} is saved in {checkpoint}" if checkpoint is not None else "no step had trained, nothing is saved"
    return f"hybridpar: stopped at step {step}: {error}; {kept}"


class DataStopped(Exception):
    """Raised by train_step on every rank when the data stopped before the step trained; the loop
    catches it. `error`: the agreed error (agreed_error)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def finish(error: Exception, step: int, checkpoint: Optional[Path], *, said: bool) -> None:
    """The data stopped the run (every rank, checkpoint saved): a damaged store is an error every rank
    raises alike; a source run out with data.on_exhausted = "stop" is the end asked for, said in a
    line (`said`: by this rank)."""
    text = stopped_text(error, step, checkpoint)
    if isinstance(error, StoreDamagedError):
        raise mark_every_rank(StoreDamagedError(text))
    if said:
        log.info(text)
