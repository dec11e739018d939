"""Bytes on the wire: ring formulas, and each strategy's traffic worked by hand."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from plait.estimate import estimate_layout
from plait.estimate.traffic import (
    dp_traffic,
    estimate_comm,
    naive_comm,
    pp_traffic,
    ring_bytes,
    tp_traffic,
)
from plait.estimate.layout import Workload, stages
from plait.models.gpt.config import get_preset

pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


LEDGER_AXES = {"dp", "tp", "pp"}
LEDGER_OPS = {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "send", "recv"}
PSI = 1_000_000


def test_ring_formulas() -> None:
    s = 1024.0
    assert ring_bytes("all_reduce", s, 4) == 2 * 3 / 4 * s
    assert ring_bytes("all_gather", s, 4) == ring_bytes("reduce_scatter", s, 4) == 3 / 4 * s
    assert ring_bytes("broadcast", s, 4) == ring_bytes("send", s, 2) == ring_bytes("recv", s, 2) == s
    assert ring_bytes("all_to_all", s, 4) == 3 / 4 * s  # each rank keeps its own quarter
    assert ring_bytes("all_reduce", s, 1) == 0.0
    with pytest.raises(ValueError):
        ring_bytes("all_to_one", s, 4)


def test_ring_formulas_agree_with_the_ledger() -> None:
    runtime = pytest.importorskip("plait.runtime.comm")
    for op in LEDGER_OPS:
        for n in (1, 2, 3, 8):
            assert ring_bytes(op, 4096, n) == runtime.ring_wire_bytes(op, 4096, n)


def test_ddp_all_reduce_once_per_step() -> None:
    """2(n−1)/n·Ψ·b, whatever the accumulation (no_sync skips all but the last)."""
    for m in (1, 4):
        traffic = dp_traffic(PSI, Workload(dp=8, grad_accum=m, precision="fp32"))
        assert traffic == {"dp": {"all_reduce": 2 * 7 / 8 * PSI * 4}}


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_1_2_reduce_scatter_and_all_gather(zero: int) -> None:
    """ZeRO-1 reduces once per step; ZeRO-2 keeps no whole gradient, so once per micro-batch."""
    traffic = dp_traffic(PSI, Workload(dp=8, zero=zero, grad_accum=4, precision="bf16"))
    times = 4 if zero == 2 else 1
    assert traffic == {"dp": {"reduce_scatter": times * 7 / 8 * PSI * 2, "all_gather": 7 / 8 * PSI * 2}}


def test_zero3_three_times_n_minus_one_over_n() -> None:
    traffic = dp_traffic(PSI, Workload(dp=8, zero=3, precision="fp32"))
    assert sum(traffic["dp"].values()) == pytest.approx(3 * 7 / 8 * PSI * 4)
    assert traffic["dp"]["all_gather"] == pytest.approx(2 * 7 / 8 * PSI * 4)
    accumulated = dp_traffic(PSI, Workload(dp=8, zero=3, grad_accum=4, precision="fp32"))
    assert accumulated["dp"]["all_gather"] == pytest.approx(4 * 2 * 7 / 8 * PSI * 4)


def test_tp_four_all_reduces_per_layer_per_micro_batch() -> None:
    cfg = get_preset("llama-7b")
    layout = Workload(tp=8, micro_batch=2, seq_len=1024, grad_accum=3, precision="bf16")
    stage = stages(cfg, 8, 1)[0]
    act = 2 * 1024 * cfg.d_model * 2
    ring = 2 * 7 / 8
    per_micro_batch = (4 * cfg.n_layers + 2) * act + 3 * 2 * 1024 * 4  # + embed, head, loss
    assert tp_traffic(cfg, layout, stage)["tp"] == {"all_reduce": pytest.approx(3 * ring * per_micro_batch)}


def test_sp_moves_the_same_activation_bytes_plus_regathers() -> None:
    cfg = get_preset("llama-7b")
    tp = Workload(tp=4, seq_len=512, precision="bf16")
    sp = Workload(tp=4, seq_len=512, precision="bf16", sp=True)
    stage = stages(cfg, 4, 1)[0]
    act, ring, L = 512 * cfg.d_model * 2, 3 / 4, cfg.n_layers
    traffic = tp_traffic(cfg, sp, stage)["tp"]
    assert traffic["reduce_scatter"] == pytest.approx(ring * (4 * L + 2) * act)
    assert traffic["all_gather"] == pytest.approx(ring * (6 * L + 3) * act)
    # Without the re-gathers, SP moves exactly what TP's all-reduces move.
    regathers = ring * (2 * L + 1) * act
    norms = 2 * ring * (2 * L + 1) * cfg.d_model * 2
    plain = tp_traffic(cfg, tp, stage)["tp"]["all_reduce"]
    assert sum(traffic.values()) - regathers - norms == pytest.approx(plain)


def test_sp_cut_at_the_blocks_keeps_the_ends_on_the_whole_sequence() -> None:
    """A transformers model under SP (whole_sequence_ends): its embedding and head all-reduce as
    without SP, the first stage gathers its blocks' input slices again in backward, the last
    gathers its blocks' output in forward, and the final norm sums nothing. Per pp stage."""
    gpt = replace(get_preset("llama-7b"), n_layers=4)
    hf = replace(gpt, whole_sequence_ends=True)
    layout = Workload(tp=4, pp=2, seq_len=512, precision="bf16", sp=True)
    act, ring, h = 512 * gpt.d_model * 2, 3 / 4, gpt.d_model
    first, last = stages(gpt, 4, 2)
    loss = 2 * ring * 3 * 512 * 4
    norms = 2 * ring * 2 * 2 * h * 2  # two blocks' two norms, bf16 gradients
    assert tp_traffic(hf, layout, first)["tp"] == pytest.approx(
        {"all_gather": ring * (6 * 2 + 1) * act, "reduce_scatter": ring * 4 * 2 * act,
         "all_reduce": 2 * ring * act + norms})
    assert tp_traffic(hf, layout, last)["tp"] == pytest.approx(
        {"all_gather": ring * (6 * 2 + 1) * act, "reduce_scatter": ring * 4 * 2 * act,
         "all_reduce": 2 * ring * act + loss + norms})
    gpt_last = tp_traffic(gpt, layout, last)["tp"]  # the GPT's head re-gathers and reduce-scatters instead
    assert gpt_last["all_gather"] == pytest.approx(ring * (6 * 2 + 2) * act)
    assert gpt_last["all_reduce"] == pytest.approx(loss + norms + 2 * ring * h * 2)


def test_pp_send_and_recv_per_boundary() -> None:
    cfg = get_preset("llama-7b")  # untied: no embedding-gradient swap
    layout = Workload(pp=4, micro_batch=1, seq_len=256, grad_accum=8, precision="bf16")
    message = 256 * cfg.d_model * 2
    first, middle = stages(cfg, 1, 4)[0], stages(cfg, 1, 4)[1]
    assert pp_traffic(cfg, layout, first)["pp"] == {"send": 8 * message, "recv": 8 * message}
    assert pp_traffic(cfg, layout, middle)["pp"] == {"send": 16 * message, "recv": 16 * message}


def test_a_pipeline_message_carries_every_residual_stream() -> None:
    """Hyper-connections (DeepSeek-V4's four streams) widen what a stage hands the next: its
    messages, its two receive buffers and their time on the wire, four times one stream's."""
    from plait.estimate.exposed import message_s
    from plait.estimate.hardware import get_hardware
    from plait.estimate.memory import stage_buffers

    one, four = get_preset("llama-7b"), replace(get_preset("llama-7b"), residual_streams=4)
    layout = Workload(pp=4, micro_batch=1, seq_len=256, grad_accum=8, precision="bf16")
    middle = stages(one, 1, 4)[1]
    assert pp_traffic(four, layout, middle)["pp"]["send"] == 4 * pp_traffic(one, layout, middle)["pp"]["send"]
    message = 256 * one.d_model * 2
    assert stage_buffers(four, layout, middle) - stage_buffers(one, layout, middle) == 2 * 3 * message
    h100 = get_hardware("h100-sxm")
    latency = message_s(one, layout, h100, 1) - message / h100.message(2, 1)[1]
    assert message_s(four, layout, h100, 1) == pytest.approx(latency + 4 * message / h100.message(2, 1)[1])


def test_pp_tied_embeddings_swap_gradients() -> None:
    cfg = get_preset("tiny")  # tied
    layout = Workload(pp=2, micro_batch=2, seq_len=32, grad_accum=2, precision="fp32")
    message, table = 2 * 32 * cfg.d_model * 4, cfg.vocab_size * cfg.d_model * 4
    first = stages(cfg, 1, 2)[0]
    assert pp_traffic(cfg, layout, first)["pp"] == {"send": 2 * message + table,
                                                    "recv": 2 * message + table}


def test_a_whole_tied_table_is_swapped_and_held_whole_under_tp() -> None:
    """GPT-2's tied embedding and head stay whole on every tp rank (vocab_split false): each
    stage holds all V rows and the pipeline's two copies swap the whole gradient."""
    split = replace(get_preset("tiny"), arch="gpt2", n_kv_heads=4)
    whole = replace(split, vocab_split=False)
    layout = Workload(tp=2, pp=2, micro_batch=2, seq_len=32, precision="fp32")
    table = split.vocab_size * split.d_model
    first_split, first_whole = stages(split, 2, 2)[0], stages(whole, 2, 2)[0]
    assert first_whole.params - first_split.params == table // 2
    swapped = pp_traffic(whole, layout, first_whole)["pp"]["send"] - pp_traffic(split, layout, first_split)["pp"]["send"]
    assert swapped == table // 2 * 4


def test_keys_are_the_ledgers() -> None:
    result = estimate_layout(get_preset("llama-70b"), dp=2, tp=8, pp=4, zero=1, sp=True,
                             grad_accum=8, precision="bf16", seq_len=2048)
    assert set(result["comm"]) == LEDGER_AXES
    for ops in result["comm"].values():
        assert set(ops) <= LEDGER_OPS
        assert all(wire > 0 for wire in ops.values())


def test_one_gpu_moves_nothing() -> None:
    assert estimate_comm(get_preset("tiny"), Workload()) == {}


def test_naive_totals_beside_ring() -> None:
    """The seeds' Ψ·b·N·(N−1) against ring all-reduce's 2(N−1)·Ψ·b for the whole group."""
    naive = naive_comm(None, Workload(dp=8, precision="fp32"), PSI)["dp"]
    assert naive["naive_bytes"] == PSI * 4 * 8 * 7
    assert naive["plait_bytes"] == pytest.approx(2 * 7 * PSI * 4)
    assert naive["naive_bytes"] / naive["plait_bytes"] == pytest.approx(8 / 2)


def test_naive_tp_and_pp() -> None:
    cfg = get_preset("llama-7b")
    layout = Workload(tp=4, pp=2, seq_len=128, precision="bf16")
    out = 128 * cfg.d_model * 2
    naive = naive_comm(cfg, layout)
    assert naive["tp"]["naive_bytes"] == 16 * out * 4 * 3  # 16 layers per stage
    assert naive["pp"]["naive_bytes"] == out  # one boundary, forward
    assert naive["pp"]["plait_bytes"] == 2 * out  # forward activation + backward gradient


def test_estimate_package_never_imports_torch() -> None:
    """plait.estimate must load in well under a second: no torch anywhere in it."""
    package = Path(__file__).resolve().parents[1] / "plait" / "estimate"
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert not name.startswith(("torch", "numpy", "plait.parallel", "plait.runtime",
                                            "plait.train")), f"{path.name} imports {name}"
