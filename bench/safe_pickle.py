"""The cost of reading a checkpoint's `.metadata` through the restricted unpickler.

1. A 1 GB checkpoint (64 tensors of 16 MB) loaded with hybridpar's reader as it is (restricted
   `.metadata`) against the same reader taking DCP's own unrestricted `read_metadata`, warm page
   cache, rounds interleaved A B / B A.
2. `.metadata` alone, at the size of a large job's: Llama 2 70B's tensors (weights and AdamW's two
   moments) each split into 128 chunks, read with plain `pickle.loads` against the restricted one.

    python3 bench/safe_pickle.py [--gb 1] [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybridpar.fastpaths.dcp_reader import FastFileSystemReader  # noqa: E402
from hybridpar.safe_pickle import dcp_metadata_global, loads  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "safe_pickle.json"


class UnrestrictedReader(FastFileSystemReader):
    """hybridpar's reader with DCP's own read_metadata (a plain pickle.load): the baseline."""

    read_metadata = FileSystemReader.read_metadata


def _load_seconds(folder: Path, reader_type, target: dict) -> float:
    for t in target.values():
        t.zero_()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=reader_type(folder, thread_count=2), no_dist=True)
    return time.perf_counter() - start


def bench_load(gb: float, rounds: int, root: Path) -> dict:
    n = 64
    rows = int(gb * 2**30 / n / 4 / 1024)
    state = {f"w{i}": torch.randn(rows, 1024) for i in range(n)}
    folder = root / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    size = sum(p.stat().st_size for p in folder.iterdir())
    target = {k: torch.empty_like(v) for k, v in state.items()}
    _load_seconds(folder, FastFileSystemReader, target)  # warm the page cache
    times = {"restricted": [], "unrestricted": []}
    for r in range(rounds):
        order = ["restricted", "unrestricted"] if r % 2 == 0 else ["unrestricted", "restricted"]
        for name in order:
            reader = FastFileSystemReader if name == "restricted" else UnrestrictedReader
            times[name].append(_load_seconds(folder, reader, target))
            assert all(torch.equal(target[k], state[k]) for k in state), name
    return {"bytes": size, "metadata_bytes": (folder / ".metadata").stat().st_size, "seconds": times}


def _big_metadata(chunks: int = 128) -> bytes:
    """A .metadata shaped like Llama 2 70B's at `chunks` ranks: weights and AdamW's two moments."""
    dim, hidden, layers, vocab = 8192, 28672, 80, 32000
    shapes = {"tok_embeddings.weight": (vocab, dim), "output.weight": (vocab, dim), "norm.weight": (dim,)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({p + "attention.wq.weight": (dim, dim), p + "attention.wk.weight": (1024, dim),
                       p + "attention.wv.weight": (1024, dim), p + "attention.wo.weight": (dim, dim),
                       p + "feed_forward.w1.weight": (hidden, dim), p + "feed_forward.w2.weight": (dim, hidden),
                       p + "feed_forward.w3.weight": (hidden, dim), p + "attention_norm.weight": (dim,),
                       p + "ffn_norm.weight": (dim,)})
    props = TensorProperties(dtype=torch.float32)
    state, storage = {}, {}
    for prefix in ("model.", "optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq."):
        for name, shape in shapes.items():
            fqn = prefix + name
            step = -(-shape[0] // chunks)
            parts = [ChunkStorageMetadata(offsets=torch.Size([lo] + [0] * (len(shape) - 1)),
                                          sizes=torch.Size([min(step, shape[0] - lo)] + list(shape[1:])))
                     for lo in range(0, shape[0], step)]
            state[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(shape), chunks=parts)
            for j, c in enumerate(parts):
                storage[MetadataIndex(fqn, c.offsets, j)] = {"file": f"__{j}_0.distcp", "offset": j}
    return pickle.dumps(Metadata(state_dict_metadata=state, storage_data=storage))


def bench_metadata(rounds: int) -> dict:
    data = _big_metadata()
    times = {"restricted": [], "unrestricted": []}
    for r in range(rounds):
        order = ["restricted", "unrestricted"] if r % 2 == 0 else ["unrestricted", "restricted"]
        for name in order:
            start = time.perf_counter()
            if name == "restricted":
                loads(data, dcp_metadata_global, "bench", "a checkpoint's .metadata")
            else:
                pickle.loads(data)
            times[name].append(time.perf_counter() - start)
    return {"bytes": len(data), "seconds": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="hybridpar-bench-"))
    try:
        load = bench_load(args.gb, args.rounds, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    meta = bench_metadata(max(args.rounds, 10))
    rows = []
    for label, result in (("1 GB checkpoint load", load), (".metadata alone (70B, 128 chunks)", meta)):
        a, b = statistics.median(result["seconds"]["restricted"]), statistics.median(result["seconds"]["unrestricted"])
        ratios = [x / y for x, y in zip(result["seconds"]["restricted"], result["seconds"]["unrestricted"])]
        result["median_ratio"] = statistics.median(ratios)
        rows.append((label, result["bytes"], a, b, result["median_ratio"]))
    print(f"{'what':<36} {'bytes':>14} {'restricted s':>13} {'plain s':>9} {'ratio (median of rounds)':>25}")
    for label, size, a, b, ratio in rows:
        print(f"{label:<36} {size:>14,} {a:>13.4f} {b:>9.4f} {ratio:>25.3f}")
    print(f"the 1 GB checkpoint's .metadata: {load['metadata_bytes']:,} bytes")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"load": load, "metadata": meta}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
