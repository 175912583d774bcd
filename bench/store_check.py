"""The cost of checked bytes (hybridpar.data.chunks): a token store's windows read with every chunk
checked the first time (CRC-32C + the vocabulary scan), against the same reads unchecked, and
`hybridpar verify`'s speed at 1 and 2 threads.

A store of random uint16 tokens (`--mb` of them, 64 MB shards) is written by the shard writer;
windows of seq_len + 1 tokens are read in the sampler's random order, as a training rank reads them:
    unchecked  the memory maps alone (what version 1 stores read)
    first      a fresh TokenStore: each chunk checked when a window first touches it
    again      the same TokenStore: every chunk already checked (a bit looked up)
The files are in the page cache throughout (written just before): the check's own cost, not the disk's.

    python3 bench/store_check.py [--mb 256] [--seq-len 2048] [--rounds 3]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybridpar.data import shards as shard_files  # noqa: E402
from hybridpar.data.store.token_store import FORMAT, MANIFEST, VERSION, TokenStore, _Concatenated  # noqa: E402
from hybridpar.data.store.integrity import verify_store  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "store_check.json"
VOCAB = 32000


def make_store(folder: Path, mb: float) -> TokenStore:
    shard_files.MAX_SHARD_TOKENS = 32 << 20  # 64 MB shards: several, for verify's threads
    rng = np.random.default_rng(0)
    n = int(mb * 2**20) // 2
    writer = shard_files.ShardWriter(folder, 0, 0)
    (folder / "units").mkdir(parents=True)
    for start in range(0, n, 1 << 22):
        writer.write(rng.integers(0, VOCAB, min(1 << 22, n - start), dtype=np.uint16))
    shards = [{k: s[k] for k in ("name", "tokens", "size", "chunks_crc32c")} for s in writer.finish()]
    manifest = {"format": FORMAT, "version": VERSION, "dtype": "uint16", "vocab_size": VOCAB, "eos_id": 0,
                "tokenizer_sha256": "", "files": [{"tokens": n}],
                "parts": {"train": {"tokens": n, "documents": 1, "shards": shards}}}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return TokenStore(folder)


def read_windows(tokens, starts: np.ndarray, seq_len: int) -> float:
    """Seconds a window, reading each as PackedDataset does (an int64 copy)."""
    began = time.perf_counter()
    for s in starts:
        np.asarray(tokens[int(s):int(s) + seq_len + 1], dtype=np.int64)
    return (time.perf_counter() - began) / len(starts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=256.0)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        store = make_store(Path(tmp) / "store", args.mb)
        print(f"store: {store.n_tokens:,} tokens in {len(store.shards)} shards, written in "
              f"{time.perf_counter() - began:.1f} s", flush=True)
        n_windows = (store.n_tokens - 1) // args.seq_len
        starts = np.random.default_rng(1).permutation(n_windows) * args.seq_len  # one epoch, the sampler's way
        rows: dict[str, list[float]] = {"unchecked": [], "first": [], "again": []}
        for _ in range(args.rounds):  # interleaved, so a busy moment hits every variant alike
            plain = _Concatenated([np.memmap(store.folder / s["name"], dtype=np.uint16, mode="r") for s in store.shards])
            rows["unchecked"].append(read_windows(plain, starts, args.seq_len))
            fresh = TokenStore(store.folder).tokens
            rows["first"].append(read_windows(fresh, starts, args.seq_len))
            rows["again"].append(read_windows(fresh, starts, args.seq_len))
        result = {k: statistics.median(v) * 1e6 for k, v in rows.items()}
        inside = [int(s) for s in starts if s + args.seq_len + 1 <= store.shards[0]["tokens"]]
        began = time.perf_counter()
        for s in inside:  # the check alone, every chunk checked already: what a window pays from then on
            fresh.check(0, s, s + args.seq_len + 1)
        result["check_again"] = (time.perf_counter() - began) / len(inside) * 1e6
        for k, us in result.items():
            print(f"{k:>9}: {us:7.2f} us a window of {args.seq_len + 1} tokens "
                  f"({us / result['unchecked']:.2f}x unchecked)" if k != "check_again" else
                  f"{k:>9}: {us:7.2f} us a window: the look-up alone, once every chunk is checked", flush=True)
        for threads in (1, 2):
            began = time.perf_counter()
            assert verify_store(store.folder, out=io.StringIO(), workers=threads) == 0
            seconds = time.perf_counter() - began
            result[f"verify_{threads}_threads_GBps"] = args.mb * 2**20 / seconds / 1e9
            print(f"verify, {threads} thread{'s' if threads > 1 else ''}: {args.mb:.0f} MB in {seconds:.2f} s "
                  f"({result[f'verify_{threads}_threads_GBps']:.2f} GB/s)", flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"mb": args.mb, "seq_len": args.seq_len, "rounds": args.rounds, **result}, indent=1))


if __name__ == "__main__":
    main()
