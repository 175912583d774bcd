"""Packed windows, a sampler keyed by data-parallel coordinates, and a resumable batch loader.

Ranks of one model-parallel group must see the same batch, so everything here takes the
data-parallel rank and size (ParallelDims.dp_rank / dp_size), never the global rank.

The position in the data is one number per epoch, `global_offset`: how many samples of the epoch's
permutation the whole data-parallel group has consumed. Rank r of D reads perm[offset + r :: D],
so a position saved at one dp size resumes at another, and the samples consumed are always
perm[:offset] exactly.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import numpy as np
import torch
import torch.utils.data

from hybridpar.data.blend import next_sources
from hybridpar.data.store.token_store import TokenStore
from hybridpar.progress import note

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


def validation_windows(store: TokenStore, seq_len: int, where: str) -> PackedDataset:
    """The windows of a validation store, refused in one line when it holds less than one window
    (`where` says which validation data it is)."""
    windows = PackedDataset(store, seq_len)
    if len(windows) == 0:
        raise ValueError(f"the validation data ({where}) has {store.n_tokens} tokens, fewer than one "
                         f"sequence of data.seq_len + 1 = {seq_len + 1}: give it more text")
    return windows


@dataclasses.dataclass(frozen=True)
class Source:
    """One source of the run: a single data.source is a blend of one, weight 1."""

    name: str
    weight: float  # normalised: the weights sum to 1
    dataset: PackedDataset


def torch_permutation(n: int, seed: int) -> np.ndarray:
    """torch's DistributedSampler order of an epoch (seed + epoch): a single source's, as before blends."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return torch.randperm(n, generator=generator).numpy()


class Position:
    """Where the whole data-parallel group is: per source, its epoch and the windows of that epoch
    consumed. `group(n)` hands out the group's next n (source, window) pairs and moves on.

    Which source gives each sequence: next_sources (blend.py). A single source keeps the order it
    always had (torch's DistributedSampler, drop_last): the group's sequences are one run of the
    epoch's permutation, a new epoch when fewer than a group remain. A blend's source s reads its
    k-th sequence at perm_s,e[k mod n_s], e = k // n_s, seeded by (seed, s, e): one at a time, so
    its epochs run on across batches."""

    def __init__(self, sources: Sequence[Source], seed: int, on_exhausted: str) -> None:
        self.sizes = [len(s.dataset) for s in sources]
        self.names, self.weights = [s.name for s in sources], [s.weight for s in sources]
        self.seed, self.on_exhausted = seed, on_exhausted
        self.epochs, self.offsets = [0] * len(sources), [0] * len(sources)
        self._orders: dict[tuple[int, int], np.ndarray] = {}
        self.on_repeat = lambda s: None  # told when source s starts a new epoch (the loader's own position)

    def copy(self) -> "Position":
        """The same place, moving on its own (the sampler's, read ahead of the batches handed out)."""
        twin = object.__new__(Position)
        twin.sizes, twin.names, twin.weights = self.sizes, self.names, self.weights
        twin.seed, twin.on_exhausted, twin.on_repeat = self.seed, self.on_exhausted, lambda s: None
        twin.epochs, twin.offsets, twin._orders = list(self.epochs), list(self.offsets), dict(self._orders)
        return twin

    @property
    def counts(self) -> list[int]:
        """Sequences the group consumed per source (a blend's: epochs run on, none dropped)."""
        return [e * n + o for e, n, o in zip(self.epochs, self.sizes, self.offsets)]

    def _order(self, s: int) -> np.ndarray:
        key = (s, self.epochs[s])
        if key not in self._orders:
            if len(self._orders) > 2 * len(self.sizes):  # keep the epochs in use
                self._orders = {k: v for k, v in self._orders.items() if k[1] >= self.epochs[s] - 1}
            n = self.sizes[s]
            self._orders[key] = (torch_permutation(n, self.seed + self.epochs[s]) if len(self.sizes) == 1 else
                                 np.random.default_rng([self.seed, s, self.epochs[s]]).permutation(n))
        return self._orders[key]

    def _take(self, s: int, m: int) -> list[tuple[int, int]]:
        """The next m windows of source s, starting its next epoch when fewer than m remain."""
        if self.offsets[s] + m > self.sizes[s]:
            if self.on_exhausted == "stop":
                raise exhausted(self.names[s], self.offsets[s], blend=len(self.sizes) > 1)
            self.epochs[s], self.offsets[s] = self.epochs[s] + 1, 0
            self.on_repeat(s)
        start, self.offsets[s] = self.offsets[s], self.offsets[s] + m
        return [(s, int(w)) for w in self._order(s)[start:start + m]]

    def group(self, n: int) -> list[tuple[int, int]]:
        """The group's next n (source, window); nothing moves when the data stops."""
        if len(self.sizes) == 1:
            return self._take(0, n)
        before = list(self.epochs), list(self.offsets)
        try:
            return [pair for s in next_sources(self.weights, self.counts, n) for pair in self._take(s, 1)]
        except SourceExhaustedError:
            self.epochs, self.offsets = before
            raise

    def state(self) -> dict:
        return {"sources": {name: {"epoch": e, "offset": o, "windows": n, "weight": w} for name, e, o, n, w
                            in zip(self.names, self.epochs, self.offsets, self.sizes, self.weights)},
                "seed": self.seed}


class WindowSampler(torch.utils.data.Sampler):
    """The batch sampler of one data-parallel rank: from `start` on, each micro-batch's (source,
    window) pairs, rank r taking positions r, r + dp_size, ... of the group's next micro_batch x
    dp_size. It ends where the data stops; DataLoader workers fetch ahead of what the loader hands out."""

    def __init__(self, start: Position, *, dp_rank: int, dp_size: int, micro_batch_size: int) -> None:
        self.start, self.dp_rank, self.dp_size, self.micro_batch_size = start, dp_rank, dp_size, micro_batch_size

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        position = self.start.copy()
        while True:
            try:
                group = position.group(self.micro_batch_size * self.dp_size)
            except SourceExhaustedError:
                return
            yield group[self.dp_rank::self.dp_size]


class SourceWindows(torch.utils.data.Dataset):
    """(source, window) -> that source's window: what the DataLoader's workers read."""

    def __init__(self, sources: Sequence[Source]) -> None:
        self.datasets = [s.dataset for s in sources]

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def __getitem__(self, key: tuple[int, int]) -> torch.Tensor:
        s, window = key
        return self.datasets[s][window]


def inputs_and_targets(windows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of seq_len + 1 -> (inputs, targets), each contiguous (split in the collate step,
    inside the workers, so both come out contiguous and get pinned)."""
    batch = torch.stack(windows)
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


class ResumableDataLoader:
    """Endless (inputs [B, S], targets [B, S]) int64 micro-batches of one or several weighted
    sources for one data-parallel rank, read by torch's DataLoader (num_workers, pinned memory).

    The position counts batches handed to the caller (not those the workers fetched ahead), so
    state_dict() taken after any batch, loaded into a fresh loader, makes it yield exactly the
    batch the original would have yielded next, at any dp size. `sequences` / `tokens` count what
    the whole group consumed from each source.
    """

    def __init__(self, sources: Sequence[Source], *, dp_rank: int, dp_size: int, micro_batch_size: int, seed: int,
                 num_workers: int = 0, pin_memory: Optional[bool] = None, on_exhausted: str = "repeat") -> None:
        if on_exhausted not in EXHAUSTED_CHOICES:
            raise ValueError(f"data.on_exhausted must be one of {', '.join(EXHAUSTED_CHOICES)}, got {on_exhausted!r}")
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}")
        if not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"dp_size must be a positive integer, got {dp_size!r}")
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size - 1}] for dp_size {dp_size}, got {dp_rank!r}")
        self.sources = list(sources)
        if len(self.sources) == 1:  # its epochs are whole groups: one group at least
            check_dataset_size(self.sources[0].dataset, micro_batch_size * dp_size, micro_batch_size=micro_batch_size,
                               dp_size=dp_size)
        for s in self.sources:
            if len(s.dataset) == 0:
                raise ValueError(f"data source {s.name!r} has {s.dataset.n_tokens} tokens, fewer than one sequence of "
                                 f"data.seq_len + 1 = {s.dataset.seq_len + 1}: give it more text or drop it")
        self.micro_batch_size, self.dp_size, self.seed = micro_batch_size, dp_size, seed
        self.position = Position(self.sources, seed, on_exhausted)
        # Not a bound method: a loader in a reference cycle is freed by the garbage collector, whose
        # order of finalizers leaves torch's DataLoader workers waiting (5 s each) before they are killed.
        self.position.on_repeat = functools.partial(_said_repeat, self.sources, [False] * len(self.sources))
        self.sampler = WindowSampler(self.position, dp_rank=dp_rank, dp_size=dp_size, micro_batch_size=micro_batch_size)
        self._loader = torch.utils.data.DataLoader(
            SourceWindows(self.sources), batch_sampler=self.sampler, num_workers=num_workers,
            pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
            collate_fn=inputs_and_targets, persistent_workers=num_workers > 0)
        self._batches: Optional[Iterator] = None
        # A list: each micro-batch handed out appends the whole group's (source, window) pairs (a replica
        # group's record of what it read, hybridpar.replicas); None: no record.
        self.record: Optional[list] = None

    def __iter__(self) -> "ResumableDataLoader":
        return self

    @property
    def windows(self) -> int:
        """Sequences in all sources together (what the trainer's banner counts)."""
        return sum(len(s.dataset) for s in self.sources)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._batches is None:
            self._batches = iter(self._loader)  # the sampler starts from self.position
        try:
            batch = next(self._batches)
        except StopIteration:  # the sampler met the data's end: the same step on every rank
            self._batches = None
            self.position.group(self.micro_batch_size * self.dp_size)  # raises SourceExhaustedError
            raise RuntimeError("the batch sampler ended before the data did") from None
        pairs = self.position.group(self.micro_batch_size * self.dp_size)
        if self.record is not None:
            self.record.append(pairs)
        return batch

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    @property
    def weights(self) -> list[float]:
        return [s.weight for s in self.sources]

    @property
    def tokens(self) -> list[int]:
        """Tokens trained on so far, per source (targets: seq_len per sequence)."""
        return [c * s.dataset.seq_len for c, s in zip(self.position.counts, self.sources)]

    @property
    def epochs(self) -> list[float]:
        """Passes through each source's data so far (1.5: once and a half)."""
        return [c / len(s.dataset) for c, s in zip(self.position.counts, self.sources)]

    def seek(self, micro_batches: int) -> None:
        """Go to where the data is after `micro_batches` of the whole group's from its start, reading
        none: where a replica group that trained that many continues (hybridpar.replicas)."""
        self.position.epochs = [0] * len(self.sources)
        self.position.offsets = [0] * len(self.sources)
        for _ in range(micro_batches):
            self.position.group(self.micro_batch_size * self.dp_size)
        self._batches = None

    def state_dict(self) -> dict:
        """The same on every rank of the job: the group's position per source, not this rank's."""
        return self.position.state()

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Continue from `state` (this loader's, or one written before the loaders were one: a single
        source's {epoch, global_offset} or a blend's counts). strict: refuse a position saved for
        other data, weights or seed, where the order differs and the position would not mean the
        same samples."""
        saved = saved_position(state, self.position)
        if strict:
            refuse_other_data(saved, state.get("seed"), self.position)
        entries = (list(saved.values()) if len(saved) == 1 else
                   [saved.get(name, {"epoch": 0, "offset": 0}) for name in self.position.names])
        for s, entry in enumerate(entries):
            epoch, offset = int(entry["epoch"]), int(entry["offset"])
            if not 0 <= offset <= self.position.sizes[s]:
                offset = 0  # only reachable with strict=False on smaller data: start the epoch over
            self.position.epochs[s], self.position.offsets[s] = epoch, offset
        self._batches = None  # batches the workers fetched from the old position are dropped


def _said_repeat(sources: Sequence[Source], said: list[bool], s: int) -> None:
    """A blend's source that runs out is said once (its later epochs are counted in summary.json)."""
    if len(sources) > 1 and not said[s]:
        said[s] = True
        note(f"data: source {sources[s].name!r} ran out after {len(sources[s].dataset):,} sequences; "
             "repeating it in a new order (its epochs are counted in summary.json)")


def saved_position(state: dict, position: Position) -> dict:
    """{name: {epoch, offset, windows?, weight?}} of any saved data state."""
    if "global_offset" in state:  # a single source's, before the loaders were one
        saved = {position.names[0]: {"epoch": int(state["epoch"]), "offset": int(state["global_offset"]),
                                     **({"windows": int(state["samples_per_epoch"])} if "samples_per_epoch" in state
                                        else {})}}
    elif "blend" in state:  # a blend's counts, before the loaders were one: epochs run on
        saved = {}
        for name, count in state["blend"].items():
            n = position.sizes[position.names.index(name)] if name in position.names else 1
            epoch, offset = divmod(int(count), n)
            saved[name] = {"epoch": epoch, "offset": offset, "weight": state.get("weights", {}).get(name)}
    else:
        saved = {name: dict(entry) for name, entry in state["sources"].items()}
    if (len(saved) > 1) != (len(position.names) > 1):
        raise ValueError(f"the saved data position is for the sources {', '.join(saved)}, this run reads "
                         f"{', '.join(position.names)}: resume with the same data.source or data.sources")
    return saved


def refuse_other_data(saved: dict, seed, position: Position) -> None:
    """The clear error when a saved position was for other sources, sizes, weights or seed."""
    mine = {name: {"windows": n, "weight": w} for name, n, w in zip(position.names, position.sizes, position.weights)}
    if len(saved) == 1:  # one source: its name (the path) may move; its windows and seed must not
        saved, mine = {"": next(iter(saved.values()))}, {"": next(iter(mine.values()))}
    differs = set(saved) != set(mine) or (seed is not None and int(seed) != position.seed) or any(
        saved[n].get(key) is not None and abs(saved[n][key] - mine[n][key]) > 1e-12
        for n in mine for key in ("windows", "weight"))
    if differs:
        was = {n: {k: v for k, v in e.items() if k in ("windows", "weight") and v is not None} for n, e in saved.items()}
        raise ValueError(f"the saved data position is for {was} with seed {seed}, this run reads {mine} with seed "
                         f"{position.seed}: the data, seq_len, weights or seed changed, so the sample order differs; "
                         "use the same ones to resume, or load with strict=False to start at the same offset anyway")


def build_dataloader(data, **kwargs) -> ResumableDataLoader:
    """The loader for one data-parallel rank (ResumableDataLoader's keyword arguments; pass
    ParallelDims.dp_rank / dp_size, never the global rank) over one PackedDataset, or over
    (name, weight, PackedDataset) triples, a blend (the weights are normalised)."""
    if isinstance(data, PackedDataset):
        return ResumableDataLoader([Source(kwargs.pop("name", "") or "data.source", 1.0, data)], **kwargs)
    total = sum(w for _, w, _ in data)
    return ResumableDataLoader([Source(n, w / total, d) for n, w, d in data], **kwargs)


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
