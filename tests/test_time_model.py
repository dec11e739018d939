"""The time model: per-operation costs, calibrated hardware files, the GPU presets against
published runs, and (one world) the prediction against a measured run on this machine."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import statistics
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from plait.estimate import estimate_layout
from plait.estimate.cli import estimate_main as estimate_with
from plait.families import shape_of


def estimate_main(argv: list[str]) -> int:
    return estimate_with(argv, shape_of)
from plait.errors import PlaitError
from plait.estimate.hardware import get_hardware, hardware_toml, load_hardware, sized_rate
from plait.estimate.layout import Workload, stages
from plait.estimate.ops import Gemm, fit_gemm_line, gemm_key, gemm_s, micro_batch_compute_s, optimizer_s
from plait.estimate.activations import loss_bytes
from plait.estimate.memory import estimate_memory
from plait.estimate.time import estimate_time
from plait.models.gpt.config import get_preset
from tests.worldlib import ROOT, run_world

CPU = get_hardware("cpu")
CALIBRATED = replace(CPU, name="calibrated test", gemm=(("fp32 1024x64x64", 0.05), ("attn fp32 b8 a4 s128 d16", 0.01)),
                     links=((2, 300.0, 1.5), (4, 400.0, 1.0)), op_overhead_us=5.0, optimizer_tensor_us=40.0,
                     grad_tensor_us=15.0)


def test_measured_gemm_rate_beats_the_roofline() -> None:
    g = Gemm(1024, 64, 64)
    assert gemm_key(g, "fp32") == "fp32 1024x64x64"
    assert gemm_s(g, "fp32", CALIBRATED) == pytest.approx(g.flops / 0.05e12)
    other = Gemm(2048, 64, 64)  # not measured: roofline at peak·efficiency, plus the op's cost
    expected = max(other.flops / (CPU.peak_fp32_tflops * 1e12 * CPU.compute_efficiency),
                   (2048 * 64 + 64 * 64 + 2048 * 64) * 4 / (CPU.memory_gb_s * 1e9)) + 5e-6
    assert gemm_s(other, "fp32", CALIBRATED) == pytest.approx(expected)


def test_links_per_group_size() -> None:
    assert CALIBRATED.link(2, False) == pytest.approx((300e-6, 1.5e9))
    assert CALIBRATED.link(4, False) == pytest.approx((400e-6, 1.0e9))
    assert CALIBRATED.link(3, False) == pytest.approx((400e-6, 1.0e9))  # nearest, the larger on a tie
    assert CALIBRATED.link(2, True) == (CPU.latency(True), CPU.bandwidth(True))  # not measured


LAGGING = replace(CALIBRATED, lags=((2, 1000.0, 0.0), (2, 4000.0, 1000.0), (2, 16000.0, 1500.0),
                                    (2, 1e6, 2000.0), (4, 1000.0, 0.0), (4, 16000.0, 3000.0)))


def test_a_collective_after_a_longer_burst_pays_the_ranks_lag() -> None:
    """`lags` is read on a line in the burst's logarithm, nothing below its shortest burst
    (where the latency was taken), its longest's beyond, at the nearest measured group."""
    assert LAGGING.lag_s(2, 0.0005) == 0.0 and LAGGING.lag_s(2, 0.001) == 0.0
    assert LAGGING.lag_s(2, 0.002) == pytest.approx(0.5e-3)  # halfway from 1 to 4 ms, in the log
    assert LAGGING.lag_s(2, 0.008) == pytest.approx(1.25e-3)
    assert LAGGING.lag_s(2, 0.016) == pytest.approx(1.5e-3) and LAGGING.lag_s(2, 10.0) == pytest.approx(2e-3)
    assert LAGGING.lag_s(3, 0.016) == pytest.approx(3e-3)  # nearest group, the larger on a tie
    assert CALIBRATED.lag_s(2, 1.0) == 0.0  # none measured


def test_tensor_parallel_collectives_pay_the_lag_after_their_share_of_the_compute() -> None:
    """dp 2 x tp 2 on small: each of a micro-batch's tp collectives follows its share of the
    micro-batch's compute and pays the ranks' lag after it; dp 4 has no tp collective, and
    its step is unchanged. On 4 ranks sharing 2 cores dp 2 x tp 2 measured 7% over dp 4 where
    it was priced 3% (benchmarks/planner_measured.py)."""
    from plait.estimate.exposed import stage_tp_collectives

    small = get_preset("small")
    tp = Workload(dp=2, tp=2, micro_batch=8, seq_len=128)
    dp = Workload(dp=4, micro_batch=4, seq_len=128)
    plain, lagged = (estimate_time(small, tp, hw, 4) for hw in (CALIBRATED, LAGGING))
    calls = sum(stage_tp_collectives(small, tp, stages(small, 2, 1)[0]).values())
    assert calls == 4 * small.n_layers + 2  # two a block each way, the embedding's and the head's
    lag = LAGGING.lag_s(2, lagged.compute_s / calls)
    assert 1.5e-3 < lag < 2e-3
    assert lagged.tp_s - plain.tp_s == pytest.approx(calls * lag)
    assert lagged.step_s - plain.step_s == pytest.approx(calls * lag)
    assert estimate_time(small, dp, LAGGING, 4).step_s == estimate_time(small, dp, CALIBRATED, 4).step_s
    # tp 2 x cp 2: the ring's exchanges (one forward, three backward a block) come between the
    # tp collectives, and each burst is the micro-batch's compute over both counts
    both = Workload(tp=2, cp=2, micro_batch=16, seq_len=128)
    plain, lagged = (estimate_time(small, both, hw, 4) for hw in (CALIBRATED, LAGGING))
    exchanges = 4 * small.n_layers
    burst = lagged.compute_s / (calls + exchanges)
    assert lagged.tp_s - plain.tp_s == pytest.approx(calls * LAGGING.lag_s(2, burst))
    assert lagged.cp_s - plain.cp_s == pytest.approx(exchanges * LAGGING.lag_s(2, burst))


def test_optimizer_costs_bytes_and_tensors() -> None:
    # norm 4 + clipping 8 + AdamW 84 + zeroing 4 bytes per parameter; fixed costs
    # per optimizer tensor and per gradient piece checked (ZeRO: flat shards, many pieces)
    bytes_s = 100e6 / (CPU.memory_gb_s * 1e9)
    assert optimizer_s(1_000_000, 10, CALIBRATED) == pytest.approx(bytes_s + 10 * (40 + 15) * 1e-6)
    assert optimizer_s(1_000_000, 2, CALIBRATED, pieces=6) == pytest.approx(bytes_s + (2 * 40 + 6 * 15) * 1e-6)


def test_measured_gemm_changes_the_compute() -> None:
    cfg = get_preset("tiny")
    layout = Workload(micro_batch=8, seq_len=128)
    stage = stages(cfg, 1, 1, 1)[0]
    slow = replace(CALIBRATED, gemm=(("fp32 1024x64x64", 0.001),))
    assert micro_batch_compute_s(cfg, layout, stage, slow) > micro_batch_compute_s(cfg, layout, stage, CALIBRATED)


def test_a_rate_keyed_by_size_is_read_between_and_beyond_the_sizes_it_was_taken_at() -> None:
    """An op's time is linear in its size between two measured sizes and, beyond the largest,
    grows at the last two sizes' marginal rate; below the smallest, the smallest's rate holds.
    A profile with no table keeps its one figure; a table with a rate that is not positive is
    refused."""
    table = ((1_000_000, 1.0), (4_000_000, 2.0))  # times 1 and 2 (in size / rate)
    assert sized_rate(table, 2_500_000) == pytest.approx(2_500_000 / 1_500_000)  # time 1.5
    assert sized_rate(table, 10_000_000) == pytest.approx(10_000_000 / 4_000_000)  # 2 + 6 / 3 (marginal 3)
    assert sized_rate(table, 1e12) == pytest.approx(3.0, rel=1e-5)  # far beyond: the marginal rate
    # two noisy rows (a marginal rate of 9,900) promise no more than twice the largest's rate
    assert sized_rate(((1_000_000, 100.0), (2_000_000, 199.0)), 1e9) == 398.0
    assert sized_rate(table, 1_000) == 1.0 and sized_rate(table, 4_000_000) == 2.0 and sized_rate((), 5) == 0.0
    hw = replace(CPU, memory_by_size=((1 << 20, 4.0), (1 << 24, 6.0)), stream_by_size=((1 << 20, 2.0),))
    assert hw.memory_rate(1 << 20) == 4e9 and hw.memory_rate(1 << 24) == 6e9 and CPU.memory_rate(1) == 8.8e9
    assert hw.stream_rate(1 << 30) == 2e9 and CPU.stream_rate(1 << 30) == CPU.stream_bytes_per_s
    with pytest.raises(PlaitError, match="positive finite rate"):
        replace(CPU, memory_by_size=((1024, 0.0),))
    # an element-wise size that timed faster than a larger one (its data kept in the caches by a
    # crowded host's burst: 57.9 GB/s at 384 KiB, 11.3 at 3 MiB, 6.9 at 24 MiB) is read at the
    # larger's rate; the update's sizes are read as measured (a small model's states stay cached)
    crowded = replace(CPU, memory_by_size=((393_216, 57.9), (3_145_728, 11.3), (25_165_824, 6.9)),
                      stream_by_size=((1 << 20, 8.0), (1 << 23, 4.0)))
    assert [crowded.memory_rate(n) for n in (393_216, 3_145_728, 25_165_824)] == pytest.approx([6.9e9] * 3)
    assert replace(CPU, memory_by_size=((1 << 20, 8.0), (1 << 23, 4.0), (1 << 26, 5.0))).memory_rate(1 << 20) == 4e9
    assert crowded.stream_rate(1 << 20) == 8e9


def test_a_gemm_no_one_measured_is_priced_by_the_line_through_those_measured() -> None:
    """time = fixed + FLOPs / rate, fitted on relative errors: ten shapes made on 10 µs and
    500 TFLOP/s give both back; shapes all of a size (within FIT_SPAN) give no line. A preset
    charges the line at peak·efficiency plus its ramp."""
    shapes = [Gemm(m, k, n) for m in (1024, 4096) for k in (512, 4096) for n in (256, 2048, 8192)][:10]
    measured = {gemm_key(g, "bf16"): g.flops / (10e-6 + g.flops / 500e12) / 1e12 for g in shapes}
    assert fit_gemm_line(measured) == pytest.approx((500.0, 10.0), rel=1e-6)
    assert fit_gemm_line({"bf16 64x64x64": 3.0}) is None
    assert fit_gemm_line({"bf16 64x64x64": 3.0, "bf16 64x64x128": 5.0}) is None
    h100, g = get_hardware("h100-sxm"), Gemm(4096, 4096, 4096)
    assert gemm_s(g, "bf16", h100) == pytest.approx(g.flops / (989e12 * 0.7) + h100.gemm_fixed_us * 1e-6)


def test_a_gpu_overlaps_host_costs_with_device_work_and_a_cpu_adds_them() -> None:
    """The update's per-tensor costs and a micro-batch's per-op costs are host work: on a
    GPU (queues_kernels) the longer of host and device counts, on a CPU their sum."""
    cpu = replace(CALIBRATED, stream_gb_s=100.0)
    gpu = replace(cpu, queues_kernels=True)
    streamed, fixed = 100e6 / 100e9, 10 * (40 + 15) * 1e-6
    assert optimizer_s(1_000_000, 10, cpu) == pytest.approx(streamed + fixed)
    assert optimizer_s(1_000_000, 10, gpu) == pytest.approx(max(streamed, fixed))
    cfg, layout = get_preset("tiny"), Workload(micro_batch=8, seq_len=128)
    stage = stages(cfg, 1, 1, 1)[0]
    summed = micro_batch_compute_s(cfg, layout, stage, cpu)
    device = micro_batch_compute_s(cfg, layout, stage, replace(cpu, op_overhead_us=0.0, view_overhead_us=0.0))
    assert micro_batch_compute_s(cfg, layout, stage, gpu) == pytest.approx(max(device, summed - device))
    assert micro_batch_compute_s(cfg, layout, stage, gpu) < summed


def test_queues_kernels_is_true_or_false() -> None:
    with pytest.raises(PlaitError, match="queues_kernels must be true or false"):
        replace(CPU, queues_kernels=1)


def test_calibration_file_round_trips_through_hardware_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "hw.toml"
    sized = replace(LAGGING, memory_by_size=((4096, 2.5), (1 << 20, 7.0)), stream_by_size=((1 << 20, 3.5),),
                    queues_kernels=True, gemm_fixed_us=12.5)
    path.write_text(hardware_toml(sized, {"plait calibration of": "a test"}))
    assert load_hardware(path) == sized
    for bad in ('"2" = 1.0', '"1 4000.0" = 1.0', '"2 500.0" = -1.0', '"2 x" = 1.0', '"2 500.0 x" = 1.0',
                '"2 500.0" = true', '"2 500.0" = "1"', '"2 500.0" = nan'):
        path.write_text(hardware_toml(sized).replace('"2 1000.0" = 0.0', bad))
        with pytest.raises(PlaitError, match=r"hardware\.lags"):
            load_hardware(path)
    for rows in (((2, "x", 1.0), (2, 1000.0, 0.0)), ((2, True, False),), ((2, 1000.0),)):
        with pytest.raises(PlaitError, match="lags"):
            replace(CALIBRATED, lags=rows)
    path.write_text(hardware_toml(CALIBRATED, {"plait calibration of": "a test"}))
    assert load_hardware(path) == CALIBRATED
    assert estimate_main(["--model", "tiny", "--dp", "2", "--precision", "fp32", "--micro-batch", "8",
                          "--seq-len", "128", "--hardware-file", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    direct = estimate_layout(get_preset("tiny"), dp=2, micro_batch=8, seq_len=128, hardware=CALIBRATED)
    assert result["layout"]["hardware"] == "calibrated test"
    assert result["time"] == pytest.approx(direct["time"])
    assert {"optimizer_s", "overhead_s", "compute_s", "bubble_s", "dp_s"} <= set(result["time"])


def _benchmark(name: str):
    """benchmarks/`name`.py, loaded as a module (the benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.one_process  # arithmetic on published runs: beside another such file (tests/pairing.py)
def test_gpu_presets_against_published_runs() -> None:
    """Narayanan et al. 2021 Table 1, all ten rows within 10%, priced as Megatron-LM ran them
    (--stack megatron-2021); torchtitan's Llama 3 8B within 40% on the SXM preset
    (their GPUs were capped at 500 W: the capped preset's rows are within 15%). What FSDP's
    communication costs shows in the scaling from 8 GPUs to 128 (one node to 16): published
    0.973, predicted within 5% of it (per-block gathers and reduce-scatters; charged a ring
    latency per 25 MiB bucket, the estimate gave 0.906)."""
    module = _benchmark("gpu_presets")
    for size, _, _, _, published, predicted in module.megatron_rows():
        assert abs(predicted / published - 1) <= 0.10, (size, predicted, published)
    rows = module.torchtitan_rows()
    for name, _, published, predicted, _ in rows:
        assert abs(predicted / published - 1) <= (0.40 if name == "h100-sxm" else 0.15), name
    for hardware in {name for name, *_ in rows}:
        (_, _, pub8, pred8, _), (_, _, pub128, pred128, _) = [r for r in rows if r[0] == hardware]
        assert abs((pred128 / pred8) / (pub128 / pub8) - 1) <= 0.05, hardware


@pytest.mark.one_process  # arithmetic on published runs: beside another such file (tests/pairing.py)
def test_table_2_of_narayanan_et_al() -> None:
    """GPT-3 175 B on 384-1536 A100s: PTD-P (t 8, p 12) within 10% of each published figure.
    ZeRO-3 without model parallelism is out, in the bands it is known to err in
    (docs/estimate.md): each rank's rings cross on its node's eight NICs, so the wire costs a
    few seconds a step at every GPU count and the model's step is its compute; the published
    steps took 65-80 s, which DeepSpeed's ZeRO-3 of 2021 spent on something other than the
    wire."""
    rows = _benchmark("gpu_presets").table_2_rows()
    for name, gpus, published, predicted in rows:
        if name.startswith("t 8"):
            assert abs(predicted / published - 1) <= 0.10, (name, gpus, predicted)
    zero3 = {gpus: predicted / published for name, gpus, published, predicted in rows if name.startswith("ZeRO")}
    bands = {384: (1.3, 1.5), 768: (2.2, 2.4), 1536: (4.4, 4.8)}
    assert all(bands[gpus][0] <= ratio <= bands[gpus][1] for gpus, ratio in zero3.items()), zero3


# Each published run's prediction/published ratio: within 10% where the model holds, else the
# band it is known to err in (docs/estimate.md says why), so that a change moving either shows.
# Keyed by (run, hardware preset), "" for every preset.
WITHIN_10 = (0.90, 1.10)
PUBLISHED_BANDS = {("BLOOM", ""): WITHIN_10, ("MPT-7B", ""): WITHIN_10, ("MPT-30B", ""): WITHIN_10,
                   ("MPT-70B", "h100-sxm"): WITHIN_10, ("MPT-70B", "a100-80gb"): (0.85, 0.90),
                   ("Nemotron-4 15B (arXiv 2402.16819): tp 8 + sp, dp 288", ""): (1.05, 1.20),
                   ("Nemotron-4 15B", ""): WITHIN_10,
                   ("Llama 3 405B", ""): WITHIN_10}


@pytest.mark.one_process  # arithmetic on published runs: beside another such file (tests/pairing.py)
def test_published_runs_each_in_their_own_definition() -> None:
    """BLOOM-176B (hardware TFLOP/s with recompute), llm-foundry's MPT and Nemotron-4 15B (MFU).
    BLOOM runs on its own machine, Jean Zay's A100 nodes with four 100 Gb/s Omni-Path links: on
    a DGX A100's eight 200 Gb/s NICs it would be 13% over."""
    module = _benchmark("gpu_presets")
    rows = module.published_rows()
    assert len(rows) == 10
    for source, hardware, gpus, kind, published, predicted in rows:
        low, high = next(band for (name, preset), band in PUBLISHED_BANDS.items()
                         if name in source and preset in ("", hardware))
        assert low <= predicted / published <= high, (source, hardware, predicted, published)
    source, config, machine, gpus, layout, _, published = module.PUBLISHED[0]
    assert machine == "a100-80gb jean-zay" and module.machine(machine).inter_node_gb_s == 4 * 12.5 / 8
    dgx = estimate_time(config, layout, get_hardware("a100-80gb"), 8)
    assert dgx.hardware_flops_per_token * dgx.tokens_per_s / gpus / 1e12 / published == pytest.approx(1.13, abs=0.01)


# Published layouts the estimate says do not fit the GPUs they ran on, and why (docs/estimate.md).
# Llama 3 405B on 8,192 GPUs was one (91 GiB) until plait's block made SwiGLU's product again for
# down's backward rather than keep it.
NOT_FITTING: dict[str, str] = {}


@pytest.mark.one_process  # arithmetic on published runs: beside another such file (tests/pairing.py)
def test_the_largest_published_layouts_fit_where_they_ran() -> None:
    """Every published layout the suite holds fits its GPUs by the estimate, without recompute
    where the run used none, but those NOT_FITTING names, each with its reason. Llama 3 405B
    (tp 8, pp 16, no recompute) is priced whole, cut as the paper says (a layer a chunk, the
    first chunk the embedding alone and the last the head alone). On 8,192 GPUs the second
    rank holds 141 chunk-forwards of a layer in flight: 75.0 GiB of 78, since plait's block
    makes SwiGLU's product again for down's backward (25.75h + 4 bytes a token, where keeping
    it was 32.25h + 4: 90.8 GiB). On 16,384, where every forward runs before the first
    backward, 63.4 GiB (77.6 while the product was kept; 83 while every chunk's gradients
    were allocated at setup)."""
    module = _benchmark("gpu_presets")
    out = set()
    for name, config, hardware, layout in module.published_layouts():
        if estimate_memory(config, layout).total > module.machine(hardware).usable_bytes:
            out.add(name if "Llama 3" not in name else f"{name} on {layout.world}")
    assert out == set(NOT_FITTING), out


@pytest.mark.one_process  # arithmetic on published runs: beside another such file (tests/pairing.py)
def test_llm_foundrys_whole_table() -> None:
    """Every bf16 row of llm-foundry's MPT benchmark table (209 runs, 8 to 512 GPUs, 125 M to
    70 B parameters, 512 to 65,536 tokens), each priced as it ran and compared in the table's
    own MFU. The shapes are right: each model's parameters, with the runs' learned position
    embeddings, are the table's to 0.1%. On H100s the model holds: the median within 3% and
    56 of the 70 rows within 10%, a count the test holds. On A100s (80 and 40 GB) it is under:
    0.86 and 0.85 with FlashAttention-2 priced at 50% of the peak, 0.92 and 0.88 at 60% (its
    paper's 50-73%; the 82%-attention row implies 62%), 35 and 31 rows within 10%. The rest is
    the A100's GEMM line (70% of peak): the published best GEMM (87% of peak) under the
    Hopper rule would put it at 76%, which lifts these to 0.96 and 0.93 but puts Narayanan et
    al.'s 2021 rows and BLOOM's 12-16% fast (docs/estimate.md)."""
    module = _benchmark("gpu_presets")
    rows = module.llm_foundry_rows()
    assert len(rows) == 209
    assert all(int(r["params"]) == pytest.approx(r["model_params"], rel=1e-3) for r in rows)
    summary = {hw: (n, median, within) for hw, n, median, _, _, within, _, _, _ in module.llm_foundry_summary()}
    n, median, within = summary["h100-sxm"]
    assert n == 70 and abs(median - 1) <= 0.03 and within >= 56  # today's count: a row that leaves must say why
    assert (summary["a100-80gb"][1], summary["a100-40gb"][1]) == pytest.approx((0.92, 0.88), abs=0.01)
    assert summary["a100-80gb"][2] >= 35 and summary["a100-40gb"][2] >= 31


@pytest.mark.one_process  # arithmetic on published runs: beside another such file (tests/pairing.py)
def test_every_llm_foundry_row_outside_10_percent_has_its_reason_read_off_the_row() -> None:
    """Each of the 87 rows of llm-foundry's table outside 10% is given a reason from what the row
    shows. Over by more than 10% with FSDP's transfers at least 15% of the compute (which the
    model hides whole): 9 on H100 (MPT-13B at micro-batch 2,
    MPT-7B on 256 and 512 GPUs, MPT-70B on 32, MPT-30B on 8) and MPT-70B on 64 A100 40 GB. Over
    at the memory's edge (MPT-30B at 8,192 tokens on 8 GPUs, the estimate at 96%), on H100 and
    A100 80 GB alike. The rest lie along the share of attention in the step: factors per GPU on
    plait's time outside attention and in it (per head dimension), fitted over its light rows,
    put 73 of them within 10%; on H100 they are the presets' lines within 10% (0.73 and 0.32 of
    peak against 0.70 and 0.35), on A100 a line outside attention at 0.82-0.83 of peak against
    the preset's 0.70 (docs/estimate.md: the GEMM line), attention at 0.58 of peak at head
    dimension 128 (0.60) and 0.52-0.53 at 64 (MPT-125M and 350M). MPT-13B and
    MPT-7B at 1,024 tokens with recompute on A100 80 GB (0.77) publish a hardware rate that,
    with every GEMM and the attention at the best GEMM rate measured on an A100, leaves 8-10% of
    the published step for the rest, where plait's time outside GEMMs and attention (element-wise
    passes, the update, exposed transfers) comes to 16-19% of it. The runs' reduce dtype is the
    table's "MP Mode": DEFAULT reduces in fp32."""
    module = _benchmark("gpu_presets")
    rows, fitted = module.llm_foundry_reasons()
    assert len(rows) == 87
    reasons = Counter((r["hardware"], r["reason"]) for r in rows)
    assert reasons == {("h100-sxm", "collectives"): 9, ("h100-sxm", "memory"): 1, ("h100-sxm", "lines"): 4,
                       ("a100-80gb", "memory"): 1, ("a100-80gb", "lines"): 23, ("a100-80gb", "ceiling"): 2,
                       ("a100-40gb", "collectives"): 1, ("a100-40gb", "lines"): 46}
    heavy = [r for r in rows if r["reason"] == "collectives"]
    assert (min(r["wire"] for r in heavy), max(r["wire"] for r in heavy)) == pytest.approx((0.17, 0.43), abs=0.005)
    assert {(r["model"], r["micro_batch"]) for r in heavy if r["hardware"] == "h100-sxm"} == \
        {("13b", "2"), ("7b", "6"), ("70b", "2"), ("30b", "1"), ("30b", "3")}
    assert {(r["model"], r["seq_len"]) for r in rows if r["reason"] == "memory"} == {("30b", "8192")}
    ceiling = [r for r in rows if r["reason"] == "ceiling"]
    assert sorted((r["model"], r["seq_len"]) for r in ceiling) == [("13b", "1024"), ("7b", "1024")]
    assert [(round(r["rest_ceiling"], 2), round(r["rest"], 2)) for r in sorted(ceiling, key=lambda r: r["model"])] == \
        [(0.08, 0.16), (0.10, 0.19)]
    assert ("a100-40gb", "125m", "32768", "lines") in {(r["hardware"], r["model"], r["seq_len"], r["reason"]) for r in rows}
    h100 = get_hardware("h100-sxm")
    assert h100.compute_efficiency / fitted["h100-sxm"]["outside"] == pytest.approx(0.73, abs=0.01)
    assert h100.attention_efficiency / fitted["h100-sxm"][128] == pytest.approx(0.32, abs=0.01)
    assert 64 not in fitted["h100-sxm"]  # no H100 run attends at 64
    for a100 in ("a100-80gb", "a100-40gb"):
        hw, lines = get_hardware(a100), fitted[a100]
        assert 0.81 <= hw.compute_efficiency / lines["outside"] <= 0.84
        assert hw.attention_efficiency / lines[128] == pytest.approx(0.58, abs=0.01)
        assert hw.attention_efficiency / lines[64] == pytest.approx(0.525, abs=0.01)  # ~10% slower than at 128
    modes = Counter((r["gpu"], r["mp_mode"], r["layout"].reduce_dtype) for r in module.llm_foundry_rows())
    assert modes == {("h100_80gb", "DEFAULT", "fp32"): 70, ("a100_80gb", "DEFAULT", "fp32"): 59,
                     ("a100_80gb", "PURE", "bf16"): 2, ("a100_40gb", "PURE", "bf16"): 78}


@pytest.mark.one_process  # arithmetic on published runs: beside another such file (tests/pairing.py)
def test_llm_foundrys_runs_fit_where_they_ran_with_its_fused_loss() -> None:
    """Every run of llm-foundry's table fits the GPU it ran on by the estimate, priced on
    --stack llm-foundry, whose fused cross-entropy (flash-attn's, MPT's default loss_fn) keeps
    the logits alone. Priced with plait's loss (the logits, an fp32 copy and an fp32 log-softmax)
    72 of the 209 did not: 13 on H100, 16 on A100 80 GB, 43 on A100 40 GB, up to 1.3 times the
    memory (MPT-760M at 49,152 tokens a micro-batch: 23.1 GiB of loss, 4.6 of it the logits)."""
    module = _benchmark("gpu_presets")
    rows = module.llm_foundry_rows()
    assert [r for r in rows if not r["fits"]] == []
    mpt_760m = replace(module._mpt(1536, 24, 12), max_seq_len=2048)
    fused = Workload(dp=8, zero=3, precision="bf16", micro_batch=24, seq_len=2048, stack="llm-foundry")
    assert loss_bytes(mpt_760m, fused) == 24 * 2048 * 50368 * 2
    assert loss_bytes(mpt_760m, replace(fused, stack="plait")) == 24 * 2048 * 50368 * (2 + 4 + 4)
    over = [r for r in rows if estimate_memory(r["config"], replace(r["layout"], stack="plait")).total
            > module.machine(r["hardware"]).usable_bytes]
    assert len(over) == 72


@pytest.mark.slow  # plait plan over the published runs on up to 512 GPUs: ~20 s of search
@pytest.mark.one_process  # beside another such file (tests/pairing.py)
def test_the_planner_matches_or_beats_each_published_layout_on_paper() -> None:
    """For each published run on up to 512 GPUs, `plait plan` over the same model, GPUs, batch
    and sequence predicts at least the published layout's throughput, each of which fits by the
    estimate (llm-foundry's MPT-7B, micro-batch 6 without recompute, since o_proj reads SDPA's
    output as a view: 73.9 GiB of 78). By how much, and with which layout, is
    benchmarks/RESULTS.md's."""
    rows = _benchmark("gpu_presets").planner_rows(max_gpus=512)
    assert len(rows) >= 9
    for name, hardware, gpus, published, best, layout, fits in rows:
        assert fits, name
        assert best >= published * (1 - 1e-9), (name, hardware, best, published, layout)


@pytest.mark.one_process  # arithmetic on published runs: beside another such file (tests/pairing.py)
def test_the_presets_predict_plaits_own_gpu_runs() -> None:
    """benchmarks/gpu_presets.py's MEASURED_RUNS: the 5.12 B ZeRO-3 offload step measured on
    an H200 (its host step 2.0 of 2.7 s: PCIe both ways in fp32 and the host's AdamW), and the
    1.04 B GPT's."""
    module = _benchmark("gpu_presets")
    for name, measured, predicted in module.measured_rows():
        assert abs(predicted / measured - 1) <= 0.10, (name, predicted, measured)


def test_prediction_holds_on_this_machine_after_calibration(tmp_path: Path) -> None:
    """`tiny` under dp 2, calibrated in the same world right before training: the predicted
    step time within 50% of the measured median (the benchmark holds 20% on a quiet machine)."""
    _, reports = run_world("time_model.py", 2, tmp_path, str(tmp_path / "run"), "tiny", "6", "0.5", "lags",
                           timeout=400)
    attempts = reports[0]["attempts"]
    assert reports[0]["hardware"].startswith("calibrated")
    last = attempts[-1]
    assert set(last["predicted"]) == {"compute", "exposed_comm", "bubble", "optimizer", "overhead", "step"}
    assert last["predicted"]["step"] == pytest.approx(sum(v for k, v in last["predicted"].items() if k != "step"))
    assert abs(last["ratio"] - 1) <= 0.5, attempts
    # the ranks' lag (plait.bench.comm_timing.measure_lags): for the pair, after each of three
    # bursts, each longer than the last, what a collective adds over the shortest's, never less
    lags = reports[0]["lags"]
    assert [row[0] for row in lags] == [2, 2, 2] and lags[0][2] == 0.0, lags
    assert lags[0][1] < lags[1][1] < lags[2][1] and 0 <= lags[1][2] <= lags[2][2], lags
    # the pair's all-reduce, and ZeRO's all-gather and reduce-scatter timed in the same rounds
    # (plait.bench.comm_timing.measure_links), each a bus rate
    links, ops = reports[0]["links"], reports[0]["op_links"]
    assert [row[0] for row in links] == [2] and links[0][2] > 0, links
    assert [(op, n) for op, n, _ in ops] == [("all_gather", 2), ("reduce_scatter", 2)], ops
    assert all(0 < rate < 1e4 for _, _, rate in ops), ops


@pytest.mark.one_process  # arithmetic: beside another such file (tests/pairing.py)
def test_a_latency_longer_than_the_collective_leaves_a_finite_rate() -> None:
    """1 MB in 1 ms with 0.2 ms of ring latency is 1.25 GB/s; where the latency (timed between
    bursts of compute on a loaded host) is 2 ms, longer than the whole collective, the rate is
    2 GB/s (half the time taken off at most), not the 1e6 GB/s that once priced ZeRO's gathers
    at nothing."""
    from plait.bench.comm_timing import bus_rate

    assert bus_rate(1e6, 1e-3, 0.2e-3) == pytest.approx(1.25)
    assert bus_rate(1e6, 1e-3, 2e-3) == pytest.approx(2.0)
    assert bus_rate(1e6, 1e-3, 0.0) == pytest.approx(1.0)


def spans_on_one_clock(mesh, starts, ends):
    """`timing.round_spans` for a one-rank stand-in mesh: each round's own start to end."""
    return [[end - start for start, end in zip(began, ended)] for began, ended in zip(starts, ends)]


@pytest.mark.one_process  # arithmetic: beside another such file (tests/pairing.py)
def test_a_collectives_first_slow_rounds_are_not_timed(monkeypatch) -> None:
    """The large collectives' rates are their steady ones: a stand-in collective that takes 20 ms
    on its first five calls (its warm-up run and LINK_WARM_ROUNDS rounds) and 1 ms after is
    timed at 1 ms; timed from the first round, 11 rounds' median had read a world's slow start
    (an all-gather at 0.43 GB/s against a steady 0.53). A host that is not crowded times one run
    a round, six rounds a rep (22 rounds' all-gather read 0.49-0.86 GB/s on 2 ranks, 66 rounds'
    0.68-0.83); a crowded one, whose rounds are bursts of runs, two."""
    from types import SimpleNamespace

    from plait.bench import comm_timing, timing

    calls = []

    def collective() -> None:
        calls.append(1)
        time.sleep(0.02 if len(calls) <= 1 + comm_timing.LINK_WARM_ROUNDS else 0.001)

    one_rank = SimpleNamespace(env=SimpleNamespace(world_size=1), device=SimpleNamespace(type="cpu"))
    (taken,) = comm_timing.link_rates(one_rank, [collective], reps=3)
    assert taken == pytest.approx(0.001, abs=0.004)
    assert len(calls) == 1 + comm_timing.LINK_WARM_ROUNDS + 1 + 6 * 3  # each median_rounds warms up once
    calls.clear()
    monkeypatch.setattr(timing, "crowded", lambda mesh: True)
    monkeypatch.setattr(timing, "_bursts", lambda mesh, fns, crowd, on_cpu=False: [1] * len(fns))
    monkeypatch.setattr(timing, "round_spans", spans_on_one_clock)
    comm_timing.link_rates(one_rank, [collective], reps=3)
    assert len(calls) == comm_timing.LINK_WARM_ROUNDS + 2 * 3  # a crowded host: two rounds a rep


def test_train_uses_a_cached_calibration_of_this_machine(tmp_path: Path, monkeypatch) -> None:
    """No cache: a quick calibration, saved under the user cache dir; the next run reads it.
    A larger model's run finds the cache lacking its GEMM shapes, its activation's bandwidth
    and its update's rate: they are measured and added beside the small model's, each keyed
    by its size, and a third run reads them all."""
    from types import SimpleNamespace

    from plait.bench import machine
    from plait.bench.machine import cache_path, machine_facts
    from plait.runtime.mesh import init_mesh
    from plait.train.config.settings import TrainConfig
    from plait.train.observe.timing import run_hardware

    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PLAIT_CALIBRATION", raising=False)
    # The cache alone: a calibration the suite's load made noisy is not cached (that branch is
    # test_a_calibration_taken_on_a_busy_machine_is_not_cached_and_is_named's), which here
    # would fail the run by chance.
    monkeypatch.setattr(machine, "noisy", lambda mesh: None)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as one of two ranks on this machine (and far quicker under load)
    mesh = init_mesh()
    trainer = SimpleNamespace(config=TrainConfig(model="tiny", micro_batch=2, seq_len=32), mesh=mesh,
                              task=SimpleNamespace(calibration_shape=lambda: (get_preset("tiny"), 32)))
    first, source = run_hardware(trainer)
    assert source.startswith("quick calibration") and cache_path(machine_facts(mesh)).exists()
    assert first.gemm_tflops("fp32 64x64x192") > 0 and first.name.startswith("calibrated")
    again, source = run_hardware(trainer)
    assert source.startswith("cached calibration") and again == first
    larger = SimpleNamespace(config=TrainConfig(model="small", micro_batch=8, seq_len=128), mesh=mesh,
                             task=SimpleNamespace(calibration_shape=lambda: (get_preset("small"), 128)))
    grown, source = run_hardware(larger)
    assert source.endswith("(+ what it lacked at this model's sizes)"), source
    tiny_bytes, small_bytes = 2 * 32 * 64 * 4, 8 * 128 * 384 * 4  # an activation's, and an eighth and 8 times it
    assert [n for n, _ in grown.memory_by_size] == sorted(
        size * k for size in (tiny_bytes, small_bytes) for k in (1 / 8, 1, 8))
    assert [n for n, _ in grown.stream_by_size] == [get_preset("tiny").num_params(), get_preset("small").num_params()]
    assert set(first.gemm) < set(grown.gemm) and grown.gemm_tflops("fp32 1024x384x384") > 0
    assert run_hardware(larger) == (grown, f"cached calibration {cache_path(machine_facts(mesh))}")
    monkeypatch.setenv("PLAIT_CALIBRATION", "off")
    assert run_hardware(trainer)[0].name == "cpu"
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ["micro_batch=4", "grad_accum=2"], ["zero=3"], ["tp=2"], ["pp=2", "micro_batch=2", "grad_accum=4"],
], ids=["dp2", "zero3x2", "tp2", "pp2-1f1b"])
def test_prediction_holds_for_small_layouts(tmp_path: Path, extra: list[str]) -> None:
    """`small` under the issue's layouts, each calibrated right before it trains (50%)."""
    _, reports = run_world("time_model.py", 2, tmp_path, str(tmp_path / "run"), "small", "6", "0.5", *extra,
                           timeout=900)
    assert abs(reports[0]["attempts"][-1]["ratio"] - 1) <= 0.5, reports[0]["attempts"]


@pytest.mark.one_process  # arithmetic: beside another such file (tests/pairing.py)
def test_attempts_out_of_bound_are_pooled_each_priced_between_its_calibration_and_the_next() -> None:
    """tests/worlds/time_model.py's verdict: the last attempt's own ratio where it holds, else
    every attempt's pooled (predicted and measured steps summed, each attempt but the last priced
    at the mean of the two calibrations around it), else the last's. The three attempts of a
    closing run that failed on 2026-12-03 pool to 1.06."""
    spec = importlib.util.spec_from_file_location("time_model_world", ROOT / "tests" / "worlds" / "time_model.py")
    world = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(world)
    first = {"ratio": 1.17, "predicted": {"step": 1.17}, "measured": {"step": 1.0}}
    second = {"ratio": 1.15, "predicted": {"step": 0.95}, "measured": {"step": 0.826}}
    assert world.verdict([first], 0.1) == 1.17
    assert world.verdict([first, second], 0.11) == pytest.approx((1.06 + 0.95) / 1.826)
    assert world.verdict([first, second], 0.1) == 1.15  # neither holds: the last attempt's
    assert world.verdict([first, {**second, "ratio": 1.02}], 0.05) == 1.02
    closing = [{"ratio": p / m, "predicted": {"step": p}, "measured": {"step": m}}
               for p, m in ((1.9006, 1.5790), (1.7057, 1.4177), (1.6535, 1.8682))]
    assert world.verdict(closing[:2], 0.1) == closing[1]["ratio"]  # 1.17 pooled: out
    assert world.verdict(closing, 0.1) == pytest.approx((1.80315 + 1.6796 + 1.6535) / 4.8649)


@pytest.mark.slow
def test_prediction_holds_when_ranks_outnumber_the_cores(tmp_path: Path) -> None:
    """`small` under dp 4 on a 2-core machine (one thread a rank): each rank computes on half
    a core, and the calibration times every rank's runs together (plait.bench.timing.
    crowded). Timed one rank at a time, each measured a whole core, and the step was
    predicted at 0.77-0.87 of its measurement here (0.50-0.59 in benchmarks/planner_measured.
    py); now 0.99-1.01, held to 10%. Attempts out of the bound are pooled, each priced again at the mean of
    its own calibration and the next attempt's, timed after it (tests/worlds/time_model.py): a
    closing run on 2026-12-02, the host about 0.8 of its usual pace, ended at 1.17, and one on
    2026-12-03 measured 1.20, 1.20 and 0.89 (1.06 pooled). Later the quick calibration,
    its adds timed at one size, priced it at 0.88-1.02 (12 worlds, 1 of them failing), and now
    the adds at three sizes over 11 rounds, 0.96-1.09 (docs/estimate.md, "A quick
    calibration")."""
    _, reports = run_world("time_model.py", 4, tmp_path, str(tmp_path / "run"), "small", "6", "0.1",
                           "micro_batch=4", "lone", timeout=900)
    attempts = [(a["ratio"], a["predicted"]["step"], a["measured"]["step"]) for a in reports[0]["attempts"]]
    assert abs(reports[0]["held"] - 1) <= 0.1, attempts
    # the same crowded world: a rank alone on a core trains a block 1.8-3 times as fast as with
    # every rank at work (1.92-2.23 measured here at two threads a core; 1.87-1.89 at this
    # micro-batch, in this world and a scratch one, on a host whose product ran 106-146 GFLOP/s
    # a thread, 2026-12-07, where a neighbour's load slows the lone ranks more than the crowded
    # ones); a host with a core for each rank measures nothing
    crowding, lone = reports[0]["crowding"], reports[0]["lone"]
    assert (0.9 * crowding <= lone <= 1.5 * crowding) if crowding > 1 else lone == 0.0, (crowding, lone)
    # and ZB-H1's split backward, unclamped: a micro-batch 1.03-1.13 times a whole one's in
    # calibrations here (RESULTS.md, run 14; 1.05 at micro-batch 4 in this world), its rounds'
    # medians a percent or two apart
    assert 0.98 <= reports[0]["split"] <= 1.3, reports[0]["split"]


@pytest.mark.slow
def test_a_pipeline_is_priced_with_the_cores_its_waiting_ranks_leave(tmp_path: Path) -> None:
    """`small` under dp 2 × pp 2 (1F1B, one micro-batch of 8) on a 2-core machine, one thread a
    rank: one rank of each pipeline works at a time, two ranks on two cores, each at about
    twice the pace the crowded calibration prices (estimate/pipeline.Crowd). Priced at that
    pace throughout it came to 1.26 s against 0.63-0.64 measured (benchmarks/RESULTS.md, runs
    11 to 13); as the schedule runs, within 4% in the planner check; held to 10% here, pooled
    as above."""
    _, reports = run_world("time_model.py", 4, tmp_path, str(tmp_path / "run"), "small", "6", "0.1",
                           "pp=2", timeout=900)
    attempts = [(a["ratio"], a["predicted"]["step"], a["measured"]["step"]) for a in reports[0]["attempts"]]
    assert abs(reports[0]["held"] - 1) <= 0.1, attempts


@pytest.mark.slow
def test_calibrate_command_writes_a_file_estimate_reads(tmp_path: Path) -> None:
    from tests.worldlib import run_plait

    out = tmp_path / "hw.toml"
    proc = run_plait("calibrate", "--nproc", "2", "--model", "tiny", "--tp", "1,2", "--micro-batch", "8,4", "--quick",
                     "--no-cache", "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr
    hw = load_hardware(out)
    assert hw.gemm_tflops("fp32 1024x64x192") > 0 and hw.gemm_tflops("fp32 1024x64x96") > 0  # tp 1 and 2
    assert hw.gemm_tflops("fp32 512x64x192") > 0 and hw.gemm_tflops("attn fp32 b4 a4 s128 d16") > 0  # micro-batch 4
    assert [n for n, _, _ in hw.links] == [2]
    proc = run_plait("estimate", "--model", "tiny", "--dp", "2", "--precision", "fp32", "--micro-batch", "8",
                     "--seq-len", "128", "--hardware-file", str(out), "--json")
    assert json.loads(proc.stdout)["layout"]["hardware"] == hw.name


def test_a_crowded_calibration_sets_its_shapes_by_cpu_time_and_their_level_by_the_spans(monkeypatch) -> None:
    """plait.bench.timing._shaped: three shapes whose CPU times are 1:2:3 and whose spans
    the scheduler moved (2.0, 4.6, 5.7 s): each is its CPU time times the spans' median ratio
    to it (2.0), so 2, 4 and 6 s; without CPU times (none measured), the spans as they are."""
    from plait.bench import timing

    monkeypatch.setattr(timing, "slowest", lambda mesh, values: list(values))
    assert timing._shaped(None, [2.0, 4.6, 5.7], [1.0, 2.0, 3.0]) == pytest.approx([2.0, 4.0, 6.0])
    assert timing._shaped(None, [2.0, 4.6], [0.0, 2.0]) == [2.0, 4.6]


def test_a_crowded_calibration_counts_every_thread_of_a_rank(monkeypatch) -> None:
    """A rank with two threads at work (the main one and a helper, as a product's intra-op
    workers are) does twice the work of one: read by the rank's CPU time, not its main
    thread's, its timing is at least 1.6 times the one-thread one's (2.8-3.1 measured, the two
    threads sharing the memory bus). By the main thread's clock the two read alike (1.15), and
    a rank of two threads was priced at half its cost."""
    import threading
    from types import SimpleNamespace

    import torch

    from plait.bench import timing

    a, b = torch.randn(192, 192), torch.randn(192, 192)

    def products() -> None:  # about 20 ms: a thread's start a small part of it
        for _ in range(200):
            torch.mm(a, b)

    def two_threads() -> None:
        helper = threading.Thread(target=products)
        helper.start()
        products()
        helper.join()

    monkeypatch.setattr(timing, "crowded", lambda mesh: True)
    monkeypatch.setattr(timing, "_bursts", lambda mesh, fns, *crowd: [1] * len(fns))
    monkeypatch.setattr(timing, "slowest", lambda mesh, values: list(values))
    monkeypatch.setattr(timing, "round_spans", spans_on_one_clock)
    mesh = SimpleNamespace(env=SimpleNamespace(world_size=1), device=torch.device("cpu"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # each thread's products on that thread alone
    try:
        one, two = timing.median_rounds(mesh, [products, two_threads], 5, watched=True)
    finally:
        torch.set_num_threads(threads)
    assert 1.6 < two / one < 4.0, (one, two)  # two threads sharing the memory bus: 2.8-3.1 measured; main's clock 1.15


@pytest.mark.one_process  # arithmetic: beside another such file (tests/pairing.py)
def test_a_crowded_compute_timings_burst_is_counted_from_its_cpu_time(monkeypatch) -> None:
    """On a crowded host a compute timing's runs a burst come from its warm-up's CPU time, over
    the share of a core a rank gets: a product of about 2 ms of CPU whose warm-up waited 50 ms
    for a core still gets about 40 ms of runs (10 at half a core), where its wall time gave
    it one. Read from wall time, one GEMM got 3 runs in one calibration and 10 or 23 in the
    next, and its cost moved with the count."""
    from types import SimpleNamespace

    import torch

    from plait.bench import timing

    a, b = torch.randn(128, 128), torch.randn(128, 128)
    calls: list[float] = []

    def product() -> None:
        if len(calls) < 2:
            time.sleep(0.05)  # each of the two warm-ups below waits for a core
        started = time.process_time()
        while time.process_time() - started < 0.002:
            torch.mm(a, b)
        calls.append(time.process_time() - started)

    monkeypatch.setattr(timing, "crowding", lambda mesh: 2.0)
    monkeypatch.setattr(timing, "slowest", lambda mesh, values: list(values))
    mesh = SimpleNamespace(env=SimpleNamespace(world_size=4), device=torch.device("cpu"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (by_cpu,) = timing._bursts(mesh, [product], True, on_cpu=True)
        (by_wall,) = timing._bursts(mesh, [product], True)
    finally:
        torch.set_num_threads(threads)
    assert by_wall == 1
    assert 5 <= by_cpu <= 11, (by_cpu, calls)  # 0.04 s / (2 ms / 0.5 core); each run a little over 2 ms


@pytest.mark.one_process  # arithmetic: beside another such file (tests/pairing.py)
def test_a_crowded_hosts_gemm_reads_each_weight_cold() -> None:
    """A crowded host's GEMM timing reads its second operand from a pool larger than a core's
    caches, one view after the next, as training meets a layer's weights once a micro-batch:
    a 384 x 1152 weight's views are distinct, tile the 64 MiB pool and come round again; a
    weight larger than the pool is a tensor of its own. Resident, `small`'s micro-batches of
    4 were priced 3-5% over 8 where they measured 4.6-8.3% over."""
    import torch

    from plait.bench.calibrate import COLD_POOL_BYTES, ColdOperands

    cold = ColdOperands(torch.device("cpu"))
    weights = cold.cycle(384, 1152, torch.float32)
    fits = COLD_POOL_BYTES // 4 // (384 * 1152)
    seen = [next(weights) for _ in range(fits + 1)]
    assert all(w.shape == (384, 1152) for w in seen)
    assert len({w.data_ptr() for w in seen[:fits]}) == fits
    assert seen[fits].data_ptr() == seen[0].data_ptr()
    assert (seen[fits - 1].data_ptr() - seen[0].data_ptr()) // 4 == (fits - 1) * 384 * 1152
    large = next(cold.cycle(5000, 5000, torch.float32))
    assert large.shape == (5000, 5000)
    assert next(cold.cycle(16, 16, torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.one_process  # arithmetic: beside another such file (tests/pairing.py)
def test_attention_is_timed_as_the_model_calls_it_with_its_grouped_kv_heads(monkeypatch) -> None:
    """The calibration times the attention core with the model's K/V heads unexpanded, as
    causal_attention runs it: `small` (6 query heads, 2 K/V) at tp 1 and tp 2 gets K and V at
    2 and 1 heads, and the run passes forward and backward through the model's own call. At
    every query head it read `small`'s 4 sequences cheaper a sequence than its 8, which
    training does not run."""
    from types import SimpleNamespace

    import torch

    from plait.bench import calibrate as cal, timing

    calls: list[tuple[tuple[int, ...], ...]] = []
    model_call = cal.causal_attention

    def recorded(q, k, v):
        calls.append((tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return model_call(q, k, v)

    monkeypatch.setattr(cal, "causal_attention", recorded)
    monkeypatch.setattr(timing, "median_rounds", lambda mesh, runs, reps, watched=False: [run() or 1.0 for run in runs])
    monkeypatch.setattr(timing, "slowest", lambda mesh, values: list(values))
    mesh = SimpleNamespace(device=torch.device("cpu"))
    small = get_preset("small")
    rates = cal.measure_attention(mesh, small, 2, 16, [1, 2], "fp32", 1)
    assert len(rates) == 2
    assert calls == [((2, 6, 16, 64), (2, 2, 16, 64), (2, 2, 16, 64)),
                     ((2, 3, 16, 64), (2, 1, 16, 64), (2, 1, 16, 64))]
    assert cal._attention_run(mesh, (1, 4, 8, 16), "fp32")() is None  # a preset sweep's: every query head's own
    assert calls[-1] == ((1, 4, 8, 16), (1, 4, 8, 16), (1, 4, 8, 16))


@pytest.mark.one_process  # arithmetic: beside another such file (tests/pairing.py)
def test_a_crowded_hosts_compute_counts_its_bursts_from_cpu_time_and_a_collective_from_wall_time(monkeypatch) -> None:
    """The adds' bandwidth and the GEMMs count their runs a burst from CPU time on a crowded host
    (from wall time one add got 4 runs in one timing and 64 in the next, and read 4.4 and 17.2
    GB/s); the large collectives from wall time, which they spend waiting on their peers."""
    from types import SimpleNamespace

    import torch

    from plait.bench import calibrate as cal, comm_timing, timing

    read_on_cpu: list[bool] = []

    def bursts(mesh, fns, crowd, on_cpu=False):
        read_on_cpu.append(on_cpu)
        return [1] * len(fns)

    monkeypatch.setattr(timing, "_bursts", bursts)
    monkeypatch.setattr(timing, "crowded", lambda mesh: True)
    monkeypatch.setattr(timing, "slowest", lambda mesh, values: list(values))
    monkeypatch.setattr(timing, "round_spans", spans_on_one_clock)
    mesh = SimpleNamespace(env=SimpleNamespace(world_size=1), device=torch.device("cpu"))
    cal.measure_bandwidth(mesh, [1024], 1)
    cal.measure_gemms(mesh, {"fp32 8x8x8": cal.Gemm(8, 8, 8)}, "fp32", 1)
    comm_timing.link_rates(mesh, [lambda: None], 1)
    assert read_on_cpu == [True, True, False, False]  # adds, GEMMs, the collectives' warm rounds and timed ones


def test_a_calibration_records_how_crowded_its_host_was(monkeypatch, tmp_path: Path) -> None:
    """plait.bench.timing.crowding: 4 one-thread ranks on 2 cores ran two threads a core,
    2 threads a rank on 3 cores 8/3; ranks with a core each, a rank alone, ranks spread over
    hosts (LOCAL_WORLD_SIZE under the world) and a GPU, 1.0. The hardware file keeps it, and
    the lone rank's speedups by micro-batch, and the split backward's ratios."""
    from types import SimpleNamespace

    from plait.bench import timing

    def mesh(world: int, device: str = "cpu") -> SimpleNamespace:
        return SimpleNamespace(device=SimpleNamespace(type=device), env=SimpleNamespace(world_size=world))

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(timing.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(timing.torch, "get_num_threads", lambda: 1)
    assert timing.crowding(mesh(4)) == 2.0 and timing.crowded(mesh(4))
    assert timing.crowding(mesh(2)) == 1.0 and not timing.crowded(mesh(2))
    assert timing.crowding(mesh(1)) == 1.0 and timing.crowding(mesh(4, "cuda")) == 1.0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert timing.crowding(mesh(4)) == 1.0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(timing.os, "cpu_count", lambda: 3)
    monkeypatch.setattr(timing.torch, "get_num_threads", lambda: 2)
    assert timing.crowding(mesh(4)) == pytest.approx(8 / 3)
    crowded = replace(get_hardware("cpu"), crowding=2.0, lone_by_micro_batch=((4, 2.1), (16, 2.0)),
                      split_by_micro_batch=((4, 1.07), (16, 1.05)))
    (tmp_path / "hw.toml").write_text(hardware_toml(crowded))
    assert load_hardware(tmp_path / "hw.toml") == crowded


def test_a_quiet_cpu_calibration_sets_its_shapes_by_a_second_run_and_their_level_by_the_first() -> None:
    """plait.bench.timing._resident: three shapes whose second runs (operands in the caches)
    take 1, 2 and 4 s, and whose first runs paid a fixed 0.5 s each (1.5, 2.5, 4.5 s): each is
    its second run times the first runs' total over the second runs' (8.5 / 7), so the shapes
    keep the second runs' 1:2:4, with no fixed part for a split micro-batch to pay twice; no
    second run timed, the first as they are."""
    from plait.bench import timing

    level = 8.5 / 7
    assert timing._resident([1.5, 2.5, 4.5], [1.0, 2.0, 4.0]) == pytest.approx([level, 2 * level, 4 * level])
    assert timing._resident([1.5, 2.5], [0.0, 2.0]) == [1.5, 2.5]


def test_a_calibration_times_each_micro_batch_it_is_asked_for() -> None:
    """A plan weighs micro-batches against each other; read off a line fitted to one
    micro-batch's shapes, another's GEMMs took a fixed cost the shapes' own differences made
    (98 µs a GEMM on `small`, 17.5 with four micro-batches measured), which priced mb 4 x 2
    2.9% over mb 8, against 0.8% measured (benchmarks/RESULTS.md, "planner-measured")."""
    import plait.bench.calibrate as cal
    from plait.estimate.ops import attention_key, block_gemms, gemm_key

    config = get_preset("small")
    attention, gemms = cal.model_shapes(config, 8, 128, [1, 2], "fp32", [2], other_micro_batches=[4, 1])
    for batch in (8, 4, 1):
        for tp in (1, 2):
            assert all(gemm_key(g, "fp32") in gemms for g in block_gemms(config, batch * 128, tp))
            assert attention_key(config, batch, 128, tp, "fp32") in attention
    assert attention[0].startswith("attn fp32 b8 ")  # the asked micro-batch's core sets the efficiency
    assert attention[-1].startswith("ring")
    assert len(cal.model_shapes(config, 8, 128, [1], "fp32")[1]) < len(gemms)


def test_a_cpu_adds_bandwidth_leaves_out_its_dispatch(monkeypatch) -> None:
    """The time model adds each op's dispatch on its own (ops.elementwise_s); the bandwidth
    it divides bytes by must not hold it too. A 196 KiB add took 27 µs here, 4.6 of them its
    dispatch: counted twice, small activations' element-wise work ran dear."""
    import plait.bench.calibrate as cal
    from plait.runtime.mesh import init_mesh

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cal.timing, "median_rounds", lambda mesh, runs, reps, **how: [27e-6 for _ in runs])
    mesh = init_mesh()
    elements = 196608 // 4
    (size, with_dispatch), = cal.measure_bandwidth(mesh, [elements], 1)
    (_, without), = cal.measure_bandwidth(mesh, [elements], 1, op_s=4.6e-6)
    assert size == 196608 and with_dispatch == pytest.approx(3 * 196608 / 27e-6 / 1e9)
    assert without == pytest.approx(3 * 196608 / 22.4e-6 / 1e9)


def test_a_calibration_taken_on_a_busy_machine_is_not_cached_and_is_named(tmp_path: Path, monkeypatch) -> None:
    """Repeats of a GEMM's timing half a median apart (measured: 1.3-3x under two CPU burners,
    under 0.2 when quiet): the profile serves this run, says so, and is not cached."""
    from types import SimpleNamespace

    import plait.bench.calibrate as cal
    from plait.bench.machine import cache_path, machine_facts
    from plait.runtime.mesh import init_mesh
    from plait.train.config.settings import TrainConfig
    from plait.train.observe.timing import run_hardware

    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PLAIT_CALIBRATION", raising=False)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    measure = cal.measure_gemms

    def busy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        cal.timing.SPREADS.add([0.010, 0.011, 0.030, 0.031])  # a burner took the core half the time
        return measure(*args, **kwargs)

    monkeypatch.setattr(cal, "measure_gemms", busy)
    mesh = init_mesh()
    trainer = SimpleNamespace(config=TrainConfig(model="tiny", micro_batch=2, seq_len=32), mesh=mesh,
                              task=SimpleNamespace(calibration_shape=lambda: (get_preset("tiny"), 32)))
    hw, source = run_hardware(trainer)
    assert source.startswith("a NOISY calibration (repeats of one timing") and "not cached" in source, source
    assert hw.name.startswith("calibrated") and not cache_path(machine_facts(mesh)).exists()
    monkeypatch.setattr(cal, "measure_gemms", measure)
    assert run_hardware(trainer)[1].startswith("quick calibration")  # quiet again: measured and cached
    assert cache_path(machine_facts(mesh)).exists()


def test_an_fp8_calibration_times_the_blocks_as_float8_products_and_the_head_in_bf16(monkeypatch) -> None:
    """fp8's block GEMMs run as float8 products (twice bf16's rate on Hopper: 139 -> 72 ms on
    the 1 B model, benchmarks/RESULTS.md, 2026-11-30); timing them in bf16 priced an fp8 run
    as a bf16 one (0.2688 s against bf16's 0.2709, for 0.1934 measured). The head stays bf16."""
    import torch

    import plait.bench.calibrate as cal
    from plait.bench.machine import gemm_line
    from plait.estimate.hardware import get_hardware
    from plait.runtime.mesh import init_mesh

    config = get_preset("tiny")
    _, gemms = cal.model_shapes(config, 2, 32, [1], "fp8")
    head = [k for k, g in gemms.items() if config.vocab_size in (g.m, g.k, g.n)]
    assert head and {k.split()[0] for k in head} == {"bf16"}
    assert {k.split()[0] for k in gemms if k not in head} == {"fp8"}
    products = []
    real = torch._scaled_mm

    def counted(a, b, **kwargs):  # noqa: ANN001, ANN003, ANN202
        products.append((a.dtype, b.dtype, tuple(a.shape), tuple(b.shape)))
        return real(a, b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counted)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    mesh = init_mesh()
    try:
        rates = cal.measure_gemms(mesh, {"fp8 64x32x48": Gemm(64, 32, 48), "bf16 64x32x40": Gemm(64, 32, 40)}, "fp8", 1)
    finally:
        mesh.close()
    assert set(products) == {(torch.float8_e4m3fn, torch.float8_e4m3fn, (64, 32), (32, 48))}
    assert set(rates) == {"fp8 64x32x48", "bf16 64x32x40"} and min(rates.values()) > 0
    # Two lines: float8's peak from the fp8 shapes, the 16-bit one from the bf16 ones; on a GPU
    # never above the datasheet.
    h200 = get_hardware("h200")
    measured = {"fp8 1024x1024x1024": 500.0, "fp8 8192x8192x8192": 1500.0, "fp8 2048x2048x2048": 1000.0,
                "bf16 1024x1024x1024": 300.0, "bf16 8192x8192x8192": 750.0, "bf16 2048x2048x2048": 600.0}
    cpu = gemm_line(measured, "fp8", 0.0, "cpu", get_hardware("cpu"))
    gpu = gemm_line(measured, "fp8", 0.0, "cuda", h200)
    assert cpu["peak_fp8_tflops"] > 1000 and 600 < cpu["peak_bf16_tflops"] < 1000
    assert gpu["peak_fp8_tflops"] <= h200.peak_fp8_tflops and gpu["peak_bf16_tflops"] <= h200.peak_bf16_tflops
    assert gpu["peak_fp8_tflops"] > 1.5 * gpu["peak_bf16_tflops"]
    assert gemm_line(measured, "bf16", 0.0, "cpu", get_hardware("cpu")).keys() == {"peak_bf16_tflops", "gemm_fixed_us"}


def test_the_planner_check_pairs_each_step_with_the_same_rounds_others() -> None:
    """benchmarks/planner_measured.py's paired measurement: each step against the others' in
    its round. Two layouts, the second 10% faster, taking turns while the host runs twice as
    slow for two rounds of five; one of the second's fast-round steps is slow on its own. Its
    raw median then lands on that step and ranks it slower; paired, it is 0.9 of the first."""
    module = _benchmark("planner_measured")
    pace = [1.0, 2.0, 2.0, 1.0, 1.0]
    steps = [[1.0 * p for p in pace], [0.9 * p for p in pace]]
    steps[1][3] = 1.3
    assert statistics.median(steps[1]) > statistics.median(steps[0])
    paired = module.paired(steps)
    assert paired[1] / paired[0] == pytest.approx(0.9)
    assert module.spearman([1.0, 0.9], paired) == pytest.approx(1.0)


def test_the_planner_check_reads_how_well_its_measurement_agrees_with_itself() -> None:
    """The benchmark's `self_agreement`: the paired steps of the odd rounds ranked against the
    even rounds'. Three layouts 10% apart agree with themselves (1.0) whatever the host's pace
    does to a round; two of them 0.5% apart, one ahead in the odd rounds and the other in the
    even ones, swap places between the halves, and the order reads 0.5."""
    module = _benchmark("planner_measured")
    pace = [1.0, 1.5, 1.0, 2.0, 1.0, 1.0, 1.2, 1.0]
    apart = [[level * p for p in pace] for level in (1.0, 1.1, 1.2)]
    assert module.self_agreement(apart) == pytest.approx(1.0)
    close = [[p * (1.0 + 0.01 * (r % 2)) for r, p in enumerate(pace)],
             [p * (1.01 - 0.01 * (r % 2)) for r, p in enumerate(pace)], [1.2 * p for p in pace]]
    assert module.self_agreement(close) == pytest.approx(0.5)
    assert math.isnan(module.self_agreement([steps[:3] for steps in apart]))  # too few rounds to halve


def test_the_planner_check_gives_each_gap_the_interval_its_rounds_allow() -> None:
    """The benchmark's `paired_intervals`: each layout's paired step over the first's, its
    rounds drawn again. Over 40 rounds of a host whose pace wanders 1.0-1.9, a layout 10% slower
    than the first with its own 1% noise reads within 10 ± 1.5%, its interval under 2% wide;
    a layout no slower than the first holds 1.0; fewer rounds give a wider interval; a plan of
    one layout has no gap to resolve (nan), not an error."""
    module = _benchmark("planner_measured")
    noise = random.Random(7)
    pace = [1.0 + 0.9 * noise.random() for _ in range(40)]
    steps = [[level * p * (1 + 0.01 * noise.gauss(0, 1)) for p in pace] for level in (1.0, 1.1, 1.0)]
    first, slower, same = module.paired_intervals(steps)
    assert first == (1.0, 1.0)
    assert 1.085 < slower[0] < slower[1] < 1.115 and slower[1] - slower[0] < 0.02
    assert same[0] < 1.0 < same[1] and same[1] - same[0] < 0.02
    fewer = module.paired_intervals([taken[:8] for taken in steps])
    assert fewer[2][1] - fewer[2][0] > same[1] - same[0]
    alone = module.world_result([{"step_s": 1.0}], {0: steps[0]}, steps[:1])  # a plan of one layout
    assert alone["intervals"] == [(1.0, 1.0)] and math.isnan(alone["resolution"])


def test_layouts_take_turns_once_a_round_in_a_new_order_the_same_on_every_rank() -> None:
    """plait.bench.turns.take_turns, as the planner check and its slow test's world run their
    layouts: three stand-in trainers over 12 rounds each step once a round, the first
    WARM_STEPS of each left out; the orders differ between rounds (no layout always follows
    the same one: each one precedes another at least once and follows it at least once), and
    a second world from the same seed (another rank) takes the same orders."""
    from plait.bench.turns import WARM_STEPS, take_turns

    class Stand:
        def __init__(self, name: str, log: list[tuple[str, int]]):
            self.name, self.log = name, log

        def train_step(self, step: int) -> dict:
            self.log.append((self.name, step))
            return {"step_time_s": float(len(self.log))}

    def world() -> tuple[list[list[float]], list[tuple[str, int]]]:
        log: list[tuple[str, int]] = []
        return take_turns([Stand(name, log) for name in "abc"], 12), log

    times, log = world()
    assert [len(taken) for taken in times] == [12 - WARM_STEPS] * 3
    rounds = [[name for name, step in log if step == r] for r in range(12)]
    assert all(sorted(names) == ["a", "b", "c"] for names in rounds)
    assert len({tuple(names) for names in rounds}) > 1
    for x, y in (("a", "b"), ("a", "c"), ("b", "c")):
        before = [names.index(x) < names.index(y) for names in rounds]
        assert any(before) and not all(before), (x, y, rounds)
    for taken, name in zip(times, "abc"):  # each step's time is its place in the log: its own, in order
        assert taken == [float(i + 1) for i, entry in enumerate(log) if entry[0] == name][WARM_STEPS:]
    assert world() == (times, log)


@pytest.mark.slow
def test_the_plans_first_layouts_measure_as_it_ranks_them(tmp_path: Path) -> None:
    """`plait plan` from this machine's full calibration (every micro-batch a rank's share of
    the batch allows), then its first three layouts that 2 data-parallel ranks run, each
    trained: the first pick within 5% of the fastest measured (less two standard errors of
    their rounds' ratio), and each layout priced within
    10% against the others (its predicted / measured within 10% of the three's median ratio),
    the median ratio within 25% of 1 (where the calibration's pace and the training's differed by
    more than 20%, the machine is timed again after the layouts and each priced at the mean of
    the two: one closing run here had the host 26% slower in the calibration than in the
    training).

    The layouts take turns step by step, 12 steps each, and each is measured against the
    others in its round (the benchmark's `paired`): a slow stretch of the host slows a round's
    every step alike and cancels. The calibration is a full one (11 rounds of each shape), as
    `plait calibrate` runs by default, less the ranks' lag and the send/recv latency, which no
    data-parallel layout pays (machine.calibrate's data_parallel_only: 6.3-6.5 s here against
    19.3-19.9 s with them, timed in turn on a busy host). With a quick one (3 rounds), priced
    again after the layouts ran and the two averaged, and raw median steps, this test failed 3
    runs in 7 on this host: one quick calibration priced micro-batch 2 at 1.02 times
    micro-batch 4, the next at 1.16, and four in a row put micro-batch 4, 4, 2 and 1 first
    where 8 measured fastest. Six runs as it is now all passed, every first pick micro-batch
    8, measuring within 0-3.4% of the fastest. benchmarks/planner_measured.py runs the whole
    check (top six, tp and cp included, each prediction held to 10% of its own measurement;
    benchmarks/RESULTS.md, "planner-measured")."""
    _, reports = run_world("planner_world.py", 2, tmp_path, str(tmp_path / "run"), "small", "16", "12", "3",
                           timeout=900)
    trained = reports[0]["trained"]
    assert len(trained) == 3, reports[0]
    measured = _benchmark("planner_measured").paired([t["steps"] for t in trained])
    # priced at the mean of the machine timed before and after them where the two paces differed
    # (tests/worlds/planner_world.RECHECK_PACE)
    ratios = [statistics.fmean([t["predicted"], t.get("predicted_after", t["predicted"])]) / m
              for t, m in zip(trained, measured)]
    pace = statistics.median(ratios)
    assert all(abs(r / pace - 1) <= 0.1 for r in ratios), (measured, trained)
    assert abs(pace - 1) <= 0.25, (measured, trained)
    # The plan's first pick (its rows by step) within 5% of the fastest, up to the measurement's
    # own uncertainty: the rounds' log step ratio of the two, its mean less two standard errors.
    # Three layouts that measure within a few percent are a tie 12 rounds cannot order (one
    # closing run here: 5.3% over, its steps spread 0.91-1.42 s).
    fastest = measured.index(min(measured))
    logs = [math.log(a / b) for a, b in zip(trained[0]["steps"], trained[fastest]["steps"])]
    assert len(logs) > 1, trained  # a standard error needs two rounds: never skip the check
    over = statistics.fmean(logs) - 2 * statistics.stdev(logs) / math.sqrt(len(logs))
    assert over <= math.log(1.05), (measured, over, trained)


def test_a_full_cpu_calibration_records_the_split_backward_and_a_quick_one_does_not(monkeypatch) -> None:
    """plait.bench.machine.calibrate, every measurement replaced by a fixed one on a fake
    4-rank CPU mesh: a full calibration that prices split layouts records the split backward's
    ratio at each micro-batch (a measured 0.97 clamped to 1: the split does all of a whole
    backward's work, 1.08 kept) beside the lone speedups; a quick one, or one for data
    parallelism alone, records neither."""
    from types import SimpleNamespace

    from plait.bench import calibrate as cal
    from plait.bench import machine

    mesh = SimpleNamespace(device=SimpleNamespace(type="cpu"), env=SimpleNamespace(world_size=4))
    memory = {"memory_gb_s": 10.0, "memory_by_size": ((4096, 10.0),), "op_overhead_us": 10.0,
              "view_overhead_us": 0.5, "step_overhead_us": 40.0, "optimizer_tensor_us": 4.0, "grad_tensor_us": 8.0}
    fixed = {"measure_gemms": lambda *a, **k: {"fp32 512x384x384": 0.08, "fp32 1024x384x384": 0.09},
             "measure_attention": lambda *a, **k: {}, "measure_memory": lambda *a, **k: dict(memory),
             "measure_host_update": lambda *a, **k: 5.0, "measure_links": lambda *a, **k: (((4, 300.0, 1.0),), ()),
             "measure_p2p": lambda *a, **k: 3000.0, "measure_lags": lambda *a, **k: (),
             "measure_lone_speedup": lambda mesh, config, mb, seq: 2.0 + mb / 100,
             "measure_split_backward": lambda mesh, config, mb, seq, precision: {4: 0.97, 8: 1.08}[mb],
             "crowding": lambda mesh: 2.0, "crowded": lambda mesh: True}
    from plait.bench import comm_timing, pace, timing

    homes = {"measure_links": comm_timing, "measure_p2p": comm_timing, "measure_lags": comm_timing,
             "measure_lone_speedup": pace, "measure_split_backward": pace, "crowding": timing, "crowded": timing}
    for name, value in fixed.items():
        monkeypatch.setattr(homes.get(name, cal), name, value)
    monkeypatch.setattr(machine, "machine_facts", lambda *a, **k: {"host": "test", "gpu": ""})

    def calibrated(**options) -> object:
        return machine.calibrate(mesh, get_preset("small"), micro_batch=8, seq_len=128, tp_sizes=[1],
                                 precision="fp32", other_micro_batches=[4], **options)

    full = calibrated()
    assert full.split_by_micro_batch == ((4, 1.0), (8, 1.08))  # recorded as read, 0.97 clamped
    assert full.split_backward(8) == full.split_backward(4) == pytest.approx(1.04)  # priced through the fit
    assert full.lone_by_micro_batch == ((4, 2.04), (8, 2.08)) and full.crowding == 2.0
    for lean in (calibrated(quick=True), calibrated(data_parallel_only=True)):
        assert lean.split_by_micro_batch == () and lean.lone_by_micro_batch == () and lean.split_backward(8) == 0.0
