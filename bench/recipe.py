"""The seed recipe hybridpar is measured against: Meta's Llama on fairscale, wrapped by FSDP1.

Written here from scratch in the style of Meta's reference model code (llama / llama3), turned into a
training model the way recipes built on it do (no kv cache, a causal mask over the whole window):

  * fairscale's layers (`fairscale.nn.model_parallel.layers`) on fairscale's module-level groups
    (`initialize_model_parallel(mp)`): ColumnParallelLinear for wq wk wv w1 w3 and the output head,
    RowParallelLinear for wo w2, VocabParallelEmbedding (Llama 3) or ParallelEmbedding (Llama 2);
  * attention as Meta writes it: explicit q k^T / sqrt(d) + additive causal mask, fp32 softmax,
    kv heads repeated for grouped-query attention; RoPE from a precomputed complex table;
  * the output head gathers the full [batch, seq, vocab] logits on every model-parallel rank
    (`gather_output=True`, Meta's default), and the loss is F.cross_entropy on them;
  * FSDP1 (`FullyShardedDataParallel`) over the data-parallel ranks, one unit per TransformerBlock,
    HYBRID_SHARD with (shard, replicate) groups cut from fairscale's data-parallel group. With a
    shard group of one rank FSDP1 would silently switch HYBRID_SHARD to NO_SHARD on that group and
    stop all-reducing across replicas, so that case (dp_shard = 1) uses NO_SHARD over the whole
    data-parallel group explicitly, which does all-reduce;
  * torch.optim.AdamW with its defaults otherwise (on the CPU: the per-parameter loop).

The gradient norm is computed over the whole model across mp and dp (FSDP1's own clip_grad_norm_
only reduces over its data-parallel group, so it would miss the model-parallel shards): the same
number as hybridpar's, so both runs compute the same training step.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _skip_init(weight: torch.Tensor) -> torch.Tensor:  # weights are copied in after construction
    return weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


def precompute_freqs_cis(dim: int, end: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    shape = [d if i == 1 or i == x.ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep, head_dim)


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        from fairscale.nn.model_parallel.initialize import get_model_parallel_world_size
        from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear

        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        mp = get_model_parallel_world_size()
        self.n_local_heads = args.n_heads // mp
        self.n_local_kv_heads = self.n_kv_heads // mp
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.dim // args.n_heads
        column = dict(bias=False, gather_output=False, init_method=_skip_init)
        self.wq = ColumnParallelLinear(args.dim, args.n_heads * self.head_dim, **column)
        self.wk = ColumnParallelLinear(args.dim, self.n_kv_heads * self.head_dim, **column)
        self.wv = ColumnParallelLinear(args.dim, self.n_kv_heads * self.head_dim, **column)
        self.wo = RowParallelLinear(args.n_heads * self.head_dim, args.dim, bias=False, input_is_parallel=True,
                                    init_method=_skip_init)

    def forward(self, x, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear

        self.w1 = ColumnParallelLinear(dim, hidden_dim, bias=False, gather_output=False, init_method=_skip_init)
        self.w2 = RowParallelLinear(hidden_dim, dim, bias=False, input_is_parallel=True, init_method=_skip_init)
        self.w3 = ColumnParallelLinear(dim, hidden_dim, bias=False, gather_output=False, init_method=_skip_init)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Full logits [batch, seq, vocab] on every rank, as Meta's forward returns them."""

    def __init__(self, args):
        super().__init__()
        from fairscale.nn.model_parallel.layers import ColumnParallelLinear, ParallelEmbedding, VocabParallelEmbedding

        self.params = args
        embedding = VocabParallelEmbedding if args.resolved_embedding_split == "vocab" else ParallelEmbedding
        self.tok_embeddings = embedding(args.vocab_size, args.dim, init_method=_skip_init)
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = ColumnParallelLinear(args.dim, args.vocab_size, bias=False, init_method=_skip_init)
        self.freqs_cis = precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len * 2, args.rope_theta)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[:seqlen]
        mask = torch.full((seqlen, seqlen), float("-inf"), device=tokens.device)
        mask = torch.triu(mask, diagonal=1).type_as(h)
        for layer in self.layers:
            h = layer(h, freqs_cis, mask)
        h = self.norm(h)
        return self.output(h).float()


# --- groups, wrapping, the training step ---------------------------------------------------------


def recipe_groups(mp: int, dp_shard: int, dp_replicate: int):
    """fairscale's groups, and FSDP1's process group(s) cut from fairscale's data-parallel group.

    Returns (strategy, process_group): HYBRID_SHARD with (shard, replicate) when dp_shard > 1, else
    NO_SHARD over the data-parallel group (see the module doc for why not HYBRID_SHARD there).
    """
    from fairscale.nn.model_parallel.initialize import (
        get_data_parallel_group,
        get_data_parallel_rank,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from torch.distributed.fsdp import ShardingStrategy

    if not model_parallel_is_initialized():
        initialize_model_parallel(mp)
    world = dist.get_world_size()
    dp = world // mp
    if dp != dp_shard * dp_replicate:
        raise ValueError(f"world {world} / mp {mp} = {dp} data-parallel ranks, not {dp_shard} x {dp_replicate}")
    # Data-parallel rank d of model-parallel slot k is global rank d * mp + k (fairscale's layout).
    rank = dist.get_rank()
    my_dp, my_slot = get_data_parallel_rank(), rank % mp
    shard_pg = replicate_pg = None
    for k in range(mp):  # every rank creates every group, in the same order
        for rep in range(dp_replicate):
            ranks = [(rep * dp_shard + i) * mp + k for i in range(dp_shard)]
            group = dist.new_group(ranks)
            if k == my_slot and rep == my_dp // dp_shard:
                shard_pg = group
        for i in range(dp_shard):
            ranks = [(rep * dp_shard + i) * mp + k for rep in range(dp_replicate)]
            group = dist.new_group(ranks)
            if k == my_slot and i == my_dp % dp_shard:
                replicate_pg = group
    if dp_shard > 1:
        return ShardingStrategy.HYBRID_SHARD, (shard_pg, replicate_pg)
    return ShardingStrategy.NO_SHARD, get_data_parallel_group()


def copy_weights(model: nn.Module, local_shards: dict[str, torch.Tensor]) -> None:
    """Copy this rank's model-parallel slices (same names and split dims as Meta's) into `model`."""
    own = dict(model.named_parameters())
    missing = sorted(set(own) - set(local_shards))
    if missing:
        raise KeyError(f"no weights for {missing[:5]}")
    with torch.no_grad():
        for name, param in own.items():
            src = local_shards[name]
            if src.shape != param.shape:
                raise ValueError(f"{name}: slice {tuple(src.shape)} != recipe parameter {tuple(param.shape)}")
            param.copy_(src)


class RecipeTrainer:
    """Builds the recipe's model, FSDP1 wrapper and AdamW; `step(inputs, targets)` trains one step."""

    def __init__(self, args, mp: int, dp_shard: int, dp_replicate: int, local_shards: dict[str, torch.Tensor],
                 *, lr: float, weight_decay: float, betas=(0.9, 0.95), eps: float = 1e-8, grad_clip: float = 1.0,
                 precision: str = "float32"):
        from fairscale.nn.model_parallel.initialize import get_data_parallel_group
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        self.strategy, process_group = recipe_groups(mp, dp_shard, dp_replicate)
        self.mp, self.dp_size, self.dp_replicate = mp, dp_shard * dp_replicate, dp_replicate
        self.dp_group = get_data_parallel_group()
        model = Transformer(args)
        copy_weights(model, local_shards)
        # Decided before wrapping: FSDP1 with use_orig_params keeps these Parameter objects but
        # turns them into flat 1-D views of the local shard.
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        # Norm weights are whole on every model-parallel rank; the rest is split over mp.
        self.mp_replicated = {id(p) for p in no_decay}
        self.model = FSDP(
            model, process_group=process_group, sharding_strategy=self.strategy,
            auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}), use_orig_params=True,
            limit_all_gathers=True, device_id=torch.device("cpu"),  # FSDP1 needs it said on the CPU
            # bf16: the usual FSDP1 setting, compute in bf16 and gradients reduced in fp32
            mixed_precision=None if precision == "float32" else MixedPrecision(
                param_dtype=getattr(torch, precision), reduce_dtype=torch.float32),
        )
        ids = {id(p) for p in self.model.parameters()}
        if not all(id(p) in ids for p in decay + no_decay):
            raise RuntimeError("FSDP1 replaced the model's Parameter objects: the optimizer groups would be stale")
        self.params = decay + no_decay
        self.grad_clip = grad_clip
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr, betas=betas, eps=eps,
        )

    def grad_norm_and_clip(self) -> float:
        """The norm of the whole model's gradient: local squares / copies, one all-reduce over the world."""
        sq = torch.zeros((), dtype=torch.float32)
        grads = []
        for p in self.params:
            if p.grad is None or p.grad.numel() == 0:
                continue
            copies = self.dp_replicate if self.strategy.name == "HYBRID_SHARD" else self.dp_size
            if id(p) in self.mp_replicated:
                copies *= self.mp
            sq += p.grad.float().pow(2).sum() / copies
            grads.append(p.grad)
        dist.all_reduce(sq)
        total = sq.sqrt()
        if self.grad_clip > 0:
            coef = torch.clamp(self.grad_clip / (total + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef)
        return total.item()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, probe=None) -> float:
        counts = torch.tensor([float((targets != -100).sum())])
        dist.all_reduce(counts, group=self.dp_group)
        global_targets = counts.item()
        scale = self.dp_size / global_targets  # FSDP1 averages over the data-parallel ranks
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                               reduction="sum")
        (loss * scale).backward()
        loss_sum = loss.detach().clone()
        dist.all_reduce(loss_sum, group=self.dp_group)
        self.grad_norm_and_clip()
        if probe is not None:
            probe(self)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum.item() / global_targets
