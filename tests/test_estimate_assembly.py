"""One assembly of the step (plait/estimate/time.py): every estimate is each rank's record
of named parts, assembled as the slowest rank's path, with pipeline messages as delays on the
schedule's edges; the planner assembles its layouts through the same function."""

from __future__ import annotations

from dataclasses import replace

import pytest

from plait.estimate.exposed import clip_s, overhead_s
from plait.estimate.hardware import get_hardware
from plait.estimate.layout import Workload
from plait.estimate.network import inter_node
from plait.estimate.ops import accumulate_params_s
from plait.estimate.pipeline import Crowd, makespan, rank_ends
from plait.estimate.time import RankCost, StepCosts, assemble, crowd_of, estimate_time_params_only, step_costs
from plait.models.gpt.config import get_preset
from plait.estimate.planner import plan, plan_layouts, plan_request, row_layout, search_for
from plait.estimate.time import estimate_time

CPU, H100 = get_hardware("cpu"), get_hardware("h100-sxm")
THIRD = 1 / 3


def test_a_message_is_a_delay_on_the_edge_not_time_of_either_rank() -> None:
    """1F1B on 2 ranks, one micro-batch: F on rank 0, its activations d later, F and B on
    rank 1, the gradient d later, B on rank 0. Rank 1 ends d + its own work after rank 0's
    forward; rank 0 ends a second d and its backward later."""
    f0, b0, f1, b1, d = 1.0, 2.0, 3.0, 6.0, 0.5
    ends = rank_ends("1f1b", 2, 1, 1, [f0 + b0, f1 + b1], THIRD, edge_s=d)
    assert ends == pytest.approx((f0 + d + f1 + b1 + d + b0, f0 + d + f1 + b1), rel=1e-12)
    assert makespan("1f1b", 2, 1, 1, [3.0, 9.0], THIRD, edge_s=0.0) == pytest.approx(f0 + f1 + b1 + b0)


def test_the_step_is_the_slowest_path_to_the_clip_then_the_slowest_update() -> None:
    """As the loop runs it: each rank's path to the clip's all-reduce (its end, then its own dp
    sync), the slowest; then every rank updates at once. Under 1F1B rank 0 ends last, yet rank
    1's dp sync is long: the path to the clip is rank 1's, and the update after it is rank 0's
    (the longer), though no one rank holds both; the parts add up. Before, each rank's update
    sat in its own path, and the step was the longest path of the two, 1 s shorter here."""
    layout = Workload(pp=2, grad_accum=4)
    ranks = (RankCost(3.0, update=3.0), RankCost(6.0, dp=5.0, update=2.0))
    step = assemble(layout, CPU, StepCosts(ranks, model_flops=1.0, hardware_flops=1.0, clip=0.25, overhead=0.5))
    ends = rank_ends("1f1b", 2, 4, 1, [3.0, 6.0], THIRD)
    assert ends[0] > ends[1] and ends[1] + 5.0 > ends[0] and step.critical_rank == 1
    assert step.step_s == pytest.approx(ends[1] + 5.0 + 0.25 + 3.0 + 0.5, rel=1e-12)
    assert step.step_s == pytest.approx(max(ends[0] + 3.0, ends[1] + 5.0 + 2.0) + 1.0 + 0.75, rel=1e-12)
    assert (step.dp_s, step.optimizer_s) == (5.0, 3.25)
    parts = step.compute_s + step.bubble_s + step.pp_s + step.dp_s + step.optimizer_s + step.overhead_s
    assert parts == pytest.approx(step.step_s, rel=1e-12)
    swapped = assemble(layout, CPU, StepCosts((RankCost(3.0, dp=5.0, update=2.0), RankCost(6.0, update=3.0)), 1.0, 1.0))
    assert swapped.critical_rank == 0 and swapped.step_s == pytest.approx(ends[0] + 5.0 + 3.0, rel=1e-12)


def test_on_a_crowded_host_the_dp_sync_takes_its_price_and_the_accumulation_the_runs_pace() -> None:
    """Two threads a core (pipeline.Crowd(2.0)), 1F1B, two stages at 3 s a micro-batch, one
    micro-batch, each rank 1 s of accumulation and a 1 s dp sync: rank 0's last backward ends
    at 4.0 s, rank 1's accumulation and sync sharing the cores with it from 2 to 4 s
    (tests/test_estimate_pipeline.py works it by hand). Rank 0's accumulation then runs alone
    at twice the pace (0.5 s), its dp sync, a collective, at its price (1 s): the first stage's
    all-reduce, its pair alone at work, measured 23.0 ms against 23.8 calibrated with every
    rank at once. Had the sync run at the lone pace too, the step would be 0.5 s shorter."""
    layout = Workload(pp=2, grad_accum=1)
    ranks = (RankCost(3.0, accumulate=1.0, dp=1.0), RankCost(3.0, accumulate=1.0, dp=1.0))
    step = assemble(layout, CPU, StepCosts(ranks, 1.0, 1.0, crowd=Crowd(2.0)))
    assert step.critical_rank == 0 and step.step_s == pytest.approx(4.0 + 0.5 + 1.0, rel=1e-12)
    assert step.dp_s == 1.0 and step.compute_s == pytest.approx(2.5 + 0.5, rel=1e-12)  # its busy 2.5 s


def test_the_messages_share_is_what_the_path_waits_for_them() -> None:
    """The same ranks with and without a message's delay: the step grows by the delay the
    critical path waits (two edges per micro-batch's fill and drain at most), shown as pp_s."""
    layout = Workload(pp=2, grad_accum=4)
    ranks = (RankCost(3.0), RankCost(3.0))
    quiet, loud = (assemble(layout, CPU, StepCosts(ranks, 1.0, 1.0, message=d)) for d in (0.0, 0.1))
    assert quiet.pp_s == 0.0 and loud.pp_s == pytest.approx(loud.step_s - quiet.step_s, rel=1e-12)
    assert 0.2 - 1e-12 <= loud.pp_s <= 2 * 4 * 0.1


def test_a_model_known_by_its_size_pays_the_clip_and_the_accumulation() -> None:
    """The params-only estimate (and the CNN's, which shares it) once left out the clip's
    all-reduces and the adds of accumulated gradients that the GPT's estimate pays."""
    layout = Workload(dp=8, zero=1, micro_batch=2, grad_accum=4, seq_len=512, precision="bf16")
    one = estimate_time_params_only(10**9, layout.replace(grad_accum=1), H100, 8)
    four = estimate_time_params_only(10**9, layout, H100, 8)
    links = inter_node(layout, 8)
    adds = accumulate_params_s(layout, 10**9, 2, H100)
    assert adds > 0 and four.compute_s == pytest.approx(4 * one.compute_s + adds, rel=1e-12)
    clip = clip_s(layout, H100, links)
    assert clip > 0 and four.optimizer_s > clip
    assert four.step_s == pytest.approx(four.compute_s + four.dp_s + four.optimizer_s + overhead_s(layout, H100, 8),
                                        rel=1e-12)


def test_the_planner_ranks_with_the_estimates_own_assembly() -> None:
    """The planner's rows are estimate_time's steps: on small over 4 CPU ranks whose
    collectives pay the ranks' lag (`Hardware.lags`), each of the top layouts, pipelines and
    tensor parallelism among them, is the assembly of its record."""
    lagging = replace(CPU, lags=((2, 1000.0, 0.0), (2, 20000.0, 1500.0), (4, 1000.0, 0.0), (4, 20000.0, 2500.0)))
    request = plan_request(get_preset("small"), gpus=4, global_batch=16, seq_len=128, hardware=lagging)
    search = search_for(request)
    found = search.best(5) + search.best(5, lambda w: w.pp > 1) + search.best(5, lambda w: w.tp > 1)
    assert any(layout.pp > 1 for layout in found) and any(layout.tp > 1 for layout in found)
    for layout in found:
        assert search._step[layout] == estimate_time(request.config, layout, request.hardware, 2).step_s
    # every layout priced (no --top) from the cached parts: the pruned plan's rows, priced afresh, to the bit
    assert plan_layouts(request)[:5] == plan_layouts(request, top=5)
    # an MoE whose tp splits the routed experts' rows only where ep does not deal them out: ep
    # changes a rank's compute, and the planner's cached compute is keyed by it
    moe = replace(get_preset("tiny-moe"), tp_routed_split=True)
    request = plan_request(moe, gpus=8, global_batch=16, seq_len=128, hardware=lagging, precision="fp32")
    search = search_for(request)
    found = search.best(10) + search.best(10, lambda w: w.ep > 1 and w.tp > 1)
    assert any(layout.ep > 1 and layout.tp > 1 for layout in found)
    for layout in found:
        assert search._step[layout] == estimate_time(moe, layout, lagging, request.gpus_per_node).step_s, layout


def test_a_host_that_runs_its_own_collectives_hides_nothing_behind_compute() -> None:
    """On a CPU (Gloo's collectives on the cores that compute) every transfer the step needs is
    exposed: ZeRO-3's gathers make it slower than ZeRO-1, as measured on 2 CPU ranks
    (benchmarks/planner_measured.py), where the GPU overlap model had it faster; on a GPU
    preset ZeRO-3's prefetched gathers still hide behind compute."""
    small = get_preset("small")
    one, three = (Workload(dp=2, zero=z, micro_batch=8, seq_len=128) for z in (1, 3))
    cpu_one, cpu_three = (estimate_time(small, w, CPU, 2) for w in (one, three))
    assert cpu_three.step_s > cpu_one.step_s and cpu_three.dp_s > cpu_one.dp_s
    big = get_preset("llama-7b")
    gpu = [estimate_time(big, Workload(dp=8, zero=z, micro_batch=2, seq_len=2048, precision="bf16"), H100, 8)
           for z in (1, 3)]
    assert gpu[1].dp_s < gpu[0].dp_s  # prefetched gathers behind compute


def test_ring_attention_runs_at_its_own_measured_rate() -> None:
    """cp's small attention calls: a hardware file that measured one rank's ring compute
    (plait calibrate --cp) prices a ring layout's attention at that rate; without it, at the
    whole core's."""
    from dataclasses import replace

    from plait.estimate.ops import attention_key, attention_time, ring_key

    small = get_preset("small")
    ring = Workload(cp=2, micro_batch=16, seq_len=128)
    core = attention_key(small, 16, 128, 1, "fp32")
    measured = replace(CPU, gemm=((core, 0.06), (ring_key(small, 128, 1, 2, "fp32"), 0.03)))
    whole = replace(CPU, gemm=((core, 0.06),))
    assert attention_time(small, ring, measured, 1) == pytest.approx(2 * attention_time(small, ring, whole, 1))
    ulysses = ring.replace(cp_kind="ulysses")
    assert attention_time(small, ulysses, measured, 1) == attention_time(small, ulysses, whole, 1)


def test_a_data_parallel_layout_pays_neither_the_lag_nor_the_send_recv_latency() -> None:
    """What machine.calibrate(data_parallel_only=True) leaves out prices no layout that splits
    no model: the plan of small over 2 CPU ranks (tests/worlds/planner_world.py's) ranks and
    prices its data-parallel rows alike with and without the ranks' lag and the send/recv
    latency, and its tensor-parallel and pipelined rows pay them."""
    measured = replace(CPU, lags=((2, 600.0, 0.0), (2, 2200.0, 400.0), (2, 10000.0, 1100.0)), p2p_latency_us=860.0)
    without = replace(measured, lags=(), p2p_latency_us=0.0)
    rows = [plan(get_preset("small"), gpus=2, global_batch=16, seq_len=128, hardware=hw, gpus_per_node=2,
                 precision="fp32") for hw in (measured, without)]
    data_parallel = [[row for row in found if row["tp"] == row["pp"] == row["cp"] == row["ep"] == 1]
                     for found in rows]
    assert len(data_parallel[0]) > 3 and data_parallel[0] == data_parallel[1]
    split = [{row_layout(row): row["step_s"] for row in found if row["tp"] > 1 or row["pp"] > 1} for found in rows]
    assert split[0].keys() == split[1].keys() and len(split[0]) > 3
    assert all(split[0][key] > split[1][key] for key in split[0]), split


def test_a_crowded_hosts_pipeline_is_priced_with_the_cores_its_waiting_ranks_leave() -> None:
    """Prices taken with two threads a core (Hardware.crowding 2: 4 one-thread ranks on 2
    cores). A pipeline's path is the event run of pipeline.rank_paths: its bubble is the time
    its critical rank sleeps, and its micro-batches' parts shrink alike to the time that rank
    worked (faster while others waited); the parts still add up to the step. Without a
    pipeline every rank works at once and nothing moves; nor does a pipeline on a host with a
    core for each thread (crowding 1), whatever lone speedups its file holds.

    On `small`, dp 2 × pp 2 with zb-h1 and micro-batch 4 × 2 was priced at 0.764 s from run
    10's 4-rank calibration and measured 0.699 s, 3% under dp 4's 0.721 (benchmarks/
    RESULTS.md, the planner's ranking)."""
    small = get_preset("small")
    crowded = replace(CPU, crowding=2.0)
    layout = Workload(dp=2, pp=2, schedule="zb-h1", micro_batch=4, grad_accum=2, seq_len=128)
    plain, shared = (estimate_time(small, layout, hw, 4) for hw in (CPU, crowded))
    assert shared.step_s < plain.step_s - 0.5 * plain.bubble_s and shared.compute_s < plain.compute_s
    for step in (plain, shared):
        parts = (step.compute_s + step.tp_s + step.bubble_s + step.pp_s + step.dp_s + step.offload_s
                 + step.optimizer_s + step.overhead_s)
        assert parts == pytest.approx(step.step_s, rel=1e-12)
    # a rank alone on its core measured 2.2 times as fast at micro-batch 4, 2.0 at 8, and 2.15
    # at 16: one figure for the host, their median, whatever the layout's micro-batch
    measured = replace(crowded, lone_by_micro_batch=((4, 2.2), (8, 2.0), (16, 2.15)))
    assert measured.lone_speedup == 2.15 and replace(crowded, lone_by_micro_batch=((4, 2.2), (8, 2.0))).lone_speedup \
        == pytest.approx(2.1) and crowded.lone_speedup == 0.0
    assert crowd_of(measured) == Crowd(2.0, 2.15)
    faster = estimate_time(small, layout, measured, 4)
    assert faster.step_s < shared.step_s and faster.bubble_s < shared.bubble_s + 1e-12
    # read under the cores' share (the planner check's run 44, its second calibration: 1.88),
    # the host's other work in that minute: priced as shared without loss (pipeline.Crowd.fastest)
    low = replace(crowded, lone_by_micro_batch=((1, 2.08), (2, 1.77), (4, 1.88), (8, 1.88), (16, 1.84)))
    assert low.lone_speedup == 1.88 and estimate_time(small, layout, low, 4) == shared
    dp4 = Workload(dp=4, micro_batch=4, seq_len=128)
    assert estimate_time(small, dp4, crowded, 4) == estimate_time(small, dp4, CPU, 4)
    quiet = replace(CPU, lone_by_micro_batch=((4, 2.2),))
    assert CPU.crowding == 1.0 and estimate_time(small, layout, quiet, 4) == plain
    # the plan keeps the estimate's assembly on a crowded host, and its pruning bound holds
    request = plan_request(small, gpus=4, global_batch=16, seq_len=128, hardware=crowded, precision="fp32")
    search = search_for(request)
    found = search.best(6) + search.best(6, lambda w: w.pp > 1)
    assert any(w.pp > 1 for w in found)
    for w in found:
        assert search._step[w] == estimate_time(small, w, crowded, request.gpus_per_node).step_s
    pruned, every = plan_layouts(request, top=6), plan_layouts(request, top=6, exhaustive=True)
    assert [row_layout(r) for r in pruned] == [row_layout(r) for r in every]


def test_a_measured_split_backward_prices_zb_h1_as_1f1b_times_its_ratio() -> None:
    """Hardware.split_backward: a host that measured ZB-H1's split (I + W) prices each rank's
    micro-batch at 1F1B's times the ratio at the nearest micro-batch, in place of what W makes
    again (a 4-rank pipeline's stages took 7-10% more CPU time with the split, priced 2% more
    by that), its forward's share shrunk to keep the forward 1F1B's. 1F1B is unchanged, and so
    is the split on a host without the table; the plan prices such a host's layouts as the
    estimate does."""
    from plait.estimate.ops import micro_batch_compute_s
    from plait.estimate.layout import layout_stages

    small = get_preset("small")
    measured = replace(CPU, split_by_micro_batch=((4, 1.12), (8, 1.09)))
    assert measured.split_backward(8) == 1.09 and measured.split_backward(2) == 1.12 and CPU.split_backward(8) == 0.0
    zb = Workload(dp=2, pp=2, schedule="zb-h1", micro_batch=8, seq_len=128)
    whole = replace(zb, schedule="1f1b")
    for stage in layout_stages(small, zb):
        plain = micro_batch_compute_s(small, whole, stage, measured)
        assert micro_batch_compute_s(small, zb, stage, measured) == pytest.approx(1.09 * plain, rel=1e-12)
        assert plain < micro_batch_compute_s(small, zb, stage, CPU) < 1.05 * plain  # W's extras, as priced
    assert estimate_time(small, whole, measured, 4) == estimate_time(small, whole, CPU, 4)
    assert estimate_time(small, zb, measured, 4).step_s > estimate_time(small, zb, CPU, 4).step_s
    # the forward stays 1F1B's (measured so); the split's extra is I's and W's
    split, plain = step_costs(small, zb, measured, 4), step_costs(small, whole, measured, 4)
    assert split.forward == pytest.approx(plain.forward / 1.09) and plain.forward == pytest.approx(1 / 3)
    for mine, theirs in zip(split.ranks, plain.ranks):
        assert mine.micro_batch * split.forward == pytest.approx(theirs.micro_batch * plain.forward, rel=1e-12)
    request = plan_request(small, gpus=4, global_batch=16, seq_len=128, hardware=measured, precision="fp32")
    search = search_for(request)
    split = search.best(6, lambda w: w.pp > 1 and w.schedule == "zb-h1")
    assert split
    for w in split:
        assert search._step[w] == estimate_time(small, w, measured, request.gpus_per_node).step_s


def test_a_split_backward_reading_that_rises_with_the_micro_batch_is_read_through_a_non_increasing_fit() -> None:
    """Hardware.split_backward: a calibration of 4 ranks on 2 cores (the planner check's run
    43) read the split at micro-batches 1 to 16 as 1.048, 1.082, 1.084, 1.000, 1.167. The
    pooled fit reads 1.076 at every one of them, and ZB-H1 at micro-batch 8 is priced at it,
    not at the 1.000 that had priced its split as free; a table already in order is read as
    it is."""
    noisy = replace(CPU, split_by_micro_batch=((1, 1.048), (2, 1.082), (4, 1.084), (8, 1.0), (16, 1.167)))
    assert [noisy.split_backward(mb) for mb in (1, 2, 4, 8, 16)] == pytest.approx([1.0762] * 5)
    partly = replace(CPU, split_by_micro_batch=((1, 1.111), (2, 1.011), (4, 1.051), (8, 1.041), (16, 1.047)))
    assert [partly.split_backward(mb) for mb in (1, 2, 4, 8, 16)] == pytest.approx([1.111] + [1.0375] * 4)
    quiet = ((1, 1.096), (2, 1.074), (4, 1.048), (8, 1.035), (16, 1.033))
    assert [replace(CPU, split_by_micro_batch=quiet).split_backward(mb) for mb, _ in quiet] == [r for _, r in quiet]
    small = get_preset("small")
    zb = Workload(dp=2, pp=2, schedule="zb-h1", micro_batch=8, seq_len=128)
    fitted = replace(CPU, split_by_micro_batch=((8, 1.0762),))
    assert estimate_time(small, zb, noisy, 4).step_s == pytest.approx(estimate_time(small, zb, fitted, 4).step_s, rel=1e-4)
    assert estimate_time(small, zb, noisy, 4).step_s > estimate_time(small, zb, replace(CPU, split_by_micro_batch=((8, 1.0),)), 4).step_s


def test_zeros_gather_of_the_updated_weights_runs_inside_the_update_after_the_clip() -> None:
    """ZeRO-1 and -2 gather the updated weights inside optimizer.step, after the clip, and the
    loop times it in its update phase: on `small`, dp 2 × pp 2, 4 ranks sharing 2 cores, ZeRO-1's
    update phase measured 42-45 ms where the report predicted 23.6 with the gather counted as
    exposed communication (benchmarks/RESULTS.md, "ZeRO-1 and -2 against ZeRO-0"). The gather
    is now each rank's `gather`, after the clip; dp_s still counts it (gather_s names it), and the
    report's predicted update holds it. A stack that hides it behind the next forward keeps it
    in the dp sync; ZeRO-0 and -3 have none."""
    from plait.estimate.network import collective_s
    from plait.estimate.exposed import dp_exposed_s, gather_after_update_s
    from plait.train.observe.timing import step_time_parts

    small, params, compute = get_preset("small"), 9_000_000, 0.3
    zero1 = Workload(dp=2, pp=2, zero=1, micro_batch=8, seq_len=128, precision="fp32")
    gather = gather_after_update_s(params, zero1, CPU, 0)
    buckets = params * 4 / zero1.bucket_bytes  # fp32 gradients: a reduce-scatter, then a gather, each bucket
    assert gather == pytest.approx(collective_s("all_gather", params * 4, 2, CPU, 0, buckets), rel=1e-12)
    assert dp_exposed_s(params, 0, zero1, CPU, 0, compute, THIRD) == pytest.approx(
        collective_s("reduce_scatter", params * 4, 2, CPU, 0, buckets), rel=1e-12)  # the sync holds no gather
    costs = step_costs(small, zero1, CPU, 4)
    assert all(rank.gather > 0 for rank in costs.ranks)
    step = assemble(zero1, CPU, costs)
    assert step.gather_s == max(rank.gather for rank in costs.ranks) and step.dp_s > step.gather_s
    parts = (step.compute_s + step.tp_s + step.bubble_s + step.pp_s + step.dp_s + step.offload_s
             + step.optimizer_s + step.overhead_s)
    assert parts == pytest.approx(step.step_s, rel=1e-12)
    report = step_time_parts({"time": step.as_dict(), "layout": {"hardware": CPU.name}}, step.step_s, 0.04)
    predicted = report["predicted"]
    assert predicted["optimizer"] == pytest.approx(step.optimizer_s + step.gather_s, rel=1e-12)
    assert predicted["exposed_comm"] == pytest.approx(step.dp_s - step.gather_s + step.pp_s + step.tp_s, rel=1e-12)
    for other in (replace(zero1, zero=0), replace(zero1, zero=3),
                  Workload(dp=64, zero=1, precision="bf16", micro_batch=16, seq_len=2048, stack="megatron-core")):
        assert gather_after_update_s(params, other, H100, 0) == 0.0, other


# Run 48's first calibration (4 ranks of `small` sharing 2 cores): one forward product's
# readings at micro-batches 1 to 16, 128 to 2048 rows, TFLOP/s.
READ_ROWS = ((128, 0.04699), (256, 0.06739), (512, 0.07346), (1024, 0.07269), (2048, 0.07502))


def _family(readings: tuple[tuple[int, float], ...], k: int = 384, n: int = 1024) -> tuple[tuple[str, float], ...]:
    return tuple((f"fp32 {rows}x{k}x{n}", rate) for rows, rate in readings)


def test_a_cpus_products_are_read_off_the_line_through_their_rows() -> None:
    """Hardware.rows_tflops: a CPU calibration's product at each row count is read on the line
    time = fixed + rows · per-row through every reading of its family (its other two dimensions
    the same), so that one reading's noise moves it by a fifth of itself; the line fits the
    readings by least squares on their relative errors, a reading on the line is read as it
    is, and the weight gradient's family runs along K. A GPU's queued products, a family of
    fewer than three and a product not measured read as they were."""
    hw = replace(CPU, gemm=_family(READ_ROWS))
    fitted = [hw.rows_tflops(f"fp32 {rows}x384x1024", 0) for rows, _ in READ_ROWS]
    seconds = [2 * rows * 384 * 1024 / (rate * 1e12) for (rows, _), rate in zip(READ_ROWS, fitted)]
    per_row = (seconds[-1] - seconds[0]) / (2048 - 128)
    assert all(t == pytest.approx(seconds[0] + per_row * (rows - 128), rel=1e-9) for (rows, _), t in
               zip(READ_ROWS, seconds))  # on one line
    assert seconds[0] - 128 * per_row > 0  # a fixed part: the weight read cold each call
    read = [2 * rows * 384 * 1024 / (rate * 1e12) for rows, rate in READ_ROWS]
    # least squares on relative errors: the residuals over each reading's time squared sum to
    # zero, and so do they times the rows (the normal equations)
    residuals = [(r - t) / r ** 2 for t, r in zip(seconds, read)]
    scale = sum(abs(e) for e in residuals)
    assert abs(sum(residuals)) < 1e-9 * scale
    assert abs(sum(e * rows for e, (rows, _) in zip(residuals, READ_ROWS))) < 1e-9 * scale * 2048
    # this product at 4 sequences against 8, a sequence: read alone 0.99x, off the line 1.07x
    assert read[2] / 4 / (read[3] / 8) == pytest.approx(0.9895, abs=1e-3)
    assert seconds[2] / 4 / (seconds[3] / 8) == pytest.approx(1.071, abs=1e-3)
    on_line = replace(CPU, gemm=_family(tuple((rows, 2 * rows * 384 * 1024 / ((50e-6 + rows * 1e-7) * 1e12))
                                              for rows, _ in READ_ROWS)))
    assert all(on_line.rows_tflops(key, 0) == pytest.approx(rate, rel=1e-12) for key, rate in on_line.gemm)
    weights = replace(CPU, gemm=tuple((f"fp32 384x{rows}x1024", rate) for rows, rate in READ_ROWS))
    assert weights.rows_tflops("fp32 384x512x1024", 1) == pytest.approx(fitted[2], rel=1e-12)
    assert weights.rows_tflops("fp32 384x512x1024", 0) == weights.gemm_tflops("fp32 384x512x1024") == 0.07346
    assert replace(hw, queues_kernels=True).rows_tflops("fp32 512x384x1024", 0) == 0.07346
    assert replace(CPU, gemm=_family(READ_ROWS[2:4])).rows_tflops("fp32 512x384x1024", 0) == 0.07346
    assert hw.rows_tflops("fp32 512x384x1023", 0) == 0.0
    falling = replace(CPU, gemm=_family(((128, 0.08), (256, 0.07), (512, 0.06))))  # a negative fixed part: through zero
    assert len({round(falling.rows_tflops(key, 0), 12) for key, _ in falling.gemm}) == 1


def test_a_stages_products_are_priced_off_their_lines_so_one_micro_batchs_noise_moves_them_a_fraction() -> None:
    """ops.block_gemm_s reads each of a block's products along its tokens (M forward and for the
    input gradient, K for the weight gradient): every product of `small` timed at micro-batches
    1 to 16 on a line (a fixed 40 µs a call), then every reading at micro-batch 4 taken 10%
    fast, as one calibration's noise can. Read one by one, the block at 4 sequences would be
    priced 9.1% under the line; read off the lines, 2.3% under."""
    from plait.estimate.ops import _block_gemm_s, block_gemms, gemm_key

    small = get_preset("small")
    products: dict[str, float] = {}
    for mb in (1, 2, 4, 8, 16):
        for g in block_gemms(small, mb * 128, 1):
            for p in (g, *g.backward()):
                seconds = 40e-6 + p.flops / 0.07e12
                products[gemm_key(p, "fp32")] = p.flops / seconds / 1e12 * (1.1 if mb == 4 else 1.0)
    fast_at_4 = replace(CPU, gemm=tuple(products.items()))
    truth = sum(40e-6 + p.flops / 0.07e12 for g in block_gemms(small, 512, 1) for p in (g, *g.backward()))
    read_alone = sum(p.flops / (products[gemm_key(p, "fp32")] * 1e12)
                     for g in block_gemms(small, 512, 1) for p in (g, *g.backward()))
    priced = sum(_block_gemm_s(small, 512, 1, "fp32", fast_at_4))
    assert read_alone == pytest.approx(truth / 1.1, rel=1e-9)
    assert priced == pytest.approx(0.977 * truth, rel=1e-3)  # a quarter of the 9.1% the readings alone miss by
    launches = 3 * len(block_gemms(small, 512, 1)) * CPU.op_overhead_us * 1e-6  # a queued product's host launch
    queued = replace(fast_at_4, queues_kernels=True)  # a GPU's readings are read as they are
    assert sum(_block_gemm_s(small, 512, 1, "fp32", queued)) == pytest.approx(read_alone + launches, rel=1e-9)
