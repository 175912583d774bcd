"""`hybridpar eval` on a Hugging Face Llama 4 folder made by transformers (Llama4ForCausalLM, random
weights: 4 experts on layers 1 and 3, a RoPE-less layer, chunks of 8 positions in a 64-position window)
with a Llama 3/4-style tokenizer.json (its post-processor puts <|begin_of_text|> first) equals
lm-evaluation-harness's own Hugging Face backend (`lm_eval --model hf`) on the same folder: identical
accuracies, per-request log-likelihoods and perplexities within 1e-5, at world 1, mp 2, ep 2 and
ep 2 x mp 2. At ep > 1 a task that generates text is refused in one line before the model loads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.evaluate.local_tasks import QUESTIONS, per_request, relative_errors, write_tasks

pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")
pytest.importorskip("transformers")
os.environ["HF_DATASETS_OFFLINE"] = "1"  # no network: every dataset is a local file
os.environ["HF_HUB_OFFLINE"] = "1"

BOUND = 1e-5  # per-request log-likelihoods and perplexities, relative, in float32
TASKS = "tiny_mc,tiny_ppl"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The Llama 4 folder with its tokenizer (tokenizer.json and tokenizer_config.json, as a download
    holds them) and the local task files; returns their root."""
    from hybridpar.data import default_corpus_documents
    from tests.checkpoint.hf_folders import make_llama4_folder
    from tests.data.bpe_files import train_hf_bpe

    root = tmp_path_factory.mktemp("llama4_eval")
    documents = list(default_corpus_documents(max_documents=200))
    tokenizer, n_words = train_hf_bpe(documents, 400)
    # The ids of <|begin_of_text|> and <|end_of_text|>: the first two specials after the BPE's words.
    folder = make_llama4_folder(root / "hf", vocab_size=n_words + 256, bos_token_id=n_words, eos_token_id=n_words + 1)
    tokenizer.save(str(folder / "tokenizer.json"))
    # Plain strings, as Llama 4's own file has them (transformers 5 refuses the {"content": ...} form here).
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                             "eos_token": "<|end_of_text|>"}))
    # transformers' tokenizer from the folder puts bos first, so the harness's hf backend scores with it.
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(folder))("Return the").input_ids[0] == n_words
    # Documents of several lengths: the longest spans more than one 64-token window.
    write_tasks(root / "tasks", [documents[i] for i in (3, 10, 25, 40)])
    return root


@pytest.fixture(scope="module")
def reference(saved):
    """lm-eval's Hugging Face backend on the folder, in float32: transformers' Llama4ForCausalLM, found
    by AutoModelForCausalLM from the folder's llama4_text config, and its tokenizer, which adds bos."""
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    output = simple_evaluate(model="hf", model_args=f"pretrained={saved / 'hf'},dtype=float32",
                             tasks=TASKS.split(","), log_samples=True, device="cpu", batch_size=4,
                             task_manager=TaskManager(include_path=str(saved / "tasks"), include_defaults=False))
    return output


def _case_evaluate(root: str, mp: int, ep: int) -> dict:
    from hybridpar.evaluate import evaluate_checkpoint
    from tests.distributed import parallel_dims

    parallel = parallel_dims(mp=mp, ep=ep)
    output = evaluate_checkpoint(Path(root) / "hf", TASKS, include_path=str(Path(root) / "tasks"), log_samples=True,
                                 parallel=parallel, batch_tokens=100)
    return None if output is None else {k: output[k] for k in ("results", "samples", "step")}


@pytest.mark.slow
@pytest.mark.parametrize("world,mp,ep", [(1, 1, 1), (2, 2, 1), (2, 1, 2), (4, 2, 2)],
                         ids=["world1", "mp2", "ep2", "ep2-mp2"])
def test_eval_of_a_llama4_folder_equals_the_harness_hf_backend(workers, saved, reference, check_close, world, mp, ep):
    results = workers(world).run(_case_evaluate, str(saved), mp, ep)
    assert all(r is None for r in results[1:]), "only rank 0 returns the harness's output"
    output = results[0]
    assert output["step"] is None
    for metric in ("acc,none", "acc_norm,none"):  # accuracies identical
        assert output["results"]["tiny_mc"][metric] == reference["results"]["tiny_mc"][metric], metric
    assert per_request(output, greedy=True) == per_request(reference, greedy=True)
    ours, theirs = per_request(output), per_request(reference)
    assert ours.keys() == theirs.keys() and len(ours) == sum(len(q[1]) for q in QUESTIONS) + 4
    check_close(f"Llama 4 folder at mp{mp} ep{ep} (world {world}) vs lm-eval hf", relative_errors(output, reference),
                BOUND)


GENERATING = ("--tasks: tiny_gen generate text (generate_until), which hybridpar eval does not run at --ep 2: the ep "
              "ranks run every forward together and generation runs each rank's own number of steps; score them at "
              "--ep 1 (each rank holding every expert)")


def _case_generation_at_ep(root: str) -> str:
    from hybridpar.config import ConfigError
    from hybridpar.evaluate import evaluate_checkpoint
    from tests.distributed import parallel_dims

    with pytest.raises(ConfigError) as refused:
        evaluate_checkpoint(Path(root) / "hf", "tiny_mc,tiny_gen", include_path=str(Path(root) / "tasks"),
                            parallel=parallel_dims(ep=2))
    return str(refused.value)


@pytest.mark.slow
def test_a_task_that_generates_is_refused_at_ep_2_in_one_line_before_the_model_loads(workers, saved):
    assert workers(2).run(_case_generation_at_ep, str(saved)) == [GENERATING] * 2


def test_the_harness_backends_generation_at_ep_2_is_refused_in_one_line_naming_its_model_args():
    """Through lm-eval's own command line (python -m hybridpar.evaluate --model_args ...,ep=2) no task
    is checked beforehand: rank 0 refuses the harness's first generation request, before any command."""
    from types import SimpleNamespace

    from hybridpar.evaluate import HybridparLM, Loaded

    loaded = Loaded(model=None, parallel=SimpleNamespace(ep=2, world_size=1), tokenizer=None, args=None, step=None)
    lm = HybridparLM(loaded=loaded, add_bos_token=False)
    requests = [SimpleNamespace(args=("Return the", {"until": ["\n"]}))] * 3
    with pytest.raises(ValueError) as refused:
        lm.generate_until(requests)
    assert str(refused.value) == ("3 requests generate text (generate_until), which hybridpar eval does not run at "
                                  "ep=2: the ep ranks run every forward together and generation runs each rank's own "
                                  "number of steps; score them at ep=1 (each rank holding every expert)")
