"""`plait train` end to end: parity across layouts, the outputs, and every bad-input message."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file

from plait.cli import main, train_parser
from plait.errors import PlaitError
from plait.train.config.settings import TrainConfig, build_config, load_toml
from tests.golden import check
from tests.parity import assert_losses_close, assert_params_close
from tests.worldlib import Runs, run_plait, run_world

COMMON = ["--model", "tiny", "--steps", "6", "--micro-batch", "4", "--seq-len", "32", "--eval-every", "3",
          "--sample-tokens", "24", "--warmup-steps", "2"]


def train_run(out, *flags):
    proc = run_plait("train", *COMMON, "--out", str(out), *flags)
    assert proc.returncode == 0, proc.stderr
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    params = {k: v.flatten().tolist() for k, v in load_file(out / "model.safetensors").items()}
    return proc, metrics, summary, params


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process with n micro-batches: the reference for dp = n."""
    return Runs(lambda n: train_run(tmp_path_factory.mktemp(f"single{n}"), "--nproc", "1", "--grad-accum", str(n)))


@pytest.fixture(scope="module")
def dp(tmp_path_factory):
    """dp = n processes; the parity and the prediction tests read the same run."""
    return Runs(lambda n: train_run(tmp_path_factory.mktemp(f"dp{n}"), "--nproc", str(n), "--dp", str(n)))


# dp 4 proves the same wiring as dp 2 with another ring factor: the long matrix.
DP_SIZES = [2, pytest.param(4, marks=pytest.mark.slow)]


@pytest.mark.parametrize("n", DP_SIZES)
def test_dp_run_trains_the_same_model_as_one_process(n, single, dp):
    _, metrics, summary, params = dp[n]
    _, ref_metrics, ref_summary, ref_params = single[n]
    assert_losses_close([m["loss"] for m in metrics], [m["loss"] for m in ref_metrics])
    assert_params_close(params, ref_params)
    assert summary["val_losses"].keys() == ref_summary["val_losses"].keys() == {"3", "6"}
    assert_losses_close(list(summary["val_losses"].values()), list(ref_summary["val_losses"].values()))
    psi_bytes = summary["num_params"] * 4
    assert all(m["comm"] == {"dp": {"all_reduce": round(2 * (n - 1) / n * psi_bytes)}} for m in metrics)
    assert all(m["comm"] == {} for m in ref_metrics)


def test_the_tiny_run_keeps_its_golden_losses(single):
    """One process, two micro-batches: the curve every layout of test_cli is compared with."""
    _, metrics, _, _ = single[2]
    check("tiny", [m["loss"] for m in metrics], " ".join(["plait train", *COMMON, "--nproc 1 --grad-accum 2"]))


def test_metrics_summary_and_report(single):
    proc, metrics, summary, _ = single[2]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    first = metrics[0]
    assert set(first) >= {"step", "loss", "lr", "grad_norm", "tokens", "step_time_s", "tokens_per_s", "mem", "comm"}
    assert first["tokens"] == 2 * 4 * 32
    assert set(first["mem"]) == {"params", "grads", "optim", "activations_peak"}
    psi_bytes = summary["num_params"] * 4
    assert first["mem"]["params"] == psi_bytes and first["mem"]["optim"] == 2 * psi_bytes
    assert first["mem"]["activations_peak"] > 0
    assert metrics[0]["lr"] < metrics[1]["lr"]  # warm-up
    assert summary["loss_last"] < summary["loss_first"]
    for line in ("loss ", "speed ", "wire/step", "memory/rank", "sample ", "outputs "):
        assert line in proc.stdout


def test_toml_config_and_flags_override_it(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nmodel = "tiny"\nsteps = 7\nmicro-batch = 3\nlr = 0.01\n')
    config = build_config(load_toml(str(path)), {"steps": 9, "lr": None})
    assert (config.model, config.steps, config.micro_batch, config.lr) == ("tiny", 9, 3, 0.01)
    assert (config.dp, config.nproc) == (2, 2)  # the embedded default layout
    bad = tmp_path / "bad.toml"
    bad.write_text("stepz = 3\n")
    with pytest.raises(PlaitError, match="unknown keys: stepz"):
        load_toml(str(bad))


def test_every_config_field_is_a_flag():
    flags = {a.dest for a in train_parser()._actions}
    assert set(TrainConfig.__dataclass_fields__) <= flags


@pytest.mark.parametrize("flags, message", [
    (["--nproc", "3", "--dp", "2"], "layout dp=2 × tp=1 × pp=1 = 2 does not match --nproc 3"),
    (["--nproc", "999"], "--nproc 999 is more than this machine allows"),
    (["--model", "gpt5"], "unknown --model 'gpt5'"),
    (["--model", "llama-7b"], "model preset 'llama-7b' is shape-only"),
    (["--model", "tiny", "--seq-len", "4096"], "--seq-len 4096 is longer than --model tiny allows (128)"),
    (["--out", "/proc/plait-out"], "--out /proc/plait-out is not writable"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--config", "/nonexistent.toml"], "config file /nonexistent.toml does not exist"),
    (["--nproc", "4", "--pp", "2", "--zero", "2", "--schedule", "zb-h1"], "--zero 2 cannot run the zb-h1 schedule"),
    (["--reduce-dtype", "fp8"], "unknown --reduce-dtype 'fp8'"),
    (["--loss-scale", "0.5"], "--loss-scale must be at least 1, got 0.5"),
    (["--precision", "fp4"], "unknown --precision 'fp4'"),
    (["--model", "tiny,heads=4"], "model 'tiny,heads=4': 'heads=4' is not FIELD=VALUE for a GPTConfig field"),
    (["--model", "tiny,n_kv_heads=3"], "n_kv_heads"),
    (["--prompt", ""], "--prompt is empty: the closing sample continues it"),
    (["--prompt", "\udcff"], "--prompt is not valid UTF-8 text"),
    (["--sample-tokens", "99999999"], "--sample-tokens must be at most 10000, got 99999999"),
])
def test_bad_input_is_one_clear_line(flags, message, tmp_path, capsys, monkeypatch):
    """Through `plait.cli.main`, which `python -m plait` calls, in this process: validation
    imports torch, and a process per case would pay for that 13 times. The command itself
    prints the same way in test_debug_shows_the_traceback and test_corpus_too_small_for_the_batch."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PLAIT_SPAWNED"):
        monkeypatch.delenv(name, raising=False)  # as a user's shell: no launcher around
    assert main(["train", "--out", str(tmp_path), *flags]) == 2
    stderr = capsys.readouterr().err
    lines = stderr.strip().splitlines()
    assert lines[0].startswith("plait: error: ") and message in lines[0], stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("argv, message, hint", [
    (["estimate", "--tpp", "2"], "plait estimate: unrecognized arguments: --tpp 2", "did you mean --tp?"),
    (["estimate", "--global-batch", "256"], "plait estimate: unrecognized arguments: --global-batch 256",
     "`plait estimate --help` lists its flags"),
    (["train", "--grad-acum", "4"], "plait train: unrecognized arguments: --grad-acum 4", "did you mean --grad-accum?"),
    (["plan", "--gpus", "x"], "plait plan: argument --gpus: invalid int value: 'x'", "`plait plan --help`"),
    (["ckpt"], "plait ckpt: the following arguments are required: action", "`plait ckpt --help`"),
    (["trian"], "unknown command 'trian'", "did you mean train? the commands: train, eval, launch"),
])
def test_a_flag_or_command_plait_cannot_read_is_one_line_and_a_hint(argv, message, hint, capsys):
    """argparse's own refusal (its usage block, then SystemExit) reads like any other: one
    line, the nearest name it knows, exit 2."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"plait: error: {message}", lines[1]] and lines[1].startswith("  hint: ") and hint in lines[1]


def test_corpus_too_small_for_the_batch(tmp_path, monkeypatch, capsys):
    """In this process, as rank 0 of 1 (what the spawner would start): refused before step 1."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    corpus = tmp_path / "small.txt"
    corpus.write_text("x" * 100)
    assert main(["train", *COMMON, "--nproc", "1", "--data", str(corpus), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "plait: error: the corpus gives 2 samples, fewer than the global batch of 4" in err
    assert "hint: lower --seq-len" in err
    corpus.write_text("x" * 500)  # enough to train on, too little held out to evaluate
    assert main(["train", *COMMON, "--nproc", "1", "--data", str(corpus), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "plait: error: the held-out split (25 tokens) has no sequence of 32 tokens" in err
    assert "train:" not in err  # refused before the first step


def test_a_rank_that_raises_ends_the_job_within_seconds(tmp_path):
    start = time.monotonic()
    proc, _ = run_world("rank_raises.py", 2, tmp_path, expect_ok=False, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1
    assert "ValueError: boom on purpose" in proc.stderr
    assert "rank 1 exited with code 1" in proc.stderr
    assert elapsed < 60  # the collective's own time-out is 600 s: this is the spawner stopping rank 0


def test_debug_shows_the_traceback(tmp_path):
    proc = run_plait("train", "--model", "gpt5", "--debug", "--out", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and "Traceback" in proc.stderr


def test_model_file_loads_without_plait(single):
    # model.safetensors is a plain file: torch alone can load it into a fresh GPT.
    from plait.models.gpt.config import get_preset
    from plait.models.gpt.model import build_gpt

    *_, params = single[2]
    model = build_gpt(get_preset("tiny"), seed=99)
    state = {k: torch.tensor(v).view_as(model.state_dict()[k]) for k, v in params.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}  # tied: stored once


@pytest.mark.parametrize("n", DP_SIZES)
def test_prediction_matches_measurement(n, single, dp):
    """summary.json carries plait estimate's figures for the run's own layout: model states
    and wire bytes exact, activations within 10%."""
    runs = {"single": single[n][2], "dp": dp[n][2]}
    for name, summary in runs.items():
        predicted, measured = summary["predicted"], summary["mem"]
        for kind in ("params", "grads", "optim"):
            assert predicted["memory"][kind] == measured[kind], (name, kind)
        assert predicted["memory"]["activations"] == pytest.approx(measured["activations_peak"], rel=0.10)
        assert predicted["comm"] == summary["comm_per_step"], name
        assert "predicted" in json.dumps(summary) and predicted["time"]["step_s"] > 0


def test_an_error_and_its_hint_reach_stderr_in_one_write(monkeypatch):
    """Ranks share one stderr: a line written in two pieces can be spliced by another rank's."""
    import io
    import sys

    class Writes(io.StringIO):
        def __init__(self):
            super().__init__()
            self.calls = []

        def write(self, text):
            self.calls.append(text)
            return super().write(text)

    stderr = Writes()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    from plait.cli import _print_error

    _print_error(PlaitError("the corpus is empty", hint="give --data a file"), debug=False)
    assert stderr.calls == ["plait: error: rank 1: the corpus is empty\n  hint: give --data a file\n"]


def test_what_would_lose_a_users_files_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """A fresh run onto another run's checkpoints (it replaced and pruned them), an export over
    a directory holding other files (it was replaced whole) or with an empty name (a file called
    None), a config file whose keys sat beside its [train] table or twice (dropped), and a
    spawner asked for a thousand processes, a checkpoint resumed into a smaller model: each is
    one line, nothing written. A re-export
    over an earlier export, and a run that resumes, still go."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    run = ["train", *COMMON, "--nproc", "1", "--steps", "2", "--sample-tokens", "0", "--no-report"]
    assert main([*run, "--save-every", "2", "--out", str(tmp_path / "a")]) == 0
    capsys.readouterr()

    def refused(argv, words):
        assert main(argv) == 2
        lines = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("train:")]
        assert len(lines) == 2 and lines[0].startswith("plait: error: ") and words in lines[0], lines

    refused([*run, "--out", str(tmp_path / "a")], f"--out {tmp_path / 'a'} holds another run's checkpoints")
    assert main([*run, "--out", str(tmp_path / "a"), "--resume", "auto"]) == 0
    capsys.readouterr()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    checkpoint = str(tmp_path / "a" / "checkpoints" / "step-00000002")
    refused([*run, "--model", "tiny,n_layers=1", "--resume", checkpoint, "--out", str(tmp_path / "b")],
            "holds 9 tensor(s) this model has no place for, e.g. blocks.1.")  # a smaller model dropped them
    for text, words in (("{bad", "is damaged: Expecting property name"), ("[1]", "is damaged: it has no valid format, step"),
                        ("\udcff", "is damaged")):
        damaged = tmp_path / "damaged" / "step-00000001"
        damaged.mkdir(parents=True, exist_ok=True)
        (damaged / "index.json").write_bytes(text.encode("utf-8", "surrogateescape"))
        refused(["ckpt", "inspect", str(damaged)], f"checkpoint index {damaged / 'index.json'} {words}")
        refused([*run, "--resume", str(damaged), "--out", str(tmp_path / "c")], words)
    refused(["ckpt", "export", checkpoint, "--to", str(tmp_path / "mine")], "is a directory")
    refused(["ckpt", "export", checkpoint, "--to", ""], "--to needs a name")
    refused(["ckpt", "export", checkpoint, "--hf", ""], "--hf needs a name")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    assert main(["ckpt", "export", checkpoint, "--to", str(tmp_path / "w.safetensors")]) == 0
    assert not list(tmp_path.glob(".w.safetensors.tmp-*"))
    for name, text, words in (("beside.toml", "steps = 3\n[train]\nlr = 1e-3\n", "keys outside its [train] table"),
                              ("twice.toml", "[train]\nmicro-batch = 4\nmicro_batch = 2\n", "gives micro_batch twice")):
        (tmp_path / name).write_text(text)
        with pytest.raises(PlaitError, match=words.replace("[", "\\[").replace("]", "\\]")):
            load_toml(str(tmp_path / name))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name)
    refused(["launch", "--nproc", "1000", str(tmp_path / "x.py")], "--nproc 1000 is more than this machine allows")
    refused(["bench", "collectives", "--nproc", "1000"], "--nproc 1000 is more than this machine allows")
