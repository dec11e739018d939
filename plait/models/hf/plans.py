"""What the strategies ask of a transformers model, answered from the plans it declares.

transformers 5 causal LMs declare how their layers split across ranks (`model.tp_plan`) and
which pieces a pipeline may hold (`model.pp_plan`), composed from `config.base_model_tp_plan`
/ `base_model_pp_plan` and the class's own `_tp_plan` / `_pp_plan` (the head). plait reads
those declarations instead of a list of families: every causal LM that declares them (Llama,
Mistral, Qwen2, Qwen3, Gemma 3, Phi-3, OLMo 2...) trains under every strategy with no family code,
and what plait cannot honour is refused in one line (never skipped).

- `tensor_plan`: the declared styles in plait's (models/hf/styles.py), the config's sizes
  checked; under sequence parallelism the embedding and head keep their split and read the
  whole sequence ("+whole") and the blocks' norms get their gradients summed.
- `after_tensor_parallel`: with SP, the blocks run on sequence slices (split before the
  first, gathered after the last); without, nothing: the head's gather is its own style.
- `blocks`, `parts`, `run_stage`: the block list and the cut from `pp_plan`, and a stage that
  makes positions, rotary angles and masks itself (models/hf/stages.py).

Tied embeddings need nothing here: under tp one vocabulary shard serves the embedding and
the head; across pipeline ranks the split makes two copies whose gradients are summed.
"""

from __future__ import annotations

import logging
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from plait.errors import PlaitError
from plait.models.hf import context as hf_context, stages as hf_stages
from plait.models.hf.hooks import split_sequence_around
from plait.models.hf.inferred import inferred_tp_plan, narrow_counts
from plait.models.hf.own_forward import OwnForward, own_parts
from plait.parallel.applied import applied_of
from plait.parallel.probe import first_line
from plait.parallel.tensor.styles import PARAMS, WHOLE, parse_style, whole_sequence
from plait.models.hf.styles import check_config, for_sequence_parallel, plait_plan, probe_input, text_config
from plait.parallel.probe_copy import stand_in
from plait.parallel.seam import GenericAdapter, Parts, StageView
from plait.runtime.comm import Axis

log = logging.getLogger(__name__)


def declares_plans(model: nn.Module) -> bool:
    """Whether `model` declares a tensor- or pipeline-parallel plan."""
    return bool(declared(model, "tp") or declared(model, "pp"))


def laid_out_as_declared(model: nn.Module) -> bool:
    """Whether a model that declares no plan is laid out as its siblings that do (an
    embedding, one list of layers, a final norm under its base model, and a head): the
    plans can then be inferred (the cut: models/hf/stages.py; the tp plan: inferred.py)."""
    return bool(hf_stages.inferred_plan(model))


class DeclaredPlanAdapter:
    """Any transformers causal LM, split as its own tp_plan and pp_plan say."""

    def __init__(self, own_forward: bool = False) -> None:
        """`own_forward`: pipeline stages always run the model's own forward (own_forward.py);
        by default only where the usual stage (stages.py) cannot give the model's logits."""
        self.own_forward = own_forward
        self._parts: Parts | None = None
        self._config: Any = None
        self._head: hf_stages.OwnHead | None = None
        self._other: dict[str, str | None] = {}  # layer types masked as another, or not (check_kinds)
        self._own: OwnForward | None = None  # stages that run the model's own forward (own_forward.py)
        self._inferred: dict[str, str] = {}  # the tp plan read off the layer names, where it declares none

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The repeated blocks: the pp plan's module list (else the tp plan's), else the generic answer."""
        name = block_list(model)
        return list(model.get_submodule(name)) if name else GenericAdapter().blocks(model)

    def parts(self, model: nn.Module) -> Parts:
        """The cut `pp_plan` declares, checked on a few tokens against the model's own forward."""
        plan, inferred = cut_plan(model)
        if inferred:
            if not plan:
                raise PlaitError(f"pp needs to know how to cut {type(model).__name__}: it declares no pp_plan, "
                                 "and it is not an embedding, one list of layers and a final norm",
                                 hint=hf_stages.HINT)
            log.info("pp: %s declares no pp_plan; cutting it as inferred: %s", type(model).__name__, ", ".join(plan))
        config = text_config(model)
        _refuse_layer_drop(model, config)
        real = stand_in(model)  # a meta model's checks run a copy with values (plait.parallel.probe_copy)
        self._config, self._own = config, None
        refusal = PlaitError("own forward asked for") if self.own_forward else self._usual_cut(model, real, plan)
        if refusal is None:
            return self._parts
        # what a stage remakes by rule is not all: stages that run the model's own forward
        self._own = self._own_cut(model, real, plan, config, refusal).for_model(model)
        self._parts = self._own.parts
        return self._parts

    def _usual_cut(self, model: nn.Module, real: nn.Module, plan: dict[str, Any]) -> PlaitError | None:
        """The cut whose stages make positions, angles and masks by rule (stages.py), checked on
        `real`; its refusal where the check fails."""
        try:
            parts = hf_stages.declared_parts(model, plan)
            other = hf_stages.check_kinds(real, self._config, parts.blocks)
            hf_stages.check_cut(real, parts, self._config, hf_stages.OwnHead(real), other)
        except PlaitError as refusal:
            return refusal
        self._parts, self._head, self._other = parts, hf_stages.OwnHead(model), other
        return None

    @staticmethod
    def _own_cut(model: nn.Module, real: nn.Module, plan: dict[str, Any], config: Any,
                 refusal: PlaitError) -> OwnForward:
        """The stages that run the model's own forward (models/hf/own_forward.py), checked on
        `real`; the usual stage's `refusal` where that check fails too."""
        try:
            checker = OwnForward.of(real, own_parts(model, plan, real))
            checker.check(real, hf_stages.probe_ids(real, hf_stages.probe_length(real, hf_stages.mask_reach(config))))
        except PlaitError as error:
            log.info("pp: %s's own forward cannot be cut either: %s", type(model).__name__, error)
            raise refusal from None
        if applied_of(model).context is not None:
            raise PlaitError(f"pp × cp: {type(model).__name__}'s stages must run its own forward "
                             f"({first_line(refusal)}), which makes its own positions, not context "
                             "parallelism's", hint="drop --cp or --pp for this model")
        log.info("pp: %s's stages run its own forward (%s), which gives its own logits cut after each layer",
                 type(model).__name__, first_line(refusal))
        return checker

    def run_stage(self, stage: StageView, x: torch.Tensor) -> torch.Tensor:
        """Ids or hidden states in; hidden states or logits out (models/hf/stages.py)."""
        if self._parts is None:
            raise PlaitError("run_stage before parts(): cut the model with this adapter first")
        if self._own is not None:
            return self._own(stage, x)
        return hf_stages.run_stage(stage, x, self._parts, self._config, self._head, self._other)

    def probe_input(self, model: nn.Module, tokens: int) -> tuple[tuple, dict]:
        """The batch a split is checked on before training (plait.parallel.probe)."""
        return probe_input(model, tokens)

    def tensor_plan(self, model: nn.Module, tp: int, sp: bool) -> dict[str, str]:
        """The declared tp_plan in plait's styles; PlaitError for a style or a size plait cannot split.
        A mixture of experts' experts (what its ep plan dispatches) stay whole on every tp rank:
        their entries are left out, as plait's own MoE blocks are (docs/moe.md)."""
        experts = dispatched_experts(declared(model, "ep"))
        plan = plait_plan(model, without_experts(declared(model, "tp") or self._inferred_tp(model), experts))
        if sp:
            plan = whole_beside_experts(model, plan, experts)
        if not plan:
            raise PlaitError(f"tensor parallelism needs a plan for a {type(model).__name__}: it declares no tp_plan, "
                             "and none can be read off its layer names (separate q, k, v and one output "
                             "projection; up, gate and one down projection)",
                             hint='pass ParallelConfig(tp_plan={"layer.name": "column" | "row" | "vocab" | '
                                  '"region", ...}); see docs/tensor.md')
        if sp:
            blocks = _blocks_for_sp(model)
            plan = for_sequence_parallel(model, plan, blocks)
        check_config(model, plan, tp)
        return plan

    def _inferred_tp(self, model: nn.Module) -> dict[str, str]:
        """The plan read off the layer names of a model that declares none (models/hf/inferred.py)."""
        plan = self._inferred = inferred_tp_plan(model, block_list(model))
        if plan:
            log.info("tp: %s declares no tp_plan; splitting it as inferred: %s", type(model).__name__,
                     ", ".join(f"{key}: {style}" for key, style in plan.items()))
        return plan

    def split_head(self, model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
        """`plan` with the head split by vocabulary (its logits left split: plait's vocab-parallel
        loss reads them) where it gathers them whole; kept as declared where the head shares its
        weight with an embedding the plan does not split by vocabulary."""
        head = getattr(model, "get_output_embeddings", lambda: None)()
        name = next((n for n, m in model.named_modules() if m is head), None) if head is not None else None
        if name is None or name not in plan or _base(plan[name]) != "column_gather":
            return plan
        embedding = getattr(model, "get_input_embeddings", lambda: None)()
        if embedding is not None and getattr(embedding, "weight", None) is getattr(head, "weight", None):
            embedded = next((n for n, m in model.named_modules() if m is embedding), None)
            if embedded not in plan or _base(plan[embedded]) != "vocab":
                return plan
        return {**plan, name: "vocab" + (WHOLE if whole_sequence(plan[name]) else "")}  # under SP, as declared

    def expert_modules(self, model: nn.Module) -> list[nn.Module]:
        """The experts modules its declared ep plan names (plait.models.hf.experts), checked."""
        from plait.models.hf.experts import declared_experts

        return declared_experts(model, declared(model, "ep"), declared(model, "tp"))

    def context_attention(self, model: nn.Module, context: Any) -> None:
        """Context parallelism through transformers' attention-function seam (models/hf/context.py)."""
        hf_context.context_attention(model, context)

    def after_tensor_parallel(self, model: nn.Module, axis: Axis, sp: bool) -> None:
        """An inferred plan's attentions keep their share of the sizes they hold (inferred.py).
        With SP the blocks run on sequence slices: split before the first, gather after the last."""
        if self._inferred and axis.size > 1:
            narrow_counts(model, self._inferred, axis.size)
        if sp and axis.size > 1:
            split_sequence_around(list(model.get_submodule(_blocks_for_sp(model))), axis)


def _refuse_layer_drop(model: nn.Module, config: Any) -> None:
    """A model that skips whole layers at random in training (LayerDrop: OPT's, BioGPT's,
    XGLM's `layerdrop`) draws on each stage what one process draws once: refused for pp."""
    for key, value in vars(config).items():
        if "layerdrop" in key and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            raise PlaitError(f"pp: {type(model).__name__} skips whole layers at random in training ({key} = "
                             f"{value}), which a cut into stages cannot draw as one process does",
                             hint=f"set {key} = 0, or train it with pp 1")


def dispatched_experts(ep_plan: dict[str, Any]) -> list[str]:
    """The patterns of the experts modules `ep_plan` dispatches."""
    return [pattern for pattern, style in ep_plan.items() if style == "ep_dispatch_experts"]


def without_experts(tp_plan: dict[str, Any], experts: list[str]) -> dict[str, Any]:
    """`tp_plan` less the entries at or under the `experts` modules (patterns)."""
    return {key: style for key, style in tp_plan.items()
            if not any(key == e or key.startswith(e + ".") for e in experts)}


def cut_plan(model: nn.Module) -> tuple[dict[str, Any], bool]:
    """The pp plan a pipeline cuts `model` by, and whether it was inferred: the declared one
    where it names the list of blocks, else (none, or the head's alone: OLMoE's, PhiMoE's) the
    one read off its children (stages.inferred_plan; {} where there is none)."""
    plan = declared(model, "pp")
    if hf_stages.names_a_list(model, plan):
        return plan, False
    return hf_stages.inferred_plan(model), True


def beside_experts(model: nn.Module, experts: list[str]) -> set[str]:
    """The modules around the experts modules `experts` (patterns) dispatches: what SP keeps
    whole (whole_beside_experts)."""
    return {name.rpartition(".")[0] for name, _ in model.named_modules()
            if name and any(fnmatchcase(name, e) for e in experts)}


def whole_beside_experts(model: nn.Module, plan: dict[str, str], experts: list[str]) -> dict[str, str]:
    """Under SP, `plan` with nothing split inside an MoE block holding experts kept whole (the
    block around an experts module the ep plan dispatches): such a block adds its routed
    experts' output, whole, to its shared experts', which a split would leave in partial
    sums (DeepSeek's, dots.llm1's). The block then runs on its sequence slice, every weight
    whole, its gradients summed, as a block with no shared expert does. The plan's patterns
    become the module (and parameter) names they match, less those inside such blocks."""
    modules = [name for name, _ in model.named_modules() if name]
    blocks = beside_experts(model, experts)
    if not blocks:
        return plan
    params = [name for name, _ in model.named_parameters()]
    concrete: dict[str, str] = {}
    for pattern, style in plan.items():
        names = params if parse_style(style)[0] in PARAMS else modules
        concrete.update({name: style for name in names if fnmatchcase(name, pattern)
                         and not any(name.startswith(f"{block}.") for block in blocks)})
    return concrete


def block_list(model: nn.Module) -> str | None:
    """The name of the model's block list: the ModuleList of the pp plan, else the one the tp
    plan's patterns reach into ("model.layers" of "model.layers.*.mlp.up_proj"), else the
    one of the cut inferred for a model that declares no pp plan (models/hf/stages.py)."""
    modules = dict(model.named_modules())
    lists = [key for key in declared(model, "pp") if isinstance(modules.get(key), nn.ModuleList)]
    if not lists:
        lists = [name for name, module in modules.items() if isinstance(module, nn.ModuleList)
                 and any(pattern.startswith(f"{name}.*.") for pattern in declared(model, "tp"))]
    if not lists:  # laid out as its siblings (HunYuan's plans split only the embedding and the head)
        lists = [key for key in hf_stages.inferred_plan(model) if isinstance(modules.get(key), nn.ModuleList)]
    return lists[0] if len(lists) == 1 else None


def _blocks_for_sp(model: nn.Module) -> str:
    name = block_list(model)
    if name is None:
        raise PlaitError(f"sequence parallelism: plait cannot tell {type(model).__name__}'s blocks from its plans",
                         hint="drop --sp, or give parallelize an adapter (plait.parallel.seam)")
    return name


def declared(model: nn.Module, kind: str) -> dict[str, Any]:
    """The full plan `model` declares ("tp" or "pp"), as transformers 5 composes it on the model
    (`model.tp_plan`); older transformers only keeps the pieces, composed the same way here:
    the base model's plan from its config (prefixed with where the base model sits) and the
    class's own (the head's)."""
    plan = getattr(model, f"{kind}_plan", None)
    if isinstance(plan, dict):
        return dict(plan)
    config = getattr(model, "config", None)
    base = getattr(config, f"base_model_{kind}_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix and isinstance(getattr(model, prefix, None), nn.Module)
    composed = {(f"{prefix}.{key}" if inner else key): value for key, value in base.items()}
    return {**composed, **(getattr(type(model), f"_{kind}_plan", None) or {})}


def _base(style: str) -> str:
    """A plait style's kind, without its fusion or its "+share" ("column_gather+share" -> "column_gather")."""
    return parse_style(style.split("+")[0])[0]
