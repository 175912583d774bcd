"""Task files the evaluation tests write: a multiple-choice task, a rolling-loglikelihood (perplexity) task
and a generation task, each a YAML over a local JSON file (no network); and a loglikelihood task over
the requests a test makes for its model (write_loglikelihood_task); per_request and relative_errors
read the harness's samples back."""

from __future__ import annotations

import json
from pathlib import Path

QUESTIONS = [
    ("Return the sum of", ["a and b.", "the list.", "nothing at all."], 0),
    ("Open the file and", ["read its lines.", "close the door.", "return None."], 0),
    ("A list of", ["strings.", "numbers and names.", "the tokens in the text."], 2),
    ("Raise ValueError if", ["the value is negative.", "it rains.", "x."], 0),
    ("The default is", ["None.", "zero, or the empty string.", "True"], 1),
    ("Compare two", ["objects for equality.", "files.", "dates and times"], 1),
]


def write_tasks(folder: Path, documents: list[str]) -> None:
    """A multiple-choice task and a perplexity task, each a YAML over a local JSON file."""
    folder.mkdir()
    with open(folder / "mc.jsonl", "w") as f:
        for question, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    with open(folder / "ppl.jsonl", "w") as f:
        for doc in documents:
            f.write(json.dumps({"text": doc}) + "\n")
    (folder / "tiny_mc.yaml").write_text(
        "task: tiny_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\nmetadata:\n  version: 1.0\n")
    (folder / "tiny_ppl.yaml").write_text(
        "task: tiny_ppl\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'ppl.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
        "metadata:\n  version: 2.0\n")
    (folder / "tiny_gen.yaml").write_text(
        "task: tiny_gen\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_target: \"{{choices[answer]}}\"\ngeneration_kwargs:\n  until: [\" \"]\n  max_gen_toks: 12\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\nmetadata:\n  version: 1.0\n")


def write_loglikelihood_task(folder: Path, requests: list[dict]) -> None:
    """Task tiny_ll: a loglikelihood request per record ({"context": ..., "continuation": ...}, the
    continuation scored as written: no delimiter added), its metric whether the continuation is greedy."""
    with open(folder / "ll.jsonl", "w") as f:
        for record in requests:
            f.write(json.dumps(record) + "\n")
    (folder / "tiny_ll.yaml").write_text(
        "task: tiny_ll\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'll.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood\ndoc_to_text: context\ndoc_to_target: continuation\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\nmetadata:\n  version: 1.0\n")


def per_request(output: dict, greedy: bool = False) -> dict:
    """{(task, doc_id, choice): log-likelihood} of every request (a document's, for perplexity); with
    greedy, {...: whether the continuation is the greedy one} of the multiple-choice and loglikelihood
    requests."""
    found = {}
    for task, samples in output["samples"].items():
        for sample in samples if task != "tiny_gen" else []:
            for k, resp in enumerate(sample["resps"]):
                pair = isinstance(resp[0], (list, tuple))
                if pair or not greedy:
                    found[(task, sample["doc_id"], k)] = (bool(resp[0][1]) if greedy else float(resp[0][0])) \
                        if pair else float(resp[0])
    return found


def relative_errors(output: dict, reference: dict) -> dict:
    """{quantity: relative error} of the harness's output against the reference's: every request's
    log-likelihood together and each on its own, and tiny_ppl's perplexities."""
    import torch

    from tests.distributed import rel_err

    ours, theirs = per_request(output), per_request(reference)
    keys = sorted(theirs)
    errors = {"loglikelihoods": rel_err(torch.tensor([ours[k] for k in keys]), torch.tensor([theirs[k] for k in keys]))}
    for k in keys:  # each request on its own, too
        errors[f"{k[0]}[{k[1]}][{k[2]}]"] = abs(ours[k] - theirs[k]) / abs(theirs[k])
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        mine, ref = output["results"]["tiny_ppl"][metric], reference["results"]["tiny_ppl"][metric]
        errors[metric] = abs(mine - ref) / abs(ref)
    return errors
