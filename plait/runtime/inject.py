"""Fault injection, for the tests that prove plait survives faults (and for users who want to
rehearse one): PLAIT_INJECT="ATTEMPT:RANK:STEP:SIGNAL[,...]" makes RANK send itself SIGNAL
(KILL, STOP, TERM...) as STEP begins, in the world started after ATTEMPT restarts. STEP =
--steps + 1 is the closing phase of `plait train` (the sample, the weights, the report),
after the last step and its checkpoint. A fifth field `save` ("0:1:10:KILL:save") sends it
instead while RANK writes the checkpoint of step STEP, after its tensors are in the file and
before the checkpoint is published (in the background thread under --async-save).

Read at each step's start; nothing happens unless the variable is set.

`--inject bitflip:rank=R,step=S` (`parse_bitflip`) rehearses silent data corruption instead:
plait.parallel.replicas flips one bit of a weight, which --check-replicas must catch.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable

from plait.errors import PlaitError
from plait.runtime import console

VARIABLE = "PLAIT_INJECT"
HANG = "HANG"
PHASES = ("step", "save")


def parse(spec: str) -> list[tuple[int, int, int, signal.Signals | str, str]]:
    """"0:2:7:KILL,1:0:9:STOP:save" -> [(attempt, rank, step, signal, phase), ...]."""
    faults = []
    for item in filter(None, spec.split(",")):
        try:
            attempt, rank, step, name, *phase = item.split(":")
            what = HANG if name.upper() == HANG else signal.Signals[f"SIG{name.upper()}"]
            if len(phase) > 1 or (phase and phase[0] not in PHASES):
                raise ValueError
            faults.append((int(attempt), int(rank), int(step), what, phase[0] if phase else "step"))
        except (ValueError, KeyError):
            raise PlaitError(f"{VARIABLE} item {item!r} is not ATTEMPT:RANK:STEP:SIGNAL[:save]",
                             hint="e.g. 0:2:7:KILL kills rank 2 as step 7 begins, before any restart") from None
    return faults


def maybe_inject(rank: int, step: int, before: Callable[[], Any] | None = None, phase: str = "step") -> None:
    """Send the injected signal to this process if this rank, step and attempt match.

    `before` runs first: the flight recorder publishes its record there, so a rehearsal shows
    exactly where the rank stopped (a real fault leaves a record up to a second old)."""
    spec = os.environ.get(VARIABLE)
    if not spec:
        return
    attempt = int(os.environ.get("PLAIT_RESTART", "0"))
    for when, who, at, sig, where in parse(spec):
        if (when, who, at, where) == (attempt, rank, step, phase):
            if before is not None:
                before()
            name = sig if sig == HANG else sig.name
            console.say(f"plait: injected fault: rank {rank} sends itself {name} at step {step}"
                        f"{' while saving' if phase == 'save' else ''} (t={time.time():.3f})")
            if sig == HANG:
                while True:
                    time.sleep(3600)
            os.kill(os.getpid(), sig)


def parse_bitflip(spec: str) -> tuple[int, int]:
    """"bitflip:rank=R,step=S" -> (R, S); one PlaitError otherwise."""
    try:
        kind, _, rest = spec.partition(":")
        fields = dict(item.split("=", 1) for item in rest.split(","))
        if kind != "bitflip" or set(fields) != {"rank", "step"}:
            raise ValueError
        rank, step = int(fields["rank"]), int(fields["step"])
        if rank < 0 or step < 1:
            raise ValueError
    except ValueError:
        raise PlaitError(f"--inject {spec!r} is not bitflip:rank=R,step=S",
                         hint="e.g. --inject bitflip:rank=1,step=3 flips one bit of a weight on rank 1 as step 3 "
                              "begins") from None
    return rank, step
