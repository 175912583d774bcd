"""What a Llama 4 model (mixture-of-experts layers, RoPE-less or chunked attention) needs of a training
config, checked by hybridpar.preflight before any process group: what context parallelism does not
run of its layers yet, and parallel.ep (expert parallelism) against the model's experts and the mesh."""

from __future__ import annotations

from .options import ConfigError


def check_llama4(args, cp: int) -> None:
    """What does not run Llama 4's layers yet: under context parallelism, chunked local attention,
    temperature-tuned RoPE-less layers and experts (context_parallel_gaps), refused by name."""
    gaps = context_parallel_gaps(args)
    if cp > 1 and gaps:
        raise ConfigError(f"parallel.cp = {cp}: {gaps}; set parallel.cp = 1")


def context_parallel_gaps(args) -> str:
    """What of a model (ModelArgs) context parallelism does not run yet, said as one clause ("" if nothing):
    its attention masks the all-gathered keys causally only and scales no query by its global position
    (qk norm, per token, it runs), and expert parallelism takes its ranks (and the experts' FSDP groups)
    from dp_shard without cp's."""
    gaps = []
    if args.attention_chunk_size is not None:
        gaps.append(f"chunked local attention (attention_chunk_size = {args.attention_chunk_size})")
    if args.nope_layers and args.attn_temperature_tuning:
        gaps.append("RoPE-less layers' temperature tuning by position (attn_temperature_tuning)")
    if args.n_experts:
        gaps.append(f"routed experts (n_experts = {args.n_experts})")
    if not gaps:
        return ""
    listed = gaps[0] if len(gaps) == 1 else f"{', '.join(gaps[:-1])} or {gaps[-1]}"
    return f"context parallelism does not run Llama 4's {listed} yet"


def check_experts(config, args, dp_shard: int) -> None:
    """parallel.ep (expert parallelism): a model with experts, ep dividing them and dp_shard, whose
    ranks it takes (check_llama4 has refused context parallelism with experts); [moe]'s balancing: a model
    with experts."""
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
