"""The whole Llama Transformer at mp = 2 and 4 against mp = 1 on the same full weights."""

import json

import pytest
import torch
import torch.nn.functional as F

from hybridpar.models.args import ModelArgs, preset_names
from hybridpar.models.llama import Transformer
from tests.distributed import parallel_dims, rel_err
from tests.models.meta_files import PUBLISHED_PARAMS

BOUND = 1e-5


def _batch(args: ModelArgs, batch: int = 2, seq: int = 16):
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(7))
    targets = tokens[:, 1:].clone()
    targets[0, 5] = -100  # an ignored position
    return tokens[:, :-1], targets


def _forward_backward(model, inputs, targets, parallel):
    from hybridpar.parallel import vocab_parallel_cross_entropy

    model.zero_grad(set_to_none=True)
    local_logits = model(inputs)
    loss = vocab_parallel_cross_entropy(local_logits, targets, parallel=parallel)
    loss.backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return local_logits.detach(), loss.detach(), grads


def _case_transformer_matches_mp1(preset: str, mp: int, sequence_parallel: bool = False, **fields) -> dict:
    from hybridpar.parallel.state import full_state_dict, load_full_state_dict

    args = ModelArgs.from_preset(preset, **fields)
    p1, pn = parallel_dims(mp=1), parallel_dims(mp=mp)
    torch.manual_seed(0)
    reference = Transformer(args, p1)
    torch.manual_seed(1)  # other weights, then overwritten: the load must do all the work
    model = Transformer(args, pn, sequence_parallel=sequence_parallel)
    load_full_state_dict(model, full_state_dict(reference))

    inputs, targets = _batch(args)
    ref_logits, ref_loss, ref_grads = _forward_backward(reference, inputs, targets, p1)
    # The mp = 1 reference itself against plain single-process cross-entropy.
    plain_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    logits, loss, grads = _forward_backward(model, inputs, targets, pn)
    with torch.no_grad():
        full_logits = model(inputs, gather_logits=True)

    errors = {
        "reference_loss_vs_F.cross_entropy": rel_err(ref_loss, plain_loss),
        "local_logits": rel_err(logits, ref_logits.chunk(mp, dim=-1)[pn.mp_rank]),
        "gathered_logits": rel_err(full_logits, ref_logits),
        "loss": rel_err(loss, ref_loss),
    }
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        errors[f"grad.{name}"] = rel_err(grad, ref_grads[name])
    return errors


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sequence_parallel"])
@pytest.mark.parametrize("mp", [2, 4])
@pytest.mark.parametrize("preset", ["debug", "debug_gqa", "debug_llama2"])
def test_transformer_matches_mp1(workers, check_close, preset, mp, sp):
    # debug_gqa at mp 4: 2 kv heads, each replicated on two ranks; debug_llama2: the embedding split on dim.
    results = workers(4).run(_case_transformer_matches_mp1, preset, mp, sp)
    check_close(f"{preset} mp{mp}{' sequence-parallel' if sp else ''}", results, BOUND)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sequence_parallel"])
@pytest.mark.parametrize("mp", [2, 4])
def test_tied_embeddings_match_mp1(workers, check_close, mp, sp):
    """The output head reads the embedding's weight; its gradient sums both uses, at any mp."""
    fields = dict(tie_embeddings=True, use_scaled_rope=True, rope_scaling_factor=32.0)
    results = workers(4).run(_case_transformer_matches_mp1, "debug_gqa", mp, sp, **fields)
    assert not any("output" in name for name in results[0])  # one weight, saved once
    check_close(f"tied mp{mp}{' sequence-parallel' if sp else ''}", results, BOUND)


def _case_tied_fsdp_step(mp: int, strategy: str) -> dict:
    """A tied model sharded by FSDP takes the optimizer step of the unsharded mp = 1 model on the
    whole batch: the embedding's gradient sums the head's use and the lookup's, over dp ranks."""
    import torch.distributed as dist

    from hybridpar.parallel import vocab_parallel_cross_entropy
    from hybridpar.config.sharding import FSDPConfig
    from hybridpar.parallel.fsdp import apply_fsdp
    from hybridpar.parallel.state import full_state_dict

    args = ModelArgs.from_preset("debug_gqa", tie_embeddings=True)
    p1, pn = parallel_dims(mp=1), parallel_dims(mp=mp, dp_shard=-1)
    torch.manual_seed(0)
    reference = Transformer(args, p1)
    torch.manual_seed(0)
    model = apply_fsdp(Transformer(args, pn), pn, FSDPConfig(sharding_strategy=strategy, param_dtype="float32"))
    inputs, targets = _batch(args, batch=2 * pn.dp_size)
    targets = torch.where(targets < 0, 0, targets)  # equal token counts per rank: the mean of means is the mean
    errors = {}
    for name, m, par, rows in (("reference", reference, p1, slice(None)),
                               ("fsdp", model, pn, slice(2 * pn.dp_rank, 2 * pn.dp_rank + 2))):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.5)
        for _ in range(2):
            optimizer.zero_grad()
            loss = vocab_parallel_cross_entropy(m(inputs[rows]), targets[rows], parallel=par)
            loss.backward()
            optimizer.step()
        errors[name] = full_state_dict(m)
    assert "output.weight" not in errors["fsdp"] and dist.get_world_size() == mp * pn.dp_size
    return {k: rel_err(errors["fsdp"][k], v) for k, v in errors.pop("reference").items()}


@pytest.mark.parametrize("mp,strategy", [(1, "full_shard"), (2, "hybrid_shard"), (2, "full_shard")])
def test_tied_embeddings_under_fsdp_take_the_single_process_step(workers, check_close, mp, strategy):
    check_close(f"tied fsdp mp{mp} {strategy}", workers(4).run(_case_tied_fsdp_step, mp, strategy), BOUND)


def _case_init_independent_of_mesh(preset: str, mp: int, dp_shard: int) -> dict:
    from hybridpar.parallel.state import full_state_dict

    args = ModelArgs.from_preset(preset)
    torch.manual_seed(42)
    reference = full_state_dict(Transformer(args, parallel_dims(mp=1)))
    torch.manual_seed(42)
    model = full_state_dict(Transformer(args, parallel_dims(mp=mp, dp_shard=dp_shard)))
    return {name: rel_err(model[name], reference[name]) for name in reference}


@pytest.mark.parametrize("mp,dp_shard", [(2, 2), (4, 1), (2, -1)])
def test_initial_weights_do_not_depend_on_mesh(workers, check_close, mp, dp_shard):
    results = workers(4).run(_case_init_independent_of_mesh, "debug_gqa", mp, dp_shard)
    check_close(f"init mp{mp}", results, 0.0)


def _case_kv_heads_replicated(mp: int) -> tuple:
    args = ModelArgs.from_preset("debug_gqa")
    model = Transformer(args, parallel_dims(mp=mp))
    wk = model.layers["0"].attention.wk
    return type(wk).__name__, tuple(wk.weight.to_local().shape)


def test_gqa_kv_heads_replicated_when_mp_exceeds_them(workers):
    # debug_gqa: 2 kv heads of dim 8. mp = 4 replicates them, mp = 2 splits them.
    assert workers(4).run(_case_kv_heads_replicated, 4) == [("ReplicatedHeadLinear", (16, 64))] * 4
    assert workers(4).run(_case_kv_heads_replicated, 2) == [("ColumnParallelLinear", (8, 64))] * 4


# --- ModelArgs and presets (no processes) -----------------------------------------------------

PUBLISHED = {  # Meta's parameter counts and feed-forward sizes
    "llama2_7b": (6_738_415_616, 11008),
    "llama2_13b": (13_015_864_320, 13824),
    "llama2_70b": (68_976_648_192, 28672),
    "llama3_8b": (8_030_261_248, 14336),
    "llama3_70b": (70_553_706_496, 28672),
    "llama3.1_8b": (8_030_261_248, 14336),
    "llama3.1_70b": (70_553_706_496, 28672),
    "llama3.1_405b": (405_853_388_800, 53248),
    "llama3.2_1b": (1_235_814_400, 8192),
    "llama3.2_3b": (3_212_749_824, 8192),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_meta_published_shapes(name):
    args = ModelArgs.from_preset(name)
    assert (args.num_params(), args.ffn_hidden_dim) == PUBLISHED[name]
    assert args.resolved_embedding_split == ("dim" if name.startswith("llama2") else "vocab")
    assert args.use_scaled_rope == name.startswith(("llama3.1", "llama3.2"))
    assert args.tie_embeddings == name.startswith("llama3.2")


def test_every_preset_loads():
    assert set(PUBLISHED) | {"tiny", "debug"} <= set(preset_names())
    for name in preset_names():
        ModelArgs.from_preset(name).check(1)


def test_params_json_round_trip_and_llama2_vocab(tmp_path):
    path = tmp_path / "params.json"
    # Llama 2 7B's params.json as Meta ships it: vocab_size -1, no rope_theta.
    path.write_text(json.dumps(PUBLISHED_PARAMS["llama2_7b"]))
    args = ModelArgs.from_params_json(path)
    assert args.rope_theta == 10000.0 and args.resolved_embedding_split == "dim"
    with pytest.raises(ValueError, match="vocab_size is -1.*tokenizer"):
        args.check(1)
    ModelArgs.from_params_json(path, vocab_size=32000).check(8)


@pytest.mark.parametrize(
    "fields,mp,message",
    [
        ({"dim": 96, "n_heads": 6, "n_kv_heads": 6}, 4, r"n_heads = 6 is not divisible by the model-parallel size mp = 4"),
        ({"n_kv_heads": 3, "n_heads": 6, "dim": 96}, 2, r"n_kv_heads = 3 and mp = 2: one must divide the other"),
        ({"vocab_size": 130}, 4, r"vocab_size .* = 130 is not divisible by .* mp = 4"),
        ({"multiple_of": 10}, 4, r"feed-forward hidden size .* = 170 is not divisible by .* mp = 4"),
        ({"dim": 36, "n_heads": 4, "n_kv_heads": 4}, 1, r"head_dim = dim / n_heads = 9 must be even"),
        ({"n_heads": 8, "n_kv_heads": 3}, 1, r"n_heads = 8 is not a multiple of n_kv_heads = 3"),
        ({"embedding_split": "rows"}, 1, r"embedding_split must be 'auto', 'dim' or 'vocab'"),
        ({"dim": 66, "n_heads": 4}, 1, r"dim = 66 is not divisible by n_heads = 4"),
    ],
)
def test_shape_errors_name_the_numbers(fields, mp, message):
    args = ModelArgs.from_dict({**vars(ModelArgs.from_preset("debug")), **fields})
    with pytest.raises(ValueError, match=message):
        args.check(mp)


def test_unknown_params_json_field_is_an_error(tmp_path):
    path = tmp_path / "params.json"
    path.write_text(json.dumps({"dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 128, "rope_scaling": 2.0}))
    with pytest.raises(ValueError, match=r"params.json: unknown model fields \['rope_scaling'\]; valid fields are"):
        ModelArgs.from_params_json(path)
