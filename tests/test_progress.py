"""Progress lines: quiet for short work, periodic and closed for long work, from one process; and how the
library's records reach the terminal (log_to_terminal) or a program's own handler."""

import logging
import subprocess
import sys
import types

import pytest

from hybridpar.progress import Progress, RankFilter, TerminalHandler, note
from tests.distributed import child_pythonpath


class Heard(logging.Handler):
    """A program's own handler: the records it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self) -> list[str]:
        return [r.getMessage() for r in self.records]


@pytest.fixture
def heard():
    handler = Heard()
    logging.getLogger("hybridpar").addHandler(handler)
    yield handler
    logging.getLogger("hybridpar").removeHandler(handler)


def test_short_work_is_silent_and_long_work_reports_and_closes(monkeypatch, heard):
    clock = iter([0.0, 1.0, 6.0, 7.0, 13.0, 14.0] + [14.0] * 3)  # start, four updates, finish; then "quick"
    monkeypatch.setattr("hybridpar.progress.time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    with Progress("loading x", total=4 * 2**20, unit="B", every=5.0, enabled=True) as progress:
        for _ in range(4):
            progress.update(2**20)
    lines = heard.lines()
    assert lines[0] == "loading x: 2.0 MiB of 4.0 MiB (50%), about 6 s left [6 s]"  # 5 s passed
    assert lines[1] == "loading x: 4.0 MiB of 4.0 MiB (100%) [13 s]"
    assert lines[-1] == "loading x: done, 4.0 MiB in 14 s" and len(lines) == 3
    # the module doing the work speaks (its logger), at INFO, as a progress note
    assert {(r.name, r.levelno, r.progress) for r in heard.records} == {("hybridpar.progress", logging.INFO, True)}

    heard.records.clear()
    with Progress("quick", total=3, enabled=True) as progress:
        progress.update(3)
    assert heard.lines() == []


def test_other_processes_stay_silent(heard):
    progress = Progress("x", enabled=False, every=0.0)
    progress.update(5)
    progress.finish()
    assert heard.lines() == [] and progress.done == 5


def test_notes_always_print_but_do_not_count_as_progress_and_the_summary_ends_the_closing_line(heard):
    with Progress("work", enabled=True) as quick:
        quick.note("work starts (once)")
        quick.update(1)
    assert heard.lines() == ["work starts (once)"]  # short work: no closing line after a note

    heard.records.clear()
    with Progress("work", unit="files", every=0.0, enabled=True) as progress:
        progress.update(2)
        progress.summary = "2 outputs"
    assert heard.lines()[-1] == "work: done, 2 files in 0 s: 2 outputs"

    heard.records.clear()
    Progress("work", enabled=False).note("not here")
    note("nor here", enabled=False)
    assert heard.lines() == []
    note("here, from rank 0")  # no process group: this process is rank 0
    assert heard.lines() == ["here, from rank 0"] and heard.records[0].name == "hybridpar.progress"


def test_the_terminal_gets_the_message_alone_information_on_stdout_the_rest_on_stderr(capsys):
    """log_to_terminal's handler (the command line's; conftest installs it as the CLI does)."""
    assert any(isinstance(h, TerminalHandler) for h in logging.getLogger("hybridpar").handlers)
    log = logging.getLogger("hybridpar.some.module")
    log.info("step 1/2 | loss 3.0")
    note("loading a model")
    log.warning("hybridpar: warning: something to change")
    log.error("\nhybridpar watchdog: rank 1 died\n")
    out, err = capsys.readouterr()
    assert out == "step 1/2 | loss 3.0\n"
    assert err == "loading a model\nhybridpar: warning: something to change\n\nhybridpar watchdog: rank 1 died\n\n"


def test_the_rank_filter_names_the_rank_of_each_record(monkeypatch, heard):
    heard.addFilter(RankFilter())
    monkeypatch.setattr("hybridpar.progress._rank", lambda: 3)
    logging.getLogger("hybridpar.x").warning("from a rank")
    assert heard.records[0].rank == 3


def test_a_program_that_sets_up_no_logging_sees_warnings_only():
    """Embedding hybridpar: importing it installs no handler, so Python's default applies (warnings and
    errors on stderr, information nowhere) until the program configures logging."""
    script = ("import logging\nfrom hybridpar.progress import note\nnote('an information line')\n"
              "logging.getLogger('hybridpar.data.store').warning('a warning')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": child_pythonpath(), "PATH": "/usr/bin:/bin"})
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "a warning\n")


def test_each_line_is_flushed_at_once_as_a_dying_rank_leaves_with_os_exit(monkeypatch):
    """A watchdog's verdict is logged, then the process ends with os._exit, which flushes nothing."""
    calls = []
    stream = types.SimpleNamespace(write=lambda text: calls.append(("write", text)),
                                   flush=lambda: calls.append(("flush",)))
    monkeypatch.setattr(sys, "stderr", stream)
    logging.getLogger("hybridpar.diagnostics.monitor").error("hybridpar watchdog: rank 3 died")
    assert calls == [("write", "hybridpar watchdog: rank 3 died\n"), ("flush",)]


def test_a_verdict_goes_out_even_when_the_rank_cannot_be_read(monkeypatch, capsys):
    def torn_down():
        raise RuntimeError("the process group was destroyed")

    monkeypatch.setattr("hybridpar.progress._rank", torn_down)
    logging.getLogger("hybridpar.diagnostics.watchdog").error("hybridpar watchdog (rank 2): exiting")
    assert capsys.readouterr().err == "hybridpar watchdog (rank 2): exiting\n"
