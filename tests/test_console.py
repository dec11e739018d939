"""Rank 0's progress bar and the job's error lines share one stderr: an error line (a rank's,
the spawner's) always starts a line of its own (plait.runtime.console). No processes: the
bar, a rank's printer and the spawner's share one stream here, and the mark its folder."""

from __future__ import annotations

from plait import cli
from plait.runtime import console, launch


def test_an_error_line_never_lands_on_the_bar_line(tmp_path, monkeypatch, capsys):
    from plait.train.loop.run import _progress_bar

    monkeypatch.setenv(console.FOLDER_ENV, str(tmp_path))  # the world's scratch folder, as the spawner sets it
    bar = _progress_bar(10)
    bar.update(3)
    bar.refresh()  # rank 0's bar, its cursor left at the end of the line
    cli.say("plait: error: rank 1: boom")  # another rank's one-line error
    launch._report([(1, 2)], 1, console.mark_in(tmp_path))  # then the spawner's line
    bar.refresh()  # the bar draws again (rank 0 still waits in a collective) ...
    launch._report([(1, 2)], 0, console.mark_in(tmp_path))  # ... and is left open again
    bar.close()
    cli.say("plait: preempted by SIGTERM")  # after the bar closed: no empty line
    lines = capsys.readouterr().err.split("\n")
    assert "3/10" in lines[0] and "plait" not in lines[0]
    assert lines[1:3] == ["plait: error: rank 1: boom",
                          "plait: rank 1 exited with code 2; stopping the other 1 rank(s) (the failing rank's error is above)"]
    assert "3/10" in lines[3] and lines[4].startswith("plait: rank 1 exited with code 2 (the failing")
    assert "3/10" in lines[5] and lines[6:] == ["plait: preempted by SIGTERM", ""]
    assert not console.mark_in(tmp_path).exists()


def test_without_a_bar_or_a_scratch_folder_a_line_is_just_the_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(console.FOLDER_ENV, raising=False)
    cli.say("plait: error: one")
    monkeypatch.setenv(console.FOLDER_ENV, str(tmp_path))
    cli.say("plait: error: two")
    assert capsys.readouterr().err == "plait: error: one\nplait: error: two\n"


def test_a_log_line_starts_a_line_of_its_own(tmp_path, monkeypatch, capsys):
    import logging
    import sys

    from plait.train.observe.logs import setup_logging

    monkeypatch.setenv(console.FOLDER_ENV, str(tmp_path))
    bar = console.BarStream(sys.stderr)
    bar.write("\rtrain: 3/10")
    setup_logging("warning", rank=1)
    try:
        logging.getLogger("plait.parallel.tensor.plan").warning("slow")
    finally:
        setup_logging("warning", rank=0)
    bar.write("\rtrain: 4/10")
    assert capsys.readouterr().err == "\rtrain: 3/10\n[rank 1] plait.parallel.tensor.plan: slow\n\rtrain: 4/10"
