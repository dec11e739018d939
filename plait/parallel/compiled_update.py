"""AdamW over fp32 masters of 16-bit weights in one compiled pass a tensor (`--optimizer-kernel compiled`).

With 16-bit weights, torch's kernels take three passes over memory to update them: the 16-bit
gradient copied to an fp32 tensor the fused AdamW can read (6 bytes a parameter), the fused
AdamW itself (28: master, both moments and gradient read, three written), and the masters
rounded back into the 16-bit weights (6). That is 40 bytes a parameter, where a plain fp32
loop's update moves 28, and on an H200 it made the 1 B model's update 20 ms against the
plain loop's 14 (benchmarks/RESULTS.md, GPU sections).

One compiled function does it in one pass per tensor: it reads the 16-bit gradient (scaled by
the loss scale's inverse and the clip factor as it reads it), the master and the two moments,
and writes the master, the moments and the rounded 16-bit weight: 28 bytes a parameter, and
no fp32 copy of the gradient is ever allocated.

The arithmetic is torch's AdamW (decoupled decay; bias corrections in fp64), so the state it
steps is torch's own (`step`, `exp_avg`, `exp_avg_sq`), which checkpoints save and load as
ever. Rounding differs from torch's fused kernel in the last bits, as torch's own kernels
differ from each other. Under ZeRO the state is made with the optimizer, each piece's moments
a view of one flat pair a shard, so that the pass runs over a few long runs (consecutive
pieces of one group) rather than one tensor a parameter. Without ZeRO, the first step, and
any step where a tensor has no state or no gradient yet, runs torch's kernel, which makes
the state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from plait.errors import PlaitError


@dataclass
class Slot:
    """One tensor's update: the fp32 master (what the inner optimizer steps), the 16-bit
    weight it is rounded into, and the 16-bit gradient it reads."""

    master: torch.Tensor
    weight: torch.Tensor
    grad: torch.Tensor


@dataclass
class FlatPart:
    """A ZeRO shard stepped as few long runs instead of one tensor a parameter: its flat fp32
    master, 16-bit weight and gradient, and the pieces (views of the master, each a parameter
    of the optimizer) at their bounds. Fewer tensors is fewer launches and guards for the host
    to issue, which bound the per-piece pass's wall time on an H200 (RESULTS.md, GPU section,
    2026-12-04, second)."""

    master: torch.Tensor
    weight: torch.Tensor
    grad: torch.Tensor | None
    pieces: Sequence[torch.Tensor]
    bounds: Sequence[tuple[int, int]]


def unsupported(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the compiled pass cannot stand in for `optimizer`'s step, or None if it can."""
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        return type(optimizer).__name__
    for group in optimizer.param_groups:
        for flag in ("amsgrad", "maximize", "differentiable"):
            if group.get(flag):
                return f"{type(optimizer).__name__} with {flag}"
        if type(optimizer) is torch.optim.Adam and group.get("weight_decay"):
            return "Adam with L2 weight decay"
    return None


def adamw_pass(masters: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
               avgs: Sequence[torch.Tensor], squares: Sequence[torch.Tensor], decays: Sequence[float],
               hyper: torch.Tensor, step: torch.Tensor, beta1: float, beta2: float, eps: float) -> None:
    """AdamW on each (master, weight, grad, exp_avg, exp_avg_sq), in place; `hyper` is (lr,
    gradient scale) in fp64 and `step` the step count after this step. Written as plain tensor
    ops so that the compiler fuses each tensor's chain into one kernel; run eagerly, it is the
    reference the tests hold it to."""
    lr, scale = hyper[0], hyper[1]
    step64 = step.to(torch.float64)
    step_size = (lr / (1 - beta1 ** step64)).to(torch.float32)
    root2 = torch.sqrt(1 - beta2 ** step64).to(torch.float32)
    scale32 = scale.to(torch.float32)
    for master, weight, grad, avg, square, decay in zip(masters, weights, grads, avgs, squares, decays):
        g = grad.to(torch.float32) * scale32
        if decay:
            master.mul_(1 - (lr * decay).to(torch.float32))
        avg.mul_(beta1).add_(g, alpha=1 - beta1)
        square.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        master.sub_(step_size * avg / (square.sqrt() / root2 + eps))
        weight.copy_(master)


class CompiledAdamW:
    """Steps `optimizer`'s masters with `adamw_pass`, compiled once per (group, tensors) set."""

    def __init__(self, optimizer: torch.optim.Optimizer, compile_fn: Callable[..., Callable[..., None]] | None = None):
        reason = unsupported(optimizer)
        if reason:
            raise PlaitError(f"--optimizer-kernel compiled is AdamW's pass, and the optimizer is {reason}",
                             hint="use torch.optim.AdamW (or Adam without weight decay), without amsgrad, maximize "
                                  "or differentiable; or leave compiled_update off")
        self.optimizer = optimizer
        self.compiled = (compile_fn or _compile)(adamw_pass)
        self.steps = 0  # compiled steps taken: what tests and logs read
        self.tensors = 0  # how many tensors (runs, for flat parts) the last compiled step passed over
        self._index: dict[int, dict] = {}
        self._indexed: list[dict] = []  # the group dicts the index was made from
        self._plan: FlatPlan | None = None  # step_flat's runs, kept while their inputs stand
        self.plans_made = 0  # how often step_flat cut its runs afresh: what tests read

    def step(self, slots: Sequence[Slot], scale: float) -> bool:
        """One update of every slot, the gradients times `scale`; False (nothing done) where
        torch's kernel must take this step: a slot without state or gradient, or a master no
        group holds."""
        state = self.optimizer.state
        if not slots or any(slot.grad is None or not state.get(slot.master) for slot in slots):
            return False
        runs = self._group_runs(list(slots), [[slot.master] for slot in slots])
        return runs is not None and self._run(runs, scale, [[slots[i].grad for i in each.members] for each in runs])

    def own_flat_state(self, parts: Sequence[FlatPart]) -> None:
        """Make each piece's state now, as torch's AdamW would at its first step (zero
        moments, step 0), with the moments as views of one flat pair a part: consecutive
        pieces of a group are then one run for `step_flat`, with no copy at any step."""
        state = self.optimizer.state
        for part in parts:
            avg, square = torch.zeros_like(part.master), torch.zeros_like(part.master)
            for piece, (start, stop) in zip(part.pieces, part.bounds):
                group = self._group_of(piece)
                if group is None:  # a frozen parameter's piece: no state, never stepped
                    continue
                on_device = group.get("fused") or group.get("capturable")
                step = torch.zeros((), dtype=torch.float32, device=piece.device if on_device else "cpu")
                state[piece] = {"step": step, "exp_avg": avg[start:stop].view_as(piece),
                                "exp_avg_sq": square[start:stop].view_as(piece)}

    def step_flat(self, parts: Sequence[FlatPart], scale: float) -> bool:
        """`step` over runs: each run is consecutive pieces of one group whose moments lie
        consecutively in one flat pair (as `own_flat_state` made them; a state loaded as
        new tensors makes a piece its own run). False where torch's kernel must step.

        The runs are cut once and kept while the shards, the groups and every piece's state
        are the very tensors they were cut from: on an H200 the host's cutting (a Python walk
        over every piece, and a view a run) came after the clip's sync, with the device idle
        (RESULTS.md, GPU section, 2026-12-04, fourth). The gradient is a new buffer each step,
        so only its views are taken anew, and none is kept past the step."""
        if self._plan is None or not self._plan.stands(parts, self.optimizer):
            plan = self._cut_runs(parts)
            if plan is None:
                return False
            self._plan, self.plans_made = plan, self.plans_made + 1
        cuts = self._plan.cuts
        grads = [[parts[part].grad[start:stop] for part, start, stop in (cuts[i] for i in each.members)]
                 for each in self._plan.runs]
        return self._run(self._plan.runs, scale, grads)

    def _cut_runs(self, parts: Sequence[FlatPart]) -> FlatPlan | None:
        """The parts' runs, grouped as `_run` takes them, with what they were cut from; None
        where torch's kernel must step (a shard without a gradient, a piece without state)."""
        state = self.optimizer.state
        slots: list[Slot] = []
        keys: list[list[torch.Tensor]] = []
        cuts: list[tuple[int, int, int]] = []
        for index, part in enumerate(parts):
            stepped = [piece for piece in part.pieces if self._group_of(piece) is not None]
            if part.grad is None or any(not state.get(piece) for piece in stepped):
                return None
            for run in _runs(part, state, self._group_of):
                first, last = run[0], run[-1]
                start, stop = part.bounds[first][0], part.bounds[last][1]
                slots.append(Slot(part.master[start:stop], part.weight[start:stop], part.grad[start:stop]))
                keys.append([part.pieces[i] for i in run])
                cuts.append((index, start, stop))
        runs = self._group_runs(slots, keys)
        return None if runs is None else FlatPlan.of(parts, self.optimizer, runs, cuts)

    def _group_of(self, param: torch.Tensor) -> dict | None:
        """The optimizer's group holding `param` (None if none does); the index is rebuilt
        when the groups change."""
        groups = self.optimizer.param_groups
        if not _same(groups, self._indexed) or sum(len(g["params"]) for g in groups) != len(self._index):
            self._index = {id(p): g for g in groups for p in g["params"]}
            self._indexed = list(groups)
        return self._index.get(id(param))

    def _group_runs(self, slots: list[Slot], keys: list[list[torch.Tensor]]) -> list[GroupRuns] | None:
        """The slots (a tensor, or a run of the pieces `keys` names) by group, in the
        optimizer's order of groups; a run's moments are its first key's state, widened over
        the run. None if a key is in no group."""
        state = self.optimizer.state
        groups = [self._group_of(run_keys[0]) for run_keys in keys]
        if any(group is None for group in groups):
            return None
        out = []
        for group in self.optimizer.param_groups:
            members = [i for i, of in enumerate(groups) if of is group]
            if members:
                out.append(GroupRuns(group, members, [slots[i].master for i in members],
                                     [slots[i].weight for i in members],
                                     [_widened(state[keys[i][0]]["exp_avg"], slots[i].master) for i in members],
                                     [_widened(state[keys[i][0]]["exp_avg_sq"], slots[i].master) for i in members],
                                     [state[key]["step"] for i in members for key in keys[i]]))
        return out

    def _run(self, runs: list[GroupRuns], scale: float, grads: list[list[torch.Tensor]]) -> bool:
        """One compiled pass a group over `grads` (the group's, in its runs' order), with the
        group's hyperparameters as they stand now (a scheduler moves the lr between steps)."""
        for each, group_grads in zip(runs, grads):
            group = each.group
            torch._foreach_add_(each.steps, 1.0)
            device = each.masters[0].device
            hyper = torch.tensor([float(group["lr"]), scale], dtype=torch.float64).to(device, non_blocking=True)
            beta1, beta2 = group["betas"]
            decay = float(group.get("weight_decay", 0.0)) if type(self.optimizer) is torch.optim.AdamW else 0.0
            self.compiled(each.masters, each.weights, group_grads, each.avgs, each.squares, [decay] * len(each.masters),
                          hyper, each.steps[0].to(device), float(beta1), float(beta2), float(group["eps"]))
        self.steps += 1
        self.tensors = sum(len(each.masters) for each in runs)
        return True


@dataclass
class GroupRuns:
    """One group's share of a compiled step: its slots' places in the step's list (`members`:
    where the caller finds their gradients, which are not kept), the tensors its pass takes,
    and every piece's step count (each advanced, as torch's kernel would, so a checkpoint
    holds them right)."""

    group: dict
    members: list[int]
    masters: list[torch.Tensor]
    weights: list[torch.Tensor]
    avgs: list[torch.Tensor]
    squares: list[torch.Tensor]
    steps: list[torch.Tensor]


@dataclass
class FlatPlan:
    """`step_flat`'s runs, where each run's gradient lies (part, start, stop: the gradient is
    a new buffer each step), and what they were cut from: where each shard's master and weight
    lie (the shard hands out a fresh view of its weight at each step), the groups, and every
    stepped piece's state (by identity: a checkpoint loads into those tensors in place, and a
    state replaced by new tensors cuts the runs again)."""

    runs: list[GroupRuns]
    cuts: list[tuple[int, int, int]]
    shards: list[tuple[int, int, int]]
    groups: list[dict]
    states: list[Any]  # `_states`: each piece's state dict and its three tensors, or Nones

    @staticmethod
    def of(parts: Sequence[FlatPart], optimizer: torch.optim.Optimizer, runs: list[GroupRuns],
           cuts: list[tuple[int, int, int]]) -> FlatPlan:
        return FlatPlan(runs, cuts, _shards(parts), list(optimizer.param_groups), _states(parts, optimizer.state))

    def stands(self, parts: Sequence[FlatPart], optimizer: torch.optim.Optimizer) -> bool:
        """Whether the runs still step these parts: the same buffers, groups and states."""
        return (all(part.grad is not None for part in parts) and _shards(parts) == self.shards
                and _same(optimizer.param_groups, self.groups) and _same(_states(parts, optimizer.state), self.states))


def _shards(parts: Sequence[FlatPart]) -> list[tuple[int, int, int]]:
    """Where each part's master and weight start, and how long the master is."""
    return [(part.master.data_ptr(), part.weight.data_ptr(), part.master.numel()) for part in parts]


def _states(parts: Sequence[FlatPart], state: dict) -> list[Any]:
    """Every piece's state dict and tensors, in order (None for a piece with no state)."""
    out: list[Any] = []
    for part in parts:
        for piece in part.pieces:
            entry = state.get(piece)
            out += (entry, None, None, None) if not entry else (entry, entry["step"], entry["exp_avg"],
                                                                entry["exp_avg_sq"])
    return out


def _same(these: Sequence[Any], those: Sequence[Any]) -> bool:
    """The same objects, in the same order (identity, not equality: tensors and dicts)."""
    return len(these) == len(those) and all(a is b for a, b in zip(these, those))


def _runs(part: FlatPart, state: dict, group_of: Callable[[torch.Tensor], dict | None]) -> list[list[int]]:
    """The part's pieces cut into runs: consecutive in the shard, under one group, and with
    each moment continuing the previous piece's in memory."""
    runs: list[list[int]] = []
    for i, piece in enumerate(part.pieces):
        if group_of(piece) is None:  # frozen: a gap no run crosses
            runs.append([])
            continue
        if runs and runs[-1]:
            prev = runs[-1][-1]
            joins = (part.bounds[prev][1] == part.bounds[i][0] and group_of(part.pieces[prev]) is group_of(piece)
                     and all(_follows(state[part.pieces[prev]][k], state[piece][k]) for k in ("exp_avg", "exp_avg_sq")))
            if joins:
                runs[-1].append(i)
                continue
        runs.append([i])
    return [run for run in runs if run]


def _follows(before: torch.Tensor, after: torch.Tensor) -> bool:
    """`after` starts where `before` ends, in one storage."""
    return (before.untyped_storage().data_ptr() == after.untyped_storage().data_ptr()
            and before.is_contiguous() and after.is_contiguous()
            and before.data_ptr() + before.numel() * before.element_size() == after.data_ptr())


def _widened(first: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The slot's moment: `first` itself for a tensor of its own, else the run's elements of
    the flat storage from where `first` starts."""
    if first.shape == like.shape:
        return first
    return first.reshape(-1).as_strided((like.numel(),), (1,))


def _compile(fn: Callable[..., None]) -> Callable[..., None]:
    """torch.compile without a graph break allowed: a pass that falls back to eager ops would
    move the three passes' bytes again, unseen."""
    return torch.compile(fn, fullgraph=True, dynamic=False)
