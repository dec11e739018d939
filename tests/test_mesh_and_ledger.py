"""The layout's grid arithmetic, the mesh made from it, and the ledger's formulas, without processes."""

from __future__ import annotations

import pytest

from plait.errors import PlaitError
from plait.runtime.comm import Ledger, naive_exchange_bytes, ring_wire_bytes
from plait.runtime.env import ProcessEnv
from plait.layout import Layout
from plait.runtime.mesh import init_mesh


def test_layout_that_does_not_match_the_world_names_all_four_numbers():
    with pytest.raises(PlaitError) as err:
        Layout(pp=2, dp=3, tp=2).check_world(8)
    assert err.value.message == "layout dp=3 × tp=2 × pp=2 = 12 does not match world size 8"


def test_dp_fills_what_tp_and_pp_leave():
    assert Layout.fill(8, tp=2, pp=2) == Layout(pp=2, dp=2, tp=2)
    with pytest.raises(PlaitError, match="world size 6 is not divisible by tp=4 × pp=1"):
        Layout.fill(6, tp=4)


def test_tp_varies_fastest_then_dp_then_pp():
    shape = Layout(pp=2, dp=2, tp=2)
    assert [tuple(shape.coords(r)[a] for a in ("pp", "dp", "tp")) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]


def test_degree_below_one_is_refused():
    with pytest.raises(PlaitError, match="--tp must be a whole number of at least 1, got 0"):
        Layout(tp=0)


def test_combinations_not_built_yet_are_refused_not_ignored():
    with pytest.raises(PlaitError, match="--ep 2 with --cp 2: expert parallelism with context parallelism is not "
                                         "built yet"):
        Layout(dp=2, ep=2, cp=2)
    assert Layout(dp=2, ep=2, zero=3).zero == 3  # ZeRO shards the experts over edp
    with pytest.raises(PlaitError, match="--ep 2 does not divide dp = 3"):
        Layout(dp=3, ep=2)
    with pytest.raises(PlaitError, match=r"unknown --cp-kind 'striped' \(hint: choose one of: ring, ulysses\)"):
        Layout(cp=2, cp_kind="striped")


def test_a_mesh_takes_another_strategy_choice_but_not_other_degrees():
    mesh = init_mesh(env=ProcessEnv("single", 0, 1, 0, "127.0.0.1", 29500))
    assert mesh.with_layout(zero=3).layout.zero == 3 and mesh.layout.zero == 0
    with pytest.raises(PlaitError, match="a mesh built for dp=1 tp=1 pp=1 cannot take dp=2"):
        mesh.with_layout(dp=2)


def test_single_process_mesh_has_no_groups():
    mesh = init_mesh(env=ProcessEnv("single", 0, 1, 0, "127.0.0.1", 29500))
    assert [mesh.size(a) for a in ("pp", "dp", "tp", "world")] == [1, 1, 1, 1]
    assert mesh.group("dp") is None and mesh.is_main


def test_single_process_mesh_rejects_a_bigger_layout():
    with pytest.raises(PlaitError, match="dp=2 × tp=1 × pp=1 = 2 does not match world size 1"):
        init_mesh(dp=2, env=ProcessEnv("single", 0, 1, 0, "127.0.0.1", 29500))


@pytest.mark.parametrize("n, factor", [(2, 1.0), (4, 1.5), (8, 1.75)])
def test_ring_all_reduce_is_two_n_minus_one_over_n(n, factor):
    assert ring_wire_bytes("all_reduce", 1000, n) == factor * 1000


def test_ring_gather_scatter_and_point_to_point():
    assert ring_wire_bytes("all_gather", 800, 4) == 600
    assert ring_wire_bytes("reduce_scatter", 800, 4) == 600
    assert ring_wire_bytes("broadcast", 800, 4) == 800
    assert ring_wire_bytes("send", 800, 2) == 800
    assert ring_wire_bytes("all_reduce", 800, 1) == 0


def test_naive_exchange_grows_quadratically_and_ring_does_not():
    payload = 4 * 10**6  # 1 M fp32 parameters
    assert naive_exchange_bytes(payload, 8) == payload * 8 * 7
    ring_total = ring_wire_bytes("all_reduce", payload, 8) * 8
    assert ring_total == 2 * 7 * payload
    assert naive_exchange_bytes(payload, 8) / ring_total == 4.0  # N/2 times more


def test_ledger_separates_purposes_and_diffs_snapshots():
    ledger = Ledger()
    ledger.record("dp", "all_reduce", 100, 2)
    snap = ledger.snapshot()
    ledger.record("dp", "all_reduce", 100, 2)
    ledger.record("tp", "all_gather", 400, 4)
    ledger.record("world", "all_reduce", 8, 2, purpose="telemetry")
    assert ledger.wire() == {"dp": {"all_reduce": 200.0}, "tp": {"all_gather": 300.0}}
    assert ledger.since(snap) == {"dp": {"all_reduce": 100.0}, "tp": {"all_gather": 300.0}}
    assert ledger.wire("telemetry") == {"world": {"all_reduce": 8.0}}
    assert ledger.calls() == 3 and ledger.calls("telemetry") == 1


def test_a_models_state_is_broadcast_in_packs_of_one_dtype_each_value_landing_in_its_tensor(monkeypatch):
    """comm.broadcast_many: 2 fp32 tensors, an int64 one, a non-contiguous fp32 view and one
    past the pack size. Each pack is one broadcast (the ledger's count, the same bytes as one a
    tensor), and each tensor gets back the source's values, the view too."""
    import torch

    from plait.runtime import comm

    monkeypatch.setattr(comm, "PACKED_BROADCAST_BYTES", 64)
    sent: list[int] = []

    def from_source(tensor, axis, src=0, purpose=comm.TRAIN):  # the source rank's values: 100 + position
        axis.ledger.record(axis.name, "broadcast", tensor.numel() * tensor.element_size(), axis.size, purpose)
        sent.append(tensor.numel())
        tensor.copy_(torch.arange(tensor.numel(), dtype=tensor.dtype).view_as(tensor) + 100)

    monkeypatch.setattr(comm, "broadcast", from_source)
    axis = comm.Axis("dp", 2, 0, None, Ledger())
    a, b, steps, big = torch.zeros(3), torch.zeros(2, 2), torch.zeros(2, dtype=torch.int64), torch.zeros(20)
    view = torch.zeros(2, 4).t()[1]  # 2 elements, stride 4
    comm.broadcast_many([a, steps, b, big, view], axis, purpose=comm.SETUP)
    assert sent == [7, 2, 20, 2]  # a and b; steps; big alone; the view (the open pack is big's)
    assert a.tolist() == [100, 101, 102] and b.flatten().tolist() == [103, 104, 105, 106]
    assert steps.tolist() == [100, 101] and big[-1].item() == 119 and view.tolist() == [100, 101]
    tally = axis.ledger.tallies[(comm.SETUP, "dp", "broadcast")]
    assert (tally.calls, tally.payload) == (4, 4 * (7 + 20 + 2) + 8 * 2)


def test_each_tensor_is_broadcast_over_its_own_axis_axis_by_axis_in_the_order_first_met(monkeypatch):
    """comm.broadcast_each: tensors over dp and over edp (an expert's), mixed; one packed
    broadcast an axis, dp's first (its tensor came first), each tensor in its axis's pack."""
    import torch

    from plait.runtime import comm

    calls: list[tuple[str, list[int]]] = []
    monkeypatch.setattr(comm, "broadcast_many",
                        lambda tensors, axis, src=0, purpose=comm.TRAIN: calls.append((axis.name, [t.numel() for t in tensors])))
    dp, edp = comm.Axis("dp", 4, 0, None, Ledger()), comm.Axis("edp", 2, 0, None, Ledger())
    comm.broadcast_each([(torch.zeros(1), dp), (torch.zeros(2), edp), (torch.zeros(3), dp), (torch.zeros(4), edp)],
                        purpose=comm.SETUP)
    assert calls == [("dp", [1, 3]), ("edp", [2, 4])]
