"""The planner against published training throughput: each case is a run someone measured and
published, restated as the nearest hybridpar layout on the matching `--gpu` spec
(`hybridpar plan --published` prints the table; docs/planner.md shows it).

Tokens/s per GPU are compared through the trainer's FLOP count where a source gives MFU instead.
"""

from __future__ import annotations

import dataclasses
from hybridpar.models.args import ModelArgs

from .hardware import spec
from .inputs import Layout, Workload
from .search import Estimate, estimate


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

CASES = [
    # Table 1: Llama 3.1 8B, FSDP on 8 GPUs, local batch 2 x 8192, selective AC (torchtitan's per-op
    # policy recomputes every second matmul: about what checkpointing every second block costs).
    Published("Llama 3.1 8B, FSDP 8", TORCHTITAN_H100, "llama3.1_8b", "h100-500w", 8,
              Layout(1, 8, 1, "selective", 2), Workload(seq_len=8192, micro_batch=2), tokens_per_s_per_gpu=5762),
    Published("Llama 3.1 8B, FSDP 8, compiled", TORCHTITAN_H100, "llama3.1_8b", "h100-500w", 8,
              Layout(1, 8, 1, "selective", 2), Workload(seq_len=8192, micro_batch=2, compile=True),
              tokens_per_s_per_gpu=6667),
    # Table 3: the same at 128 GPUs, global batch 256.
    Published("Llama 3.1 8B, FSDP 128", TORCHTITAN_H100, "llama3.1_8b", "h100-500w", 128,
              Layout(1, 128, 1, "selective", 2), Workload(seq_len=8192, micro_batch=2), tokens_per_s_per_gpu=5605),
    # Table 4: Llama 3.1 70B, FSDP 32 x TP 8 on 256 GPUs, local batch 16 (global 512), full AC,
    # torch.compile and Float8 linears; 876 with asynchronous TP.
    Published("Llama 3.1 70B, FSDP 32 x TP 8", TORCHTITAN_H100, "llama3.1_70b", "h100-500w", 256,
              Layout(8, 32, 1, "full"), Workload(seq_len=8192, micro_batch=16, compile=True),
              tokens_per_s_per_gpu=829,
              missing="Float8 matmuls (torchtitan measured 1.28x from Float8 on the 8B)"),
    # The same table with asynchronous TP: its collectives hidden behind the matmuls.
    Published("Llama 3.1 70B, FSDP 32 x TP 8, async TP", TORCHTITAN_H100, "llama3.1_70b", "h100-500w", 256,
              Layout(8, 32, 1, "full"), Workload(seq_len=8192, micro_batch=16, compile=True, async_tp=True),
              tokens_per_s_per_gpu=876, missing="Float8 matmuls"),
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
              Workload(seq_len=8192, micro_batch=4, global_batch=256, compile=True, async_tp=True),
              tokens_per_s_per_gpu=100, missing="Float8 matmuls"),
    Published("Llama 3.1 405B, PP 8 interleaved", TORCHTITAN_405B, "llama3.1_405b", "h100-500w", 512,
              Layout(8, 8, 1, "full", pp=8, pp_schedule="Interleaved1F1B", v=2),
              Workload(seq_len=8192, micro_batch=4, global_batch=256, compile=True, async_tp=True),
              tokens_per_s_per_gpu=128, missing="Float8 matmuls"),
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
    out = [f"{'published run':<40} {'gpu':<10} {'layout':<35} {'published':>10} {'planned':>8} {'error':>6}"]
    for r in rows:
        lay = r.case.layout
        pp = f"pp{lay.pp}{'v' + str(lay.v) if lay.v > 1 else ''} x " if lay.pp > 1 else ""
        cp = f"cp{lay.cp} x " if lay.cp > 1 else ""
        layout = f"{pp}{cp}mp{lay.mp} x {lay.dp_shard}x{lay.dp_replicate}, AC {lay.ac}"
        out.append(f"{r.case.name:<40} {r.case.gpu:<10} {layout:<35} {r.published:>10,.0f} {r.planned:>8,.0f} "
                   f"{100 * r.error:>+5.0f}%")
    out.append("tokens/s per GPU; not modelled where it applies:")
    out.extend(f"  {r.case.name}: {r.case.missing}" for r in rows if r.case.missing)
    out.append("sources:")
    out.extend(f"  {s}" for s in dict.fromkeys(r.case.source for r in rows))
    return "\n".join(out)
