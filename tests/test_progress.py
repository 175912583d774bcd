"""Progress lines: quiet for short work, periodic and closed for long work, from one process."""

import io
import types


from hybridpar.progress import Progress, note


def test_short_work_is_silent_and_long_work_reports_and_closes(monkeypatch):
    clock = iter([0.0, 1.0, 6.0, 7.0, 13.0, 14.0] + [14.0] * 3)  # start, four updates, finish; then "quick"
    monkeypatch.setattr("hybridpar.progress.time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    out = io.StringIO()
    with Progress("loading x", total=4 * 2**20, unit="B", every=5.0, enabled=True, stream=out) as progress:
        for _ in range(4):
            progress.update(2**20)
    lines = out.getvalue().splitlines()
    assert lines[0] == "loading x: 2.0 MiB of 4.0 MiB (50%), about 6 s left [6 s]"  # 5 s passed
    assert lines[1] == "loading x: 4.0 MiB of 4.0 MiB (100%) [13 s]"
    assert lines[-1] == "loading x: done, 4.0 MiB in 14 s" and len(lines) == 3

    quiet = io.StringIO()
    with Progress("quick", total=3, enabled=True, stream=quiet) as progress:
        progress.update(3)
    assert quiet.getvalue() == ""


def test_other_processes_stay_silent():
    out = io.StringIO()
    progress = Progress("x", enabled=False, stream=out, every=0.0)
    progress.update(5)
    progress.finish()
    assert out.getvalue() == "" and progress.done == 5


def test_notes_always_print_but_do_not_count_as_progress_and_the_summary_ends_the_closing_line():
    out = io.StringIO()
    with Progress("work", enabled=True, stream=out) as quick:
        quick.note("work starts (once)")
        quick.update(1)
    assert out.getvalue() == "work starts (once)\n"  # short work: no closing line after a note

    out = io.StringIO()
    with Progress("work", unit="files", every=0.0, enabled=True, stream=out) as progress:
        progress.update(2)
        progress.summary = "2 outputs"
    assert out.getvalue().splitlines()[-1] == "work: done, 2 files in 0 s: 2 outputs"

    silent = io.StringIO()
    Progress("work", enabled=False, stream=silent).note("not here")
    note("nor here", enabled=False, stream=silent)
    assert silent.getvalue() == ""
