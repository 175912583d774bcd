"""`hybridpar lighthouse`: torchft's lighthouse, which keeps the quorum of a fault-tolerant job's replica
groups (fault_tolerance.lighthouse names its address), until it is stopped."""

from __future__ import annotations

import os
import signal
import socket
import threading

# Seconds the lighthouse serves on after a stop signal. A preemption (scancel) signals every process of
# the job at once: the groups finish the step they are in, which may need one more quorum, and save;
# below torchrun's and Slurm's 30 s grace. A Ctrl-C after the first signal stops it at once.
STOP_GRACE = 20.0


def serve(port: int, min_groups: int, join_timeout: float, heartbeat_timeout: float, say=print) -> int:
    """Run the lighthouse on `port` (0: any free one) until STOP_GRACE seconds after SIGTERM or SIGINT (a
    SIGINT after the first signal: at once); its address is said first.
    min_groups: the fewest groups of a quorum; join_timeout: seconds a quorum waits for a group that
    heartbeats but has not asked yet; heartbeat_timeout: seconds of silence before a group is gone."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum tick at its default
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=f"[::]:{port}", min_replicas=min_groups, join_timeout_ms=int(join_timeout * 1000),
                              heartbeat_timeout_ms=int(heartbeat_timeout * 1000))
    stopped, now = threading.Event(), threading.Event()

    def on_signal(signum, frame) -> None:
        if signum == signal.SIGINT and stopped.is_set():
            now.set()
        stopped.set()

    for signum in (signal.SIGTERM, signal.SIGINT):  # before its address is said: a signal from then on is a stop
        signal.signal(signum, on_signal)
    address = server.address().replace("[::]", socket.gethostname())
    say(f"hybridpar lighthouse: {address} (fault_tolerance.lighthouse = \"{address}\"); "
        f"a quorum of {min_groups} group(s) or more; Ctrl-C stops it {STOP_GRACE:.0f} s later (the groups' last "
        "steps), a second Ctrl-C at once", flush=True)
    stopped.wait()
    now.wait(STOP_GRACE)
    server.shutdown()
    return 0
