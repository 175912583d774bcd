"""The training loop and its metrics."""

from .optim import NonFiniteLossError
from .trainer import Trainer

__all__ = ["Trainer", "NonFiniteLossError"]
