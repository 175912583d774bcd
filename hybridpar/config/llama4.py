"""What a Llama 4 model (mixture-of-experts layers, RoPE-less or chunked attention) needs of a training
config, checked by hybridpar.preflight before any process group: what does not run its layers yet."""

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
