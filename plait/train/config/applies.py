"""A flag that does not apply to the run is refused, never ignored.

`--cp-kind ulysses` without `--cp`, `--fp8-scaling rowwise` in bf16, `--augment crop` on a
language model: each would be accepted and then do nothing, and the user would believe the
run used it. One table says, for each such setting, when it means something; a value other
than its default outside that is one PlaitError naming the flag and what it needs. Settings
only some model families read are the family's to claim (`Family.reads`). The layout's own
settings (ZeRO-3's prefetch, the virtual stages, offload) are the layout's rules
(plait.rules), which the estimator shares.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from plait.errors import PlaitError

# field: (whether the run uses it, what it needs, said in the error)
NEEDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "cp_kind": (lambda c: c.layout.cp > 1, "--cp 2 or more"),
    "fp8_scaling": (lambda c: c.precision == "fp8", "--precision fp8"),
    "loss_scale": (lambda c: c.precision == "fp16", "--precision fp16 (the other precisions scale no loss)"),
    "schedule": (lambda c: c.layout.pp > 1, "--pp 2 or more"),
    "reduce_dtype": (lambda c: c.layout.dp * c.layout.cp > 1, "data-parallel ranks (dp × cp above 1) to reduce over"),
    "min_nproc": (lambda c: c.max_restarts > 0, "--max-restarts 1 or more"),
    "keep_checkpoints": (lambda c: c.save_every > 0, "--save-every N"),
    "async_save": (lambda c: c.save_every > 0, "--save-every N"),
}
# read by some families only (`--sample-tokens 0`, no sample, is true of every family: not here)
FAMILY_FIELDS = ("augment", "sync_bn", "packing", "doc_mask", "prompt")


def check_applies(config: Any, family: Any) -> None:
    """One PlaitError for the first setting given a value it cannot use in this run."""
    defaults = {f.name: f.default for f in fields(config)}
    given = [name for name, value in config.to_dict().items() if name in defaults and value != defaults[name]]
    reads = getattr(family, "reads", None)
    for name in given:
        flag = "--" + name.replace("_", "-")
        if name in NEEDS and not NEEDS[name][0](config):
            raise PlaitError(f"{flag} {_shown(getattr(config, name))} does nothing in this run: it needs "
                             f"{NEEDS[name][1]}", hint=f"drop {flag}, or give what it needs")
        if name in FAMILY_FIELDS and reads is not None and name not in reads:
            raise PlaitError(f"{flag} {_shown(getattr(config, name))} does nothing for --model {config.model} "
                             f"({family.name} models do not read it)", hint=f"drop {flag}")


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
