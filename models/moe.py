"""Llama 4's mixture-of-experts feed-forward: a router, the routed experts as grouped GEMMs, a shared expert.

    feed_forward.router.weight         [n_experts, dim]          replicated over mp
    feed_forward.experts.w1, .w3       [n_experts, hidden, dim]  split on hidden: Shard(1), column-parallel
    feed_forward.experts.w2            [n_experts, dim, hidden]  split on hidden: Shard(2), row-parallel
    feed_forward.shared_expert.w1/w3/w2  a dense SwiGLU of the experts' hidden size (models.llama.FeedForward)

Routing as transformers' Llama4TextMoe: a token goes to the experts of its experts_per_token largest
router logits, each logit's sigmoid scaling the token going in (the input, not the output); their
outputs and the shared expert's add up. Dropless: every token reaches its experts however many
choose the same one (no capacity factor).

The steps stand apart for expert parallelism, which dispatches between them: `route` (each token's
experts and weights), `sort_by_expert` (the token slots in expert order, and tokens per expert),
GroupedExperts (the sorted tokens through their experts; the weights' dim 0 is the expert, what an
ep split slices), then back to token order and summed.

Expert parallelism (parallel.ep > 1): each ep rank holds n_experts / ep of the experts (DTensors on
the (ep, mp) mesh, Shard(0) then the mp split, so a checkpoint holds the whole [n_experts, ...]
tensors); the sorted slots go to their experts' ranks and come back by all-to-all
(hybridpar.parallel.experts' dispatch and combine) between sort_by_expert and the return to token order.

Load balance (hybridpar.train.experts sets a MoE's `balance`, a LayerBalance, when it trains one):
the tokens each expert gets are counted; DeepSeek-V3's per-expert bias joins the logits for the
choice of experts only (the weights stay the logits' sigmoid); the Switch / transformers
load-balancing loss, E x sum_e f_e P_e (f_e: the share of the micro-batch's tokens choosing e, their
counts summed over dp x cp first, one all-reduce of E numbers; P_e: the mean softmax probability of
e), rides on the layer's output into the backward (with_aux_loss): the same loss at every layout.

Tensor parallelism: every rank routes alike, runs every expert on its slice of the hidden size,
and the experts' and the shared expert's partial sums leave the region in one reduction (an
all-reduce; a reduce-scatter under sequence parallelism). The router reads the layer's input as it
arrives (this rank's tokens under sequence parallelism) and its logits enter the region as the
tokens do, so their gradient is summed over mp once.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import Replicate, Shard

from hybridpar.mesh.device import ParallelDims
from hybridpar.parallel import copy_to_region, enter_region, leave_region
from hybridpar.parallel.experts import balanced_counts, combine, dispatch
from hybridpar.parallel.layers import local_tensor, mp_parameter

from .args import ModelArgs

# What torch._grouped_mm runs: on the CPU these, on CUDA bf16 on compute capability 9.x and 10.x
# (elsewhere torch loops over the experts itself, as expert_matmul does).
_CPU_GROUPED = (torch.float32, torch.bfloat16, torch.float16)
_CUDA_GROUPED_MAJORS = (9, 10)


def _normal(std: float):
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)


def grouped_mm_allowed(x: torch.Tensor, weights: torch.Tensor) -> bool:
    """Can torch._grouped_mm take rows x [n, in] against weights [experts, out, in] here: the device
    and dtype (above), and every row 16-byte aligned (in and out a multiple of 16 bytes)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != weights.dtype:
        return False
    if x.device.type == "cpu":
        allowed = x.dtype in _CPU_GROUPED
    else:
        allowed = (x.device.type == "cuda" and x.dtype == torch.bfloat16
                   and torch.cuda.get_device_capability(x.device)[0] in _CUDA_GROUPED_MAJORS)
    return allowed and all(n * x.element_size() % 16 == 0 for n in weights.shape[1:])


def expert_matmul(x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor, grouped: bool,
                  splits: Optional[list[int]] = None) -> torch.Tensor:
    """Rows x [n, in] sorted by expert (counts[e] rows for expert e) times their expert's weights[e]^T:
    [n, out]. grouped: one torch._grouped_mm; else a matmul per expert (counts read on the host, unless
    `splits` gives them there: balanced routing)."""
    if grouped:
        return torch._grouped_mm(x, weights.transpose(-2, -1), offs=torch.cumsum(counts, 0, dtype=torch.int32))
    return torch.cat([rows @ w.t() for rows, w in zip(x.split(counts.tolist() if splits is None else splits), weights)])


def route(logits: torch.Tensor, top_k: int, bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts), each [tokens, top_k]: the largest logits' experts and the logits' sigmoid.
    bias [n_experts] (DeepSeek-V3's balancing): added to the logits for the choice only."""
    if bias is None:
        top, experts = torch.topk(logits, top_k, dim=-1)
    else:
        experts = torch.topk(logits + bias.to(logits.dtype), top_k, dim=-1).indices
        top = logits.gather(-1, experts)
    return torch.sigmoid(top.float()).to(logits.dtype), experts


def load_balancing_loss(logits: torch.Tensor, counts: torch.Tensor, top_k: int,
                        group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """This rank's part of n_experts x sum_e f_e P_e over the tokens of `group` (dp x cp), the
    Switch Transformer's and transformers' load_balancing_loss_func: f_e the share of the tokens
    choosing expert e (counts [n_experts] of this rank's logits [n, n_experts], summed over the
    group: not differentiable), P_e their mean softmax probability of e. Summed over the group's
    ranks it is the loss of all their tokens; k for tokens spread evenly over the experts."""
    total = counts.to(torch.float64)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    tokens = total.sum() / top_k
    share = (total / tokens).to(torch.float32)
    probabilities = torch.softmax(logits.float(), dim=-1).sum(0) / tokens.to(torch.float32)
    return logits.shape[-1] * (share * probabilities).sum()


class _AuxLoss(torch.autograd.Function):
    """x unchanged; the backward gives the loss riding on it the gradient `scale`."""

    @staticmethod
    def forward(ctx, x, loss, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


def with_aux_loss(x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    """x, with `loss` (a scalar) differentiated as if `scale` x loss were added to what x's backward
    starts from: an auxiliary loss without a second backward or a change to the model's outputs."""
    return _AuxLoss.apply(x, loss, scale)


@dataclasses.dataclass
class LayerBalance:
    """What a trainer watching a MoE layer's load balance sets on it (hybridpar.train.experts): `load`
    the tokens this rank sent to each expert since the trainer last read it, `aux` the auxiliary
    loss's weighted sum since then; `bias` DeepSeek-V3's routing bias (None: off); the auxiliary
    loss weighted by `aux_weight` (0: off), its gradient scaled by `aux_scale` (the trainer's
    gradient scale: FSDP's average undone, the mp ranks' copies counted once), its counts summed over `group`."""

    load: torch.Tensor
    aux: torch.Tensor
    bias: Optional[torch.Tensor] = None
    aux_weight: float = 0.0
    aux_scale: float = 1.0
    group: Optional[ProcessGroup] = None


def sort_by_expert(experts: torch.Tensor, n_experts: int, balanced: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): the token slots (token t's j-th choice is slot t * top_k + j) in expert order,
    stable, and how many each expert gets [n_experts]; `balanced`: balanced_counts instead of counting."""
    flat = experts.flatten()
    if balanced:
        return torch.argsort(flat, stable=True), torch.tensor(balanced_counts(flat.numel(), n_experts),
                                                              device=flat.device)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=n_experts)


class Router(nn.Module):
    """Logits x W^T over the experts, W replicated over mp; the same routing on every rank."""

    def __init__(self, dim: int, n_experts: int, top_k: int, parallel: ParallelDims, init_std: float,
                 dtype=None, device=None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.top_k, self.group, self.sequence_parallel = top_k, parallel.mp_group, sequence_parallel
        self.weight = mp_parameter((n_experts, dim), Replicate(), parallel, _normal(init_std), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: the layer's tokens as they arrive [n, dim] -> the logits of every token of the region [N, n_experts]."""
        weight = local_tensor(self.weight)
        if self.sequence_parallel:  # each rank's tokens give part of the weight's gradient
            weight = copy_to_region(weight, self.group)
        return enter_region(F.linear(x, weight), self.group, self.sequence_parallel)


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLUs, w2(silu(w1 x) * w3 x) per expert, stacked on dim 0; each rank
    holds its slice of every expert's hidden size (of its n_experts / ep experts under expert
    parallelism). `grouped`: None picks torch._grouped_mm where it runs (grouped_mm_allowed), else the
    loop; True or False forces one (they agree exactly in fp32)."""

    def __init__(self, n_experts: int, dim: int, hidden: int, parallel: ParallelDims, init_std: float,
                 out_std: float, dtype=None, device=None) -> None:
        super().__init__()
        column = ((n_experts, hidden, dim), Shard(1), parallel, _normal(init_std), dtype, device)
        self.w1 = mp_parameter(*column, experts=True)
        self.w3 = mp_parameter(*column, experts=True)
        self.w2 = mp_parameter((n_experts, dim, hidden), Shard(2), parallel, _normal(out_std), dtype, device,
                               experts=True)
        self.grouped: Optional[bool] = None

    def forward(self, x: torch.Tensor, counts: torch.Tensor, splits: Optional[list[int]] = None) -> torch.Tensor:
        """x [n, dim] sorted by expert, counts [this rank's experts] (`splits`: the same on the host, where
        known) -> this rank's partial sums [n, dim]."""
        w1, w3, w2 = (local_tensor(w) for w in (self.w1, self.w3, self.w2))
        grouped = self.grouped if self.grouped is not None else grouped_mm_allowed(x, w1) and grouped_mm_allowed(x, w2)
        hidden = F.silu(expert_matmul(x, w1, counts, grouped, splits)) * expert_matmul(x, w3, counts, grouped, splits)
        return expert_matmul(hidden, w2, counts, grouped, splits)

    def extra_repr(self) -> str:
        return f"experts={self.w1.shape[0]}, dim={self.w1.shape[2]}, hidden={self.w1.shape[1]}, grouped={self.grouped}"


class MoE(nn.Module):
    """The mixture-of-experts feed-forward of one layer. `shared_expert`: a models.llama.FeedForward
    of the experts' hidden size (its partial() gives this rank's partial sums)."""

    def __init__(self, args: ModelArgs, parallel: ParallelDims, shared_expert: nn.Module, init_std: float,
                 out_std: float, *, dtype=None, device=None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = parallel.mp_group, sequence_parallel
        self.ep_group = parallel.ep_group  # None without expert parallelism
        self.n_experts, self.top_k = args.n_experts, args.experts_per_token
        self.router = Router(args.dim, args.n_experts, args.experts_per_token, parallel, init_std, dtype, device,
                             sequence_parallel)
        self.experts = GroupedExperts(args.n_experts, args.dim, args.expert_hidden_dim, parallel, init_std, out_std,
                                      dtype, device)
        self.shared_expert = shared_expert
        self.balance: Optional[LayerBalance] = None  # set by a trainer (hybridpar.train.experts)
        # Every expert routed balanced_counts' share of the slots, whatever the router chose: the dry run's
        # rehearsal on fake tensors (which have no values to count nor exchange sizes to read back).
        self.balanced = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [batch, seq, dim], or this rank's tokens [n, dim] under sequence parallelism: the same layout back."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = self.router(tokens)
        weights, experts = route(logits, self.top_k, self.balance.bias if self.balance is not None else None)
        tokens = enter_region(tokens, self.group, self.sequence_parallel)  # every token of the region
        routed = self.routed(tokens, logits, weights, experts)
        out = leave_region(routed + self.shared_expert.partial(tokens), self.group, self.sequence_parallel)
        return out if self.sequence_parallel else out.view(shape)

    # Left eager under train.compile (the rest of the block compiles around it): how many tokens
    # each expert gets is data (read on the host for the loop and ep's split sizes), and the load
    # balance's counts are state the trainer reads.
    @torch.compiler.disable
    def routed(self, tokens: torch.Tensor, logits: torch.Tensor, weights: torch.Tensor,
               experts: torch.Tensor) -> torch.Tensor:
        """The routed experts' partial sums for tokens [n, dim] (route()'s weights and experts of the
        router's `logits`): [n, dim], carrying the auxiliary loss's gradient where [moe] asks for it."""
        order, counts = sort_by_expert(experts, self.n_experts, self.balanced)
        balance, aux = self.balance, None
        if balance is not None and self.training:
            balance.load += counts
            if balance.aux_weight:
                aux = balance.aux_weight * load_balancing_loss(logits, counts, self.top_k, balance.group)
                balance.aux += aux.detach()
        slots = tokens.repeat_interleave(self.top_k, dim=0) if self.top_k > 1 else tokens
        routed = slots[order] * weights.flatten()[order, None]
        if self.ep_group is None:
            routed = self.experts(routed, counts, balanced_counts(len(order), self.n_experts) if self.balanced else None)
        else:  # to the ranks holding their experts and back
            routed, local_counts, exchange = dispatch(routed, counts, self.ep_group, self.balanced)
            routed = combine(self.experts(routed, local_counts, exchange.counts), exchange)
        # Back to slot order (each slot written once), then each token's top_k outputs summed.
        routed = torch.zeros_like(routed).index_copy(0, order, routed).view(-1, self.top_k, tokens.shape[-1]).sum(1)
        return routed if aux is None else with_aux_loss(routed, aux, balance.aux_scale)


def balance_routing(modules, grouped: bool) -> None:
    """Every MoE layer of these modules routes balanced_counts' share of the slots to each expert, the
    sizes known on the host: what runs on fake tensors (the dry run), through the grouped matmul or the
    loop (`grouped`: fake tensors have torch._grouped_mm's shapes in bf16 only)."""
    for module in (m for part in modules for m in part.modules() if isinstance(m, MoE)):
        module.balanced, module.experts.grouped = True, grouped
