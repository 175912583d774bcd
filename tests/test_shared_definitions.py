"""Definitions that several modules use are made once."""

import pytest
import torch

from hybridpar.config import dtypes
from hybridpar.models.args import ModelArgs


def test_dtype_names_and_bytes():
    assert (dtypes.parse("float32").torch, dtypes.parse("float32").bytes) == (torch.float32, 4)
    assert [dtypes.dtype_bytes(name) for name in ("float16", "bfloat16")] == [2, 2]
    assert dtypes.CANONICAL_NAMES == {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    assert dtypes.TORCH_DTYPES == {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    assert dtypes.NAMES == ("float32", "bfloat16", "float16")
    assert all(d.bytes == d.torch.itemsize for d in dtypes.TABLE)


@pytest.mark.parametrize("name,message", [
    ("bf16", "fsdp.param_dtype: write 'bfloat16' (torch's name) instead of 'bf16'"),
    ("fp32", "fsdp.param_dtype: write 'float32' (torch's name) instead of 'fp32'"),
    ("int8", "fsdp.param_dtype: unknown dtype 'int8'; choose one of float32, bfloat16, float16"),
])
def test_a_dtype_alias_or_unknown_name_is_refused_naming_the_right_spelling(name, message):
    with pytest.raises(ValueError) as caught:
        dtypes.parse(name, "fsdp.param_dtype")
    assert str(caught.value) == message


def test_config_plan_and_export_read_the_one_dtype_table():
    from hybridpar import plan
    from hybridpar.checkpoint import hf

    assert hf._DTYPE_NAMES is dtypes.CANONICAL_NAMES
    assert plan.dtype_bytes is dtypes.dtype_bytes


def test_one_flops_per_token_and_one_list_of_ac_modes():
    from hybridpar import plan
    from hybridpar.config import sharding as fsdp_config
    from hybridpar.train import metrics

    assert plan.flops_per_token is metrics.flops_per_token is ModelArgs.flops_per_token
    assert plan.AC_MODES is fsdp_config.AC_MODES
    # The planner's candidates come in this order, and equal estimates keep it in the ranking.
    layouts, _ = plan.candidate_layouts(ModelArgs.from_preset("tiny"), plan.Hardware(gpus=1, gpu_mem_gib=80))
    assert [layout.ac for layout in layouts] == ["none", "selective", "full"]

