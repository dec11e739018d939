"""The planner: every valid layout, only those that fit, fastest first; and `plait plan`."""

from __future__ import annotations

import json
import re

import pytest

from plait.errors import PlaitError
from plait.estimate.cli import plan_main as plan_with
from plait.families import shape_of


def plan_main(argv: list[str]) -> int:
    return plan_with(argv, shape_of)
from plait.estimate.hardware import GIB, get_hardware
from plait.estimate.memory import estimate_memory
from plait.estimate.planner import PlanRequest, candidates, plan
from plait.models.gpt.config import get_preset


def test_every_row_is_a_valid_layout() -> None:
    cfg = get_preset("llama-7b")
    rows = plan(cfg, gpus=16, gpus_per_node=8, hardware="a100-80gb", global_batch=64, seq_len=2048)
    assert rows
    for r in rows:
        assert r["dp"] * r["tp"] * r["pp"] * r["cp"] == 16
        assert cfg.n_heads % r["tp"] == 0 and cfg.n_kv_heads % r["tp"] == 0
        assert r["cp_kind"] == "ring" or cfg.n_heads // r["tp"] % r["cp"] == 0  # Ulysses splits whole heads
        assert r["tp"] <= 8 and r["pp"] <= cfg.n_layers
        assert r["dp"] * r["micro_batch"] * r["grad_accum"] == 64
        assert r["memory_bytes"] <= get_hardware("a100-80gb").usable_bytes
        assert r["zero"] == 0 or r["dp"] * r["cp"] > 1  # one replica has nothing to shard
    times = [r["step_s"] for r in rows]
    assert times == sorted(times)


def test_tp_stays_inside_a_node() -> None:
    request = PlanRequest(config=get_preset("llama-70b"), gpus=16, gpus_per_node=2,
                          hardware=get_hardware("h100-sxm"), global_batch=32, seq_len=1024)
    assert {layout.tp for layout in candidates(request)} == {1, 2}


def test_tp_divides_heads() -> None:
    # small: 6 heads, 2 kv heads, ffn 1024 -> tp in {1, 2}
    request = PlanRequest(config=get_preset("small"), gpus=6, gpus_per_node=8,
                          hardware=get_hardware("cpu"), global_batch=12, seq_len=128)
    assert {layout.tp for layout in candidates(request)} == {1, 2}


def test_top_limits_the_list() -> None:
    rows = plan(get_preset("tiny"), gpus=2, hardware="cpu", global_batch=8, seq_len=64, top=3)
    assert len(rows) == 3


def test_nothing_fits_names_the_smallest_need() -> None:
    cfg = get_preset("llama-70b")
    with pytest.raises(PlaitError) as err:
        plan(cfg, gpus=2, gpus_per_node=2, hardware="rtx3090", global_batch=2, seq_len=4096)
    match = re.match(r"nothing fits: the smallest layout needs ([\d.]+) GiB per GPU", err.value.message)
    assert match, err.value.message
    request = PlanRequest(config=cfg, gpus=2, gpus_per_node=2, hardware=get_hardware("rtx3090"),
                          global_batch=2, seq_len=4096)
    smallest = min(estimate_memory(cfg, layout).total for layout in candidates(request))
    assert float(match.group(1)) == pytest.approx(smallest / GIB, abs=0.05)
    assert "--offload" in err.value.hint


def test_no_valid_layout_at_all() -> None:
    # tiny on 3 GPUs: tp must divide 4 heads (tp = 1), pp <= 2 layers (pp = 1), so dp = 3,
    # which does not divide a global batch of 4.
    with pytest.raises(PlaitError, match="no layout of 3 GPUs fits"):
        plan(get_preset("tiny"), gpus=3, hardware="cpu", global_batch=4)


def test_bad_plan_requests() -> None:
    with pytest.raises(PlaitError, match="--gpus must be a whole number of at least 1"):
        plan(get_preset("tiny"), gpus=0, global_batch=4)
    with pytest.raises(PlaitError, match="plan searches the gpipe and 1f1b schedules only"):
        plan(get_preset("tiny"), gpus=2, global_batch=4, schedule="interleaved")


# -- plait plan ------------------------------------------------------------------------------
def test_plan_cli_table(capsys) -> None:
    code = plan_main(["--model", "llama-70b", "--gpus", "64", "--gpus-per-node", "8",
                      "--hardware", "h100-sxm", "--global-batch", "1024", "--seq-len", "4096",
                      "--top", "5"])
    out = capsys.readouterr().out
    assert code == 0
    assert "llama-70b on 64 x h100-sxm" in out
    assert len([line for line in out.splitlines() if re.match(r"\s*\d+\s+\d+\s+\d+", line)]) == 5


def test_plan_cli_json(capsys) -> None:
    plan_main(["--model", "small", "--gpus", "4", "--hardware", "cpu", "--global-batch", "8",
               "--seq-len", "128", "--precision", "fp32", "--json", "--top", "2"])
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 and rows[0]["step_s"] <= rows[1]["step_s"]


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt5", "--gpus", "8", "--global-batch", "8"], "unknown --model 'gpt5'"),
    (["--model", "tiny", "--gpus", "8", "--global-batch", "8", "--hardware", "abacus"],
     "unknown hardware 'abacus'"),
    (["--gpus", "8", "--global-batch", "8"], "no model given"),
    (["--model", "llama-70b", "--gpus", "1", "--global-batch", "1", "--hardware", "rtx4090"],
     "nothing fits: the smallest layout needs"),
])
def test_plan_cli_bad_input(argv: list[str], message: str) -> None:
    with pytest.raises(PlaitError) as err:
        plan_main(argv)
    assert message in err.value.message
    if "model" in message:
        assert "llama-7b" in err.value.hint  # lists the valid names


def test_a_long_sequence_is_planned_with_context_parallelism() -> None:
    """128K tokens of llama-7b on 8 GPUs, one sequence per step: data parallelism has nothing to
    split, and the fastest layouts that fit split the sequence (cp, with ZeRO-3 over dp·cp)."""
    rows = plan(get_preset("llama-7b"), gpus=8, gpus_per_node=8, hardware="h100-sxm", global_batch=1,
                seq_len=131072)
    assert (rows[0]["cp"], rows[0]["cp_kind"], rows[0]["zero"]) == (8, "ring", 3)
    assert all(r["dp"] == 1 for r in rows)
    assert min(r["step_s"] for r in rows if r["cp"] == 1) > rows[0]["step_s"]  # tp 8 alone is slower
