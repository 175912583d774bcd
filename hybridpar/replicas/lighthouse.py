"""`hybridpar lighthouse`: torchft's lighthouse, which keeps the quorum of a fault-tolerant job's replica
groups (fault_tolerance.lighthouse names its address), until it is stopped."""

from __future__ import annotations

import os
import signal
import socket
import threading


def serve(port: int, min_groups: int, join_timeout: float, heartbeat_timeout: float, say=print) -> int:
    """Run the lighthouse on `port` (0: any free one) until SIGTERM or SIGINT; its address is said first.
    min_groups: the fewest groups of a quorum; join_timeout: seconds a quorum waits for a group that
    heartbeats but has not asked yet; heartbeat_timeout: seconds of silence before a group is gone."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum tick at its default
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=f"[::]:{port}", min_replicas=min_groups, join_timeout_ms=int(join_timeout * 1000),
                              heartbeat_timeout_ms=int(heartbeat_timeout * 1000))
    address = server.address().replace("[::]", socket.gethostname())
    say(f"hybridpar lighthouse: {address} (fault_tolerance.lighthouse = \"{address}\"); "
        f"a quorum of {min_groups} group(s) or more; Ctrl-C stops it", flush=True)
    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    stopped.wait()
    server.shutdown()
    return 0
