"""Mixed precision across processes: every layout trains the model one process trains, one
verdict on non-finite gradients for all ranks, and exact resume (the loss scale included).

Rank 0 of each world also trains the one-process reference, so a world checks several
layouts against it. fp16 uses an initial loss scale of 1024 here (no overflow on these
steps), except where the test is about the scale.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from plait.runtime.env import have_torchao
from tests.parity import assert_grad_norms_close, assert_losses_close
from tests.worldlib import run_plait, run_world

FP16_RTOL = 2e-3  # the bar: 16-bit sums in another order
GRAD_NORM_RTOL_16 = 1e-2  # the norm of 16-bit gradients summed in another order
BF16_RTOL = 2e-3


# fp8 multiplies through torchao (plait[fp8]): an install without it runs the other phases.
FP8 = have_torchao()


@pytest.fixture(scope="module")
def world(tmp_path_factory: Any) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("precision")
    _, reports = run_world("precision_world.py", 2, out, str(out / "runs"), "parity", "faults", "resume",
                           *(["fp8"] if FP8 else []), timeout=600)
    return reports


def test_fp16_and_bf16_without_zero_match_one_process_on_dp_tp_and_pp(world):
    report = world[0]
    for precision in ("fp16", "bf16"):
        reference = report[f"one-{precision}"]
        assert reference["skipped"] == [False, False]
        for layout in ("dp2", "tp2", "pp2"):
            run = report[f"{layout}-{precision}"]
            assert_losses_close(run["losses"], reference["losses"], rtol=FP16_RTOL if precision == "fp16" else BF16_RTOL)
            assert run["scales"] == reference["scales"] and run["skipped"] == [False, False], layout
            # 2 + 2 + 12 bytes per parameter, as predicted (the busiest pp stage may differ
            # by a norm's weight between the max over ranks and the predicted busiest rank)
            for kind in ("params", "grads", "optim"):
                assert run["mem"][kind] == pytest.approx(run["predicted"]["memory"][kind], rel=0.01), (layout, kind)
            assert run["mem"]["optim"] == 6 * run["mem"]["params"], (layout, precision)
    assert report["dp2-bf16"]["losses"] != report["dp2-fp16"]["losses"]  # two precisions really ran


@pytest.mark.skipif(not FP8, reason="--precision fp8 needs torchao (plait[fp8]), which this Python lacks")
def test_fp8_trains_the_one_process_model_on_dp_zero_and_pp_and_tp_is_refused(world):
    report = world[0]
    one, bf16 = report["fp8-phase-one-fp8"]["losses"], report["fp8-phase-one-bf16"]["losses"]
    # float8 really ran: the same model in bf16 gives other losses, within fp8's rounding of them
    assert one != bf16 and one == pytest.approx(bf16, rel=2e-3)
    # each dp rank casts whole micro-batches and whole weights, as the one process does: the same bits
    for zero in (0, 1, 3):
        assert report[f"dp2-zero{zero}-fp8"]["losses"] == one, zero
    if isinstance(report["dp2-fp8-rowwise"], str):  # torch before 2.13 on the CPU: refused in one line
        assert report["dp2-fp8-rowwise"].startswith("--fp8-scaling rowwise on the CPU needs torch 2.13 or later")
    else:
        assert report["fp8-phase-one-rowwise"]["losses"] not in (one, bf16)
        assert report["dp2-fp8-rowwise"]["losses"] == report["fp8-phase-one-rowwise"]["losses"]
    # pp: the stages' bf16 gradients summed in another order (as bf16's own pp parity)
    assert_losses_close(report["pp2-fp8"]["losses"], one, rtol=BF16_RTOL)
    assert report["pp2-fp8"]["losses"][0] == one[0]
    assert report["tp2-fp8"].startswith("--precision fp8 with --tp 2: each tp rank would scale its shard")


def test_reduce_dtype_fp32_doubles_the_gradient_bytes_as_predicted(world):
    report = world[0]
    plain, wide = report["dp2-bf16"], report["dp2-bf16-reduce-fp32-zero0"]
    assert wide["comm"]["dp"]["all_reduce"] == 2 * plain["comm"]["dp"]["all_reduce"]
    for zero in (0, 1):
        run = report[f"dp2-bf16-reduce-fp32-zero{zero}"]
        for op, want in run["predicted"]["comm"]["dp"].items():
            assert 0 <= run["comm"]["dp"][op] - want <= 16, (zero, op)  # + the clip's 8-byte all-reduce
        assert run["losses"] == pytest.approx(plain["losses"][:1], rel=1e-3)


def test_an_overflow_on_one_tp_rank_skips_the_step_on_every_rank(world):
    for rank, report in enumerate(world):
        run = report["overflow"]
        assert run["skipped"] == [False, True], rank
        assert run["untouched"] is True, rank  # parameters and Adam state bit-identical
        assert run["scales"] == [1024.0, 1024.0] and run["summary_scale"] == 512.0, rank
        assert run["skipped_steps"] == 1
    assert world[0]["overflow"]["poisoned"] is None and world[1]["overflow"]["poisoned"] == "norm.weight"


def test_a_nonfinite_gradient_stops_every_rank_naming_step_rank_and_parameter(world):
    name = world[1]["stop_poisoned"]
    for report in world:
        assert report["stop"].startswith(f"step 2: the gradient of {name} went non-finite on rank 1"), report["stop"]
        assert "--skip-nonfinite" in report["stop"]


def test_skip_nonfinite_skips_on_every_rank(world):
    for report in world:
        run = report["skip"]
        assert run["skipped"] == [False, True] and run["untouched"] is True
        assert run["scales"] == [1.0, 1.0] and run["skipped_steps"] == 1


def test_an_fp16_run_resumes_to_the_bit_scale_included(world):
    for report in world:
        whole, again = report["resume"]["whole"], report["resume"]["again"]
        assert whole["skipped"] == [True, False, False, False]  # 131072 overflows once here: the scale moved
        assert whole["scales"][2:] == again["scales"] == [65536.0, 65536.0]
        assert again["losses"] == whole["losses"][2:]
        assert again["skipped_steps"] == whole["skipped_steps"] == 1
        assert report["resume"]["bitwise"] is True


def test_an_fp32_checkpoint_resumed_in_fp16_builds_masters_from_its_weights(world):
    for report in world:
        for zero in (0, 1):
            masters = report[f"masters-zero{zero}"]
            assert masters["count"] > 0 and masters["exact"] is True and masters["dtype"] == "torch.float32"


def test_products_in_fp16_and_bf16_match_one_process(tmp_path):
    """dp2 × pp2 with ZeRO-1 in fp16, tp2 × pp2 without ZeRO in bf16, dp2 × tp2 ZeRO-2 fp16:
    the all-ranks verdict, the masters and the scale compose with every group."""
    layouts = ["dp2pp2-z1:2,1,2:1:fp16", "tp2pp2:1,2,2:0:bf16", "dp2tp2-z2:2,2,1:2:fp16"]
    _, reports = run_world("precision_product.py", 4, tmp_path, str(tmp_path / "runs"), *layouts, timeout=900)
    report = reports[0]
    for layout in layouts:
        name, precision = layout.split(":")[0], layout.split(":")[3]
        run, reference = report[name], report[f"one-{precision}"]
        assert_losses_close(run["losses"], reference["losses"], rtol=FP16_RTOL)
        assert_grad_norms_close(run["grad_norms"], reference["grad_norms"], rtol=GRAD_NORM_RTOL_16)
        assert run["scales"] == reference["scales"] and run["skipped"] == [False, False], name
        for kind in ("params", "grads", "optim"):
            assert run["mem"][kind] == pytest.approx(run["predicted"]["memory"][kind], rel=0.01), (name, kind)


@pytest.mark.slow
def test_dp2_tp2_pp2_zero1_fp16_matches_one_process(tmp_path):
    common = ["--model", "tiny", "--steps", "3", "--micro-batch", "2", "--seq-len", "32", "--eval-every", "0",
              "--sample-tokens", "0", "--warmup-steps", "1", "--precision", "fp16", "--loss-scale", "1024"]
    losses, norms = [], []
    for name, flags in (("one", ["--nproc", "1", "--grad-accum", "4"]),
                        ("3d", ["--nproc", "8", "--dp", "2", "--tp", "2", "--pp", "2", "--zero", "1",
                                "--grad-accum", "2"])):
        proc = run_plait("train", *common, *flags, "--out", str(tmp_path / name), timeout=900)
        assert proc.returncode == 0, proc.stderr
        lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses.append([r["loss"] for r in lines])
        norms.append([r["grad_norm"] for r in lines])
    assert_losses_close(losses[1], losses[0], rtol=FP16_RTOL)
    assert_grad_norms_close(norms[1], norms[0], rtol=GRAD_NORM_RTOL_16)
