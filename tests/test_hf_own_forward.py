"""Pipeline stages that run a transformers model's own forward (plait/models/hf/own_forward.py)
train the one-process model under tp × pp and SP × pp (tests/worlds/hf_own_forward_world.py,
one 4-rank spawn): GPT-Neo (learned positions added to the token embedding, SP), MPT (ALiBi
biases), DeepSeek-V3.2 (an indexer that must have the causal mask made, SP), BioGPT (scaled
embeddings, learned positions); GPT-Neo at dp 2 × pp 2 with ZeRO-3 and full recomputation."""

from __future__ import annotations

from typing import Any

import pytest

from tests.worldlib import run_world

pytest.importorskip("transformers")

FAMILIES = ("gpt_neo", "mpt", "deepseek_v32", "biogpt")


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    _, reports = run_world("hf_own_forward_world.py", 4, tmp_path_factory.mktemp("own"), ",".join(FAMILIES))
    return reports


@pytest.mark.parametrize("family", FAMILIES)
def test_own_forward_stages_under_tp_train_the_one_process_model(reports: list[dict[str, Any]],
                                                                  family: str) -> None:
    for report in reports:
        case = report[family]
        assert case["own"], f"{family}: cut by the usual stages, not its own forward"
        assert case["losses"] == pytest.approx(case["expected"], rel=1e-5)
        assert case["worst"] < 1e-5, f"{family}: a parameter differs by {case['worst']:.2e} from one process's"


def test_own_forward_stages_under_zero3_and_recompute(reports: list[dict[str, Any]]) -> None:
    for report in reports:
        assert report["zero3"]["losses"] == pytest.approx(report["zero3"]["expected"], rel=1e-5)
