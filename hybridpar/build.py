"""The one place a model is built: tensor parallelism inside the model, then its weights, float8,
activation checkpointing, compile and FSDP, in the order below.

Training, the dry run, the planner's CPU probe, checkpoint conversion and the benchmark all call
`build_model` (a pipeline stage through hybridpar.pipeline.cutting); what differs between them (device, dtype, FSDP or not, compile, sequence
parallelism, where the weights come from) is a parameter.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from hybridpar.models.args import ModelArgs
from hybridpar.models.llama import Transformer

from .config.low_precision import Float8Config
from .config.sharding import FSDPConfig
from . import progress
from .mesh.device import ParallelDims
from .parallel.float8 import convert_to_float8, emulated_note, experts_note
from .parallel.float8_gather import gather_in_float8, precompute_at_first_forward
from .parallel.fsdp import apply_activation_checkpointing, apply_fsdp, check_compiler, compile_blocks, dp_mesh_for


def build_model(args: ModelArgs, parallel: ParallelDims, *, device: Optional[torch.device] = None,
                dtype: Optional[torch.dtype] = None, sequence_parallel: bool = False,
                load: Optional[Callable[[Transformer], None]] = None, fsdp: Optional[FSDPConfig] = None,
                compile: bool = False, part: Optional[dict] = None,
                float8: Optional[Float8Config] = None) -> Transformer:
    """A Transformer for this rank of `parallel`.

    device "meta" builds without memory (the dry run; or weights loaded after `to_empty`). load(model)
    fills the unsharded model (a checkpoint sliced into it). fsdp None: no FSDP, no activation
    checkpointing, no compile (conversion, generation). compile: torch.compile each block.
    part: build only these pieces of the model (Transformer's layers / embedding / head keywords): a
    pipeline stage, hybridpar.pipeline.cutting' build_stage), with the whole model's
    weights for the same seed. float8: its recipe in the tensor-parallel linears (none: high precision);
    with float8.fsdp_all_gather and FSDP, their weights all-gathered in float8 (parallel.float8_gather).
    """
    if fsdp is not None:
        fsdp.validate()  # bad fsdp.* values and a missing compiler refused before anything is built
        check_compiler(compile, parallel)
    allocate = None
    if part is not None and load is not None and (device is None or torch.device(device).type != "meta"):
        # The checkpoint fills every weight: no draws through the layers of the other stages.
        allocate, device = device if device is not None else parallel.device, torch.device("meta")
    # 1. Tensor parallelism is inside the model: each layer is built as this rank's mp slice, which is
    #    what lets Meta's and fairscale's layouts load one to one. The same seed gives the same weights
    #    at any layout.
    model = Transformer(args, parallel, device=device, dtype=dtype, sequence_parallel=sequence_parallel,
                        **(part or {}))
    if allocate is not None:
        model.to_empty(device=allocate)
    # 2. Weights are sliced into the unsharded model: before FSDP.
    if load is not None:
        load(model)
    # 3. Float8 matmuls in the linears the config does not skip: the parameters keep their values
    #    (with float8.fsdp_all_gather, wrapped for FSDP to gather in float8: before FSDP shards them).
    gathered = fsdp is not None and float8 is not None and float8.enabled and float8.fsdp_all_gather
    if float8 is not None and float8.enabled:
        rehearsal = torch.device(allocate or device or parallel.device).type == "meta"  # the dry run's
        convert_to_float8(model, parallel, float8, device=parallel.device)
        if gathered:
            gather_in_float8(model, dp_mesh_for(fsdp.sharding_strategy, parallel).mesh.shape[-1])
        for note in (emulated_note(parallel.device), experts_note(args.n_experts)):
            if note and not rehearsal and (part is None or part.get("embedding", True)):  # once: rank 0's first stage
                progress.note(note)
    if fsdp is None:
        return model
    # 4. Activation checkpointing: inserts no wrapper module, so parameter names stay Meta's; chosen
    #    by the layer's index in the whole model.
    apply_activation_checkpointing(model.layers, fsdp.activation_checkpointing, fsdp.ac_every)
    # 5. Compile each block: after activation checkpointing, which it then traces; before FSDP, whose
    #    hooks stay outside the compiled code.
    if compile:
        compile_blocks(model)
    # 6. FSDP over the data-parallel dims (on gloo, its collectives as all-to-alls).
    apply_fsdp(model, parallel, fsdp)
    # 7. The float8-gathered weights' scales for the first all-gathers (then each optimizer step's and load's).
    if gathered:
        precompute_at_first_forward(model)
    return model
