"""`plait train --compile`: each block's forward compiled (torch.compile, Inductor's C++ on
CPU). The compiled layouts (dp 2, ZeRO-3 × 2, tp 2 + sp, pp 2, recomputation, 16 bits, and
zero1 × tp 2 + sp on 4 ranks) are rows of the parity matrix (tests/matrix.py): each trains
the model of one eager process on the same global batch. Here: graph breaks, counted by
torch's own counter, are none inside a block for every such row; the rows share one compile
cache (TORCHINDUCTOR_CACHE_DIR), and a later run of the same graph finds it there, so a
restart does not compile again; and what cannot compile is refused in one line.
"""

from __future__ import annotations

import pytest

from tests.matrix import ROWS, MatrixRuns, parametrized, train
from tests.worldlib import run_plait

COMMON = ["--model", "tiny", "--steps", "4", "--micro-batch", "2", "--seq-len", "32", "--eval-every", "4",
          "--eval-samples", "8", "--sample-tokens", "0", "--warmup-steps", "1", "--no-report"]
COMPILED = [param for param in parametrized() if "--compile" in ROWS[param.values[0]].flags]
DP2, TP2_SP = "gpt/n2+compile", "gpt/n2-tp2-sp-ga2+compile"


@pytest.mark.parametrize("name", COMPILED)
def test_a_compiled_layout_has_no_graph_break_and_says_what_compiling_cost(matrix_runs: MatrixRuns,
                                                                           name: str) -> None:
    run = matrix_runs.rows[name]
    compiled = run.summary["compile"]
    assert compiled["graph_breaks"] == 0, compiled["break_reasons"]  # selective too: its core is a checkpoint
    assert compiled["graphs"] >= 1
    assert compiled["seconds"] > 0
    assert f"  compile     {compiled['seconds']:.1f} s in the first step; {compiled['graphs']} graph(s), " \
           f"{compiled['graph_breaks']} graph break(s)" in run.stdout


@pytest.mark.slow
def test_a_later_run_finds_every_graph_in_the_cache(matrix_runs: MatrixRuns, tmp_path) -> None:
    """The restart's case: the dp2 row run again, on the same cache, compiles nothing."""
    first = matrix_runs.rows[DP2].summary["compile"]
    later = train(tmp_path, matrix_runs.root, "gpt", ROWS[DP2].flags, matrix_runs.compile_env).summary["compile"]
    assert later["cache_misses"] == 0 and later["cache_hits"] >= 1, later
    assert later["seconds"] < first["seconds"] or first["cache_misses"] == 0


def test_compile_without_a_cxx_compiler_is_one_clear_line(tmp_path):
    proc = run_plait("train", *COMMON, "--out", str(tmp_path), "--compile", "--nproc", "1",
                     env_extra={"CXX": "/nonexistent/g++"})
    assert proc.returncode != 0
    assert "--compile on a CPU needs a C++ compiler, and /nonexistent/g++ was not found" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_compile_with_zb_h1_is_refused_before_spawning(tmp_path):
    """zb-h1's W step captures inputs with hooks inside the block, which a compiled block skips."""
    proc = run_plait("train", *COMMON, "--out", str(tmp_path), "--compile", "--nproc", "2", "--pp", "2",
                     "--grad-accum", "2", "--schedule", "zb-h1")
    assert proc.returncode != 0
    assert "--compile cannot run the zb-h1 schedule" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_tensor_parallel_graph_is_found_in_the_cache_by_a_later_process(matrix_runs: MatrixRuns, tmp_path) -> None:
    """TP's collectives are custom ops whose axis argument is a name, not an address: a later
    process finds the tp2 + sp row's graph."""
    matrix_runs.rows[TP2_SP]
    later = train(tmp_path, matrix_runs.root, "gpt", ROWS[TP2_SP].flags, matrix_runs.compile_env).summary["compile"]
    assert later["cache_misses"] == 0 and later["cache_hits"] >= 1, later
