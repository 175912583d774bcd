"""Shared fixtures: spawned worker pools (one per world size) and the equivalence-error table."""

from __future__ import annotations

import math
import os
import sys
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite starts hundreds of Python processes (a job's ranks, its launcher, a CLI run), each of which
# imports hybridpar and test modules. Where the environment forbids bytecode files (PYTHONDONTWRITEBYTECODE,
# to keep the checkout clean) each of them compiled those sources anew; they are cached outside the
# checkout instead, in a folder of the temp dir kept between sessions (a stale file is recompiled).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    os.environ.setdefault("PYTHONPYCACHEPREFIX", os.path.join(tempfile.gettempdir(), f"hybridpar-pycache-{os.getuid()}"))
    sys.pycache_prefix, sys.dont_write_bytecode = os.environ["PYTHONPYCACHEPREFIX"], False

import pytest  # noqa: E402

from hybridpar.progress import log_to_terminal  # noqa: E402
from tests.distributed import WorkerPool  # noqa: E402

# The library logs; tests read its lines where the command line shows them (stdout, stderr).
log_to_terminal()

@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small jsonl corpus (real text from the embedded corpus) and a cache folder shared by all runs."""
    import json

    from hybridpar.data import default_corpus_documents

    root = tmp_path_factory.mktemp("train_data")
    path = root / "docs.jsonl"
    with open(path, "w") as f:
        for doc in default_corpus_documents(400):
            f.write(json.dumps({"text": doc}) + "\n")
    return {"source": str(path), "cache_dir": str(root / "cache")}


# (test and label, worst quantity, its relative error, bound): one row per check_close call.
_ERRORS: list[tuple[str, str, float, float]] = []


@pytest.fixture(scope="session")
def workers():
    """workers(n) -> a WorkerPool of n gloo ranks, started once and reused by every test."""
    pools: dict[int, WorkerPool] = {}

    def get(world_size: int) -> WorkerPool:
        pool = pools.get(world_size)
        if pool is None or not pool.alive:
            pool = pools[world_size] = WorkerPool(world_size)
        return pool

    yield get
    for pool in pools.values():  # every pool leaves at once: the session's end waits for the slowest only
        pool.stop()
    for pool in pools.values():
        pool.close()


def pytest_collection_modifyitems(config, items):
    """The fast tier (`python -m pytest -m fast`, the contributor's loop) is every test not marked
    slow or slurm: a test that takes more than a few seconds says so with @pytest.mark.slow."""
    for item in items:
        if item.get_closest_marker("slow") is None and item.get_closest_marker("slurm") is None:
            item.add_marker(pytest.mark.fast)


def compare(who: str, label: str, per_rank, bound: float) -> None:
    """per_rank: {name: error} or one such dict per rank (the worst rank counts); every error <= bound."""
    ranks = [per_rank] if isinstance(per_rank, dict) else list(per_rank)
    # A comparison of nothing would pass whatever the code did: a rank that compared no quantity fails.
    assert ranks and all(ranks), f"{label}: nothing was compared ({len(ranks)} ranks: {[len(r) for r in ranks]})"
    worst: dict[str, float] = {}
    for errors in ranks:
        for name, err in errors.items():
            err, before = float(err), worst.get(name)
            # NaN wins: max() would let a rank's NaN hide behind another rank's finite error.
            worst[name] = err if before is None or math.isnan(err) or err > before else before
    name = max(worst, key=worst.get)
    _ERRORS.append((f"{who} {label}", f"{name} (worst of {len(worst)})", worst[name], bound))
    bad = {n: e for n, e in worst.items() if not e <= bound}
    assert not bad, f"{label}: relative error above {bound:g}: " + ", ".join(f"{n}={e:.3g}" for n, e in bad.items())


@pytest.fixture
def check_close(request):
    """check_close(label, per_rank, bound): every relative error <= bound; all are printed at the end."""
    return lambda label, per_rank, bound: compare(request.node.name, label, per_rank, bound)


def pytest_terminal_summary(terminalreporter):
    if not _ERRORS:
        return
    terminalreporter.section("relative errors against single-process math (worst quantity per check)")
    width = max(len(check) for check, _, _, _ in _ERRORS)
    qwidth = max(len(quantity) for _, quantity, _, _ in _ERRORS)
    for check, quantity, err, bound in _ERRORS:
        terminalreporter.write_line(f"{check:<{width}}  {quantity:<{qwidth}}  {err:.2e}  (bound {bound:.0e})")
