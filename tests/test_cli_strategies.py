"""`plait train`'s own claims beside the parity matrix (tests/matrix.py, whose rows run each
strategy and product through the command against one process): ZeRO-3's memory formula,
interleaved chunks reduced once, and a pipeline's closing sample equal to one process's.
"""

from __future__ import annotations

import json

import pytest

from tests.matrix import ROWS
from tests.worldlib import run_plait

COMMON = ["--model", "tiny", "--steps", "4", "--micro-batch", "2", "--seq-len", "32", "--eval-every", "2",
          "--eval-samples", "8", "--sample-tokens", "0", "--warmup-steps", "1"]


def run(out, *flags):
    proc = run_plait("train", *COMMON, "--out", str(out), *flags)
    assert proc.returncode == 0, proc.stderr
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return metrics, summary


@pytest.mark.slow
def test_zero3_memory_is_the_formula(tmp_path):
    """--zero 3 on 4 ranks: parameters, gradients and Adam state each 1/4 (fp32: 16Ψ/N in all)."""
    _, summary = run(tmp_path, "--nproc", "4", "--zero", "3", "--steps", "1", "--eval-every", "0")
    psi = summary["num_params"]
    shard = -(-psi // 4)  # padded to a multiple of N
    mem = summary["mem"]
    # Parameters: the shard, plus tiny's three units (root and two blocks) whole at once.
    assert mem["params"] == pytest.approx(4 * shard + 4 * psi, abs=4 * 4 * 8)
    assert mem["grads"] == pytest.approx(4 * shard, abs=4 * 4 * 8)
    assert mem["optim"] == pytest.approx(8 * shard, abs=8 * 4 * 8)
    assert mem["params"] - 4 * psi + mem["grads"] + mem["optim"] < 16 * psi / 4 * 1.01


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["2", "3"])
def test_zero_over_interleaved_chunks_reduce_scatters_each_chunk_once(matrix_runs, zero):
    """Two chunks per pipeline rank (the parity matrix's rows): each chunk's backward reduces
    only its own groups, m times a step, no chunk twice."""
    row = next(name for name, row in ROWS.items() if row.family == "gpt-4-layers" and f"--zero {zero}" in row.layout)
    summary = matrix_runs.rows[row].summary
    predicted, measured = summary["predicted"]["comm"]["dp"], summary["comm_per_step"]["dp"]
    assert measured["reduce_scatter"] == predicted["reduce_scatter"]


@pytest.mark.slow
def test_a_pipeline_samples_the_same_text_as_one_process(tmp_path):
    """The closing sample through pp 2 × tp 2 with SP: the last stage draws, every rank follows."""
    samples = []
    for name, flags in (("one", ["--nproc", "1", "--grad-accum", "2"]),
                        ("3d", ["--nproc", "4", "--pp", "2", "--tp", "2", "--sp", "--grad-accum", "2"])):
        _, summary = run(tmp_path / name, *flags, "--steps", "2", "--sample-tokens", "12")
        samples.append(summary["sample"])
    assert samples[0] == samples[1] and len(samples[0]) >= len("def ") + 1
