"""The planner against published training throughput: each case is a run someone measured and
published, restated as the nearest hybridpar layout on the matching `--gpu` spec
(`hybridpar plan --published` prints the table; docs/planner.md shows it).

Tokens/s per GPU are compared through the trainer's FLOP count where a source gives MFU instead.
Nothing here is fitted to a row: the GPUs' figures are hardware.py's and every row is priced by the
same model. A row beyond TOLERANCE says why (Published.why), and the table prints it.
"""

from __future__ import annotations

import dataclasses
from hybridpar.models.args import ModelArgs

from .hardware import spec
from .inputs import Layout, Workload
from .search import Estimate, estimate


TOLERANCE = 0.15  # the planned tokens/s within 15% of the published figure, or the row says why not


@dataclasses.dataclass(frozen=True)
class Published:
    name: str
    source: str
    model: str  # a preset
    gpu: str  # a hardware.GPUS name
    gpus: int
    layout: Layout
    workload: Workload
    tokens_per_s_per_gpu: float = 0.0  # as published
    mfu: float = 0.0  # as published, when the source gives MFU instead of tokens/s
    missing: str = ""  # what the published run has that hybridpar (and so the estimate) does not
    why: tuple[str, ...] = ()  # why the estimate lies beyond TOLERANCE of it, where it does: what the model lacks
    baseline: str = ""  # the row this one adds float8 or async TP to: the table prints the gain, planned and published

    def estimate(self) -> Estimate:
        hw = spec(self.gpu, self.gpus)
        return estimate(ModelArgs.from_preset(self.model), self.layout, self.workload, hw)

    def published_tokens_per_s(self) -> float:
        if self.tokens_per_s_per_gpu:
            return self.tokens_per_s_per_gpu
        args = ModelArgs.from_preset(self.model)
        return self.mfu * spec(self.gpu, self.gpus).peak_flops / args.flops_per_token(self.workload.seq_len)


TORCHTITAN_H100 = ("torchtitan docs/performance.md (Dec 2024: torch 1963fc8, torchtitan 9dec370), Grand Teton "
                   "H100 96 GB HBM2e at 500 W, 400 Gb/s per GPU")
TORCHTITAN_405B = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md, table 5 (torchtitan 9dec370): 512 "
                   "Grand Teton H100 at 500 W, FSDP 8 x TP 8 x PP 8, local batch 32, compile, Float8, async TP")
TORCHTITAN_A100 = "torchtitan docs/performance.md (mid 2024), 64 A100 80 GB, FSDP2"
LLAMA3_PAPER = ("The Llama 3 Herd of Models (Meta, 2024), table 4: 16,384 H100 80 GB at 700 W, "
                "TP 8 x CP 1 x PP 16 x DP 128, 400 TFLOP/s per GPU; at 131,072 tokens TP 8 x CP 16 x PP 16 x DP 8, "
                "380 TFLOP/s")

# Why rows on Grand Teton lie beyond TOLERANCE: what the planner cannot know about that card or the torch
# of Dec 2024 (none is tuned away: a constant fitted to these rows would hide it).
OVER_500W = ("the 500 W card's clock under dense matmuls: every row on it is over, the bf16 ones without float8, "
             "async TP or stages too; hardware.py reads the capped clock off the datasheets' line from the NVL "
             "(835 TFLOP/s at 400 W) to the SXM (989 at 700 W), 886/989 at 500 W, inside the bounds torchtitan's "
             "note gives it, and no one has measured it on this card")
OVER_FLOAT8 = ("float8 matmuls at the same fraction of the float8 peak as bf16's of theirs (torchao's roofline "
               "assumes one): on top of the bf16 row's over-estimate, float8's gain is priced above torchtitan's")
OVER_ASYNC_TP = ("async TP in Dec 2024's torch: torchtitan measured 1.06x from it on the 70B then (829 -> 876); on "
                 "the same cluster and 70B configuration in June 2025, 1.16x (809.8 -> 942.4, torchtitan's "
                 "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md), what the planner prices: each forward "
                 "collective hidden behind its own matmuls")

# torchtitan's Float8 (Dec 2024): torchao's dynamic tensorwise scaling, the weights all-gathered in float8
# (its docs/float8.md runs --float8.enable_fsdp_float8_all_gather), the output head left in bf16.
FLOAT8 = dict(float8="tensorwise", float8_all_gather=True)

CASES = [
    # Table 1: Llama 3.1 8B, FSDP on 8 GPUs, local batch 2 x 8192, selective AC (torchtitan's per-op
    # policy recomputes every second matmul: about what checkpointing every second block costs).
    Published("Llama 3.1 8B, FSDP 8", TORCHTITAN_H100, "llama3.1_8b", "h100-500w", 8,
              Layout(1, 8, 1, "selective", 2), Workload(seq_len=8192, micro_batch=2), tokens_per_s_per_gpu=5762),
    Published("Llama 3.1 8B, FSDP 8, compiled", TORCHTITAN_H100, "llama3.1_8b", "h100-500w", 8,
              Layout(1, 8, 1, "selective", 2), Workload(seq_len=8192, micro_batch=2, compile=True),
              tokens_per_s_per_gpu=6667),
    Published("Llama 3.1 8B, FSDP 8, compiled, Float8", TORCHTITAN_H100, "llama3.1_8b", "h100-500w", 8,
              Layout(1, 8, 1, "selective", 2), Workload(seq_len=8192, micro_batch=2, compile=True, **FLOAT8),
              tokens_per_s_per_gpu=8532, why=(OVER_500W, OVER_FLOAT8),
              baseline="Llama 3.1 8B, FSDP 8, compiled"),
    # Table 3: the same at 128 GPUs, global batch 256.
    Published("Llama 3.1 8B, FSDP 128", TORCHTITAN_H100, "llama3.1_8b", "h100-500w", 128,
              Layout(1, 128, 1, "selective", 2), Workload(seq_len=8192, micro_batch=2), tokens_per_s_per_gpu=5605),
    Published("Llama 3.1 8B, FSDP 128, compiled, Float8", TORCHTITAN_H100, "llama3.1_8b", "h100-500w", 128,
              Layout(1, 128, 1, "selective", 2), Workload(seq_len=8192, micro_batch=2, compile=True, **FLOAT8),
              tokens_per_s_per_gpu=8380),
    # Table 4: Llama 3.1 70B, FSDP 32 x TP 8 on 256 GPUs, local batch 16 (global 512), full AC,
    # torch.compile and Float8 linears; 876 with asynchronous TP.
    Published("Llama 3.1 70B, FSDP 32 x TP 8", TORCHTITAN_H100, "llama3.1_70b", "h100-500w", 256,
              Layout(8, 32, 1, "full"), Workload(seq_len=8192, micro_batch=16, compile=True, **FLOAT8),
              tokens_per_s_per_gpu=829),
    # The same table with asynchronous TP: the forward's collectives hidden behind their matmuls (plan.async_tp).
    Published("Llama 3.1 70B, FSDP 32 x TP 8, async TP", TORCHTITAN_H100, "llama3.1_70b", "h100-500w", 256,
              Layout(8, 32, 1, "full"), Workload(seq_len=8192, micro_batch=16, compile=True, async_tp=True, **FLOAT8),
              tokens_per_s_per_gpu=876, why=(OVER_500W, OVER_ASYNC_TP), baseline="Llama 3.1 70B, FSDP 32 x TP 8"),
    # Table 4 of the paper: 405B on 16,384 GPUs, 16M-token batches of 8192-token sequences (16 per
    # data-parallel rank: 16 micro-batches), 41% MFU. Section 3.3.2: the first stage's first chunk holds
    # only the embedding and the last stage's last only the output: one layer per chunk, (126 + 2) / 16
    # = 8 chunks (virtual stages) per rank, interleaved. Full AC: the planner's fitting choice.
    Published("Llama 3 405B, 16,384 GPUs", LLAMA3_PAPER, "llama3.1_405b", "h100", 16384,
              Layout(8, 128, 1, "full", pp=16, pp_schedule="Interleaved1F1B", v=8),
              Workload(seq_len=8192, micro_batch=1, global_batch=2048), mfu=0.41),
    # The same table's long-context row: 131,072-token sequences, TP 8 x CP 16 x PP 16 x DP 8, 16M-token
    # batches (16 sequences per data-parallel rank: 16 micro-batches), 380 TFLOP/s per GPU, 38% MFU; the
    # stages as in the row above.
    Published("Llama 3 405B, 128k context", LLAMA3_PAPER, "llama3.1_405b", "h100", 16384,
              Layout(8, 8, 1, "full", cp=16, pp=16, pp_schedule="Interleaved1F1B", v=8),
              Workload(seq_len=131072, micro_batch=1, global_batch=128), mfu=0.38),
    # torchtitan's 405B table: local batch 32 in torchtitan's default of pp micro-batches (8 of 4
    # sequences), two stages per rank when interleaved (its generate_split_points).
    Published("Llama 3.1 405B, PP 8 1F1B", TORCHTITAN_405B, "llama3.1_405b", "h100-500w", 512,
              Layout(8, 8, 1, "full", pp=8, pp_schedule="1F1B"),
              Workload(seq_len=8192, micro_batch=4, global_batch=256, compile=True, async_tp=True, **FLOAT8),
              tokens_per_s_per_gpu=100, why=(OVER_500W, OVER_FLOAT8, OVER_ASYNC_TP)),
    Published("Llama 3.1 405B, PP 8 interleaved", TORCHTITAN_405B, "llama3.1_405b", "h100-500w", 512,
              Layout(8, 8, 1, "full", pp=8, pp_schedule="Interleaved1F1B", v=2),
              Workload(seq_len=8192, micro_batch=4, global_batch=256, compile=True, async_tp=True, **FLOAT8),
              tokens_per_s_per_gpu=128, why=(OVER_500W, OVER_FLOAT8, OVER_ASYNC_TP)),
    # The A100 tables (Llama 3 8B and 70B, local batch 1 x 8192 on 64 GPUs).
    Published("Llama 3 8B, FSDP 64", TORCHTITAN_A100, "llama3_8b", "a100", 64,
              Layout(1, 64, 1, "selective", 2), Workload(seq_len=8192, micro_batch=1), tokens_per_s_per_gpu=2973),
    Published("Llama 3 70B, FSDP 64", TORCHTITAN_A100, "llama3_70b", "a100", 64,
              Layout(1, 64, 1, "full"), Workload(seq_len=8192, micro_batch=1), tokens_per_s_per_gpu=331),
]


@dataclasses.dataclass(frozen=True)
class Row:
    case: Published
    published: float  # tokens/s per GPU
    planned: float

    @property
    def error(self) -> float:
        return self.planned / self.published - 1


def compare(cases=CASES) -> list[Row]:
    rows = []
    for case in cases:
        rows.append(Row(case, case.published_tokens_per_s(), case.estimate().tokens_per_s_per_gpu))
    return rows


def format_table(rows: list[Row]) -> str:
    out = [f"{'published run':<40} {'gpu':<10} {'layout':<35} {'published':>10} {'planned':>8} {'ratio':>6} "
           f"{'error':>6}"]
    for r in rows:
        lay = r.case.layout
        pp = f"pp{lay.pp}{'v' + str(lay.v) if lay.v > 1 else ''} x " if lay.pp > 1 else ""
        cp = f"cp{lay.cp} x " if lay.cp > 1 else ""
        layout = f"{pp}{cp}mp{lay.mp} x {lay.dp_shard}x{lay.dp_replicate}, AC {lay.ac}"
        beyond = " *" if abs(r.error) > TOLERANCE else ""
        out.append(f"{r.case.name:<40} {r.case.gpu:<10} {layout:<35} {r.published:>10,.0f} {r.planned:>8,.0f} "
                   f"{r.planned / r.published:>6.2f} {100 * r.error:>+5.0f}%{beyond}")
    out.append(f"tokens/s per GPU; ratio = planned / published; * beyond {100 * TOLERANCE:.0f}%, and why:")
    beyond = [r for r in rows if abs(r.error) > TOLERANCE]
    for reason in dict.fromkeys(why for r in beyond for why in r.case.why or ("no reason recorded",)):
        names = [r.case.name for r in beyond if reason in (r.case.why or ("no reason recorded",))]
        out.append(f"  {'; '.join(names)}: {reason}")
    named = {r.case.name: r for r in rows}
    for r in (r for r in rows if r.case.baseline in named):
        base = named[r.case.baseline]
        added = "float8" if r.case.workload.float8 != base.case.workload.float8 else "async TP"
        out.append(f"{added}'s gain, {r.case.name} over {base.case.name}: planned {r.planned / base.planned:.2f}x, "
                   f"published {r.published / base.published:.2f}x")
    if any(r.case.missing for r in rows):
        out.append("not modelled where it applies:")
        out.extend(f"  {r.case.name}: {r.case.missing}" for r in rows if r.case.missing)
    out.append("sources:")
    out.extend(f"  {s}" for s in dict.fromkeys(r.case.source for r in rows))
    return "\n".join(out)
