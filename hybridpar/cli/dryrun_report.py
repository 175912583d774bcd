"""What `hybridpar train --dry-run` found (hybridpar.cli.dryrun runs the rehearsal), and its report."""

from __future__ import annotations

import dataclasses

from ..files import human_bytes


@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    detail: str
    warning: bool = False  # passed, with something to look at (e.g. data this machine cannot see)


@dataclasses.dataclass
class DryRun:
    """What the rehearsal found; `text()` is the report."""

    world: int
    rank: int
    target: str  # "gpu" or "cpu"
    layout: str = ""
    pp: int = 1  # pipeline stages' ranks: the state's ideal share divides by pp too
    model: str = ""
    checks: list[Check] = dataclasses.field(default_factory=list)
    parameters: list[dict] = dataclasses.field(default_factory=list)  # one row per group of alike parameters
    state_bytes: dict = dataclasses.field(default_factory=dict)  # parameters, gradients, optimizer (this rank)
    expected_bytes: dict = dataclasses.field(default_factory=dict)  # the same, total / (pp x mp x dp_shard)
    collectives: list[dict] = dataclasses.field(default_factory=list)  # per (dim, op): calls, payload, wire
    memory: dict = dataclasses.field(default_factory=dict)  # the planner's estimate for this layout
    checkpoint: dict = dataclasses.field(default_factory=dict)
    routing: str = ""  # a mixture of experts': how the rehearsal routed the tokens (hybridpar.cli.dryrun)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(c.ok or c.warning for c in self.checks)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "ok": self.ok}

    def text(self) -> str:
        return report(self)


def report(run: DryRun) -> str:
    lines = [f"dry run of rank {run.rank} of {run.world} ({'GPU' if run.target == 'gpu' else 'CPU'} job): "
             f"{run.model or '?'}; {run.layout or '?'}"]
    if run.parameters:
        lines.append("")
        lines.append("parameters (this rank's shards):")
        width = max(len(_row_name(r)) for r in run.parameters)
        for r in run.parameters:
            lines.append(f"  {_row_name(r):<{width}}  {_shape(r['global_shape']):>14} -> {_shape(r['local_shape']):<14}"
                         f"  {r['dtype']:<8} {r['placement']}")
    if run.state_bytes:
        lines.append("")
        lines.append(f"state on this rank (float32; ideal = the model's state / ({'pp x ' if run.pp > 1 else ''}mp x dp_shard)):")
        for key in ("parameters", "gradients", "optimizer"):
            have, ideal = run.state_bytes[key], run.expected_bytes[key]
            lines.append(f"  {key:<11} {human_bytes(have):>10}   ideal {human_bytes(ideal):>10}   {have / ideal:.3f}x")
        total = sum(run.state_bytes.values())
        ideal = sum(run.expected_bytes.values())
        lines.append(f"  {'total':<11} {human_bytes(total):>10}   ideal {human_bytes(ideal):>10}   {total / ideal:.3f}x")
    if run.collectives:
        lines.append("")
        lines.append("collectives of one training step on this rank (issued by the real code, counted):")
        lines.append(f"  {'dimension':<13} {'collective':<15} {'ranks':>5} {'calls':>6} {'payload':>11} {'sent':>11}")
        for r in run.collectives:
            lines.append(f"  {r['dim']:<13} {r['op']:<15} {r['group_size']:>5} {r['calls']:>6} "
                         f"{human_bytes(r['payload']):>11} {human_bytes(r['wire']):>11}")
    if run.memory:
        m = run.memory
        lines.append("")
        float8 = ""
        if m.get("float8", "none") != "none":  # priced by the planner: the weights FSDP gathers in float8
            float8 = f", float8 {m['float8']}" + (", its linears' weights gathered in 1 byte" if m["float8_gathered"]
                                                  else "")
        lines.append(f"memory per rank (the planner's estimate for a step{float8}): activations "
                     f"{human_bytes(m['activations'])}, "
                     f"gathered parameters {human_bytes(m['gathered_params'])}, gradient buffers "
                     f"{human_bytes(m['grad_buffers'])}, working space {human_bytes(m['transient'])}"
                     + (f", the allocator's reserve {human_bytes(m['allocator'])}" if m.get("allocator") else "")
                     + f"; peak {human_bytes(m['total'])} with the state")
        if "experts_per_rank" in m:
            lines.append(experts_line(run))
        if "step_s" in m:
            ep = f", all-to-all {m['all_to_all_s']:.2f} s" if m.get("all_to_all_bytes") else ""
            lines.append(f"time per step (the planner, on {m['gpu']}; hybridpar plan --gpu says what it assumes): "
                         f"{m['step_s']:.2f} s, of which tensor-parallel {m['tp_s']:.2f} s{ep} and exposed FSDP "
                         f"{m['fsdp_exposed_s']:.2f} s; {m['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, "
                         f"MFU {100 * m['mfu']:.0f}%")
    if run.checkpoint:
        k = run.checkpoint
        lines.append("")
        lines.append(f"checkpoint: {k['folder']} about {human_bytes(k['total'])} in {k['files']} files, "
                     f"{human_bytes(k['per_rank_file'])} per rank's file: {', '.join(k['layout'])}")
    lines.append("")
    lines.append("checks:")
    for check in run.checks:
        status = "ok  " if check.ok else "warn" if check.warning else "FAIL"
        lines.append(f"  {status} {check.name}: {check.detail}")
    lines.append(f"dry run {'passed' if run.ok else 'FAILED'} in {run.seconds:.0f} s")
    return "\n".join(lines)


def routing_text(args, tokens: int, ep: int) -> str:
    """How a rehearsal routes a mixture of experts' `tokens` per micro-batch (models.moe.balance_routing)."""
    slots = tokens * args.experts_per_token
    return (f"balanced (fake tensors have no values to route by): each of the {args.n_experts} experts gets "
            f"{slots / args.n_experts:g} of a micro-batch's {slots} token slots (tokens x top-k {args.experts_per_token})"
            + (" from every ep rank" if ep > 1 else "") + f"; {args.n_experts // ep} experts per ep rank (ep {ep})")


def experts_line(run: DryRun) -> str:
    """A mixture of experts' rehearsal: its routing, the experts this rank holds, and the all-to-alls,
    planned and as the step issued them."""
    m = run.memory
    counted = sum(r["payload"] for r in run.collectives if r["dim"] == "ep" and r["op"] == "all_to_all")
    line = (f"experts (routing {run.routing}): this rank holds {m['experts_per_rank']} of each MoE layer's experts, "
            f"{human_bytes(m['expert_state'])} of float32 parameters, gradients and AdamW state (the planner)")
    if not m["all_to_all_bytes"]:
        return line + "; no all-to-all at ep 1"
    return (line + f"; all-to-all per step {human_bytes(m['all_to_all_bytes'])} planned, {human_bytes(counted)} issued "
            f"(dispatch and combine, forward and backward), {100 * m['all_to_all_leaving']:.0f}% of it leaving the rank"
            + (f": {m['all_to_all_s']:.2f} s on {m['gpu']}" if "all_to_all_s" in m else ""))


def _row_name(row: dict) -> str:
    layers = row["layers"]
    if not layers:
        return row["name"]
    return f"{row['name']} ({len(layers)} layers)"


def _shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"
