"""What filled each tensor of a model built on the meta device: the recorder behind plait.parallel.deferred.

A dispatch mode (`Recorder`) runs every op on the meta device and writes, per storage, the
ops that made and wrote it, with the CPU generator's state before each random draw (the draw
itself runs once on a reused host buffer, so the generator moves as in a real build). A
function mode (`OnMeta`) puts the build on the meta device, except that a tensor made from
data is made on the host first, so its values are recorded. plait.parallel.deferred replays
these histories; this module only writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
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


def ref_of(t: torch.Tensor, histories: dict[int, History]) -> Ref:
    """`t` (a recorded meta tensor) as an op sees it now: its storage's version and its view."""
    key = t.untyped_storage()._cdata
    return Ref(key, len(histories[key].entries), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)


def covers(t: torch.Tensor) -> bool:
    """Whether `t` views every byte of its storage, once each."""
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())


def _random(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


class OnMeta(TorchFunctionMode):
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


class Recorder(TorchDispatchMode):
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
            if func in _OVERWRITES and covers(target) and not _reads_itself(func, args, target):
                history.start = len(history.entries)
            history.entries.append(Entry(func, *refs, rng=rng, target=ref_of(target, self.histories)))
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
                    return ref_of(value, self.histories)
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
