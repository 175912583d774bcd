"""Plan a layout before asking for GPUs: per-rank memory and step time of every (pp, mp, cp, dp_shard,
dp_replicate, AC) layout, best first (`hybridpar plan`; docs/planner.md). Context parallelism (cp)
is considered when a sequence's activations need it (search.context_parallel_needed), pipeline
stages (pp) when nothing fits without them (pipeline_cost: the bubble, micro-batches in flight, P2P).

Arithmetic on the model's shape, derived from what hybridpar's code keeps, runs and sends: the
fp32 state FSDP2 shards, gathered compute-dtype parameters, gradient buffers and the unsharded
gradients kept between accumulation micro-batches, the activations models/llama.py saves; the
matmul, attention and memory-bound work of a step, each at the hardware's sustained rate; and the
collectives (tensor-parallel ones on the critical path, FSDP's overlapping compute).
tests/test_plan.py checks the state, activation, accumulated-gradient and collective bytes and
calls, the FLOPs and the op counts against the real model on CPU, and the step time against
published GPU runs (published.py); bench/planner.py checks it against bench/run.py on this CPU;
tests/test_plan_context.py checks context parallelism's terms and the attention bytes it keeps;
tests/test_plan_pipeline.py pipeline parallelism's terms and the published pipelined runs.
Workload.float8 prices float8 training (plan.compute: the linears at the float8 rate, their casts;
tests/test_plan_float8.py). The memory is what a GPU holds: the tensors, each counted as alive at
once, plus the caching allocator's reserve on top (Hardware.allocator_overhead, measured on an H200).
The compute FSDP's collectives overlap runs on the SMs NCCL's kernels leave (Hardware.sms,
comm.overlapped). Not modelled: NCCL's latency.

inputs: Layout, Workload, Hardware. hardware: named GPUs; cpu: this machine, measured. memory:
parameters, activations, Memory. compute: the kernels' work. comm: collective bytes, calls and
times. async_tp: torch's asynchronous TP, for published runs. pipeline_cost: pp's stages, bubble and
in-flight micro-batches. layouts: candidate_layouts, the sizes each dimension may take. search: estimate,
make_plan. report: the text. published: the check.
"""

from ..config.dtypes import dtype_bytes
from ..config.sharding import AC_MODES
from .comm import (CommBytes, StepTime, all_gather_seconds, all_reduce_seconds, collective_bytes, flops_per_token,
                   group_busbw)
from .inputs import GIB, MASTER_BYTES, Hardware, Layout, Workload
from .memory import (Activations, Memory, ParamCounts, activation_bytes, kv_heads_per_rank, local_param_shapes,
                     param_counts)
from .report import breakdown, config_flags, format_plan, no_fit_message, parse_global_batch, plan_json
from .layouts import candidate_layouts, divisors
from .search import Estimate, Plan, estimate, make_plan

__all__ = [
    "AC_MODES", "GIB", "MASTER_BYTES", "dtype_bytes",
    "Layout", "Workload", "Hardware",
    "kv_heads_per_rank", "local_param_shapes", "ParamCounts", "param_counts", "Activations", "activation_bytes",
    "Memory", "StepTime", "CommBytes", "flops_per_token", "group_busbw", "all_reduce_seconds", "all_gather_seconds",
    "collective_bytes", "Estimate", "estimate", "divisors", "candidate_layouts", "Plan", "make_plan",
    "parse_global_batch", "breakdown", "config_flags", "format_plan", "no_fit_message", "plan_json",
]
