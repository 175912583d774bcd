"""What a Llama 4 model (mixture-of-experts layers, RoPE-less or chunked attention) needs of a training
config, checked by hybridpar.preflight before any process group: what does not run its layers yet,
and parallel.ep (expert parallelism) against the model's experts and the mesh."""

from __future__ import annotations

from .options import ConfigError


def check_llama4(config, args, pp: int, cp: int) -> None:
    """What does not run Llama 4's layers yet (experts, RoPE-less or chunked attention): refused by name."""
    if not args.llama4:
        return
    what = "Llama 4's layers (experts, RoPE-less or chunked attention)"
    if pp > 1:
        raise ConfigError(f"parallel.pp = {pp}: pipeline parallelism does not cut {what} yet; set parallel.pp = 1")
    if cp > 1:
        raise ConfigError(f"parallel.cp = {cp}: context parallelism does not run {what} yet; set parallel.cp = 1")
    if args.n_experts and config.float8.enabled:
        raise ConfigError(f"float8.recipe = {config.float8.recipe!r}: the experts have no float8 matmuls yet; set "
                          'float8.recipe = "none" for a mixture-of-experts model')
    if args.n_experts and config.train.compile:
        raise ConfigError("train.compile: the mixture-of-experts layers (data-dependent routing) are not compiled yet; "
                          "set train.compile = false")


def check_experts(config, args, dp_shard: int) -> None:
    """parallel.ep (expert parallelism): a model with experts, ep dividing them and dp_shard, whose
    ranks it takes (check_llama4 has refused what does not run experts yet); [moe]'s balancing: a model with experts."""
    ep = config.parallel.ep
    for key in ("router_aux_loss_coef", "bias_update_rate"):
        if getattr(config.moe, key) and not args.n_experts:
            raise ConfigError(f"moe.{key} = {getattr(config.moe, key)} balances a mixture of experts' router, and this "
                              f"model is dense (no experts); set moe.{key} = 0")
    if config.moe.bias_update_rate and config.fault_tolerance.enabled:
        raise ConfigError("moe.bias_update_rate with fault_tolerance.enabled: each replica group would move its routing "
                          "bias by its own tokens alone (the groups share gradients, not token counts); set "
                          "moe.bias_update_rate = 0 or fault_tolerance.enabled = false")
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ConfigError(f"parallel.ep must be a positive integer (1: no expert parallelism), got {ep!r}")
    if ep == 1:
        return
    if not args.n_experts:
        raise ConfigError(f"parallel.ep = {ep} splits a mixture of experts' experts, and this model is dense (no "
                          "experts); set parallel.ep = 1")
    if args.n_experts % ep:
        raise ConfigError(f"parallel.ep = {ep} does not divide the model's {args.n_experts} experts (n_experts, "
                          f"num_local_experts): each ep rank holds n_experts / ep; choose a parallel.ep dividing "
                          f"{args.n_experts}")
    if dp_shard % ep:
        raise ConfigError(f"parallel.ep = {ep} does not divide parallel.dp_shard = {dp_shard}: the experts are split "
                          f"over ep of the dp_shard ranks (it has none of its own); choose a parallel.ep dividing "
                          f"{dp_shard}, or more dp_shard ranks")
