"""ZeRO on 2 and 4 processes (CPU, Gloo): parity, memory to the byte, the ledger, overlap.

Two worlds, each running many configurations (tests/worlds/zero_parity.py), then the real
Trainer at every stage (tests/worlds/zero_trainer.py); the 2-process world runs in `make test`,
the 4-process one in `make test-all`:
- parity with one process on the same global batch: the loss of every step and the clipped
  gradient norm, rtol 1e-5, for every run; final parameters: SGD with momentum at rtol 1e-5
  and atol 1e-7 (for parameters that pass through zero): its update is linear in the
  gradient and passes fp32 summation-order noise on unamplified; AdamW at tests/parity.py's
  bar (rtol 1e-5, atol 5e-6), because Adam divides by √v + eps, and where a gradient nearly
  cancels that noise becomes an O(lr) parameter difference (torch DDP shows the same).
- bf16 parameters with fp32 master weights: losses rtol 1e-4, gradient norms rtol 1e-2,
  SGD parameters atol 1e-3 (a few bf16 ulps; they move by 2.4e-2).
- memory: measured (distinct storages) == the paper's formula with padding, to the byte;
  the tiny GPT needs no padding at n = 2 or 4, so there it equals the formula exactly.
- the ledger of every step == 2(n-1)/n·Ψ·b (stages 1-2) or 3(n-1)/n·Ψ·b (stage 3), exactly,
  plus the clipping all-reduce of one float64 (8 bytes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from plait.estimate.layout import Workload, stages
from plait.estimate.memory import StateBytes, gathered_params
from plait.estimate.traffic import dp_traffic
from plait.models.gpt.config import get_preset
from tests.worlds.zero_common import STEPS, padded_state_bytes, paper_states
from plait.runtime.comm import ring_wire_bytes
from tests.worldlib import run_world


@pytest.fixture(scope="module")
def n2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("zero2")
    return run_world("zero_parity.py", 2, tmp, "n2", str(tmp / "checkpoints"))[1]


@pytest.fixture(scope="module")
def n4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("zero4")
    return run_world("zero_parity.py", 4, tmp, "n4", str(tmp / "checkpoints"))[1]


# The 4-process world repeats a subset at another ring size: the long matrix (`make test-all`).
@pytest.fixture(params=["n2", pytest.param("n4", marks=pytest.mark.slow)])
def world(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return request.getfixturevalue(request.param)


def _bytes(run: dict[str, Any]) -> tuple[int, int, int]:
    """Bytes per element of parameters, gradients and optimizer state (K) for a run."""
    b = 2 if "bfloat16" in run["dtype"] else 4
    k = 8 if run["optim"].startswith("adamw") else 4  # Adam: m, v; SGD: momentum
    if b == 2 or run["offload"]:
        k += 4  # the fp32 master copy of the shard
    return b, b, k


def test_parity_with_one_process(world: list[dict[str, Any]]) -> None:
    runs = world[0]["runs"]
    for name, run in runs.items():
        assert run["loss_excess"] <= 0, (name, run["losses"], run["ref_losses"])
        assert run["norm_excess"] <= 0, (name, run["norms"])
        if "param_excess" in run:  # all but bf16 AdamW (a rounding tip moves a parameter by ±lr)
            assert run["param_excess"] <= 0, (name, run["param_excess"])
    # --optimizer-kernel compiled: every step in the one pass (ZeRO makes the state up front),
    # over runs of consecutive pieces of a group (ZeRO-1: 6 runs for the 11 pieces a rank owns)
    compiled = {name: run["compiled_steps"] for name, run in runs.items() if run["optim"] == "adamw-compiled"}
    assert compiled == ({} if world[0]["n"] == 4 else {f"gpt-bf16-adamw-compiled-z{s}": STEPS for s in (1, 3)})
    for name in compiled:
        assert 0 < runs[name]["compiled_tensors"] < runs[name]["pieces"], (name, runs[name]["compiled_tensors"])
        assert runs[name]["compiled_plans"] == 1, name  # the runs cut at the first step, kept after
    stages = {(r["stage"], r["accum"], r["offload"]) for r in runs.values() if r["optim"] == "sgd"}
    if world[0]["n"] == 2:  # every stage, with and without accumulation and offload
        assert {(s, a, o) for s in (1, 2, 3) for a, o in ((1, False), (2, False), (2, True))} <= stages


def test_memory_matches_the_formulas_to_the_byte(world: list[dict[str, Any]]) -> None:
    n = world[0]["n"]
    for rank, report in enumerate(world):
        for name, run in report["runs"].items():
            per = StateBytes(*_bytes(run))
            if run["stage"] == 0:
                expected = paper_states(0, run["num_params"], n, StateBytes(4, 4, 8))
            else:
                expected = padded_state_bytes(run["stage"], run["groups"], n, rank, per)
            assert run["mem"] == expected, (name, rank)
            if run["kind"] == "gpt":  # no padding: plait.estimate's figure itself, to the byte
                assert run["mem"] == paper_states(run["stage"], run["num_params"], n, per), (name, rank)


def test_padding_is_real_and_small(world: list[dict[str, Any]]) -> None:
    """The user MLP has odd sizes: measured differs from Ψ/N by at most the padding."""
    n, run = world[0]["n"], world[0]["runs"]["mlp-sgd-z3-accum2"]
    formula = paper_states(3, run["num_params"], n, StateBytes(4, 4, 4))
    pad = sum(-m % n for m in run["groups"])
    assert pad > 0
    assert 0 < run["mem"]["params"] - formula["params"] <= 4 * pad


def test_ledger_matches_the_formulas_exactly(world: list[dict[str, Any]]) -> None:
    n = world[0]["n"]
    clip = ring_wire_bytes("all_reduce", 8, n)  # one float64: the sum of squares of the gradient shards
    for name, run in world[0]["runs"].items():
        precision = "bf16" if "bfloat16" in run["dtype"] else "fp32"
        if run["stage"] == 0:  # torch clips DDP's whole gradients
            want = dp_traffic(run["num_params"], Workload(dp=n, precision=precision))["dp"]
        else:
            padded = sum(-(-m // n) * n for m in run["groups"])
            work = Workload(dp=n, zero=run["stage"], grad_accum=run["accum"], precision=precision,
                            prefetch=run["prefetch"], reshard_after_forward=run["reshard"])
            want = {**dp_traffic(padded, work)["dp"], "all_reduce": clip}
        for step in run["ledger"]:
            assert step == want, (name, step, want)
    z1, z3 = world[0]["runs"]["gpt-adamw-z1"], world[0]["runs"]["gpt-adamw-z3"]
    psi_b = 4 * z1["num_params"]
    assert z1["ledger"][0]["reduce_scatter"] + z1["ledger"][0]["all_gather"] == 2 * (n - 1) / n * psi_b
    assert z3["ledger"][0]["reduce_scatter"] + z3["ledger"][0]["all_gather"] == 3 * (n - 1) / n * psi_b


def test_reductions_overlap_backward_and_units_are_prefetched(world: list[dict[str, Any]]) -> None:
    runs = world[0]["runs"]
    for stage in (1, 2):
        events = runs[f"gpt-adamw-z{stage}"]["events"][0]
        launched = [e for e in events if e[0].startswith("reduce_scatter")]
        assert len(launched) == len(runs[f"gpt-adamw-z{stage}"]["groups"]) > 1
        assert all(e[0] == "reduce_scatter" for e in launched)  # every one launched inside backward
    # Stage 3, units [root, block 0, block 1]: forward gathers root then prefetches each block;
    # backward regathers root, prefetches block 1 then block 0, and reduces each unit as soon
    # as autograd has its whole gradient (block 1 first, the root, whose embedding is used
    # first, last).
    assert runs["gpt-adamw-z3"]["events"][0] == [
        ["all_gather", 0], ["all_gather", 1], ["all_gather", 2],
        ["all_gather", 0], ["all_gather", 2], ["all_gather", 1],
        ["reduce_scatter", 2], ["reduce_scatter", 1], ["reduce_scatter", 0], ["backward_end", -1]]


def test_prefetch_depth_and_keeping_units_bound_what_is_gathered(n2: list[dict[str, Any]]) -> None:
    """The deep GPT's 4 block units: at most 1 + prefetch of them gathered at once (the root
    aside), and all 4 when kept from forward to backward; the memory estimate says the same
    bytes, and the gathers run in the order the depth implies."""
    config = dataclasses.replace(get_preset("tiny"), n_layers=4)
    (share,) = stages(config, 1, 1)
    runs = n2[0]["runs"]
    block = runs["deep-adamw-z3-prefetch1"]["groups"][1]
    root = runs["deep-adamw-z3-prefetch1"]["groups"][0]
    for depth in (0, 1, 2):
        run = runs[f"deep-adamw-z3-prefetch{depth}"]
        assert run["gathered_units"] == 1 + depth, (depth, run["gathered_units"])
        assert run["gathered"] == 4 * (root + (1 + depth) * block), depth
        assert run["gathered"] == 4 * gathered_params(config, Workload(dp=2, zero=3, prefetch=depth), share)
    for name in ("deep-adamw-z3-keep", "deep-sgd-z3-keep-accum2"):
        assert runs[name]["gathered_units"] == 4, name
        assert runs[name]["gathered"] == 4 * (root + 4 * block), name
        kept = Workload(dp=2, zero=3, reshard_after_forward=False)
        assert runs[name]["gathered"] == 4 * gathered_params(config, kept, share), name
    forward = [e for e in runs["deep-adamw-z3-prefetch2"]["events"][0] if e[0] == "all_gather"][:5]
    assert forward == [["all_gather", g] for g in (0, 1, 2, 3, 4)]
    events = runs["deep-adamw-z3-keep"]["events"][0]  # one gather per unit, none in backward
    assert [e for e in events if e[0] == "all_gather"] == [["all_gather", g] for g in (0, 1, 2, 3, 4)]


def test_the_trainer_meter_already_counts_stages_1_and_3(world: list[dict[str, Any]]) -> None:
    """Without the meter change (see docs/zero.md), stage-2 shards and fp32 masters are missed."""
    runs = world[0]["runs"]
    assert runs["gpt-adamw-z1"]["meter"] == runs["gpt-adamw-z1"]["mem"]
    z3, n = runs["gpt-adamw-z3"], world[0]["n"]
    # Stage 3's parameters also count the units gathered at once: tiny's root and both
    # blocks are all whole together (forward: root, block 0, block 1 prefetched).
    assert z3["gathered"] == 4 * sum(-(-m // n) * n for m in z3["groups"])
    assert z3["meter"] == {**z3["mem"], "params": z3["mem"]["params"] + z3["gathered"]}


def test_agrees_with_torch_fsdp2(n2: list[dict[str, Any]]) -> None:
    fsdp = n2[0]["fsdp2"]
    assert fsdp["loss_excess"] <= 0, (fsdp["ours"], fsdp["losses"])
    assert fsdp["norm_excess"] <= 0  # the clip hides a gradient's scale from losses and weights
    assert fsdp["param_excess"] <= 0


def test_checkpoints_move_between_ddp_and_every_stage(n2: list[dict[str, Any]]) -> None:
    """Saved under one layout after 2 steps, resumed under another: the 3-step run, to rtol 1e-5."""
    for name, result in n2[0]["checkpoints"].items():
        assert result["loss_excess"] <= 0, (name, result)
        if "param_excess" in result:
            assert result["param_excess"] <= 0, (name, result)


def test_backend_without_reduce_scatter_is_a_clear_error(n2: list[dict[str, Any]]) -> None:
    message = n2[0]["backend_error"]
    assert "--zero 2 needs reduce_scatter" in message and "--backend gloo" in message, message


def test_the_trainer_trains_with_every_stage(world: list[dict[str, Any]]) -> None:
    """The real Trainer (tiny GPT, 2 micro-batches), run in the same world: the same run at every stage."""
    runs, n = world[0]["trainer"], world[0]["n"]
    ddp, psi = runs["zero0"], 115008  # get_preset("tiny").num_params()
    assert set(runs) == {"zero0", "zero1", "zero2", "zero3", "zero3-offload"}
    for name, history in runs.items():
        assert len(history) == len(ddp) == 4, name
        for got, want in zip(history, ddp):
            assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (name, got["step"])
            if "val_loss" in want:
                assert abs(got["val_loss"] - want["val_loss"]) <= 1e-5 * want["val_loss"], name
        stage = int(name[4])
        formula = paper_states(stage, psi, n, StateBytes(4, 4, 12 if "offload" in name else 8))
        assert {k: history[-1]["mem"][k] for k in formula} == formula, name
