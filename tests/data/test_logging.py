"""hybridpar embedded in a program: a store build's lines are logging records under "hybridpar", which
the program quiets with the logger's level or hears through a handler of its own."""

import logging

from hybridpar.data import prepare_store
from hybridpar.progress import RankFilter
from tests.test_progress import Heard


def test_a_program_quiets_a_store_builds_information_and_hears_it_through_its_own_handler(
        tmp_path, tokenizer, corpus_sample, capsys):
    docs = tmp_path / "docs.txt"
    docs.write_text("\n".join(corpus_sample[:100]) + "\n")
    logger = logging.getLogger("hybridpar")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        prepare_store([docs], tokenizer, tmp_path / "quiet", workers=1, progress_every=0.0)
    finally:
        logger.setLevel(level)
    assert capsys.readouterr() == ("", "")  # the terminal handler (conftest's, the CLI's) got nothing

    heard = Heard()
    heard.addFilter(RankFilter())
    logger.addHandler(heard)
    try:
        prepare_store([docs], tokenizer, tmp_path / "heard", workers=1, progress_every=0.0)
    finally:
        logger.removeHandler(heard)
    first = heard.records[0]
    assert first.getMessage() == f"preparing {docs} into the token store {tmp_path / 'heard'}"
    assert (first.name, first.levelno, first.rank) == ("hybridpar.data.store.workers", logging.INFO, 0)
    assert len(heard.records) >= 3, heard.lines()  # the progress lines and the closing one too
    assert capsys.readouterr().err.splitlines() == heard.lines()  # and the terminal showed the same lines


def test_the_command_line_shows_the_librarys_lines_as_it_printed_them(tmp_path, tokenizer, corpus_sample):
    """`hybridpar` installs the terminal handler (hybridpar.cli.main): the store's progress note on
    stderr, the command's answer on stdout."""
    import subprocess
    import sys

    from tests.distributed import child_pythonpath

    docs = tmp_path / "docs.txt"
    docs.write_text("\n".join(corpus_sample[:100]) + "\n")
    done = subprocess.run([sys.executable, "-m", "hybridpar", "prepare", str(docs), "--tokenizer", str(tokenizer.path),
                           "--out", str(tmp_path / "store"), "--workers", "1"], capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": child_pythonpath(), "PATH": "/usr/bin:/bin",
                                            "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.splitlines()[0] == f"preparing {docs} into the token store {tmp_path / 'store'}", done.stderr
    assert done.stdout.startswith(f"{tmp_path / 'store'}: complete, "), done.stdout
