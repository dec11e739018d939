"""Hybrid sharding (--dp-shard N): refused in one line where it cannot apply, priced per axis
with the link each axis rides, and a checkpoint written under it resumes under plain ZeRO-3
and under data parallelism. Its parity with one process, and its ledger against the
formula per axis (dp_shard's reduce-scatter and all-gather, dp_replicate's all-reduce), are
the parity matrix's rows with --dp-shard (tests/matrix.py: ZeRO 1, 2 and 3, with pp, and a
Llama under cp)."""

from __future__ import annotations

import json

import pytest

from plait.cli import main
from plait.estimate import estimate_layout
from plait.estimate.layout import Workload
from plait.models.gpt.config import get_preset
from tests.parity import assert_losses_close, assert_params_close
from tests.worldlib import run_losses, run_plait, run_weights

TINY = ["--model", "tiny", "--steps", "4", "--micro-batch", "2", "--seq-len", "16", "--eval-every", "0",
        "--sample-tokens", "0", "--warmup-steps", "1", "--no-report"]


@pytest.mark.parametrize("flags, message", [
    (["--nproc", "4", "--dp-shard", "2"], "--dp-shard 2 shards ZeRO's states inside groups of data ranks, and --zero is 0"),
    (["--nproc", "4", "--zero", "1", "--dp-shard", "3"], "--dp-shard 3 does not divide the 4 data-parallel ranks"),
    (["--nproc", "4", "--zero", "1", "--dp-shard", "-2"], "--dp-shard must be a whole number of at least 1"),
    (["--model", "tiny-moe", "--nproc", "4", "--ep", "2", "--zero", "1", "--dp-shard", "2"],
     "--dp-shard with --ep 2: expert parameters are sharded over their own edp ranks"),
])
def test_a_hybrid_sharding_that_cannot_apply_is_refused_in_one_line(flags, message, capsys):
    model = [] if "--model" in flags else ["--model", "tiny"]
    assert main(["train", *model, *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("error:") == 1


def test_the_shard_group_is_what_zero_divides_and_the_replicas_sum_its_shard():
    """Memory: ZeRO-3 over 2 ranks holds twice plain ZeRO-3's shard over 8; wire: the shard's
    reduce-scatter and gathers over its group, its all-reduce over the 4 replicas."""
    config = get_preset("small")
    common = dict(dp=8, zero=3, precision="bf16", micro_batch=2, seq_len=128)
    plain, hybrid = (estimate_layout(config, Workload(**common, dp_shard=d), hardware="h100-sxm") for d in (0, 2))
    assert hybrid["memory"]["optim"] == pytest.approx(4 * plain["memory"]["optim"], rel=1e-3)
    psi = config.num_params()
    shard = -(-psi // 2)
    assert hybrid["comm"]["dp_shard"]["reduce_scatter"] == pytest.approx(psi * 2 / 2, rel=1e-6)
    assert hybrid["comm"]["dp_replicate"] == {"all_reduce": pytest.approx(2 * 3 / 4 * shard * 2)}
    assert "dp" not in hybrid["comm"] and set(plain["comm"]) == {"dp"}


def test_estimate_prints_the_link_each_axis_rides(capsys):
    """tp 2 × a shard group of 4: 8 neighbouring ranks, one node of 8; the replicas cross nodes."""
    assert main(["estimate", "--model", "llama-7b", "--dp", "16", "--tp", "2", "--zero", "3", "--dp-shard", "4",
                 "--micro-batch", "1", "--seq-len", "2048", "--hardware", "h100-sxm"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rides: dict[str, str] = {}
    for line in lines:  # an axis's first row names its link
        if line.startswith(("  dp_", "  tp ")):
            rides.setdefault(line.split()[0], line.split()[1])
    assert rides == {"dp_shard": "node", "dp_replicate": "network", "tp": "node"}
    assert main(["estimate", "--model", "llama-7b", "--dp", "16", "--tp", "2", "--zero", "3", "--json",
                 "--micro-batch", "1", "--seq-len", "2048", "--hardware", "h100-sxm"]) == 0
    assert json.loads(capsys.readouterr().out)["links"] == {"dp": "network", "tp": "node"}


def test_a_checkpoint_written_under_dp_shard_resumes_under_plain_zero3_and_under_dp(tmp_path):
    """Each shard was written once (by its first replica); resumed at step 2 on plain ZeRO-3
    over 4 ranks and on plain dp 2, both runs continue as the hybrid one did."""
    first = run_plait("train", *TINY, "--nproc", "4", "--zero", "3", "--dp-shard", "2", "--save-every", "2",
                      "--keep-checkpoints", "0", "--out", str(tmp_path / "hybrid"))
    assert first.returncode == 0, first.stderr
    step2 = tmp_path / "hybrid" / "checkpoints" / "step-00000002"
    for name, layout in (("zero3", ["--nproc", "4", "--zero", "3"]), ("dp", ["--nproc", "2", "--grad-accum", "2"])):
        resumed = run_plait("train", *TINY, *layout, "--resume", str(step2), "--out", str(tmp_path / name))
        assert resumed.returncode == 0, resumed.stderr
        assert_losses_close(run_losses(tmp_path / name), run_losses(tmp_path / "hybrid")[2:])
        assert_params_close(run_weights(tmp_path / name), run_weights(tmp_path / "hybrid"))


def test_an_elastic_world_keeps_only_sizes_the_shard_groups_divide():
    from plait.train.checkpoint.elastic import world_sizes

    assert world_sizes(16, 2, up_to=8) == [1, 2, 4, 8]
    assert world_sizes(16, 2, up_to=8, dp_shard=2) == [2, 4, 8]
    assert world_sizes(16, 2, up_to=8, dp_shard=4) == [4, 8]
    assert world_sizes(16, 2, up_to=8, cp=2, dp_shard=4) == [4, 8]  # dp·cp ranks: dp 2 and 4 of cp 2


def test_a_model_known_by_size_is_priced_with_its_shard_groups():
    from plait.estimate import estimate_by_size

    result = estimate_by_size(10_000_000, Workload(dp=4, zero=3, dp_shard=2), hardware="h100-sxm")
    assert set(result["comm"]) == {"dp_shard", "dp_replicate"}
    assert result["memory"]["optim"] == pytest.approx(10_000_000 * 8 / 2, rel=1e-3)  # fp32 Adam m, v over 2


def test_a_resnet_refuses_hybrid_sharding_in_one_line(capsys):
    assert main(["train", "--model", "resnet18,width=8", "--data", "digits", "--nproc", "4", "--zero", "1",
                 "--dp-shard", "2"]) == 2
    err = capsys.readouterr().err
    assert "with --dp-shard: its BatchNorm buffers follow rank 0 over both hybrid axes" in err and err.count("error:") == 1
