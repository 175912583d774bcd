"""Log-likelihoods of token sequences under a (tensor-parallel) Llama, with the work shared by the
data-parallel ranks and computed by each model-parallel group together.

A request is (tokens, n_scored): the model reads tokens[:-1] and the last n_scored tokens are scored,
as lm-evaluation-harness's Hugging Face backend does ((context + continuation)[-(max_len + 1):], the
continuation's tokens scored). Requests are sorted by length (longest first) and cut into batches of
about `batch_tokens` tokens; batch b goes to data-parallel rank b % dp, and every rank runs the same
number of forwards (a rank short of one repeats the shortest batch and drops its results): under FSDP
(the model in training) each forward all-gathers the parameters over the data-parallel group, which
every rank must join. Each log-probability comes from the vocabulary shards as they are:
hybridpar.parallel.vocab_parallel_cross_entropy takes the log-softmax over the mp shards (the max and
the sum of exponentials all-reduced, the target's logit from the shard that holds it), and the greedy
check all-reduces each position's best logit and its id, so no rank ever holds a [tokens, vocab]
tensor of the whole vocabulary.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..config.evaluation import DEFAULT_BATCH_TOKENS
from ..mesh.device import ParallelDims
from ..mesh.ranks import gather_objects, raise_if_any_failed
from ..parallel.loss import IGNORE_INDEX, vocab_parallel_cross_entropy
from ..progress import Progress

__all__ = ["DEFAULT_BATCH_TOKENS", "batches_by_length", "score", "score_batch", "vocab_parallel_argmax"]


def batches_by_length(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Request indices, longest first (ties in index order), cut into batches whose padded size
    (count x longest) stays within batch_tokens (one request at least)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def vocab_parallel_argmax(local_logits: torch.Tensor, parallel: ParallelDims) -> torch.Tensor:
    """The id of the largest logit over the whole vocabulary, from logits split along it (the lowest id
    among equal maxima, as torch.argmax over the whole vocabulary picks)."""
    best, where = local_logits.max(dim=-1)
    if parallel.mp == 1:
        return where
    group = parallel.mp_group
    where = where + dist.get_rank(group) * local_logits.shape[-1]
    top = best.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    # Ids past any vocabulary where this shard does not hold the maximum: the minimum picks the lowest id.
    candidate = torch.where(best == top, where, torch.full_like(where, torch.iinfo(where.dtype).max))
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=group)
    return candidate


@torch.no_grad()
def score_batch(model, parallel: ParallelDims, requests: Sequence[tuple[Sequence[int], int]]) -> list[tuple[float, bool]]:
    """(sum of the scored tokens' log-probabilities, whether each is the greedy choice) per request,
    on every rank of the model-parallel group (which all call this with the same requests)."""
    length = max(len(tokens) for tokens, _ in requests) - 1
    if getattr(model, "sequence_parallel", False):  # the sequence is split over the mp ranks: a multiple of mp
        length = -(-length // parallel.mp) * parallel.mp
    device = parallel.device
    inputs = torch.zeros(len(requests), length, dtype=torch.long, device=device)
    targets = torch.full((len(requests), length), IGNORE_INDEX, dtype=torch.long, device=device)
    for row, (tokens, n_scored) in enumerate(requests):
        tokens = torch.tensor([int(t) for t in tokens], dtype=torch.long, device=device)
        n = len(tokens) - 1
        inputs[row, :n] = tokens[:-1]  # padded on the right: causal attention never looks there
        targets[row, n - n_scored: n] = tokens[n - n_scored + 1:]
    local_logits = model(inputs)
    # Log-probabilities over the mp shards (0 where ignored), in float32 whatever the logits' dtype.
    logprobs = -vocab_parallel_cross_entropy(local_logits, targets, parallel=parallel, reduction="none")
    scored = targets != IGNORE_INDEX
    greedy = (vocab_parallel_argmax(local_logits, parallel) == targets) | ~scored
    sums = logprobs.double().sum(dim=-1)
    return [(float(s), bool(g)) for s, g in zip(sums.tolist(), greedy.all(dim=-1).tolist())]


def score(model, parallel: ParallelDims, requests: Sequence[tuple[Sequence[int], int]], *,
          batch_tokens: int = DEFAULT_BATCH_TOKENS, what: str = "scoring") -> list[tuple[float, bool]]:
    """score_batch over every request, in their order: collective over the whole world, which must
    all call it with the same requests; each data-parallel rank computes its share of the batches and
    every rank gets every result."""
    for i, (tokens, n_scored) in enumerate(requests):
        if not 0 < n_scored < len(tokens):
            raise ValueError(f"request {i}: {n_scored} tokens to score of {len(tokens)}: score at least one, "
                             "and give at least one token before them")
    batches = batches_by_length([len(t) for t, _ in requests], batch_tokens)
    mine = batches[parallel.dp_rank::parallel.dp_size]
    rounds = -(-len(batches) // parallel.dp_size)  # forwards per rank, the same on every rank
    found: dict[int, tuple[float, bool]] = {}
    error = None
    with Progress(what, total=len(requests), unit="requests", every=10.0) as progress:
        try:
            for k in range(rounds):
                batch = mine[k] if k < len(mine) else batches[-1]
                scores = score_batch(model, parallel, [requests[i] for i in batch])
                if k < len(mine):  # else a repeat, so that this rank joins its peers' forward
                    found.update(zip(batch, scores))
                    progress.update(len(batch) * parallel.dp_size)  # rank 0's share stands for everyone's
        except Exception as err:  # noqa: BLE001 - shared below, so no rank waits for another in vain
            error = err
    raise_if_any_failed(error, what, error_type=RuntimeError)
    # One rank per model-parallel group sends its share: the others hold the same numbers.
    every = {}
    for share in gather_objects(found if parallel.mp_rank == 0 else {}):
        every.update(share)
    return [every[i] for i in range(len(requests))]
