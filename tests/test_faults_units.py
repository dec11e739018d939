"""The pieces of fault handling that need no processes: the recorder's verdicts from store
records, its publisher (no store write per collective), --resume auto, the restart command, the no-save warning,
fault-injection specs; the spawner's elastic restarts and signal forwarding (ranks of a few lines of Python);
the preemption flag; the world sizes that keep a global batch."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from plait.errors import PlaitError
from plait.runtime import launch
from plait.runtime.inject import parse
from plait.runtime import recorder as recorder_module
from plait.runtime.recorder import KEY, Entry, FlightRecorder
from plait.train.config.settings import TrainConfig
from plait.train.checkpoint.restart import resolve_auto, restart_argv, restart_count, warn_restarts_without_saves


class DictStore:
    """The three calls the recorder makes on a c10d store."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value

    def get(self, key):
        return self.data[key].encode()

    def check(self, keys):
        return all(k in self.data for k in keys)

    def set_timeout(self, _):
        pass


class CountingStore(DictStore):
    """Counts writes, and hands itself out as the publisher's client."""

    def __init__(self):
        super().__init__()
        self.writes = 0

    def set(self, key, value):
        self.writes += 1
        super().set(key, value)

    def clone(self):
        return self


@pytest.fixture(autouse=True)
def short_grace(monkeypatch):
    monkeypatch.setattr(recorder_module, "GRACE_S", 0.2)  # a diagnosis waits this long for a missing rank


def recorders(n, store):
    return [FlightRecorder(store, r, n, {"dp": list(range(n))}, hosts_store=r == 0) for r in range(n)]


def tick(ranks):
    """What each rank's publisher thread does once a second."""
    for rec in ranks:
        rec.publish()


def test_the_rank_that_never_entered_is_named_with_what_it_did_last():
    store = DictStore()
    ranks = recorders(3, store)
    for step in (1, 2):
        for rec in ranks:
            rec.begin_step(step)
            if step == 2 and rec.rank == 1:
                continue  # rank 1 stops in step 2's compute
            rec.finish(rec.enter("dp", "all_reduce"))
        tick(ranks)
    entry = ranks[0].entered
    assert entry == Entry("all_reduce", "dp", 2, 2)
    text = ranks[0].diagnose(entry)
    assert text == (" — rank 1 never entered all_reduce #2 on the dp group at step 2: rank 1 is at step 2, "
                    "the last collective it finished was all_reduce #1 on the dp group at step 1")
    assert ranks[0].culprits == [1]
    assert json.loads(store.data[f"{KEY}1"])["seq"] == {"dp": 1}


def test_a_rank_with_no_record_and_a_peer_of_a_recv():
    store = DictStore()
    first, second = recorders(2, store)
    assert "rank 1 has entered no collective yet" in first.diagnose(first.enter("dp", "all_reduce"))
    second.begin_step(4)
    second.finish(second.enter("pp", "send", peer=0))
    second.begin_step(5)
    assert f"{KEY}1" not in store.data  # nothing reaches the store until the publisher's tick
    tick([second])
    text = first.diagnose(first.enter("pp", "recv", peer=1))
    assert text == " — rank 1 is at step 5, the last collective it finished was send on the pp group with rank 0 at step 4"


def test_every_rank_entered_means_no_culprit():
    store = DictStore()
    ranks = recorders(2, store)
    entries = [rec.enter("dp", "all_reduce") for rec in ranks]
    tick(ranks)
    assert "every rank of the group entered it" in ranks[0].diagnose(entries[0]) and ranks[0].culprits == []


def test_a_record_that_lands_during_the_grace_clears_its_rank():
    store = DictStore()
    ranks = recorders(2, store)
    entries = [rec.enter("dp", "all_reduce") for rec in ranks]  # both entered; rank 1 not yet published
    threading.Timer(0.05, ranks[1].publish).start()
    assert "every rank of the group entered it" in ranks[0].diagnose(entries[0]) and ranks[0].culprits == []


def test_a_store_that_does_not_answer_points_at_its_host():
    class DeadStore(DictStore):
        reads = 0

        def set(self, key, value):
            raise RuntimeError("timed out")

        def check(self, keys):
            self.reads += 1
            return super().check(keys)

    store = DeadStore()
    rec = recorders(2, store)[1]
    assert "the job's store does not answer" in rec.diagnose(rec.enter("dp", "all_reduce"))
    assert rec.culprits == [0] and store.reads == 0  # the own write failed: no waiting, no reads


def test_collectives_write_nothing_to_the_store_only_the_publisher_does(monkeypatch):
    monkeypatch.setattr(recorder_module, "PUBLISH_INTERVAL_S", 0.05)
    store, calls = CountingStore(), 20000
    rec = recorders(2, store)[0]
    start = time.monotonic()
    rec.start()  # one write at once, then at most one per tick
    for _ in range(calls):
        rec.finish(rec.enter("dp", "all_reduce"))
    deadline = time.monotonic() + 10
    while rec._publisher.written != rec.version:  # a tick publishes the last state
        assert time.monotonic() < deadline, store.data
        time.sleep(0.01)
    ticks = (time.monotonic() - start) / 0.05
    assert json.loads(store.data[f"{KEY}0"])["seq"] == {"dp": calls}
    assert 2 <= store.writes <= ticks + 2 and store.writes < calls / 10, (store.writes, ticks)
    idle = store.writes
    time.sleep(0.15)
    assert store.writes == idle  # an unchanged record is not written again
    rec.stop()
    rec.enter("dp", "all_reduce")
    time.sleep(0.15)
    assert store.writes == idle  # a stopped publisher writes nothing


def test_the_store_host_waits_for_a_named_rank_only_a_grace_longer():
    store = DictStore()
    host = recorders(3, store)[0]
    host.culprits = [2]
    store.set("plait/fr-done/1", "1")  # rank 1 read the store; rank 2 was named and never answers
    start = time.monotonic()
    host.linger()
    assert 0.15 < time.monotonic() - start < 1.0  # GRACE_S (0.2 s here), not LINGER_S (10 s)


def test_the_spawner_waits_for_a_named_rank_that_still_runs_but_not_for_a_stopped_one(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "REPORT_S", 5.0)
    (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0, "culprits": [1]}))
    late = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.8)"])  # alive: its record was late
    start = time.monotonic()
    launch._wait_for_reports([subprocess.Popen(["true"]), late], tmp_path)
    assert late.poll() == 0 and time.monotonic() - start < 4.0
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    stopped.send_signal(signal.SIGSTOP)
    try:
        time.sleep(0.2)
        start = time.monotonic()
        launch._wait_for_reports([subprocess.Popen(["true"]), stopped], tmp_path)
        assert time.monotonic() - start < 2.0 and stopped.poll() is None
    finally:
        stopped.kill()
        stopped.wait()


def test_resume_auto_and_the_restart_command(tmp_path):
    config = TrainConfig(out=str(tmp_path), resume="auto")
    assert resolve_auto(config).resume == ""  # nothing saved yet: a fresh start
    assert restart_argv(["--steps", "3"], str(tmp_path)) == ["--steps", "3"]
    (tmp_path / "checkpoints" / "latest").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest" / "index.json").write_text("{}")
    assert resolve_auto(config).resume == str(tmp_path)
    assert restart_argv(["--steps", "3"], str(tmp_path)) == ["--steps", "3", "--resume", "auto"]
    # A smaller world: its size and the accumulation that keeps the global batch, last (they win).
    assert restart_argv(["--nproc", "4"], str(tmp_path), 2, 4) == ["--nproc", "4", "--nproc", "2", "--grad-accum", "4",
                                                                 "--resume", "auto"]


def test_restart_counters_of_each_launcher(monkeypatch):
    for name in ("PLAIT_RESTART", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    assert restart_count() == 0
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert restart_count() == 2


def test_restarts_without_saves_are_announced(capsys):
    warn_restarts_without_saves(2, 0)
    assert "--max-restarts 2 without --save-every: nothing is saved, so a restart would lose everything" in capsys.readouterr().err
    warn_restarts_without_saves(2, 5)
    warn_restarts_without_saves(0, 0)
    assert capsys.readouterr().err == ""


def test_injection_specs():
    assert parse("0:2:7:KILL,1:0:9:stop,0:1:10:KILL:save") == [
        (0, 2, 7, signal.SIGKILL, "step"), (1, 0, 9, signal.SIGSTOP, "step"), (0, 1, 10, signal.SIGKILL, "save")]
    for bad in ("2:7:KILL", "0:1:10:KILL:later", "0:1:10:KILL:save:x"):
        with pytest.raises(PlaitError, match="is not ATTEMPT:RANK:STEP:SIGNAL"):
            parse(bad)


# -- elastic worlds and preemption, with ranks that are a few lines of Python ----------------------
RANK_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
out, rank, attempt = Path(sys.argv[1]), int(os.environ["RANK"]), int(os.environ["PLAIT_RESTART"])
note = out / f".world{attempt}-rank{rank}"  # renamed once written: a rank stopped mid-write leaves no half file
note.write_text(os.environ["WORLD_SIZE"] + " " + " ".join(sys.argv[2:]))
note.rename(out / note.name[1:])
if sys.argv[2] == "fail-rank-3" and rank == 3 and attempt < 2:
    sys.exit(1)
if sys.argv[2] in ("sigterm", "no-handler"):
    if sys.argv[2] == "sigterm":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))  # plait train's answer to a preemption
    (out / f"ready{attempt}-{rank}").write_text("")
    time.sleep(60)
"""


def world_sizes_started(out):
    return {int(p.name.split("-")[0].removeprefix("world")): int(p.read_text().split()[0]) for p in out.glob("world*")}


def test_a_rank_that_fails_in_two_worlds_in_a_row_is_taken_as_lost(tmp_path, capsys):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    command = [sys.executable, str(script), str(tmp_path), "fail-rank-3"]
    code = launch.spawn(command, 4, max_restarts=3, restart_command=lambda n: [*command, f"--nproc={n}"],
                        sizes=[1, 2, 4])
    assert code == 0
    assert world_sizes_started(tmp_path) == {0: 4, 1: 4, 2: 2}  # the same size once, then the largest that fits
    assert (tmp_path / "world2-rank0").read_text() == "2 fail-rank-3 --nproc=2"
    err = capsys.readouterr().err
    assert "rank(s) 3 failed in two worlds in a row: taken as lost; the world restarts on 2 process(es) instead of 4" in err


def test_without_a_smaller_size_the_spawner_restarts_the_same_world_and_gives_up(tmp_path, capsys):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    command = [sys.executable, str(script), str(tmp_path), "fail-rank-3"]
    assert launch.spawn(command, 4, max_restarts=1, restart_command=lambda n: command) == 1
    assert world_sizes_started(tmp_path) == {0: 4, 1: 4}
    code = launch.spawn(command, 4, max_restarts=3, restart_command=lambda n: command, sizes=[4])
    assert code == 1 and "no smaller world the run accepts is left (it can run on 4 processes)" in capsys.readouterr().err


def test_sigterm_to_the_spawner_reaches_every_rank_and_is_not_restarted(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    job = subprocess.Popen([sys.executable, "-m", "plait", "launch", "--nproc", "2", str(script), str(tmp_path),
                            "sigterm"], stderr=subprocess.PIPE, text=True)
    wait_for_ready(tmp_path, 2)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=30) == 75, job.stderr.read()
    assert "exited with code" not in job.stderr.read()  # 75 is a preempted rank, not a failed one


def test_a_job_told_to_stop_is_not_restarted_even_if_its_ranks_die_of_the_signal(tmp_path):
    """Ranks still starting (no handler yet) die of SIGTERM: with --max-restarts left, the
    spawner still ends the job, since it was told to stop."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    spawner = ("import sys; from plait.runtime import launch; "
               f"sys.exit(launch.spawn([sys.executable, {str(script)!r}, {str(tmp_path)!r}, 'no-handler'], 2, "
               "max_restarts=2))")
    job = subprocess.Popen([sys.executable, "-c", spawner], stderr=subprocess.PIPE, text=True)
    wait_for_ready(tmp_path, 2)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=30) == 128 + signal.SIGTERM, job.stderr.read()
    assert "restarting the world" not in job.stderr.read()
    assert world_sizes_started(tmp_path) == {0: 2}


def wait_for_ready(out, nproc, attempt=0):
    deadline = time.monotonic() + 30
    while not all((out / f"ready{attempt}-{r}").exists() for r in range(nproc)) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_repeat_of_the_signal_is_the_same_preemption_and_the_other_signal_acts_at_once():
    """The spawner (or torchrun's agent) passes on the SIGTERM its ranks already got: one
    preemption. SIGTERM after a SIGUSR1 warning (the time limit is here) ends the process."""
    from plait.train.checkpoint.preempt import Preemption

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    preemption = Preemption().install()
    try:
        signal.raise_signal(signal.SIGUSR1)
        assert preemption.received == signal.SIGUSR1
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN  # ignored by the OS, even inside a collective
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        signal.raise_signal(signal.SIGUSR1)  # the repeat: this test process is still here
        assert preemption.received == signal.SIGUSR1
    finally:
        preemption.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN  # a late repeat, as the rank leaves with 75
    signal.signal(signal.SIGUSR1, before[signal.SIGUSR1])
    quiet = Preemption().install()
    quiet.uninstall()  # no signal came: every handler is put back
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_the_world_sizes_that_keep_a_global_batch():
    from plait.train.checkpoint.elastic import accumulation, world_sizes

    assert world_sizes(8, 2) == [1, 2, 4]
    assert world_sizes(8, 2, tp=2, up_to=4) == [2, 4]
    assert world_sizes(8, 1, pp=2) == [2, 4, 8, 16]  # any micro-batch count, interleaved too
    assert accumulation(8, 2, 2) == 2 and accumulation(8, 2, 3) is None and accumulation(8, 2, 8) is None


def test_min_nproc_above_nproc_is_refused_before_spawning():
    from plait.families import family_of
    from plait.train.config.settings import build_config, validate

    config = build_config({}, {"nproc": "2", "min_nproc": "3"}, family_of)
    with pytest.raises(PlaitError, match="--min-nproc 3 is more than --nproc 2"):
        validate(config, family_of(config))
