"""A transformers SwiGLU MLP whose down projection gets its input made again, not kept.

transformers' Llama-like MLP computes down_proj(act_fn(gate_proj(x)) * up_proj(x)). Autograd
keeps four f-wide tensors a token for it: gate (silu's input), silu's output and up (the
product's inputs), and the product (the down projection's input, for its weight's gradient).
plait's own block keeps two, gate and up, and makes silu(gate) and the product again when
backward reads them (plait/models/gpt/lean.gated_down): the same values, bit for bit, for one
element-wise multiplication and one silu in backward.

`remake_gated_products` gives the MLPs of a model plait builds from a transformers directory
that same forward. It takes only an MLP it can read as that expression, in its class's own
source, with a SiLU as its activation: another activation, a clamp, a dropout or a scale
between the ops (about twenty of transformers' MLPs) keeps transformers' forward.
Both of plait's builds are given it (plait/models/hf/load.py): the one that trains, and the one
on the meta device whose forwards read what a block keeps, so the estimate reads what the run
keeps.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch
from torch import nn

from plait.models.gpt.lean import gated_down

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def remake_gated_products(model: nn.Module) -> int:
    """Give each SwiGLU MLP of `model` (`_remakable`) the forward that makes its product again
    for the down projection's backward; the number given it."""
    mlps = [module for module in model.modules() if _remakable(module)]
    for mlp in mlps:  # a partial, not a bound method: a pickled model loads again
        mlp.forward = functools.partial(_gated_forward, mlp)
    return len(mlps)


def remade(mlp: nn.Module | None) -> bool:
    """Whether `mlp` was given the forward that makes its product again."""
    return getattr(getattr(mlp, "forward", None), "func", None) is _gated_forward


def _gated_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """down_proj(silu(gate_proj(x)) · up_proj(x)), the product made again in backward."""
    return gated_down(self.down_proj, self.gate_proj(x), self.up_proj(x))


def _remakable(module: nn.Module) -> bool:
    """Whether `module` is a SwiGLU MLP whose forward is its class's own, the expression above
    (`_reads_as_swiglu`), with projections that are modules and a SiLU as its activation."""
    if not all(isinstance(getattr(module, name, None), nn.Module) for name in PROJECTIONS):
        return False
    if "forward" in vars(module) or not _is_silu(getattr(module, "act_fn", None)):
        return False
    return _reads_as_swiglu(type(module))


def _is_silu(act: object) -> bool:
    """torch's SiLU, or transformers' SiLUActivation, running its own forward (a kernel that
    replaced it computes something this module cannot vouch for)."""
    if not isinstance(act, nn.Module) or "forward" in vars(act):
        return False
    if type(act) is nn.SiLU:
        return True
    return type(act).__name__ == "SiLUActivation" and type(act).__module__.startswith("transformers.")


@functools.cache
def _reads_as_swiglu(cls: type) -> bool:
    """Whether `cls.forward(self, x)` is `return self.down_proj(self.act_fn(self.gate_proj(x)) *
    self.up_proj(x))`, or that expression assigned to a name which it then returns, a docstring
    aside: read from its source, which no stand-in or hook changes."""
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
        function = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return False
    if not isinstance(function, ast.FunctionDef):
        return False
    args = function.args
    if len(args.args) != 2 or args.vararg or args.kwarg or args.kwonlyargs or args.defaults:
        return False
    x = args.args[1].arg
    expected = ast.dump(ast.parse(f"self.down_proj(self.act_fn(self.gate_proj({x})) * self.up_proj({x}))",
                                  mode="eval").body)
    body = [s for s in function.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None:
        return ast.dump(body[0].value) == expected
    if len(body) == 2 and isinstance(body[0], ast.Assign) and isinstance(body[1], ast.Return):
        target, returned = body[0].targets, body[1].value
        return (len(target) == 1 and isinstance(target[0], ast.Name) and isinstance(returned, ast.Name)
                and returned.id == target[0].id and ast.dump(body[0].value) == expected)
    return False
