"""A transformers GPT-2 through plait's public API on 2 processes matches one process.

One spawn (tests/worlds/hf_gpt2_world.py): tp 2 with the GPT-2 adapter's plan (Conv1D
layers, q|k|v fused in c_attn), dp 2, ZeRO-3 × 2 and ZeRO-3 × 2 with full recomputation;
where the model seam provides them, tp 2 with sequence parallelism and pp 2 (1F1B, and interleaved).
"""

from __future__ import annotations

from typing import Any

import pytest

from plait.parallel import seam
from plait.parallel.tensor import regions
from tests.parity import assert_losses_close
from tests.worldlib import run_world

pytest.importorskip("transformers")

NEEDS_PIPELINE_SEAM = pytest.mark.skipif(not hasattr(seam, "Parts"),
                                         reason="the pipeline cuts a model through its adapter's parts "
                                                "(plait.parallel.seam.Parts) once the seam is in")
NEEDS_SEQUENCE_OPS = pytest.mark.skipif(not hasattr(regions, "gather_to_replicated"),
                                        reason="SP around the blocks needs regions.gather_to_replicated")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    _, reports = run_world("hf_gpt2_world.py", 2, tmp_path_factory.mktemp("hf_gpt2"))
    return reports


@pytest.mark.parametrize("run", ["tp", pytest.param("tp_sp", marks=NEEDS_SEQUENCE_OPS)])
def test_tensor_parallel_gpt2_matches_one_process(world: list[dict[str, Any]], run: str) -> None:
    """Losses every step within 1e-4; the gathered parameters (c_attn's three parts put back
    in place), and those a checkpoint holds, equal the one-process model's after training;
    logits come back whole."""
    for report in world:
        tp = report[run]
        assert_losses_close(tp["losses"], report["reference"]["losses"], rtol=1e-4)
        assert tp["param_max_rel"] < 1e-4, tp["param_max_rel"]
        assert tp["checkpoint_max_rel"] == tp["param_max_rel"]  # the fused q|k|v parts in place
        assert tp["c_attn_local"] == [32, 48]  # Conv1D: (in, 3·out/tp), the output dim split
        assert tp["logits_shape"] == [4, 16, 128]
        assert tp["logits_max_diff"] < 1e-5


def test_one_tp_all_reduce_per_region_in_backward(world: list[dict[str, Any]]) -> None:
    """Attention (fused q|k|v) and MLP each all-reduce their input gradient once per layer."""
    for report in world:
        assert report["tp"]["backward_tp_all_reduces"] == 2 * report["tp"]["layers"]


@pytest.mark.parametrize("run", ["dp", "zero3", "zero3_recompute"])
def test_data_parallel_gpt2_matches_one_process(world: list[dict[str, Any]], run: str) -> None:
    """Each dp rank's loss is the mean over its half of the batch; their mean is the global loss."""
    losses = [sum(step) / len(world) for step in zip(*(report[run]["losses"] for report in world))]
    assert_losses_close(losses, world[0]["reference"]["losses"], rtol=1e-5)
    assert world[0][run]["recomputed_blocks"] == (world[0]["tp"]["layers"] if run == "zero3_recompute" else 0)


@NEEDS_PIPELINE_SEAM
@pytest.mark.parametrize("run", ["pp", "pp_interleaved"])
def test_pipeline_gpt2_matches_one_process(world: list[dict[str, Any]], run: str) -> None:
    """pp 2 with 1F1B, and interleaved (2 virtual stages per rank): the embedding and the tied
    head on different ranks, every step's loss; the checkpoint holds the trained weights."""
    for report in world:
        assert_losses_close(report[run]["losses"], report["reference"]["losses"], rtol=1e-4)
        assert report[run]["checkpoint_max_rel"] < 1e-4


@pytest.mark.slow
@NEEDS_PIPELINE_SEAM
def test_dp_tp_pp_with_zero1_gpt2_matches_one_process(tmp_path: Any) -> None:
    """dp 2 × tp 2 × pp 2 with ZeRO-1 on 8 ranks: the dp-mean loss of every step."""
    _, reports = run_world("hf_gpt2_world.py", 8, tmp_path, "3d")
    for report in reports:
        assert_losses_close(report["3d"]["losses"], report["reference"]["losses"], rtol=1e-4)
        assert report["3d"]["checkpoint_max_rel"] < 1e-4  # ZeRO-1's pieces of fused tp slices
