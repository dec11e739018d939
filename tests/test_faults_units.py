"""The pieces of fault handling that need no processes: the recorder's verdicts from store
records, its publisher (no store write per collective), --resume auto, the restart command, the no-save warning, fault-injection specs."""

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
from plait.train.config import TrainConfig
from plait.train.restart import resolve_auto, restart_argv, restart_count, warn_restarts_without_saves


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
    assert parse("0:2:7:KILL,1:0:9:stop") == [(0, 2, 7, signal.SIGKILL), (1, 0, 9, signal.SIGSTOP)]
    with pytest.raises(PlaitError, match="is not ATTEMPT:RANK:STEP:SIGNAL"):
        parse("2:7:KILL")
