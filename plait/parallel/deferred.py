"""A model built on the meta device whose initial weights can still be drawn, one tensor at a time.

Building a model on the meta device costs no memory, but it also draws no weights: the
random numbers a one-process build would have drawn are gone. `build_deferred` runs the
model's own constructor (its initialisation included: nn.Linear's, GPT's, transformers'
`_init_weights`) on the meta device under a dispatch mode that writes down, per storage,
what filled it: the op, its arguments, and the state of torch's generator just before each
random draw. A random draw is also run once on a real scratch tensor of the same shape, so
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
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from plait.errors import PlaitError

aten = torch.ops.aten

# Ops that set every element they write without reading it: the history before such an op on
# a whole storage does not matter for the values (only for the generator, which is recorded).
_OVERWRITES = {aten.uniform_.default, aten.normal_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default,
               aten.random_.default, getattr(aten.random_, "from"), aten.random_.to, aten.exponential_.default,
               aten.geometric_.default, aten.cauchy_.default, aten.log_normal_.default, aten.copy_.default,
               aten.bernoulli_.float}


class CannotDefer(PlaitError):
    """This build cannot be replayed from the meta device; the caller builds the model whole."""


_RECORDING: list[bool] = []  # one entry per build_deferred running (not a setting: a fact of the call stack)


def recording() -> bool:
    """Whether a meta build is running: a family whose build loads weights leaves that to
    its source then (plait.models.hf.weights), building from its config alone."""
    return bool(_RECORDING)


@dataclass(frozen=True)
class Ref:
    """A meta tensor as an op saw it: its storage, the storage's version then, and the view."""

    key: int
    version: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass
class Entry:
    """One op in a storage's history: it made the storage (`output` >= 0, which of its
    outputs) or wrote into it (`target`, the view it wrote)."""

    func: Any
    args: tuple
    kwargs: dict
    rng: torch.Tensor | None = None  # the CPU generator's state just before a random op
    output: int = -1
    target: Ref | None = None


@dataclass
class History:
    """Everything that filled one storage, in order; `start`: the last whole overwrite."""

    entries: list[Entry] = field(default_factory=list)
    start: int = 0


def _ref(t: torch.Tensor, histories: dict[int, History]) -> Ref:
    key = t.untyped_storage()._cdata
    return Ref(key, len(histories[key].entries), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)


def _covers(t: torch.Tensor) -> bool:
    """Whether `t` views every byte of its storage, once each."""
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())


def _random(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


class _OnMeta(TorchFunctionMode):
    """torch.device("meta") as a context, except that a tensor made from data (`torch.tensor(3.0)`)
    is made on the host and then copied to meta, so the recorder sees its values (the device
    context makes it on meta directly, past the dispatcher, and the values are lost)."""

    FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self.FROM_DATA and kwargs.get("device") is None:
            return func(*args, **kwargs).to("meta")
        if func in _device_constructors() and kwargs.get("device") is None:
            kwargs["device"] = torch.device("meta")
        return func(*args, **kwargs)


class _Recorder(TorchDispatchMode):
    """Runs every op on the meta device and writes the histories of the storages it makes."""

    def __init__(self) -> None:
        super().__init__()
        self.histories: dict[int, History] = {}
        self.constants: list[torch.Tensor] = []  # keeps the host tensors an op read alive
        # Every storage made is kept alive, so its address (the key) is never given to another.
        self.alive: list[torch.Tensor] = []
        self.scratch = torch.empty(0, dtype=torch.uint8)  # what random draws run on (_draw_scratch)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if kwargs.get("generator") is not None:
            raise CannotDefer("a model's initialisation draws from its own torch.Generator",
                             hint="it is built whole instead (the meta build replays torch's default generator)")
        written = self._written(func, args, kwargs)
        rng = torch.random.get_rng_state() if _random(func) else None
        if rng is not None:  # move the generator as the real draw would, on a scratch tensor
            self._draw_scratch(func, args, kwargs)
        # A draw into a meta tensor changes nothing there, so it is not run.
        drawn_in_place = rng is not None and len(written) == 1 and args and written[0] is args[0]
        out = args[0] if drawn_in_place else func(*args, **kwargs)
        refs = self._refs((args, kwargs), func)
        for target in written:
            history = self.histories.get(target.untyped_storage()._cdata)
            if history is None:
                continue  # a tensor made outside the build (not on meta): not the model's
            if func in _OVERWRITES and _covers(target) and not _reads_itself(func, args, target):
                history.start = len(history.entries)
            history.entries.append(Entry(func, *refs, rng=rng, target=_ref(target, self.histories)))
        if not written:
            self._made(func, out, refs, rng)
        return out

    def _written(self, func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The meta tensors `func` writes into (its mutable arguments)."""
        out = []
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            if isinstance(value, torch.Tensor) and value.is_meta:
                out.append(value)
        return out

    def _made(self, func: Any, out: Any, refs: tuple, rng: torch.Tensor | None) -> None:
        """Storages `func` created (not views of storages it was given) start their history."""
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        for index, tensor in enumerate(outputs):
            if not isinstance(tensor, torch.Tensor) or not tensor.is_meta:
                continue
            key = tensor.untyped_storage()._cdata
            if key in self.histories:
                continue  # a view, or an op that returned its input
            self.alive.append(tensor)
            self.histories[key] = History([Entry(func, *refs, rng=rng, output=index)])
            # How the storage was made: replays that start later allocate it the same way.
            self.histories[key].entries[0].target = Ref(key, 0, tuple(tensor.shape), tuple(tensor.stride()),
                                                        tensor.storage_offset(), tensor.dtype)

    def _refs(self, tree: Any, func: Any) -> tuple:
        def one(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if value.is_meta:
                    if value.untyped_storage()._cdata not in self.histories:
                        raise CannotDefer(f"a model's initialisation read a meta tensor made outside its build ({func})",
                                         hint="it is built whole instead")
                    return _ref(value, self.histories)
                constant = value.detach().clone()  # a host value the build read (a table, a scalar)
                self.constants.append(constant)
                return constant
            return value

        args, kwargs = tree_map(one, tree)
        return tuple(args), dict(kwargs)

    def _draw_scratch(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Run a random op once on host tensors shaped as its meta arguments (values do not
        matter: only the generator's advance does, which depends on shapes and dtypes). The
        tensor drawn into is a view of one reused buffer: a fresh tensor per draw leaves the
        host allocator holding about the model's size in freed pieces it never returns."""
        target = args[0] if args and isinstance(args[0], torch.Tensor) and args[0].is_meta else None

        def scratch(value: Any) -> Any:
            if value is target:
                return self._scratch_view(value)
            if isinstance(value, torch.Tensor) and value.is_meta:
                return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype).fill_(0.5)
            return value

        with torch.utils._python_dispatch._disable_current_modes():
            func(*tree_map(scratch, args), **tree_map(scratch, {**kwargs, "device": torch.device("cpu")}
                                                        if "device" in kwargs else kwargs))

    def _scratch_view(self, like: torch.Tensor) -> torch.Tensor:
        """A host tensor with `like`'s shape, strides and offset, in the reused scratch buffer."""
        extent = like.storage_offset() + sum((n - 1) * st for n, st in zip(like.shape, like.stride())) + 1
        needed = extent * like.element_size() if like.numel() else 0
        if self.scratch.numel() < needed:
            self.scratch = torch.empty(0, dtype=torch.uint8)  # the old one goes before the new one comes
            self.scratch = torch.empty(needed, dtype=torch.uint8)
        flat = self.scratch[:needed].view(like.dtype) if needed else torch.empty(0, dtype=like.dtype)
        return flat.as_strided(like.shape, like.stride(), like.storage_offset())


def _reads_itself(func: Any, args: tuple, target: torch.Tensor) -> bool:
    """copy_ from a view of the same storage reads what it overwrites."""
    return func is aten.copy_.default and isinstance(args[1], torch.Tensor) and args[1].is_meta and (
        args[1].untyped_storage()._cdata == target.untyped_storage()._cdata)


class Deferred:
    """The recorded build of one model: draws any of its tensors, as the one-process build made
    it, by the tensor or by its name in the model as built (`draw_named`), which the strategies
    keep (plait.parallel.pipeline.split.logical_parameters)."""

    def __init__(self, histories: dict[int, History], constants: list[torch.Tensor], model: nn.Module):
        self._histories, self._constants = histories, constants
        self._named = {name: _ref(t, histories) for name, t in _tensors(model)}

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
        return self._draw(_ref(tensor, self._histories))

    def _draw(self, ref: Ref) -> torch.Tensor:
        """Replays leave torch's generator as they found it (the run seeds its own draws). A
        tensor that is its whole storage is returned as replayed, without a copy."""
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            base = self._replay(ref.key, ref.version, {})
            view = self._view(base, ref)
            whole = view.is_contiguous() and view.storage_offset() == 0 and \
                view.numel() * view.element_size() == base.untyped_storage().nbytes()
            return view if whole and not self._is_constant(base) else view.clone()

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
    recorder = _Recorder()
    _RECORDING.append(True)
    try:
        with _OnMeta(), recorder:
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
