"""Elastic restarts: a run that loses ranks continues on the world it has, and one given more
ranks uses them; either way it trains the same model as the run that never changed size
(same global batch, same samples at every step; only the reduction order differs, so the
losses and weights agree to the parity tests' tolerances, tests/parity.py).

The runs come from the session's pool (run_plait), the faulted ones too: a rank killed by
PLAIT_INJECT is a forked process of its own, which dies and is restarted as an exec'd one
would be (tests/test_faults_restart.py says why that tests the same thing). The slow tier's
resizes start their killed worlds in new interpreters, so that a world of exec'd ranks
hands its checkpoint to a pooled one, as a real restart with another hash seed would."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tests.parity import assert_losses_close, assert_params_close
from tests.worldlib import run_plait, run_plait_fresh

# Global batch 8: micro-batch 2 × dp 4, or × dp 2 with --grad-accum 2.
RUN = ["--model", "tiny", "--micro-batch", "2", "--seq-len", "16", "--eval-every", "0", "--sample-tokens", "0",
       "--warmup-steps", "2", "--steps", "12", "--save-every", "5", "--no-report"]


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(out):
    return {name: tensor.flatten().tolist() for name, tensor in load_file(str(out / "model.safetensors")).items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """dp 4 from start to end, never interrupted."""
    out = tmp_path_factory.mktemp("dp4")
    proc = run_plait("train", *RUN, "--nproc", "4", "--out", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out


def assert_same_model(out, reference, loss_rtol=1e-5, param_atol=5e-6):
    assert [r["step"] for r in records(out)] == list(range(1, 13))
    assert_losses_close([r["loss"] for r in records(out)], [r["loss"] for r in records(reference)], rtol=loss_rtol)
    assert_params_close(weights(out), weights(reference), atol=param_atol)


def test_a_rank_that_keeps_failing_shrinks_the_world_under_zero3(reference, tmp_path, monkeypatch):
    """Rank 3 dies at step 7, and again as the restarted world starts (step 6 after resuming
    step 5): the spawner takes it as lost and continues on 2 ranks, the largest world from
    --min-nproc that keeps the global batch; ZeRO-3's shards are re-cut from the checkpoint."""
    monkeypatch.setenv("PLAIT_INJECT", "0:3:7:KILL,1:3:6:KILL")
    proc = run_plait("train", *RUN, "--nproc", "4", "--zero", "3", "--max-restarts", "2", "--min-nproc", "2",
                     "--out", str(tmp_path), timeout=400)
    assert proc.returncode == 0, proc.stderr
    assert ("plait: rank(s) 3 failed in two worlds in a row: taken as lost; the world restarts on 2 process(es) "
            "instead of 4") in proc.stderr
    assert ("plait: elastic resume: step-00000005 was written by 4 process(es) (dp=4); this world has 2 (dp=2): "
            "--grad-accum 2 keeps the global batch of 8") in proc.stderr
    lines = records(tmp_path)
    assert [r["world_size"] for r in lines] == [4] * 5 + [2] * 7
    assert [r["grad_accum"] for r in lines] == [1] * 5 + [2] * 7
    assert [r["restart"] for r in lines] == [0] * 5 + [2] * 7
    assert_same_model(tmp_path, reference)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["worlds"] == [{"first_step": 1, "last_step": 5, "world_size": 4, "grad_accum": 1},
                                 {"first_step": 6, "last_step": 12, "world_size": 2, "grad_accum": 2}]
    assert ("  elastic     steps 1-5 on 4 process(es) (grad-accum 1), steps 6-12 on 2 process(es) (grad-accum 2), "
            "the same global batch") in proc.stdout
    report = run_plait("report", str(tmp_path))
    assert report.returncode == 0, report.stderr
    assert ("- world size changed (elastic restart): steps 1-5 on 4 process(es) (grad-accum 1), steps 6-12 on 2 "
            "process(es) (grad-accum 2), the same global batch") in (tmp_path / "report.md").read_text()


def test_a_run_grows_onto_more_ranks_with_tp_fixed_and_a_size_that_cannot_keep_the_batch_is_refused(
        reference, tmp_path, monkeypatch):
    """tp 2 × dp 1 on 2 ranks (--grad-accum 4), killed at step 7; a world of 3 (dp 3) cannot
    keep the global batch and is refused; then 4 ranks: tp 2 × dp 2 with half the
    accumulation. TP sums in another order than the dp 4 reference: its tolerances are
    the parity matrix's (tests/matrix.py)."""
    monkeypatch.setenv("PLAIT_INJECT", "0:1:7:KILL")
    tp = ["--tp", "2", "--grad-accum", "4"]
    first = run_plait("train", *RUN, *tp, "--nproc", "2", "--out", str(tmp_path), timeout=300)
    assert first.returncode == 137, first.stderr  # no --max-restarts: the job ends, step 5 saved
    monkeypatch.delenv("PLAIT_INJECT")
    refused = run_plait("train", *RUN, "--nproc", "3", "--resume", "auto", "--out", str(tmp_path), timeout=60)
    assert refused.returncode == 2
    assert ("plait: error: 3 process(es) (dp=3) cannot keep the global batch of 8 samples that step-00000005 was "
            "trained with, at --micro-batch 2\n  hint: world sizes that can: 1, 2, 4 (or change --micro-batch)"
            ) in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "checkpoints" / "step-00000006").exists()
    grown = run_plait("train", *RUN, *tp, "--nproc", "4", "--resume", "auto", "--out", str(tmp_path), timeout=300)
    assert grown.returncode == 0, grown.stderr
    assert ("step-00000005 was written by 2 process(es) (dp=1); this world has 4 (dp=2): --grad-accum 2 keeps the "
            "global batch of 8") in grown.stderr
    lines = records(tmp_path)
    assert [(r["world_size"], r["grad_accum"]) for r in lines] == [(2, 4)] * 5 + [(4, 2)] * 7
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["layout"]["tp"] == 2 and summary["layout"]["dp"] == 2
    assert_same_model(tmp_path, reference, loss_rtol=1e-4, param_atol=2e-5)


@pytest.mark.slow  # make test covers a shrink (dp, ZeRO-3) and a grow (tp fixed); these are the other pairings
@pytest.mark.parametrize("before,after,flags,rtol,atol", [
    ((2, 2), (4, 1), ["--zero", "3"], 1e-5, 5e-6),  # dp 2 -> 4 under ZeRO-3
    ((4, 2), (2, 4), ["--tp", "2"], 1e-4, 2e-5),  # tp 2 × dp 2 -> tp 2 × dp 1
])
def test_the_other_pairings_of_size_and_strategy(reference, tmp_path, monkeypatch, before, after, flags, rtol, atol):
    """(processes, --grad-accum) before and after: the global batch is 8 throughout."""
    (n0, accum0), (n1, accum1) = before, after
    flags = [*RUN, *flags, "--grad-accum", str(accum0), "--out", str(tmp_path)]
    monkeypatch.setenv("PLAIT_INJECT", "0:1:7:KILL")
    first = run_plait_fresh("train", *flags, "--nproc", str(n0), timeout=300)  # exec'd: see the module's note
    assert first.returncode == 137, first.stderr
    monkeypatch.delenv("PLAIT_INJECT")
    second = run_plait("train", *flags, "--nproc", str(n1), "--resume", "auto", timeout=300)
    assert second.returncode == 0, second.stderr
    assert [(r["world_size"], r["grad_accum"]) for r in records(tmp_path)] == [(n0, accum0)] * 5 + [(n1, accum1)] * 7
    assert_same_model(tmp_path, reference, loss_rtol=rtol, param_atol=atol)


def _saved(tmp_path, **settings):
    """A checkpoint's index as `plait train` writes it (what fit_world reads of it): dp 2,
    micro-batch 2, grad-accum 2, so a global batch of 8."""
    path = tmp_path / "step-00000002"
    path.mkdir()
    config = {"micro_batch": 2, "grad_accum": 2, "dp": 2, "seed": 0, "seq_len": 16, **settings}
    (path / "index.json").write_text(json.dumps({"format": "plait-checkpoint/1", "step": 2, "world_size": 2,
                                                 "layout": {"dp": 2}, "trainer": {"config": config},
                                                 "files": {}, "tensors": {}}))
    return path


def _resumed(path, capsys, **flags):
    from plait.train.config.settings import build_config

    config = build_config({}, {"model": "tiny", "seq_len": 16, "resume": str(path), **flags})
    return config, capsys.readouterr().err


def test_a_resume_keeps_the_global_batch_on_the_same_dp_and_refuses_other_samples(tmp_path, capsys, monkeypatch):
    """Not only an elastic resume: one on the same dp with another --micro-batch or --grad-accum
    keeps the checkpoint's global batch (said in one line); a changed seed or sequence length,
    which trains on other samples from there on, is said in one line too."""
    from plait.errors import PlaitError

    monkeypatch.setenv("RANK", "0")  # rank 0 of the world says it
    path = _saved(tmp_path)
    config, said = _resumed(path, capsys, nproc=2, micro_batch=2, grad_accum=2)
    assert config.grad_accum == 2 and said == ""
    config, said = _resumed(path, capsys, nproc=2, micro_batch=2)  # --grad-accum left at its default, 1
    assert config.grad_accum == 2
    assert ("plait: resume: step-00000002 was trained with a global batch of 8 samples; at --micro-batch 2 on dp=2, "
            "--grad-accum 2 keeps it") in said
    config, _ = _resumed(path, capsys, nproc=2, micro_batch=4)
    assert config.grad_accum == 1
    with pytest.raises(PlaitError, match="cannot keep the global batch of 8 samples"):
        _resumed(path, capsys, nproc=2, micro_batch=3)
    _, said = _resumed(path, capsys, nproc=2, micro_batch=2, grad_accum=2, seed=1)
    assert said == ("plait: resume: --seed 1 differs from the 0 that step-00000002 was trained with: the samples "
                    "from step 3 on are not those the run would have trained on\n")
    _, said = _resumed(path, capsys, nproc=2, micro_batch=2, grad_accum=2, seq_len=32)
    assert "plait: resume: --seq-len 32 differs from the 16" in said


def test_a_sync_bn_run_shrinks_only_to_worlds_without_accumulation():
    """SyncBN refuses accumulation on more than one data rank, so the spawner's smaller worlds
    (and the refusal's hint) leave those sizes out: batch 64 at micro-batch 16 runs on 4
    ranks, or on 1 with accumulation, not on 2."""
    from plait.train.checkpoint.elastic import world_sizes

    assert world_sizes(64, 16) == [1, 2, 4]
    assert world_sizes(64, 16, sync_bn=True) == [1, 4]
