"""A split is checked against the whole model before it trains: exact or refused, never drifting.

A plan says which modules to split, not everything a model does: a module subclass with its
own arithmetic (Gemma's scaled embedding), a layer reading what the split changed... Those
would train a different model in silence. So `parallelize` runs the whole model once on a
probe batch of a few tokens before tensor, expert and context parallelism touch it
(`record`), and the split model on the same batch after (`check`):

- the split model's output is compared with the whole model's, as this rank should hold it
  (its sequence positions under cp and SP, the vocabulary gathered over tp), within the
  split's tolerance (probe_views.TOLERANCE, by the model's dtype);
- where it differs, or the split model raises, the module whose output first differs (or
  that raised) is found from every module's output, in the order the whole model ran them;
- the gradients of every parameter the split leaves whole, of a fixed random weighing of the
  output, are compared too: a small one (norms, biases, learned scalars: up to
  `SMALL_PARAMETER` elements) element by element, a larger one (an embedding or a head left
  whole) through `PROJECTIONS` fixed random ±1 projections, so that any difference moves
  them and none escapes while no large gradient is kept or moved whole. A
  replicated parameter acting on a split activation (Apertus's learned activation scalars
  after a column-split projection) gets a partial gradient on each tp rank: where their sum
  over tp is the whole model's gradient and nothing sums it, plait sums it (a measured fix,
  logged); a gradient that differs otherwise is refused;
- the ranks agree on the verdict (one all-reduce), so every rank refuses with the same one
  line, or none does; a rank whose split model raises refuses at once instead (the others
  may be waiting in a collective of that forward): it ends, and the launcher stops the rest.

The probe costs one forward and backward of the whole model and of the split model, on
`PROBE_TOKENS` tokens (more when cp or SP must divide them), without dropout, compilation or
the random numbers training draws, and leaves no gradient behind; its collectives are counted
as set-up, not training. A model whose adapter gives no probe input (`probe_input`) is not
checked.
"""

from __future__ import annotations

import contextlib
import logging
import zlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait.errors import PlaitError
from plait.parallel.compiled import eager
from plait.parallel.context.plan import context_engaged, context_of, shard_batch
from plait.parallel.tensor.layers import sum_grad_over
from plait.parallel.probe_views import RankView, dtype_of, relative_error, tolerance
from plait.runtime import comm
from plait.runtime.comm import Axis

log = logging.getLogger(__name__)

PROBE_TOKENS = 8
SMALL_PARAMETER = 1 << 22  # gradients compared element by element up to this size (norms, biases, scalars)
PROJECTIONS = 4  # a larger parameter's gradient is compared through this many random ±1 projections
PROJECTION_CHUNK = 1 << 20  # elements projected at a time
GRADIENT_FLOOR = 1e-3  # of the largest small gradient: below it, a gradient is rounding noise
SETUP = comm.SETUP  # the ledger's purpose for what the probe sends
NOT_FOUND = 1 << 30


@dataclass
class Probe:
    """The whole model's outputs on the probe batch: every module's, in the order they ran."""

    inputs: tuple[tuple, dict]
    tokens: int
    order: list[str] = field(default_factory=list)  # module names, each call once, as they finished
    kinds: dict[str, str] = field(default_factory=dict)  # module name -> its class in the whole model
    outputs: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    final: torch.Tensor | None = None
    weights: torch.Tensor | None = None  # the fixed weights of the output whose gradient is taken
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # gradients (or projections: `signature`), by name
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # each compared parameter's shape
    dtype: torch.dtype = torch.float32  # the model's: what its outputs' rounding is measured against
    seconds: float = 0.0


def spread_ids(vocab: int, tokens: int, device: torch.device) -> torch.Tensor:
    """(1, tokens) ids spread over the vocabulary, so every tensor-parallel rank's rows are read."""
    return ((torch.arange(tokens, device=device) * max(1, vocab // tokens) + 1) % vocab).unsqueeze(0)


def probe_tokens(tp_sp: int, cp: int) -> int:
    """Tokens per probe sequence: a few, divisible into cp's 2·cp chunks and each cp rank's
    tokens into the SP degree's slices."""
    return math.lcm(PROBE_TOKENS, 2 * cp, cp * tp_sp)


def record(model: nn.Module, adapter: Any, tokens: int) -> Probe | None:
    """The whole model on a probe batch of `tokens` tokens (None: the adapter gives no input)."""
    make = getattr(adapter, "probe_input", None)
    if not callable(make):
        return None
    start = time.perf_counter()
    probe = Probe(inputs=make(model, tokens), tokens=tokens, dtype=dtype_of(model))
    probe.kinds = {name or "(the model)": type(module).__name__ for name, module in model.named_modules()}
    trained = {name: param for name, param in model.named_parameters() if param.requires_grad}
    with _watching(model, probe.order, probe.outputs), quiet(model, grad=bool(trained)):
        final = _output(model(*probe.inputs[0], **probe.inputs[1]))
        if final is not None and final.requires_grad:
            probe.weights = torch.randn(final.shape, generator=torch.Generator().manual_seed(0))
            grads = torch.autograd.grad(_weighted(final, probe.weights), list(trained.values()), allow_unused=True)
            probe.grads = {name: signature(grad, param, name) for (name, param), grad in zip(trained.items(), grads)}
            probe.shapes = {name: tuple(param.shape) for name, param in trained.items()}
    probe.final = final.detach() if final is not None else None
    probe.seconds = time.perf_counter() - start
    return probe


def check(model: nn.Module, probe: Probe | None, world: Axis, *, tp: Axis, sp: bool, what: str,
          device: torch.device) -> list[str]:
    """Refuse, on every rank alike, a split model whose output on the probe batch is not the
    whole model's, or whose small parameters' gradients are not (see the module docstring);
    a replicated parameter whose gradient is partial over tp gets it summed. `what` names the
    split ("tp 2 + sp"). Returns the names of those parameters."""
    if probe is None:
        return []
    start, before = time.perf_counter(), world.ledger.snapshot()
    order: list[str] = []
    outputs: dict[str, list[torch.Tensor]] = {}
    failed: list[str] = []  # the innermost module that raised, and the error's first line
    context = context_of(model)
    views = RankView(probe.tokens, context, tp, sp, device)
    flags = torch.zeros(len(probe.grads), dtype=torch.int64)
    try:
        with _watching(model, order, outputs, failed), quiet(model, grad=bool(probe.grads)), context_engaged(model):
            args, kwargs = _on(_device_of(model), probe.inputs)
            args, kwargs = _sharded_inputs(model, (args, kwargs)) if context is not None else (args, kwargs)
            final = _output(model(*args, **kwargs))
            flags = _grad_flags(model, probe, final, views)
        final = views.gathered(final.detach() if final is not None else None, probe.final)
        worst = relative_error(final, views.local(probe.final, final) if final is not None else None)
        first = NOT_FOUND if worst <= tolerance(probe.dtype) else _first_different(probe, outputs, views)
    except Exception as error:  # noqa: BLE001 - any failure of the split model is a verdict
        # Refused here, not after agreeing: the other ranks may be inside a collective of the
        # forward this rank left, and would wait for it until the timeout. The rank ends with
        # its one line; the launcher then stops the others at once.
        failed.append(f"{type(error).__name__}: {first_line(error)}")
        first = _index_of(failed[0], probe.order) if len(failed) > 1 else len(probe.order)
        world.ledger.move_since(before, SETUP)
        raise _refusal(model, probe, first, failed, what) from None
    # one max over the world: the least index, the worst flag of each parameter
    verdict = torch.cat([torch.tensor([-first]), flags]).to(device)
    comm.all_reduce(verdict, world, op="max", purpose=comm.CONTROL)
    world.ledger.move_since(before, SETUP)
    first, flags = -int(verdict[0]), verdict[1:].cpu().tolist()
    if first < NOT_FOUND:
        raise _refusal(model, probe, first, failed, what)
    partial = _sum_partial_grads(model, probe, flags, tp, what)
    seconds = probe.seconds + time.perf_counter() - start
    log.info("%s checked against the whole model on a probe of %d tokens in %.2f s", what, probe.tokens, seconds)
    return partial


OK, PARTIAL, DIFFERENT = 0, 1, 2  # a small parameter's gradient after the split


def _grad_flags(model: nn.Module, probe: Probe, final: torch.Tensor | None, views: RankView) -> torch.Tensor:
    """Per small parameter of the whole model (probe.grads' order): OK where the split model's
    gradient is the whole model's, PARTIAL where only its sum over tp is (the parameter acts
    on a split activation and nothing sums its gradient), DIFFERENT otherwise. Parameters the
    split cut (other shapes) are the split's own business, checked through the output."""
    flags = torch.zeros(len(probe.grads), dtype=torch.int64)
    weights = views.weights_for(probe.weights, final)
    if weights is None or not final.requires_grad:
        return flags
    params = dict(model.named_parameters())
    names = [name for name in probe.grads
             if name in params and params[name].requires_grad and tuple(params[name].shape) == probe.shapes[name]]
    if not names:  # every parameter was split (or there are none): the output says it all
        return flags
    grads = torch.autograd.grad(_weighted(final, weights), [params[name] for name in names], allow_unused=True)
    mine = [signature(grad, params[name], name) for name, grad in zip(names, grads)]
    if views.context is not None:  # each cp rank holds some tokens: their sum is the whole batch's
        mine = _summed(mine, views.context.axis, views.device)
    summed = _summed(mine, views.tp, views.device) if views.tp.size > 1 else mine
    index = {name: i for i, name in enumerate(probe.grads)}
    # a gradient that is 0 in theory (a key bias: softmax ignores a constant shift) is rounding
    # noise in both runs: errors are measured against a floor of the gradients' own scale (the
    # elements', and the projections' apart: a projection adds up a whole gradient)
    floors = {projected: GRADIENT_FLOOR * max((grad.abs().max().item() for name, grad in probe.grads.items()
                                               if _projected(probe, name) == projected), default=0.0)
              for projected in (False, True)}
    for name, local, total in zip(names, mine, summed):
        whole, bar, floor = probe.grads[name], tolerance(probe.dtype), floors[_projected(probe, name)]
        if relative_error(local, whole, floor) > bar:
            flags[index[name]] = PARTIAL if relative_error(total, whole, floor) <= bar else DIFFERENT
    return flags


def _sum_partial_grads(model: nn.Module, probe: Probe, flags: list[int], tp: Axis, what: str) -> list[str]:
    """Refuse a parameter whose gradient differs; sum over tp those whose gradient is partial."""
    names = list(probe.grads)
    different = [name for name, flag in zip(names, flags) if flag == DIFFERENT]
    if different:
        raise PlaitError(f"{what} trains another model than {type(model).__name__}: on a probe of {probe.tokens} "
                         f"tokens the gradient of {different[0]} differs from one process's",
                         hint="train it without that split, or give parallelize a plan or an adapter that leaves "
                              "the module whole (docs/tensor.md, plait.parallel.seam)")
    partial = [name for name, flag in zip(names, flags) if flag == PARTIAL]
    params = dict(model.named_parameters())
    for name in partial:
        sum_grad_over(params[name], tp)
    if partial:
        log.info("%s: %s act on split activations and the plan does not sum their gradients over tp: "
                 "plait sums them (measured on the probe)", what, ", ".join(partial))
    return partial


def _weighted(output: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The scalar whose gradient the probe compares: the output weighed by fixed random weights."""
    return (output.float() * weights.to(output.device)).sum()


def _plain(grad: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor:
    return torch.zeros(param.shape) if grad is None else grad.detach().float().cpu()


def signature(grad: torch.Tensor | None, param: torch.Tensor, name: str) -> torch.Tensor:
    """A parameter's gradient as the probe compares it: whole up to SMALL_PARAMETER elements,
    else its PROJECTIONS projections onto fixed pseudo-random ±1 vectors (seeded by the name,
    made on the gradient's device a chunk at a time): linear, so a tp sum of partial gradients
    is the sum of their projections, and any difference moves them."""
    if param.numel() <= SMALL_PARAMETER:
        return _plain(grad, param)
    if grad is None:
        return torch.zeros(PROJECTIONS, dtype=torch.float64)
    flat = grad.detach().reshape(-1)
    keys = torch.arange(PROJECTIONS, device=flat.device, dtype=torch.int64) * 7919 + zlib.crc32(name.encode()) % 65521
    out = torch.zeros(PROJECTIONS, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), PROJECTION_CHUNK):
        piece = flat[start:start + PROJECTION_CHUNK].double()
        index = torch.arange(start, start + piece.numel(), device=flat.device, dtype=torch.int64)
        out += _signs(index, keys) @ piece
    return out.cpu()


def _signs(index: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """(keys, index) of ±1 from an integer hash (every product stays below 2^63)."""
    x = (index[None, :] % (1 << 31) * 1103515245 + index[None, :] // (1 << 31) + keys[:, None] * 12345) & 0x7FFFFFFF
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0x7FFFFFFF
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0x7FFFFFFF
    return ((x ^ (x >> 16)) & 1).double() * 2 - 1


def _projected(probe: Probe, name: str) -> bool:
    return math.prod(probe.shapes[name]) > SMALL_PARAMETER


def _summed(tensors: list[torch.Tensor], axis: Axis, device: torch.device) -> list[torch.Tensor]:
    """Each (CPU) tensor summed over `axis`, in one all-reduce on `device`."""
    if not tensors:
        return tensors
    flat = torch.cat([t.flatten() for t in tensors]).to(device)
    comm.all_reduce(flat, axis, purpose=SETUP)
    flat = flat.cpu()
    return [piece.view(t.shape) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


@contextlib.contextmanager
def quiet(model: nn.Module, grad: bool = False) -> Iterator[None]:
    """A probe forward: eval mode (no dropout), no gradients (unless `grad`), compiled blocks
    run eagerly, and the random generators as they were, so training draws what one process
    draws."""
    modes = [(module, module.training) for module in model.modules()]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    model.eval()
    try:
        with torch.set_grad_enabled(grad), eager(), torch.random.fork_rng(devices=devices):
            yield
    finally:
        for module, mode in modes:
            module.training = mode


@contextlib.contextmanager
def _watching(model: nn.Module, order: list[str], outputs: dict[str, list[torch.Tensor]],
              failed: list[str] | None = None) -> Iterator[None]:
    """Record each module's output tensor as it finishes; `failed` gets the innermost module
    running when an exception escapes."""
    running: list[str] = []

    def enter(name: str) -> Any:
        return lambda *_: running.append(name)

    def leave(name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            running.pop()
            tensor = _output(out)
            if isinstance(tensor, torch.Tensor):
                order.append(name)
                outputs.setdefault(name, []).append(tensor.detach().cpu())
        return hook

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(name or "(the model)")))
        handles.append(module.register_forward_hook(leave(name or "(the model)")))
    try:
        yield
    except Exception:
        if failed is not None and running:
            failed.insert(0, running[-1])
        raise
    finally:
        for handle in handles:
            handle.remove()


def _device_of(model: nn.Module) -> torch.device:
    return next((param.device for param in model.parameters()), torch.device("cpu"))


def _on(device: torch.device, inputs: tuple[tuple, dict]) -> tuple[tuple, dict]:
    """The probe's (args, kwargs) with their tensors on `device` (the split model may have moved)."""
    move = lambda value: value.to(device) if isinstance(value, torch.Tensor) else value  # noqa: E731
    return tuple(move(a) for a in inputs[0]), {key: move(value) for key, value in inputs[1].items()}


def _output(out: Any) -> torch.Tensor | None:
    """The tensor a module returned: itself, its `.logits`, `.last_hidden_state`, or the first of a tuple."""
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        value = getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _sharded_inputs(model: nn.Module, inputs: tuple[tuple, dict]) -> tuple[tuple, dict]:
    """Under cp, this rank's tokens of every (batch, seq) input, as a training step gives them."""
    args, kwargs = inputs
    names = [key for key, value in kwargs.items() if isinstance(value, torch.Tensor)]
    sharded = shard_batch(model, *args, *(kwargs[key] for key in names))
    return tuple(sharded[:len(args)]), {**kwargs, **dict(zip(names, sharded[len(args):]))}


def _first_different(probe: Probe, outputs: dict[str, list[torch.Tensor]], views: RankView) -> int:
    """The index (in the whole model's order) of the first module whose output differs."""
    seen: dict[str, int] = {}
    for index, name in enumerate(probe.order):
        call = seen[name] = seen.get(name, -1) + 1
        whole = probe.outputs[name][call]
        mine = outputs.get(name, [])
        if call >= len(mine):
            continue
        local = views.local(whole, mine[call])
        if local is not None and relative_error(mine[call], local) > tolerance(probe.dtype):
            return index
    return len(probe.order)  # the output differs, and no module's output alone says where


def _index_of(name: str, order: list[str]) -> int:
    """A module of the split model in the whole model's order (or its nearest parent)."""
    while name:
        if name in order:
            return order.index(name)
        name = name.rpartition(".")[0]
    return len(order)


def first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:200] if lines else ""


def _refusal(model: nn.Module, probe: Probe, index: int, failed: list[str], what: str) -> PlaitError:
    name, tokens = type(model).__name__, f"a probe of {probe.tokens} tokens"
    hint = ("train it without that split, or give parallelize a plan or an adapter that leaves the module whole "
            "(docs/tensor.md, plait.parallel.seam)")
    module = probe.order[index] if index < len(probe.order) else None
    where = f"{module} ({probe.kinds.get(module, '?')})" if module else "the model"
    if failed and failed[-1]:
        return PlaitError(f"{what}: {name} fails on {tokens} in {where}: {failed[-1]}; plait refuses to train "
                          "it split", hint=hint)
    if module is None:
        return PlaitError(f"{what} trains another model than {name}: on {tokens} its output differs from one "
                          "process's", hint=hint)
    return PlaitError(f"{what} trains another model than {name}: on {tokens} the output of {where} is the "
                      "first to differ from one process's", hint=hint)
