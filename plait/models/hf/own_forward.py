"""A pipeline stage that runs the causal LM's own forward, with the other stages' layers stepped over.

plait's usual stage (models/hf/stages.py) does around its layers what a base model's forward
does: positions, rotary angles, causal masks. Many forwards do more: ALiBi biases (MPT,
BLOOM), learned position embeddings added to the token ones (GPT-Neo, BioGPT), projections
in and out (OPT), a mask the indexer must have made (DeepSeek-V3.2), scalings of their own
(Beam's NoPE layers), a head over widened streams (hyper-connections). A stage that remakes
them by rule refuses each.

This stage makes none of them. Every stage runs the model's own forward on a shell of the
model: its own classes and plain attributes, the pieces the stage holds, and in place of
what it does not hold:

- a block another stage holds is stepped over: it hands its hidden states on untouched
  (`_Slot`), with the block's plain attributes (its `attention_type`) for the forward to read;
- a piece before the blocks that another stage holds (the embedding, on a later stage) gives
  zeros of its output's shape: they run the forward's start, masks and angles, and are
  dropped, since the stage's hidden states enter at its first block;
- on every stage but the last the forward stops after the stage's last block, and its
  output is the stage's.

So a later stage makes its masks, angles and biases from the micro-batch's own token ids,
which plait's pipeline runner hands every stage (every pipeline rank holds them), and a layer
that reads the ids (DeepSeek-V4's hash router) reads them there too. What the forward makes
before the blocks then holds on every stage. `check` proves the rest, before the first cut:
the model is run cut after every block, stage by stage, and must give exactly its own logits
(a forward that hands a later layer more than the hidden states, as Zamba's hands on its
embeddings, differs), and run so in training mode (RWKV's rescales every block's weights).

Not under context parallelism: the forward makes its own positions, and under cp each rank
holds other ones.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from plait.errors import PlaitError
from plait.models.hf.stages import HINT, first_output, placed_pieces, probe_length
from plait.models.hf.styles import probe_ids
from plait.parallel.packed import forward_parameters
from plait.parallel.probe import first_line, quiet
from plait.parallel.seam import Parts, StageView
from plait.parallel.tensor.plan import tensor_parallel_of


class _StageDone(BaseException):
    """Raised after a stage's last block on every stage but the last: its output is the stage's.
    A BaseException, so that a forward's own `except Exception` does not swallow it."""

    def __init__(self, hidden: Any):
        super().__init__("stage done")
        self.hidden = hidden


@dataclass
class _Skeleton:
    """A module on the path to the pieces: its class and plain state, without its children
    (those that are None, as OPT's absent projections are, stay None)."""

    cls: type
    state: dict[str, Any]
    children: list[str]
    empty: set[str]


@dataclass
class _Shape:
    """What a piece before the blocks gives, for its stand-in: the shape past (batch, seq)."""

    tail: tuple[int, ...]
    floating: bool


class _Entering:
    """The hidden states a stage takes in, for the one forward in flight (its slots read them)."""

    x: torch.Tensor | None = None


@dataclass
class _Shell:
    """A stage's shell, built once: its root, the modules whose training flag follows the stage's,
    where its hidden states enter, and what it was built from (rebuilt when that changes)."""

    root: nn.Module
    flagged: list[nn.Module]
    entering: _Entering
    built_from: tuple


@dataclass
class OwnForward:
    """The stages of one model, each running the model's own forward (see the module docstring)."""

    parts: Parts
    skeletons: dict[str, _Skeleton]
    block_state: list[dict[str, Any]]  # each block's plain attributes (`attention_type`, `layer_idx`)
    outputs: dict[str, _Shape] = field(default_factory=dict)  # the pieces before the blocks
    tuple_len: int = 0  # a block's output: a tensor (0), or a tuple of that many, hidden states first
    shells: "weakref.WeakKeyDictionary[Any, _Shell]" = field(default_factory=weakref.WeakKeyDictionary)

    @classmethod
    def of(cls, real: nn.Module, parts: Parts) -> "OwnForward":
        """The stages of `real` (a model with values: the model, or its probe copy, whose buffers
        hold values) cut as `parts` says: nothing is run (`for_model` gives them to the model)."""
        names = [*parts.first, *parts.last, *parts.shared, parts.blocks]
        paths = {""} | {name.rsplit(".", 1)[0] if "." in name else "" for name in names}
        paths |= {".".join(path.split(".")[:i]) for path in list(paths) for i in range(1, path.count(".") + 1)}
        skeletons = {path: _skeleton(real.get_submodule(path)) for path in paths}
        return cls(parts, skeletons, [_plain(block) for block in real.get_submodule(parts.blocks)])

    def for_model(self, model: nn.Module) -> "OwnForward":
        """These stages, checked on the probe copy, for `model` itself: its own blocks' attributes
        (the copy may hold fewer blocks), the same shells and shapes otherwise."""
        return replace(self, block_state=[_plain(block) for block in model.get_submodule(self.parts.blocks)],
                       shells=weakref.WeakKeyDictionary())

    def learn_shapes(self, real: nn.Module, ids: torch.Tensor) -> torch.Tensor | None:
        """What the pieces before the blocks and a block give, from one forward of `real`; its logits."""
        seen: dict[str, Any] = {}
        hooks = [real.get_submodule(name).register_forward_hook(
            lambda module, args, out, name=name: seen.setdefault(name, out)) for name in self.parts.first]
        hooks.append(real.get_submodule(self.parts.blocks)[0].register_forward_hook(
            lambda module, args, out: seen.setdefault("", out)))
        try:
            with quiet(real):
                logits = getattr(real(input_ids=ids), "logits", None)
        finally:
            for hook in hooks:
                hook.remove()
        for name in self.parts.first:
            out = first_output(seen.get(name))
            if isinstance(out, torch.Tensor) and out.dim() >= 2:
                self.outputs[name] = _Shape(tuple(out.shape[2:]), out.is_floating_point())
        block_out = seen.get("")
        self.tuple_len = len(block_out) if isinstance(block_out, tuple) else 0
        return logits

    def __call__(self, stage: StageView, x: torch.Tensor) -> torch.Tensor:
        """Ids (first stage) or hidden states in; hidden states or logits (last stage) out. A
        later stage runs the forward on the micro-batch's own token ids, which plait's pipeline
        runner hands every stage (`token_ids`)."""
        ids = x if stage.is_first else getattr(stage, "token_ids", None)
        if not isinstance(ids, torch.Tensor) or ids.shape[0] != x.shape[0]:
            raise PlaitError("a pipeline stage that runs its model's own forward needs the micro-batch's token ids",
                             hint="run the stages through plait's pipeline runner (PipelineRunner), which hands "
                                  "them to every stage")
        ids = ids.to(x.device)  # the runner hands them as the step has them: moved only where a stage reads them
        shell = self._shell_of(stage, x)
        training = getattr(stage, "training", None)
        training = next((b.training for b in stage.held_blocks()), False) if training is None else training
        for module in shell.flagged:
            module.training = training
        kwargs: dict[str, Any] = {"use_cache": False}
        if "output_router_logits" in forward_parameters(type(shell.root)):
            kwargs["output_router_logits"] = False
        packed = getattr(stage, "packed", None)
        if packed is not None:
            kwargs["position_ids"] = packed.positions
        shell.entering.x = None if stage.is_first else x
        try:
            out = type(shell.root).forward(shell.root, input_ids=ids, **kwargs)
        except _StageDone as done:
            return done.hidden
        finally:
            shell.entering.x = None
        logits = getattr(out, "logits", None)
        return first_output(out) if logits is None else logits

    def _shell_of(self, stage: StageView, x: torch.Tensor) -> _Shell:
        """The stage's shell, built on its first forward and again when what it holds changes."""
        held = [stage.held(name) for name in (*self.parts.first, *self.parts.last, *self.parts.shared)]
        built_from = (tuple(id(m) for m in held), tuple(id(b) for b in stage.held_blocks()), x.device, x.dtype)
        shell = self.shells.get(stage)
        if shell is None or shell.built_from != built_from:
            entering, flagged = _Entering(), []
            root = self._shell("", stage, x, entering, flagged)
            shell = self.shells[stage] = _Shell(root, flagged, entering, built_from)
        return shell

    def _shell(self, path: str, stage: StageView, x: torch.Tensor, entering: _Entering,
               flagged: list[nn.Module]) -> nn.Module:
        """The module at `path` as this stage holds it: its class and state, its children held,
        stepped over or stood in for."""
        skeleton = self.skeletons[path]
        shell = object.__new__(skeleton.cls)
        vars(shell).update(skeleton.state)
        buffers = {key: None if value is None else value.to(x.device) for key, value in skeleton.state["_buffers"].items()}
        children: dict[str, Any] = {}
        for child in skeleton.children:
            full = f"{path}.{child}" if path else child
            if child in skeleton.empty:
                children[child] = None
            elif full == self.parts.blocks:
                children[child] = self._slots(stage, entering)
            elif full in self.skeletons:
                children[child] = self._shell(full, stage, x, entering, flagged)
            else:
                held = stage.held(full)
                children[child] = held if held is not None else _Absent(self.outputs.get(full), x.dtype)
        vars(shell).update(_parameters={}, _buffers=buffers, _modules=children)
        flagged.append(shell)
        return shell

    def _slots(self, stage: StageView, entering: _Entering) -> nn.ModuleList:
        """One slot per block of the model: this stage's blocks run, the others are stepped over."""
        held = stage.held_blocks()
        start, end, n = stage.first_layer, stage.first_layer + len(held), len(self.block_state)
        later, last = not stage.is_first, stage.is_last
        return nn.ModuleList(
            _Slot(held[i - start] if start <= i < end else None, self.block_state[i], self.tuple_len, entering,
                  enter=later and i == start, enter_after=later and start == n and i == n - 1,
                  stop=not last and i == end, stop_after=not last and end == n and i == n - 1)
            for i in range(n))

    def check(self, real: nn.Module, ids: torch.Tensor) -> None:
        """Learn the shapes (`learn_shapes`) of `real` (self's model, or its probe copy); refuse
        unless, cut after every block, it gives exactly its own logits, stage by stage, in eval
        mode, and runs so in training mode."""
        name = type(real).__name__
        blocks = len(real.get_submodule(self.parts.blocks))
        own = self.learn_shapes(real, ids)
        with quiet(real):
            try:
                x = self._cut_after_each(real, ids, blocks)
                real.train()  # a forward may take another path in training (RWKV's rescaling reads every block)
                self._cut_after_each(real, ids, blocks)
            except Exception as error:  # noqa: BLE001 - a forward that cannot be cut is a refusal
                raise PlaitError(f"pp: {name}'s own forward fails when cut after each layer on a few test tokens "
                                 f"({type(error).__name__}: {first_line(error)}), so plait cannot cut it",
                                 hint=HINT) from None
        if own is None or own.shape != x.shape or not torch.equal(own, x):
            raise PlaitError(f"pp: {name}'s forward, cut after each layer, does not give its own logits on a few "
                             "test tokens (it reads more than the hidden states between its layers), so plait "
                             "cannot cut it", hint=HINT)

    def _cut_after_each(self, real: nn.Module, ids: torch.Tensor, blocks: int) -> torch.Tensor:
        info = tensor_parallel_of(real)
        split = info.axis.size if info is not None and info.sp else 1  # hidden states hold seq / tp under SP
        x = ids
        for index in range(blocks):
            x = self(_ProbeStage(real, self.parts, index, blocks, split, ids), x)
        return x


class _Slot(nn.Module):
    """Block i of the model on one stage: the stage's own block, or a step over another stage's;
    it takes the stage's hidden states in where they enter, and stops the forward where they leave."""

    def __init__(self, block: nn.Module | None, state: dict[str, Any], tuple_len: int, entering: _Entering, *,
                 enter: bool, enter_after: bool, stop: bool, stop_after: bool):
        super().__init__()
        vars(self).update({key: value for key, value in state.items() if key not in vars(self)})
        self.block, self.tuple_len, self.entering = block, tuple_len, entering
        self.enter, self.enter_after, self.stop, self.stop_after = enter, enter_after, stop, stop_after

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if self.enter:
            hidden = self.entering.x
            args, kwargs = ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})
        if self.stop:
            raise _StageDone(hidden)
        out = self.block(*args, **kwargs) if self.block is not None else self._stepped(hidden)
        if self.enter_after:
            out = self._stepped(self.entering.x)
        if self.stop_after:
            raise _StageDone(first_output(out))
        return out

    def _stepped(self, hidden: torch.Tensor) -> Any:
        return (hidden, *([None] * (self.tuple_len - 1))) if self.tuple_len else hidden


class _Absent(nn.Module):
    """A piece before the blocks that another stage holds: zeros of its output's shape."""

    def __init__(self, shape: _Shape | None, dtype: torch.dtype):
        super().__init__()
        self.shape, self.dtype = shape, dtype

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.shape is None:
            raise PlaitError("a stage ran a piece another stage holds, after its blocks")
        lead = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        return torch.zeros(*lead.shape[:2], *self.shape.tail, device=lead.device,
                           dtype=self.dtype if self.shape.floating else torch.long)


class _ProbeStage:
    """The StageView of stage `index` of a model cut after every block (`OwnForward.check`)."""

    packed = None

    def __init__(self, model: nn.Module, parts: Parts, index: int, num_stages: int, seq_split: int,
                 token_ids: torch.Tensor):
        self.model, self.parts, self.index, self.num_stages, self.first_layer = model, parts, index, num_stages, index
        self.seq_split, self.token_ids, self.training = seq_split, token_ids, model.training
        self.is_first, self.is_last = index == 0, index == num_stages - 1

    def held(self, name: str) -> Any:
        if name in self.parts.shared or (name in self.parts.first and self.is_first) or (
                name in self.parts.last and self.is_last):
            return self.model.get_submodule(name)
        return None

    def held_blocks(self) -> list[nn.Module]:
        return [self.model.get_submodule(self.parts.blocks)[self.index]]

    def context_positions(self, seq: int, device: torch.device) -> None:
        return None


def own_parts(model: nn.Module, plan: dict[str, Any], real: nn.Module, until_blocks: bool = False) -> Parts:
    """The cut `plan` names, for stages that run the model's own forward: its pieces, and each
    module with parameters the plan leaves out (a head beside the final norm, per-layer
    embeddings), go before the blocks or after them as the forward runs them on `real` (OPT
    registers its final norm before its layers); one the forward never runs, as it is
    registered. Whether the forward agrees is `OwnForward.check`'s to say. `until_blocks`
    stops the forward as it enters the first block and puts every piece it has not run after
    the blocks: the shape's reading on meta (models/hf/load.py), where a forward through a
    large model's blocks costs seconds and grouped experts do not run in fp32."""
    name = type(model).__name__
    order, placed, blocks = placed_pieces(model, plan)
    pieces, shared = [key for key in placed if key != blocks], []
    stack = [""]
    while stack:
        path = stack.pop(0)
        module = model.get_submodule(path)
        if any(True for _ in module.parameters(recurse=False)):
            raise PlaitError(f"pp: {name}'s {path or 'model itself'} holds parameters of its own beside its "
                             "layers, so no stage can hold it", hint=HINT)
        for child_name, child in module.named_children():
            full = f"{path}.{child_name}" if path else child_name
            if full in placed:
                continue
            if any(key.startswith(f"{full}.") for key in placed):
                stack.append(full)
            elif any(True for _ in child.parameters()):
                pieces.append(full)
            else:
                shared.append(full)
    before = _run_before_blocks(real, pieces, blocks, until_blocks)
    pieces.sort(key=order.get)
    return Parts(blocks=blocks, first=tuple(k for k in pieces if before.get(k, order[k] < order[blocks])),
                 last=tuple(k for k in pieces if not before.get(k, order[k] < order[blocks])), shared=tuple(shared))


class _BlocksEntered(Exception):
    """Raised by the first block's pre-hook to stop a forward there (`_run_before_blocks`)."""


def _run_before_blocks(real: nn.Module, pieces: list[str], blocks: str,
                       until_blocks: bool = False) -> dict[str, bool]:
    """{piece: whether the forward first runs it before its first block}, for the pieces one
    forward of `real` on a few tokens runs; with `until_blocks`, for every piece, the forward
    stopped as it enters the first block."""
    seen: list[str] = []

    def entered(module: nn.Module, args: Any) -> None:
        seen.append("")
        if until_blocks:
            raise _BlocksEntered

    hooks = [real.get_submodule(piece).register_forward_pre_hook(lambda module, args, piece=piece: seen.append(piece))
             for piece in pieces]
    hooks.append(real.get_submodule(blocks)[0].register_forward_pre_hook(entered))
    try:
        with quiet(real):
            real(input_ids=probe_ids(real, probe_length(real)))
    except _BlocksEntered:
        pass
    finally:
        for hook in hooks:
            hook.remove()
    first = seen.index("") if "" in seen else len(seen)
    if until_blocks:
        return {piece: piece in seen[:first] for piece in pieces}
    return {piece: seen.index(piece) < first for piece in pieces if piece in seen}


def _skeleton(module: nn.Module) -> _Skeleton:
    state = {key: value for key, value in vars(module).items() if key not in ("_modules", "_parameters")}
    state["_buffers"] = dict(state.get("_buffers", {}))  # its own: moved to the stage's device, written by its forward
    return _Skeleton(type(module), state, list(module._modules),
                     {name for name, child in module._modules.items() if child is None})


PLAIN = (str, int, float, bool, type(None))


def _plain(module: nn.Module) -> dict[str, Any]:
    """A module's plain attributes (no parameters, buffers or children), and the plain values its
    class gives (Inkling's `attention_type`, a property elsewhere): what a forward may read of a block."""
    state = {key: value for key, value in vars(module).items() if not key.startswith("_") and key != "training"}
    for cls in type(module).__mro__:
        if cls is nn.Module:
            break
        for key, value in vars(cls).items():
            if key.startswith("_") or key in state or not isinstance(value, (property, *PLAIN)):
                continue
            try:
                read = getattr(module, key)
            except Exception:  # noqa: BLE001 - a property that cannot be read here is not kept
                continue
            if isinstance(read, PLAIN):
                state[key] = read
    return state
