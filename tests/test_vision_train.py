"""`plait train` on images: the digits reach 95% top-1 on 2 processes; a SyncBN run resumes
on another number of processes and continues as if uninterrupted, its running statistics
included. Mostly slow: full CLI runs."""

from __future__ import annotations

import json

import pytest

from tests.parity import assert_losses_close
from tests.worldlib import run_plait

ACCURACY_RUN = ["--model", "resnet18,width=16", "--data", "digits", "--nproc", "2", "--sync-bn", "--steps", "150",
                "--micro-batch", "32", "--lr", "0.01", "--warmup-steps", "5", "--eval-every", "50"]


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_digits_reach_95_percent_top1_on_two_processes(tmp_path):
    proc = run_plait("train", *ACCURACY_RUN, "--out", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["val_accuracy"] >= 0.95, summary["val_accuracy"]
    assert "top-1 accuracy" in proc.stdout and "dp all_reduce" in proc.stdout
    assert [r["step"] for r in _records(tmp_path) if "val_accuracy" in r] == [50, 100, 150]
    # The prediction of the dp all-reduce holds to the byte: gradients plus SyncBN's sums.
    assert summary["predicted"]["comm"]["dp"]["all_reduce"] == summary["comm_per_step"]["dp"]["all_reduce"]


@pytest.mark.slow
def test_a_sync_bn_run_resumes_on_one_process(tmp_path):
    common = ["--model", "resnet18,width=4", "--data", "digits", "--steps", "4", "--eval-every", "0", "--lr", "0.01"]
    first = run_plait("train", *common, "--nproc", "2", "--micro-batch", "4", "--sync-bn", "--save-every", "2",
                      "--out", str(tmp_path / "a"), timeout=300)
    assert first.returncode == 0, first.stderr
    second = run_plait("train", *common, "--nproc", "1", "--micro-batch", "8",
                       "--resume", str(tmp_path / "a" / "checkpoints" / "step-00000002"),
                       "--out", str(tmp_path / "b"), timeout=300)
    assert second.returncode == 0, second.stderr
    expected = [r["loss"] for r in _records(tmp_path / "a")][2:]
    assert_losses_close([r["loss"] for r in _records(tmp_path / "b")], expected)


def test_a_resumed_run_keeps_the_batchnorm_running_statistics(tmp_path):
    """Evaluation normalises with the running statistics, which are buffers, not parameters:
    the checkpoint and model.safetensors carry them, so a run resumed at step 2 evaluates at
    step 4 as the uninterrupted run does, and ends with the same bytes, statistics included."""
    from safetensors.torch import load_file

    common = ["--model", "resnet18,width=4", "--data", "digits", "--nproc", "2", "--sync-bn", "--micro-batch", "16",
              "--steps", "4", "--eval-every", "2", "--eval-samples", "64", "--lr", "0.01", "--no-report"]
    whole = run_plait("train", *common, "--save-every", "2", "--out", str(tmp_path / "a"), timeout=300)
    assert whole.returncode == 0, whole.stderr
    resumed = run_plait("train", *common, "--resume", str(tmp_path / "a" / "checkpoints" / "step-00000002"),
                        "--out", str(tmp_path / "b"), timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert [r.get("val_loss") for r in _records(tmp_path / "b")] == [r.get("val_loss") for r in _records(tmp_path / "a")][2:]
    first, again = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("a", "b"))
    assert first.keys() == again.keys() and {"blocks.0.bn1.running_mean", "blocks.0.bn1.running_var"} <= first.keys()
    assert all(first[name].equal(again[name]) for name in first)
    assert first["blocks.0.bn1.num_batches_tracked"].item() == 4
