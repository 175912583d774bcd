"""compat.torch's shims that change numbers: the gradient norm that clipping divides by."""

import torch

from hybridpar.compat.torch import tensor_norms


def test_tensor_norms_are_accurate_on_cpu():
    # torch._foreach_norm alone is off by ~1e-4 at 2^22 float32 elements on the CPU (its error grows
    # with the length); every layout's clip coefficient would then depend on its shard sizes.
    torch.manual_seed(0)
    big = torch.randn(1 << 22) * 1e-3
    tensors = [big, torch.randn(1 << 20)[::2], torch.randn(3, 5), torch.empty(0), big.view(1024, -1).t()]
    norms = tensor_norms(tensors)
    assert norms.dtype == torch.float32 and norms.shape == (len(tensors),)
    for t, n in zip(tensors, norms):
        expected = t.double().norm().item()
        err = abs(n.item() - expected) / expected if expected else n.item()
        assert err <= 1e-6, f"{tuple(t.shape)} strides {t.stride()}: relative error {err:.2e}"
