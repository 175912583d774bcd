"""The Llama Transformer with context parallelism against cp = 1 on the same full weights: each cp
rank feeds its two chunks of the sequence; the logits put back in order, the summed loss and the
gradients summed over the cp group equal the whole-sequence model's."""

import pytest
import torch

from hybridpar.models.args import ModelArgs
from hybridpar.models.llama import Transformer
from tests.distributed import parallel_dims, rel_err
from tests.models.test_llama import _batch

BOUND = 1e-5


def _case_cp_matches_cp1(preset: str, cp: int, mp: int, sequence_parallel: bool, seq: int) -> dict:
    import torch.distributed as dist

    from hybridpar.parallel import vocab_parallel_cross_entropy
    from hybridpar.parallel.context import gather_sequence, shard_sequence
    from hybridpar.parallel.state import full_state_dict, load_full_state_dict

    args = ModelArgs.from_preset(preset, use_scaled_rope=True, rope_scaling_factor=8.0)
    p1, pc = parallel_dims(), parallel_dims(mp=mp, cp=cp)
    torch.manual_seed(0)
    reference = Transformer(args, p1)
    model = Transformer(args, pc, sequence_parallel=sequence_parallel)
    load_full_state_dict(model, full_state_dict(reference))
    inputs, targets = _batch(args, seq=seq)

    count = (targets != -100).sum()  # the whole sequence's targets, as count_targets sums them over dp x cp

    def step(net, parallel, inputs, targets, group):
        net.zero_grad(set_to_none=True)
        logits = net(inputs)
        loss = vocab_parallel_cross_entropy(logits, targets, parallel=parallel, reduction="sum")
        (loss / count).backward()
        grads = {name: p.grad.full_tensor() for name, p in net.named_parameters()}
        if group is not None:  # each cp rank holds its tokens' share of the gradient (FSDP sums it in training)
            for grad in grads.values():
                dist.all_reduce(grad, group=group)
            dist.all_reduce(loss, group=group)
        with torch.no_grad():
            full = gather_sequence(net(inputs, gather_logits=True), group)
        return full, loss.detach(), grads

    ref_logits, ref_loss, ref_grads = step(reference, p1, inputs, targets, None)
    local = [shard_sequence(t, cp, pc.cp_rank) for t in (inputs, targets)]
    logits, loss, grads = step(model, pc, *local, pc.cp_group)
    errors = {"gathered_logits": rel_err(logits, ref_logits), "summed_loss": rel_err(loss, ref_loss)}
    for name, grad in grads.items():
        errors[f"grad.{name}"] = rel_err(grad, ref_grads[name])
    return errors


CASES = {
    # name: (preset, cp, mp, sequence_parallel, seq)
    "cp2-gqa": ("debug_gqa", 2, 1, False, 16),
    "cp4-single-token-chunks": ("debug_gqa", 4, 1, False, 8),
    "cp2-mp2-sequence_parallel": ("debug_gqa", 2, 2, True, 16),
    "cp2-mp2-tp-llama2": ("debug_llama2", 2, 2, False, 16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cp_model_matches_cp1(workers, check_close, case):
    check_close(f"model {case}", workers(4).run(_case_cp_matches_cp1, *CASES[case]), BOUND)


def _case_generation_refused() -> list:
    from hybridpar.generate import generate

    parallel = parallel_dims(cp=2)
    model = Transformer(ModelArgs.from_preset("debug_gqa"), parallel)
    messages = []
    for call in (lambda: generate(model, parallel, [[1, 2, 3]], 2, use_cache=True),
                 lambda: generate(model, parallel, [[1, 2, 3]], 2, use_cache=False)):
        try:
            call()
            messages.append("no error")
        except ValueError as err:
            messages.append(str(err))
    return messages


def test_generation_is_refused_at_cp_above_1(workers):
    for messages in workers(2).run(_case_generation_refused):  # one refusal, before the first forward
        for message in messages:
            assert message.startswith("generation runs at cp = 1, this model was built with cp = 2") and "\n" not in message


def _case_sp_part_refused() -> str:
    model = Transformer(ModelArgs.from_preset("debug_gqa"), parallel_dims(mp=4, cp=2), sequence_parallel=True)
    try:
        model(torch.zeros(1, 6, dtype=torch.long))  # a whole sequence of 12: 6 tokens per cp rank, over 4 mp ranks
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.slow  # world 8
def test_a_cp_part_mp_does_not_divide_is_refused_with_sequence_parallelism(workers):
    for message in workers(8).run(_case_sp_part_refused):
        assert message == ("this cp rank's part of the sequence, 6 tokens, is not divisible by mp = 4: sequence "
                           "parallelism gives each rank 1/mp of the positions; use a seq_len that is a multiple of 16 "
                           "or set parallel.sequence_parallel = false")
