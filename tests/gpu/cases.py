"""The bodies of the tests marked gpu, by device: test_cuda.py runs them on "cuda" (world 1, nccl);
the same bodies run on "cpu" with gloo (`python -m tests.gpu.cases`), so their logic is checked on
a machine without a GPU before a GPU session spends its minutes on them."""

from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import numpy as np
import torch

from hybridpar.models.args import ModelArgs

# Small, but the shapes the fused kernels take: head_dim 64, GQA 4/2 (enable_gqa), bf16.
ARGS = dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=32, max_seq_len=256)
BATCH, SEQ = 2, 128
# ||bf16 - fp32|| / ||fp32|| of the logits. bf16 keeps 8 significant bits: each rounding of a
# matmul's inputs (and of the parameters gathered in bf16) errs by up to u = 2^-8 = 3.9e-3 per
# element, and the model rounds before each of its 2 x n_layers + 1 matmul stages and its norms;
# independent roundings add in quadrature, sqrt(2 x 2 + 1) x u = 8.7e-3 for 2 layers. FlashAttention
# accumulates in fp32, so it adds no more than the math path. 2e-2 leaves 2x for correlated errors;
# a real defect (fp16 overflow, a wrong kernel, weights not copied) gives O(1).
BF16_LOGITS_BOUND = 2e-2
FUSED = re.compile(r"flash|efficient|fmha|cutlass|cudnn", re.I)
MATH = "aten::_scaled_dot_product_attention_math"
# aten's softmax kernels, which the math path runs (the model has no other softmax)
MATH_KERNELS = re.compile(r"softmax_warp_(forward|backward)|cunn_SoftMax(Forward|Backward)")


def process_group(device: str):
    """World 1 on this process: nccl on cuda, gloo on cpu, as hybridpar's default backend picks."""
    import hybridpar

    return hybridpar.init_parallel(mp=1, backend="nccl" if device == "cuda" else "gloo")


def reference_and_model(parallel, device: str):
    """(fp32 model on the CPU, the same weights built by hybridpar's build path on `device`: FSDP2
    at world 1, bf16 parameters in compute, fp32 reductions)."""
    from hybridpar.config.sharding import FSDPConfig
    from hybridpar.build import build_model
    from hybridpar.parallel.state import load_full_state_dict

    args = ModelArgs(**ARGS)
    torch.manual_seed(0)
    reference = plain_cpu(build_model(args, parallel))  # fsdp None: plain fp32
    weights = dict(reference.state_dict())
    model = build_model(args, parallel, device=torch.device(device),
                        load=lambda m: load_full_state_dict(m, weights),
                        fsdp=FSDPConfig(sharding_strategy="full_shard", param_dtype="bfloat16"))
    return reference, model, weights


def plain_cpu(model: torch.nn.Module) -> torch.nn.Module:
    """The model with plain fp32 CPU tensors for parameters. Its layers hold DTensors on the mp mesh
    even at mp 1, and DTensor.from_local moves a CPU tensor to the mesh's device (cuda under nccl):
    at mp 1 each DTensor's local tensor is the whole tensor, and the layers compute on local
    tensors (parallel/layers.py's local_tensor), so plain tensors give the same model on the CPU."""
    from torch.distributed.tensor import DTensor

    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            local = param.to_local() if isinstance(param, DTensor) else param
            setattr(module, name, torch.nn.Parameter(local.detach().to("cpu", torch.float32).clone()))
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, buffer.to("cpu"))
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, ARGS["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def bf16_logits_error(parallel, device: str) -> float:
    reference, model, _ = reference_and_model(parallel, device)
    x = tokens()
    with torch.no_grad():
        want = reference(x, gather_logits=True).double()
        got = model(x.to(device), gather_logits=True).double().cpu()
    assert got.shape == want.shape == (BATCH, SEQ, ARGS["vocab_size"])
    return ((got - want).norm() / want.norm()).item()


def attention_ops(parallel, device: str) -> tuple[set[str], set[str]]:
    """(the scaled-dot-product-attention ops a forward + backward of hybridpar's model ran, the GPU
    kernels it launched) under torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _, model, _ = reference_and_model(parallel, device)
    x = tokens().to(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        model(x).float().sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = {e.key for e in events if e.device_type == DeviceType.CUDA}
    return {e.key for e in events if "scaled_dot_product" in e.key}, kernels


def fused_attention_only(parallel, device: str) -> None:
    """A forward + backward with SDPA restricted to FLASH + EFFICIENT: raises if neither takes
    hybridpar's attention (the math fallback would be the only one left)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _, model, _ = reference_and_model(parallel, device)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        model(tokens().to(device)).float().sum().backward()


def gather_to_matches(parallel, device: str) -> int:
    """Every parameter gathered with parallel.state.gather_to on `device` equals its full tensor and
    the weights that were loaded; the number of parameters checked."""
    from torch.distributed.tensor import DTensor

    from hybridpar.parallel.state import block, gather_to

    _, model, weights = reference_and_model(parallel, device)
    checked = 0
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{name} is not a DTensor under FSDP2"
        full = gather_to(param, 0, [block(param)])  # world 1: rank 0 holds every block
        assert full.device.type == device and full.dtype == torch.float32, (name, full.device, full.dtype)
        assert torch.equal(full, param.full_tensor()), name
        assert torch.equal(full.cpu(), weights[name]), name
        checked += 1
    return checked


def loaded_batch(device: str) -> tuple[bool, bool]:
    """(the loader's batch is in pinned memory, the batch on `device` equals it) for hybridpar's
    ResumableDataLoader with its default pin_memory, moved as the training step moves it."""
    from hybridpar.data.loader import PackedDataset, build_dataloader

    n = 64 * 17 + 1
    store = SimpleNamespace(tokens=np.arange(n, dtype=np.int64) % 500, n_tokens=n)
    loader = build_dataloader(PackedDataset(store, 16), dp_rank=0, dp_size=1, micro_batch_size=4, seed=0)
    inputs, targets = next(loader)
    pinned = inputs.is_pinned() and targets.is_pinned()
    moved = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)  # train/step.py's way
    if device == "cuda":
        torch.cuda.synchronize()
    return pinned, all(m.device.type == device and torch.equal(m.cpu(), t) for m, t in zip(moved, (inputs, targets)))


def main(device: str = "cpu") -> None:
    """The CPU rehearsal: every in-process body on this device, world 1."""
    parallel = process_group(device)
    print(f"bf16 logits relative error {bf16_logits_error(parallel, device):.2e} (bound {BF16_LOGITS_BOUND:g})")
    sdpa, _ = attention_ops(parallel, device)
    print(f"attention ops: {sorted(sdpa)}")
    try:
        fused_attention_only(parallel, device)
        print("flash/efficient only: ran")
    except RuntimeError as err:
        print(f"flash/efficient only: {str(err).splitlines()[0]}")
    print(f"gather_to: {gather_to_matches(parallel, device)} parameters equal")
    print(f"pinned, equal on {device}: {loaded_batch(device)}")


if __name__ == "__main__":
    main(*sys.argv[1:])
