"""A flight recorder for collectives: when one times out, name the rank that never came.

A timed-out collective only tells the rank that waited that *someone* is missing. To say who,
every rank numbers the collectives it enters on each axis (all ranks of a group enter the
same collectives in the same order, so the n-th all-reduce on the dp group is the same call
everywhere) and publishes, before entering, a small record in the job's c10d store:

    plait/fr/<rank> = {"seq": {"dp": 57, "world": 12}, "entered": [...], "finished": [...], "step": 5}

A rank whose collective fails reads its group members' records: a member whose count on that
axis is below the failed call's number never entered it, and its record says what it did
last. The store is the one torch.distributed already rendezvoused through (hosted by rank 0
under plait's spawner, srun and mpirun; by the agent under torchrun), so this costs one small
write per collective and no extra process. The idea follows PyTorch's flight recorder and
torchft's per-step quorum, reduced to what a timeout message needs.

Point-to-point calls (pipeline send/recv) are not numbered per group — only two ranks take
part — so a failed one names its peer and shows that peer's record.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KEY = "plait/fr/"
DONE = "plait/fr-done/"
READ_TIMEOUT_S = 5.0
LINGER_S = 10.0
FAULT_DIR = "PLAIT_FAULT_DIR"  # set by plait's spawner: where ranks leave what they found


@dataclass(frozen=True)
class Entry:
    """One collective this rank entered: its op, axis, number on that axis, and the step."""

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
    """This rank's collective counts, published through the store before each collective."""

    def __init__(self, store: Any, rank: int, world_size: int, members: dict[str, list[int]], hosts_store: bool):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.members, self.hosts_store = members, hosts_store
        self.seq: dict[str, int] = {}
        self.entered: Entry | None = None
        self.finished: Entry | None = None
        self.step = 0
        self.culprits: list[int] = []
        self.finding = ""  # the diagnosis, without the failing rank's own words

    def enter(self, axis: str, op: str, peer: int | None = None) -> Entry:
        seq = 0
        if peer is None:
            seq = self.seq[axis] = self.seq.get(axis, 0) + 1
        self.entered = Entry(op, axis, seq, self.step, peer)
        self._publish()
        return self.entered

    def finish(self, entry: Entry) -> None:
        """Remembered now, published with the next entry or step (a stuck rank publishes nothing)."""
        self.finished = entry

    def begin_step(self, step: int) -> None:
        """Publish at each step's start too, so a rank stuck in compute shows its last finish."""
        self.step = step
        self._publish()

    def _publish(self) -> None:
        record = {"seq": self.seq, "step": self.step, "entered": _pack(self.entered), "finished": _pack(self.finished)}
        try:
            self.store.set(f"{KEY}{self.rank}", json.dumps(record, separators=(",", ":")))
        except RuntimeError:
            pass  # the store is gone: the collective itself will fail and say so

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
            records = {m: self._read(m) for m in suspects}
        except RuntimeError:
            self.culprits = [0] if not self.hosts_store and 0 in suspects else []
            return (" — the job's store does not answer; under plait's spawner, srun and mpirun rank 0 "
                    "hosts it, so rank 0 is probably the one stopped or stuck")
        if entry.peer is not None:
            self.culprits = [entry.peer]
            return f" — {_whereabouts(entry.peer, records[entry.peer])}"
        missing = [m for m, rec in records.items() if rec is None or rec["seq"].get(entry.axis, 0) < entry.seq]
        self.culprits = missing
        if not missing:
            return " — every rank of the group entered it; one may have died inside it"
        names = ", ".join(map(str, missing))
        lines = "; ".join(_whereabouts(m, records[m]) for m in missing)
        return f" — rank{'s' if len(missing) > 1 else ''} {names} never entered {entry.describe()}: {lines}"

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
        timeouts; the culprits are not waited for (they will never answer)."""
        if not self.hosts_store:
            return
        waiting = [f"{DONE}{r}" for r in range(self.world_size) if r != self.rank and r not in self.culprits]
        deadline = time.monotonic() + LINGER_S
        while waiting and time.monotonic() < deadline:
            try:
                waiting = [key for key in waiting if not self.store.check([key])]
            except RuntimeError:
                return
            time.sleep(0.1)


def _pack(entry: Entry | None) -> list[Any] | None:
    return None if entry is None else [entry.op, entry.axis, entry.seq, entry.step, entry.peer]


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
