"""Meta and Hugging Face folders load into pipeline stage models (hybridpar.pipeline.cutting.build_stage):
each stage reads only its own layers' tensors and the ends it holds (every tensor read is recorded:
Meta's memory-mapped tensors through a recording subclass, safetensors through its slices), and
holds exactly the values the unsplit model loaded from the same folder holds, at mp 1 and mp 2.
And HF -> hybridpar at pp 2 -> HF gives back every tensor bit for bit."""

import json
from pathlib import Path

import pytest
import torch

from tests.checkpoint.pp_stages import small_args
from tests.distributed import parallel_dims

transformers = pytest.importorskip("transformers")

from tests.checkpoint.hf_folders import folder_tensors as _tensors, make_hf_folder  # noqa: E402

N_STAGES = 3  # of 4 layers: embedding + layer 0 | layers 1-2 | layer 3 + norm + head


class _Recorded(torch.Tensor):
    """A memory-mapped tensor of a Meta file that records its name when its values are touched
    (anything but asking its shape, dtype or device)."""

    reads: set = set()
    _META = {torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
             torch.Tensor.ndim.__get__, torch.Tensor.dim, torch.Tensor.size, torch.Tensor.is_floating_point}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func not in cls._META:
            cls.reads.update(a.hp_name for a in args if isinstance(a, _Recorded) and hasattr(a, "hp_name"))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class _Slice:
    def __init__(self, real, name: str, reads: set) -> None:
        self.real, self.name, self.reads = real, name, reads

    def __getitem__(self, index):
        self.reads.add(self.name)
        return self.real[index]

    def __getattr__(self, attr):  # get_shape, get_dtype: the header
        return getattr(self.real, attr)


class _Handle:
    """A safetensors handle whose data reads (a slice's block, a whole tensor) are recorded by name."""

    reads: set = set()

    def __init__(self, real) -> None:
        self.real = real

    def get_slice(self, name):
        return _Slice(self.real.get_slice(name), name, self.reads)

    def get_tensor(self, name):
        self.reads.add(name)
        return self.real.get_tensor(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.real.__exit__(*exc)

    def __getattr__(self, attr):
        return getattr(self.real, attr)


def _recording(kind: str):
    """Patch the reader of `kind` so that every tensor read lands in the returned set; returns (set, undo)."""
    if kind == "meta":
        from hybridpar.checkpoint import meta_read

        real = meta_read._load_file

        def load(path, *a, **k):
            out = {}
            for name, tensor in real(path, *a, **k).items():
                out[name] = tensor.as_subclass(_Recorded)
                out[name].hp_name = name
            return out

        meta_read._load_file, reads = load, _Recorded.reads
        return reads, lambda: setattr(meta_read, "_load_file", real)
    from hybridpar.checkpoint import hf_read

    real_open = hf_read._open
    hf_read._open = lambda path: _Handle(real_open(path))
    return _Handle.reads, lambda: setattr(hf_read, "_open", real_open)


def _case_stage_reads(kind: str, folder: str, mp: int) -> list[dict]:
    """Per stage: the names it holds, the names it read (the format's), and those whose values differ
    from the unsplit model's loaded from the same folder."""
    from hybridpar.checkpoint.convert import load_into, read_args
    from hybridpar.checkpoint.hf import hf_name
    from hybridpar.models.llama import Transformer
    from hybridpar.pipeline.schedules import stage_layer_counts
    from hybridpar.pipeline.cutting import build_stage
    from hybridpar.parallel.state import full_state_dict

    parallel, folder = parallel_dims(mp=mp), Path(folder)
    args = read_args(kind, folder)

    def built() -> Transformer:
        with torch.device("meta"):
            model = Transformer(args, parallel)
        return model.to_empty(device="cpu")

    whole = built()
    load_into(kind, folder, whole, parallel)
    expected = full_state_dict(whole)
    counts = stage_layer_counts(args.n_layers, N_STAGES)
    out = []
    for stage in range(N_STAGES):
        model = build_stage(args, parallel, stage, counts, device=torch.device("meta")).to_empty(device="cpu")
        reads, undo = _recording(kind)
        reads.clear()
        try:
            load_into(kind, folder, model, parallel)
        finally:
            undo()
        got = full_state_dict(model)
        names = sorted(got)
        out.append({"held": [hf_name(n) if kind == "hf" else n for n in names], "read": sorted(reads),
                    "differ": [n for n in names if not torch.equal(got[n], expected[n])]})
    return out


def _case_write_meta(folder: str) -> None:
    from hybridpar.checkpoint.meta import save_meta_checkpoint
    from hybridpar.models.llama import Transformer

    parallel = parallel_dims(mp=2)
    torch.manual_seed(3)
    save_meta_checkpoint(Transformer(small_args(n_layers=4), parallel), Path(folder), parallel, 2)


@pytest.fixture(scope="module")
def folders(workers, tmp_path_factory):
    root = tmp_path_factory.mktemp("pp_load")
    workers(2).run(_case_write_meta, str(root / "meta"))
    return {"meta": root / "meta", "hf": make_hf_folder(root / "hf", num_hidden_layers=4)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["meta", "hf"])
@pytest.mark.parametrize("mp", [1, 2])
def test_each_stage_reads_only_its_own_tensors_and_equals_the_whole(workers, folders, kind, mp):
    per_rank = workers(mp).run(_case_stage_reads, kind, str(folders[kind]), mp)
    ends = {"meta": ("tok_embeddings.weight", "norm.weight", "output.weight"),
            "hf": ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}[kind]
    for rank, stages in enumerate(per_rank):
        held = [set(s["held"]) for s in stages]
        assert set().union(*held) >= set(ends) and not held[0] & held[1] and not held[1] & held[2]
        assert ends[0] in held[0] and ends[1] in held[2] and ends[2] in held[2]
        for stage, result in enumerate(stages):
            # exactly its own: no other stage's layer, no embedding or head it does not hold
            extra = sorted(set(result["read"]) - set(result["held"]) - {"rope.freqs"})
            assert not extra, f"rank {rank} stage {stage} read tensors it does not hold: {extra}"
            assert set(result["read"]) >= set(result["held"]), (stage, result)
            assert not result["differ"], f"rank {rank} stage {stage}: not the unsplit model's {result['differ']}"


# --- HF -> hybridpar at pp 2 -> HF ---------------------------------------------------------------


def _case_hf_into_pp2(src: str, folder: str) -> list[str]:
    """Each rank its stage of the HF folder, saved through the Checkpointer (weights only)."""
    from hybridpar.checkpoint.convert import load_into, read_args
    from hybridpar.checkpoint.dcp import Checkpointer, params_dict
    from hybridpar.pipeline.schedules import stage_layer_counts
    from hybridpar.pipeline.cutting import build_stage

    parallel = parallel_dims(pp=2)
    args = read_args("hf", Path(src))
    stage = build_stage(args, parallel, parallel.pp_rank, stage_layer_counts(args.n_layers, 2), device=torch.device("meta"))
    stage.to_empty(device="cpu")
    load_into("hf", Path(src), stage, parallel)
    Checkpointer(Path(folder), parallel).save(0, [stage], None, {}, params_dict(args))
    return sorted(stage.state_dict())


def _case_convert_to_hf(src: str, dst: str) -> None:
    from hybridpar.checkpoint.convert import convert

    convert(Path(src), Path(dst), "hf", parallel_dims(mp=1), dtype=torch.float32, max_shard_size="64KB")


@pytest.mark.slow
def test_hf_to_hybridpar_at_pp2_and_back_is_exact(workers, folders, tmp_path):
    src = folders["hf"]
    stages = workers(2).run(_case_hf_into_pp2, str(src), str(tmp_path / "ckpt"))
    assert not set(stages[0]) & set(stages[1])  # each rank saved its own stage
    workers(1).run(_case_convert_to_hf, str(tmp_path / "ckpt"), str(tmp_path / "back"))
    original, again = _tensors(src), _tensors(tmp_path / "back")
    assert len(original) == 4 * 9 + 3 and sorted(again) == sorted(original)
    differ = [name for name, tensor in original.items()
              if again[name].dtype != tensor.dtype or not torch.equal(again[name], tensor)]
    assert not differ, differ
    config, back = (json.loads((p / "config.json").read_text()) for p in (src, tmp_path / "back"))
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "max_position_embeddings", "tie_word_embeddings", "rms_norm_eps", "model_type"):
        assert back[key] == config[key], key
    assert back["rope_scaling"] == {k: v for k, v in config["rope_parameters"].items() if k != "rope_theta"}
    assert back["rope_theta"] == config["rope_parameters"]["rope_theta"]
