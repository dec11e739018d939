"""CNNs with BatchNorm on 2 processes: SyncBN is one process, plain BN is torch DDP, bytes exact."""

from __future__ import annotations

import pytest

from tests.parity import assert_losses_close, assert_params_close
from tests.worldlib import run_world

STAT_ATOL = 1e-6  # running statistics are not touched by Adam's division: tighter than params


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    _, reports = run_world("vision_parity.py", 2, tmp_path_factory.mktemp("vision"))
    return reports


def _every_step_close(run: dict, reference: dict) -> None:
    """Losses and every parameter and running statistic, after every step."""
    assert_losses_close(run["losses"], reference["losses"])
    for actual, expected in zip(run["states"], reference["states"], strict=True):
        assert_params_close(actual, expected)


def test_sync_bn_on_two_ranks_is_one_process_with_the_whole_batch(reports):
    report = reports[0]
    assert report["sync_layers"] == 6  # the stem, 2 per block, 1 in the shortcut that downsamples
    _every_step_close(report["sync"], report["single"])
    for step, state in enumerate(report["sync"]["states"]):
        assert state["blocks.0.bn1.num_batches_tracked"] == [step + 1.0]
    # The running statistics are the same numbers on both ranks, without any broadcast.
    assert reports[1]["sync"]["states"] == report["sync"]["states"]


def test_sync_bn_with_zero3_recompute_and_accumulation(reports):
    # Two micro-batches per rank: each global micro-batch normalised as one, stats updated
    # once per micro-batch (recomputation does not count twice).
    _every_step_close(reports[0]["sync_zero3"], reports[0]["single_accum"])


def test_without_sync_bn_the_run_differs_and_follows_torch_ddp(reports):
    report = reports[0]
    gap = max(abs(a - b) for a, b in zip(report["plain"]["losses"], report["single"]["losses"]))
    assert gap > 1e-3, gap  # each rank normalised its own half of the batch
    final, single = report["plain"]["states"][-1], report["single"]["states"][-1]
    assert max(abs(a - b) for a, b in zip(final["stem_bn.running_var"], single["stem_bn.running_var"])) > 1e-3
    # What torch's DDP does with broadcast_buffers=True, step by step, buffers included.
    _every_step_close(report["plain"], report["torch"])


def test_a_user_cnn_through_the_api_with_sync_bn(reports):
    _every_step_close(reports[0]["user_sync"], reports[0]["user_single"])
    assert "has no BatchNorm layers" in reports[0]["no_bn_error"]


def test_ledger_bytes_of_one_sync_bn_layer_are_the_formula(reports):
    n, channels = 2, 5
    ring = 2 * (n - 1) / n
    for report in reports:
        assert report["ledger"]["forward"] == {"dp": {"all_reduce": ring * (2 * channels + 1) * 4}}
        assert report["ledger"]["backward"] == {"dp": {"all_reduce": ring * 2 * channels * 4}}
