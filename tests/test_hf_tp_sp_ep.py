"""tp 2 + SP × dp 2 × ep 2 trains transformers mixtures of experts like one process
(tests/worlds/hf_tp_sp_ep_world.py, one 4-rank spawn): Mixtral (no shared expert) and
DeepSeek-V3 (shared experts beside routed ones, kept whole under SP)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.worldlib import run_world

pytest.importorskip("transformers")

FAMILIES = ("mixtral", "deepseek_v3")


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    _, reports = run_world("hf_tp_sp_ep_world.py", 4, tmp_path_factory.mktemp("tp_sp_ep"), ",".join(FAMILIES))
    return reports[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_tp_sp_and_ep_together_train_the_one_process_model(reports: dict[str, Any], family: str) -> None:
    case = reports[family]
    assert case["losses"] == pytest.approx(case["expected"], rel=1e-4)
    assert case["worst"] < 1e-5, f"{family}: a parameter differs by {case['worst']:.2e} from one process's"
