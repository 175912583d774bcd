"""The environment rules of `hybridpar doctor`, on hand-made environments (no processes needed),
plus the facts about torch 2.13 they rest on, checked against the installed torch."""

import mmap
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridpar.diagnostics.env import (
    ERROR,
    OK,
    RENAMED,
    WARNING,
    Finding,
    check_deprecated,
    check_env,
    check_interfaces,
    check_rank_envs,
    check_threads,
    check_timeouts,
    check_values,
    format_ranks,
    merge_findings,
)

TORCH_DIR = Path(torch.__file__).parent
C10D_HEADERS = TORCH_DIR / "include" / "torch" / "csrc" / "distributed" / "c10d"


def _only(findings, level):
    assert [f.level for f in findings] == [level], findings
    return findings[0].message


# --- deprecated spellings -------------------------------------------------------------------------


def test_a_clean_environment_passes_every_check():
    findings = check_env({"OMP_NUM_THREADS": "1"}, n_hosts=1, backend="gloo", interfaces=["lo", "eth0"],
                         init_timeout=600, train_timeout=300)
    assert {f.level for f in findings} == {OK}
    assert [f.check for f in findings] == ["deprecated-env", "env-values", "timeouts", "interfaces"]


def test_a_deprecated_spelling_alone_still_works_and_is_a_warning():
    message = _only(check_deprecated({"NCCL_BLOCKING_WAIT": "1"}), WARNING)
    assert "rename it to TORCH_NCCL_BLOCKING_WAIT=1" in message


def test_a_deprecated_spelling_shadowed_by_hybridpar_default_is_an_error():
    # Without a launcher nothing sets the new spelling, but the trainer's defaults set it to 3,
    # which wins over the old spelling: the user's 1 is silently ignored.
    message = _only(check_deprecated({"NCCL_ASYNC_ERROR_HANDLING": "1"}), ERROR)
    assert message.startswith("NCCL_ASYNC_ERROR_HANDLING=1 is ignored: TORCH_NCCL_ASYNC_ERROR_HANDLING=3 takes "
                              "precedence (hybridpar's default")
    assert "set TORCH_NCCL_ASYNC_ERROR_HANDLING=1 and remove NCCL_ASYNC_ERROR_HANDLING" in message
    message = _only(check_deprecated({"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"}), ERROR)
    assert "TORCH_FR_BUFFER_SIZE=2000 takes precedence" in message


def test_a_deprecated_spelling_shadowed_by_torchrun_is_an_error_naming_torchrun():
    env = {"NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # what torchrun workers see
    assert "torchrun sets it to 1" in _only(check_deprecated(env), ERROR)


def test_both_spellings_with_one_value_is_only_redundant():
    env = {"NCCL_DESYNC_DEBUG": "1", "TORCH_NCCL_DESYNC_DEBUG": "1"}
    assert "redundant" in _only(check_deprecated(env), WARNING)


def test_the_renamed_table_matches_torch_sources():
    """Each pair is declared by torch as (new, old) in one getCvar list, new first."""
    if not C10D_HEADERS.is_dir():
        pytest.skip("this torch build ships no c10d headers")
    text = " ".join((C10D_HEADERS / name).read_text() for name in ("ProcessGroupNCCL.hpp", "FlightRecorder.hpp"))
    text = re.sub(r"\s+", "", text)
    in_headers = {old for old, new in RENAMED.items() if f'"{new}","{old}"' in text}
    # The dump-file pair is read in FlightRecorder.cpp: both strings are in the library.
    assert set(RENAMED) - in_headers == {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}
    library = TORCH_DIR / "lib" / "libtorch_cpu.so"
    if library.exists():
        with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            assert data.find(b"TORCH_NCCL_DEBUG_INFO_TEMP_FILE\0") >= 0 and data.find(b"TORCH_FR_DUMP_TEMP_FILE\0") >= 0


FR_PROBE = """
import pickle, torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
dist.all_reduce(torch.ones(2))
print("entries", len(pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, True, False))["entries"]))
dist.destroy_process_group()
"""


def test_torch_reads_the_new_spelling_first_and_warns_about_the_old():
    """The precedence rule behind the errors above, observed in a fresh process: the old spelling asks
    for a flight recorder of 50 entries, the new one for none (0), and the new one wins, while torch
    still reads the old one (it warns). With neither set, the recorder is on (FACTS.md)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_FR_", "TORCH_NCCL_", "RANK", "WORLD"))}
    env = {**base, "TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "50", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", FR_PROBE], env=env, capture_output=True, text=True, timeout=180)
    assert "entries 0" in result.stdout, result.stdout + result.stderr
    assert ("Environment variable TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated; use TORCH_FR_BUFFER_SIZE instead"
            in result.stderr)


# --- values and timeouts --------------------------------------------------------------------------


@pytest.mark.parametrize("env,expected", [
    ({"TORCH_NCCL_BLOCKING_WAIT": "maybe"}, "TORCH_NCCL_BLOCKING_WAIT='maybe' is not a boolean"),
    ({"NCCL_DESYNC_DEBUG": "on"}, "NCCL_DESYNC_DEBUG='on' is not a boolean"),
    ({"TORCH_FR_BUFFER_SIZE": "big"}, "TORCH_FR_BUFFER_SIZE='big' is not an integer"),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "7"}, "not a mode torch knows (0-3)"),
])
def test_values_torch_cannot_parse_are_errors(env, expected):
    assert expected in _only(check_values(env), ERROR)


def test_values_torch_parses_pass():
    env = {"TORCH_NCCL_BLOCKING_WAIT": "False", "TORCH_NCCL_DUMP_ON_TIMEOUT": "yes", "TORCH_FR_BUFFER_SIZE": " 2000"}
    _only(check_values(env), OK)


def test_no_async_error_handling_is_a_warning():
    assert "a hang stays a hang" in _only(check_values({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}), WARNING)


def test_blocking_wait_disables_the_watchdog_settings():
    message = _only(check_timeouts({"TORCH_NCCL_BLOCKING_WAIT": "1"}), WARNING)
    assert "no watchdog thread" in message and "TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in message


def test_timeout_variables_nobody_reads_are_named():
    env = {"NCCL_TIMEOUT": "1800", "TORCH_NCCL_TIMEOUT_SEC": "60", "NCCL_IB_TIMEOUT": "22",
           "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "600"}
    findings = check_timeouts(env)
    assert [f.level for f in findings] == [WARNING, WARNING]
    assert findings[0].message.startswith("NCCL_TIMEOUT=1800 is read by neither torch 2.13 nor NCCL")
    assert findings[1].message.startswith("TORCH_NCCL_TIMEOUT_SEC=60")


def test_train_timeout_longer_than_init_timeout_is_a_warning():
    assert "make train_timeout the shorter one" in _only(check_timeouts({}, 600, 900), WARNING)
    _only(check_timeouts({}, 600, 0), OK)  # 0: keep the init timeout


def test_an_init_timeout_without_a_train_timeout_is_consistent():
    assert _only(check_timeouts({}, init_timeout=600.0), OK) == "timeout settings are consistent"


def test_dump_on_timeout_without_a_recorder_is_a_warning():
    assert "nothing to dump" in _only(check_timeouts({"TORCH_FR_BUFFER_SIZE": "0"}), WARNING)


# --- interfaces -----------------------------------------------------------------------------------


def test_multi_host_jobs_need_an_interface_setting():
    message = _only(check_interfaces({}, n_hosts=2, backend="gloo", interfaces=["lo", "ib0"]), WARNING)
    assert "set GLOO_SOCKET_IFNAME" in message and "this host has: lo, ib0" in message
    assert "NCCL_SOCKET_IFNAME" in _only(check_interfaces({}, n_hosts=2, backend="nccl"), WARNING)
    _only(check_interfaces({"NCCL_SOCKET_IFNAME": "ib"}, n_hosts=2, backend="nccl", interfaces=["ib0"]), OK)
    _only(check_interfaces({}, n_hosts=1, backend="nccl"), OK)


def test_interface_names_must_exist_on_the_host():
    ifaces = ["lo", "eth0", "ib0", "docker0"]
    assert "no interface eth1" in _only(check_interfaces({"GLOO_SOCKET_IFNAME": "eth1"}, n_hosts=1, backend="gloo",
                                                         interfaces=ifaces), ERROR)
    for spec in ("eth", "=eth0", "^docker,lo", "^=docker0", "ib0,eth0"):  # NCCL's prefix / exact / exclude forms
        _only(check_interfaces({"NCCL_SOCKET_IFNAME": spec}, n_hosts=1, backend="nccl", interfaces=ifaces), OK)
    for spec in ("=eth", "enp", "^lo,eth,ib,docker"):
        message = _only(check_interfaces({"NCCL_SOCKET_IFNAME": spec}, n_hosts=1, backend="nccl",
                                         interfaces=ifaces), ERROR)
        assert "selects none of this host's interfaces" in message


# --- across ranks ---------------------------------------------------------------------------------


def test_variables_differing_between_ranks_are_named_with_their_ranks():
    envs = [{"NCCL_DEBUG": "WARN", "MASTER_PORT": "29500"}] * 3 + [{"NCCL_DEBUG": "INFO", "MASTER_PORT": "29500"}]
    envs.append({"MASTER_PORT": "29500"})
    message = _only(check_rank_envs(envs), WARNING)
    assert message.startswith("1 variable(s) differ between ranks: NCCL_DEBUG: 'WARN' on ranks 0-2; 'INFO' on "
                              "ranks 3; unset on ranks 4")


def test_identical_environments_pass_with_one_digest():
    envs = [{"NCCL_DEBUG": "WARN", "MASTER_ADDR": "h0"} for _ in range(4)]
    message = _only(check_rank_envs(envs), OK)
    other = _only(check_rank_envs([{"NCCL_DEBUG": "INFO", "MASTER_ADDR": "h0"}]), OK)
    assert "identical on all 4 ranks" in message and message[-14:] != other[-14:]  # the digest follows the values


def _ranks(threads, host_cores=2, hosts=1):
    return [{"host": f"h{r % hosts}", "threads": t, "cpu_ids": list(range(host_cores))} for r, t in enumerate(threads)]


def test_oversubscribed_hosts_get_a_thread_count_to_set():
    message = _only(check_threads(_ranks([4, 4], host_cores=4)), WARNING)
    assert message == "host h0: 2 processes x 4 threads = 8 > 4 cores: set OMP_NUM_THREADS=2"
    assert "run at most 2 processes per host" in _only(check_threads(_ranks([1, 1, 1, 1])), WARNING)
    _only(check_threads(_ranks([2, 2, 2, 2], host_cores=4, hosts=2)), OK)  # 2 ranks x 2 threads per 4-core host


def test_findings_from_several_ranks_are_merged_with_their_ranks():
    a, b = Finding(WARNING, "x", "on some"), Finding(OK, "y", "everywhere")
    merged = merge_findings([[a, b], [b], [a, b]])
    assert merged == [Finding(WARNING, "x", "on some", (0, 2)), Finding(OK, "y", "everywhere")]
    assert merged[0].line() == "warning  x [ranks 0,2]: on some"
    assert format_ranks([7, 0, 1, 2, 5, 8]) == "0-2,5,7-8"


@pytest.mark.parametrize("spec,selected", [
    ("eth", ["eth0", "eth1", "eth10"]), ("=eth0,eth1", ["eth0", "eth1"]), ("^=eth0,eth1", ["eth10", "ib0"]),
    ("^eth", ["ib0"]), ("eth1,ib", ["eth1", "eth10", "ib0"]),
])
def test_nccl_interface_lists_select_as_nccl_does(spec, selected):
    # A leading '=' makes the whole list exact (NCCL's rule), not only its first name.
    from hybridpar.diagnostics.env import _nccl_matches

    assert _nccl_matches(spec, ["eth0", "eth1", "eth10", "ib0"]) == selected


def test_a_made_up_c10d_timeout_reaches_the_doctor():
    # The doctor checks the variables relevant_env keeps: C10D_* must be among them to be flagged.
    from hybridpar.diagnostics.env import check_env, relevant_env

    messages = [f.message for f in check_env(relevant_env({"C10D_TIMEOUT": "30", "HOME": "/root"}))]
    assert any(m.startswith("C10D_TIMEOUT=30 is read by neither torch 2.13 nor NCCL") for m in messages), messages
