"""The CUDA paths no CPU test reaches, on one GPU at world 1 with nccl (issue 40):

    python -m pytest -m gpu tests/gpu -q -rs      # bench/gpu/first_light.sh runs it on the card

Without CUDA every test here is skipped with one reason. HYBRIDPAR_GPU_TESTS_DEVICE=cpu runs the
same bodies on the CPU with gloo (the assertions only a GPU can meet are left out), to check the
tests themselves before a GPU session spends its minutes on them. The bodies are in cases.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.gpu import cases
from tests.runs import GLOBAL_BATCH
from tests.distributed import child_pythonpath

ROOT = Path(__file__).resolve().parents[2]
DEVICE = os.environ.get("HYBRIDPAR_GPU_TESTS_DEVICE", "cuda")
CUDA = DEVICE == "cuda"
TRAIN_TIMEOUT = 4.0
REPORT_WITHIN = TRAIN_TIMEOUT + 15.0  # the watchdog's bound (tests/diagnostics/test_watchdog.py's)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(CUDA and not torch.cuda.is_available(),
                       reason="no CUDA device: the tests marked gpu run in bench/gpu/first_light.sh on a GPU machine"),
]


@pytest.fixture(scope="module")
def parallel():
    """World 1 in this process: nccl on the GPU (gloo for the CPU rehearsal)."""
    import torch.distributed as dist

    parallel = cases.process_group(DEVICE)
    yield parallel
    dist.destroy_process_group()


def test_bf16_logits_on_cuda_match_fp32_on_cpu(parallel):
    error = cases.bf16_logits_error(parallel, DEVICE)
    print(f"\nbf16 logits on {DEVICE} against fp32 on the CPU, same weights: relative error {error:.2e} "
          f"(bound {cases.BF16_LOGITS_BOUND:g})")
    assert error <= cases.BF16_LOGITS_BOUND
    assert error > 0 or not CUDA, "bf16 gave fp32's logits exactly: the model did not compute in bf16"


def test_attention_runs_a_fused_kernel_not_the_math_fallback(parallel):
    sdpa, kernels = cases.attention_ops(parallel, DEVICE)
    fused = sorted(k for k in kernels if cases.FUSED.search(k))
    print(f"\nattention ops: {sorted(sdpa)}\n{len(kernels)} GPU kernels, fused attention ones: "
          f"{[k[:100] for k in fused[:4]]}")
    assert sdpa, "no scaled_dot_product_attention op in the profile: is the profiler looking at the model?"
    assert cases.MATH not in sdpa, f"the math fallback ran: {sorted(sdpa)}"
    if CUDA:
        assert any(cases.FUSED.search(n) for n in sdpa - {"aten::scaled_dot_product_attention"}), sorted(sdpa)
        if kernels:  # CUPTI recorded the kernels (a profiler without it sees the ops above only)
            assert fused, f"no flash / efficient / fmha / cutlass / cudnn kernel among {sorted(kernels)[:20]}"
            assert not [k for k in kernels if cases.MATH_KERNELS.search(k)], "a softmax kernel ran: the math path"
    cases.fused_attention_only(parallel, DEVICE)  # raises "No available kernel" if neither fits


def test_gather_to_on_the_device_gives_the_full_tensor(parallel):
    assert cases.gather_to_matches(parallel, DEVICE) == 21  # 2 blocks x 9, embedding, norm, output


def test_the_loader_pins_memory_and_the_batch_arrives_equal():
    pinned, equal = cases.loaded_batch(DEVICE)
    assert pinned == CUDA  # pin_memory defaults to torch.cuda.is_available() (data/loader.py)
    assert equal


def test_the_measured_matmul_rate_is_the_cards(parallel):
    """The trainer's fallback for a card of unknown name: bf16 8192^2 matmuls timed on the card,
    averaged over ranks on the device (nccl reduces GPU tensors only). Above the datasheet's peak
    would mean the clock stopped before the GPU finished (no synchronize)."""
    from types import SimpleNamespace

    from hybridpar.plan.hardware import peak_flops_of
    from hybridpar.train.trainer import Trainer

    rate = Trainer._measure_peak(SimpleNamespace(device=parallel.device))
    name = torch.cuda.get_device_name() if CUDA else "this CPU"
    nominal = peak_flops_of(name) if CUDA else None
    print(f"\nmeasured matmul rate on {name}: {rate / 1e12:.1f} TFLOP/s"
          + (f", {rate / nominal:.2f} of the datasheet's {nominal / 1e12:.0f}" if nominal else ""))
    assert rate > (1e13 if CUDA else 1e8)
    if nominal:
        assert 0.3 * nominal < rate <= 1.05 * nominal


# --- a training job in a fresh process (tests/gpu/job.py) ---------------------------------------

def _job(corpus, run_dir: Path, mode: str, **overrides) -> tuple[subprocess.CompletedProcess, float]:
    """job.py in MODE with tests/runs.py's small model and data; train.peak_flops 0: MFU against the card."""
    flags = {
        "model.preset": "debug", "model.vocab_size": 512, "parallel.backend": "nccl" if CUDA else "gloo",
        "fsdp.sharding_strategy": "full_shard", "fsdp.param_dtype": "bfloat16" if CUDA else "float32",
        "data.source": corpus["source"], "data.cache_dir": corpus["cache_dir"], "data.tokenizer_vocab_size": 512,
        "data.seq_len": 32, "data.micro_batch_size": GLOBAL_BATCH, "train.log_every": 1, "train.peak_flops": 0,
        "output.run_dir": str(run_dir), "output.tensorboard": False, "output.plot": False,
        "checkpoint.at_end": False, **overrides,
    }
    # A fresh world of one: none of this process's rendezvous (the `parallel` fixture's port) leaks in.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "NCCL_DEBUG")
           and not k.startswith(("TORCH_FR", "TORCH_NCCL"))}  # the tracing variables: hybridpar's defaults
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=child_pythonpath())
    start = time.time()
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "job.py"), mode, json.dumps(flags)],
                            capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    return result, start


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gpu_run") / "run"
    result, _ = _job(corpus, run_dir, "run", **{"train.steps": 3})
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert result.returncode == 0 and line, f"the job failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return {**json.loads(line[len("RESULT "):]), "stderr": result.stderr, "run_dir": run_dir}


@pytest.mark.slow  # a training job in a fresh process (once for the three)
def test_cuda_memory_is_in_every_steps_metrics(trained):
    memory = trained["memory_gb"]
    print(f"\nmemory_gb per step {memory}, CUDA's peak allocation {trained['cuda_max_allocated_gb']} GB")
    assert len(memory) == 3 and all(m > 0 for m in memory)
    if CUDA:  # torch.cuda.max_memory_allocated, not the process's resident set
        assert 0.9 * trained["cuda_max_allocated_gb"] <= memory[-1] <= trained["cuda_max_allocated_gb"]


@pytest.mark.slow  # a training job in a fresh process (once for the three)
def test_mfu_is_against_the_cards_named_or_measured_peak(trained):
    said = [ln for ln in trained["stderr"].splitlines() if ln.startswith("MFU against")]
    print(f"\n{said}, peak {trained['peak_flops']:.3g}")
    assert trained["peak_flops"] > 0 and all(0 < m < 1 for m in trained["mfu"])
    if CUDA:
        from hybridpar.plan.hardware import peak_flops_of

        name = torch.cuda.get_device_name()
        assert len(said) == 1 and name in said[0], said
        if peak_flops_of(name) is not None:
            assert trained["peak_flops"] == peak_flops_of(name)


@pytest.mark.slow  # a training job in a fresh process (once for the three)
def test_the_flight_recorder_settings_are_set_before_the_process_group(trained):
    env = trained["env_at_init"]
    trace_file = str(trained["run_dir"] / "flight_recorder" / "flight_recorder_rank_")
    assert env == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_DEBUG": "WARN",
                   "TORCH_FR_DUMP_TEMP_FILE": trace_file}, env
    assert trained["backend"] == ("nccl" if CUDA else "gloo") and trained["device"].startswith(DEVICE)
    recorded = trained["recorded"]
    prefix = "nccl:" if CUDA else "gloo:"
    ours = recorded["hybridpar"]
    print(f"\nhybridpar's dump: {len(ours)} entries; NCCL's recorder: "
          f"{len(recorded['nccl']) if 'nccl' in recorded else 'absent'}")
    # The recorder is on (TORCH_FR_BUFFER_SIZE) and hybridpar's dump, what the watchdog and
    # hang-report read, holds this backend's collectives.
    assert isinstance(ours, list) and any(str(n).startswith(prefix) for n in ours), \
        f"hybridpar's flight-recorder dump holds no {prefix} collective: {str(ours)[:300]}; NCCL's own: " \
        f"{str(recorded.get('nccl'))[:300]}"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_stalled_rank_gets_the_watchdogs_hang_report_at_world_1(corpus, tmp_path):
    from hybridpar.diagnostics.heartbeat import HANG_EXIT_CODE

    run_dir = tmp_path / "run"
    result, start = _job(corpus, run_dir, "stall", **{"train.steps": 6,
        "diagnostics.train_timeout": TRAIN_TIMEOUT, "diagnostics.watchdog_interval": 0.25})
    stalled = re.search(r"STALL on rank 0 at ([\d.]+)", result.stderr)
    assert stalled, f"the stall never happened:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    report_path = run_dir / "hang_report.json"
    assert report_path.exists(), f"no report:\n{result.stderr[-4000:]}"
    delay = report_path.stat().st_mtime - float(stalled.group(1))
    report = json.loads(report_path.read_text())
    text = result.stderr[result.stderr.index("hybridpar watchdog"):]
    print(f"\nreport {delay:.1f} s after the stall (bound {REPORT_WITHIN:g} s), job {time.time() - start:.0f} s\n"
          + "\n".join(text.splitlines()[:6]))
    assert result.returncode == HANG_EXIT_CODE
    assert delay <= REPORT_WITHIN
    from tests.gpu.job import STALL_STEP

    assert report["step"] == STALL_STEP and report["reason"].startswith("no progress"), report["reason"]
    # Alone in the world there is no peer to compare with: the report places rank 0 at its line.
    rank = report["ranks"]["0"]
    assert rank["where"].startswith("tests/gpu/job.py:") and rank["where"].endswith(" in all_reduce"), rank
    assert rank["step"] == STALL_STEP and rank["waiting_in"] == [], rank
