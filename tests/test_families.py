"""The family record: a new model family is one file (tests/toy_family.py), and `plait train`
trains it on two ranks like one process, evaluates it, reports on it and exports it, with
nothing in plait changed; the built-in families are found by the `--model` text alone."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from plait.errors import PlaitError
from plait.families import family_for, registered
from tests.parity import assert_losses_close
from tests.worldlib import Runs, run_plait

TOY = ["--imports", "tests.toy_family", "--model", "mlp,hidden=24", "--data", "digits", "--steps", "8",
       "--eval-every", "4", "--warmup-steps", "2", "--lr", "0.01", "--micro-batch", "16"]


def _train(out, *flags: str):
    proc = run_plait("train", *TOY, *flags, "--out", str(out), env_extra={"PLAIT_REPORT": "on"})
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return proc, lines, json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    return Runs(lambda name: (root / name, *_train(root / name, *{
        "two": ["--nproc", "2", "--zero", "3"], "one": ["--nproc", "1", "--grad-accum", "2"]}[name])))


def test_a_family_in_one_file_trains_on_two_ranks(runs):
    _, proc, lines, summary = runs["two"]
    assert "trained mlp,hidden=24" in proc.stdout and "dp=2 tp=1 pp=1 zero=3" in proc.stdout
    assert "global batch 32 images" in proc.stdout and "images/s" in proc.stdout
    assert [r["step"] for r in lines if "val_accuracy" in r] == [4, 8]
    assert lines[-1]["loss"] < lines[0]["loss"] and 0.1 < summary["val_accuracy"] <= 1
    assert summary["task"]["unit"] == "images" and summary["num_params"] == 64 * 24 + 24 + 24 * 24 + 24 + 24 * 10 + 10


@pytest.mark.slow
def test_two_ranks_train_it_as_one_process(runs):
    _, _, lines, summary = runs["two"]
    _, _, ref_lines, ref_summary = runs["one"]
    assert_losses_close([r["loss"] for r in lines], [r["loss"] for r in ref_lines])
    assert summary["val_accuracy"] == pytest.approx(ref_summary["val_accuracy"], abs=1e-9)


def test_its_report_and_export_come_from_the_run(runs, tmp_path):
    out, proc, _, summary = runs["two"]
    assert f"report      {out}/report.md" in proc.stdout
    for name in ("loss", "throughput", "val_accuracy", "memory", "comm"):
        assert (out / "report" / f"{name}.png").stat().st_size > 1000, name
    assert "Top-1 accuracy on the held-out split" in (out / "report.md").read_text()
    exported = tmp_path / "mlp.safetensors"
    assert run_plait("ckpt", "export", str(out), "--to", str(exported)).returncode == 0  # no checkpoint: the outputs
    weights, written = load_file(str(exported)), load_file(str(out / "model.safetensors"))
    assert sorted(weights) == ["blocks.0.0.bias", "blocks.0.0.weight", "blocks.1.0.bias", "blocks.1.0.weight",
                               "head.bias", "head.weight"]
    assert all(torch.equal(weights[k], written[k]) for k in weights)
    assert summary["predicted"]["memory"]["optim"] == pytest.approx(8 * summary["num_params"] / 2)  # Adam /dp


def test_the_family_joins_help_and_its_checks_run_before_spawning(tmp_path):
    assert "mlp: a toy MLP on digits" in run_plait("train", "--imports", "tests.toy_family", "--help").stdout
    proc = run_plait("train", *TOY, "--tp", "2", "--nproc", "2", "--out", str(tmp_path))
    assert proc.returncode == 2 and "plait: error: --model mlp trains data-parallel only" in proc.stderr
    proc = run_plait("train", "--imports", "tests.no_such_module", "--out", str(tmp_path))
    assert proc.returncode == 2 and "--imports tests.no_such_module: cannot import it" in proc.stderr


@pytest.mark.parametrize("model, family", [("tiny", "gpt"), ("small,n_layers=4", "gpt"), ("llama-7b", "gpt"),
                                           ("resnet18,width=16", "resnet"), ("hf:some/dir", "hf")])
def test_the_built_in_families_are_found_by_the_model_text(model: str, family: str) -> None:
    assert family_for(model).name == family
    assert [f.name for f in registered()][-3:] == ["hf", "resnet", "gpt"]


def test_an_unknown_model_names_every_family() -> None:
    with pytest.raises(PlaitError, match="unknown --model 'gpt5'") as info:
        family_for("gpt5")
    for words in ("plait's GPT: tiny, small", "resnet18", "hf:DIR"):
        assert words in info.value.hint


def test_a_two_matrix_mlp_is_estimated_but_not_trained_as_plaits_gpt(tmp_path, capsys) -> None:
    """mlp_matrices=2 prices a GELU or relu² MLP (plait estimate), which plait's GPT does not
    build: training it is refused in one line, before the estimate and the model disagree."""
    from plait.cli import main
    from plait.models.gpt.config import get_preset

    assert get_preset("tiny,mlp_matrices=2").num_params() == get_preset("tiny").num_params() - 2 * 64 * 192
    assert main(["train", "--model", "tiny,mlp_matrices=2", "--steps", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("plait: error: --model tiny,mlp_matrices=2: mlp_matrices=2 describes a GELU or relu² MLP for "
                      "plait estimate, and plait's GPT trains a SwiGLU MLP (three matrices)")
    assert err[1].startswith("  hint: drop mlp_matrices") and len(err) == 2
