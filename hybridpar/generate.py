"""Text generation with a (tensor-parallel) Llama: greedy or nucleus sampling, with a KV cache.

Every rank of a model-parallel group runs the same loop on the same prompts. Each step gathers the
full logits of the last position only ([batch, vocab], small next to the weights) so greedy
argmax and top-p see the whole distribution; the vocabulary shards alone would do for argmax but
not for top-p, which needs a sort over the full vocabulary. All ranks draw from generators seeded
alike, and the token chosen on mp rank 0 is then broadcast over the mp group, so the ranks agree
even where two devices would round a logit differently.

Prompts of different lengths advance in lockstep, one position at a time from the shortest
prompt's end (as Meta's reference does): at positions still inside a longer prompt the prompt's
token is kept instead of the prediction, so no padding ever enters the attention.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from hybridpar.mesh.device import ParallelDims
from hybridpar.parallel import gather_from_region


def sample_top_p(probs: torch.Tensor, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row of probs [batch, vocab] from the smallest set whose mass reaches top_p."""
    # Stable sort: among equal probabilities the lowest id comes first, as argmax picks it.
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    # The most likely token always survives (its mass_before is 0), so top_p -> 0 is greedy.
    sorted_probs = sorted_probs.masked_fill(mass_before > top_p, 0.0)
    choice = torch.multinomial(sorted_probs, 1, generator=generator)  # normalises the kept mass
    return order.gather(-1, choice).squeeze(-1)


def _choose(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return sample_top_p(probs, top_p, generator)


def _agree(tokens: torch.Tensor, parallel: ParallelDims) -> torch.Tensor:
    """Every mp rank takes mp rank 0's tokens (a few bytes per step)."""
    if parallel.mp > 1:
        dist.broadcast(tokens, group=parallel.mp_group, group_src=0)
    return tokens


def _check_arguments(model, prompt_tokens, max_new_tokens, temperature, top_p) -> None:
    args = model.args
    if getattr(model, "cp", 1) > 1:  # each rank would read its prompt as two chunks of a longer sequence
        raise ValueError(f"generation runs at cp = 1, this model was built with cp = {model.cp}: build it with "
                         "parallel.cp = 1 (the parameters do not depend on cp)")
    if not prompt_tokens:
        raise ValueError("prompt_tokens is empty; pass a list of prompts, each a list of token ids")
    for i, prompt in enumerate(prompt_tokens):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. the tokenizer's bos)")
        bad = [t for t in prompt if not 0 <= int(t) < args.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the model's vocabulary [0, {args.vocab_size})")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    total = max(len(p) for p in prompt_tokens) + max_new_tokens
    if total > args.max_seq_len:
        raise ValueError(
            f"longest prompt ({max(len(p) for p in prompt_tokens)} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{total} exceeds the model's max_seq_len = {args.max_seq_len}; shorten the prompt or max_new_tokens"
        )
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


@torch.no_grad()
def generate(
    model,
    parallel: ParallelDims,
    prompt_tokens: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 0.9,
    eos_id: Optional[int] = None,
    seed: int = 0,
    *,
    use_cache: bool = True,
    vocab_limit: Optional[int] = None,
) -> list[list[int]]:
    """Continue each prompt by up to max_new_tokens tokens; returns the new tokens only, per prompt.

    temperature 0 is greedy; otherwise top-p (nucleus) sampling at that temperature, from a
    generator seeded with `seed` (the same tokens at every mp size, up to rounding of the logits).
    A sequence stops at its first eos_id, which is not included in its output. Every rank of the
    model-parallel group must call this with the same arguments and gets the same result.
    use_cache=False recomputes the whole sequence every step (slow; a reference for tests).
    vocab_limit: only ids below it are chosen (a tokenizer smaller than the model's embedding: the
    ids past its end have no text).
    """
    if parallel.pp > 1:  # no stage holds both the embedding and the output head
        raise ValueError(f"generation runs at pp = 1, this mesh has pp = {parallel.pp}: build the model with "
                         "parallel.pp = 1 (a checkpoint loads at any pp)")
    _check_arguments(model, prompt_tokens, max_new_tokens, temperature, top_p)
    batch = len(prompt_tokens)
    if max_new_tokens == 0:
        return [[] for _ in range(batch)]
    device = parallel.device
    lengths = [len(p) for p in prompt_tokens]
    total = max(lengths) + max_new_tokens
    tokens = torch.zeros(batch, total, dtype=torch.long, device=device)
    in_prompt = torch.zeros(batch, total, dtype=torch.bool, device=device)
    for i, prompt in enumerate(prompt_tokens):
        tokens[i, : lengths[i]] = torch.tensor([int(t) for t in prompt], dtype=torch.long)
        in_prompt[i, : lengths[i]] = True
    last_new = torch.tensor([n + max_new_tokens - 1 for n in lengths], device=device)  # last position to fill
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = model.new_cache(batch, total) if use_cache else None

    prev = 0
    for cur in range(min(lengths), total):
        # Predict position cur from everything before it; with the cache only the unseen tokens go in.
        if cache is not None:
            local_logits = model(tokens[:, prev:cur], start_pos=prev, cache=cache)
        else:
            local_logits = model(tokens[:, :cur])
        logits = gather_from_region(local_logits[:, -1], parallel.mp_group)
        if vocab_limit is not None:
            logits[:, vocab_limit:] = float("-inf")
        chosen = _agree(_choose(logits, temperature, top_p, generator), parallel)
        chosen = torch.where(in_prompt[:, cur], tokens[:, cur], chosen)
        tokens[:, cur] = chosen
        if eos_id is not None:
            done |= ~in_prompt[:, cur] & (chosen == eos_id)
        done |= cur >= last_new
        prev = cur
        if bool(done.all()):
            break

    return [_new_tokens(tokens[i, n : min(n + max_new_tokens, prev + 1)].tolist(), eos_id)
            for i, n in enumerate(lengths)]


def _new_tokens(new: list[int], eos_id: Optional[int]) -> list[int]:
    """A sequence's generated tokens, cut before its first eos_id."""
    return new[: new.index(eos_id)] if eos_id is not None and eos_id in new else new


def generate_text(model, parallel: ParallelDims, tokenizer, prompts: Sequence[str], **kwargs) -> list[str]:
    """Encode prompts (with bos), generate, decode the completions. kwargs go to generate()."""
    prompt_tokens = [tokenizer.encode(p, bos=True) for p in prompts]
    completions = generate(model, parallel, prompt_tokens, eos_id=tokenizer.eos_id,
                           vocab_limit=tokenizer.vocab_size, **kwargs)
    return [tokenizer.decode(c) for c in completions]
