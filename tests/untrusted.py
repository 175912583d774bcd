"""Crafted pickles for the tests that nothing read runs code. Each payload makes a marker file when
unpickled without restriction and still leaves a well-formed result (the object a genuine file
holds), so a reader that ran it would go on as if nothing happened: the tests assert that the marker
was never made, and that check, not a broken result, is what fails."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any, Callable


def reduce_pickle(module: str, name: str, *args: str) -> bytes:
    """A pickle that imports `module`.`name` (dotted names too: protocol 4) and calls it with `args`."""
    def text(s: str) -> bytes:
        data = s.encode()
        return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data

    return (b"\x80\x04" + text(module) + text(name) + pickle.STACK_GLOBAL + pickle.MARK
            + b"".join(text(a) for a in args) + pickle.TUPLE + pickle.REDUCE + pickle.STOP)


def then(call: bytes, result: Any) -> bytes:
    """`call` (a pickle that calls something), its return value dropped, then `result`: unpickled
    without restriction it runs `call` and gives exactly `result`."""
    genuine = pickle.dumps(result, protocol=2)  # no frames; memo indices start at 0 as `call` uses none
    assert call.endswith(pickle.STOP) and genuine.startswith(b"\x80\x02")
    return call[:-1] + pickle.POP + genuine[2:]


def payloads(marker: Path, result: Any) -> dict[str, tuple[str, bytes]]:
    """{case: (the global it names, a pickle that creates `marker` and gives `result`)}."""
    calls = {
        "os.system": ("posix.system", reduce_pickle("posix", "system", f"touch {marker}")),
        "exec": ("builtins.exec", reduce_pickle("builtins", "exec", f"open({str(marker)!r}, 'w').close()")),
        # a dotted name reaching os through a module the metadata's own classes live in
        "through-dcp-module": ("torch.distributed.checkpoint.metadata.os.system",
                               reduce_pickle("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}")),
        # torch is an allowed module (dtypes); its other attributes are not
        "torch-attribute": ("torch.os.system", reduce_pickle("torch", "os.system", f"touch {marker}")),
    }
    return {case: (name, then(call, result)) for case, (name, call) in calls.items()}


def touch_then(marker: str, value: Any) -> Any:
    """What RunsCode runs when unpickled: make the marker, give back the value it stands for."""
    Path(marker).touch()
    return value


TOUCH_THEN = f"{__name__}.touch_then"  # the global a refusal of RunsCode names


class RunsCode:
    """Pickles as a call of touch_then(marker, value): unpickled, it is `value` (a tensor stays a
    tensor) and the marker exists."""

    def __init__(self, marker: Path, value: Any) -> None:
        self.marker, self.value = str(marker), value

    def __reduce__(self):
        return touch_then, (self.marker, self.value)


def never_ran(marker: Path, read: Callable[[], Any], refusal: type[BaseException]) -> BaseException:
    """read() must raise `refusal` without having made the marker. The marker is checked first: a
    reader that ran the pickle fails here, whatever it returned or raised."""
    try:
        read()
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: BLE001 - checked below, after the marker (DCP's CheckpointException is a BaseException)
        raised: Any = err
    else:
        raised = None
    assert not os.path.exists(marker), f"the pickle ran code: {marker} was made (the read gave {raised!r})"
    assert isinstance(raised, refusal), f"expected {refusal.__name__}, the read gave {raised!r}"
    return raised
