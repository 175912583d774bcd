"""hybridpar.parallel.fairscale: fairscale's own layers on a hybridpar mesh serve as the oracle.

Both libraries build the same layer on the same ranks with the same local shards; outputs, input
gradients and local weight gradients must agree. Every case releases fairscale's state on exit
(`with use_mesh(...)`), so cases sharing a worker pool do not leak groups into each other.
"""

import pytest
import torch
import torch.distributed as dist

from tests.distributed import parallel_dims, rel_err

BOUND = 1e-5
BATCH, SEQ, D_IN, D_OUT, VOCAB = 3, 5, 16, 24, 32


def _build(library, kind: str, flag, **extra):
    """The same constructor call on fairscale's layers module or hybridpar.parallel."""
    if kind == "column":
        return library.ColumnParallelLinear(D_IN, D_OUT, bias=True, gather_output=flag, **extra)
    if kind == "row":
        return library.RowParallelLinear(D_IN, D_OUT, bias=True, input_is_parallel=flag, **extra)
    if kind == "vocab_embedding":
        return library.VocabParallelEmbedding(VOCAB, D_OUT, **extra)
    return library.ParallelEmbedding(VOCAB, D_OUT, **extra)


def _inputs(kind: str, flag, mp: int, mp_rank: int):
    """Input and output gradient, drawn alike on every rank, cut to this rank's slice where the layer expects one."""
    torch.manual_seed(1)
    x = torch.randn(BATCH, SEQ, D_IN) if kind in ("column", "row") else torch.randint(0, VOCAB, (BATCH, SEQ))
    grad = torch.randn(BATCH, SEQ, D_OUT)
    if kind == "row" and flag:
        x = x.chunk(mp, dim=-1)[mp_rank]
    if kind == "column" and not flag:
        grad = grad.chunk(mp, dim=-1)[mp_rank]
    return x, grad


def _forward_backward(layer, x, grad) -> dict:
    """Output, input gradient and this rank's parameter gradients, all as plain local tensors."""
    if x.is_floating_point():
        x = x.clone().requires_grad_()
    out = layer(x)
    out.backward(grad)
    result = {"output": out.detach()}
    if x.is_floating_point():
        result["input_grad"] = x.grad
    for name, param in layer.named_parameters():
        result[f"{name}_grad"] = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
    return result


def _case_layer(kind: str, flag, mp: int) -> dict:
    import fairscale.nn.model_parallel.layers as fairscale_layers

    import hybridpar.parallel as hybridpar_layers
    from hybridpar.parallel.fairscale import use_mesh

    parallel = parallel_dims(mp=mp)
    with use_mesh(parallel):
        torch.manual_seed(0)
        ours = _build(hybridpar_layers, kind, flag, parallel=parallel)
        theirs = _build(fairscale_layers, kind, flag)
        with torch.no_grad():
            for name, param in ours.named_parameters():
                local = param.to_local()
                if name == "bias":
                    local.normal_()  # a zero bias would hide bias bugs
                target = getattr(theirs, name)
                assert target.shape == local.shape, (name, target.shape, local.shape)  # same shard layout
                target.copy_(local)
        x, grad = _inputs(kind, flag, mp, parallel.mp_rank)
        expected = _forward_backward(theirs, x, grad)
        actual = _forward_backward(ours, x, grad)
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    return {name: rel_err(actual[name], expected[name]) for name in expected}


def _case_cross_entropy(mp: int) -> dict:
    from fairscale.nn.model_parallel.cross_entropy import vocab_parallel_cross_entropy as fairscale_ce

    from hybridpar.parallel.fairscale import use_mesh
    from hybridpar.parallel import vocab_parallel_cross_entropy

    parallel = parallel_dims(mp=mp)
    with use_mesh(parallel):
        torch.manual_seed(2)
        logits = 3 * torch.randn(BATCH, SEQ, VOCAB)
        target = torch.randint(0, VOCAB, (BATCH, SEQ))
        grad = torch.rand(BATCH, SEQ)
        local = logits.chunk(mp, dim=-1)[parallel.mp_rank]
        ours_in, theirs_in = local.clone().requires_grad_(), local.clone().requires_grad_()
        ours = vocab_parallel_cross_entropy(ours_in, target, parallel=parallel, reduction="none")
        # fairscale returns per-token losses and subtracts the max in place: it gets its own copy.
        theirs = fairscale_ce(theirs_in, target)
        ours.backward(grad)
        theirs.backward(grad)
    return {"loss": rel_err(ours, theirs), "logits_grad": rel_err(ours_in.grad, theirs_in.grad)}


def _case_getters(dims: dict) -> dict:
    from fairscale.nn.model_parallel import initialize as fs

    from hybridpar.parallel.fairscale import use_mesh

    parallel = parallel_dims(**dims)
    before = fs.model_parallel_is_initialized()
    with use_mesh(parallel):
        seen = {
            "initialized": fs.model_parallel_is_initialized(),
            "mp_rank": fs.get_model_parallel_rank(),
            "mp_size": fs.get_model_parallel_world_size(),
            "src_rank": fs.get_model_parallel_src_rank(),
            "dp_rank": fs.get_data_parallel_rank(),
            "dp_size": fs.get_data_parallel_world_size(),
            "mp_group": dist.get_process_group_ranks(fs.get_model_parallel_group()),
            "dp_group": dist.get_process_group_ranks(fs.get_data_parallel_group()),
            "pipeline_group": dist.get_process_group_ranks(fs.get_pipeline_parallel_group()),
            "pipeline_ranks": fs.get_pipeline_parallel_ranks(),
        }
    return {"rank": dist.get_rank(), "before": before, "after": fs.model_parallel_is_initialized(), **seen}


def _fairscale_layout(rank: int, world: int, mp: int) -> dict:
    """What fairscale's getters mean, from fairscale's layout arange(world).reshape(dp, mp)."""
    grid = torch.arange(world).reshape(world // mp, mp)
    row, col = divmod(rank, mp)
    return {
        "rank": rank, "before": False, "after": False, "initialized": True,
        "mp_rank": col, "mp_size": mp, "src_rank": row * mp,
        "dp_rank": row, "dp_size": world // mp,
        "mp_group": grid[row].tolist(), "dp_group": grid[:, col].tolist(),
        "pipeline_group": [rank], "pipeline_ranks": [rank],
    }


def _case_lifecycle(mp: int) -> None:
    """Refuses to take over fairscale's own state, replaces it on request, restores it, nests in order."""
    from fairscale.nn.model_parallel import initialize as fs

    from hybridpar.parallel.fairscale import use_mesh

    small, large = parallel_dims(mp=mp), parallel_dims(mp=4)
    fs.initialize_model_parallel(mp)
    try:
        theirs = fs.get_model_parallel_group()
        try:
            use_mesh(small)
        except RuntimeError as err:
            assert "already initialised" in str(err) and "replace=True" in str(err), err
        else:
            raise AssertionError("use_mesh took over fairscale's own state without replace=True")
        with use_mesh(small, replace=True):
            assert fs.get_model_parallel_group() is small.mp_group
            assert fs.get_data_parallel_group() is small.dp_group
        assert fs.get_model_parallel_group() is theirs, "release did not restore fairscale's own state"
    finally:
        fs.destroy_model_parallel()

    outer = use_mesh(small)
    inner = use_mesh(large, replace=True)
    assert fs.get_model_parallel_world_size() == 4
    try:
        outer.release()
    except RuntimeError as err:
        assert "reverse order" in str(err), err
    else:
        raise AssertionError("releasing out of order clobbered the newer state")
    inner.release()
    assert fs.get_model_parallel_world_size() == mp and outer.active
    outer.release()
    outer.release()  # a second release is a no-op
    assert not fs.model_parallel_is_initialized()


LAYERS = [
    ("column", True), ("column", False), ("row", True), ("row", False),
    ("vocab_embedding", None), ("parallel_embedding", None),
]


@pytest.mark.parametrize("mp", [2, 4])
@pytest.mark.parametrize("kind,flag", LAYERS, ids=[f"{k}-{f}" for k, f in LAYERS])
def test_layer_matches_fairscale(workers, check_close, kind, flag, mp):
    check_close(f"{kind} mp{mp} vs fairscale", workers(4).run(_case_layer, kind, flag, mp), BOUND)


@pytest.mark.parametrize("mp", [2, 4])
def test_cross_entropy_matches_fairscale(workers, check_close, mp):
    check_close(f"cross_entropy mp{mp} vs fairscale", workers(4).run(_case_cross_entropy, mp), BOUND)


# (world, init_parallel arguments), spelled as the other tests spell them so each worker reuses its mesh.
GETTER_MESHES = {
    "world4-mp1": (4, dict(mp=1)),
    "world4-mp2": (4, dict(mp=2)),
    "world4-mp4": (4, dict(mp=4)),
    "world8-rep2-shard2-mp2": (8, dict(mp=2, dp_shard=2, dp_replicate=2)),
}


@pytest.mark.parametrize("mesh", GETTER_MESHES)
def test_fairscale_getters(workers, mesh):
    world, dims = GETTER_MESHES[mesh]
    for rank, seen in enumerate(workers(world).run(_case_getters, dims)):
        assert seen == _fairscale_layout(rank, world, dims["mp"]), f"rank {rank}"


def test_use_mesh_guards_and_restores_state(workers):
    workers(4).run(_case_lifecycle, 2)
