"""A fresh optimizer gets its state tensors from the checkpoint's metadata (no zero-gradient step),
loads exactly the saved state, and is left to torch's own initialisation when the stored state is
not parameter-shaped or is missing."""

from __future__ import annotations

import warnings

import torch

# Single process, no process group: DCP's no_dist mode.


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    model[1].bias.requires_grad_(False)  # a frozen parameter: never stepped, no state
    return model


def _trained(folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _model(0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for _ in range(3):
        model(torch.randn(4, 6)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(folder), no_dist=True)
    return model, optimizer, dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata


def _fresh():
    model = _model(1)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)


def test_allocated_state_loads_the_saved_state(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as sd

    from hybridpar.checkpoint.reader import SafeLoadPlanner
    from hybridpar.fastpaths.dcp_reader import FastFileSystemReader
    from hybridpar.fastpaths.optimizer_state import allocate_optimizer_state as _allocate_optimizer_state

    saved_model, saved_opt, metadata = _trained(tmp_path)
    model, optimizer = _fresh()
    _allocate_optimizer_state(model, optimizer, metadata)
    by_name = dict(model.named_parameters())
    assert {n for n, p in by_name.items() if p in optimizer.state} == {"0.weight", "0.bias", "1.weight"}
    for name, p in by_name.items():
        if p.requires_grad:
            assert optimizer.state[p]["exp_avg"].shape == p.shape and optimizer.state[p]["step"].shape == ()

    init = sd._init_optim_state

    def no_zero_step(optim):  # torch's initialisation returns at once for an optimizer with state
        assert optim.state, "torch's zero-gradient step would run despite the allocated state"
        init(optim)

    monkeypatch.setattr(sd, "_init_optim_state", no_zero_step)
    model_sd, optim_sd = sd.get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": model_sd, "optimizer": optim_sd}, storage_reader=FastFileSystemReader(tmp_path),
                 planner=SafeLoadPlanner(), no_dist=True)
    sd.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    saved_params = dict(saved_model.named_parameters())
    for name, p in by_name.items():
        assert torch.equal(p, saved_params[name]), name
        if p.requires_grad:
            for key, value in saved_opt.state[saved_params[name]].items():
                assert torch.equal(optimizer.state[p][key], value), (name, key)
    # The loaded optimizer steps like the saved one.
    x = torch.randn(4, 6)
    for m, o in ((saved_model, saved_opt), (model, optimizer)):
        m(x).square().sum().backward()
        o.step()
    for name, p in by_name.items():
        assert torch.equal(p, saved_params[name]), f"{name} after a step"


def test_state_of_another_shape_is_left_to_torch(tmp_path):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from hybridpar.fastpaths.optimizer_state import allocate_optimizer_state as _allocate_optimizer_state

    _, _, metadata = _trained(tmp_path)
    # As for a factored optimizer (Adafactor keeps row and column statistics, not a full copy).
    entry = metadata["optimizer.state.0.weight.exp_avg_sq"]
    metadata["optimizer.state.0.weight.exp_avg_sq"] = TensorStorageMetadata(entry.properties, torch.Size([5, 1]),
                                                                           entry.chunks)
    model, optimizer = _fresh()
    _allocate_optimizer_state(model, optimizer, metadata)
    assert not optimizer.state


def test_missing_state_is_left_to_torch(tmp_path):
    from hybridpar.fastpaths.optimizer_state import allocate_optimizer_state as _allocate_optimizer_state

    _, _, metadata = _trained(tmp_path)
    metadata = {k: v for k, v in metadata.items() if not k.startswith("optimizer.state.1.weight.")}
    model, optimizer = _fresh()
    _allocate_optimizer_state(model, optimizer, metadata)
    assert not optimizer.state  # all or nothing: torch's step then finds what is missing
