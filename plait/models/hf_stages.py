"""A transformers model's declared pipeline plan: where plait cuts it, and how a stage runs.

transformers declares the pieces a pipeline may hold (`model.pp_plan`, e.g. {"model.embed_tokens":
(["input_ids"], ["inputs_embeds"]), "model.layers": (["hidden_states", "attention_mask"],
["hidden_states"]), "model.norm": ..., "lm_head": ...}). plait reads it as a cut (`Parts`):

- the piece that is a ModuleList is the block list; the plan's pieces registered before it
  run on the first stage, those after it on the last;
- the base model's other modules, which the plan leaves out, must hold no parameters (the
  rotary embedding): every stage keeps them. One with parameters is refused in one line.

A stage does what the base model's forward does around its own layers: positions 0..s-1,
rotary angles from the shared `rotary_emb` (one set per layer type where it takes one, as
Gemma3's does), and causal masks, sliding-window ones for the layers `config.layer_types`
says slide (else all of them when `config.sliding_window` is set), made inside the stage, so
a stage passes only hidden states on. A family without a `rotary_emb`, or with a layer type
plait makes no mask for, is refused for pp > 1 in one line.

A declaration says where to cut, not everything the forward does between the pieces (a
logit soft-cap, a scaled embedding...). So before the first cut plait runs the pieces in a
row, as the stages will, on a few tokens, and refuses the pipeline in one line unless the
logits are exactly the model's own.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from plait.errors import PlaitError
from plait.models.hf_styles import probe_ids, quiet
from plait.parallel.seam import Parts, StageView
from plait.parallel.tensor.plan import tensor_parallel_of

ROTARY = "rotary_emb"
HINT = ("train it with pp 1 (dp, ZeRO and tp need no cut), or give parallelize an adapter whose "
        "parts() and run_stage() say how (plait.parallel.seam)")


def declared_parts(model: nn.Module, plan: dict[str, Any]) -> Parts:
    """The cut the pp plan declares (see the module docstring); PlaitError where it cannot be."""
    name, modules = type(model).__name__, dict(model.named_modules())
    order = {key: i for i, key in enumerate(modules)}
    placed = sorted((key for key in plan if key in modules), key=order.get)
    lists = [key for key in placed if isinstance(modules[key], nn.ModuleList)]
    if len(lists) != 1:
        raise PlaitError(f"pp: {name}'s pp_plan names {len(lists)} module lists ({', '.join(lists) or 'none'}); "
                         "plait cuts one list of blocks", hint=HINT)
    blocks = lists[0]
    shared = _unplaced(model, set(placed))
    if not any(key.rsplit(".", 1)[-1] == ROTARY for key in shared):
        raise PlaitError(f"pp: {name} has no {ROTARY} beside its layers, and plait's stages make the "
                         "positions a layer reads from one", hint=HINT)
    return Parts(blocks=blocks, first=tuple(k for k in placed if order[k] < order[blocks]),
                 last=tuple(k for k in placed if order[k] > order[blocks]), shared=tuple(shared))


def _unplaced(model: nn.Module, placed: set[str]) -> list[str]:
    """The modules no piece of the plan holds, outermost first; each must be parameter-free."""
    out: list[str] = []
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        prefix, module = stack.pop(0)
        if any(True for _ in module.parameters(recurse=False)):
            raise _unplaced_error(model, prefix or "the model itself")
        for child_name, child in module.named_children():
            full = f"{prefix}{child_name}"
            if full in placed:
                continue
            if any(key.startswith(f"{full}.") for key in placed):
                stack.append((f"{full}.", child))
            elif any(True for _ in child.parameters()):
                raise _unplaced_error(model, full)
            else:
                out.append(full)
    return out


def _unplaced_error(model: nn.Module, where: str) -> PlaitError:
    return PlaitError(f"pp: {type(model).__name__}'s pp_plan places no stage for {where}, which holds parameters",
                      hint=HINT)


def layer_kinds(config: Any) -> list[str]:
    """The attention each layer runs: as `config.layer_types` says, else sliding everywhere
    when the config sets a window (Mistral), else full."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    sliding = getattr(config, "sliding_window", None) is not None
    return ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers


def run_stage(stage: StageView, x: torch.Tensor, parts: Parts, config: Any) -> torch.Tensor:
    """Ids or hidden states (batch, seq, hidden) in; hidden states or logits out."""
    if stage.is_first:
        for name in parts.first:
            x = _first(stage.held(name)(x))
    # Under sequence parallelism hidden states between stages hold seq / tp positions.
    seq = x.shape[1] * (1 if stage.is_first else stage.seq_split)
    rotary = next(stage.held(name) for name in parts.shared if name.rsplit(".", 1)[-1] == ROTARY)
    positions = stage_positions(stage, seq, x.device)
    whole = x[:, :1].expand(x.shape[0], seq, x.shape[-1])  # the shape the masks are made for
    kinds = layer_kinds(config)
    angles = _angles(rotary, whole, positions, set(kinds))
    masks = causal_masks(config, whole, positions, set(kinds))
    for i, block in enumerate(stage.held_blocks(), start=stage.first_layer):
        x = _first(block(x, attention_mask=masks[kinds[i]], position_ids=positions,
                         position_embeddings=angles[kinds[i]], use_cache=False))
    if stage.is_last:
        for name in parts.last:
            x = _first(stage.held(name)(x))
    return x


def stage_positions(stage: StageView, seq: int, device: torch.device) -> torch.Tensor:
    """(1, seq): the positions of a stage's tokens, 0..seq-1, or under engaged context
    parallelism this rank's global ones."""
    positions = stage.context_positions(seq, device)
    return torch.arange(seq, device=device).unsqueeze(0) if positions is None else positions


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _angles(rotary: nn.Module, whole: torch.Tensor, positions: torch.Tensor, kinds: set[str]) -> dict[str, Any]:
    """cos and sin per layer type: one set for all, or one each where the rotary module takes
    the layer type (different bases for local and global layers)."""
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        return {kind: rotary(whole, positions, layer_type=kind) for kind in kinds}
    angles = rotary(whole, positions)
    return {kind: angles for kind in kinds}


def causal_masks(config: Any, whole: torch.Tensor, positions: torch.Tensor, kinds: set[str]) -> dict[str, Any]:
    """The masks the base model makes (None where attention can be told `is_causal`)."""
    from transformers import masking_utils  # only with a transformers model in hand

    make = {"full_attention": masking_utils.create_causal_mask,
            "sliding_attention": masking_utils.create_sliding_window_causal_mask}
    # transformers 5.24 names the cache `cache`; earlier versions `past_key_values`
    cache = "cache" if "cache" in inspect.signature(make["full_attention"]).parameters else "past_key_values"
    return {kind: make[kind](config=config, inputs_embeds=whole, attention_mask=None, position_ids=positions,
                             **{cache: None}) for kind in kinds}


def check_kinds(model: nn.Module, config: Any) -> None:
    """pp only makes full and sliding-window causal masks: one line for any other layer type."""
    other = sorted(set(layer_kinds(config)) - {"full_attention", "sliding_attention"})
    if other:
        raise PlaitError(f"pp: {type(model).__name__} has {other[0]} layers, and plait's stages make only "
                         "full and sliding-window causal masks", hint=HINT)


class WholeModel:
    """The StageView of one stage holding every piece: the pieces run in a row."""

    index, num_stages, first_layer, seq_split = 0, 1, 0, 1
    is_first = is_last = True

    def __init__(self, model: nn.Module, parts: Parts):
        self.model, self.parts = model, parts

    def held(self, name: str) -> Any:
        return self.model.get_submodule(name)

    def held_blocks(self) -> list[nn.Module]:
        return list(self.model.get_submodule(self.parts.blocks))

    def context_positions(self, seq: int, device: torch.device) -> None:
        return None  # the probe runs whole sequences


def check_cut(model: nn.Module, parts: Parts, config: Any) -> None:
    """Refuse the cut unless its pieces, run in a row as the stages run them, give exactly the
    model's own logits on a few tokens (a multiple of tp under sequence parallelism)."""
    info = tensor_parallel_of(model)
    ids = probe_ids(model, 4 * (info.axis.size if info is not None and info.sp else 1))
    with quiet(model):
        own = getattr(model(input_ids=ids), "logits", None)
        staged = run_stage(WholeModel(model, parts), ids, parts, config)
    if own is None or own.shape != staged.shape or not torch.equal(own, staged):
        raise PlaitError(f"pp: {type(model).__name__}'s forward does more than its pp_plan's pieces in a row "
                         "(on a few test tokens its logits differ from the stages'), so plait cannot cut it",
                         hint=HINT)
