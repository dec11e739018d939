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

The pieces outside the base model (the head) run through the causal LM's own forward, with
the base model standing in as the hidden states the stage made (`OwnHead`): what that
forward does after the head (Gemma 2's logit soft-cap, Cohere's logit scale) runs on the
last stage as the model does it, read from the model, not from a list of families.

A model that declares no pp plan but is laid out as its declared siblings are (one list of
layers between an embedding and a final norm, under the base model) is cut the same way
(`inferred_plan`); the log says so.

A declaration says where to cut, not everything the forward does between the pieces. So
before the first cut plait runs the pieces in a row, as the stages will, on a few tokens,
and refuses the pipeline in one line unless the logits are exactly the model's own.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from plait.errors import PlaitError
from plait.parallel.packed import forward_parameters
from plait.models.hf.styles import probe_ids
from plait.parallel.probe import first_line, quiet
from plait.parallel.seam import Parts, StageView
from plait.parallel.tensor.plan import tensor_parallel_of

log = logging.getLogger(__name__)
ROTARY = "rotary_emb"
HINT = ("train it with pp 1 (dp, ZeRO and tp need no cut), or give parallelize an adapter whose "
        "parts() and run_stage() say how (plait.parallel.seam)")


def placed_pieces(model: nn.Module, plan: dict[str, Any]) -> tuple[dict[str, int], list[str], str]:
    """({module: its place in registration order}, the plan's modules in that order, the one
    module list among them: the blocks); PlaitError unless there is exactly one list."""
    modules = dict(model.named_modules())
    order = {key: i for i, key in enumerate(modules)}
    placed = sorted((key for key in plan if key in modules), key=order.get)
    lists = [key for key in placed if isinstance(modules[key], nn.ModuleList)]
    if len(lists) != 1:
        raise PlaitError(f"pp: {type(model).__name__}'s pp_plan names {len(lists)} module lists "
                         f"({', '.join(lists) or 'none'}); plait cuts one list of blocks", hint=HINT)
    return order, placed, lists[0]


def declared_parts(model: nn.Module, plan: dict[str, Any]) -> Parts:
    """The cut the pp plan declares (see the module docstring); PlaitError where it cannot be."""
    order, placed, blocks = placed_pieces(model, plan)
    shared = _unplaced(model, set(placed))
    return Parts(blocks=blocks, first=tuple(k for k in placed if order[k] < order[blocks]),
                 last=tuple(k for k in placed if order[k] > order[blocks]), shared=tuple(shared))


def _unplaced(model: nn.Module, placed: set[str]) -> list[str]:
    """The modules no piece of the plan holds, outermost first; each must be parameter-free."""
    out: list[str] = []
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        prefix, module = stack.pop(0)
        if any(True for _ in module.parameters(recurse=False)):
            raise _unplaced_error(model, prefix.rstrip(".") or "the model itself")
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


class OwnHead:
    """The causal LM's own forward after its base model, run on the last stage: the base model
    stands in as the hidden states the stage made, the held head is the model's, so whatever
    the forward does around the head (a soft-cap, a scale) runs as the model does it."""

    def __init__(self, model: nn.Module):
        self.cls = type(model)
        self.prefix = _base_name(model, getattr(model, "get_input_embeddings", lambda: None)())
        # the model's own attributes (config, logit_scale...), without its modules and parameters
        self.state = {key: value for key, value in vars(model).items() if key not in ("_modules", "_parameters")}
        base = getattr(model, self.prefix, None) if self.prefix else None
        self.base_state = {key: value for key, value in vars(base).items()  # its plain attributes only
                           if not key.startswith("_") and key != "training"} if isinstance(base, nn.Module) else {}
        self.router_flag = "output_router_logits" in forward_parameters(self.cls)

    def wraps(self, name: str) -> bool:
        """Whether the piece `name` runs inside the model's own forward (outside its base model)."""
        return bool(self.prefix) and not name.startswith(f"{self.prefix}.")

    def __call__(self, stage: StageView, names: tuple[str, ...], hidden: torch.Tensor) -> torch.Tensor:
        shell = object.__new__(self.cls)
        vars(shell).update(self.state)
        held = {name: stage.held(name) for name in names}
        vars(shell).update(_parameters={}, _modules={self.prefix: _Hidden(hidden, self.base_state), **held},
                           training=next(iter(held.values())).training)  # train or eval, as the stage runs
        extra = {"output_router_logits": False} if self.router_flag else {}
        out = self.cls.forward(shell, use_cache=False, **extra)
        logits = getattr(out, "logits", None)
        return first_output(out) if logits is None else logits  # return_dict=False: the logits come first


class _Hidden(nn.Module):
    """Stands in for a base model: returns the hidden states it was given."""

    def __init__(self, hidden: torch.Tensor, base_state: dict[str, Any] | None = None):
        super().__init__()
        self.hidden, self.base_state = hidden, base_state or {}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import MoeModelOutputWithPast  # every field a forward reads

        return MoeModelOutputWithPast(last_hidden_state=self.hidden)

    def __getattr__(self, name: str) -> Any:
        """The base model's own attributes (Falcon-H1's head reads `model.lm_head_multiplier`),
        as plain values: what the stand-in does not hold, the base model it stands for did."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            state = self.__dict__.get("base_state", {})
            if name in state:
                return state[name]
            raise


def names_a_list(model: nn.Module, plan: dict[str, Any]) -> bool:
    """Whether `plan` names a module list of `model` (the layers a pipeline cuts)."""
    modules = dict(model.named_modules())
    return any(isinstance(modules.get(key), nn.ModuleList) for key in plan)


def inferred_plan(model: nn.Module) -> dict[str, Any]:
    """The pp plan of a model that declares none, as its declared siblings' read: the base
    model's children with parameters (an embedding, one list of layers, a final norm) and the
    head, looking inside a base model that only wraps one (OPT's `model.decoder`). {} unless
    the first such child is, or holds, the input embedding (ModernBERT's `embeddings`)."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    embedding = getattr(model, "get_input_embeddings", lambda: None)()
    prefix = _base_name(model, embedding)
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, nn.Module) or head is None:
        return {}
    pieces = _holders(base)
    while len(pieces) == 1 and not isinstance(base.get_submodule(pieces[0]), nn.ModuleList):
        prefix, base = f"{prefix}.{pieces[0]}", base.get_submodule(pieces[0])  # a wrapper (OPT's decoder)
        pieces = _holders(base)
    if not pieces or not any(module is embedding for module in base.get_submodule(pieces[0]).modules()):
        return {}
    tops = [name for name, child in model.named_children() if child is head]
    return {**{f"{prefix}.{name}": None for name in pieces}, **{name: None for name in tops}}


def _holders(module: nn.Module) -> list[str]:
    """The names of `module`'s children that hold parameters, in order."""
    return [name for name, child in module.named_children() if any(True for _ in child.parameters())]


def _base_name(model: nn.Module, embedding: Any) -> str:
    """Where the base model sits: `base_model_prefix`, or where that names nothing (Llama 4's
    text model keeps the multimodal model's "language_model" but sits at "model") the one
    child holding the input embedding."""
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return prefix
    holders = [name for name, child in model.named_children()
               if embedding is not None and any(m is embedding for m in child.modules())]
    return holders[0] if len(holders) == 1 else ""


def run_stage(stage: StageView, x: torch.Tensor, parts: Parts, config: Any, head: OwnHead | None = None,
              other: dict[str, str | None] | None = None) -> torch.Tensor:
    """Ids or hidden states (batch, seq, hidden) in; hidden states or logits out. `head`: the
    model's own forward around its head; `other`: the layer types a stage does not mask as
    such, each given the mask of the type it takes (check_kinds), or none."""
    if stage.is_first:
        for name in parts.first:
            x = first_output(stage.held(name)(x))
    # Under sequence parallelism hidden states between the blocks hold seq / tp positions (not
    # those before the first block or after the last: an end stage may hold none).
    kinds = layer_kinds(config)
    sliced = not stage.is_first and 0 < stage.first_layer < len(kinds)
    seq = x.shape[1] * (stage.seq_split if sliced else 1)
    # no rotary module (Jamba's, Nemotron-H's layers take no angles): none to give
    rotary = next((stage.held(name) for name in parts.shared if name.rsplit(".", 1)[-1] == ROTARY), None)
    positions = stage_positions(stage, seq, x.device)
    whole = x[:, :1].expand(x.shape[0], seq, x.shape[-1])  # the shape the masks are made for
    angles = _angles(rotary, whole, positions, set(kinds))
    other = other or {}
    made = causal_masks(config, whole, positions, (set(kinds) - set(other)) | {v for v in other.values() if v})
    masks = {**made, **{kind: made[taken] if taken else None for kind, taken in other.items()}}
    for i, block in enumerate(stage.held_blocks(), start=stage.first_layer):
        x = first_output(block(x, attention_mask=masks[kinds[i]], position_ids=positions,
                         position_embeddings=angles[kinds[i]], use_cache=False))
    if stage.is_last:
        inside = tuple(name for name in parts.last if head is None or not head.wraps(name))
        for name in inside:
            x = first_output(stage.held(name)(x))
        if len(inside) < len(parts.last):
            x = head(stage, tuple(name for name in parts.last if name not in inside), x)
    return x


def stage_positions(stage: StageView, seq: int, device: torch.device) -> torch.Tensor:
    """(1, seq): the positions of a stage's tokens, 0..seq-1, or under engaged context
    parallelism this rank's global ones; (batch, seq) for packed documents, restarting at each
    (the masks transformers makes from them keep attention inside each document)."""
    packed = getattr(stage, "packed", None)
    positions = stage.context_positions(seq, device)
    if packed is not None and positions is not None:
        raise PlaitError("packed documents under cp × pp: a transformers model's pipeline stages cannot hand the "
                         "ring the documents", hint="drop --pp or --cp, or train plait's GPT, or give --doc-mask false")
    if packed is not None:
        return packed.positions
    return torch.arange(seq, device=device).unsqueeze(0) if positions is None else positions


def first_output(out: Any) -> Any:
    """A module's output, or the first of the tuple it returns (a block's hidden states)."""
    return out[0] if isinstance(out, tuple) else out


def _angles(rotary: nn.Module | None, whole: torch.Tensor, positions: torch.Tensor,
            kinds: set[str]) -> dict[str, Any]:
    """cos and sin per layer type: one set for all, or one each where the rotary module takes
    the layer type (different bases for local and global layers); None without one."""
    if rotary is None:
        return dict.fromkeys(kinds)
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        return {kind: rotary(whole, positions, layer_type=kind) for kind in kinds}
    angles = rotary(whole, positions)
    return {kind: angles for kind in kinds}


def causal_masks(config: Any, whole: torch.Tensor, positions: torch.Tensor, kinds: set[str]) -> dict[str, Any]:
    """The masks the base model makes (None where attention can be told `is_causal`)."""
    from transformers import masking_utils  # only with a transformers model in hand

    make = {"full_attention": masking_utils.create_causal_mask,
            "sliding_attention": masking_utils.create_sliding_window_causal_mask,
            "chunked_attention": masking_utils.create_chunked_causal_mask}
    # transformers 5.24 names the cache `cache`; earlier versions `past_key_values`
    cache = "cache" if "cache" in inspect.signature(make["full_attention"]).parameters else "past_key_values"
    return {kind: make[kind](config=config, inputs_embeds=whole, attention_mask=None, position_ids=positions,
                             **{cache: None}) for kind in kinds}


MADE = ("full_attention", "sliding_attention", "chunked_attention")  # the layer types whose masks a stage makes


MAKERS = {"create_causal_mask": "full_attention", "create_sliding_window_causal_mask": "sliding_attention",
          "create_chunked_causal_mask": "chunked_attention"}  # transformers' mask makers -> the type a stage makes


def check_kinds(model: nn.Module, config: Any, blocks: str) -> dict[str, str | None]:
    """{layer type beyond those a stage masks: the type whose mask it takes, or None}. The
    model's own forward runs once with its mask makers tagged: a type given no mask on an
    unpadded batch (linear attention) gets none from a stage either; one given the mask a
    maker made (DeepSeek-V3.2's indexed attention takes `create_causal_mask`'s) gets that
    maker's from a stage. One line for a type given any other mask, which a stage cannot make."""
    other = sorted(set(layer_kinds(config)) - set(MADE))
    if not other:
        return {}
    reach = mask_reach(config)
    if reach + 2 > REACH_CHECKED:
        raise PlaitError(f"pp: {type(model).__name__}'s {other[0]} layers may take a mask, and its config reaches "
                         f"{reach} tokens (a window or a chunk): plait checks them on at most {REACH_CHECKED}",
                         hint=HINT)
    given: dict[str, list[Any]] = {kind: [] for kind in other}
    kinds = layer_kinds(config)
    handles = [block.register_forward_pre_hook(
        lambda module, args, kwargs, kind=kinds[i]: given.get(kind, []).append(
            kwargs.get("attention_mask", "positional") if len(args) < 2 else "positional"), with_kwargs=True)
        for i, block in enumerate(model.get_submodule(blocks))]
    made: dict[int, str] = {}
    try:
        with quiet(model), _tagged_makers(model, made):
            model(input_ids=probe_ids(model, probe_length(model, reach)))
    finally:
        for handle in handles:
            handle.remove()
    taken: dict[str, str | None] = {}
    for kind in other:
        makers = {None if mask is None else made.get(id(mask), "") for mask in given[kind]}
        if len(makers) != 1 or "" in makers:
            raise PlaitError(f"pp: {type(model).__name__}'s {kind} layers take a mask its own forward makes, and "
                             "plait's stages make only full, sliding-window and chunked causal masks", hint=HINT)
        taken[kind] = makers.pop()
    return taken


@contextlib.contextmanager
def _tagged_makers(model: nn.Module, made: dict[int, str]) -> Iterator[None]:
    """transformers' mask makers, as the model's module calls them, wrapped so that each mask
    they return is recorded in `made` (its id -> the type a stage makes it for)."""
    module = sys.modules.get(type(model).__module__)
    saved = {name: getattr(module, name) for name in MAKERS if module is not None and hasattr(module, name)}

    def tagging(name: str, make: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            mask = make(*args, **kwargs)
            if mask is not None:
                made[id(mask)] = MAKERS[name]
            return mask
        return wrapped

    for name, make in saved.items():
        setattr(module, name, tagging(name, make))
    try:
        yield
    finally:
        for name, make in saved.items():
            setattr(module, name, make)


class WholeModel:
    """The StageView of one stage holding every piece: the pieces run in a row."""

    index, num_stages, first_layer, seq_split = 0, 1, 0, 1
    is_first = is_last = True
    packed = None  # the probe runs plain sequences

    def __init__(self, model: nn.Module, parts: Parts):
        self.model, self.parts = model, parts

    def held(self, name: str) -> Any:
        return self.model.get_submodule(name)

    def held_blocks(self) -> list[nn.Module]:
        return list(self.model.get_submodule(self.parts.blocks))

    def context_positions(self, seq: int, device: torch.device) -> None:
        return None  # the probe runs whole sequences


REACH_CHECKED = 64  # the longest probe the cut's checks run: past a window or chunk up to 62 tokens


def mask_reach(config: Any) -> int:
    """The longest window or chunk the config sets (`sliding_window`, `attention_chunk_size`,
    `sliding_window_size`...), 0 for none: a probe no longer than it sees a windowed or chunked
    mask as the causal one, or as none (Llama 4's chunks, Inkling's window)."""
    sizes = [value for key, value in vars(config).items() if isinstance(value, int) and not isinstance(value, bool)
             and ("window" in key or ("chunk" in key and "att" in key))]  # not a state-space scan's chunks
    return max(sizes, default=0)


def probe_length(model: nn.Module, reach: int = 0) -> int:
    """A few tokens, past `reach` (a window or chunk up to REACH_CHECKED), a multiple of tp
    under sequence parallelism (the model may be split already)."""
    info = tensor_parallel_of(model)
    step = info.axis.size if info is not None and info.sp else 1
    tokens = max(4 * step, min(reach + 2, REACH_CHECKED))
    return -(-tokens // step) * step


def check_cut(model: nn.Module, parts: Parts, config: Any, head: OwnHead | None = None,
              other: dict[str, str | None] | None = None) -> None:
    """Refuse the cut unless its pieces, run in a row as the stages run them, give exactly the
    model's own logits on a few tokens (a multiple of tp under sequence parallelism)."""
    ids = probe_ids(model, probe_length(model, mask_reach(config)))
    with quiet(model):
        own = getattr(model(input_ids=ids), "logits", None)
        try:
            staged = run_stage(WholeModel(model, parts), ids, parts, config, head, other)
        except Exception as error:  # noqa: BLE001 - pieces that cannot run in a row are a refusal too
            raise PlaitError(f"pp: {type(model).__name__}'s pp_plan pieces fail when run in a row on a few test "
                             f"tokens ({type(error).__name__}: {first_line(error)}), so plait cannot cut it",
                             hint=HINT) from None
    if own is None or own.shape != staged.shape or not torch.equal(own, staged):
        raise PlaitError(f"pp: {type(model).__name__}'s forward does more than its pp_plan's pieces in a row "
                         "(on a few test tokens its logits differ from the stages'), so plait cannot cut it",
                         hint=HINT)
    log.info("pp: %s's pieces in a row give its own logits on a %d-token probe", type(model).__name__, ids.shape[1])
