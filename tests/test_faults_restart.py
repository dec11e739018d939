"""Faults in real worlds: a stuck rank is named by every rank and by the spawner; a killed
rank's world restarts from the latest checkpoint and ends with the same bytes as a run that
never failed (faults are injected with PLAIT_INJECT, see plait/runtime/inject.py).

The runs here come from the session's pool (run_plait) unless they test the exec boundary
(below): the command is forked with torch imported, and its spawner forks each rank. A rank is still a process of its own, so a fault
is the process's: killed, stopped or signalled, it exits or hangs as an exec'd rank would,
and the spawner sees it through the same waits and /proc reads. The process boundary itself
(exec'd ranks under srun, a scheduler's SIGTERM to the whole job, and a killed rank's
restart in the slow tier, whose bytes must equal the pooled reference's) is tested with new
interpreters below and in tests/test_launchers.py."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plait.errors import EXIT_PREEMPTED
from tests import slurmlib
from tests.slurmlib import launcher_env
from tests.worldlib import ROOT, run_plait, run_plait_fresh

RUN = ["--model", "tiny", "--micro-batch", "2", "--seq-len", "16", "--eval-every", "0",
       "--sample-tokens", "0", "--warmup-steps", "2"]
STEPS = ["--steps", "12", "--save-every", "5", "--nproc", "2"]


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run; `--resume auto` with nothing saved yet starts it fresh."""
    out = tmp_path_factory.mktemp("reference")
    proc = run_plait("train", *RUN, *STEPS, "--resume", "auto", "--out", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.slow  # make test restarts a killed world below, with the rank killed mid-save (--async-save)
def test_a_killed_rank_restarts_the_world_and_ends_with_the_same_bytes(reference, tmp_path, monkeypatch):
    monkeypatch.setenv("PLAIT_INJECT", "0:1:7:KILL")  # rank 1 dies as step 7 begins, first world only
    # exec'd ranks, so that the bytes compared with the pooled reference would differ if
    # training followed the string-hash seed (pooled processes share one)
    proc = run_plait_fresh("train", *RUN, *STEPS, "--max-restarts", "1", "--out", str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "rank 1 exited with code -9 (SIGKILL)" in proc.stderr
    assert "plait: restarting the world (1 of 1)" in proc.stderr
    assert (tmp_path / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    lines = records(tmp_path)
    assert [r["step"] for r in lines] == list(range(1, 13))
    assert [r["restart"] for r in lines] == [0] * 5 + [1] * 7  # steps 6-12 ran again, after the restart
    assert [r["loss"] for r in lines] == [r["loss"] for r in records(reference)]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["resumed_from"].endswith("step-00000005")
    assert json.loads((reference / "summary.json").read_text())["restarts"] == 0


@pytest.mark.slow  # an edge of the restart path; make test keeps the mid-run kill and the SIGTERM ones
def test_a_world_that_dies_after_its_last_save_ends_well(reference, tmp_path, monkeypatch):
    """Rank 1 dies in the closing phase (step 13 of 12: sample, weights, report), after
    step-00000012 was written: the restarted world finds the finished run and writes its
    outputs from that checkpoint; `--resume auto` by hand on a finished run does the same."""
    monkeypatch.setenv("PLAIT_INJECT", "0:1:13:KILL")
    proc = run_plait("train", *RUN, *STEPS, "--max-restarts", "1", "--out", str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "rank 1 sends itself SIGKILL at step 13" in proc.stderr
    assert "plait: restarting the world (1 of 1)" in proc.stderr
    assert (tmp_path / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    assert [r["loss"] for r in records(tmp_path)] == [r["loss"] for r in records(reference)]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["resumed_from"].endswith("step-00000012")
    assert summary["steps"] == 12 and summary["val_loss"] == json.loads((reference / "summary.json").read_text())["val_loss"]
    monkeypatch.delenv("PLAIT_INJECT")
    (tmp_path / "model.safetensors").unlink()
    again = run_plait("train", *RUN, *STEPS, "--resume", "auto", "--out", str(tmp_path), timeout=300)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()


def test_an_async_save_killed_mid_write_leaves_the_previous_checkpoint_and_resumes_exactly(reference, tmp_path,
                                                                                         monkeypatch):
    """--async-save: rank 1 dies in the background write of step 10 (after its tensors are in
    the file, before the checkpoint is published). Step 5 stays `latest` and whole; the
    restarted world resumes it and, saving in the background too, ends with the same bytes
    and losses as the synchronous reference."""
    monkeypatch.setenv("PLAIT_INJECT", "0:1:10:KILL:save")
    proc = run_plait("train", *RUN, *STEPS, "--async-save", "--max-restarts", "1", "--out", str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "rank 1 sends itself SIGKILL at step 10 while saving" in proc.stderr
    assert "plait: restarting the world (1 of 1)" in proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step-00000005")
    assert (tmp_path / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    lines = records(tmp_path)
    assert [r["loss"] for r in lines] == [r["loss"] for r in records(reference)]
    assert [r["restart"] for r in lines] == [0] * 5 + [1] * 7
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-00000005", "step-00000010",
                                                             "step-00000012"]
    assert (checkpoints / "latest").resolve().name == "step-00000012"
    for step in ("00000010", "00000012"):  # what the background writes produced loads like any checkpoint
        assert run_plait("ckpt", "inspect", str(checkpoints / f"step-{step}")).returncode == 0


def test_sigterm_saves_at_one_step_on_every_rank_and_resume_ends_with_the_same_bytes(reference, tmp_path,
                                                                                     monkeypatch):
    """SIGTERM reaches rank 1 alone, as step 7 begins: both ranks finish step 7, save it,
    and exit with 75; `--resume auto` continues from there to the reference's bytes."""
    monkeypatch.setenv("PLAIT_INJECT", "0:1:7:TERM")
    proc = run_plait("train", *RUN, *STEPS, "--max-restarts", "1", "--out", str(tmp_path), timeout=300)
    assert proc.returncode == 75, proc.stderr
    assert "plait: restarting the world" not in proc.stderr  # a preempted job is not restarted
    assert (f"plait: preempted by SIGTERM: every rank stopped after step 7 of 12 and saved "
            f"{tmp_path / 'checkpoints' / 'step-00000007'}; continue with --resume auto (exit code 75)") in proc.stderr
    assert proc.stderr.count("plait: preempted") == 1
    assert (tmp_path / "checkpoints" / "latest").resolve().name == "step-00000007"
    assert [r["step"] for r in records(tmp_path)] == list(range(1, 8))
    monkeypatch.delenv("PLAIT_INJECT")
    again = run_plait("train", *RUN, *STEPS, "--resume", "auto", "--out", str(tmp_path), timeout=300)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    assert [r["loss"] for r in records(tmp_path)] == [r["loss"] for r in records(reference)]


def test_sigterm_to_the_whole_job_step_is_one_preemption(tmp_path):
    """A scheduler signals the spawner and every rank at once, and the spawner passes the signal
    on: each rank gets SIGTERM twice, the second after its handler took the first. That is one
    preemption: every rank saves at one step and the job exits 75 (not 143, its ranks killed
    by the repeat and nothing saved)."""
    job = subprocess.Popen([sys.executable, "-m", "plait", "train", *RUN, "--steps", "1000", "--nproc", "2",
                            "--out", str(tmp_path)], cwd=ROOT, env=launcher_env(), stderr=subprocess.PIPE, text=True)
    try:
        metrics, deadline = tmp_path / "metrics.jsonl", time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            time.sleep(0.05)  # both ranks are training: their handlers are in place
        ranks = [int(pid) for pid in Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split()]
        assert len(ranks) == 2, ranks
        for pid in ranks:
            os.kill(pid, signal.SIGTERM)
        while any(catches(pid, signal.SIGTERM) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.005)  # the ranks took it (a second copy at once would merge with the first)
        job.send_signal(signal.SIGTERM)  # the spawner's copy, passed on to the ranks
        _, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == EXIT_PREEMPTED, err
    assert "exited with code" not in err and err.count("plait: preempted by SIGTERM: every rank stopped") == 1, err
    latest = (tmp_path / "checkpoints" / "latest").resolve()
    assert latest.is_dir() and latest.name.startswith("step-"), err


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` now (/proc's SigCgt mask); False once it exited."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (sig - 1) & 1)


def test_under_srun_sigterm_to_one_rank_stops_the_job_at_one_step_and_it_resumes_exactly(reference, tmp_path):
    """The same under a real Slurm (a one-node cluster on localhost): srun's job exits 75 with
    every rank saved at step 7, and the requeued job (`--resume auto`, here srun by hand)
    ends with the bytes of the reference run plait's own spawner trained."""
    why = slurmlib.missing()
    if why:
        pytest.skip(why)
    train = [sys.executable, "-m", "plait", "train", *RUN, "--steps", "12", "--save-every", "5", "--out", str(tmp_path)]
    with slurmlib.cluster(tmp_path / "slurm") as env:
        def srun(*extra, **variables):
            return subprocess.run(["srun", "-n", "2", "--time", "5", *train, *extra], cwd=ROOT, capture_output=True,
                                  text=True, timeout=300, env=launcher_env(SLURM_CONF=env["SLURM_CONF"], **variables))

        preempted = srun(PLAIT_INJECT="0:1:7:TERM")
        assert preempted.returncode == 75, preempted.stdout + preempted.stderr
        assert "every rank stopped after step 7 of 12" in preempted.stderr
        assert (tmp_path / "checkpoints" / "latest").resolve().name == "step-00000007"
        resumed = srun("--resume", "auto")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["layout"]["launcher"] == "slurm" and summary["resumed_from"].endswith("step-00000007")
    assert (tmp_path / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()


def test_a_stopped_rank_is_named_by_every_rank_and_the_spawner(tmp_path, monkeypatch):
    monkeypatch.setenv("PLAIT_INJECT", "0:2:3:STOP")  # rank 2 of 4 freezes as step 3 begins
    proc = run_plait("train", *RUN, "--steps", "5", "--nproc", "4", "--timeout", "2", "--out", str(tmp_path),
                     timeout=300)
    ended = time.time()
    assert proc.returncode == 2, proc.stderr
    stopped_at = float(re.search(r"rank 2 sends itself SIGSTOP at step 3 \(t=([\d.]+)\)", proc.stderr).group(1))
    for rank in (0, 1, 3):
        # Each error starts a line of its own, even with rank 0's bar drawn on that stderr (runtime/console.py).
        found = re.search(rf"^plait: error: rank {rank}: [^\n]*", proc.stderr, re.MULTILINE)
        line = found.group(0) if found else ""
        assert line, f"rank {rank} printed no error line:\n{proc.stderr}"
        assert "on the dp group (4 ranks) (step 3) failed" in line, line
        assert "rank 2 never entered all_reduce #" in line and "on the dp group at step 3" in line, line
        assert "the last collective it finished was all_reduce #" in line, line
    assert re.search(r"^plait: stuck or dead: rank 2 \(its process is stopped\), named by rank\(s\) 0, 1, 3", proc.stderr,
                     re.MULTILINE), proc.stderr
    print(f"rank 2 named {ended - stopped_at:.1f} s after it stopped")  # shown with pytest -s
    assert ended - stopped_at < 25  # --timeout 2, then the diagnosis and the summary


@pytest.mark.slow
def test_soak_five_random_kills_end_with_the_same_bytes(tmp_path, monkeypatch):
    rng = random.Random(17)
    steps = sorted(rng.sample(range(2, 20), 5))  # rising, so each restarted world reaches its kill
    spec = ",".join(f"{attempt}:{rng.randrange(4)}:{step}:KILL" for attempt, step in enumerate(steps))
    flags = [*RUN, "--steps", "20", "--save-every", "3", "--nproc", "4"]
    clean = run_plait("train", *flags, "--out", str(tmp_path / "clean"), timeout=600)
    assert clean.returncode == 0, clean.stderr
    monkeypatch.setenv("PLAIT_INJECT", spec)
    proc = run_plait("train", *flags, "--max-restarts", "5", "--out", str(tmp_path / "soak"), timeout=900)
    assert proc.returncode == 0, (spec, proc.stderr)
    assert proc.stderr.count("plait: restarting the world") == 5, spec
    assert (tmp_path / "soak" / "model.safetensors").read_bytes() == (tmp_path / "clean" / "model.safetensors").read_bytes()
    assert max(r["restart"] for r in records(tmp_path / "soak")) == 5
