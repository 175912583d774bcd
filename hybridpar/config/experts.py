"""The [moe] config section, without torch: a mixture of experts' load balance (hybridpar.train.experts
applies it; models.moe computes it).

    router_aux_loss_coef  the Switch / transformers load-balancing loss's weight (0: off)
    bias_update_rate      DeepSeek-V3's auxiliary-loss-free balancing: the routing bias's step (0: off)
    hot_ratio             an ep rank getting this many times its even share of the tokens is named hot
"""

from __future__ import annotations

import dataclasses

from .options import option


@dataclasses.dataclass
class MoEConfig:
    router_aux_loss_coef: float = option(0.0, "the router's load-balancing loss, n_experts x sum of (share of the "
                                              "tokens choosing an expert) x (its mean probability), weighted by this "
                                              "and added to the training loss (0: off; HF Llama 4 configs say 0.001)")
    bias_update_rate: float = option(0.0, "DeepSeek-V3's auxiliary-loss-free balancing: after each optimizer step "
                                          "each expert's routing bias (added to the router's logits for the choice of "
                                          "experts only) moves by this towards balance (0: off; DeepSeek-V3: 0.001)")
    hot_ratio: float = option(1.5, "at ep > 1, an ep rank whose experts get more than this many times its even "
                                   "share (1 / ep) of a layer's routed tokens is named hot: the step line, "
                                   "events.jsonl, the straggler report")

    @property
    def balancing(self) -> bool:
        """Whether a load balance mechanism acts on the router."""
        return bool(self.router_aux_loss_coef or self.bias_update_rate)
