"""Checkpoints: exact resume, resharding to other layouts, atomic saves, every damage named."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from plait.errors import PlaitError
from plait.models.gpt.config import get_preset
from plait.models.gpt.model import build_gpt
from plait.runtime.env import ProcessEnv
from plait.runtime.mesh import init_mesh
from plait.train.checkpoint import write as checkpoint
from plait.train.checkpoint.read import Reader, describe, load
from plait.train.checkpoint.restart import resolve
from tests.parity import assert_losses_close
from tests.worldlib import ROOT, run_losses, run_plait, split_slow

TRAIN = ["--model", "tiny", "--steps", "6", "--micro-batch", "4", "--seq-len", "32", "--eval-every", "0",
         "--sample-tokens", "0", "--warmup-steps", "2"]


def single_mesh():
    return init_mesh(env=ProcessEnv("single", 0, 1, 0, "127.0.0.1", 29500))


def trained(config_name="tiny", **overrides):
    model = build_gpt(get_preset(config_name, **overrides), 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(8).view(1, 8)).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A dp=2 run of 6 steps that checkpoints at steps 3 and 6."""
    out = tmp_path_factory.mktemp("run")
    proc = run_plait("train", *TRAIN, "--nproc", "2", "--save-every", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


def test_resume_on_the_same_layout_is_exact_to_the_bit(saved, tmp_path):
    proc = run_plait("train", *TRAIN, "--nproc", "2", "--out", str(tmp_path),
                     "--resume", str(saved / "checkpoints" / "step-00000003"))
    assert proc.returncode == 0, proc.stderr
    assert run_losses(tmp_path) == run_losses(saved)[3:]


EXACT = {
    "zero2-offload": ["--nproc", "2", "--zero", "2", "--offload"],
    "tp2-sp": ["--nproc", "2", "--tp", "2", "--sp", "--micro-batch", "8"],
    "pp2-zbh1": ["--nproc", "2", "--pp", "2", "--grad-accum", "2", "--schedule", "zb-h1"],
    "dp2-pp2-zero1": ["--nproc", "4", "--dp", "2", "--pp", "2", "--zero", "1", "--micro-batch", "2",
                      "--grad-accum", "2"],
    "zero3-bf16": ["--nproc", "2", "--zero", "3", "--precision", "bf16"],
}


# `make test` keeps no case here: ZeRO's world moves checkpoints between DDP and every stage,
# the same-layout test below resumes to the bit, and an fp32 checkpoint resumed in bf16 loads
# its weights as masters; every layout here (bf16 masters under ZeRO-3 too) runs in `make test-all`.
@pytest.mark.parametrize("case", split_slow(EXACT, []))
def test_each_strategy_resumes_to_the_bit(tmp_path, case):
    """Model, optimizer (offloaded or sharded too), LR schedule, RNG and data position all return."""
    layout = EXACT[case]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    proc = run_plait("train", *TRAIN, *layout, "--steps", "4", "--save-every", "2", "--out", str(whole))
    assert proc.returncode == 0, proc.stderr
    proc = run_plait("train", *TRAIN, *layout, "--steps", "4", "--out", str(resumed),
                     "--resume", str(whole / "checkpoints" / "step-00000002"))
    assert proc.returncode == 0, proc.stderr
    assert run_losses(resumed) == run_losses(whole)[2:]


# Each layout keeps the global batch of 8 sequences; TP and PP sum in another order (1e-4).
LAYOUTS = {
    "dp2->dp1": (["--nproc", "1", "--grad-accum", "2"], 1e-5),
    "dp2->dp4": (["--nproc", "4", "--micro-batch", "2"], 1e-5),
    "dp2->zero3x4": (["--nproc", "4", "--micro-batch", "2", "--zero", "3"], 1e-5),
    "dp2->tp2": (["--nproc", "2", "--tp", "2", "--micro-batch", "8"], 1e-4),
    "dp2->pp2": (["--nproc", "2", "--pp", "2", "--grad-accum", "2"], 1e-4),
}


@pytest.mark.parametrize("case", split_slow(LAYOUTS, ["dp2->tp2"]))
def test_resume_on_another_layout_continues_the_same_run(saved, tmp_path, case):
    layout, rtol = LAYOUTS[case]
    proc = run_plait("train", *TRAIN, *layout, "--out", str(tmp_path),
                     "--resume", str(saved / "checkpoints" / "step-00000003"))
    assert proc.returncode == 0, proc.stderr
    assert_losses_close(run_losses(tmp_path), run_losses(saved)[3:], rtol=rtol)


TO_DP = {"pp2->dp2": ["--pp", "2", "--grad-accum", "2"], "tp2->dp2": ["--tp", "2", "--micro-batch", "8"]}


@pytest.mark.parametrize("case", split_slow(TO_DP, []))  # make test reshards dp2 -> tp2 (above)
def test_a_model_parallel_checkpoint_resumes_as_data_parallel(saved, tmp_path, case):
    layout = TO_DP[case]
    first = tmp_path / "first"
    proc = run_plait("train", *TRAIN, "--nproc", "2", *layout, "--steps", "3", "--save-every", "3", "--out", str(first))
    assert proc.returncode == 0, proc.stderr
    assert "written by 2 rank(s)" in describe(first)
    proc = run_plait("train", *TRAIN, "--nproc", "2", "--out", str(tmp_path / "second"), "--resume", str(first))
    assert proc.returncode == 0, proc.stderr
    assert_losses_close(run_losses(first) + run_losses(tmp_path / "second"), run_losses(saved), rtol=1e-4)


# The pairs: a run on every axis at once, (dp2, tp2, pp2) with ZeRO-3 and SP, with
# a global batch of 8; its checkpoint resumes on the same layout to the bit, and as (dp8)
# and as (tp4, pp2) within rtol 1e-5. tp 4 needs 4 key/value heads (tiny has 2).
MHA = ["--model", "tiny,n_kv_heads=4"]
THREE_D = ["--nproc", "8", "--dp", "2", "--tp", "2", "--pp", "2", "--zero", "3", "--sp",
           "--micro-batch", "2", "--grad-accum", "2"]
FROM_3D = {
    "3d->3d": THREE_D,
    "3d->dp8": ["--nproc", "8", "--micro-batch", "1"],
    "3d->tp4-pp2": ["--nproc", "8", "--tp", "4", "--pp", "2", "--micro-batch", "2", "--grad-accum", "4"],
}


# Four 8-process runs: the long matrix (`make test-all`). `make test` trains dp × tp × pp in
# the parity matrix (tests/matrix.py).
@pytest.fixture(scope="module")
def saved_3d(tmp_path_factory):
    out = tmp_path_factory.mktemp("run3d")
    proc = run_plait("train", *TRAIN, *MHA, *THREE_D, "--save-every", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.slow
def test_a_3d_checkpoint_stores_each_logical_tensor_once(saved_3d):
    index = json.loads((saved_3d / "checkpoints" / "step-00000003" / "index.json").read_text())
    assert {k: index["layout"][k] for k in ("pp", "dp", "tp")} == {"pp": 2, "dp": 2, "tp": 2} and index["world_size"] == 8
    for name, entry in index["tensors"].items():  # the pieces tile the full tensor, once
        volume = sum(math.prod(piece["lengths"]) for piece in entry["pieces"])
        assert volume == math.prod(entry["shape"]), name
    model = build_gpt(get_preset("tiny", n_kv_heads=4), 0)
    for name, param in model.named_parameters():
        assert index["tensors"][f"model/{name}"]["shape"] == list(param.shape)
        assert index["tensors"][f"optim/{name}/exp_avg"]["shape"] == list(param.shape)
    assert len([k for k in index["tensors"] if k.startswith("model/")]) == len(dict(model.named_parameters()))


@pytest.mark.slow
@pytest.mark.parametrize("case", FROM_3D)
def test_a_3d_checkpoint_resumes_on_any_layout(saved_3d, tmp_path, case):
    proc = run_plait("train", *TRAIN, *MHA, *FROM_3D[case], "--out", str(tmp_path),
                     "--resume", str(saved_3d / "checkpoints" / "step-00000003"))
    assert proc.returncode == 0, proc.stderr
    if case == "3d->3d":
        assert run_losses(tmp_path) == run_losses(saved_3d)[3:]
    else:
        assert_losses_close(run_losses(tmp_path), run_losses(saved_3d)[3:], rtol=1e-5)


def test_latest_keep_inspect_and_export(saved, tmp_path):
    assert resolve(saved) == (saved / "checkpoints" / "step-00000006").resolve()
    text = describe(saved)
    assert "step 6, written by 2 rank(s): dp=2 tp=1 pp=1" in text and "model/embed.weight" in text
    assert "optim/embed.weight/exp_avg_sq" in text
    target = tmp_path / "model.safetensors"
    proc = run_plait("ckpt", "export", str(saved), "--to", str(target))
    assert proc.returncode == 0, proc.stderr
    exported = load_file(target)
    final = load_file(saved / "model.safetensors")  # what the run itself wrote at the end
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in final)


def test_keep_last_k_and_atomic_latest(tmp_path):
    mesh = single_mesh()
    model, opt = trained()
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, step, model, opt, mesh, {}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000003", "step-00000004"]
    assert (tmp_path / "latest").resolve().name == "step-00000004"


def test_round_trip_into_a_fresh_model_and_optimizer(tmp_path):
    mesh = single_mesh()
    model, opt = trained()
    checkpoint.save(tmp_path, 1, model, opt, mesh, {"epoch": 0})
    fresh = build_gpt(get_preset("tiny"), 7)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    state = load(tmp_path, fresh, fresh_opt, mesh)
    assert state["step"] == 1 and state["epoch"] == 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert all(torch.equal(opt.state[a][k], fresh_opt.state[b][k]) for k in opt.state[a])


@pytest.fixture
def one(tmp_path):
    mesh = single_mesh()
    model, opt = trained()
    return checkpoint.save(tmp_path, 5, model, opt, mesh, {}), mesh


def test_missing_directory(tmp_path):
    with pytest.raises(PlaitError, match=f"checkpoint {tmp_path / 'nope'} does not exist"):
        Reader(tmp_path / "nope")


def test_missing_shard_file(one):
    path, _ = one
    (path / "rank00000.safetensors").unlink()
    with pytest.raises(PlaitError, match="rank00000.safetensors is missing"):
        Reader(path)


def test_truncated_shard_file(one):
    path, _ = one
    file = path / "rank00000.safetensors"
    file.write_bytes(file.read_bytes()[:1000])
    with pytest.raises(PlaitError, match=r"rank00000.safetensors is truncated: 1000 bytes"):
        Reader(path)


def test_checksum_mismatch(one):
    path, _ = one
    file = path / "rank00000.safetensors"
    data = bytearray(file.read_bytes())
    data[-5] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(PlaitError, match="rank00000.safetensors fails its sha256 check"):
        Reader(path)


def test_ranks_share_the_verification_and_all_name_the_bad_file(saved, tmp_path):
    """On resume, rank 1 hashes rank00001's file; the damage it finds stops both ranks."""
    copy = tmp_path / "ckpt"
    shutil.copytree(saved / "checkpoints" / "step-00000003", copy)
    file = copy / "rank00001.safetensors"
    data = bytearray(file.read_bytes())
    data[-5] ^= 0xFF
    file.write_bytes(bytes(data))
    proc = run_plait("train", *TRAIN, "--nproc", "2", "--out", str(tmp_path / "out"), "--resume", str(copy))
    assert proc.returncode == 2, proc.stderr
    assert f"plait: error: rank 0: checkpoint file {file} fails its sha256 check" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_fp32_checkpoint_resumed_in_bf16_takes_its_weights_as_masters(tmp_path):
    """An fp32 run writes no masters: its fp32 weights are them (tests/test_precision_worlds.py
    checks the masters equal them to the bit)."""
    first, second = tmp_path / "fp32", tmp_path / "bf16"
    proc = run_plait("train", *TRAIN, "--nproc", "1", "--zero", "1", "--steps", "1", "--save-every", "1",
                     "--out", str(first))
    assert proc.returncode == 0, proc.stderr
    proc = run_plait("train", *TRAIN, "--nproc", "1", "--zero", "1", "--precision", "bf16", "--out", str(second),
                     "--resume", str(first))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr


def test_checkpoint_of_another_model_shape_names_the_tensor(one):
    path, mesh = one
    other, opt = trained(d_model=32, n_heads=2, n_kv_heads=1)
    with pytest.raises(PlaitError, match=r"tensor 'model/embed.weight' .* has shape \(256, 64\), this model needs \(256, 32\)"):
        load(path, other, opt, mesh)


def test_sigkill_during_save_leaves_the_previous_checkpoint(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "worlds" / "kill_during_save.py"), str(tmp_path)],
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert (tmp_path / "latest").resolve().name == "step-00000001"
    assert (tmp_path / ".tmp-step-00000002").is_dir() and not (tmp_path / "step-00000002").exists()
    assert Reader(tmp_path).index["trainer"] == {"note": "good"}
    with pytest.raises(PlaitError, match="is incomplete: .*index.json is missing"):
        resolve(tmp_path / ".tmp-step-00000002")
