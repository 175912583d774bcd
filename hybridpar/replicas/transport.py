"""torchft's HTTP checkpoint transport, reading with torch's weights-only unpickler: a peer's state is
tensors and plain values, and nothing hybridpar reads may run code (torchft's own reader allows any
pickle)."""

from __future__ import annotations

import urllib.request
import warnings
from datetime import timedelta

from torchft.checkpointing._serialization import _streaming_load
from torchft.checkpointing.http_transport import HTTPTransport


# torch reads the state into read-only buffers and warns of it; the state is copied as it is loaded.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class WeightsOnlyTransport(HTTPTransport):
    @classmethod
    def _load_from_address(cls, address: str, timeout: timedelta) -> object:
        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
            return _streaming_load(f, weights_only=True)
