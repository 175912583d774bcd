"""KV-cache decoding and generation, at mp 1, 2 and 4, against the full-sequence forward."""

import contextlib
import io
import json
import types
from pathlib import Path

import pytest
import torch

from hybridpar.models.args import ModelArgs
from hybridpar.models.llama import Transformer
from tests.distributed import parallel_dims, rel_err

BOUND = 1e-5


def _model(preset: str, mp: int, seed: int = 0):
    """The same weights at every mp: drawn at mp 1, loaded into the mp model."""
    from hybridpar.parallel.state import full_state_dict, load_full_state_dict

    args = ModelArgs.from_preset(preset)
    torch.manual_seed(seed)
    reference = Transformer(args, parallel_dims(mp=1))
    parallel = parallel_dims(mp=mp)
    model = Transformer(args, parallel)
    load_full_state_dict(model, full_state_dict(reference))
    return model, parallel


# --- the KV cache --------------------------------------------------------------------------------


def _case_cache_matches_full_forward(preset: str) -> dict:
    errors = {}
    for mp in (1, 2, 4):
        model, _ = _model(preset, mp)
        tokens = torch.randint(0, model.args.vocab_size, (2, 14), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            full = model(tokens, gather_logits=True)
            local_full = model(tokens)
            cache = model.new_cache(2, 20)
            # A prefill, single tokens, a 3-token chunk after a cached prefix, then single tokens again.
            cuts = [0, 5, 6, 7, 10, 11, 12, 13, 14]
            pieces, local_pieces = [], []
            for start, end in zip(cuts, cuts[1:]):
                pieces.append(model(tokens[:, start:end], gather_logits=True, start_pos=start, cache=cache))
                local_pieces.append(model(tokens[:, start:end], start_pos=start, cache=cache))
        errors[f"mp{mp}.gathered"] = rel_err(torch.cat(pieces, dim=1), full)
        errors[f"mp{mp}.local"] = rel_err(torch.cat(local_pieces, dim=1), local_full)
    return errors


@pytest.mark.parametrize("preset", ["debug", "debug_gqa", "debug_llama2", "debug_llama4"])
def test_incremental_decoding_equals_full_forward(workers, check_close, preset):
    # debug_gqa has 2 kv heads: mp 4 replicates them, mp 2 splits them. debug_llama4's chunks of 8: the
    # 3-token piece at 7 crosses a chunk's end; its RoPE-less layer scales queries by their positions.
    check_close(f"{preset} cache", workers(4).run(_case_cache_matches_full_forward, preset), BOUND)


def _case_cache_errors() -> list:
    model, _ = _model("debug", 1)
    cache = model.new_cache(1, 8)
    messages = []
    for call in (
        lambda: model(torch.zeros(1, 4, dtype=torch.long), start_pos=6, cache=cache),
        lambda: model(torch.zeros(1, 2, dtype=torch.long), start_pos=2),
        lambda: model.new_cache(1, 1000),
    ):
        try:
            call()
            messages.append(None)
        except ValueError as err:
            messages.append(str(err))
    return messages


def test_cache_misuse_is_a_clear_error(workers):
    too_long, no_cache, too_big = workers(4).run(_case_cache_errors)[0]
    assert "do not fit a cache of max_len 8" in too_long and "model.new_cache" in too_long
    assert "start_pos = 2 needs a cache" in no_cache
    assert "max_len = 1000 must be between 1 and max_seq_len = 64" in too_big


# --- generate --------------------------------------------------------------------------------------

PROMPTS = [[1, 17, 99, 4], [1, 5], [1, 60, 61, 62, 63, 64, 3]]  # different lengths on purpose


def _case_generate(preset: str, mp: int, runs: list) -> list:
    from hybridpar.generate import generate

    model, parallel = _model(preset, mp)
    out = []
    for kwargs in runs:
        prompts = kwargs.pop("prompts", PROMPTS)
        out.append(generate(model, parallel, prompts, **kwargs))
    return out


GREEDY = dict(max_new_tokens=12)
SAMPLED = dict(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=5)


def _same_on_every_rank(results):
    assert all(r == results[0] for r in results), "ranks of one job returned different tokens"
    return results[0]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["debug", "debug_gqa"])
def test_generation_is_the_same_at_every_mp(workers, preset):
    runs = [GREEDY, SAMPLED, dict(SAMPLED, seed=6)]
    by_mp = {mp: _same_on_every_rank(workers(4).run(_case_generate, preset, mp, runs)) for mp in (1, 2, 4)}
    greedy, sampled, sampled_other_seed = by_mp[1]
    assert by_mp[2] == by_mp[1] and by_mp[4] == by_mp[1]
    assert [len(c) for c in greedy] == [12, 12, 12]
    assert sampled != greedy and sampled_other_seed != sampled


def test_vocab_limit_keeps_the_choice_to_the_tokenizers_ids(workers):
    """A tokenizer smaller than the model's embedding (a 4,096-piece tokenizer under Llama 3's 128,256
    rows, as on the GPU check): ids past its end have no text and must never be chosen."""
    limit = 8
    free, greedy, sampled = _same_on_every_rank(workers(2).run(_case_generate, "debug", 2, [
        dict(SAMPLED, max_new_tokens=24), dict(GREEDY, vocab_limit=limit),
        dict(SAMPLED, max_new_tokens=24, vocab_limit=limit)]))
    assert any(t >= limit for c in free for t in c), free  # unlimited, the model picks ids past it
    assert all(t < limit for c in greedy + sampled for t in c), (greedy, sampled)
    assert [len(c) for c in greedy] == [12] * len(greedy)


@pytest.mark.slow
def test_cache_top_p_batching_and_eos(workers):
    pool = workers(4)
    runs = [
        GREEDY,
        dict(GREEDY, use_cache=False),
        SAMPLED,
        dict(SAMPLED, use_cache=False),
        dict(GREEDY, temperature=1.0, top_p=1e-9, seed=1),  # only the most likely token survives
        *[dict(GREEDY, prompts=[p]) for p in PROMPTS],  # each prompt alone
    ]
    greedy, greedy_no_cache, sampled, sampled_no_cache, tiny_top_p, *alone = _same_on_every_rank(
        pool.run(_case_generate, "debug", 2, runs)
    )
    assert greedy_no_cache == greedy
    assert sampled_no_cache == sampled
    assert tiny_top_p == greedy
    assert [a[0] for a in alone] == greedy  # batching prompts of different lengths changes nothing

    # eos: a token greedy emits at step 4 of the first sequence (and not before) ends it there.
    first = greedy[0]
    step = next(i for i in range(3, len(first)) if first[i] not in first[:i])
    eos = first[step]
    with_eos = _same_on_every_rank(pool.run(_case_generate, "debug", 2, [dict(GREEDY, eos_id=eos)]))[0]
    expected = [seq[: seq.index(eos)] if eos in seq else seq for seq in greedy]
    assert with_eos == expected and len(with_eos[0]) == step
    # Alone, the sequence stops there: a prefill plus one forward per new token up to the eos.
    tokens, calls = pool.run(_case_count_forwards, "debug", 2, dict(GREEDY, prompts=PROMPTS[:1], eos_id=eos))[0]
    assert tokens == [first[:step]] and calls == step + 1


def _case_count_forwards(preset: str, mp: int, kwargs: dict) -> tuple:
    from hybridpar.generate import generate

    model, parallel = _model(preset, mp)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    return generate(model, parallel, kwargs.pop("prompts"), **kwargs), len(calls)


def _case_generate_errors() -> list:
    from hybridpar.generate import generate

    model, parallel = _model("debug", 1)
    messages = []
    for kwargs in (
        dict(prompt_tokens=[[1, 2], []], max_new_tokens=2),
        dict(prompt_tokens=[[1, 500]], max_new_tokens=2),
        dict(prompt_tokens=[[1] * 60], max_new_tokens=10),
        dict(prompt_tokens=[[1]], max_new_tokens=2, temperature=1.0, top_p=0.0),
    ):
        try:
            generate(model, parallel, **kwargs)
            messages.append(None)
        except ValueError as err:
            messages.append(str(err))
    return messages


def test_generate_argument_errors(workers):
    empty, out_of_vocab, too_long, top_p = workers(4).run(_case_generate_errors)[0]
    assert "prompt 1 is empty" in empty
    assert "token ids [500] outside the model's vocabulary [0, 128)" in out_of_vocab
    assert "= 70 exceeds the model's max_seq_len = 64" in too_long
    assert "top_p must be in (0, 1]" in top_p


def test_sample_top_p_keeps_the_nucleus():
    from hybridpar.generate import sample_top_p

    probs = torch.tensor([[0.1, 0.5, 0.3, 0.1]])
    generator = torch.Generator().manual_seed(0)
    # 0.5 + 0.3 reaches 0.75: ids 1 and 2 only; tiny top_p leaves the argmax alone.
    drawn = {int(sample_top_p(probs, 0.75, generator)) for _ in range(200)}
    assert drawn == {1, 2}
    assert {int(sample_top_p(probs, 1e-9, generator)) for _ in range(50)} == {1}
    assert {int(sample_top_p(probs, 1.0, generator)) for _ in range(400)} == {0, 1, 2, 3}


# --- the command's entry point ------------------------------------------------------------------


def _case_main_generate(folder: str, tokenizer: str, prompts: list) -> tuple:
    from hybridpar.cli.commands import cmd_generate

    args = types.SimpleNamespace(checkpoint=folder, tokenizer=tokenizer, prompts=prompts, max_new_tokens=6,
                                 temperature=0.0, top_p=0.9, mp=2)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cmd_generate(args)
    return code, out.getvalue()


def _case_meta_folder(folder: str, vocab_size: int) -> None:
    """Write a Meta consolidated folder (one file, MP 1) of a debug_llama2-shaped model on rank 0."""
    import torch.distributed as dist

    from hybridpar.parallel.state import full_state_dict

    args = ModelArgs.from_preset("debug_llama2", vocab_size=vocab_size)
    torch.manual_seed(0)
    state = full_state_dict(Transformer(args, parallel_dims(mp=1)))
    if dist.get_rank() == 0:
        params = {k: getattr(args, k) for k in ("dim", "n_layers", "n_heads", "multiple_of", "norm_eps")}
        # Llama 2's params.json: no vocab_size (-1), the tokenizer decides.
        (Path(folder) / "params.json").write_text(json.dumps({**params, "vocab_size": -1}))
        torch.save(state, Path(folder) / "consolidated.00.pth")
    dist.barrier()


def test_main_generate_prints_on_rank_0_only(workers, tmp_path):
    pytest.importorskip("hybridpar.checkpoint.meta", reason="the Meta checkpoint reader is not there yet")
    from hybridpar.data import default_corpus_documents, train_tokenizer

    tokenizer = train_tokenizer(default_corpus_documents(max_documents=300), 600, tmp_path / "tokenizer.model")
    folder = tmp_path / "meta"
    folder.mkdir()
    pool = workers(4)
    pool.run(_case_meta_folder, str(folder), tokenizer.vocab_size)
    prompts = ["Return the", "A list of"]
    results = pool.run(_case_main_generate, str(folder), str(tmp_path / "tokenizer.model"), prompts)
    assert [code for code, _ in results] == [0] * 4
    assert [bool(text) for _, text in results] == [True, False, False, False]
    printed = results[0][1]
    assert all(p in printed for p in prompts) and printed.count("\n> ") == 2


def test_main_generate_with_llama3_and_hugging_face_tokenizers(workers, tmp_path):
    """Meta's original/ folder with a tiktoken tokenizer.model, and a folder with a tokenizer.json."""
    pytest.importorskip("hybridpar.checkpoint.meta", reason="the Meta checkpoint reader is not there yet")
    from hybridpar.data import Tokenizer, default_corpus_documents
    from tests.data.bpe_files import train_hf_bpe, write_tiktoken_file

    hf, n_words = train_hf_bpe(list(default_corpus_documents(max_documents=150)), 800)
    (tmp_path / "original").mkdir()
    (tmp_path / "hf").mkdir()
    write_tiktoken_file(hf, tmp_path / "original" / "tokenizer.model")
    hf.save(str(tmp_path / "hf" / "tokenizer.json"))
    assert Tokenizer(tmp_path / "original").vocab_size == Tokenizer(tmp_path / "hf").vocab_size == n_words + 256
    folder = tmp_path / "meta"
    folder.mkdir()
    pool = workers(4)
    pool.run(_case_meta_folder, str(folder), n_words + 256)
    prompts = ["Return the", "A list of"]
    for tokenizer in ("original", "hf"):
        results = pool.run(_case_main_generate, str(folder), str(tmp_path / tokenizer), prompts)
        assert [code for code, _ in results] == [0] * 4
        printed = results[0][1]
        assert all(p in printed for p in prompts) and printed.count("\n> ") == 2
