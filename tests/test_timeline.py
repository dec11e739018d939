"""Drawing timed schedules: the text figure exactly, the PNG as a real image file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from plait.errors import PlaitError
from plait.schedule.build import build_schedule, gpipe, simulate
from plait.schedule.timeline import render_png, render_text


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def test_gpipe_text_figure() -> None:
    text = render_text(simulate(gpipe(2, 2), pp=2))
    assert text == (
        "rank 0 | F0 F1 .  .  .  B0 B0 B1 B1\n"
        "rank 1 | .  F0 F1 B0 B0 B1 B1 .  .\n"
        "bubble 33.3% = idle 6 / (2 ranks x makespan 9)"
    )


def test_interleaved_text_names_chunks_and_uses_half_steps() -> None:
    text = render_text(simulate(build_schedule("interleaved", 2, 2, v=2), pp=2, v=2))
    first_row = text.splitlines()[0].split()
    # Forward costs 1/2 per chunk, so each forward is one cell and each backward two.
    assert first_row[:6] == ["rank", "0", "|", "F0a", "F1a", "F0b"]
    assert "B0b B0b" in text


def test_split_backward_text_shows_i_and_w() -> None:
    text = render_text(simulate(build_schedule("zb-h1", 2, 2), pp=2, cost_i=1, cost_w=1))
    assert text.splitlines()[1] == "rank 1 | .  F0 I0 F1 I1 W0 W1"


def test_timeline_figures_agree() -> None:
    timeline = simulate(build_schedule("1f1b", 4, 8), pp=4)
    assert timeline.busy == (24.0,) * 4
    assert timeline.idle == pytest.approx(4 * timeline.makespan - 96.0)
    assert timeline.peak_pending_w == (0,) * 4


def test_png_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "zb.png"
    render_png(simulate(build_schedule("zb-h1", 4, 8), pp=4), path)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


def test_png_without_matplotlib_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    modules = ("matplotlib", "matplotlib.backends.backend_agg", "matplotlib.figure",
               "matplotlib.patches")
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules makes the import fail
    with pytest.raises(PlaitError) as err:
        render_png(simulate(gpipe(2, 2), pp=2), tmp_path / "x.png")
    assert err.value.hint == "pip install matplotlib"
