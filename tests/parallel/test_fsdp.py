"""Activation checkpointing picks the right blocks and really recomputes them in backward; the
collectives' buffer pool never hands out a buffer still in use; compiling on a CPU without a C++
compiler is refused with the fix."""

import pytest
import torch

from tests.distributed import parallel_dims


def _case_recompute_counts(mode: str, every: int) -> tuple:
    from hybridpar.parallel.fsdp import apply_activation_checkpointing
    from hybridpar.models.args import ModelArgs
    from hybridpar.models.llama import Transformer

    args = ModelArgs.from_preset("debug", n_layers=4)
    model = Transformer(args, parallel_dims())
    chosen = apply_activation_checkpointing(list(model.layers.values()), mode, every)
    calls = [0] * len(model.layers)
    for i, block in enumerate(model.layers.values()):
        forward = block.feed_forward.forward  # counted in the instance, so recomputation counts too

        def counted(x, i=i, forward=forward):
            calls[i] += 1
            return forward(x)

        block.feed_forward.forward = counted
    model(torch.randint(0, args.vocab_size, (2, 8))).sum().backward()
    return chosen, calls


@pytest.mark.parametrize(
    "mode,every,chosen,calls",
    [("none", 2, [], [1, 1, 1, 1]), ("full", 2, [0, 1, 2, 3], [2, 2, 2, 2]), ("selective", 2, [0, 2], [2, 1, 2, 1]),
     ("selective", 3, [0, 3], [2, 1, 1, 2])],
)
def test_activation_checkpointing_recomputes_chosen_blocks(workers, mode, every, chosen, calls):
    # A checkpointed block runs its forward twice: once in forward, once recomputed in backward.
    assert workers(1).run(_case_recompute_counts, mode, every)[0] == (chosen, calls)


def test_buffer_pool_reuses_only_buffers_nothing_else_holds():
    from hybridpar.fastpaths.gloo_collectives import _BufferPool

    pool = _BufferPool()
    a = pool.get((4, 3), torch.float32, "cpu")
    b = pool.get((12,), torch.float32, "cpu")
    first = a.data_ptr()
    assert b.data_ptr() != first  # a is in use
    view = a[1:]  # FSDP keeps views (a gradient in the reduced shard, say)
    del a
    c = pool.get((12,), torch.float32, "cpu")
    assert c.data_ptr() not in (first, b.data_ptr())  # the view still holds the first buffer
    del view, b
    d = pool.get((2, 6), torch.float32, "cpu")
    assert d.data_ptr() == first and d.shape == (2, 6)  # free again: reused, no new memory
    assert pool.get((12,), torch.bfloat16, "cpu").dtype == torch.bfloat16  # kept apart by dtype
    assert len(pool.buffers[(12, torch.float32, torch.device("cpu"))]) == 3


def _case_compile_without_compiler() -> tuple:
    from unittest import mock

    from hybridpar import build as model_module
    from hybridpar.config.sharding import FSDPConfig
    from hybridpar.parallel import fsdp
    from hybridpar.models.args import ModelArgs

    with mock.patch.object(fsdp.shutil, "which", return_value=None), \
            mock.patch.object(model_module, "Transformer", wraps=model_module.Transformer) as built:
        try:
            model_module.build_model(ModelArgs.from_preset("debug"), parallel_dims(), fsdp=FSDPConfig(), compile=True)
        except ValueError as err:
            message = str(err)
        else:
            message = ""
    untouched = not built.called  # refused before anything is built
    return message, untouched


def test_compile_without_a_cpp_compiler_says_what_to_do(workers):
    message, untouched = workers(1).run(_case_compile_without_compiler)[0]
    assert "needs a C++ compiler" in message and "set train.compile = false" in message, message
    assert untouched  # refused before any block was compiled or sharded
