"""A model built on the meta device whose initial weights can still be drawn, one tensor at a time.

Building a model on the meta device costs no memory, but it also draws no weights: the
random numbers a one-process build would have drawn are gone. `build_deferred` runs the
model's own constructor (its initialisation included: nn.Linear's, GPT's, transformers'
`_init_weights`) on the meta device under a dispatch mode that writes down, per storage,
what filled it: the op, its arguments, and the state of torch's generator just before each
random draw (plait.parallel.meta_record). A random draw is also run once on a real scratch tensor of the same shape, so
the generator moves exactly as in the one-process build and the next draw starts where it
would have.

`Deferred.draw(tensor)` then replays one tensor's history on the CPU: it sets the generator
to each recorded state and reruns the ops, from the last op that overwrote the whole storage
(an earlier draw that was overwritten is not redrawn). The result is the one-process
tensor, bit for bit, whatever slice of it the caller keeps; at most one whole tensor (plus
what it was computed from, such as a rotary table's frequencies) exists at a time.

What cannot be replayed is refused when recorded (a value read on the host, such as
`.item()` on a meta tensor, fails on meta anyway): the caller then builds the model whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from plait.errors import PlaitError
from plait.parallel.meta_record import CannotDefer, Entry, History, OnMeta, Recorder, Ref, covers, ref_of

__all__ = ["CannotDefer", "Deferred", "build_deferred", "is_meta", "recording"]

_RECORDING: list[bool] = []  # one entry per build_deferred running (not a setting: a fact of the call stack)


def recording() -> bool:
    """Whether a meta build is running: a family whose build loads weights leaves that to
    its source then (plait.models.hf.weights), building from its config alone."""
    return bool(_RECORDING)


class Deferred:
    """The recorded build of one model: draws any of its tensors, as the one-process build made
    it, by the tensor or by its name in the model as built (`draw_named`), which the strategies
    keep (plait.parallel.pipeline.split.logical_parameters)."""

    def __init__(self, histories: dict[int, History], constants: list[torch.Tensor], model: nn.Module):
        self._histories, self._constants = histories, constants
        self._named = {name: ref_of(t, histories) for name, t in _tensors(model)}

    def names(self) -> list[str]:
        """Every parameter's and buffer's name in the model as built (a tied one under each name)."""
        return list(self._named)

    def draw_named(self, name: str) -> torch.Tensor:
        """The tensor the model as built held under `name`, with its values, on the CPU."""
        ref = self._named.get(name)
        if ref is None:
            raise PlaitError(f"the model as built has no tensor {name}",
                             hint="a strategy renamed it; materialise by the whole model's names")
        return self._draw(ref)

    def knows(self, tensor: torch.Tensor) -> bool:
        return tensor.is_meta and tensor.untyped_storage()._cdata in self._histories

    def draw(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (a meta parameter or buffer of the recorded model) with its values, on the
        CPU: its storage replayed to the end of the build, viewed as `tensor` views it."""
        if not self.knows(tensor):
            raise PlaitError("a tensor to draw is not part of the recorded build",
                             hint="draw the tensors of the model build_deferred returned")
        return self._draw(ref_of(tensor, self._histories))

    def _draw(self, ref: Ref) -> torch.Tensor:
        """Replays leave torch's generator as they found it (the run seeds its own draws). A
        tensor that is its whole storage is returned as replayed, without a copy."""
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            base = self._replay(ref.key, ref.version, {})
            view = self._view(base, ref)
            return view if covers(view) and not self._is_constant(base) else view.clone()

    def _is_constant(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a host value the build read (an op that returns its input can
        hand one back): the caller must get a copy, or a later draw would see its changes."""
        key = tensor.untyped_storage()._cdata
        return any(c.untyped_storage()._cdata == key for c in self._constants)

    def _replay(self, key: int, version: int, memo: dict) -> torch.Tensor:
        """The storage `key` after its first `version` entries, as a flat byte-exact tensor
        viewed by its first Ref's dtype (a whole storage)."""
        if (key, version) in memo:
            return memo[(key, version)]
        history = self._histories[key]
        made = history.entries[0]
        start = history.start if history.start < version else 0
        if start == 0:
            base = self._run(made, memo)
            base = base[made.output] if isinstance(base, (tuple, list)) else base
            base = base.as_strided(made.target.size, made.target.stride, made.target.offset)
            start = 1
        else:
            base = torch.empty_strided(made.target.size, made.target.stride, dtype=made.target.dtype)
        for entry in history.entries[start:version]:
            self._run(entry, memo, into=base)
        memo[(key, version)] = base
        return base

    def _view(self, base: torch.Tensor, ref: Ref) -> torch.Tensor:
        if base.dtype != ref.dtype:
            base = base.view(ref.dtype) if base.element_size() == torch.empty((), dtype=ref.dtype).element_size() \
                else base.view(torch.uint8).view(ref.dtype)
        return base.as_strided(ref.size, ref.stride, ref.offset)

    def _run(self, entry: Entry, memo: dict, into: torch.Tensor | None = None) -> Any:
        """Rerun one recorded op on host tensors; `into`: the storage it wrote, already built."""

        def real(value: Any) -> Any:
            if isinstance(value, Ref):
                if into is not None and entry.target is not None and value == entry.target:
                    return self._view(into, value)
                return self._view(self._replay(value.key, value.version, memo), value)
            if isinstance(value, torch.device) and value.type == "meta":
                return torch.device("cpu")
            return value

        args, kwargs = tree_map(real, entry.args), tree_map(real, entry.kwargs)
        if entry.rng is not None:
            torch.random.set_rng_state(entry.rng)
        return entry.func(*args, **kwargs)


def build_deferred(build: Callable[[], nn.Module]) -> tuple[nn.Module, Deferred]:
    """`build()` run on the meta device, and what draws its tensors later (`Deferred`).

    Call it where the one-process build would run (after seeding): the generator is left
    where that build leaves it. Raises PlaitError when the build does something that cannot
    be replayed; the caller then builds the model whole."""
    recorder = Recorder()
    _RECORDING.append(True)
    try:
        with OnMeta(), recorder:
            model = build()
    except PlaitError:  # the recorder's own are CannotDefer; any other is the build's verdict on its input
        raise
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        raise CannotDefer(f"the model cannot be built on the meta device: {type(exc).__name__}: {exc}",
                          hint="it is built whole instead") from None
    finally:
        _RECORDING.pop()
    unknown = [name for name, t in _tensors(model) if not (t.is_meta and t.untyped_storage()._cdata in recorder.histories)]
    if unknown:
        raise CannotDefer(f"the meta build left {unknown[0]} off the meta device or out of its record",
                          hint="it is built whole instead")
    return model, Deferred(recorder.histories, recorder.constants, model)


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


def is_meta(model: nn.Module) -> bool:
    """Whether any of `model`'s parameters or buffers is still on the meta device."""
    return any(t.is_meta for _, t in _tensors(model))
