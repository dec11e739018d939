"""Every value of a TrainConfig checked for type and range, naming its key: one PlaitError.

TOML gives typed values (`steps = "10"` is a string, not a number); flags give text. Both go
through here before the dataclass is built, so a wrong value never reaches the code that
would trip over it with a raw TypeError. The ranges live in one table (RANGES); the layout's
degrees and choices are the layout record's (plait.layout, plait.rules), and the checks that
relate fields to each other stay in config.validate.
"""

from __future__ import annotations

import math
import re
from dataclasses import fields
from typing import Any

from plait.errors import PlaitError
from plait.rules import AUGMENTS, FP8_SCALINGS, PACKINGS
from plait.runtime.env import BACKENDS

# field: (lowest allowed, highest allowed or None, whether the lowest itself is allowed)
RANGES: dict[str, tuple[float, float | None, bool]] = {
    "steps": (1, None, True), "micro_batch": (1, None, True), "grad_accum": (1, None, True),
    "seq_len": (1, None, True), "lr": (0, None, False), "min_lr_ratio": (0, 1, True),
    "warmup_steps": (0, None, True), "weight_decay": (0, None, True), "grad_clip": (0, None, True),
    "seed": (0, 2**63 - 1, True), "eval_every": (0, None, True), "eval_samples": (1, None, True),
    "bucket_mb": (0, None, False), "nproc": (1, None, True), "loss_scale": (1, None, True),
    "timeout_s": (0, None, False), "save_every": (0, None, True), "keep_checkpoints": (0, None, True),
    "sample_tokens": (0, 10_000, True), "max_restarts": (0, None, True),
    "min_nproc": (1, None, True), "prefetch": (0, None, True), "check_replicas": (0, None, True),
}
# field: the values it takes (text fields with a fixed set: a typo is refused, never ignored)
CHOICES: dict[str, tuple[str, ...]] = {
    "backend": ("auto", *BACKENDS), "fp8_scaling": FP8_SCALINGS, "augment": ("auto", *AUGMENTS),
    "packing": ("auto", *PACKINGS), "doc_mask": ("auto", "true", "false"),
}
NAMED = ("model", "data", "out")  # text fields that name something: never empty (an empty path is the cwd)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str | int, flag: str = "--max-shard-size") -> int:
    """Bytes from "5GB", "500MB", "2GiB" or a plain count (transformers' units); one error otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]I?B|B)?\s*", str(text), flags=re.IGNORECASE)
    size = int(match.group(1)) * _UNITS[(match.group(2) or "").upper()] if match else 0
    if size <= 0:
        raise PlaitError(f"{flag} {text!r} is not a size", hint=f"give bytes with a unit, e.g. {flag} 5GB (or 500MB)")
    return size


BOOL_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def field_kinds(config_type: type) -> dict[str, tuple[str, bool]]:
    """{field: (base type name, whether None is allowed)} from the dataclass annotations."""
    out = {}
    for f in fields(config_type):
        text = str(f.type).replace(" ", "")
        out[f.name] = (text.split("|")[0], "None" in text)
    return out


def check_values(values: dict[str, Any], config_type: type, source: str) -> dict[str, Any]:
    """Typed, in-range copies of `values`; `source` is "flag" or "config file PATH"."""
    kinds = field_kinds(config_type)
    checked = {}
    for name, value in values.items():
        kind, optional = kinds[name]
        if value is None and optional:
            checked[name] = None
            continue
        value = _typed(name, value, kind, source)
        _in_range(name, value, source)
        if name in NAMED and isinstance(value, str) and not value.strip():
            raise PlaitError(f"{_label(name, source)} is empty", hint=f"name the {name.replace('_', ' ')} to use")
        if name in CHOICES and value not in CHOICES[name]:
            raise PlaitError(f"{_label(name, source)} {value!r} is not one of: {', '.join(CHOICES[name])}",
                             hint=f"e.g. {_label(name, source)} {CHOICES[name][0]}")
        checked[name] = value
    return checked


def _label(name: str, source: str) -> str:
    return f"--{name.replace('_', '-')}" if source == "flag" else f"{source}: {name}"


def _typed(name: str, value: Any, kind: str, source: str) -> Any:
    """The value as `kind`, or a PlaitError saying what was given and what is wanted."""
    if source == "flag" and isinstance(value, str) and kind in ("int", "float"):
        try:
            return int(value) if kind == "int" else float(value)
        except ValueError:
            raise PlaitError(f"{_label(name, source)} {value!r} is not {KINDS[kind]}") from None
    if source == "flag" and isinstance(value, str) and kind == "bool":
        if value.lower() not in BOOL_WORDS:
            raise PlaitError(f"{_label(name, source)} {value!r} is not {KINDS[kind]}", hint=f"write {_label(name, source)} false")
        return BOOL_WORDS[value.lower()]
    ok = {"int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool),
          "bool": isinstance(value, bool), "str": isinstance(value, str)}.get(kind, True)
    if not ok:
        hint = f"write {name} = {value}" if isinstance(value, str) and _looks_numeric(value) else None
        raise PlaitError(f"{_label(name, source)} = {value!r} is {_kind_of(value)}; it must be {KINDS[kind]}", hint=hint)
    return float(value) if kind == "float" else value


def _in_range(name: str, value: Any, source: str) -> None:
    if name not in RANGES or isinstance(value, str):
        return
    low, high, inclusive = RANGES[name]
    label = _label(name, source)
    if isinstance(value, float) and not math.isfinite(value):
        raise PlaitError(f"{label} must be a finite number, got {value}")
    if value < low or (value == low and not inclusive):
        bound = f"at least {low}" if inclusive else f"more than {low}"
        raise PlaitError(f"{label} must be {bound}, got {value}")
    if high is not None and value > high:
        raise PlaitError(f"{label} must be at most {high}, got {value}")


def _kind_of(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a table"}
    return names.get(type(value), f"a {type(value).__name__}")


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
