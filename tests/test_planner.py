"""The planner: what it searches, only layouts that fit, fastest first; pruning that never
drops a layout that would rank; `plait plan` and its --explain."""

from __future__ import annotations

import json
from dataclasses import replace
import re

import pytest

from plait.errors import PlaitError
from plait.estimate.cli import plan_main as plan_with
from plait.estimate.hardware import GIB, get_hardware
from plait.estimate.layout import Workload, layout_stages
from plait.estimate.memory import estimate_memory, stage_memory
from plait.estimate.planner import (SEARCHED_SCHEDULES, PlanRequest, Search, candidates, plan, plan_layouts,
                                    plan_request, shapes, tails)
from plait.estimate.network import inter_node
from plait.estimate.time import estimate_time
from plait.families import shape_of
from plait.models.gpt.config import get_preset


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def plan_main(argv: list[str]) -> int:
    return plan_with(argv, shape_of)


def test_every_row_is_a_valid_layout() -> None:
    cfg = get_preset("llama-7b")
    rows = plan(cfg, gpus=16, gpus_per_node=8, hardware="a100-80gb", global_batch=64, seq_len=2048, top=60)
    assert len(rows) == 60
    for r in rows:
        assert r["dp"] * r["tp"] * r["pp"] * r["cp"] == 16
        assert cfg.n_heads % r["tp"] == 0 and cfg.n_kv_heads % r["tp"] == 0
        assert r["cp_kind"] == "ring" or cfg.n_heads // r["tp"] % r["cp"] == 0  # Ulysses splits whole heads
        assert r["tp"] <= 8 and r["pp"] <= cfg.n_layers
        assert r["dp"] * r["micro_batch"] * r["grad_accum"] == 64
        assert r["memory_bytes"] <= get_hardware("a100-80gb").usable_bytes
        assert r["zero"] == 0 or r["dp"] * r["cp"] > 1  # one replica has nothing to shard
        assert r["dp_shard"] == 0 or (r["zero"] and r["dp"] * r["cp"] % r["dp_shard"] == 0)
        assert r["schedule"] in SEARCHED_SCHEDULES and (r["virtual_stages"] > 1) == (r["schedule"] == "interleaved")
        if r["schedule"] == "zb-h1" and r["pp"] > 1:
            assert r["recompute"] == "none" and r["zero"] <= 1  # plait.rules.check_split_backward
    times = [r["step_s"] for r in rows]
    assert times == sorted(times)


def test_tp_stays_inside_a_node() -> None:
    request = PlanRequest(config=get_preset("llama-70b"), gpus=16, gpus_per_node=2,
                          hardware=get_hardware("h100-sxm"), global_batch=32, seq_len=1024)
    assert {layout.tp for layout in shapes(request)} == {1, 2}


def test_tp_divides_heads() -> None:
    # small: 6 heads, 2 kv heads, ffn 1024 -> tp in {1, 2}
    request = PlanRequest(config=get_preset("small"), gpus=6, gpus_per_node=8,
                          hardware=get_hardware("cpu"), global_batch=12, seq_len=128)
    assert {layout.tp for layout in candidates(request)} == {1, 2}


def test_a_looped_model_is_planned_without_a_pipeline() -> None:
    """A model whose forward runs a block again (GPTConfig.block_runs) has no pipeline cut
    (rules.check_pipeline_cut): the search leaves pp out, and prices each run's compute."""
    looped = replace(get_preset("small"), block_runs=(1, 2, 2, 1, 1, 1))
    request = PlanRequest(config=looped, gpus=4, gpus_per_node=8, hardware=get_hardware("cpu"), global_batch=8,
                          seq_len=128)
    assert {layout.pp for layout in candidates(request)} == {1}
    assert {layout.pp for layout in candidates(replace(request, config=get_preset("small")))} == {1, 2, 4}
    layout = Workload(dp=4, micro_batch=2, seq_len=128, precision="fp32")
    cpu = get_hardware("cpu")
    looped_s, once_s = (estimate_time(c, layout, cpu, 8).compute_s for c in (looped, get_preset("small")))
    assert looped_s / once_s == pytest.approx(8 / 6, rel=0.2)  # 8 block runs against 6 (the head's work aside)
    # ZeRO-3 gathers the two looped blocks again before their second runs: the step's dp time
    # holds those gathers, and none with --reshard-after-forward false (the unit kept gathered)
    zero3 = Workload(dp=4, zero=3, micro_batch=2, seq_len=128, precision="fp32")
    kept = replace(zero3, reshard_after_forward=False)
    dp_s = {(c is looped, w.reshard_after_forward): estimate_time(c, w, cpu, 8).dp_s
            for c in (looped, get_preset("small")) for w in (zero3, kept)}
    assert dp_s[True, True] > dp_s[False, True] and dp_s[True, False] == dp_s[False, False]


def test_the_search_covers_schedules_virtual_stages_and_recompute() -> None:
    """llama-70b's 80 layers on 16 GPUs: interleaving at v 2 and 4 on every pp (equal chunks
    where pp·v divides the layers, balanced where it does not), at micro-batch counts pp
    divides and at those it does not (plait.interleave's rounds), zb-h1 without
    recomputation, every recompute policy, gpipe only when asked."""
    request = PlanRequest(config=get_preset("llama-70b"), gpus=16, gpus_per_node=8,
                          hardware=get_hardware("h100-sxm"), global_batch=32, seq_len=1024)
    found = list(shapes(request))
    piped = [layout for layout in found if layout.pp > 1]
    assert {layout.schedule for layout in piped} == {"1f1b", "interleaved", "zb-h1"}
    assert {(layout.pp, layout.virtual_stages) for layout in piped if layout.schedule == "interleaved"} == {
        (pp, v) for pp in (2, 4, 8, 16) for v in (2, 4)}
    interleaved = [layout for layout in piped if layout.schedule == "interleaved"]
    assert {layout.grad_accum % layout.pp == 0 for layout in interleaved} == {True, False}
    assert {layout.recompute for layout in found} == {"none", "selective", "full"}
    assert {layout.recompute for layout in piped if layout.schedule == "zb-h1"} == {"none"}
    assert {layout.schedule for layout in found if layout.pp == 1} == {"1f1b"}  # alike without a pipeline
    gpipe = PlanRequest(config=get_preset("llama-70b"), gpus=16, gpus_per_node=8, hardware=get_hardware("h100-sxm"),
                        global_batch=32, seq_len=1024, schedules=("gpipe",))
    assert {layout.schedule for layout in shapes(gpipe)} == {"gpipe"}


def test_hybrid_sharding_groups_span_whole_nodes() -> None:
    """dp_shard: the dp·cp ranks of 1, 2, 4 nodes (a node holds 8 / tp of them), below all 32."""
    request = PlanRequest(config=get_preset("llama-7b"), gpus=64, gpus_per_node=8,
                          hardware=get_hardware("h100-sxm"), global_batch=64, seq_len=4096)
    shape = Workload(dp=16, tp=2, cp=2, precision="bf16", micro_batch=1, grad_accum=4, seq_len=4096)
    options = {(layout.zero, layout.dp_shard) for layout in tails(request, shape)}
    assert options == {(0, 0)} | {(zero, n) for zero in (1, 2, 3) for n in (0, 4, 8, 16)}
    wide = Workload(dp=8, tp=8, precision="bf16", micro_batch=1, grad_accum=8, seq_len=4096)
    assert {layout.dp_shard for layout in tails(request, wide)} == {0, 2, 4}  # one rank a node: 2, 4 nodes


PRUNED_CASES = [  # (model, GPUs, global batch, sequence, hardware, offload, top)
    ("tiny", 4, 8, 64, "cpu", False),
    ("small", 8, 16, 256, "cpu", True),
    ("gpt2-124m,vocab_size=50304", 8, 32, 1024, "rtx4090", False),
    ("mixtral-8x7b", 16, 64, 4096, "h100-sxm", False),
    ("llama-70b", 16, 32, 4096, "h100-sxm", False),
]


@pytest.mark.parametrize("model, gpus, batch, seq, hardware, offload", PRUNED_CASES)
def test_the_pruned_search_ranks_as_the_exhaustive_one(model: str, gpus: int, batch: int, seq: int, hardware: str,
                                                        offload: bool) -> None:
    request = plan_request(get_preset(model), gpus=gpus, global_batch=batch, seq_len=seq, hardware=hardware,
                           offload=offload)
    every = plan_layouts(request, exhaustive=True)
    for top in (1, 10):
        assert plan_layouts(request, top) == every[:top]


def test_schedules_alike_in_cost_are_each_run_for_their_own_span() -> None:
    """GPipe and 1F1B share every shape's micro-batch costs and lower bound, yet their spans
    differ on an uneven cut: the search runs each schedule for its own (small with 7 blocks,
    cut 5,2, on 2 GPUs; a span cached by the costs alone once ranked GPipe's in 1F1B's place
    and missed the best layouts)."""
    request = plan_request(get_preset("small,n_layers=7"), gpus=2, global_batch=8, seq_len=128, hardware="cpu",
                           schedule="gpipe,1f1b", stage_layers=(5, 2))
    every = plan_layouts(request, exhaustive=True)
    assert {row["schedule"] for row in every} == {"gpipe", "1f1b"}
    assert plan_layouts(request, 3) == every[:3]
    for row in every[:3]:
        layout = Workload(pp=2, micro_batch=row["micro_batch"], grad_accum=row["grad_accum"], seq_len=128,
                          schedule=row["schedule"], stage_layers=(5, 2), zero=row["zero"], sp=row["sp"],
                          recompute=row["recompute"], precision="bf16")
        assert row["step_s"] == pytest.approx(
            estimate_time(request.config, layout, request.hardware, request.gpus_per_node).step_s, rel=1e-12)


def test_the_bounds_hold_on_every_layout() -> None:
    """What the pruning stands on, held on each of small's layouts: the core and the step
    bound never exceed estimate_time's step (with a pipeline the core is the schedule's lower
    bound), the search's cached parts assemble to estimate_time's own step, and the shape's
    memory bound and the first stage never exceed estimate_memory's busiest rank."""
    request = plan_request(get_preset("small"), gpus=8, global_batch=16, seq_len=256, hardware="cpu", offload=True)
    search, checked, piped = Search(request), 0, 0
    costs = search.costs
    for shape in shapes(request):
        core, memory_floor = costs.core(shape), costs.memory_bound(shape)
        for layout in tails(request, shape):
            step = estimate_time(request.config, layout, request.hardware, request.gpus_per_node).step_s
            bound, memory = costs.step_bound(layout, core), estimate_memory(request.config, layout).total
            assert core.s <= bound <= step * (1 + 1e-12)
            parts = costs.parts(layout, inter_node(layout, request.gpus_per_node))
            cached = estimate_time(request.config, layout, request.hardware, request.gpus_per_node, parts).step_s
            assert cached == step
            piped += layout.pp > 1
            first = stage_memory(request.config, layout, layout_stages(request.config, layout)[0]).total
            assert memory_floor <= memory * (1 + 1e-12) and first <= memory
            checked += 1
    assert checked > 3000 and piped > 1000


def test_why_heavier_recompute_and_zero_are_not_pruned_as_slower() -> None:
    """The claims the planner does not rely on, in this time model. Without a pipeline a longer
    backward hides more of ZeRO-3's sync: llama-7b's selective recomputation on 32 GPUs, one
    1,024-token sequence each, costs 1.6 ms of compute and nothing of the step, whose sync is
    exposed. And ZeRO-1 shards the update: on 128 GPUs at tp 8 its optimizer step is four
    times faster than ZeRO-0's, yet its step is not (by 1.5%: the weights' gather is exposed,
    on each rank's own NIC, and ZeRO-0's all-reduce may take NCCL's tree)."""
    config, hw = get_preset("llama-7b"), get_hardware("h100-sxm")
    base = Workload(dp=32, zero=3, precision="bf16", micro_batch=1, grad_accum=1, seq_len=1024)
    plain, selective = (estimate_time(config, base.replace(recompute=r), hw, 8) for r in ("none", "selective"))
    assert selective.compute_s - plain.compute_s == pytest.approx(0.0016, abs=1e-4)
    assert plain.dp_s > 0.01 and -1e-12 <= selective.step_s - plain.step_s < (selective.compute_s - plain.compute_s) / 3
    base = Workload(dp=16, tp=8, sp=True, precision="bf16", micro_batch=4, grad_accum=1, seq_len=2048)
    zero0, zero1 = (estimate_time(config, base.replace(zero=z), hw, 8) for z in (0, 1))
    assert zero1.optimizer_s < zero0.optimizer_s / 4 and zero0.step_s < zero1.step_s < zero0.step_s * 1.05


def test_top_limits_the_list() -> None:
    rows = plan(get_preset("tiny"), gpus=2, hardware="cpu", global_batch=8, seq_len=64, top=3)
    assert len(rows) == 3


def test_schedule_restricts_the_search() -> None:
    cfg = get_preset("llama-7b")
    for schedule, allowed in (("1f1b", {"1f1b"}), ("gpipe,zb-h1", {"gpipe", "zb-h1"}), (None, set(SEARCHED_SCHEDULES))):
        rows = plan(cfg, gpus=16, global_batch=32, seq_len=2048, schedule=schedule, top=200)
        assert {r["schedule"] for r in rows if r["pp"] > 1} <= allowed
    assert {r["schedule"] for r in plan(cfg, gpus=16, global_batch=32, seq_len=2048, top=2000) if r["pp"] > 1} == {
        "1f1b", "interleaved", "zb-h1"}


def test_nothing_fits_names_the_smallest_need() -> None:
    cfg = get_preset("llama-70b")
    with pytest.raises(PlaitError) as err:
        plan(cfg, gpus=2, gpus_per_node=2, hardware="rtx3090", global_batch=2, seq_len=4096, top=10)
    match = re.match(r"nothing fits: the smallest layout needs ([\d.]+) GiB per GPU", err.value.message)
    assert match, err.value.message
    request = PlanRequest(config=cfg, gpus=2, gpus_per_node=2, hardware=get_hardware("rtx3090"),
                          global_batch=2, seq_len=4096)
    smallest = min(estimate_memory(cfg, layout).total for layout in candidates(request))
    assert float(match.group(1)) == pytest.approx(smallest / GIB, abs=0.05)
    assert "--offload" in err.value.hint


def test_no_valid_layout_at_all() -> None:
    # tiny on 3 GPUs: tp must divide 4 heads (tp = 1), pp <= 2 layers (pp = 1), so dp = 3,
    # which does not divide a global batch of 4.
    with pytest.raises(PlaitError, match="no layout of 3 GPUs fits"):
        plan(get_preset("tiny"), gpus=3, hardware="cpu", global_batch=4, top=5)


def test_bad_plan_requests() -> None:
    with pytest.raises(PlaitError, match="--gpus must be a whole number of at least 1"):
        plan(get_preset("tiny"), gpus=0, global_batch=4)
    with pytest.raises(PlaitError, match="unknown --schedule 'pipedream'") as err:
        plan(get_preset("tiny"), gpus=2, global_batch=4, schedule="1f1b,pipedream")
    assert "zb-h1" in err.value.hint


# -- plait plan ------------------------------------------------------------------------------
def test_plan_cli_table(capsys) -> None:
    code = plan_main(["--model", "llama-70b", "--gpus", "64", "--gpus-per-node", "8",
                      "--hardware", "h100-sxm", "--global-batch", "1024", "--seq-len", "4096",
                      "--top", "5"])
    out = capsys.readouterr().out
    assert code == 0
    assert "llama-70b on 64 x h100-sxm" in out and "schedule" in out.splitlines()[2]
    assert len([line for line in out.splitlines() if re.match(r"\s*\d+\s+\d+\s+\d+", line)]) == 5


def test_plan_cli_json(capsys) -> None:
    plan_main(["--model", "small", "--gpus", "4", "--hardware", "cpu", "--global-batch", "8",
               "--seq-len", "128", "--precision", "fp32", "--json", "--top", "2"])
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 and rows[0]["step_s"] <= rows[1]["step_s"]
    assert {"schedule", "virtual_stages", "dp_shard"} <= set(rows[0])


def test_plan_prices_packed_documents_mask_as_estimate_does(capsys) -> None:
    """--doc-mask reaches every layout the plan weighs: its first layout holds what `plait
    estimate` gives that layout with the mask (SDPA's dense b·s² mask, once a forward), more
    than without it."""
    from plait.estimate import estimate_layout

    argv = ["--model", "small", "--gpus", "2", "--hardware", "cpu", "--global-batch", "4", "--seq-len", "512",
            "--precision", "fp32", "--json", "--top", "1"]
    for doc_mask in ("", "dense"):
        plan_main(argv + (["--doc-mask", doc_mask] if doc_mask else []))
        row = json.loads(capsys.readouterr().out)[0]
        layout = {key: row[key] for key in ("dp", "tp", "pp", "cp", "zero", "micro_batch", "grad_accum", "recompute",
                                            "sp", "schedule", "virtual_stages")}
        masked = estimate_layout(get_preset("small"), hardware="cpu", seq_len=512, precision="fp32",
                                 doc_mask="dense", **layout)["memory"]["total"]
        plain = estimate_layout(get_preset("small"), hardware="cpu", seq_len=512, precision="fp32",
                                **layout)["memory"]["total"]
        assert masked > plain
        assert row["memory_bytes"] == (masked if doc_mask else plain), (doc_mask, layout)


EXPLAINED = ["--model", "llama-70b", "--gpus", "16", "--hardware", "h100-sxm", "--global-batch", "32",
             "--seq-len", "4096", "--top", "3", "--explain"]


def test_explain_says_why_the_first_layout_wins(capsys) -> None:
    """llama-70b on 16 H100s: the best is ZeRO-3 over dp 8 with tp 2 and full recomputation
    (dp 2 × cp 4 and dp 4 × cp 2 take as long, and hold cp's rope rows besides); the text
    names its bubble, what it waits for, recompute's cost, its headroom, and each choice's
    absence: slower, or nothing fits."""
    assert plan_main(EXPLAINED) == 0
    out = capsys.readouterr().out
    assert [line.split()[:5] for line in out.splitlines() if line[:2] in ("1 ", "2 ", "3 ")] == [
        ["1", "8", "2", "1", "1"], ["2", "2", "2", "1", "4"], ["3", "4", "2", "1", "2"]]
    text = out.split("why #1 wins: ", 1)[1]
    assert text.startswith("dp=8 tp=2 pp=1 zero=3 sp, micro-batch 1 x 4, recompute full")
    for part in ("of which recompute", "bubble", "% of the step)", "communication it waits for: tp", "headroom",
                 "the best layout with", "no sp: ", "ZeRO 0-2: "):
        assert part in text
    assert re.search(r"tp = 1: nothing fits \(the smallest needs [\d.]+ GiB\)", text)
    # without recompute cp 2's ring at tp 8 fits, by the gated product down's backward makes
    # again (it needed 78.0 GiB while the product was kept, and 19.3 s before its o_proj was
    # counted keeping the output's bf16 cast beside the ring's fp32 one: tests/matrix.py)
    assert re.search(r"no recompute: 19\.3 s, [\d.]+% slower \(dp=1 tp=8 pp=1 cp=2 zero=3 sp, micro-batch 1 x 32", text)
    # 80 layers in pp 8 × 4 chunks of 2 and 3 (balanced, not equal)
    assert "ZeRO 0-2: 10.3 s, 13.4% slower (dp=1 tp=2 pp=8 zero=0 sp, interleaved x4, micro-batch 1 x 32" in text
    assert len(text.splitlines()) <= 12


def test_explain_in_json_holds_the_restricted_bests(capsys) -> None:
    """Each alternative is the exhaustive ranking's first layout without that choice; where none
    fits, the smallest is the least memory of the candidates without it."""
    request = plan_request(get_preset("llama-70b"), gpus=16, global_batch=32, seq_len=4096, hardware="h100-sxm")
    every = plan_layouts(request, exhaustive=True)
    plan_main(EXPLAINED[:-1] + ["--explain", "--json"])
    out = json.loads(capsys.readouterr().out)
    why, best = out["explain"], out["layouts"][0]
    assert why["layout"] == best == every[0]
    assert set(why["exposed_s"]) == {"tp", "pp", "cp", "ep", "dp", "offload"}
    assert why["bubble_share"] == pytest.approx(why["time"]["bubble_s"] / best["step_s"])
    assert why["headroom_bytes"] == pytest.approx(get_hardware("h100-sxm").usable_bytes - best["memory_bytes"])
    assert why["recompute_s"] > 0.2 * why["time"]["compute_s"]  # full recompute: a forward more
    keep = {"no sp": lambda r: not r["sp"], "cp = 1": lambda r: r["cp"] == 1, "tp = 1": lambda r: r["tp"] == 1,
            "no recompute": lambda r: r["recompute"] == "none", "ZeRO 0-2": lambda r: r["zero"] < 3}
    assert [other["label"] for other in why["without"]] == ["tp = 1", "no recompute", "no sp", "ZeRO 0-2"]
    for other in why["without"]:
        first = next((row for row in every if keep[other["label"]](row)), None)
        assert other["layout"] == first
        if first:
            assert other["slower"] == pytest.approx(first["step_s"] / best["step_s"] - 1)
    alone = min(estimate_memory(request.config, layout).total for layout in candidates(request) if layout.tp == 1)
    assert why["without"][0]["smallest_bytes"] == alone


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt5", "--gpus", "8", "--global-batch", "8"], "unknown --model 'gpt5'"),
    (["--model", "tiny", "--gpus", "8", "--global-batch", "8", "--hardware", "abacus"],
     "unknown hardware 'abacus'"),
    (["--gpus", "8", "--global-batch", "8"], "no model given"),
    (["--model", "llama-70b", "--gpus", "1", "--global-batch", "1", "--hardware", "rtx4090"],
     "nothing fits: the smallest layout needs"),
    (["--model", "llama-70b", "--gpus", "1", "--global-batch", "1", "--hardware", "rtx4090", "--explain"],
     "nothing fits: the smallest layout needs"),
    (["--model", "tiny", "--gpus", "2", "--global-batch", "4", "--schedule", "1f1b,pipedream"],
     "unknown --schedule 'pipedream'"),
])
def test_plan_cli_bad_input(argv: list[str], message: str) -> None:
    with pytest.raises(PlaitError) as err:
        plan_main(argv)
    assert message in err.value.message and "\n" not in err.value.message and err.value.hint
    if "model" in message:
        assert "llama-7b" in err.value.hint  # lists the valid names


def test_a_long_sequence_is_planned_with_context_parallelism() -> None:
    """256K tokens of llama-7b on 8 GPUs, one sequence per step: data parallelism has nothing to
    split, and the fastest layouts that fit split the sequence (cp, with ZeRO-3 over dp·cp). (At
    128K, tp 8 with SP fits without recompute, 76.7 GiB, since SwiGLU's product is made again for
    down's backward, and is the fastest.)"""
    rows = plan(get_preset("llama-7b"), gpus=8, gpus_per_node=8, hardware="h100-sxm", global_batch=1,
                seq_len=262144)
    assert (rows[0]["cp"], rows[0]["cp_kind"], rows[0]["zero"]) == (8, "ring", 3)
    assert all(r["dp"] == 1 for r in rows)
    assert min(r["step_s"] for r in rows if r["cp"] == 1) > rows[0]["step_s"]  # tp 8 alone is slower


def test_the_plan_prices_the_runs_gradient_buckets() -> None:
    """--bucket-mb reaches every layout the planner prices (here the best is ZeRO-3 over 64
    GPUs, whose last bucket, exposed after the backward, grows with it: a slower plan by a
    millisecond), and a bucket of no size is refused in one line."""
    cfg = get_preset("llama-7b")
    default, large = (plan(cfg, gpus=64, global_batch=256, top=1, bucket_mb=mb)[0] for mb in (25.0, 400.0))
    assert large["zero"] == default["zero"] == 3 and 0 < large["step_s"] - default["step_s"] < 0.002
    with pytest.raises(PlaitError, match="--bucket-mb must be a positive number"):
        plan(cfg, gpus=64, global_batch=256, bucket_mb=0.0)
