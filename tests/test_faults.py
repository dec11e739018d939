"""Never hang: a collective that waits too long fails with a message naming rank, op and group."""

from __future__ import annotations

from tests.worldlib import run_world


def test_a_stuck_collective_times_out_and_names_itself(tmp_path):
    _, reports = run_world("collective_timeout.py", 2, tmp_path, timeout=120)
    error = reports[0]["error"]
    assert error.startswith("rank 0: all_reduce on the dp group (2 ranks) failed: ")
    assert "Timed out" in error and "unbound_buffer" not in error
    assert "--timeout" in reports[0]["hint"]
    assert 1.9 < reports[0]["waited"] < 10  # --timeout 2 s, not the default 300 s
    assert reports[1] == {"slept": True}
