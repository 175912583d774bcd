"""Data: tokenizer -> token store -> windows -> sampler keyed by dp coordinates -> batches.

    tokenizer = load_or_train_tokenizer(None, vocab_size=4096, documents_factory=default_corpus_documents,
                                        corpus_id=default_corpus_id(), cache_dir=cache)
    tokens, _ = cached_store("default", tokenizer, cache)   # or prepare_store(files, tokenizer, folder)
    loader = build_dataloader(PackedDataset(tokens, seq_len), dp_rank=parallel.dp_rank,
                              dp_size=parallel.dp_size, micro_batch_size=2, seed=0)
    inputs, targets = next(loader)        # loader.state_dict() / load_state_dict() resume exactly

Nothing here needs torch.distributed: ranks coordinate through file locks in the cache folder.
"""

import importlib

# Where each public name lives, imported on first use: importing hybridpar.data (or one of its
# modules, as a preparation worker does) must not import torch.
_WHERE = {
    "default_corpus_documents": "corpus", "default_corpus_id": "corpus",
    "PackedDataset": "loader", "ResumableDataLoader": "loader", "Source": "loader",
    "build_dataloader": "loader", "check_dataset_size": "loader", "check_vocab": "loader",
    "build_data": "training_data", "build_sources": "training_data", "build_training_data": "training_data",
    "default_cache_dir": "training_data",
    "TokenStore": "store.token_store", "is_store": "sources", "verify_store": "store.integrity",
    "prepare_store": "store.prepare", "cached_store": "store.prepare", "merge_store": "store.prepare",
    "source_documents": "formats",
    "source_id": "sources",
    "Tokenizer": "tokenizer", "load_or_train_tokenizer": "tokenizer", "train_tokenizer": "tokenizer",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"hybridpar.data.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'hybridpar.data' has no attribute {name!r}")


__all__ = sorted(_WHERE)
