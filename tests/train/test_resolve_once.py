"""A start resolves its job once (hybridpar.preflight.resolve_job), counted in the process across a
whole start (resolve, the Trainer's set-up, a step): the init_from folder's config.json (Meta's
params.json) opened once, the data sources walked once, and a complete token store used without
opening a source file or planning from one."""

from __future__ import annotations

import pytest
import torch

from tests.runs import make_config


def _start(config, library: bool) -> None:
    """A start as a library user makes it (Trainer(config).run()), or as `hybridpar train` does
    (commands.cmd_train, here on this config, keeping the worker's process group)."""
    import argparse

    import torch.distributed as dist

    import hybridpar.cli.commands as commands
    from hybridpar.train import Trainer

    if library:
        Trainer(config).run()
        return
    saved = commands._load_config, dist.destroy_process_group
    commands._load_config, dist.destroy_process_group = (lambda args: config), (lambda *a, **k: None)
    try:
        assert commands.cmd_train(argparse.Namespace(config=None, overrides=[], dry_run=False, json=None)) == 0
    finally:
        commands._load_config, dist.destroy_process_group = saved


def _case_counted_start(config, watched: list, library: bool = False) -> dict:
    """One start, counting the opens of `watched`, the sources' walks and the store plans made."""
    import json
    from pathlib import Path

    import hybridpar.data.sources as sources
    import hybridpar.data.store.unit_plan as store_plan
    import hybridpar.data.store.prepare as store_prepare
    from tests.opens import CountedOpens

    walks, plans = [], []

    class Walk(sources._Walk):
        def __init__(self) -> None:
            walks.append(1)
            super().__init__()

    def planning(real):
        return lambda *args, **kwargs: plans.append(1) or real(*args, **kwargs)

    saved = [(sources, "_Walk"), (store_plan, "plan_of"), (store_prepare, "plan_of")]
    saved = [(module, name, getattr(module, name)) for module, name in saved]
    sources._Walk = Walk
    store_plan.plan_of, store_prepare.plan_of = planning(store_plan.plan_of), planning(store_prepare.plan_of)
    try:
        with CountedOpens() as opened:
            _start(config, library)
    finally:
        for module, name, real in saved:
            setattr(module, name, real)
    metrics = Path(config.output.run_dir) / "metrics.jsonl"
    steps = [json.loads(line).get("step") for line in metrics.read_text().splitlines()]
    return {"opened": {path: opened.count(path) for path in watched}, "walks": len(walks), "plans": len(plans),
            "steps": max(s for s in steps if s is not None)}


@pytest.mark.parametrize("library", [False, True], ids=["train", "library"])
def test_a_complete_store_is_used_without_opening_a_source(workers, corpus, tmp_path, library):
    config = make_config(corpus, tmp_path / "first", steps=1)
    first = workers(1).run(_case_counted_start, config, [corpus["source"]])[0]
    assert first["walks"] == 1  # resolve_job walked it; the pipeline answered from the job
    again = workers(1).run(_case_counted_start, make_config(corpus, tmp_path / "again", steps=1),
                           [corpus["source"]], library)[0]
    assert again == {"opened": {corpus["source"]: 0}, "walks": 1, "plans": 0, "steps": 1}


def test_a_blend_walks_each_source_once_and_opens_none_once_stored(workers, corpus, tmp_path):
    import shutil

    parts = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for part in parts:
        shutil.copy(corpus["source"], part)
    flags = {"data.source": "default", "data.sources": f"a={parts[0]}@0.5,b={parts[1]}@0.5",
             "data.cache_dir": str(tmp_path / "cache")}  # its own cache: the blend's tokenizer is trained here
    workers(1).run(_case_counted_start, make_config(corpus, tmp_path / "first", steps=1, **flags), [])
    again = workers(1).run(_case_counted_start, make_config(corpus, tmp_path / "again", steps=1, **flags),
                           [str(p) for p in parts])[0]
    assert again == {"opened": {str(p): 0 for p in parts}, "walks": 2, "plans": 0, "steps": 1}


def test_a_changed_source_is_prepared_again(workers, corpus, tmp_path):
    """The counting can fail: a source edited since its store was made is read and planned again."""
    import shutil

    source = tmp_path / "docs.jsonl"
    shutil.copy(corpus["source"], source)
    data = {"source": str(source), "cache_dir": corpus["cache_dir"]}
    workers(1).run(_case_counted_start, make_config(data, tmp_path / "first", steps=1), [])
    with open(source, "a") as f:
        f.write('{"text": "one more document, so the size and the mtime change"}\n')
    edited = workers(1).run(_case_counted_start, make_config(data, tmp_path / "edited", steps=1), [str(source)])[0]
    assert edited["opened"][str(source)] > 0 and edited["plans"] > 0 and edited["walks"] == 1


@pytest.mark.parametrize("library", [False, True], ids=["train", "library"])
def test_an_hf_init_from_config_is_read_once(workers, corpus, tmp_path, library):
    pytest.importorskip("transformers")
    from tests.checkpoint.hf_folders import make_hf_folder

    folder = make_hf_folder(tmp_path / "hf", vocab_size=512, tied=True)  # the corpus tokenizer has 512 ids
    config = make_config(corpus, tmp_path / "run", steps=1, **{"checkpoint.init_from": str(folder)})
    counted = workers(1).run(_case_counted_start, config, [str(folder / "config.json")], library)[0]
    assert counted["opened"] == {str(folder / "config.json"): 1} and counted["steps"] == 1


def _case_meta_folder(folder: str) -> None:
    from hybridpar.checkpoint.meta import save_meta_checkpoint
    from hybridpar.models.args import ModelArgs
    from hybridpar.models.llama import Transformer
    from tests.distributed import parallel_dims

    parallel = parallel_dims()
    torch.manual_seed(0)
    save_meta_checkpoint(Transformer(ModelArgs.from_preset("debug", vocab_size=512), parallel), folder, parallel, 1)


def test_a_meta_init_from_params_json_is_read_once(workers, corpus, tmp_path):
    folder = tmp_path / "meta"
    workers(1).run(_case_meta_folder, str(folder))
    watched = [str(folder / "params.json"), str(folder / "hybridpar.json")]
    config = make_config(corpus, tmp_path / "run", steps=1, **{"checkpoint.init_from": str(folder)})
    counted = workers(1).run(_case_counted_start, config, watched)[0]["opened"]
    assert counted[watched[0]] == 1 and counted[watched[1]] <= 1, counted


def test_the_dry_run_takes_the_job_and_its_complete_store(workers, corpus, tmp_path):
    """dry_run(job) reads no init_from file again, and names the complete store resolve_job found
    (after a start made it; none in an empty cache)."""
    pytest.importorskip("transformers")
    from hybridpar.data.sources import source_key
    from hybridpar.cli.dryrun import dry_run
    from hybridpar.preflight import resolve_job
    from tests.checkpoint.hf_folders import make_hf_folder
    from tests.opens import CountedOpens

    folder = make_hf_folder(tmp_path / "hf", vocab_size=512, tied=True)
    flags = {"checkpoint.init_from": str(folder), "parallel.backend": "gloo"}
    config = make_config(corpus, tmp_path / "run", steps=1, **flags)
    workers(1).run(_case_counted_start, config, [])  # a start: the tokenizer and the store are made
    empty = make_config({**corpus, "cache_dir": str(tmp_path / "empty")}, tmp_path / "run", **flags)
    assert resolve_job(empty, 2).stores == {source_key(corpus["source"]): None}

    job = resolve_job(config, 2)
    store = job.stores[source_key(corpus["source"])]
    assert store is not None and (store / "store.json").is_file()
    with CountedOpens() as opened:
        run = dry_run(job, progress=None)
    assert opened.count(folder / "config.json") == 0 and opened.count(corpus["source"]) == 0
    checks = {c.name: c for c in run.checks}
    assert checks["model shape"].ok and f"its token store {store} complete" in checks["data"].detail
    assert run.world == 2


def test_a_job_resolved_for_another_world_is_refused(corpus, tmp_path):
    from hybridpar.config import ConfigError
    from hybridpar.data.sources import source_key
    from hybridpar.preflight import as_job, resolve_job

    config = make_config(corpus, tmp_path / "run", **{"parallel.mp": 2})
    job = resolve_job(config, 4)
    assert (job.sizes, job.init_from, job.args.vocab_size) == ((1, 1, 2, 1, 2), None, 512)
    assert [f.path.name for f in job.sources[source_key(corpus["source"])]] == ["docs.jsonl"]
    assert as_job(job, 4) is job and as_job(config, 2).sizes == (1, 1, 1, 1, 2)
    with pytest.raises(ConfigError, match=r"resolved for 4 rank\(s\), but this process group has 2"):
        as_job(job, 2)
