"""The all-reduces float8 adds to a transformer block (hybridpar.parallel.float8's amax reductions),
counted on one forward and backward of the debug Llama (2 blocks, every linear but the head in
float8) against the same step without float8, per block and per mesh dimension.

A block has 5 column-parallel linears (wq, wk, wv, w1, w3) and 2 row-parallel ones (wo, w2); mp
splits the column-parallel ones' out-features and the row-parallel ones' in-features, cp the tokens.
Each pass of a linear (forward: input and weight; backward: output gradient, weight, input) reduces
the amaxes it cannot take from an earlier pass in one all-reduce per group, stacked:

  tensorwise  forward: the input over cp (and mp, row), the weight over mp; backward: the output
              gradient over cp (and mp, column); the weight and input reuse the forward's amaxes,
              the two casts of the output gradient share one.
              mp 2: 5 x 2 + 2 x 1 = 12; cp 2: 7 x 2 = 14; mp 2 x cp 2: 5 x 4 + 2 x 3 = 26
  rowwise     per row or column: along the in-features (forward, row: mp), the out-features
              (backward, column: mp), the tokens (backward, every linear: cp)
              mp 2: 5 + 2 = 7; cp 2: 7; mp 2 x cp 2: 5 x 2 + 2 x 2 = 14
  rowwise_with_gw_hp  as rowwise without the weight gradient's casts; the weight's tensorwise amax
              for the input gradient: over mp (column); row: the max of its forward amaxes, reduced
              over mp already. mp 2: 5 + 2 = 7; cp 2: 0; mp 2 x cp 2: 7

(Before the forward's amaxes were reused and the amaxes stacked: tensorwise 28, 28 and 56;
rowwise 14, 14 and 28; rowwise_with_gw_hp 16, 0 and 16.)"""

import pytest
import torch

from tests.distributed import parallel_dims

# Each worker imports torchao (torch._dynamo with it: seconds of CPU a rank) for the first case.
pytestmark = pytest.mark.slow

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
LAYOUTS = {"mp2-sp": (2, 1), "cp2": (1, 2), "mp2-cp2-sp": (2, 2)}  # (mp, cp); sequence parallel where mp > 1
PER_BLOCK = {  # layout -> recipe -> {mesh dimension: all-reduces per block}
    "mp2-sp": {"tensorwise": {"mp": 12}, "rowwise": {"mp": 7}, "rowwise_with_gw_hp": {"mp": 7}},
    "cp2": {"tensorwise": {"cp": 14}, "rowwise": {"cp": 7}, "rowwise_with_gw_hp": {}},
    "mp2-cp2-sp": {"tensorwise": {"mp": 12, "cp": 14}, "rowwise": {"mp": 7, "cp": 7}, "rowwise_with_gw_hp": {"mp": 7}},
}


def block_all_reduces(mp: int, cp: int, recipes=RECIPES, batch: int = 2, seq: int = 16) -> dict:
    """recipe -> {mesh dimension: {"calls", "payload"}}: the all-reduces (and their bytes) float8 at
    `recipe` adds to one block of the debug Llama's forward and backward at (mp, cp), sequence
    parallel where mp > 1; `batch` sequences of `seq` tokens (each cp rank its share)."""
    from hybridpar.config.low_precision import Float8Config
    from hybridpar.diagnostics.collectives import CollectiveCounter, mesh_dims
    from hybridpar.models.args import ModelArgs
    from hybridpar.models.llama import Transformer
    from hybridpar.parallel import vocab_parallel_cross_entropy
    from hybridpar.parallel.context import shard_sequence
    from hybridpar.parallel.float8 import convert_to_float8

    parallel, args = parallel_dims(mp=mp, cp=cp), ModelArgs.from_preset("debug")
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(7))
    inputs, targets = (shard_sequence(t, cp, parallel.cp_rank) for t in (tokens[:, :-1], tokens[:, 1:]))

    def counted(recipe: str) -> dict:
        torch.manual_seed(0)
        model = Transformer(args, parallel, sequence_parallel=mp > 1)
        names = convert_to_float8(model, parallel, Float8Config(recipe=recipe), device=torch.device("cpu"))
        assert len(names) == (7 * args.n_layers if recipe != "none" else 0), names
        with CollectiveCounter(label=mesh_dims(parallel)) as counter:
            vocab_parallel_cross_entropy(model(inputs), targets, parallel=parallel).backward()
        return {row["dim"]: row for row in counter.by_dim_and_op() if row["op"] == "all_reduce"}

    base = counted("none")
    result = {}
    for recipe in recipes:
        rows, result[recipe] = counted(recipe), {}
        for dim, row in rows.items():
            extra = {key: row[key] - base.get(dim, {}).get(key, 0) for key in ("calls", "payload")}
            if extra["calls"]:
                assert all(n % args.n_layers == 0 for n in extra.values()), (recipe, dim, extra)
                result[recipe][dim] = {key: n // args.n_layers for key, n in extra.items()}
    return result


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_amax_all_reduces_per_block(workers, layout):
    """The backward takes the amaxes the forward reduced (tensorwise: the weight's and the input's;
    rowwise_with_gw_hp: the weight's, for its tensorwise cast) instead of reducing them again, and
    each pass's amaxes over one group go in one all-reduce."""
    results = workers(4).run(block_all_reduces, *LAYOUTS[layout])
    assert all(r == results[0] for r in results), results  # every rank issues the same collectives
    for recipe, dims in results[0].items():
        print(f"{layout} {recipe}: " + ", ".join(f"{dim} {row['calls']} all-reduces, {row['payload']} bytes"
                                                 for dim, row in dims.items()))
    calls = {recipe: {dim: row["calls"] for dim, row in dims.items()} for recipe, dims in results[0].items()}
    assert calls == PER_BLOCK[layout]
