"""A flight recorder for collectives: when one times out, name the rank that never came.

A timed-out collective only tells the rank that waited that *someone* is missing. To say who,
every rank numbers the collectives it enters on each axis (all ranks of a group enter the
same collectives in the same order, so the n-th all-reduce on the dp group is the same call
everywhere) and keeps, in memory, a small record that a background thread copies into the
job's c10d store about once a second (only when it changed):

    plait/fr/<rank> = {"seq": {"dp": 57, "world": 12}, "entered": [...], "finished": [...], "step": 5}

Entering a collective therefore costs a counter and a tuple — no store I/O — which matters
because tensor parallelism and ZeRO-3 make hundreds of small collectives per step, and with
a store write each, every one of them would wait on rank 0's store. A rank that is stopped
or hangs leaves a record at most PUBLISH_INTERVAL_S old, which is plenty: a collective only
times out after --timeout seconds.

A rank whose collective fails publishes its own record at once, waits a little (until every
member's record shows the failed call, or GRACE_S) so that the live ranks' latest counts have
reached the store, then reads its group members' records: a member whose count on that axis
is below the failed call's number never entered it, and its record says what it did last.
The store is the one torch.distributed already rendezvoused through (hosted by rank 0 under
plait's spawner, srun and mpirun; by the agent under torchrun), so there is no extra process.
The idea follows PyTorch's flight recorder and torchft's per-step quorum, reduced to what a
timeout message needs.

Point-to-point calls (pipeline send/recv) are not numbered per group — only two ranks take
part — so a failed one names its peer and shows that peer's record.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

KEY = "plait/fr/"
DONE = "plait/fr-done/"
PUBLISH_INTERVAL_S = 1.0  # how stale a stopped rank's record may be
GRACE_S = 2 * PUBLISH_INTERVAL_S  # after a failure: time for the live ranks' last ticks to land
POLL_S = 0.1
READ_TIMEOUT_S = 5.0
LINGER_S = 10.0
FAULT_DIR = "PLAIT_FAULT_DIR"  # set by plait's spawner: where ranks leave what they found


class Entry(NamedTuple):
    """One collective this rank entered: its op, axis, number on that axis, and the step.

    A named tuple, not a dataclass: one is built per collective, and this is twice as cheap."""

    op: str
    axis: str
    seq: int  # 0 for point-to-point calls
    step: int
    peer: int | None = None

    def describe(self) -> str:
        number = f" #{self.seq}" if self.seq else ""
        peer = f" with rank {self.peer}" if self.peer is not None else ""
        when = f" at step {self.step}" if self.step else " before the first step"
        return f"{self.op}{number} on the {self.axis} group{peer}{when}"


class FlightRecorder:
    """This rank's collective counts, kept in memory and published by a background thread."""

    def __init__(self, store: Any, rank: int, world_size: int, members: dict[str, list[int]], hosts_store: bool):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.members, self.hosts_store = members, hosts_store
        self.seq: dict[str, int] = {}
        self.entered: Entry | None = None
        self.finished: Entry | None = None
        self.step = 0
        self.version = 0  # bumped by every change; the publisher compares it with what it wrote
        self.culprits: list[int] = []
        self.finding = ""  # the diagnosis, without the failing rank's own words
        self._publisher: Publisher | None = None

    # -- the hot path: memory only -------------------------------------------------------------------
    def enter(self, axis: str, op: str, peer: int | None = None) -> Entry:
        seq = 0
        if peer is None:
            seq = self.seq[axis] = self.seq.get(axis, 0) + 1
        self.entered = Entry(op, axis, seq, self.step, peer)
        self.version += 1
        return self.entered

    def finish(self, entry: Entry) -> None:
        self.finished = entry
        self.version += 1

    def begin_step(self, step: int) -> None:
        """Steps are recorded too, so a rank stuck in compute shows where it is."""
        self.step = step
        self.version += 1

    # -- publishing ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Publish now, then every PUBLISH_INTERVAL_S from a daemon thread (see Publisher)."""
        self.publish()
        if self._publisher is None:
            self._publisher = Publisher(self)
            self._publisher.start()

    def stop(self) -> None:
        if self._publisher is not None:
            self._publisher.stop()
            self._publisher = None

    def publish(self, store: Any = None) -> int:
        """Write the record (through `store`, default the main one); returns the version written."""
        try:
            return self._write(store or self.store)
        except RuntimeError:
            return -1  # the store is gone: the collective itself will fail and say so

    def _write(self, store: Any) -> int:
        version = self.version
        record = {"seq": dict(self.seq), "step": self.step, "entered": _pack(self.entered),
                  "finished": _pack(self.finished)}
        store.set(f"{KEY}{self.rank}", json.dumps(record, separators=(",", ":")))
        return version

    # -- after a failure -----------------------------------------------------------------------------
    def diagnose(self, entry: Entry | None) -> str:
        """A sentence naming the ranks that never entered `entry`, with what each did last."""
        if entry is None:
            return ""
        self.finding = self._diagnose(entry).removeprefix(" — ")
        return f" — {self.finding}"

    def _diagnose(self, entry: Entry) -> str:
        store_timeout(self.store)
        suspects = [entry.peer] if entry.peer is not None else [m for m in self.members.get(entry.axis, []) if m != self.rank]
        try:
            self._write(self.store)  # this rank is alive: its record must be current before anyone reads it
            records = self._settled_records(entry, suspects)
        except RuntimeError:
            self.culprits = [0] if not self.hosts_store and 0 in suspects else []
            return (" — the job's store does not answer; under plait's spawner, srun and mpirun rank 0 "
                    "hosts it, so rank 0 is probably the one stopped or stuck")
        if entry.peer is not None:
            self.culprits = [entry.peer]
            return f" — {_whereabouts(entry.peer, records[entry.peer])}"
        missing = [m for m, rec in records.items() if not _entered(rec, entry)]
        self.culprits = missing
        if not missing:
            return " — every rank of the group entered it; one may have died inside it"
        names = ", ".join(map(str, missing))
        lines = "; ".join(_whereabouts(m, records[m]) for m in missing)
        return f" — rank{'s' if len(missing) > 1 else ''} {names} never entered {entry.describe()}: {lines}"

    def _settled_records(self, entry: Entry, suspects: list[int]) -> dict[int, dict[str, Any] | None]:
        """The suspects' records, once all show `entry` or GRACE_S has passed.

        Records are published once a second, so a live member's latest count may not be in the
        store yet; two ticks let it land. Only the members not yet showing `entry` are read
        again, so with many ranks the store's host serves little more than one read per member.
        A point-to-point peer has no count to wait for: it is read once."""
        deadline = time.monotonic() + (GRACE_S if entry.peer is None else 0.0)
        records = {m: self._read(m) for m in suspects}
        while True:
            late = [m for m, rec in records.items() if not _entered(rec, entry)]
            if not late or time.monotonic() >= deadline:
                return records
            time.sleep(POLL_S)
            records.update({m: self._read(m) for m in late})

    def _read(self, rank: int) -> dict[str, Any] | None:
        key = f"{KEY}{rank}"
        if not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))

    def report(self, rank: int, message: str) -> None:
        """Leave the finding where plait's spawner reads it, and tell the store host we are done."""
        folder = os.environ.get(FAULT_DIR)
        if folder:
            path = Path(folder) / f"rank{rank}.json"
            note = {"rank": rank, "message": message, "finding": self.finding, "culprits": self.culprits}
            path.write_text(json.dumps(note))
        try:
            self.store.set(f"{DONE}{rank}", "1")
        except RuntimeError:
            pass

    def linger(self) -> None:
        """On the rank that hosts the store: keep it up until the other ranks have read it.

        Leaving at once would take the store down while they are still diagnosing their own
        timeouts. The named culprits get only GRACE_S beyond the others: a stopped one will
        never answer, but one whose record merely reached the store late is alive and about
        to read it."""
        if not self.hosts_store:
            return
        waiting = [r for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + LINGER_S
        while waiting and time.monotonic() < deadline:
            try:
                waiting = [r for r in waiting if not self.store.check([f"{DONE}{r}"])]
            except RuntimeError:
                return
            if set(waiting) <= set(self.culprits):  # only the named ones are left: GRACE_S from the first time
                deadline = min(deadline, time.monotonic() + GRACE_S)
            time.sleep(0.1)


class Publisher(threading.Thread):
    """Copies the recorder's record into the store every PUBLISH_INTERVAL_S, when it changed.

    A daemon thread, so it never keeps the process alive; every error is swallowed (the store
    goes away when the job ends, and the thread must not outlive it with a traceback). It
    writes through its own client: torch documents Store.clone() as the way to use a store
    from several threads ("one store per thread"; TCPStore's clone opens a second connection
    to the same server), and the main thread's client must stay free for the rendezvous and
    for diagnoses. Stores that cannot be cloned are shared: a TCPStore client also serialises
    its operations behind a mutex (activeOpLock_ in TCPStore.hpp)."""

    def __init__(self, recorder: FlightRecorder):
        super().__init__(name=f"plait-recorder-{recorder.rank}", daemon=True)
        self.recorder, self.halt = recorder, threading.Event()
        self.written = recorder.version
        try:
            self.store = recorder.store.clone()
            self.store.set_timeout(datetime.timedelta(seconds=READ_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - a fake or uncloneable store: share the main client
            self.store = recorder.store
        atexit.register(self.stop)

    def run(self) -> None:
        while not self.halt.wait(PUBLISH_INTERVAL_S):
            if self.recorder.version != self.written:
                try:
                    self.written = self.recorder.publish(self.store)
                except Exception:  # noqa: BLE001 - see the class docstring
                    pass

    def stop(self) -> None:
        """Ask the thread to end and give it a moment (a write to a dead store may block)."""
        self.halt.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout=PUBLISH_INTERVAL_S)


def _entered(record: dict[str, Any] | None, entry: Entry) -> bool:
    return record is not None and record["seq"].get(entry.axis, 0) >= entry.seq


def _pack(entry: Entry | None) -> list[Any] | None:
    return None if entry is None else list(entry)


def _whereabouts(rank: int, record: dict[str, Any] | None) -> str:
    """What `rank` last did, from its published record."""
    if record is None:
        return f"rank {rank} has entered no collective yet (stuck or dead before its first)"
    entered, finished = record["entered"], record["finished"]
    last = Entry(*entered) if entered else None
    done = Entry(*finished) if finished else None
    text = f"rank {rank} is at step {record['step']}"
    if done is not None:
        text += f", the last collective it finished was {done.describe()}"
    if last is not None and last != done:
        text += f", it last entered {last.describe()}"
    return text


def store_timeout(store: Any) -> None:
    """Reads during a diagnosis must not wait as long as training collectives do."""
    store.set_timeout(datetime.timedelta(seconds=READ_TIMEOUT_S))
