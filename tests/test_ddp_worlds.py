"""plait's DDP on 2 and 4 processes: parity with one process and torch DDP, exact bytes, overlap."""

from __future__ import annotations

import pytest

from tests.parity import assert_losses_close, assert_params_close, assert_scale_close
from tests.worldlib import run_world


# 4 processes repeat the checks at another ring size: the long matrix (`make test-all`).
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["n2", "n4"])
def world(request, tmp_path_factory):
    n = request.param
    _, reports = run_world("ddp_parity.py", n, tmp_path_factory.mktemp(f"ddp{n}"))
    return n, reports


def test_losses_match_one_process_and_torch_ddp(world):
    _, reports = world
    report = reports[0]
    single = report["single"]["losses"]
    for run in ("plait", "plait_accum", "torch"):
        assert_losses_close(report[run]["losses"], single)
    # Every rank logs the same (all-reduced) loss.
    for other in reports[1:]:
        assert other["plait"]["losses"] == report["plait"]["losses"]


def test_gradients_and_parameters_match(world):
    _, reports = world
    report = reports[0]
    for run in ("plait", "plait_accum", "torch"):
        assert_scale_close(report[run]["first_grads"], report["single"]["first_grads"], rtol=1e-6)
        assert_params_close(report[run]["params"], report["single"]["params"])
    # Same micro-batch cut as torch DDP: the same model, to fp32 noise.
    assert_params_close(report["plait_accum"]["params"], report["torch"]["params"])
    # Replicas stay identical across ranks, bit for bit.
    for other in reports[1:]:
        assert other["plait"]["params"] == report["plait"]["params"]


def test_ledger_bytes_are_the_ring_formula(world):
    n, reports = world
    psi_bytes = reports[0]["num_params"] * 4
    expected = 2 * (n - 1) / n * psi_bytes  # ring all-reduce of all fp32 gradients
    for report in reports:
        for run in ("plait", "plait_accum"):
            assert report[run]["comm"] == [{"dp": {"all_reduce": expected}}] * 4
    assert expected == {2: psi_bytes, 4: 1.5 * psi_bytes}[n]


def test_accumulation_sends_nothing_before_the_last_micro_batch(world):
    _, reports = world
    for report in reports:
        assert report["plait_accum"]["calls_mid_accum"] == [0, 0, 0, 0]


def test_first_bucket_is_launched_before_backward_ends(world):
    _, reports = world
    report = reports[0]
    events = [tuple(e) for e in report["events"]]
    assert report["buckets"] > 2
    # All buckets launched from inside backward, in order, then backward ended.
    assert events == [("launch", i) for i in range(report["buckets"])] + [("backward_end", -1)]


def test_user_model_starts_from_rank0_and_survives_an_unused_parameter(world):
    _, reports = world
    user = [r["user_model"] for r in reports]
    assert len({u["first_weight_sum"] for u in user}) == 1  # built with different seeds, broadcast
    assert len({u["grad_sum"] for u in user}) == 1  # averaged gradient, identical everywhere
    assert all(u["unused_grad_abs"] == 0.0 for u in user)
