"""Packed windows, a sampler keyed by data-parallel coordinates, and a resumable batch loader.

Ranks of one model-parallel group must see the same batch, so everything here takes the
data-parallel rank and size (ParallelDims.dp_rank / dp_size), never the global rank.

The position in the data is one number per epoch, `global_offset`: how many samples of the epoch's
permutation the whole data-parallel group has consumed. Rank r of D reads perm[offset + r :: D],
so a position saved at one dp size resumes at another, and the samples consumed are always
perm[:offset] exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional, Union

import numpy as np
import torch
import torch.utils.data

from hybridpar.data.store import TokenStore

EXHAUSTED_CHOICES = ("repeat", "stop")


class SourceExhaustedError(ValueError):
    """The data ran out with data.on_exhausted = "stop" (a single source's or a blend's source).
    Every rank reaches it at the same step: the trainer saves the last step that trained and stops."""

    every_rank = True  # hybridpar.mesh.ranks.raised_by_every_rank


def exhausted(name: str, sequences: int, blend: bool = False) -> SourceExhaustedError:
    more = ", give it more data or a lower weight" if blend else " or give it more data"
    return SourceExhaustedError(
        f"data source {name!r} is exhausted: it ran out after {sequences:,} sequences (all of its data, once; "
        f"data.on_exhausted = \"stop\"): set data.on_exhausted = \"repeat\" to go through it again{more}")


class PackedDataset(torch.utils.data.Dataset):
    """Window i = tokens[i*seq_len : i*seq_len + seq_len + 1] as int64: inputs and targets overlap by one."""

    def __init__(self, token_file: Union[TokenStore, str, Path], seq_len: int) -> None:
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        # A TokenStore (hybridpar.data.store) or its folder; any object with tokens and n_tokens
        self.token_file = TokenStore(token_file) if isinstance(token_file, (str, Path)) else token_file
        self.seq_len = seq_len

    @property
    def n_tokens(self) -> int:
        return self.token_file.n_tokens

    def __len__(self) -> int:
        return max(0, (self.n_tokens - 1) // self.seq_len)

    def __getitem__(self, index: int) -> torch.Tensor:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} is outside the dataset's {len(self)} windows")
        start = index * self.seq_len
        window = np.asarray(self.token_file.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        return torch.from_numpy(window)


class DistributedSampler(torch.utils.data.DistributedSampler):
    """torch's DistributedSampler (shuffle, drop_last) over dp coordinates, starting at a global offset.

    At offset 0 it yields exactly what torch's sampler yields. From offset o, rank r yields
    perm[o + r :: dp_size], cut so every rank gets the same count. The offset is where the next
    iteration starts; counting what was consumed is the loader's job (DataLoader workers fetch
    ahead, so the sampler cannot know).
    """

    def __init__(self, dataset, *, dp_rank: int, dp_size: int, seed: int = 0, shuffle: bool = True) -> None:
        if not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"dp_size must be a positive integer, got {dp_size!r}")
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size - 1}] for dp_size {dp_size}, got {dp_rank!r}")
        super().__init__(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.global_offset = 0

    def permutation(self) -> torch.Tensor:
        """This epoch's order of all samples, the same on every rank (torch's seed + epoch rule)."""
        if not self.shuffle:
            return torch.arange(len(self.dataset))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator)

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of `epoch`; a position inside that same epoch (just restored) is kept."""
        if epoch != self.epoch:
            self.global_offset = 0
        super().set_epoch(epoch)

    def set_position(self, epoch: int, global_offset: int) -> None:
        n = len(self.dataset)
        if not 0 <= global_offset <= n:
            raise ValueError(f"global_offset {global_offset} is outside an epoch of {n} samples")
        super().set_epoch(int(epoch))
        self.global_offset = int(global_offset)

    def __len__(self) -> int:
        return (len(self.dataset) - self.global_offset) // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        start = self.global_offset + self.rank
        stop = self.global_offset + len(self) * self.num_replicas
        return iter(self.permutation()[start : stop : self.num_replicas].tolist())

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "global_offset": self.global_offset}

    def load_state_dict(self, state: dict) -> None:
        self.set_position(int(state["epoch"]), int(state["global_offset"]))


def _inputs_and_targets(windows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    # Split in the collate step (inside the workers) so both come out contiguous and get pinned.
    batch = torch.stack(windows)
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


class ResumableDataLoader:
    """Endless (inputs [B, S], targets [B, S]) int64 micro-batches for one data-parallel rank.

    Epochs advance by themselves. The position counts batches handed to the caller (not those
    the workers fetched ahead), so state_dict() taken after any batch, loaded into a fresh loader,
    makes it yield exactly the batch the original would have yielded next, at any dp size.
    """

    def __init__(
        self,
        dataset: PackedDataset,
        *,
        dp_rank: int,
        dp_size: int,
        micro_batch_size: int,
        seed: int,
        num_workers: int = 0,
        pin_memory: Optional[bool] = None,
        on_exhausted: str = "repeat",
        name: str = "",
    ) -> None:
        if on_exhausted not in EXHAUSTED_CHOICES:
            raise ValueError(f"data.on_exhausted must be one of {', '.join(EXHAUSTED_CHOICES)}, got {on_exhausted!r}")
        self.on_exhausted, self.name = on_exhausted, name or "data.source"
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}")
        check_dataset_size(dataset, micro_batch_size * dp_size, micro_batch_size=micro_batch_size, dp_size=dp_size)
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.dp_size = dp_size
        self.seed = seed
        self.sampler = DistributedSampler(dataset, dp_rank=dp_rank, dp_size=dp_size, seed=seed)
        self._loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=micro_batch_size,
            sampler=self.sampler,
            drop_last=True,
            num_workers=num_workers,
            pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
            collate_fn=_inputs_and_targets,
            persistent_workers=num_workers > 0,
        )
        self.epoch = 0
        self.global_offset = 0  # samples of this epoch consumed by the whole dp group
        self._batches: Optional[Iterator] = None

    def __iter__(self) -> "ResumableDataLoader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        started_fresh = False
        while True:
            if self._batches is None:
                self.sampler.set_position(self.epoch, self.global_offset)
                started_fresh = self.global_offset == 0
                self._batches = iter(self._loader)
            try:
                batch = next(self._batches)
            except StopIteration:
                if started_fresh:  # guarded by check_dataset_size; never loop forever
                    raise RuntimeError("an epoch yielded no batch: the dataset is smaller than one micro-batch per rank")
                if self.on_exhausted == "stop":  # every rank at the same batch: their epochs are cut alike
                    self._batches = None
                    raise exhausted(self.name, self.global_offset)
                self._batches = None
                self.epoch += 1
                self.global_offset = 0
                continue
            self.global_offset += self.micro_batch_size * self.dp_size
            return batch

    @property
    def samples_per_epoch(self) -> int:
        return len(self.dataset)

    def state_dict(self) -> dict:
        """The same on every rank of the job: the global position, not this rank's."""
        return {
            "epoch": self.epoch,
            "global_offset": self.global_offset,
            "samples_per_epoch": self.samples_per_epoch,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Continue from `state`. strict: refuse a position saved for other data or another seed,
        where the order of samples differs, so the position would not mean the same samples."""
        epoch, offset = int(state["epoch"]), int(state["global_offset"])
        if strict:
            for key, mine in (("samples_per_epoch", self.samples_per_epoch), ("seed", self.seed)):
                if key in state and int(state[key]) != mine:
                    raise ValueError(
                        f"the saved data position is for {key} {int(state[key])}, this loader has {mine}: "
                        f"the data, seq_len or seed changed, so the sample order differs; use the same ones "
                        f"to resume, or load with strict=False to start at the same offset anyway"
                    )
        if not 0 <= offset <= self.samples_per_epoch:
            offset = 0  # only reachable with strict=False on smaller data: start the epoch over
        self.epoch, self.global_offset = epoch, offset
        self._batches = None  # batches the workers fetched from the old position are dropped


def build_dataloader(dataset: PackedDataset, **kwargs) -> ResumableDataLoader:
    """The loader for one data-parallel rank (ResumableDataLoader's keyword arguments): pass
    ParallelDims.dp_rank / dp_size, never the global rank."""
    return ResumableDataLoader(dataset, **kwargs)


def check_dataset_size(
    dataset: PackedDataset,
    global_batch: int,
    *,
    micro_batch_size: Optional[int] = None,
    grad_accum: Optional[int] = None,
    dp_size: Optional[int] = None,
) -> None:
    """Raise ValueError when the dataset has fewer windows than one global batch needs.

    global_batch = micro_batch x grad_accum x dp_size; pass the factors to have them named.
    """
    n = len(dataset)
    if n >= global_batch:
        return
    factors = [(name, value) for name, value in (("micro_batch", micro_batch_size), ("grad_accum", grad_accum), ("dp_size", dp_size)) if value is not None]
    product = " x ".join(f"{name} {value}" for name, value in factors)
    breakdown = f" ({product})" if factors else " (micro_batch x grad_accum x dp_size)"
    seq_len = getattr(dataset, "seq_len", None)
    n_tokens = getattr(dataset, "n_tokens", None)
    size = f" of seq_len + 1 = {seq_len + 1} tokens from {n_tokens} tokens" if seq_len is not None and n_tokens is not None else ""
    raise ValueError(
        f"the dataset has {n} windows{size}, but one global batch needs {global_batch}{breakdown}; "
        f"use more data, a smaller seq_len, or a smaller micro-batch, grad_accum or data-parallel size"
    )


def check_vocab(tokenizer_vocab: int, model_vocab: int) -> None:
    """Raise ValueError when the tokenizer can produce ids the model's embedding does not have."""
    if tokenizer_vocab > model_vocab:
        raise ValueError(
            f"the tokenizer has {tokenizer_vocab} tokens but the model's vocab_size is {model_vocab}: "
            f"set the model's vocab_size to at least {tokenizer_vocab}, or use a tokenizer with at most "
            f"{model_vocab} tokens"
        )
