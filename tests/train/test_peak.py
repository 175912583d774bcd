"""MFU's denominator without train.peak_flops: a GPU's dense bf16 peak read from its name
(plan/hardware.py's one table), a measured matmul rate with a line saying so for a card not in
it, and the trainer starts on a GPU without being told the card."""

import pytest
import torch

from hybridpar.plan.hardware import DENSE_BF16_PEAKS, GPUS, peak_flops_of
from hybridpar.train import throughput

# What torch.cuda.get_device_name() says on these cards, and their datasheet dense bf16 peaks.
NAMES = {
    "NVIDIA H100 80GB HBM3": 989e12,  # the SXM board
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,
    "NVIDIA H200 NVL": 836e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA B200": 2.25e15,
    "NVIDIA GB200": 2.5e15,
    "NVIDIA L4": 121e12,
    "NVIDIA L40S": 362e12,
    "NVIDIA A10": 125e12,
    "AMD Instinct MI300X": 1307.4e12,
    "Tesla T4": None,  # not in the table: measured
    "NVIDIA A10G": None,  # not the A10
    "NVIDIA GeForce RTX 4090": None,
}


@pytest.mark.parametrize("name", list(NAMES))
def test_a_cards_peak_is_read_from_its_name(name):
    assert peak_flops_of(name) == NAMES[name]


def test_the_planners_gpus_take_their_peaks_from_the_same_table():
    assert {k: v[1]["peak_flops"] for k, v in GPUS.items()} == {"a100": 312e12, "h100": 989e12, "h100-500w": 989e12}
    # A family before its variants would shadow them: every variant's own entry must be reachable.
    for words, peak in DENSE_BF16_PEAKS:
        assert peak_flops_of(" ".join(words)) == peak, words


def _peak(monkeypatch, name, peak_flops=0.0, measured=612e12):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    calls = []
    peak = throughput.peak_flops(peak_flops, torch.device("cuda", 0), lambda: calls.append(1) or measured)
    return peak, calls


def test_on_a_known_gpu_without_peak_flops_mfu_is_against_its_names_peak(monkeypatch, capsys):
    peak, measured = _peak(monkeypatch, "NVIDIA H200")
    assert (peak, measured) == (989e12, [])
    assert capsys.readouterr().err == "MFU against NVIDIA H200's dense bf16 peak 989 TFLOP/s (from its name; " \
                                      "train.peak_flops sets another)\n"


def test_on_an_unknown_gpu_the_matmul_rate_is_measured_with_a_note(monkeypatch, capsys):
    peak, measured = _peak(monkeypatch, "Tesla T4")
    assert (peak, measured) == (612e12, [1])
    err = capsys.readouterr().err
    assert err.startswith("MFU against the measured bf16 matmul rate 612 TFLOP/s (card name 'Tesla T4' unknown")
    assert "train.peak_flops" in err


def test_peak_flops_set_wins_and_says_nothing(monkeypatch, capsys):
    peak, measured = _peak(monkeypatch, "NVIDIA H100 80GB HBM3", peak_flops=500e12)
    assert (peak, measured, capsys.readouterr().err) == (500e12, [], "")


def test_on_cpu_the_peak_is_measured_as_before(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: pytest.fail("no GPU to name"))
    assert throughput.peak_flops(0.0, torch.device("cpu"), lambda: 3e10) == 3e10
    assert capsys.readouterr().err == ""


def _measured_on_cpu():
    return throughput.measure_peak(torch.device("cpu"))


def test_the_measured_peak_is_every_ranks_mean(workers):
    peaks = workers(2).run(_measured_on_cpu)
    print(f"measured matmul peak per rank: {peaks[0] / 1e9:.2f} GFLOP/s")
    assert peaks[0] == peaks[1] > 1e8  # one all-reduced figure, the same on every rank
