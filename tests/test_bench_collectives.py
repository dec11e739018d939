"""`plait bench collectives`: every primitive checked exactly on 2 and 4 Gloo ranks, the
check caught on a spoiled result, the ledger equal to nccl-tests' formula, busbw factors."""

from __future__ import annotations

import json

import pytest
import torch

from plait.bench.collectives import expected, is_right, rank_input
from plait.estimate.collectives import PRIMITIVES, bandwidths, busbw_factor, parse_size, size_range
from tests.worldlib import run_plait


@pytest.mark.parametrize("op, n, factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_reduce", 8, 1.75),
    ("all_gather", 4, 0.75), ("reduce_scatter", 4, 0.75), ("scatter", 4, 0.75), ("gather", 2, 0.5),
    ("broadcast", 4, 1.0), ("reduce", 8, 1.0), ("send_recv", 2, 1.0),
])
def test_busbw_factors_are_nccl_tests(op: str, n: int, factor: float) -> None:
    assert busbw_factor(op, n) == factor
    assert bandwidths(op, 1000, 0.5, n) == (2000, 2000 * factor)


def test_sizes_parse_like_nccl_tests() -> None:
    assert parse_size("1K") == 1024 and parse_size("256M") == 256 * 2**20 and parse_size("64") == 64
    assert size_range("1K:8K") == [1024, 2048, 4096, 8192]
    assert size_range("1K:256M", 4)[-1] == 256 * 2**20
    with pytest.raises(ValueError):
        size_range("8K:1K")


def test_the_check_refuses_a_wrong_answer() -> None:
    right = expected("all_reduce", 1, 4, 12)
    assert torch.equal(right, sum(rank_input(r, 12) for r in range(4)))
    assert is_right(right.clone(), right)
    wrong = right.clone()
    wrong[5] += 1
    assert not is_right(wrong, right)
    assert not is_right(right[:-1], right) and not is_right(None, right)
    assert is_right(None, expected("reduce", 1, 4, 12))  # nothing defined off the root


def _run(nproc: int, *extra: str):
    proc = run_plait("bench", "collectives", "--nproc", str(nproc), "--sizes", "1K:4K", "--factor", "4",
                     "--json", "--iters", "2", *extra, timeout=240)
    start = proc.stdout.index("{")
    return proc, json.loads(proc.stdout[start:proc.stdout.rindex("}") + 1])


def _check_rows(rows: list[dict], groups: list[int]) -> None:
    assert {(r["op"], r["n"], r["bytes"]) for r in rows} == {
        (op, n, size) for op in PRIMITIVES for n in groups for size in (1024, 4096)}
    for r in rows:
        assert r["ledger_wire_bytes"] == pytest.approx(r["formula_wire_bytes"])
        assert r["busbw_factor"] == busbw_factor(r["op"], r["n"])
        assert r["busbw_gb_s"] == pytest.approx(r["algbw_gb_s"] * r["busbw_factor"])
        assert r["time_s"] > 0


def test_two_ranks_every_primitive_right(tmp_path) -> None:
    png = tmp_path / "busbw.png"
    proc, result = _run(2, "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    _check_rows(result["results"], [2])
    assert all(r["ok"] for r in result["results"])
    assert png.stat().st_size > 1000


def test_four_ranks_right_and_a_spoiled_result_is_caught() -> None:
    """Groups of 2 and 4 ranks; every op's real result passes, its spoiled copy fails the
    check, and the command says so and exits with an error."""
    proc, result = _run(4, "--corrupt", "all")
    assert proc.returncode == 2
    assert "wrong results" in proc.stderr
    _check_rows(result["results"], [2, 4])
    assert all(r["ok_unspoiled"] and not r["ok"] for r in result["results"])


def test_gloos_small_collectives_are_one_all_to_all_with_torchs_results(tmp_path) -> None:
    """3 ranks: plait's all-reduce (sum, max, min), all-gather and reduce-scatter, blocking and
    async, equal torch.distributed's own on whole numbers in fp32, bf16 and int64; on random
    floats within rounding (the sum's order is rank order) and the same bits on every rank. Up
    to each op's limit (bytes: the all-gather's output) the op is one all-to-all, past it torch's
    op; the relative difference is within one rounding; the ledger counts the
    all-reduce it stands for; ZeRO's backend probe (native) takes torch's reduce-scatter."""
    from plait.runtime.comm import GLOO_BY_ALL_TO_ALL
    from tests.worldlib import run_world

    _, reports = run_world("gloo_world.py", 3, tmp_path)
    for report in reports:
        assert report["equal"] and all(report["equal"].values()), report["equal"]
        assert all(value < 0.01 if "bfloat16" in key else value < 1e-6 for key, value in report["close"].items()), \
            report["close"]
        assert all(report["same_on_every_rank"].values()), report["same_on_every_rank"]
        assert report["ledger"] == {"world": {"all_reduce": 2 * 2 / 3 * 120}}
        for op in GLOO_BY_ALL_TO_ALL:
            assert report["paths"][f"{op}@limit"] == {"all_to_all_single": 1}, report["paths"]
            assert report["paths"][f"{op}@past"] == {op: 1}, report["paths"]
        assert report["paths"]["reduce_scatter@native"] == {"reduce_scatter": 1}
