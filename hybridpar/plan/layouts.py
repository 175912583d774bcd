"""The layouts the search considers: every (pp, mp, cp, dp_shard, dp_replicate, ep, AC) of the GPUs that
the model allows, and the sizes each dimension may take."""

from __future__ import annotations

import dataclasses
from typing import Iterable

from hybridpar.models.args import ModelArgs

from ..config.sharding import AC_MODES
from ..pipeline.schedules import max_stages, stages_per_rank
from .inputs import Hardware, Layout


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def context_parallel_sizes(world: int, seq_len: int, split: int = 1) -> list[int]:
    """The cp sizes a sequence can be cut over: powers of two dividing `world` with seq_len a multiple
    of 2 x cp x `split` (mp, under sequence parallelism); 1 always."""
    sizes, cp = [1], 2
    while cp <= world:
        if world % cp == 0 and seq_len % (2 * cp * split) == 0:
            sizes.append(cp)
        cp *= 2
    return sizes


def candidate_layouts(args: ModelArgs, hw: Hardware, *, allow_cross_node_mp: bool = False,
                      ac_modes: Iterable[str] = AC_MODES, zero2: bool = False, ac_every: int = 2,
                      sequence_parallel: bool = True, seq_len: int = 0,
                      cp: int = 0, pp: int = 1, ep: int = 0) -> tuple[list[Layout], dict[int, str]]:
    """Every layout of hw.gpus ranks the model can run; and the rejected mp sizes with the reason.
    cp 0 considers every context-parallel size (context_parallel_sizes), cp N only N; ep likewise
    (expert_parallel_sizes). pp > 1: layouts of pp stages (1F1B, and Interleaved1F1B at 2 stages per
    rank where the layers allow) over the hw.gpus / pp ranks of each."""
    if pp > 1:
        inner, rejected = candidate_layouts(args, dataclasses.replace(hw, gpus=hw.gpus // pp),
                                            allow_cross_node_mp=allow_cross_node_mp, ac_modes=ac_modes, zero2=False,
                                            ac_every=ac_every, sequence_parallel=sequence_parallel, seq_len=seq_len,
                                            cp=cp, ep=ep)
        schedules = [(name, stages_per_rank(name)) for name in ("1F1B", "Interleaved1F1B")
                     if pp * stages_per_rank(name) <= max_stages(args.n_layers)]
        return [dataclasses.replace(lay, pp=pp, pp_schedule=name, v=v) for lay in inner for name, v in schedules
                if lay.reshard_after_forward], rejected
    layouts: list[Layout] = []
    rejected: dict[int, str] = {}
    for mp in divisors(hw.gpus):
        try:
            args.check(mp)
        except ValueError as err:
            rejected[mp] = str(err)
            continue
        if mp > hw.gpus_per_node and not allow_cross_node_mp:
            rejected[mp] = (f"mp = {mp} spans nodes of {hw.gpus_per_node} GPUs: tensor-parallel all-reduces would "
                            "leave the node (--allow-cross-node-mp to consider it)")
            continue
        if sequence_parallel and seq_len % mp:
            rejected[mp] = (f"seq_len = {seq_len} is not divisible by mp = {mp}, as sequence parallelism needs "
                            "(--no-sequence-parallel to consider it without)")
            continue
        split = mp if sequence_parallel else 1
        if cp:
            sizes = [cp] if (hw.gpus // mp) % cp == 0 and (cp == 1 or seq_len % (2 * cp * split) == 0) else []
        else:
            sizes = context_parallel_sizes(hw.gpus // mp, seq_len, split)
        for n_cp in sizes:
            dp = hw.gpus // (mp * n_cp)
            for ds in divisors(dp):
                for ac in ac_modes:
                    for reshard in (True, False) if zero2 else (True,):
                        if not reshard and ds * n_cp == 1:
                            continue  # nothing is sharded: ZeRO-2 is the same layout
                        layouts += [Layout(mp, ds, dp // ds, ac, ac_every, reshard, sequence_parallel, n_cp, ep=n)
                                    for n in expert_parallel_sizes(args, ds, n_cp, ep)]
    return layouts, rejected


def expert_parallel_sizes(args: ModelArgs, dp_shard: int, cp: int = 1, only: int = 0) -> list[int]:
    """The ep sizes a layout of dp_shard ranks can split the experts over (each dividing both; hybridpar
    runs them without context parallelism); [1] for a dense model. `only` N > 0: N alone, if it is one."""
    sizes = [1] if not args.n_experts or cp > 1 else [ep for ep in divisors(dp_shard) if args.n_experts % ep == 0]
    return [ep for ep in sizes if ep == only] if only else sizes


def no_layout_for_ep(ep: int, every: list[Layout], gpus: int, pp: int) -> str:
    """The line for an --ep no layout takes, where `every` are the layouts of any ep: it takes its ranks
    from dp_shard, which it must divide."""
    eps, widest = sorted({lay.ep for lay in every}), max(lay.dp_shard for lay in every)
    stages = f" at --pp {pp}" if pp > 1 else ""
    return (f"--ep {ep} fits no layout of {gpus} GPUs{stages}: ep takes its ranks from dp_shard and must divide it, "
            f"and dp_shard is at most {widest} here; choose an ep that fits ({', '.join(map(str, eps))}), or more GPUs"
            + (" or fewer pipeline stages" if pp > 1 else ""))
