"""Data preparation and loading speed, and the memory of a preparation worker.

1. `hybridpar prepare` (prepare_store, in a process of its own) at 1 and 2 workers on the same
   .jsonl input, rounds interleaved A B / B A, next to the tokenizer library's own speed on one
   core over the same documents (sentencepiece's batch encode, one thread): the limit per core.
   Each run's peak resident set per worker (the process itself at 1 worker, its largest worker
   process at 2). With --against DIR, every run is made with DIR's code too, interleaved
   (A: DIR, B: this tree): the speed and memory of a change against main.
2. One document of --long-mb MB of words without a newline, as a .jsonl record: the peak per
   worker (before, about 50x the document).
3. The loader's share of a training step: one process trains the tiny preset on the store
   (world 1, the local job's batch) and times next(loader) on the side.

    python3 bench/data.py [--mb 48] [--rounds 2] [--against /work/main] [--long-mb 20]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybridpar.data import Tokenizer, default_corpus_documents, train_tokenizer  # noqa: E402
from hybridpar.data.store.prepare import prepare_store  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "data.json"
BATCH_CHARS = 1 << 17


def make_corpus(root: Path, mb: float, doc_chars: int) -> tuple[Path, list[str]]:
    """`mb` of .jsonl: the embedded corpus's docstrings joined into documents of about `doc_chars`
    (web pages are a few KB; a docstring is a few hundred characters)."""
    documents, joined = [], ""
    for d in default_corpus_documents():
        joined = f"{joined}\n\n{d}" if joined else d
        if len(joined) >= doc_chars:
            documents.append(joined)
            joined = ""
    path, size, out = root / "corpus.jsonl", 0, []
    with open(path, "w") as f:
        while size < mb * 2**20:
            for d in documents:
                line = json.dumps({"text": d}) + "\n"
                f.write(line)
                out.append(d)
                size += len(line.encode())
                if size >= mb * 2**20:
                    break
    return path, out


def library_speed(tokenizer: Tokenizer, documents: list[str], size: int) -> dict:
    """sentencepiece on one thread over the same documents, in batches of about BATCH_CHARS."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer.path))
    batches, batch, chars = [], [], 0
    for d in documents:
        batch.append(d)
        chars += len(d)
        if chars >= BATCH_CHARS:
            batches.append(batch)
            batch, chars = [], 0
    batches.append(batch)
    start, tokens = time.perf_counter(), 0
    for b in batches:
        tokens += sum(len(ids) for ids in sp.encode(b, out_type="numpy", num_threads=1))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "mb_per_s": size / 2**20 / seconds, "tokens_per_s": tokens / seconds}


# A preparation in a process of its own, with the code of the tree on its PYTHONPATH: its speed and
# its peak resident set (RUSAGE_CHILDREN: the largest of its worker processes, once they are joined;
# each starts from this process's resident set at its start, some 70 MB, below what it reaches).
_PREPARE = """
import json, resource, sys, time
from hybridpar.data import Tokenizer
try:
    from hybridpar.data.store.prepare import prepare_store
except ImportError:  # a tree from before data/store/ was a package
    try:
        from hybridpar.data.store_prepare import prepare_store
    except ImportError:  # a tree from before store_build.py was split
        from hybridpar.data.store_build import prepare_store
source, tokenizer, out, workers, unit_bytes = sys.argv[1:]
start = time.perf_counter()
store = prepare_store(source, Tokenizer(tokenizer), out, workers=int(workers), unit_bytes=int(unit_bytes),
                      report=False)
seconds = time.perf_counter() - start
# VmHWM, not RUSAGE_SELF: a child's ru_maxrss starts at its parent's resident set (this bench's, with torch)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) / 1024
print(json.dumps({"seconds": seconds, "tokens": store.n_tokens, "documents": store.n_documents, "self_mb": hwm,
                  "workers_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def prepare_run(tree: Path, source: Path, tokenizer: Tokenizer, out: Path, workers: int,
                unit_bytes: int = 4 << 20) -> dict:
    """prepare_store with `tree`'s code in a fresh process: seconds, MB/s, tokens/s and the peak
    resident set per worker (the process at 1 worker, its largest worker process at 2)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _PREPARE, str(source), str(tokenizer.path), str(out), str(workers),
                           str(unit_bytes)], cwd=tree, env=env, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    shutil.rmtree(out)
    size = source.stat().st_size
    return {**result, "mb_per_s": size / 2**20 / result["seconds"], "tokens_per_s": result["tokens"] / result["seconds"],
            "peak_mb_per_worker": result["workers_mb"] or result["self_mb"]}  # in-process when there is one unit


def make_long_document(root: Path, mb: float) -> Path:
    """One .jsonl record of `mb` MB of words and no newline (then a short one)."""
    words = ("lorem ipsum dolor sit amet, consectetur adipiscing elit " * 20_000).encode()
    path = root / "long.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"text": "')
        for _ in range(int(mb * 2**20 / len(words)) + 1):
            f.write(words)
        f.write(b'"}\n{"text": "a short one"}\n')
    return path


def loader_share(source: Path, tokenizer: Tokenizer, root: Path, steps: int = 30) -> dict:
    """Train the tiny preset at world 1 on the store; time next(loader) separately over as many batches."""
    from hybridpar.config import load_config
    from hybridpar.data import PackedDataset, build_dataloader
    from hybridpar.train import Trainer

    store = prepare_store(source, tokenizer, root / "store", workers=1, report=False)
    config = load_config(None, [f"--data.source={store.folder}", "--data.val_fraction=0", f"--train.steps={steps}",
                                "--model.preset=tiny", "--data.seq_len=128", "--data.micro_batch_size=8",
                                f"--output.run_dir={root / 'run'}", "--output.tensorboard=false",
                                "--output.plot=false", "--checkpoint.at_end=false", "--train.log_every=1000",
                                "--train.peak_flops=1e12", "--parallel.mp=1", "--parallel.dp_shard=1"])
    trainer = Trainer(config)
    history = trainer.run()
    step = statistics.median(m["step_time"] for m in history[3:])
    loader = build_dataloader(PackedDataset(store, 128), dp_rank=0, dp_size=1, micro_batch_size=8, seed=0)
    start = time.perf_counter()
    for _ in range(steps):
        next(loader)
    fetch = (time.perf_counter() - start) / steps
    return {"step_s": step, "loader_s": fetch, "share": fetch / step}


def main() -> None:
    import torch.distributed as dist

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=48.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--doc-chars", type=int, default=4000, help="characters a document (1: each docstring alone)")
    parser.add_argument("--against", type=Path, help="another tree (main's checkout): every run made with its code too")
    parser.add_argument("--long-mb", type=float, default=20.0, help="the long document's size (0: none)")
    parser.add_argument("--no-loader", action="store_true", help="skip the loader's share of a training step")
    args = parser.parse_args()
    here = Path(__file__).resolve().parent.parent
    trees = {"B": here} if args.against is None else {"A": args.against.resolve(), "B": here}
    root = Path(tempfile.mkdtemp(prefix="hybridpar-bench-data-"))
    try:
        source, documents = make_corpus(root, args.mb, args.doc_chars)
        tokenizer = train_tokenizer(documents[:3000], 4096, root / "tokenizer.model")
        size = source.stat().st_size
        library = library_speed(tokenizer, documents, size)
        runs = {tree: {1: [], 2: []} for tree in trees}
        for r in range(args.rounds):
            for workers in ((1, 2) if r % 2 == 0 else (2, 1)):
                for tree in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                    runs[tree][workers].append(prepare_run(trees[tree], source, tokenizer, root / "s", workers))
        long = {}
        if args.long_mb:
            long_source = make_long_document(root, args.long_mb)
            long = {tree: prepare_run(trees[tree], long_source, tokenizer, root / "long", 1) for tree in trees}
        loader = None if args.no_loader else loader_share(source, tokenizer, root)
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(args, size, len(documents), library, runs, long, loader, trees)


def report(args, size: int, n_documents: int, library: dict, runs: dict, long: dict, loader: Optional[dict],
           trees: dict) -> None:
    best = {t: {w: max(runs[t][w], key=lambda r: r["mb_per_s"]) for w in (1, 2)} for t in runs}
    print(f"input: {size / 2**20:.1f} MB of .jsonl, {n_documents:,} documents of about {args.doc_chars:,} characters, "
          f"{best['B'][1]['tokens']:,} tokens, sentencepiece 4096-token vocabulary")
    print(f"{'':<40}{'MB/s':>8}{'tokens/s':>14}{'per worker vs library':>24}{'peak MB per worker':>20}")
    print(f"{'sentencepiece alone, one thread':<40}{library['mb_per_s']:>8.1f}{library['tokens_per_s']:>14,.0f}")
    for tree in runs:
        for w in (1, 2):
            b = best[tree][w]
            name = f"{tree} ({trees[tree].name}) prepare, {w} worker(s)"
            peak = max(r["peak_mb_per_worker"] for r in runs[tree][w])
            print(f"{name:<40}{b['mb_per_s']:>8.1f}{b['tokens_per_s']:>14,.0f}"
                  f"{b['tokens_per_s'] / w / library['tokens_per_s']:>23.2f}x{peak:>20.0f}")
    ratios = [b["seconds"] / a["seconds"] for a, b in zip(runs["B"][2], runs["B"][1])]
    print(f"2 workers / 1 worker: {best['B'][2]['mb_per_s'] / best['B'][1]['mb_per_s']:.2f}x (best of each), "
          f"{statistics.median(ratios):.2f}x (median of the rounds' ratios)")
    against = {}
    if "A" in runs:
        for w in (1, 2):
            against[w] = statistics.median(b["seconds"] / a["seconds"] for a, b in zip(runs["A"][w], runs["B"][w]))
            print(f"B / A seconds at {w} worker(s), median of the rounds: {against[w]:.3f}")
    for tree, result in long.items():
        print(f"{tree}: one document of {args.long_mb:g} MB without a newline: {result['seconds']:.1f} s, peak "
              f"{result['peak_mb_per_worker']:.0f} MB")
    if loader is not None:
        print(f"loader: {1e3 * loader['loader_s']:.3f} ms per batch of 8 x 128 against a {1e3 * loader['step_s']:.1f} "
              f"ms training step (tiny preset, world 1): {100 * loader['share']:.2f}% of the step")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"input_bytes": size, "doc_chars": args.doc_chars, "library": library,
                                   "prepare": runs, "trees": {t: str(p) for t, p in trees.items()},
                                   "b_over_a_seconds": against, "long_document": long, "long_mb": args.long_mb,
                                   "loader": loader, "speedup_2_workers": statistics.median(ratios)}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
