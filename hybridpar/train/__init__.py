"""The training loop and its metrics."""

from .trainer import NonFiniteLossError, Trainer

__all__ = ["Trainer", "NonFiniteLossError"]
