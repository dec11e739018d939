"""A transformers Llama through plait.parallelize with no plan and no adapter from the user:
the adapter read from its declared tp_plan and pp_plan gives every layout. Each matches one
process on every step's loss (rtol 1e-4: TP and PP change the summation order).

One 2-rank spawn (tests/worlds/hf_pipeline_world.py small): pp 2 (1F1B, interleaved, zb-h1,
tied embeddings, under ZeRO-3 a tied head holding a bias, full recomputation), tp 2 (± sp, a Qwen2, tied embeddings; the head split by vocabulary), the refusal of a model plait cannot cut. The 8-rank
dp 2 × tp 2 × pp 2 with ZeRO-1 (and with ZeRO-3, SP, recompute, tied embeddings) is `slow`
(about a minute and a half on 2 busy cores).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.parity import assert_losses_close
from tests.worldlib import run_world

pytest.importorskip("transformers")
# `make test-all`: `make test` cuts transformers models by their declared plans in
# tests/test_hf_plans_worlds.py (1F1B), test_hf_train_worlds.py and examples/hf_tp_pp.py (tp × pp).
pytestmark = pytest.mark.slow

LAYERS = 4  # tests/worlds/hf_pipeline_world.py: SHAPE


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    _, reports = run_world("hf_pipeline_world.py", 2, tmp_path_factory.mktemp("hf_pp"), "small")
    return reports


@pytest.mark.parametrize("run,reference", [("pp_1f1b", "reference"), ("pp_interleaved", "reference"),
                                           ("pp_zb", "reference"), ("pp_tied", "reference_tied"),
                                           ("pp_tied_bias_zero3", "reference_tied_bias"),
                                           ("pp_recompute", "reference")])
def test_pipelined_llama_matches_one_process(small: list[dict[str, Any]], run: str, reference: str) -> None:
    for report in small:
        assert report[run]["stages"] == ["PipelineStage"] * (2 if run == "pp_interleaved" else 1)
        assert_losses_close(report[run]["losses"], report[reference]["losses"], rtol=1e-4)


@pytest.mark.parametrize("run,reference", [("tp", "reference"), ("tp_sp", "reference"),
                                           ("qwen2_tp", "reference_qwen2"), ("tp_tied", "reference_tied")])
def test_tensor_parallel_by_the_adapters_plan_matches_one_process(small: list[dict[str, Any]], run: str,
                                                                  reference: str) -> None:
    """The user's calls keep working: whole logits, and `labels=` gives the one-process loss."""
    for report in small:
        assert_losses_close(report[run]["losses"], report[reference]["losses"], rtol=1e-4)
        assert_losses_close([report[run]["labels_loss"]], [report[reference]["labels_loss"]], rtol=1e-5)
        assert report[run]["logits_shape"] == [4, 16, 128]
        assert report[run]["head_rows"] == 64  # split by vocabulary, gathered whole (under SP too)


def test_one_tp_all_reduce_per_region_in_backward(small: list[dict[str, Any]]) -> None:
    """Attention and MLP each all-reduce their input gradient once per layer, and the
    vocabulary-split head once (its input enters a column layer); the embedding all-reduces
    in forward only."""
    for report in small:
        assert report["tp"]["backward_tp_all_reduces"] == 2 * LAYERS + 1
        assert report["qwen2_tp"]["backward_tp_all_reduces"] == 2 * LAYERS + 1


def test_sequence_parallel_moves_slices_not_sums(small: list[dict[str, Any]]) -> None:
    for report in small:
        assert report["tp"]["tp_ops"] == ["all_gather", "all_reduce"]  # the logits gathered whole
        assert "all_gather" in report["tp_sp"]["tp_ops"] and "reduce_scatter" in report["tp_sp"]["tp_ops"]


def test_a_model_plait_cannot_cut_gets_one_error_naming_the_missing_piece(small: list[dict[str, Any]]) -> None:
    assert small[0]["refusal"] == (
        "PlaitError: pp 2 needs to know the blocks of MyNet (hint: give parallelize an adapter "
        "(plait.parallel.seam.ModelAdapter: parts and run_stage), or use nn.Sequential)")


@pytest.mark.slow
def test_dp_tp_pp_with_zero_matches_one_process(tmp_path) -> None:
    """dp 2 × tp 2 × pp 2: ZeRO-1; and ZeRO-3 with SP, full recomputation, tied embeddings."""
    _, reports = run_world("hf_pipeline_world.py", 8, tmp_path, "3d", timeout=600)
    for report in reports:
        assert_losses_close(report["dp_tp_pp_zero1"]["losses"], report["reference"]["losses"], rtol=1e-4)
        assert_losses_close(report["dp_tp_sp_pp_zero3_recompute"]["losses"], report["reference_tied"]["losses"],
                            rtol=1e-4)
