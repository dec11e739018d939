"""Every strategy through `plait train`, against one process with the same global batch.

The library-level worlds (tests/test_*_worlds.py) prove each strategy in depth; these runs
prove the command a user types wires them the same way: losses every step, held-out loss,
final weights where the run writes them, and plait estimate's prediction for the run's own
layout next to what it measured.
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tests.parity import assert_grad_norms_close, assert_losses_close, assert_params_close
from tests.worldlib import Runs, run_plait, split_slow

COMMON = ["--model", "tiny", "--steps", "4", "--micro-batch", "2", "--seq-len", "32", "--eval-every", "2",
          "--eval-samples", "8", "--sample-tokens", "0", "--warmup-steps", "1"]


def run(out, *flags):
    proc = run_plait("train", *COMMON, "--out", str(out), *flags)
    assert proc.returncode == 0, proc.stderr
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    weights = out / "model.safetensors"
    params = {k: v.flatten().tolist() for k, v in load_file(weights).items()} if weights.exists() else None
    return metrics, summary, params


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process; global batch 2·k for k = 1, 2, 4 (each run on first use)."""
    return Runs(lambda k: run(tmp_path_factory.mktemp(f"ref{k}"), "--nproc", "1", "--grad-accum", str(k)))


CASES = {
    # name: (flags, reference accumulation, loss rtol). TP and PP sum in another order
    # (rtol 1e-4, as the issues allow); TP's parameter atol is 2e-5 because AdamW turns
    # last-bit gradient differences of near-zero components into ~1e-5 (see tests/parity.py;
    # the TP worlds check the same runs with SGD at 1e-7).
    "zero3-n4": (["--nproc", "4", "--zero", "3"], 4, 1e-5),
    "zero2-offload-n2": (["--nproc", "2", "--zero", "2", "--offload"], 2, 1e-5),
    "tp2-sp": (["--nproc", "2", "--tp", "2", "--sp"], 1, 1e-4),
    "pp2-1f1b": (["--nproc", "2", "--pp", "2", "--grad-accum", "2"], 2, 1e-4),
    "dp2-pp2-zbh1": (["--nproc", "4", "--dp", "2", "--pp", "2", "--grad-accum", "2",
                             "--schedule", "zb-h1"], 4, 1e-4),
    # Recomputation changes no number, only memory and (under TP) traffic.
    "tp2-sp-recompute": (["--nproc", "2", "--tp", "2", "--sp", "--recompute", "full"], 1, 1e-4),
    "dp2-pp2-zero3-recompute": (["--nproc", "4", "--dp", "2", "--pp", "2", "--zero", "3", "--grad-accum", "2",
                                 "--recompute", "full"], 4, 1e-5),
    # Products of strategies: each pair, then all of them at once.
    "dp2-tp2-zero1-sp": (["--nproc", "4", "--tp", "2", "--zero", "1", "--sp", "--grad-accum", "2"], 4, 1e-4),
    "tp2-pp2-zbh1": (["--nproc", "4", "--tp", "2", "--pp", "2", "--grad-accum", "2", "--schedule", "zb-h1"], 2, 1e-4),
    "dp2-pp2-zero2": (["--nproc", "4", "--dp", "2", "--pp", "2", "--zero", "2", "--grad-accum", "2"], 4, 1e-5),
    "dp2-tp2-pp2-zero3-sp": (["--nproc", "8", "--dp", "2", "--tp", "2", "--pp", "2", "--zero", "3", "--sp",
                              "--grad-accum", "2"], 4, 1e-4),
}


# `make test` keeps the product no world in `make test` covers, all three axes at once (dp × tp
# and tp × pp inside it), and recomputation under TP; DDP, ZeRO, offload, TP, SP, each schedule
# and dp × pp are proved by the worlds (tests/test_*_worlds.py). The rest of the matrix, the
# two-axis products dp × tp (ZeRO-1, SP) and tp × pp (ZB-H1) included, runs in `make test-all`.
FAST = ("tp2-sp-recompute", "dp2-tp2-pp2-zero3-sp")


@pytest.mark.parametrize("case", split_slow(CASES, FAST))
def test_strategy_trains_the_same_model_as_one_process(case, reference, tmp_path):
    flags, accum, rtol = CASES[case]
    metrics, summary, params = run(tmp_path, *flags)
    ref_metrics, ref_summary, ref_params = reference[accum]
    assert_losses_close([m["loss"] for m in metrics], [m["loss"] for m in ref_metrics], rtol=rtol)
    # The norm of the whole gradient, summed over whatever splits it (it clips every step).
    assert_grad_norms_close([m["grad_norm"] for m in metrics], [m["grad_norm"] for m in ref_metrics], rtol=10 * rtol)
    assert_losses_close(list(summary["val_losses"].values()), list(ref_summary["val_losses"].values()), rtol=rtol)
    if params is not None:
        assert_params_close(params, ref_params, rtol=rtol, atol=2e-5 if "--tp" in flags else 5e-6)
    # The prediction for this very layout: model states and every collective's bytes exact
    # (the gradient norm's all-reduces of one or two float64 aside), activations within 10%.
    predicted, mem = summary["predicted"], summary["mem"]
    for kind in ("params", "grads", "optim"):  # ZeRO-3's params: shards + the units gathered at once
        assert predicted["memory"][kind] == pytest.approx(mem[kind], rel=0.01), kind
    assert predicted["memory"]["activations"] == pytest.approx(mem["activations_peak"], rel=0.10)
    measured = summary["comm_per_step"]
    keys = {(a, o) for src in (predicted["comm"], measured) for a, ops in src.items() for o in ops}
    for axis, op in keys:
        got, want = measured.get(axis, {}).get(op, 0), predicted["comm"].get(axis, {}).get(op, 0)
        assert 0 <= got - want <= 16, (axis, op, got, want)  # the norm's one or two scalars on top


@pytest.mark.slow
def test_zero3_memory_is_the_formula(tmp_path):
    """--zero 3 on 4 ranks: parameters, gradients and Adam state each 1/4 (fp32: 16Ψ/N in all)."""
    _, summary, _ = run(tmp_path, "--nproc", "4", "--zero", "3", "--steps", "1", "--eval-every", "0")
    psi = summary["num_params"]
    shard = -(-psi // 4)  # padded to a multiple of N
    mem = summary["mem"]
    # Parameters: the shard, plus tiny's three units (root and two blocks) whole at once.
    assert mem["params"] == pytest.approx(4 * shard + 4 * psi, abs=4 * 4 * 8)
    assert mem["grads"] == pytest.approx(4 * shard, abs=4 * 4 * 8)
    assert mem["optim"] == pytest.approx(8 * shard, abs=8 * 4 * 8)
    assert mem["params"] - 4 * psi + mem["grads"] + mem["optim"] < 16 * psi / 4 * 1.01


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """One process on a 4-layer tiny GPT, global batch 8: the reference for interleaving."""
    return run(tmp_path_factory.mktemp("ref-l4"), "--model", "tiny,n_layers=4", "--nproc", "1", "--grad-accum", "4")


@pytest.mark.slow
@pytest.mark.parametrize("zero", ["2", "3"])
def test_zero_over_interleaved_chunks_trains_the_same_model(four_layers, tmp_path, zero):
    """Two chunks per pipeline rank: each chunk's backward reduces only its own groups."""
    metrics, summary, params = run(tmp_path, "--model", "tiny,n_layers=4", "--nproc", "4", "--dp", "2", "--pp", "2",
                                   "--grad-accum", "2", "--schedule", "interleaved", "--virtual-stages", "2",
                                   "--zero", zero)
    ref_metrics, _, ref_params = four_layers
    assert_losses_close([m["loss"] for m in metrics], [m["loss"] for m in ref_metrics], rtol=1e-5)
    assert_grad_norms_close([m["grad_norm"] for m in metrics], [m["grad_norm"] for m in ref_metrics], rtol=1e-4)
    assert_params_close(params, ref_params, rtol=1e-5, atol=5e-6)
    predicted, measured = summary["predicted"]["comm"]["dp"], summary["comm_per_step"]["dp"]
    assert measured["reduce_scatter"] == predicted["reduce_scatter"]  # m per step, no chunk twice


@pytest.mark.slow
def test_a_pipeline_samples_the_same_text_as_one_process(tmp_path):
    """The closing sample through pp 2 × tp 2 with SP: the last stage draws, every rank follows."""
    samples = []
    for name, flags in (("one", ["--nproc", "1", "--grad-accum", "2"]),
                        ("3d", ["--nproc", "4", "--pp", "2", "--tp", "2", "--sp", "--grad-accum", "2"])):
        _, summary, _ = run(tmp_path / name, *flags, "--steps", "2", "--sample-tokens", "12")
        samples.append(summary["sample"])
    assert samples[0] == samples[1] and len(samples[0]) >= len("def ") + 1


@pytest.fixture(scope="module")
def bf16_reference(tmp_path_factory):
    """One process in bf16 (its fp32 masters in ZeRO-1's optimizer over one rank), global batch 8."""
    return run(tmp_path_factory.mktemp("ref-bf16"), "--nproc", "1", "--zero", "1", "--precision", "bf16",
               "--grad-accum", "4")


BF16_CASES = {
    "dp2-zero2-offload": ["--nproc", "2", "--zero", "2", "--offload", "--grad-accum", "2"],
    "dp2-tp2-pp2-zero3-sp": ["--nproc", "8", "--dp", "2", "--tp", "2", "--pp", "2", "--zero", "3", "--sp",
                             "--grad-accum", "2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", BF16_CASES)
def test_bf16_trains_the_same_model_as_one_process_in_bf16(bf16_reference, tmp_path, case):
    """bf16 weights and gradients, fp32 masters: the layouts agree with one bf16 process as far as
    bf16 sums in another order allow, and the prediction (bf16 states, 12 B of master + Adam) holds."""
    metrics, summary, params = run(tmp_path, *BF16_CASES[case], "--precision", "bf16")
    ref_metrics, ref_summary, _ = bf16_reference
    assert summary["layout"]["precision"] == "bf16"
    assert_losses_close([m["loss"] for m in metrics], [m["loss"] for m in ref_metrics], rtol=2e-3)
    assert_grad_norms_close([m["grad_norm"] for m in metrics], [m["grad_norm"] for m in ref_metrics], rtol=1e-2)
    predicted, mem = summary["predicted"], summary["mem"]
    for kind in ("params", "grads", "optim"):
        assert predicted["memory"][kind] == pytest.approx(mem[kind], rel=0.01), kind
    assert predicted["memory"]["activations"] == pytest.approx(mem["activations_peak"], rel=0.10)
    for axis, ops in predicted["comm"].items():
        for op, want in ops.items():
            assert 0 <= summary["comm_per_step"][axis][op] - want <= 16, (axis, op)
