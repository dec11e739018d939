"""Uneven pipeline stages (--stage-layers): refused in one line where the cut cannot be,
priced per stage by plait estimate and plan, and a checkpoint written under an uneven cut
resumes under an even one. Their parity with one process is the parity matrix's
(tests/matrix.py: the rows with --stage-layers, zero-block end chunks and interleaving, for
plait's GPT, a Llama and a Qwen3)."""

from __future__ import annotations

import json

import pytest

from plait.cli import main
from tests.parity import assert_losses_close, assert_params_close
from tests.worldlib import run_losses, run_plait, run_weights

FOUR = ["--model", "tiny,n_layers=4", "--steps", "4", "--micro-batch", "2", "--seq-len", "16", "--eval-every", "0",
        "--sample-tokens", "0", "--warmup-steps", "1", "--no-report"]


@pytest.mark.parametrize("flags, message", [
    (["--nproc", "2", "--pp", "2", "--stage-layers", "1,0,1"],
     "--stage-layers gives 3 block counts, and the layout has pp=2 × virtual stages 1 = 2 stages"),
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--stage-layers", "1,0,2,1"],
     "--stage-layers 1,0,2,1 leaves a middle stage without a block"),
    (["--nproc", "2", "--pp", "2", "--stage-layers", "1,2"], "--stage-layers 1,2 gives 3 blocks, and the model has 4"),
    (["--nproc", "2", "--stage-layers", "4"], "--stage-layers cuts the blocks into pipeline stages, and there is one"),
    (["--nproc", "2", "--pp", "2", "--stage-layers", "two,two"], "--stage-layers must be comma-separated block counts"),
    (["--nproc", "2", "--pp", "2", "--stage-layers=-1,5"], "--stage-layers must be whole numbers of blocks"),
])
def test_a_cut_that_cannot_be_is_one_line(flags, message, tmp_path, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PLAIT_SPAWNED"):
        monkeypatch.delenv(name, raising=False)
    assert main(["train", *FOUR, "--out", str(tmp_path), *flags]) == 2
    stderr = capsys.readouterr().err
    lines = stderr.strip().splitlines()
    assert lines[0].startswith("plait: error: ") and message in lines[0], stderr
    assert lines[1].startswith("  hint: ") and "Traceback" not in stderr


def test_estimate_prices_each_stage_and_the_slowest_sets_the_pace(capsys):
    """Llama-3-405B-like cut of a 32-layer model: one block fewer at both ends, the first
    chunk only the embedding. Each rank's memory and micro-batch time are its own."""
    argv = ["estimate", "--model", "llama-7b", "--gpus", "16", "--dp", "2", "--tp", "2", "--pp", "4",
            "--grad-accum", "8", "--schedule", "interleaved", "--virtual-stages", "2", "--json"]
    assert main([*argv, "--stage-layers", "0,4,5,5,5,5,4,4"]) == 0
    uneven = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    even = json.loads(capsys.readouterr().out)
    assert [row["blocks"] for row in uneven["stages"]] == [[0, 5], [4, 5], [5, 4], [5, 4]]
    assert [row["blocks"] for row in even["stages"]] == [[4, 4]] * 4
    times = [row["micro_batch_s"] for row in uneven["stages"]]
    assert times[0] < min(times[1:])  # 5 blocks and the embedding, against 9 blocks
    # The schedule runs at the slowest rank's pace: 9 blocks against the even cut's 8.
    assert uneven["time"]["step_s"] > even["time"]["step_s"]
    memories = [row["memory_total"] for row in uneven["stages"]]
    assert uneven["memory"]["total"] == max(memories) and len(set(memories)) == 4
    assert main([*argv[:-1], "--stage-layers", "0,4,5,5,5,5,4,4"]) == 0
    text = capsys.readouterr().out
    assert "per pipeline stage (rank)" in text and "0+5" in text and "slowest: sets the pace" in text


def test_a_cut_given_through_the_api_is_checked_and_kept():
    """Layout(stage_layers=...) takes a list or a tuple (kept as a tuple, so the layout hashes)
    and refuses anything else in one PlaitError; the planner keeps a cut whose end stages hold
    no block even where pp is then more than the model's layers."""
    import dataclasses

    from plait.errors import PlaitError
    from plait.estimate.planner import plan
    from plait.layout import Layout
    from plait.models.gpt.config import get_preset

    assert Layout(pp=2, stage_layers=[1, 3]).stage_layers == (1, 3)
    for bad in (5, "3,4"):
        with pytest.raises(PlaitError, match="--stage-layers must be a list of block counts"):
            Layout(pp=2, stage_layers=bad)
    two_layers = dataclasses.replace(get_preset("tiny"), n_layers=2)
    rows = plan(two_layers, gpus=4, global_batch=8, hardware="cpu", stage_layers=(0, 1, 1, 0), seq_len=32)
    assert rows and {row["pp"] for row in rows} == {4}


def test_plan_takes_a_fixed_cut(capsys):
    assert main(["plan", "--model", "llama-7b", "--gpus", "16", "--global-batch", "32", "--stage-layers", "7,9,9,7",
                 "--top", "3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(row["pp"] == 4 for row in rows)


def test_a_checkpoint_from_uneven_stages_resumes_under_even_ones(tmp_path):
    """Written under pp 2 × v 2 with the end chunks empty; resumed under plain 1F1B pp 2 at
    step 2, the run continues as the uneven one did."""
    uneven = ["--nproc", "2", "--pp", "2", "--grad-accum", "2", "--schedule", "interleaved", "--virtual-stages", "2",
              "--stage-layers", "0,2,2,0"]
    first = run_plait("train", *FOUR, *uneven, "--save-every", "2", "--keep-checkpoints", "0",
                      "--out", str(tmp_path / "uneven"))
    assert first.returncode == 0, first.stderr
    resumed = run_plait("train", *FOUR, "--nproc", "2", "--pp", "2", "--grad-accum", "2",
                        "--resume", str(tmp_path / "uneven" / "checkpoints" / "step-00000002"),
                        "--out", str(tmp_path / "even"))
    assert resumed.returncode == 0, resumed.stderr
    assert_losses_close(run_losses(tmp_path / "even"), run_losses(tmp_path / "uneven")[2:])
    assert_params_close(run_weights(tmp_path / "even"), run_weights(tmp_path / "uneven"))
