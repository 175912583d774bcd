"""Data: tokenizer -> packed token file -> windows -> sampler keyed by dp coordinates -> batches.

    tokenizer = load_or_train_tokenizer(None, vocab_size=4096, documents_factory=default_corpus_documents,
                                        corpus_id=default_corpus_id(), cache_dir=cache)
    tokens = prepare_cached("default", tokenizer, cache)
    loader = build_dataloader(PackedDataset(tokens, seq_len), dp_rank=parallel.dp_rank,
                              dp_size=parallel.dp_size, micro_batch_size=2, seed=0)
    inputs, targets = next(loader)        # loader.state_dict() / load_state_dict() resume exactly

Nothing here needs torch.distributed: ranks coordinate through file locks in the cache folder.
"""

from hybridpar.data.corpus import default_corpus_documents, default_corpus_id
from hybridpar.data.loader import (
    DistributedSampler,
    PackedDataset,
    ResumableDataLoader,
    build_dataloader,
    check_dataset_size,
    check_vocab,
)
from hybridpar.data.pipeline import build_data, build_training_data, default_cache_dir
from hybridpar.data.prepare import TokenFile, prepare_cached, prepare_split_cached, prepare_tokens, source_documents
from hybridpar.data.sources import source_id
from hybridpar.data.tokenizer import Tokenizer, load_or_train_tokenizer, train_tokenizer

__all__ = [
    "Tokenizer",
    "train_tokenizer",
    "load_or_train_tokenizer",
    "default_corpus_documents",
    "default_corpus_id",
    "prepare_tokens",
    "prepare_cached",
    "prepare_split_cached",
    "source_documents",
    "source_id",
    "TokenFile",
    "PackedDataset",
    "DistributedSampler",
    "ResumableDataLoader",
    "build_dataloader",
    "build_data",
    "build_training_data",
    "default_cache_dir",
    "check_dataset_size",
    "check_vocab",
]
