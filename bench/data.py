"""Data preparation and loading speed.

1. `hybridpar prepare` (prepare_store) at 1 and 2 workers on the same .jsonl input, rounds
   interleaved A B / B A, next to the tokenizer library's own speed on one core over the same
   documents (sentencepiece's batch encode, one thread): the limit per core.
2. The loader's share of a training step: one process trains the tiny preset on the store
   (world 1, the local job's batch) and times next(loader) on the side.

    python3 bench/data.py [--mb 48] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybridpar.data import Tokenizer, default_corpus_documents, train_tokenizer  # noqa: E402
from hybridpar.data.store_prepare import prepare_store  # noqa: E402

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


def prepare_speed(source: Path, tokenizer: Tokenizer, root: Path, workers: int, round_: int) -> dict:
    out = root / f"store-w{workers}-r{round_}"
    start = time.perf_counter()
    store = prepare_store(source, tokenizer, out, workers=workers, unit_bytes=4 << 20, report=False)
    seconds = time.perf_counter() - start
    size = source.stat().st_size
    result = {"seconds": seconds, "mb_per_s": size / 2**20 / seconds, "tokens_per_s": store.n_tokens / seconds,
              "tokens": store.n_tokens}
    shutil.rmtree(out)
    return result


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
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hybridpar-bench-data-"))
    try:
        source, documents = make_corpus(root, args.mb, args.doc_chars)
        tokenizer = train_tokenizer(documents[:3000], 4096, root / "tokenizer.model")
        size = source.stat().st_size
        library = library_speed(tokenizer, documents, size)
        runs = {1: [], 2: []}
        for r in range(args.rounds):
            for workers in ((1, 2) if r % 2 == 0 else (2, 1)):
                runs[workers].append(prepare_speed(source, tokenizer, root, workers, r))
        loader = loader_share(source, tokenizer, root)
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    best = {w: max(runs[w], key=lambda r: r["mb_per_s"]) for w in runs}
    print(f"input: {size / 2**20:.1f} MB of .jsonl, {len(documents):,} documents of about {args.doc_chars:,} characters, "
          f"{best[1]['tokens']:,} tokens, sentencepiece 4096-token vocabulary")
    print(f"{'':<34}{'MB/s':>8}{'tokens/s':>14}{'per worker vs library':>24}")
    print(f"{'sentencepiece alone, one thread':<34}{library['mb_per_s']:>8.1f}{library['tokens_per_s']:>14,.0f}")
    for w in (1, 2):
        per_worker = best[w]["tokens_per_s"] / w / library["tokens_per_s"]
        print(f"{f'hybridpar prepare, {w} worker(s)':<34}{best[w]['mb_per_s']:>8.1f}{best[w]['tokens_per_s']:>14,.0f}"
              f"{per_worker:>23.2f}x")
    ratios = [b["seconds"] / a["seconds"] for a, b in zip(runs[2], runs[1])]
    print(f"2 workers / 1 worker: {best[2]['mb_per_s'] / best[1]['mb_per_s']:.2f}x (best of each), "
          f"{statistics.median(ratios):.2f}x (median of the rounds' ratios)")
    print(f"loader: {1e3 * loader['loader_s']:.3f} ms per batch of 8 x 128 against a {1e3 * loader['step_s']:.1f} ms "
          f"training step (tiny preset, world 1): {100 * loader['share']:.2f}% of the step")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"input_bytes": size, "doc_chars": args.doc_chars, "library": library, "prepare": runs, "loader": loader,
                                   "speedup_2_workers": statistics.median(ratios)}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
