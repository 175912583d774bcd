"""CPU fast paths built on torch internals, behind one switch: `enabled()`, i.e. HYBRIDPAR_FAST_PATHS.

Unset or any value but "0": on. "0": every path below is off and torch's stock path runs instead,
with the same results (tests/fastpaths). Each path: what it saves; torch internals touched; when off.

gloo_collectives  FSDP's all-gather and reduce-scatter as gloo all-to-alls, buffers pooled: less CPU per
    collective, no page faults on fresh buffers. FSDP2's AllGather/ReduceScatter hooks, storage use
    counts. Off: FSDP2's own collectives (as with fsdp.gloo_all_to_all = false, which still applies).
dcp_reader  tensor bytes read straight into their destinations, in threads: no buffer and copy per
    tensor. torch.save's zip reader, the data offset torch.load records on "meta", FileSystemReader's
    storage table. Off: DCP's FileSystemReader.
dcp_writer  no zip CRC-32 per tensor, which no reader checks: less CPU per save. torch.save's
    serialization config. Off: DCP's FileSystemWriter (same files, CRCs written).
optimizer_state  a fresh optimizer's state allocated from the checkpoint's metadata: no zero-gradient
    optimizer step before a load. The module names wrappers insert into parameter names. Off:
    get_state_dict's own initialisation (that step).
"""

from __future__ import annotations

import os

ENV = "HYBRIDPAR_FAST_PATHS"


def enabled() -> bool:
    """Whether the fast paths run; read at each call, so a process can change it between uses."""
    return os.environ.get(ENV, "1") != "0"
