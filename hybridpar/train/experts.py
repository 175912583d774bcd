"""A mixture of experts' load balance in training: measured every step, acted on by the [moe] keys,
named when an ep rank's experts are hot.

    balance = ExpertBalance(config, parallel, runner.modules, supervisor)   # sets each MoE layer's LayerBalance
    Checkpoints(..., parts={..., **balance.parts})   # the routing bias, when DeepSeek-V3's balancing is on
    m.update(balance.finish_step(skipped))           # every rank, after the optimizer step: one all-reduce

Each MoE layer counts the tokens its rank sends to each expert (on the device, no collective);
after the step one all-reduce over dp x cp of those counts ([layers x experts] numbers) and of the
auxiliary loss's sum gives every rank the step's tokens per expert over the global batch. From
them: the metrics (metrics.jsonl, TensorBoard, the dashboard), DeepSeek-V3's bias update,
bias += bias_update_rate x sign(mean load - load) per layer, the same on every rank (the counts are
the same there), and the hot ep rank: the one whose experts got more than moe.hot_ratio times its
even share of a layer's tokens, which then computes more than its peers (a straggler whose node is fine).
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from hybridpar.models.moe import LayerBalance, MoE

from ..config import Config
from ..mesh.device import ParallelDims
from ..mesh.layout import MeshCoords

PREFIX = "experts/"  # its metrics.jsonl keys, written every step (run_log.RunLog.record)
AUX_LOSS = "aux_loss"  # the auxiliary loss's weighted term, as added to the training loss (metrics.jsonl)


def tokens_key(layer: int) -> str:
    """The metrics.jsonl key of a MoE layer's tokens per expert."""
    return f"{PREFIX}tokens/layer{layer}"


def expert_range(first: int, count: int) -> str:
    """'experts 2-3', or 'expert 2' for one."""
    return f"expert {first}" if count == 1 else f"experts {first}-{first + count - 1}"


def group_shares(counts: torch.Tensor, ep: int) -> torch.Tensor:
    """counts [layers, n_experts] -> [layers, groups]: each group's share of its layer's routed tokens,
    the groups the ep ranks' experts (at ep 1, each expert)."""
    shares = counts.double() / counts.double().sum(1, keepdim=True).clamp(min=1)
    return shares.view(counts.shape[0], ep if ep > 1 else counts.shape[1], -1).sum(2)


def hot_experts(counts: torch.Tensor, ep: int, ratio: float, layers: Sequence[int]) -> Optional[dict]:
    """counts [layers, n_experts]: a step's tokens per expert. The ep rank whose experts got the
    largest share of a layer's routed tokens, when it exceeds `ratio` times its even share (1 / ep):
    {"layer", "ep_rank", "experts" (first, count), "share", "even", "expert", "expert_share"} (its
    busiest expert's), else None. At ep 1 none: every rank runs every expert, none waits for another."""
    if ep == 1:
        return None
    grouped, per = group_shares(counts, ep), counts.shape[1] // ep
    shares = counts.double() / counts.double().sum(1, keepdim=True).clamp(min=1)
    row, rank = divmod(int(torch.argmax(grouped)), ep)
    share, even = float(grouped[row, rank]), 1.0 / ep
    if share <= ratio * even:
        return None
    expert = rank * per + int(torch.argmax(shares[row, rank * per:(rank + 1) * per]))
    return {"layer": layers[row], "ep_rank": rank, "experts": (rank * per, per), "share": share, "even": even,
            "expert": expert, "expert_share": float(shares[row, expert])}


def hot_text(hot: dict) -> str:
    """The line naming a hot ep rank."""
    share = (f"{100 * hot['share']:.0f}% of layer {hot['layer']}'s routed tokens (an even share: "
             f"{100 * hot['even']:.0f}%)")
    first, count = hot["experts"]
    alone = (f", expert {hot['expert']} alone {100 * hot['expert_share']:.0f}%" if count > 1 else "")
    return (f"ep rank {hot['ep_rank']} ({expert_range(first, count)}) got {share}{alone}: its experts are hot, "
            "not its node slow")


class ExpertBalance:
    """The trainer's side of its MoE layers' load balance (none: a dense model, every call a no-op)."""

    def __init__(self, config: Config, parallel: ParallelDims, modules: Sequence[torch.nn.Module],
                 supervisor=None) -> None:
        self.parallel, self.settings = parallel, config.moe
        found = [(name, m) for module in modules for name, m in module.named_modules() if isinstance(m, MoE)]
        self.layers = [int(re.search(r"layers\.(\d+)\.", name + ".")[1]) for name, _ in found]
        self.modules = [m for _, m in found]
        self.hot: Optional[dict] = None  # the last step's hot ep rank, if any
        if not found:
            return
        n_experts, device = self.modules[0].n_experts, parallel.device
        biased = bool(self.settings.bias_update_rate)
        data_parallel = parallel.dp_size * parallel.cp
        for module in self.modules:
            module.balance = LayerBalance(
                load=torch.zeros(n_experts, dtype=torch.int64, device=device),
                aux=torch.zeros((), dtype=torch.float32, device=device),
                bias=torch.zeros(n_experts, dtype=torch.float32, device=device) if biased else None,
                # The mean over the layers and micro-batches; the trainer's gradient scale (FSDP's
                # average over dp x cp undone) over mp: every mp rank adds the same loss of the same tokens.
                aux_weight=self.settings.router_aux_loss_coef / (len(found) * config.train.grad_accum),
                aux_scale=data_parallel / parallel.mp, group=parallel.dp_cp_group if data_parallel > 1 else None)
        if supervisor is not None:
            supervisor.hot_experts = self.hot_rank

    @property
    def parts(self) -> dict:
        """The checkpoint's train_state parts: the routing bias, when it is updated."""
        return {"experts": self} if self.modules and self.settings.bias_update_rate else {}

    # A checkpoint saved without the bias (before balancing was on) resumes with a bias of zero.
    optional_state = True

    def state_dict(self) -> dict:
        """The routing bias of each MoE layer (float32 values, exact in JSON)."""
        return {"bias": {str(layer): m.balance.bias.tolist() for layer, m in zip(self.layers, self.modules)}}

    def load_state_dict(self, state: dict) -> None:
        for layer, module in zip(self.layers, self.modules):
            module.balance.bias.copy_(torch.tensor(state["bias"][str(layer)], dtype=torch.float32))

    def discard(self) -> None:
        """The counts so far, gone: after a step's metrics, or a step the replica groups did not commit (it is
        trained again, and its first try's counts are not that step's)."""
        for m in self.modules:
            m.balance.load.zero_()
            m.balance.aux.zero_()

    def finish_step(self, skipped: bool) -> dict:
        """Every rank, after the optimizer step: the step's tokens per expert over the global batch (one
        all-reduce over dp x cp), the bias update (not after a skipped step), the metrics."""
        if not self.modules:
            return {}
        balances = [m.balance for m in self.modules]
        packed = torch.cat([torch.stack([b.load for b in balances]).flatten().double(),
                            sum(b.aux for b in balances).double().reshape(1)])
        if self.parallel.dp_size * self.parallel.cp > 1:
            dist.all_reduce(packed, group=self.parallel.dp_cp_group)
        counts = packed[:-1].view(len(balances), -1)
        rate = self.settings.bias_update_rate
        for b, load in zip(balances, counts):
            if b.bias is not None and not skipped:
                b.bias += rate * torch.sign(load.mean() - load).float()
        self.discard()  # packed holds the counts: the next step counts from zero
        return self._row(counts.cpu(), float(packed[-1]))

    def _row(self, counts: torch.Tensor, aux: float) -> dict:
        ep = self.parallel.ep
        row = {tokens_key(layer): [int(x) for x in c] for layer, c in zip(self.layers, counts)}
        row[f"{PREFIX}ep_tokens"] = [int(x) for x in counts.sum(0).view(ep, -1).sum(1)]
        grouped = group_shares(counts, ep)  # the busiest group's share over its even share:
        row[f"{PREFIX}imbalance"] = round(float(grouped.max()) * grouped.shape[1], 4)
        if self.settings.router_aux_loss_coef:
            row[AUX_LOSS] = aux
        if self.settings.bias_update_rate:
            row[f"{PREFIX}bias_max"] = max(float(m.balance.bias.abs().max()) for m in self.modules)
        self.hot = hot_experts(counts, ep, self.settings.hot_ratio, self.layers)
        if self.hot is not None:
            row[f"{PREFIX}hot"] = hot_text(self.hot)
            row[f"{PREFIX}hot_rank"] = self.hot["ep_rank"]
        return row

    def hot_rank(self, rank: int) -> Optional[str]:
        """For the straggler report: why global `rank` computes more, if it is the ep rank holding the
        last step's hot experts; else None."""
        hot, p = self.hot, self.parallel
        if hot is None:
            return None
        if MeshCoords.of(rank, *p.sizes).shard_idx % p.ep != hot["ep_rank"]:
            return None
        return hot_text(hot)
