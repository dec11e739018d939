"""Build a transformers model from a local directory, and write one back: offline, always.

`build_hf_model` gives the `AutoModelForCausalLM` of DIR/config.json, with DIR's safetensors
weights when it has them, else initialised from the seed: torch's generator is seeded just
before transformers initialises, so every rank, whatever its layout, starts from the same
weights. The model is returned as it is (its own class and parameter names): strategies
pick their adapter by that class, and checkpoints keep its names.

The reverse, a directory `from_pretrained` reads, is `plait ckpt export --hf`
(plait/families/hf/export.py).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from fnmatch import fnmatchcase
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from plait.errors import PlaitError
from plait.models.gpt.config import GPTConfig
from plait.models.hf.config import HFModelDir, sliding_share
from plait.models.hf.experts import counts_routing, dense_experts
from plait.models.hf.gated import remake_gated_products, remade
from plait.models.hf.inferred import inferred_tp_plan
from plait.models.hf.own_forward import own_parts
from plait.models.hf import gpt2, stages as hf_stages
from plait.models.hf.plans import (beside_experts, block_list, cut_plan, declared, dispatched_experts,
                                   without_experts)
from plait.models.hf.styles import ATTENTION_PROJECTIONS, mixes_tokens, no_cache, probe_ids, text_config
from plait.parallel.deferred import recording
from plait.parallel.probe import quiet
from plait.parallel.seam import Parts
from plait.parallel.tensor.layers import head_vectors
from plait.parallel.zero.shard import edge_units, find_units
from plait.parallel.tensor.plan import first_input_name, holds_the_sequence, on_the_same_slice


def _transformers() -> Any:
    """transformers, kept offline and quiet (no hub lookups, no progress bars)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise PlaitError("--model hf:DIR needs the `transformers` library", hint="pip install 'plait[hf]'") from None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers


def build_hf_model(hf: HFModelDir, seed: int) -> nn.Module:
    """DIR's causal language model in training mode, from its weights or from `seed`."""
    transformers = _transformers()
    auto = transformers.AutoModelForCausalLM
    torch.manual_seed(seed)  # also for any weight the files lack: the same on every rank
    try:
        if hf.weights and not recording():  # on the meta path each rank reads its slices later (weights.py)
            model, info = auto.from_pretrained(str(hf.path), local_files_only=True, output_loading_info=True)
            _say_what_was_not_loaded(hf, info)
        else:
            config = transformers.AutoConfig.from_pretrained(str(hf.path), local_files_only=True)
            with _initialised_even_on_meta():
                model = auto.from_config(config)
    except PlaitError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers and safetensors raise their own types
        raise PlaitError(f"--model hf:{hf.path}: transformers cannot build it: {_first_line(exc)}",
                         hint="check config.json and the safetensors files (load them with from_pretrained)") from None
    model.config.use_cache = False  # training keeps no key/value cache
    remake_gated_products(model)  # as the shape reading's model (`_built_on_meta`)
    return model.float().train()  # from_pretrained returns eval mode; the trainer casts to --precision


def fails_on_its_own(hf: HFModelDir, exc: BaseException, batch: int, length: int) -> str | None:
    """`exc`'s first line (`_first_line`) where DIR's model fails so on its own: built whole
    at one process on the meta device from config.json and fed `batch` sequences of `length`
    ids, its forward raises the very same line; else None (it runs, fails otherwise, or
    transformers cannot build it, which `build_hf_model` has said already).

    Read only after a training step failed, to tell a model whose sizes disagree with each
    other (DeepSeek-V3 with 2 K/V heads for 4 query heads: transformers builds it, and its
    attention cannot broadcast the heads) from a split that plait got wrong, which the same
    forward at one process does not raise. Meta checks shapes as the CPU does, and holds no
    memory; as the shape reading's forwards, it runs the experts' stand-ins (`_experts_stood_in`)
    and reads the positions as one sequence each (`_one_sequence`), where meta holds no values."""
    line = _first_line(exc)
    try:
        model = _built_on_meta(_transformers(), hf)
    except Exception:  # noqa: BLE001 - not buildable here: nothing to compare with
        return None
    ids = probe_ids(model, batch * length).view(batch, length)
    try:
        with quiet(model), _experts_stood_in(model), _one_sequence():
            model(input_ids=ids, use_cache=False)
    except Exception as own:  # noqa: BLE001 - the model's own failure, whatever its kind
        return line if _first_line(own) == line else None
    return None


def _built_on_meta(transformers: Any, hf: HFModelDir) -> nn.Module:
    """DIR's causal language model as `AutoModelForCausalLM.from_config` builds it from
    config.json on the meta device (no memory, no weights), for reading, not training."""
    config = transformers.AutoConfig.from_pretrained(str(hf.path), local_files_only=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    remake_gated_products(model)  # as the model that trains (`build_hf_model`): what it keeps is read
    return model


@contextlib.contextmanager
def _initialised_even_on_meta() -> Iterator[None]:
    """transformers skips `_init_weights` when it sees the meta device (it expects weights to
    be loaded); plait's meta build (plait.parallel.deferred) records that initialisation, so
    the weights drawn later are `from_config`'s. Elsewhere this changes nothing: the check it
    quiets answers None for the host already."""
    import transformers.modeling_utils as utils

    check = getattr(utils, "get_torch_context_manager_or_global_device", None)
    if check is None:  # another release: its own rule stands (the meta build then says so)
        yield
        return
    utils.get_torch_context_manager_or_global_device = lambda: None
    try:
        yield
    finally:
        utils.get_torch_context_manager_or_global_device = check


def _say_what_was_not_loaded(hf: HFModelDir, info: dict) -> None:
    """Weights of the wrong shape are refused; weights the files lack start from the seed,
    and the user is told which (only rank 0 speaks)."""
    mismatched = info.get("mismatched_keys") or []
    if mismatched:
        raise PlaitError(f"--model hf:{hf.path}: {len(mismatched)} tensor(s) in the safetensors files have another "
                         f"shape than config.json gives, e.g. {list(mismatched)[0]}",
                         hint="the weights belong to another config.json; use the pair that was saved together")
    missing = sorted(info.get("missing_keys") or [])
    if missing and os.environ.get("RANK", "0") == "0":
        print(f"plait: note: --model hf:{hf.path}: {len(missing)} weight(s) not in its files start from the seed: "
              f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}", flush=True)


__all__ = ["build_hf_model"]


def measured_shape(hf: HFModelDir, kept: bool = True) -> GPTConfig:
    """config.json's shape (HFModelDir.shape) with what only the model itself says, read off the
    model transformers builds from the config on the meta device (no memory, no weights): its
    MLP's width and how many weight matrices it has (SwiGLU's three; relu² and GELU's two), its q/k norms and
    block norms, its experts (_moe_fields) and what its tp plan splits (_tp_regions), and, with
    `kept`, what autograd keeps of its blocks (`_kept_terms`: forwards on the CPU for a small
    model, on meta for a large one, seconds; without it the formulas' stand, where only
    parameters and traffic are read). Without transformers installed, config.json's reading stands: a
    Llama-like MLP."""
    shape = hf.shape()
    if shape.arch == "gpt2":  # its adapter keeps the tied embedding and head whole under tp
        shape = replace(shape, vocab_split=False, embedding_split=False)
    try:
        transformers = _transformers()
    except PlaitError:
        return shape
    try:
        model = _built_on_meta(transformers, hf)
    except Exception as exc:  # noqa: BLE001 - transformers raises its own types
        raise PlaitError(f"--model hf:{hf.path}: transformers cannot build it: {_first_line(exc)}",
                         hint="check config.json (AutoModelForCausalLM.from_config must accept it)") from None
    name = block_list(model)  # read once: each reading walks the model and its plans
    layers = _blocks(model, name)
    name, layers = _every_stack(model, name, layers)
    parts = _declared_parts(model, name) if name and layers else None  # read once too: it may run a forward
    if shape.arch == "gpt2":  # its block is described by its arch; ZeRO-3's units as any family's, what it keeps measured
        shape = replace(shape, **_zero3_edges(model, layers, parts, {}))
        return replace(shape, **_kept_terms(model, layers, shape, _gpt2_regions(name), name)) if kept else shape
    shape = _blocks_as_run(model, layers, shape)
    shape = replace(shape, **_moe_fields(model, layers, shape))  # first: which blocks are dense
    width = _mlp_width(layers, shape)
    shape = replace(shape, ffn_hidden=width) if width else shape
    matrices = _mlp_matrices(layers, shape)
    shape = replace(shape, mlp_matrices=matrices) if matrices else shape
    shape = replace(shape, remade_products=remade(_mlp_of(_first_dense_block(layers, shape))),
                    remade_shared=_shared_remade(layers, shape))
    plan = _block_plan(model, name)
    shape = replace(shape, **_qk_norm(layers, shape, plan), norm_params=_norm_params(layers, shape))
    shape = replace(shape, sp_norm_extra=_norm_extra(layers, shape),
                    residual_streams=_residual_streams(model, layers), sp_sliced_inputs=_per_layer_inputs(model))
    shape = replace(shape, **_tp_regions(model, name, layers, shape, plan), **_ends_split(model),
                    **_zero3_edges(model, layers, parts, plan))
    shape = replace(shape, whole_biases=_whole_biases(layers, shape, plan, name),
                    split_mlp_scalars=_split_mlp_scalars(layers, shape))
    shape = replace(shape, **_tally(model, layers, shape, plan, name, parts), attention_share=_attention_share(model, shape))
    return replace(shape, **_kept_terms(model, layers, shape, plan, name)) if kept else shape  # last: it casts the model


def _gpt2_regions(blocks: str | None) -> dict[str, str]:
    """GPT-2's tp plan (models/hf/gpt2.GPT2_PLAN) in the words `_row_regions` reads, for measuring
    what each region keeps: its column entries as colwise, its row entries as rowwise, under
    the block list's name as this model spells it. The plan stays the one record of the split."""
    if blocks is None:
        return {}
    styles = {"column": "colwise", "row": "rowwise"}
    return {blocks + key.removeprefix(gpt2.BLOCKS): styles[style.split(":")[0]]
            for key, style in gpt2.GPT2_PLAN.items() if style.split(":")[0] in styles}


def _ends_split(model: nn.Module) -> dict[str, Any]:
    """How the declared plan splits the embedding and the head where not both by vocabulary
    (GPTConfig.embedding_split, vocab_split, head_sums_logits): the embedding whole where no
    entry splits it (DBRX's, Inkling-2's), the head by its input (a row style: Inkling's),
    summing whole logits, or whole where no entry names it beside an embedding split alone
    (Nemotron-H's: its whole logits on every rank). {} for a plan that splits both by
    vocabulary, or names neither (an inferred plan then splits both)."""
    plan = declared(model, "tp")
    head = next((style for key, style in plan.items() if key.split(".")[-1] == "lm_head"), None)
    embedding = "embedding_rowwise" in plan.values()
    if head is None:
        return {"vocab_split": False} if embedding else {}
    fields: dict[str, Any] = {} if embedding else {"embedding_split": False}
    if embedding:
        fields["embedding_summed_params"] = _embedding_extras(model)
    if head in ROWS:
        fields.update(vocab_split=False, head_sums_logits=True)
    return fields


def _zero3_edges(model: nn.Module, layers: nn.ModuleList | None, parts: Parts | None,
                 plan: dict[str, str]) -> dict[str, Any]:
    """GPTConfig.embedding_unit, edge_units and edge_units_last, by ZeRO-3's own rule (plait.
    parallel.zero.shard.edge_units) on the model's blocks. Inkling's embedding, which holds its
    norm as a child, is no unit: its table stays whole in the root (an estimate that took it for
    one priced ZeRO-3's peak a table light, 32 KiB of 353 on 2 ranks). Gemma 3n's and Gemma 4's
    per-layer embedding and projection are units of their own, each gathered around its forward
    (priced in the root, whole throughout, Gemma 4's peak came 10 KiB over), and so is each
    module of a list beside the blocks (find_units: Gemma 3n's AltUp projections), and GPT-2's
    learned positions. A tied table, which no edge is, is a unit where a pipeline cuts it from
    its head (the estimate reads `embedding_unit` only there), as the runtime makes each stage's
    copy one. Each edge runs on the side of the blocks where the stage holding it does
    (`_edge_after_blocks`), and one the plan splits by its input (`_split_after_blocks`) is a
    tp rank's share: Qwen4-Exp's hyper-connection mixer, after its blocks and half of it split,
    taken whole before them put ZeRO-3's peak 1 KiB a rank under under tp 2 and 4 KiB over
    under pp 2."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    units = find_units(model)
    edges = edge_units(model, units)
    kinds = {type(block) for block in layers or []}  # a second stack of blocks (HRM's) is no edge: it is counted with the blocks
    others = [unit for unit in [*edges, *units] if type(unit) not in kinds and unit is not embedding and unit is not head]
    split = {id(p) for module in _split_by_input(model, plan).values() for p in module.parameters()}
    sizes = [(unit, sum(p.numel() for p in unit.parameters() if p.requires_grad and id(p) not in split),
              sum(p.numel() for p in unit.parameters() if p.requires_grad and id(p) in split)) for unit in others]
    after = _edge_after_blocks(model, layers, parts)
    # a tied table is a unit wherever a pipeline cuts it from its head (the first stage's copy)
    tied = isinstance(embedding, nn.Module) and isinstance(head, nn.Module) and any(
        p is q for p in embedding.parameters() for q in head.parameters())
    unit = not isinstance(embedding, nn.Module) or tied or any(edge is embedding for edge in edges)
    return {"embedding_unit": unit,
            "edge_units": tuple(whole + part for module, whole, part in sizes if not after(module)),
            "edge_units_last": tuple((whole, part) for module, whole, part in sizes if after(module))}


def _split_by_input(model: nn.Module, plan: dict[str, str]) -> dict[str, nn.Module]:
    """{key: module} of the plan's entries that split a layer by its input features and hand
    the whole output on ("rowwise_split_input": Qwen4-Exp's hyper-connection mixer); a key with
    the blocks' "*" names no one module (an empty one): the blocks are tallied apart."""
    return {key: _submodule(model, key) for key, style in (plan or {}).items() if style == "rowwise_split_input"}


def _submodule(model: nn.Module, key: str) -> nn.Module:
    """The module a plan's key names, an empty one where it names none (a key with a "*" of
    the blocks', or one this model lacks)."""
    try:
        return model.get_submodule(key)
    except AttributeError:
        return nn.Module()


def _edge_after_blocks(model: nn.Module, layers: nn.ModuleList | None,
                       parts: Parts | None) -> Callable[[nn.Module], bool]:
    """Whether a module outside the blocks runs after them, on the last stage: by the pp cut
    `parts` where one is read (the pieces its last stage holds), else by where the model
    registers it against its first block (ZeRO-3's own order: shard.with_edges)."""
    if parts is not None:
        held = {id(m) for key in parts.last for m in model.get_submodule(key).modules()}
        return lambda module: id(module) in held
    order = {id(m): i for i, m in enumerate(model.modules())}
    first = order.get(id(layers[0]), -1) if layers else -1
    return lambda module: first >= 0 and order[id(module)] > first


def _embedding_extras(model: nn.Module) -> int:
    """GPTConfig.embedding_summed_params: the parameters of the input embedding beyond its table
    (Inkling's `embed_norm`, run inside its forward), which plait's in-place vocabulary split
    leaves partial on each rank (parallel/tensor/layers._InPlaceVocab)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(embedding, nn.Module):
        return 0
    return sum(p.numel() for name, p in embedding.named_parameters() if name != "weight" and p.requires_grad)


def _per_layer_inputs(model: nn.Module) -> int:
    """GPTConfig.sp_sliced_inputs: the width of the per-layer inputs each block is handed beside
    its hidden states, as Gemma 3n's and Gemma 4's configs name it (hidden_size_per_layer_input)."""
    width = getattr(text_config(model), "hidden_size_per_layer_input", 0)
    return width if isinstance(width, int) else 0


def _blocks(model: nn.Module, name: str | None) -> nn.ModuleList | None:
    """The model's blocks: the list its plans name (`name`, plans.block_list), else its
    longest module list."""
    found = model.get_submodule(name) if name else None
    if isinstance(found, nn.ModuleList):
        return found
    return max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len, default=None)


def _every_stack(model: nn.Module, name: str | None,
                 layers: nn.ModuleList | None) -> tuple[str | None, nn.ModuleList | None]:
    """The blocks' list's name and `layers` with the blocks of every other list of their kind,
    as one list in the order the model registers them: HRM's two stacks (`L_module.layers`, run
    first, and `H_module.layers`), whose plans name both, so that no one list is named
    (`block_list`). Read as one stack with no name, its blocks went uncounted (config.json's
    layers priced by the formulas, its k, v and gate projections as a Llama's: 2 KiB of
    parameters short a rank on 2, and every ZeRO figure with them); read so, the first stack's
    name stands for both (their plans' entries alike). The list as it is where it holds every
    block of its kind."""
    if not layers:
        return name, layers
    kinds = tuple({type(block) for block in layers})
    stacks = [(key, m) for key, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)
              and all(isinstance(block, kinds) for block in m)]
    if len(stacks) < 2:
        return name, layers
    return name or stacks[0][0], nn.ModuleList([block for _, stack in stacks for block in stack])


def _blocks_as_run(model: nn.Module, layers: nn.ModuleList | None, shape: GPTConfig) -> GPTConfig:
    """`shape` with as many layers as the model builds blocks, and how many times one forward
    (on meta) runs each (GPTConfig.block_runs), where it runs every block and no other module
    of their kind: Dory's config counts a block's attention and its MLP as two layers (6 for
    its 3 blocks), which priced 1.6x its parameters and counted no block; a looped model runs
    its loop's blocks again each pass (Inkling-2-Loop's loop layers, Dory's recurrent ones),
    and each run dispatches, computes and keeps its activations again. A model that holds
    blocks of the kind outside the list, or whose forward does not run on meta, keeps
    config.json's count (HRM's second stack is in the list: `_every_stack`)."""
    if not layers:
        return shape
    kinds = tuple({type(block) for block in layers})
    called: list[nn.Module] = []
    hooks = [module.register_forward_pre_hook(lambda module, args: called.append(module))
             for module in model.modules() if isinstance(module, kinds)]
    try:
        with quiet(model), _experts_stood_in(model):
            model(input_ids=probe_ids(model, PROBED_TOKENS))
    except Exception:  # noqa: BLE001 - a forward that does not run on meta: config.json's count stands
        return shape
    finally:
        for hook in hooks:
            hook.remove()
    index = {id(block): i for i, block in enumerate(layers)}
    runs = [0] * len(layers)
    for module in called:
        if id(module) not in index:
            return shape
        runs[index[id(module)]] += 1
    if min(runs) == 0:
        return shape
    return replace(shape, n_layers=len(layers), block_runs=tuple(runs) if max(runs) > 1 else ())


def _qk_norm(layers: nn.ModuleList | None, shape: GPTConfig, plan: dict[str, str]) -> dict[str, Any]:
    """What the blocks' attention normalises q and k over (GPTConfig.qk_norm), from the width of
    the first such q_norm's weight: one head ("head"), every head ("full"), or none (""); and
    a block's mean of their weights in units of the first block's (qk_norm_share: a hybrid's
    linear-attention blocks have none, Qwen3-Next's three in four; Gemma 4's global layers
    norm wider heads). A per-head norm counts only where `plan` splits q_proj by heads
    ("colwise"): an attention left whole, or whose q is gathered whole (MiniMax-M3's),
    normalises whole heads on every rank, with nothing to sum."""
    weights = [getattr(getattr(getattr(block, "self_attn", None), "q_norm", None), "weight", None)
               for block in layers or []]
    held = [weight for weight in weights if isinstance(weight, torch.Tensor) and weight.dim() == 1]
    if not held:
        return {"qk_norm": ""}
    share = sum(weight.numel() for weight in held) / held[0].numel() / len(weights)
    if held[0].numel() == shape.head_dim:
        split = any(key.endswith(".q_proj") and style == "colwise" for key, style in plan.items())
        return {"qk_norm": "head", "qk_norm_share": share} if split else {"qk_norm": ""}
    if held[0].numel() == shape.n_heads * shape.head_dim:
        return {"qk_norm": "full", "qk_norm_share": share}
    return {"qk_norm": ""}


ROWS = ("rowwise", "rowwise_split_input", "rowwise_rep")  # the styles that close a region: its sum leaving
SHARED_EXPERTS = ("shared_expert", "shared_experts", "shared_mlp")  # an MoE block's names for them (HunYuan's the last)


def _block_plan(model: nn.Module, blocks: str | None) -> dict[str, str]:
    """The tp plan the blocks run under: the declared one less the experts its ep plan keeps
    whole, or the one plait infers where none is declared (`blocks`: the name of its block
    list). {} where it cannot tell."""
    if blocks is None:
        return {}
    plan = declared(model, "tp")
    return without_experts(plan, dispatched_experts(declared(model, "ep"))) if plan else inferred_tp_plan(model, blocks)


def _tp_regions(model: nn.Module, blocks: str | None, layers: nn.ModuleList | None, shape: GPTConfig,
                plan: dict[str, str]) -> dict[str, Any]:
    """Which of a block's regions the model's tp plan (`_block_plan`) splits (GPTConfig.tp_attention,
    tp_mlp, tp_shared_experts): those a row-parallel layer in its blocks closes, under an attention (a
    name holding "attn" or "attention"), under shared experts ("shared"), or neither (the
    MLP; all of a model whose experts plait does not know, as its shape's dense MLP); how each
    block's attention and other mixers split (`_attention_kinds`, `_whole_mixers`), and what
    SP reads whole. {} where it cannot tell."""
    if blocks is None or not plan:
        return {}
    inside = [key[len(blocks) + 1:].lower() for key, style in plan.items()
              if key.startswith(f"{blocks}.") and style in ROWS]
    attention = [key for key in inside if "attn" in key or "attention" in key
                 or key.startswith("*.") and _projects_attention(layers, key[2:])]
    shared = [key for key in inside if "shared" in key and key not in attention] if shape.is_moe else []
    tail = _entered_tail(model, plan, blocks, layers)
    return {"tp_attention": bool(attention), **_attention_kinds(layers, plan, blocks, shape.d_model),
            "sp_whole_mixers": _whole_mixers(layers, plan, blocks), "tp_shared_experts": bool(shared),
            **_read_whole(model, layers, plan, blocks),
            "tp_mlp": len(inside) > len(attention) + len(shared), "tp_entered_tail": tail,
            "mla_down_params": _mla_down_params(model, plan, blocks) if tail else 0,
            "sp_mlp_read_whole": _adds_residual(_mlp_of(_first_dense_block(layers, shape))),
            "tp_summed_params": _summed_by_plan(layers, plan, blocks),
            "moe_dense_mlps": _dense_beside_experts(layers, shape, plan, blocks) if shape.is_moe else 0,
            "tp_expert_entries": _expert_entries(layers, shape, plan, blocks) if shape.is_moe else (0.0, 0.0),
            **_gathered(layers, plan, blocks, attention=shape.qk_norm != "full")}


UNGRADED = ("indexer",)  # an attention's layers the loss sends no gradient (DSA's top-k key picker)
OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "dense", "c_proj", "wo")  # an attention's last layer, by name
COLUMN_STYLES = ("colwise", "colwise_gather_output", "colwise_rep", "packed_colwise")


def _attention_kinds(layers: nn.ModuleList | None, plan: dict[str, str], blocks: str,
                     d_model: int) -> dict[str, float]:
    """How each block's attention splits, as a mean over the blocks (a hybrid's differ):
    tp_attention_share, the split attentions (closed by a row layer) a block runs, a share of
    the blocks where a hybrid's differ, two a block for LongCat's;
    tp_attention_entries, the all-reduces a block's attention runs per micro-batch where the
    plan splits its layers but no row layer closes it (Qwen3-Next's linear attention, its
    projections gathered whole): one for the layers reading the block's input, which enter
    together, and one for an output projection, which reads the attention's own result; and
    tp_entry_extra (`_entry_extra`). A block whose attention no entry names (OLMo-hybrid's
    linear attention) has none of them: whole on every rank, and read whole under SP."""
    if not layers:
        return {}
    split, entries, extra, reads_input = 0, 0, 0, None
    for block in layers:
        styles: dict[str, str] = {}
        for key, style in plan.items():
            inside = key[len(blocks) + 3:] if key.startswith(f"{blocks}.*.") else ""
            if _in_block(block, inside) is not None and _under_attention(layers, inside):
                styles[inside] = style
        if any(style in ROWS for style in styles.values()):
            count = max(_matched(block, inside) for inside, style in styles.items() if style in ROWS)
            split += count  # LongCat runs two attentions a block ("self_attn.*.o_proj")
            widths = _column_widths(block, styles)
            extra += count * _entry_extra(widths, d_model)
            if reads_input is None:
                reads_input = d_model in widths
            continue
        columns = [inside.rsplit(".", 1)[-1] for inside, style in styles.items() if style in COLUMN_STYLES]
        outputs = sum(name in OUTPUT_PROJECTIONS for name in columns)
        entries += outputs + (len(columns) > outputs)
    return {"tp_attention_share": split / len(layers), "tp_attention_entries": entries / len(layers),
            "tp_entry_extra": extra / len(layers), "attention_reads_input": reads_input is not False}


def _names_attention(inside: str) -> bool:
    """Whether a plan entry named from the block lies under its attention: its first module's
    name holds "attn" or "attention" (self_attn, attention, linear_attn...)."""
    child = inside.split(".")[0].lower()
    return "attn" in child or "attention" in child


def _under_attention(layers: nn.ModuleList | None, inside: str) -> bool:
    """Whether a plan entry named from the block lies under its attention: by its first
    module's name (`_names_attention`), or as a query, key, value or output projection of a
    child that mixes tokens (`_projects_attention`)."""
    return _names_attention(inside) or _projects_attention(layers, inside)


def _projects_attention(layers: nn.ModuleList | None, inside: str) -> bool:
    """Whether a plan entry names an attention's projection (ATTENTION_PROJECTIONS) under a
    child that mixes tokens (styles.mixes_tokens) in some block: Nemotron-H calls each block's
    one child its "mixer", an attention in some blocks and a mamba or an MLP in the others,
    and transformers 5.25 splits its attention's q, k, v and o_proj by name."""
    parent, _, leaf = inside.rpartition(".")
    if not parent or leaf.lower() not in ATTENTION_PROJECTIONS:
        return False
    return any(_in_block(block, inside) is not None and (child := _in_block(block, parent)) is not None
               and mixes_tokens(child) for block in layers or [])


def _entry_extra(widths: list[int | None], d_model: int) -> int:
    """Features a token the column layers of one split attention enter with under tp, beyond
    the hidden size the attention is priced at (GPTConfig.tp_entry_extra). Layers reading the
    block's input (q, k, v: as wide as the hidden) enter once together; a layer reading a
    latent (MLA's q_b_proj and kv_b_proj, 1,536 and 512 wide in DeepSeek-V2 beside a 4,096
    hidden) enters on its own, with its own width: less than the hidden where only latents
    are read (negative), more where both are (HY-V4's gate_proj reads the hidden beside them).
    Read from the layers' input widths: a latent exactly as wide as the hidden counts as the
    hidden (`widths`: `_column_widths`). 0 where a column layer has no `in_features` to read
    (GPT-2's Conv1D)."""
    if not widths or not all(isinstance(width, int) for width in widths):
        return 0
    return sum(width for width in widths if width != d_model) + (d_model in widths) * d_model - d_model


def _column_widths(block: nn.Module, styles: dict[str, str]) -> list[int | None]:
    """The input widths of the column layers `styles` names in `block` (None: a layer without
    `in_features`)."""
    return [getattr(_in_block(block, inside), "in_features", None)
            for inside, style in styles.items() if style in COLUMN_STYLES]


def _whole_mixers(layers: nn.ModuleList | None, plan: dict[str, str], blocks: str) -> float:
    """GPTConfig.sp_whole_mixers, a block's mean: its children that mix tokens
    (styles.mixes_tokens) and that no plan entry names, beyond the one a block's attention
    accounts for (Falcon-H1's mamba beside its attention); -1 for a block that mixes no tokens
    at all, no attention the plan splits either (Nemotron-H's MoE and MLP blocks): there is no
    attention to read whole."""
    if not layers:
        return 0.0
    named = [key[len(blocks) + 3:] for key in plan if key.startswith(f"{blocks}.*.")]
    extra = 0
    for block in layers:
        mixers = [name for name, child in block.named_children() if mixes_tokens(child)]
        whole = _whole_children(block, named)
        extra += len(whole) - (1 if whole and len(whole) == len(mixers) else 0)
        if not mixers and not any(_in_block(block, key) is not None and _under_attention(layers, key) for key in named):
            extra -= 1
    return extra / len(layers)


def _whole_children(block: nn.Module, named: list[str]) -> list[nn.Module]:
    """The block's children SP reads whole: those that mix tokens (styles.mixes_tokens) and that
    no entry of the plan (`named`, from the block) names in this block, as
    styles._unsplit_attention finds them: Nemotron-H's "mixer.q_proj" names the attention
    blocks' mixer, not the mamba blocks' one."""
    return [child for name, child in block.named_children() if mixes_tokens(child)
            and not any((key == name or key.startswith(f"{name}.")) and _in_block(block, key) is not None
                        for key in named)]


def _read_whole(model: nn.Module, layers: nn.ModuleList | None, plan: dict[str, str],
                blocks: str) -> dict[str, tuple[int, ...]]:
    """GPTConfig.sp_read_whole and sp_read_whole_count, under the plan's SP form (the blocks
    around experts kept whole, plans.whole_beside_experts): each block's parameters whose
    gradients SP does not sum, those in the children it reads whole and those no gradient
    reaches (AFMoE's expert bias, a buffer kept as a parameter); and how many children it reads
    whole."""
    kept = _whole_under_sp(model)
    unsummed, children = [], []
    for i, block in enumerate(layers or []):
        children.append(_whole_children(block, list(_inside(plan, blocks, i, kept))))
        whole = {id(p) for child in children[-1] for p in child.parameters()}
        unsummed.append(sum(p.numel() for p in block.parameters() if id(p) in whole or not p.requires_grad))
    return {"sp_read_whole": tuple(unsummed), "sp_read_whole_count": tuple(len(found) for found in children),
            "sp_read_whole_passes": _read_whole_passes(model, layers, children)}


def _whole_under_sp(model: nn.Module) -> set[str]:
    """The blocks the plan's SP form keeps whole: those around the experts modules the ep plan
    dispatches (plans.whole_beside_experts), named as the model names them."""
    return beside_experts(model, dispatched_experts(declared(model, "ep")))


def _read_whole_passes(model: nn.Module, layers: nn.ModuleList | None,
                       children: list[list[nn.Module]]) -> tuple[tuple[float, float], ...]:
    """GPTConfig.sp_read_whole_passes: what each block's children read whole take and hand on
    along the sequence beyond one tensor each, by the tests the region running them whole makes
    (parallel/tensor/plan: on_the_same_slice, holds_the_sequence), in d_model-wide tensors. A
    forward's signature does not say what it returns, so the model runs on the meta device over
    two sequences of PROBED_TOKENS, its routed experts stood in for (their loops do not run
    there), as far as the first block of each kind (`_block_kind`), whose reading its kind's
    other blocks take. () where no block reads a child whole, or where that forward fails: one
    tensor in and one out each, as before."""
    if not layers or not any(children):
        return ()
    d_model = text_config(model).hidden_size
    kinds = [_block_kind(block, found) for block, found in zip(layers, children)]
    first = {kind: i for i, kind in reversed(list(enumerate(kinds)))}  # each kind's first block
    passes = {i: [0.0, 0.0] for i in first.values()}
    waiting = {id(child) for i in first.values() for child in children[i]}

    def noted(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            name = first_input_name(module)
            x = args[0] if args else kwargs.get(name or "")
            if isinstance(x, torch.Tensor) and x.dim() >= 3:
                rest = [*args[1:], *(value for key, value in kwargs.items() if key != name)]
                outputs = out[1:] if isinstance(out, tuple) else ()
                width = x.shape[:2].numel() * d_model
                passes[i][0] += sum(value.numel() for value in rest if on_the_same_slice(value, x)) / width
                passes[i][1] += sum(value.numel() for value in outputs if holds_the_sequence(value, x.shape[:2])) / width
            waiting.discard(id(module))
            if not waiting:
                raise _AllSeen
        return hook

    hooks = [child.register_forward_hook(noted(i), with_kwargs=True) for i in first.values() for child in children[i]]
    try:
        with _experts_stood_in(model), torch.no_grad():
            model(input_ids=probe_ids(model, PROBED_TOKENS).repeat(2, 1))
    except _AllSeen:
        pass
    except Exception:  # noqa: BLE001 - a forward that does not run on meta: one in, one out, as before
        return ()
    finally:
        for hook in hooks:
            hook.remove()
    if waiting:  # a child the forward never ran
        return ()
    return tuple(tuple(passes[first[kind]]) for kind in kinds)


class _AllSeen(Exception):
    """Raised once every child `_read_whole_passes` waits for has run: the rest of the forward is not needed."""


def _block_kind(block: nn.Module, whole: list[nn.Module]) -> tuple:
    """What makes two blocks read alike: their children's names and classes, and which of them
    are read whole (Nemotron-H's attention, mamba, MoE and MLP blocks are four kinds)."""
    read_whole = {id(child) for child in whole}
    return (tuple((name, type(child).__name__) for name, child in block.named_children()),
            tuple(id(child) in read_whole for child in block.children()))


@contextlib.contextmanager
def _stood_in(modules: list[nn.Module], forward_of: Callable[[nn.Module], Callable[..., Any]]) -> Iterator[None]:
    """Each of `modules` runs `forward_of(module)` in place of its own forward, for the duration
    (set on the instance, deleted after: the class's stands again)."""
    for module in modules:
        module.forward = forward_of(module)
    try:
        yield
    finally:
        for module in modules:
            del module.forward


def _experts_stood_in(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """The model's routed experts modules (each once, however many blocks hold it) answering
    zeros shaped as their tokens, for a probe forward on meta: their loops over experts and
    their grouped products (bf16 only) do not run there, and the probes read around them."""
    experts = {id(m.experts): m.experts for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module)}
    return _stood_in(list(experts.values()), lambda module: _zeros_like_input)


def _zeros_like_input(*args: Any, **kwargs: Any) -> torch.Tensor:
    """A routed experts module's stand-in: zeros shaped as the tokens it was handed."""
    return torch.zeros_like(next(t for t in _tensors_in((args, kwargs)) if t.is_floating_point()))


def _dense_beside_experts(layers: nn.ModuleList | None, shape: GPTConfig, plan: dict[str, str],
                          blocks: str) -> int:
    """GPTConfig.moe_dense_mlps: the dense MLPs the plan splits in the first MoE block, beside
    its experts: its row layers outside its attention, its experts and its shared experts
    (Gemma 4's `mlp`, beside the `router` and `experts` of its block; LongCat's two `mlps`
    beside its MoE module). DeepSeek's MoE blocks have none: their `mlp` is the MoE module."""
    block = next((block for i, block in enumerate(layers or []) if shape.moe_layer(i)), None)
    if block is None:
        return 0
    # a row layer closing a region ("rowwise"; one fed a whole input keeps its slice instead:
    # Qwen4-Exp's hyper-connection mixers)
    rows = [key[len(blocks) + 3:] for key, style in plan.items()
            if style == "rowwise" and key.startswith(f"{blocks}.*.")]
    dense = [inside for inside in rows
             if not any(word in inside.lower() for word in ("attn", "attention", "expert", "shared"))]
    return sum(_matched(block, inside) for inside in dense)


EXPERT_STYLES = ("moe_tp_experts", "all_reduce")  # the declared styles plait runs as split experts (styles.py)
PROBED_TOKENS = 4  # the tokens a probe forward on the meta device runs: `_expert_entries`' MoE module, `_read_whole_passes`' and `_blocks_as_run`'s model


def _expert_entries(layers: nn.ModuleList | None, shape: GPTConfig, plan: dict[str, str],
                    blocks: str) -> tuple[float, float]:
    """GPTConfig.tp_expert_entries: the floats per token that the first MoE block's split experts
    modules take beside the tokens and that carry a gradient, (the routed experts', the shared
    experts'). Each such module, and the routed experts whatever the plan says, is stood in for
    by one that notes its inputs and returns zeros, and the MoE module holding `experts` runs
    once on the meta device (its router's top-k and weights as the family computes them, no
    memory); (0, 0) where that forward fails there."""
    block = next((block for i, block in enumerate(layers or []) if shape.moe_layer(i)), None)
    holder = next((m for m in block.modules() if isinstance(getattr(m, "experts", None), nn.Module)), None) \
        if block is not None else None
    split = [module for key, style in plan.items() if style in EXPERT_STYLES and key.startswith(f"{blocks}.*.")
             for module in [_in_block(block, key[len(blocks) + 3:])] if module is not None]
    if holder is None or not split:
        return 0.0, 0.0
    widths: dict[int, float] = {}

    def noted(module: nn.Module) -> Callable[..., torch.Tensor]:
        def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
            floats = [t for t in _tensors_in((args, kwargs)) if t.is_floating_point()]
            widths[id(module)] = sum(t.numel() for t in floats[1:] if t.requires_grad) / PROBED_TOKENS
            return torch.zeros_like(floats[0])
        return forward

    # the routed experts too where ep keeps them whole: their loops do not run on meta
    stood_in = [*split, *([holder.experts] if all(holder.experts is not m for m in split) else [])]
    weight = next(holder.parameters())
    try:
        with _stood_in(stood_in, noted):
            holder(torch.zeros(1, PROBED_TOKENS, shape.d_model, device=weight.device, dtype=weight.dtype))
    except Exception:  # noqa: BLE001 - a router that does not run on meta: unpriced, as before
        return 0.0, 0.0
    routed = widths.get(id(holder.experts), 0.0) if any(holder.experts is m for m in split) else 0.0
    return routed, sum(widths.get(id(m), 0.0) for m in split if m is not holder.experts)


QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")  # the per-head norms GPTConfig.qk_norm prices


def _summed_by_plan(layers: nn.ModuleList | None, plan: dict[str, str], blocks: str) -> float:
    """GPTConfig.tp_summed_params, a block's mean: the parameters of the layers its plan keeps
    whole with their gradients summed ("replicated_with_grad_allreduce": dots3's norm of the
    rotary key, which every rank's heads read), but the per-head q and k norms `_qk_norm` prices."""
    if not layers:
        return 0.0
    keys = [key[len(blocks) + 3:] for key, style in plan.items()
            if style == "replicated_with_grad_allreduce" and key.startswith(f"{blocks}.*.")
            and key[len(blocks) + 3:] not in QK_NORMS]
    held = [_in_block(block, key) for block in layers for key in keys]
    return sum(p.numel() for module in held if module is not None for p in module.parameters()) / len(layers)


def _entered_tail(model: nn.Module, plan: dict[str, str], blocks: str, layers: nn.ModuleList | None) -> int:
    """GPTConfig.tp_entered_tail: the rotary key's width of each MLA kv_a_proj the plan names
    in the first block ("mla_kv_a_proj", whose last qk_rope_head_dim outputs enter the
    attention's region; LongCat's two attentions a block have one each)."""
    rope = getattr(text_config(model), "qk_rope_head_dim", 0)
    if not layers or not isinstance(rope, int):
        return 0
    return rope * sum(_matched(layers[0], key[len(blocks) + 3:]) for key, style in plan.items()
                      if style == "mla_kv_a_proj" and key.startswith(f"{blocks}.*."))


def _matched(block: nn.Module, name: str) -> int:
    """How many of the block's modules a plan entry names (several where it has a wildcard
    inside the block: LongCat's "self_attn.*.o_proj", two)."""
    if "*" in name:
        return sum(fnmatchcase(inner, name) for inner, _ in block.named_modules())
    return int(_in_block(block, name) is not None)


def _mla_down_params(model: nn.Module, plan: dict[str, str], blocks: str) -> int:
    """GPTConfig.mla_down_params of the first block, whose plan enters MLA's rotary key on its own
    (`_entered_tail`): the parameters of its attention that no plan entry splits (the
    down-projections and their norms), but a sparse attention's indexer's (DeepSeek-V3.2's,
    GLM-DSA's): it picks the keys each query reads, top-k indices through which no gradient
    flows, so it has none to sum. An entry names a layer or a parameter itself (HY-V4's
    attention sinks, split by head), with wildcards (LongCat's "self_attn.*.q_b_proj")."""
    attention = _in_block(model.get_submodule(f"{blocks}.0"), "self_attn")
    if attention is None:
        return 0
    entries = _attention_entries(_inside(plan, blocks, 0))
    return sum(p.numel() for name, p in attention.named_parameters() if not _named_by(name, entries))


def _attention_entries(plan: dict[str, str]) -> list[str]:
    """What the entries of `plan` (named from the block) split in its attention, named from the
    attention, and the layers no gradient reaches (UNGRADED): not the rotary key's entry
    ("mla_kv_a_proj"), whose layer is kept whole."""
    return [*(key[len("self_attn."):] for key, style in plan.items()
              if key.startswith("self_attn.") and style != "mla_kv_a_proj"), *UNGRADED]


def _named_by(name: str, entries: list[str]) -> bool:
    """Whether one of `entries` names `name`, or a module holding it."""
    return any(fnmatchcase(name, entry) or fnmatchcase(name, f"{entry}.*") for entry in entries)


def _gathered(layers: nn.ModuleList | None, plan: dict[str, str], blocks: str,
              attention: bool = True) -> dict[str, tuple]:
    """GPTConfig.tp_gathered, a block's mean over the blocks: the output widths of the column
    layers the plan gathers whole ("colwise_gather_output"), the input widths of the row layers
    that take a whole input and keep their slice ("rowwise_split_input", whose input gradient
    is gathered back); and tp_gathered_calls, how many layers each is (an all-gather each, whose
    latency the step pays). A mean since a hybrid's blocks differ: Qwen3-Next's linear
    attention gathers its projections, its full attention does not. Without `attention`, the
    attention's are left out: q/k norms over every head have them priced already
    (GPTConfig.qk_norm "full", OLMo2's)."""
    widths = {"colwise_gather_output": 0, "rowwise_split_input": 0}
    calls = dict.fromkeys(widths, 0)
    for key, style in plan.items():
        if style not in widths or not key.startswith(f"{blocks}.*."):
            continue
        inside = key[len(blocks) + 3:]
        if attention or not _under_attention(layers, inside):
            for block in layers or []:
                layer = _in_block(block, inside)
                if isinstance(layer, nn.Linear):
                    widths[style] += layer.out_features if style == "colwise_gather_output" else layer.in_features
                    calls[style] += 1
    n = max(1, len(layers or []))
    return {"tp_gathered": (widths["colwise_gather_output"] / n, widths["rowwise_split_input"] / n),
            "tp_gathered_calls": (calls["colwise_gather_output"] / n, calls["rowwise_split_input"] / n)}


def _norm_params(layers: nn.ModuleList | None, shape: GPTConfig) -> int:
    """The d_model-wide weights of the first block's own norms (its direct children named a
    norm: Gemma 2's four, Cohere's one, OLMo's parameter-free LayerNorms none), which SP sums
    over tp; two where they are not all d_model wide."""
    if not layers:
        return shape.norm_params
    weights = sum(p.numel() for module in layers[0].children() if _is_norm(module) for p in module.parameters())
    return weights // shape.d_model if weights % shape.d_model == 0 else shape.norm_params


def _norm_extra(layers: nn.ModuleList | None, shape: GPTConfig) -> float:
    """GPTConfig.sp_norm_extra: a block's mean of its norms' parameters (its direct children and
    its MLP's named a norm, or a hyper-connection, that do not mix tokens, whatever they hold)
    beyond the first block's `norm_params` d_model-wide weights: AXK1's norm closing its MoE
    module, in its MoE blocks alone; AXK2's gated norms, each a norm and a two-layer gate MLP;
    DeepSeek-V4's and HY-V4's hyper-connections, which mix the residual streams around each
    attention and MLP (`attn_hc`, `ffn_hc`)."""
    if not layers:
        return 0.0
    held = sum(p.numel() for block in layers for module in _children_and_mlps(block)
               if any(word in type(module).__name__.lower() for word in OUTSIDE_KINDS)
               and not mixes_tokens(module) for p in module.parameters())
    return held / len(layers) - shape.norm_params * shape.d_model


HYPER_CONNECTIONS = ("hc_mult", "hc_count")  # the configs' stream counts: DeepSeek-V4's and HY-V4's, Qwen4-Exp's


def _residual_streams(model: nn.Module, layers: nn.ModuleList | None) -> int:
    """GPTConfig.residual_streams: the config's stream count (HYPER_CONNECTIONS) where the blocks
    hold hyper-connections (a module of that kind, or so named: Qwen4-Exp's gated residuals,
    `attn_hyper_connection`), else 1."""
    config = text_config(model)
    streams = next((value for value in (getattr(config, name, None) for name in HYPER_CONNECTIONS)
                    if isinstance(value, int)), 1)
    children = layers[0].named_children() if layers else ()
    held = any("hyperconnection" in type(module).__name__.lower() or "hyper_connection" in name
               for name, module in children)
    return streams if held and streams > 1 else 1


OUTSIDE_KINDS = ("norm", "hyperconnection")  # a block's modules around its regions, by their types' names


def _children_and_mlps(block: nn.Module) -> list[nn.Module]:
    """A block's direct children and its MLP's."""
    mlp = _mlp_of(block)
    return [*block.children(), *(mlp.children() if mlp is not None else ())]


def _is_norm(module: nn.Module) -> bool:
    """A norm: named one, holding vectors alone (DBRX's DbrxNormAttentionNorm, which wraps its
    attention between two norms, is not one)."""
    return "norm" in type(module).__name__.lower() and all(p.ndim <= 1 for p in module.parameters())


def _whole_biases(layers: nn.ModuleList | None, shape: GPTConfig, plan: dict[str, str], blocks: str | None) -> int:
    """GPTConfig.whole_biases of the first block: the biases of the row layers `plan` splits
    (added after their sum: StarCoder2's, Phi's) and, where the plan leaves the MLP whole, its
    layers' biases (OPT's fc1 and fc2)."""
    if not layers or not blocks:
        return 0
    block, total = layers[0], 0
    for key, style in plan.items():
        if style in ROWS and key.startswith(f"{blocks}.*."):
            total += _bias(_in_block(block, key[len(blocks) + 3:]))
    if not shape.tp_mlp and not shape.moe_layer(0):
        total += sum(_bias(layer) for layer in _mlp_layers(block))
    return total + _router_vectors(block)


def _router_vectors(block: nn.Module) -> int:
    """The trained vectors of a block's MoE outside its experts (GPT-OSS's router bias): whole on
    every tp rank like the router."""
    moe = next((m for m in block.modules() if isinstance(getattr(m, "experts", None), nn.Module)), None)
    if moe is None:
        return 0
    experts = {id(p) for name in ("experts", *SHARED_EXPERTS)
               if isinstance(getattr(moe, name, None), nn.Module) for p in getattr(moe, name).parameters()}
    return sum(p.numel() for p in moe.parameters() if p.ndim == 1 and p.requires_grad and id(p) not in experts)


def _first_dense_block(layers: nn.ModuleList | None, shape: GPTConfig) -> nn.Module | None:
    """The first block whose MLP is dense (not an MoE block), or None."""
    return next((block for i, block in enumerate(layers or []) if not shape.moe_layer(i)), None)


def _shared_remade(layers: nn.ModuleList | None, shape: GPTConfig) -> bool:
    """Whether the first MoE block's MLP holds a SwiGLU MLP given the remaking
    (models/hf/gated.py): its shared experts' (its grouped routed experts are not one)."""
    block = next((block for i, block in enumerate(layers or []) if shape.moe_layer(i)), None)
    mlp = _mlp_of(block)
    return mlp is not None and any(remade(module) for module in mlp.modules())


def _split_mlp_scalars(layers: nn.ModuleList | None, shape: GPTConfig) -> int:
    """GPTConfig.split_mlp_scalars of the first dense block: where the plan splits its MLP, the
    elements of the MLP's vectors and scalars outside its linear layers (Apertus's learned
    activation; a router's or grouped experts' matrices are not such)."""
    dense = _first_dense_block(layers, shape)
    mlp = _mlp_of(dense) if shape.tp_mlp else None
    if not isinstance(mlp, nn.Module):
        return 0
    return sum(p.numel() for module in mlp.modules() if not isinstance(module, nn.Linear)
               for p in module.parameters(recurse=False) if p.ndim <= 1)


SPLIT_SUBTREE = ("moe_tp_experts", "all_reduce", "embedding_colwise")  # every parameter of the module split


def _tally(model: nn.Module, layers: nn.ModuleList | None, shape: GPTConfig, plan: dict[str, str],
           blocks: str | None, parts: Parts | None) -> dict[str, Any]:
    """GPTConfig.block_tally, extra_params, extra_last_params and head_vectors: each block's
    parameters as the model holds them (`_block_tally`, under `plan` and under its SP form), and
    those outside the blocks that the embedding, head and final norm do not account for, before
    the blocks and after them (`_after_blocks`, by the pp cut `parts`). {} where the blocks are
    not the shape's (a list of another length): the formulas stand."""
    if not layers or not blocks or len(layers) != shape.n_layers:
        return {}
    whole = _whole_under_sp(model)
    owned = _owned_by_block(layers)
    seen = {id(p) for params in owned for p in params}  # the blocks' own: what _after_blocks leaves out
    tally = tuple(_block_tally(block, params, [_inside(plan, blocks, i), _inside(plan, blocks, i, whole)],
                               shape) for i, (block, params) in enumerate(zip(layers, owned)))
    head = getattr(model, "get_output_embeddings", lambda: None)()
    head_vectors = _vocabulary_vectors(head, shape.vocab_size)  # Phi's bias, Dory's scale: split with the head
    outside = sum(p.numel() for p in model.parameters()) - sum(sum(block[:3]) for block in tally)
    formula = replace(shape, extra_params=0, extra_last_params=0, head_vectors=head_vectors)
    last = _after_blocks(model, parts, seen)
    h, rows = shape.d_model, shape.vocab_size
    extra_last = 0 if last is None else \
        last - formula.final_norm_weights - rows * h * (not shape.tie_embeddings) - rows * head_vectors
    return {"block_tally": tally, "head_vectors": head_vectors, "extra_last_params": extra_last,
            "extra_params": outside - formula.embedding_params() - extra_last,
            **_frozen_in_blocks(owned), **_frozen_outside(model, seen), **_split_after_blocks(model, parts, plan)}


def _owned_by_block(layers: nn.ModuleList) -> list[list[nn.Parameter]]:
    """Each block's parameters that no block before it holds: a parameter two blocks share
    (Zamba's shared attention) counts in the first."""
    seen: set[int] = set()
    owned = []
    for block in layers:
        owned.append([p for p in block.parameters() if id(p) not in seen])
        seen.update(id(p) for p in owned[-1])
    return owned


def _frozen_in_blocks(owned: list[list[nn.Parameter]]) -> dict[str, Any]:
    """GPTConfig.frozen_block_params: of each block's own parameters (`_owned_by_block`), those
    no optimizer trains (requires_grad False, a router's balancing bias that the model moves
    itself); {} where there are none. They are taken as whole on every rank of the block's
    stage, as the ones met so far are (vectors over the experts, beside the split and dealt-out
    weights); frozen parameters outside the blocks are not told apart."""
    frozen = tuple(sum(p.numel() for p in params if not p.requires_grad) for params in owned)
    return {"frozen_block_params": frozen} if any(frozen) else {}


def _frozen_outside(model: nn.Module, seen: set[int]) -> dict[str, Any]:
    """GPTConfig.frozen_extra_params: parameters outside the blocks (not in `seen`) that no
    optimizer trains (HRM's initial state `z_L_init`), taken as the first stage's; {} where there
    are none. Counted as trained, they put every ZeRO figure 32 parameters over for HRM."""
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad and id(p) not in seen)
    return {"frozen_extra_params": frozen} if frozen else {}


def _split_after_blocks(model: nn.Module, parts: Parts | None, plan: dict[str, str]) -> dict[str, Any]:
    """GPTConfig.extra_last_split and tp_last_rows: the layers after the blocks (on the last
    stage, by the model's pp cut, `parts`), but the head, that the plan splits by their input
    features ("rowwise_split_input": Qwen4-Exp's hyper-connection mixer), their weights and their
    widths per token (outputs, inputs). {} where there are none, or no cut is read (then
    extra_last_params counts nothing after the blocks either)."""
    if parts is None:
        return {}
    head = getattr(model, "get_output_embeddings", lambda: None)()
    layers = [module for key, module in _split_by_input(model, plan).items()
              if any(key == part or key.startswith(f"{part}.") for part in parts.last)
              and module is not head and isinstance(module, nn.Linear)]
    if not layers:
        return {}
    return {"extra_last_split": sum(layer.weight.numel() for layer in layers),
            "tp_last_rows": (sum(layer.out_features for layer in layers), sum(layer.in_features for layer in layers))}


NO_SOFTMAX = ("linear_attention", "conv", "moe", "mlp")  # layer_types that mix no tokens by softmax attention


def _attention_share(model: nn.Module, shape: GPTConfig) -> float:
    """GPTConfig.attention_share: of the kinds the config's `layer_types` gives its blocks (as
    transformers 5 names them, a mamba or linear attention "linear_attention", LFM2's
    convolution "conv", Nemotron-H's MLP-only layers "mlp" and "moe"), the share that are
    softmax attention (full, sliding, chunked, a hybrid's). 1 where it gives none, or not one
    a block."""
    kinds = getattr(text_config(model), "layer_types", None)
    if not isinstance(kinds, (list, tuple)) or len(kinds) != shape.n_layers or not kinds:
        return 1.0
    return sum(kind not in NO_SOFTMAX for kind in kinds) / len(kinds)


MEASURED_TOKENS = 64  # the shortest of the lengths a block's keep is measured at (`_kept_terms`): a multiple of
# the chunk a linear attention's torch path pads the sequence to (Qwen3-Next's 64; a mamba-2's config
# names its own, `chunk_size`), so what it keeps grows with the sequence as at full length


class Terms(NamedTuple):
    """One dtype's reading of a model's keep (`_fitted`), each the term of c + a·s + q·s² it is."""

    quadratic: float | None  # the s² term, a block's run; None where it was not measured
    rest: float  # the blocks' s terms, a block's run: each rank's whole,
    split: float  # what the tp plan's regions make,
    mixers: float  # what the token-mixing modules it leaves whole make
    after: float  # a token's, after the blocks (the final norm's)
    tables: float  # the rotary tables', a position (one sequence's, whatever the batch)
    copied: float  # SDPA's output copied for its output projection, a block's run
    repeated: float  # K/V heads repeated for SDPA, a block's run
    outside: float  # a token's, outside the blocks before the last
    head: float  # the head's logits, a token's
    views: float  # what SDPA's inputs alone keep beyond their own values, a block's run: signed
    read: float  # the share of SDPA's outputs an op after keeps
    constants: tuple[float, float, float]  # c: a block's run, the first stage's, the last's
    chunks: tuple[float, float, float]  # the mixers' first, second and each further chunk's bytes beyond
    # their tokens', a block's run
    blocks: tuple[tuple[float, ...], ...]  # each block's own over its runs (GPTConfig.block_keeps)
    sliced: float  # the row layers' slices of what another save keeps, a block's run (Kept.sliced_views)
    further: tuple[float, ...] | None  # what a batch of b keeps beyond b sequences read alone, a
    # block's run, f + b·(c + a·s) + (b - 1)·g·s²: a (rest, split, mixers), then c, f, g; None: not read
    cpu_sdpa: tuple[float, ...]  # what a CPU keeps beyond, a block's run: a (rest, split, mixers), then q,
    # then a batch's beyond as many sequences: a, c, f, g of each part (GPTConfig.cpu_sdpa_bytes)


def _fitted(kept: list[Kept], length: int, runs: int, chunked: tuple[Kept, Kept] | None,
            batched: list[Kept], on_cpu: tuple[list[Kept], list[Kept]]) -> Terms:
    """The terms of forwards at `length` tokens and its multiples (two, or three where the s²
    term is measured): q the second difference over 2L², a what remains of the first over L,
    c what remains at L; a block's each a mean over the blocks' runs. With forwards at L/2 and
    3L where the token-mixing modules pad to chunks (`chunked`), their chunks' (`_mixer_chunks`).
    With forwards of two sequences at the same lengths and of three at L (`batched`; else not
    read), what a batch keeps beyond as many sequences read alone (`_beyond`). What a CPU keeps
    beyond, from its own forwards (`on_cpu`: one sequence's at L, 2L and 3L, and the batches')."""
    measured = len(kept) == 3
    chunks = _mixer_chunks(chunked[0], kept, chunked[1], length) if chunked else None
    quadratic, linear, constant, own = 0.0, [], 0.0, []
    for part in BLOCK_PARTS:  # each rank's whole, the split regions', the whole-read mixers'
        c, a, q = _polynomial([getattr(k, part) for k in kept], length)
        quadratic += q / runs
        if part == "mixers" and chunks:  # a token's within a chunk; the chunks' own apart
            linear.append(max(0.0, chunks[0]) / runs)
            own.append(0.0)
            continue
        linear.append(max(0.0, a / runs))
        constant += c
        own.append(c)
    # a chunked mixer's keep steps by the chunk, which no line through two lengths follows: its
    # sequences are taken to keep alike (within 1% at two sequences of four chunks)
    beyond = [_beyond(kept, batched, lambda k, part=part: getattr(k, part), c, length)
              if batched and not (part == "mixers" and chunks) else (0.0, 0.0, 0.0, 0.0)
              for part, c in zip(BLOCK_PARTS, own)]
    one, two = kept[0], kept[1]

    def slope(name: str) -> float:  # a token's bytes of one part, once a forward
        return max(0.0, (getattr(two, name) - getattr(one, name)) / length)

    # what no token makes, once a forward: the first stage's (outside the blocks) and the last's
    first = 2 * one.outside - two.outside
    last = 2 * (one.after + one.head) - (two.after + two.head)
    return Terms(quadratic=max(0.0, quadratic) if measured else None, rest=linear[0], split=linear[1],
                 mixers=linear[2], after=slope("after"), tables=slope("tables"),
                 copied=slope("copies") / runs, repeated=slope("repeated") / runs, outside=slope("outside"),
                 head=slope("head"), views=(two.views - one.views) / length / runs,
                 read=one.read / one.calls if one.calls else 1.0,
                 constants=tuple(max(0.0, c) for c in (constant / runs, first, last)),
                 chunks=tuple(c / runs for c in chunks[1:]) if chunks else (0.0, 0.0, 0.0),
                 blocks=_block_keeps(kept, length, chunked, batched), sliced=slope("sliced_views") / runs,
                 further=tuple(terms[i] / runs for i in range(4) for terms in beyond) if batched else None,
                 cpu_sdpa=_cpu_terms(*on_cpu, length, runs))


def _cpu_terms(kept: list[Kept], batched: list[Kept], length: int, runs: int) -> tuple[float, ...]:
    """GPTConfig.cpu_sdpa_bytes of one dtype from the forwards at L, 2L (and 3L, where the math
    form's softmax, an s × s tensor, made the s² term measured): a token's bytes of each part,
    then a token's a position; then what a batch keeps beyond as many sequences alone
    (`_beyond`'s a, c, f, g of each part: in fp32 the math form views a sequence's V in the
    fused projection's output, keeping it whole, and copies a batch's); a block's run. () where
    no call took the math form."""
    if not any(any(k.cpu_more) for k in kept):
        return ()
    fits = [_polynomial([k.cpu_more[i] for k in kept], length) for i in range(len(BLOCK_PARTS))]
    # one sequence's constant is not priced: `_beyond` takes it as 0, as the estimate does
    beyond = [_beyond(kept, batched, lambda k, i=i: k.cpu_more[i], 0.0, length) if batched else (0.0,) * 4
              for i in range(len(BLOCK_PARTS))]
    return tuple(value / runs for value in (*(fit[term] for term in (1, 2) for fit in fits),
                                            *(terms[i] for i in range(4) for terms in beyond)))


def _beyond(kept: list[Kept], batched: list[Kept], read: Callable[[Kept], float], constant: float,
            length: int) -> tuple[float, float, float, float]:
    """(a, c, f, g): what a micro-batch of b >= 2 sequences keeps beyond b sequences' reading at
    one, f + b·(c + a·s) + (b - 1)·g·s²: a token's, a sequence's and a micro-batch's bytes, and
    of an s × s tensor kept once a micro-batch. From b = 2 up a batch keeps f' + m·s² + b·(c' +
    a'·s + q'·s²), which forwards of two sequences at L and 2L (and 3L where one sequence's s²
    term was read) and of three at L (`batched`) give, each read by `read`; one sequence's own
    (`kept`: its constant, `constant` as priced, a token's a and q = q' + m) may differ.

    Jamba's mamba keeps its final state once a sequence, and at one sequence views a reshape it
    copies from two up (0.977 of the meter at two sequences); GPT-NeoX-Japanese keeps less a
    sequence from two up (1.10 at two); MiniMax's decay blocks are made once a micro-batch (1.43);
    Inkling's relative position bias, an s × s tensor, is one for the batch (1.01): a reading of
    one sequence held none of them. (0, 0, 0, 0) where a batch keeps b times a sequence's tokens."""
    _, one_a, one_q = _polynomial([read(k) for k in kept], length)
    *two, three = (read(k) for k in batched)
    two_c, two_a, two_q = _polynomial(two, length)
    per_sequence_q = two_q - one_q  # and once a micro-batch: 2·one_q - two_q
    a = two_a / 2
    c = three - two[0] - a * length - per_sequence_q * length * length
    return a - one_a, c, two_c - 2 * c - constant, per_sequence_q - one_q


def _polynomial(values: list[float], length: int) -> tuple[float, float, float]:
    """(c, a, q) of c + a·s + q·s² through `values`, bytes at L, 2L (and 3L: else q is 0) tokens:
    q the second difference over 2L², a what remains of the first over L, c what remains at L."""
    c0, c1, c2 = (*values, 0)[:3]
    q = (c2 - 2 * c1 + c0) / (2 * length * length) if len(values) == 3 else 0.0
    return 2 * c0 - c1 + 2 * length * length * q, (c1 - c0 - 3 * length * length * q) / length, q


def _differing(blocks: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
    """`blocks`, or () where every block keeps alike (a dense model's: the mean is each)."""
    return blocks if len(set(blocks)) > 1 else ()


def _block_keeps(kept: list[Kept], length: int, chunked: tuple[Kept, Kept] | None,
                 batched: list[Kept]) -> tuple[tuple[float, ...], ...]:
    """Each block's keep over its runs as GPTConfig.block_keeps holds it, (c, a, q, the first,
    second and each further chunk's bytes beyond a's), from the same forwards as the mean's:
    what a pipeline stage keeps is its own blocks', and a hybrid's or DeepSeek's blocks differ
    (a dense first block keeps 0.75 of an MoE one's; a linear attention's padded chunks, 6.5
    times a softmax attention's at 16 tokens). Where the mixers pad to chunks every block is read
    in the chunks' form (a block that keeps by the token reads no chunk bytes in it). Then (a, c,
    f, g) of what a batch keeps beyond as many sequences read alone (`_beyond`; none in the
    chunks' form, or where the batches were not read)."""
    if chunked:  # read by the chunk, which no line through two lengths follows: sequences alike
        half, third = chunked
        return tuple((0.0, low, 0.0, first, second, further, 0.0, 0.0, 0.0, 0.0) for low, first, second, further in
                     (_chunks_of(*values, length)
                      for values in zip(half.by_block, kept[0].by_block, kept[1].by_block, third.by_block)))
    own = [(*_polynomial(list(values), length), 0.0, 0.0, 0.0) for values in zip(*(k.by_block for k in kept))]
    return tuple((*terms, *(_beyond(kept, batched, lambda k, i=i: k.by_block[i], terms[0], length)
                            if batched else (0.0, 0.0, 0.0, 0.0)))
                 for i, terms in enumerate(own))


def _pads_to_chunks(half: Kept, kept: list[Kept], length: int) -> bool:
    """Whether the token-mixing modules pad the sequence to a chunk of `length` tokens: their
    keep grows more per token from L to 2L (a second chunk begun) than from L/2 to L (the first
    chunk's tokens filled in). Not where it grows alike (a mamba's scan), or less (MiniMax's
    block × block scores, within a block)."""
    return kept[1].mixers - kept[0].mixers - _within_chunk(half, kept[0], length) * length > 0


def _within_chunk(half: Kept, whole: Kept, length: int) -> float:
    """The token-mixing modules' bytes a token from L/2 to L tokens: within the first chunk."""
    return _per_token_within(half.mixers, whole.mixers, length)


def _per_token_within(half: float, whole: float, length: int) -> float:
    """Bytes a token from L/2 to L tokens, of bytes `half` and `whole` at those lengths."""
    return (whole - half) / (length - length // 2)


def _chunks_of(half: float, one: float, two: float, three: float, length: int) -> tuple[float, ...]:
    """(a token's bytes within a chunk, the first chunk's beyond its tokens', the second's, each
    further one's) of bytes at L/2, L, 2L and 3L tokens, chunks of L."""
    low = _per_token_within(half, one, length)
    return low, one - low * length, two - one - low * length, three - two - low * length


def _mixer_chunks(half: Kept, kept: list[Kept], third: Kept, length: int) -> tuple[float, ...]:
    """(a token's bytes within a chunk, the first chunk's beyond its tokens', the second's, each
    further one's) of token-mixing modules that pad to chunks of `length` tokens, from forwards
    at L/2, L, 2L and 3L. Qwen3-Next's torch path pads to 64 tokens and keeps a chunk's states
    whatever the tokens in it: measured as a token's from L and 2L, its keep at 16 tokens was
    read as 0.46 of what it is, and 1.06-1.09 from 128 to 1,000 (its second chunk keeps 6% more
    than the ones after it)."""
    return _chunks_of(half.mixers, kept[0].mixers, kept[1].mixers, third.mixers, length)


def _linear_chunk(text: Any) -> int:
    """The tokens a linear attention or mamba-2 works on at a time, where its config names them:
    `chunk_size` (a mamba-2's), or `block_size` beside a linear attention layer (MiniMax's
    lightning attention, 256: within a block it keeps each head's block × block scores, so what
    it keeps grows with the sequence as at full length only from a block up). 0 where none is
    named."""
    chunk = getattr(text, "chunk_size", 0)
    if not chunk and "linear_attention" in (getattr(text, "layer_types", None) or ()):
        chunk = getattr(text, "block_size", 0)
    return chunk if isinstance(chunk, int) else 0


def _kept_terms(model: nn.Module, layers: nn.ModuleList | None, shape: GPTConfig, plan: dict[str, str],
                blocks: str | None) -> dict[str, Any]:
    """GPTConfig.attention_matrix_bytes, block_saved_bytes, final_saved_bytes,
    position_table_bytes and attention_out_copy_bytes, from what autograd keeps during the
    blocks' forwards (`_kept_in_blocks`, on `_measuring_device`) at L, 2L and 3L tokens of one
    sequence (L and 2L under SDPA, which keeps nothing of s², unless a block keeps an s × s
    tensor), in fp32 and in bf16: c + a·s + q·s² at evenly spaced lengths (`_fitted`), each a
    mean over the blocks' runs (a looped model's run again each pass, and each run keeps its own:
    Dory's looped kind was priced at 4/3 of its blocks' keep, counted a block held).

    - the s² term, where transformers runs the attention eagerly (a soft-cap, sinks, ALiBi that
      SDPA does not take): its s × s matrices, clamped at 0; or where SDPA is handed a learned
      bias as its mask (Inkling's relative positions: the kernel keeps it for its gradient, and
      the bias is made of s × s gathers); (0, 0) under SDPA otherwise, which keeps none;
    - the s term, per token, split into the rest (each rank's whole), what the regions the tp
      plan splits make (divided by tp), and what its token-mixing modules left whole make (a
      linear attention's, a mamba's: whole under SP too, which reads them whole);
    - what is kept after the blocks, a token (the final norm's, whatever kind of norm it is),
      and of the rotary tables, a position (one sequence's, shared by a batch's);
    - what is kept outside the blocks before the last, a token (GPTConfig.outside_saved_bytes),
      and the logits the head keeps, a token (GPTConfig.head_saved_bytes);
    - what no token makes, c (GPTConfig.constant_bytes): vectors a block's run derives from its
      weights (Gemma's norms' 1 + weight, Dory's scales), and the first and last stages' own;
    - what a batch of sequences keeps beyond as many read alone, by part, a token's, a
      sequence's and a micro-batch's (GPTConfig.further_sequence_bytes: `_beyond`), from
      forwards of two and three sequences in the first dtype that runs;
    - of the s terms, the copies of SDPA's output the model makes for its output projection
      (GPTConfig.attention_out_copy_bytes), and the K/V heads transformers repeats for SDPA
      (GPTConfig.kv_repeat_bytes), which context parallelism's attention spares;
    - what a CPU keeps beyond, where it runs a call of SDPA in its math form
      (GPTConfig.cpu_sdpa_bytes: `_cpu_takes_math`).

    Where one dtype's forward does not run on meta (grouped experts take bf16 alone there:
    GPT-OSS's, Mixtral's) its matrices are twice the other's, a bound (4 bytes a pair a head measured on the
    CPU against 2 for GPT-OSS), and its per-token bytes are marked unmeasured (-1): the estimate
    then shifts the other dtype's by the formulas' difference between the two. {} where neither
    runs: the formulas stand."""
    if not layers or len(layers) != shape.n_layers:
        return {}
    chunk = _linear_chunk(text_config(model))
    runs = sum(shape.block_runs) or shape.n_layers  # a looped model's blocks keep theirs at each run
    implementation = _attention_implementation(model)
    eager = implementation == "eager"  # SDPA keeps nothing of s² (a bias aside): two lengths give the s term
    length = max(MEASURED_TOKENS, chunk)
    parts = _block_modules(model, layers, plan, blocks)
    device = _measuring_device(model)

    def terms_at(length: int) -> tuple[list[Terms | None], list[tuple[int, ...]]]:
        """Each dtype's terms (fp32's, bf16's; None where its forward failed), and the attention's
        calls in one forward of the first dtype whose forwards all ran. A third length is
        measured where the attention runs eagerly, or where a block kept an s × s tensor at
        both lengths (`Kept.square`: a learned bias SDPA takes as its mask)."""
        terms: list[Terms | None] = []
        handed: list[tuple[int, ...]] = []
        for dtype in (torch.float32, torch.bfloat16):
            seen: list[tuple[int, ...]] = []
            forwards = [0]
            try:
                with _attention_handed(implementation, seen):
                    def at(n: float, batch: int = 1) -> Kept:
                        forwards[0] += 1
                        return _kept_in_blocks(model.to(dtype), layers, parts, int(n * length), device,
                                               shape.vocab_size, seen, batch)
                    kept = [at(1), at(2)]
                    if eager or (kept[0].square and kept[1].square):
                        kept.append(at(3))
                    # a token-mixing module left whole may pad to a chunk: half a length tells,
                    # and a third length gives the chunks after the second
                    half = at(0.5) if len(kept) == 2 and kept[0].mixers else None
                    chunked = (half, at(3)) if half and _pads_to_chunks(half, kept, length) else None
                    # a CPU's math form of SDPA keeps an s × s softmax: three lengths for it, in
                    # each dtype (it keeps fp32 under bf16 too, so neither gives the other's),
                    # whatever device is estimated: a model with such calls reads 4-7 forwards
                    # more a dtype (tiny DeepSeek-V3's 9 became 16)
                    math = any(k.cpu_more != (0, 0, 0) for k in kept)
                    third = kept[2] if len(kept) == 3 else chunked[1] if chunked else at(3) if math else None
                    lengths = 3 if len(kept) == 3 or math else 2
                    # what a batch keeps beyond as many sequences alone: read in the first dtype
                    # that runs, and in proportion for the other (their forwards cost as much again)
                    batched = ([at(n, batch=2) for n in range(1, lengths + 1)] + [at(1, batch=3)]
                               if not terms or terms[0] is None or math else [])
            except Exception:  # noqa: BLE001 - an op meta does not run in this dtype
                terms.append(None)
                continue
            if not handed:  # the first dtype whose forwards all ran: each call once a forward
                handed.extend(seen[:len(seen) // forwards[0]])
            # the further lengths of two sequences beyond one sequence's read for the math form alone
            own_batched = batched[:len(kept)] + batched[-1:] if batched else []
            on_cpu = ([*kept[:2], third] if third is not None else kept, batched)
            terms.append(_fitted(kept, length, runs, chunked, own_batched, on_cpu))
        return terms, handed

    terms, handed = terms_at(length)
    for within in (shape.max_seq_len // 2, shape.max_seq_len // 3):
        # a position table shorter than the lengths (OPT's learned one, GPT-J's causal buffer: a
        # tiny config's 64) fails both forwards; the formulas stood, 0.66-1.39 of measured. The
        # longest of two lengths within it, or of three
        if terms == [None, None] and 0 < within < length:
            terms, handed = terms_at(within)
    if terms == [None, None]:
        return {}
    fp32, low = (t.quadratic if t else None for t in terms)
    matrices = (fp32 if fp32 is not None else 2 * (low or 0.0), low if low is not None else fp32 or 0.0)
    saved = tuple((t.rest, t.split, t.mixers) if t else (-1.0, -1.0, -1.0) for t in terms)
    final, tables, copied, repeated, outside, head, sliced = (
        tuple(getattr(t, name) if t else -1.0 for t in terms)
        for name in ("after", "tables", "copied", "repeated", "outside", "head", "sliced"))
    further = _in_both_dtypes([t.further if t else None for t in terms])
    on_cpu = tuple(t.cpu_sdpa if t else () for t in terms)
    views = tuple(t.views if t else 0.0 for t in terms)  # signed: a dtype whose forward failed counts none
    out_kept = next((t.read for t in terms if t), 1.0)
    constants = tuple(tuple(t.constants[where] if t else -1.0 for t in terms) for where in (0, 1, 2))
    chunked = any(t and any(t.chunks) for t in terms)
    chunks = tuple(t.chunks if t else (-1.0, -1.0, -1.0) for t in terms) if chunked else ()
    text = text_config(model)
    # the built config's window: its attribute map names RecurrentGemma's attention_window_size so
    window = getattr(text, "sliding_window", None)
    masked = sliding_share(window, getattr(text, "layer_types", None),
                           getattr(text, "use_sliding_window", True), shape.block_runs) if implementation == "sdpa" else 0.0
    window_read = {"sliding_window": window} if masked and not shape.sliding_window else {}
    return {"attention_matrix_bytes": matrices, "block_saved_bytes": saved, "final_saved_bytes": final,
            "position_table_bytes": tables, "attention_out_copy_bytes": copied, "kv_repeat_bytes": repeated,
            "outside_saved_bytes": outside, "head_saved_bytes": head, "qkv_view_bytes": views,
            "sliced_view_bytes": sliced, "further_sequence_bytes": further,
            "cpu_sdpa_bytes": on_cpu if any(on_cpu) else (),
            "attention_out_kept": out_kept, "constant_bytes": constants,
            "mixer_chunk": length if chunked else 0, "mixer_chunk_bytes": chunks,
            "block_keeps": _differing(next(t.blocks for t in terms if t)),
            "sliding_mask_layers": masked, **window_read, **_heads_as_handed(handed, shape)}


def _in_both_dtypes(further: list[tuple[float, ...] | None]) -> tuple[tuple[float, ...], ...]:
    """GPTConfig.further_sequence_bytes, fp32's then 16-bit's, each as read where both were (a
    CPU's math form of SDPA reads batches in each dtype); else from the dtype they were read in:
    the other's in proportion to its bytes a value (a state kept in fp32 under bf16 is priced at
    half its bytes, where a batch's extra keep is a small share). () where neither was."""
    read = next((i for i, terms in enumerate(further) if terms is not None), None)
    if read is None:
        return ()
    if all(terms is not None for terms in further):  # each read in its own dtype (a CPU's math form's)
        return tuple(further)
    scale = (0.5, 2.0)[read]  # fp32 -> 16-bit, or 16-bit -> fp32
    other = tuple(term * scale for term in further[read])
    return (further[read], other) if read == 0 else (other, further[read])


def _attention_implementation(model: nn.Module) -> str | None:
    """The name of the attention function the model's config asks for ("sdpa", "eager", ...)."""
    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return name if isinstance(name, str) else None


@contextlib.contextmanager
def _attention_handed(name: str | None, seen: list[tuple[int, ...]]) -> Iterator[None]:
    """While inside, each call of the attention function `name` (a model's implementation in
    transformers' AttentionInterface: where context parallelism puts its own) adds to `seen`
    (q heads, q's width a head, K/V heads, K's width a head, V's): what the attention is handed,
    K and V unrepeated. An eager attention, called directly and not through the interface, adds
    nothing."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:  # no interface: nothing is read
        yield
        return
    if name is None or name not in ALL_ATTENTION_FUNCTIONS:
        yield
        return
    own, had_local = ALL_ATTENTION_FUNCTIONS[name], name in ALL_ATTENTION_FUNCTIONS._local_mapping

    def reading(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                *args: Any, **kwargs: Any) -> Any:
        seen.append((query.shape[1], query.shape[-1], key.shape[1], key.shape[-1], value.shape[-1]))
        return own(module, query, key, value, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[name] = reading  # this instance's own mapping: no other model sees it
    try:
        yield
    finally:
        if had_local:
            ALL_ATTENTION_FUNCTIONS[name] = own
        else:
            del ALL_ATTENTION_FUNCTIONS[name]


def _heads_as_handed(seen: list[tuple[int, ...]], shape: GPTConfig) -> dict[str, Any]:
    """GPTConfig.n_kv_heads and head_widths as the attention is handed them (`_attention_handed`),
    where config.json's word differs: GPT-NeoX, OPT, GPT-J and their kind run every head whatever
    num_key_value_heads says, GPT-BigCode's multi-query attention one, and a latent attention's
    K heads are wider than its V's; and GPTConfig.attention_calls, the calls a softmax-attention
    block's run makes (DiffLlama's and LongCat's two; `seen` holds one forward's). Calls that
    differ in their heads' widths alone (Gemma 4's global layers, wider than its sliding ones)
    give the widths' mean over the calls: the bytes cp moves and the FLOPs are linear in each.
    {} where no call was seen, the calls differ in their heads (blocks of different attentions)
    or q's heads are not the config's: the config's word stands."""
    if (not seen or len({(call[0], call[2]) for call in seen}) > 1 or seen[0][0] != shape.n_heads
            or shape.n_heads % seen[0][2]):
        return {}
    kv_heads = seen[0][2]
    q, k, v = (sum(call[i] for call in seen) / len(seen) for i in (1, 3, 4))
    q, k, v = (int(w) if float(w).is_integer() else w for w in (q, k, v))
    widths = (q, k, v) if (q, k, v) != (shape.head_dim,) * 3 else ()
    attention_runs = (sum(shape.block_runs) or shape.n_layers) * (shape.attention_share or 1.0)
    return {"n_kv_heads": kv_heads, "head_widths": widths, "attention_calls": len(seen) / attention_runs}


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a module's arguments, at any depth (a rotary embedding's (cos, sin))."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors_in(item)]
    return []


CPU_MEASURED_PARAMS = 1 << 24  # a model this small is measured on the CPU (zeros), where an op is faster than on meta


@contextlib.contextmanager
def _one_sequence() -> Iterator[None]:
    """While inside, transformers takes the positions it is given for one sequence, not packed
    documents: without a cache it reads them for where documents begin, a value the meta device
    does not hold (Qwen3-Next's mask failed there). The measuring forwards run one sequence."""
    try:
        import transformers.masking_utils as masks
    except ImportError:
        yield
        return
    if not hasattr(masks, "find_packed_sequence_indices"):
        yield
        return
    found = masks.find_packed_sequence_indices
    masks.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masks.find_packed_sequence_indices = found


def _hold(storages: dict[int, torch.UntypedStorage], tensors: list[torch.Tensor]) -> None:
    """Adds the tensors' storages to `storages`, by address, holding each: a storage freed
    while its address is still listed leaves the address to the next one made, and
    DeepSeek-V4's temporaries, taken for its rotary tables, read 0.87-1.8 of its keep from one
    reading to the next."""
    storages.update((t.untyped_storage()._cdata, t.untyped_storage()) for t in tensors)


class _TablesMade(TorchFunctionMode):
    """While inside, what an op makes of the rotary tables alone (storages in `tables`: GLM's and
    Ernie's attention re-lay them each layer) joins them: made of positions, one sequence's."""

    def __init__(self, tables: dict[int, torch.UntypedStorage]) -> None:
        super().__init__()
        self.tables = tables

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = _tensors_in([list(args), kwargs or {}])
        if inputs and all(t.untyped_storage()._cdata in self.tables for t in inputs):
            _hold(self.tables, _tensors_in(out))
        return out


LAYOUT_NODES = ("View", "Transpose", "Permute", "Clone", "Reshape", "Expand", "Squeeze", "Unsqueeze")


def _copies_of(tensor: torch.Tensor, outputs: list[torch.Tensor]) -> bool:
    """Whether `tensor` is the last of `outputs` (SDPA's, in order) laid out again and copied:
    its graph leads back to that output through views, transposes and clones alone, and its
    storage is not the output's."""
    out = outputs[-1]
    if tensor.untyped_storage()._cdata == out.untyped_storage()._cdata:
        return False
    node = tensor.grad_fn
    for _ in range(8):
        if node is None:
            return False
        if node is out.grad_fn:
            return True
        if not any(part in type(node).__name__ for part in LAYOUT_NODES):
            return False
        node = node.next_functions[0][0] if node.next_functions else None
    return False


def _measuring_device(model: nn.Module) -> torch.device:
    """Where `_kept_terms` runs its forwards: on the meta device, where a forward costs about a
    millisecond an op and no memory (a large model's 61 blocks: seconds); a small one (up to
    CPU_MEASURED_PARAMS, 64 MiB in fp32) is given zeroed CPU memory and run there in a few
    milliseconds, where meta took 0.1-0.4 s, and its grouped experts run in fp32 too. Zeros keep
    every value finite (a router's ties pick the same top_k of every token: the same rows)."""
    if sum(p.numel() for p in model.parameters()) > CPU_MEASURED_PARAMS:
        return torch.device("meta")
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.zero_()
    return torch.device("cpu")


class BlockModules(NamedTuple):
    """Each block's modules whose saves the shape reading tells apart (`_kept_in_blocks`), as the
    tp plan runs them: one list a block in each."""

    regions: list[list[nn.Module]]  # what the plan splits (`_row_regions`)
    mixers: list[list[nn.Module]]  # what runs whole on every rank, under SP too: the token-mixing
    # modules the plan leaves whole, those between columns gathered whole and a row layer taking
    # its slice (`_whole_parents`), an MoE module whose experts are split (`_split_experts_holders`)
    sliced: list[list[nn.Module]]  # the row layers taking their slice of a whole input (`_slicing_rows`)
    whole: list[list[nn.Module]]  # inside a split region, what runs whole before it splits (`_whole_in_regions`)


def _block_modules(model: nn.Module, layers: nn.ModuleList, plan: dict[str, str], blocks: str | None) -> BlockModules:
    """`BlockModules` of `layers` under `plan` (named from the model; none where there is no plan)."""
    experts_split = not declared(model, "ep")  # an ep plan keeps the experts whole under tp (styles.py)
    inside = [_inside(plan, blocks, i) if blocks and plan else {} for i in range(len(layers))]
    regions = [_row_regions(block, named, experts_split) for block, named in zip(layers, inside)]
    mixers = [[child for child in block.children() if mixes_tokens(child) and all(child is not r for r in split)]
              + _whole_parents(block, named) + _split_experts_holders(block, split)
              for block, named, split in zip(layers, inside, regions)]
    return BlockModules(regions, mixers, [_slicing_rows(block, named) for block, named in zip(layers, inside)],
                        [_whole_in_regions(block, named) for block, named in zip(layers, inside)])


def _whole_in_regions(block: nn.Module, plan: dict[str, str]) -> list[nn.Module]:
    """The layers of a latent attention (a plan entering its rotary key, "mla_kv_a_proj") that no
    entry splits: its down-projections and their norms run whole on every rank before its up-
    projections split (`_mla_down_params` counts their parameters so). Read as the split region
    around them, DeepSeek's and the other latent attentions' estimate under tp 2 was 0.93-0.95
    of the meter's. None elsewhere: a layer no entry names inside another attention may run on
    its split heads (Qwen3's q and k norms)."""
    attention = _in_block(block, "self_attn") if "mla_kv_a_proj" in plan.values() else None
    if attention is None:
        return []
    entries = _attention_entries(plan)
    return [module for name, module in attention.named_modules() if name
            and any(True for _ in module.parameters(recurse=False)) and not _named_by(name, entries)]


def _row_regions(block: nn.Module, plan: dict[str, str], experts_split: bool = True) -> list[nn.Module]:
    """The modules of `block` whose work the plan (named from the block) splits over tp: each
    row layer's parent, which holds the column layers feeding it and whose output the row
    layer's sum makes whole (the attention, the MLP, an MoE's shared expert; not a linear
    attention whose projections are gathered whole), and the experts modules it splits
    whole (EXPERT_STYLES, where `experts_split`: no ep plan keeps them whole). Llama 4's and
    LongCat's routed experts had been read as each rank's whole, and their estimate under tp 2
    was 1.19 and 1.13 of the meter's. Not a parent whose column layers all gather their
    outputs whole for a row layer that takes its slice of a whole input: OLMo2's, OLMoE's and
    Phi-3's attention norms q and k over every head, so each rank runs the whole attention
    (read as split, their estimate under tp 2 was 0.73-0.90 of the meter's); it is read with
    the token-mixing modules the plan leaves whole."""
    found: list[nn.Module] = []
    for key, style in plan.items():
        if style in EXPERT_STYLES and experts_split:
            modules = _each_in_block(block, key)
        else:
            parent = key.rsplit(".", 1)[0] if "." in key else ""
            modules = (_each_in_block(block, parent) if style in ROWS and parent and _in_block(block, key)
                       and not _runs_whole(plan, key) else [])
        found += [module for module in modules if all(module is not other for other in found)]
    return found


def _split_experts_holders(block: nn.Module, regions: list[nn.Module]) -> list[nn.Module]:
    """The MoE modules of `block` whose experts are a split region (`_row_regions`): under SP
    such a module runs whole on the gathered sequence (estimate/traffic.split_moe_calls), so
    what it makes beside its experts (Llama 4's router scores and the tokens it repeats for
    every expert) is whole on every rank, as a token-mixing module's is."""
    return [module for module in block.modules() if any(getattr(module, "experts", None) is r for r in regions)]


def _each_in_block(block: nn.Module, name: str) -> list[nn.Module]:
    """Every module of the block a plan entry names, a wildcard standing for one name: LongCat's
    "self_attn.*" is both its attentions (read as the first alone, the second's keep was each
    rank's whole, and its estimate under tp 2 was 1.13 of the meter's)."""
    if "*" not in name:
        module = _in_block(block, name)
        return [] if module is None else [module]
    parts = name.split(".")
    return [module for inner, module in block.named_modules()
            if len(inner.split(".")) == len(parts) and all(map(fnmatchcase, inner.split("."), parts))]


GATHERED_COLUMNS = ("colwise_gather_output", "colwise_rep")  # column styles whose output is gathered whole


def _slicing_rows(block: nn.Module, plan: dict[str, str]) -> list[nn.Module]:
    """The row layers of `block` that take their slice of a whole input (`_runs_whole`): what
    they keep of it is their slice, a tp rank's share (o_proj's of the whole attention's output,
    Phi-3's down_proj's of its whole MLP's)."""
    return [module for key in plan if _runs_whole(plan, key) and (module := _in_block(block, key)) is not None]


def _whole_parents(block: nn.Module, plan: dict[str, str]) -> list[nn.Module]:
    """The modules of `block` that run whole between columns gathered whole and a row layer
    taking its slice (`_runs_whole`) but mix no tokens (Phi-3's MLP): whole on every rank, under
    SP too, which gathers the sequence for them; read with the token-mixing modules."""
    found: list[nn.Module] = []
    for key in plan:
        parent = _in_block(block, key.rsplit(".", 1)[0]) if "." in key and _runs_whole(plan, key) else None
        if parent is not None and not mixes_tokens(parent) and all(parent is not other for other in found):
            found.append(parent)
    return found


def _runs_whole(plan: dict[str, str], row: str) -> bool:
    """Whether row layer `row` takes its slice of a whole input that every column layer beside it
    (its parent's, in `plan`) gathers whole, or that no column layer beside it feeds (Qwen4-Exp's
    hyper connections, a row layer alone in its module): the work around it runs whole on each
    rank. Read as split, Qwen4-Exp's estimate under tp 2 was 0.958 of the meter's."""
    parent = row.rsplit(".", 1)[0]
    columns = [style for key, style in plan.items() if key != row and key.rsplit(".", 1)[0] == parent]
    return plan[row] == "rowwise_split_input" and all(c in GATHERED_COLUMNS for c in columns)


class Kept(NamedTuple):
    """What one measuring forward left the graph holding (`_kept_in_blocks`), in bytes unless said."""

    rest: int  # saved in the blocks, each rank's whole
    split: int  # made inside the regions the tp plan splits
    mixers: int  # made inside what runs whole on every rank: the token-mixing modules the plan leaves
    # whole, and the modules between columns gathered whole and a row layer taking its slice
    after: int  # saved after the last block, the head's logits aside: a token's
    tables: int  # saved of the rotary tables: a position's, one sequence's
    copies: int  # of the first three, copies of SDPA's output made for its output projection
    repeated: int  # of SDPA's K and V, the heads repeated beyond those handed to it
    outside: int  # saved outside the blocks before the last, the token ids aside
    head: int  # the vocab-wide tensors saved after the last block: the logits a head keeps
    views: int  # what SDPA's inputs alone keep beyond their own values (signed)
    read: int  # SDPA's calls whose output (or a copy) an op after keeps
    calls: int  # SDPA's calls
    square: bool  # whether a block saved a tensor whose last two dimensions are the sequence
    by_block: tuple[int, ...]  # of the first three, what each block saved (each storage by its first saver)
    sliced_views: int  # what the row layers taking their slice of a whole input saved of a storage
    # kept before them (o_proj of SDPA's output): a view at one process, a slice of its own under tp
    cpu_more: tuple[int, int, int]  # of the first three, what a CPU keeps beyond (signed), where it
    # runs a call of SDPA in its math form (`_cpu_takes_math`)


BLOCK_PARTS = ("rest", "split", "mixers")  # the three parts a block's per-token bytes split into


def _kept_in_blocks(model: nn.Module, layers: nn.ModuleList, parts: BlockModules, length: int, device: torch.device,
                    vocab: int, handed: list[tuple[int, ...]] | None = None, batch: int = 1) -> Kept:
    """Bytes the graph holds after one forward of `model` on `device` over one sequence of
    `length` tokens (`batch` of them where asked: `_beyond`), of what the blocks saved, each storage once, the parameters' not: (the rest,
    what the modules the plan splits made (`parts.regions`, each block's: `_row_regions`; but
    what runs whole inside them, `parts.whole`, and what it makes), what the
    token-mixing modules it leaves whole made (`parts.mixers`: a linear attention, a mamba, read whole
    under SP; and what runs whole between columns gathered whole: `_whole_parents`), and what
    the row layers that take their slice of a whole input keep (`parts.sliced`) with
    the split regions'); what was saved after the last block, but for `vocab`-wide tensors (the final
    norm's input, statistics and output, which the head keeps; the logits are the loss's); what
    the blocks saved of the rotary tables (a rotary module's output, and what ops make of them
    alone, as an attention that re-lays them per layer does: made for positions, one sequence's
    whatever the batch, counted apart from the tokens'); and, of the first three, the copies of
    SDPA's output the model makes for its output projection (GPT-NeoX's, Phi's: heads handed out
    of a fused projection come back head-major, and reshaping them copies), which context
    parallelism's attention, handing its output back sequence-major, does not make; and the bytes
    of SDPA's K and V beyond the K/V heads the attention function was handed (the last of
    `handed`, `_attention_handed`'s): transformers repeats grouped heads up to q's where it hands
    SDPA a mask (a sliding window's), which context parallelism's attention, handed them grouped,
    does not; what was saved outside the blocks before the last one, the token ids aside (a norm
    of the embedding's output: nanochat's, ModernBERT's; a norm between two stacks or a loop's
    passes: HRM's, Dory's); the `vocab`-wide tensors saved after the last block, the logits a
    head keeps for its backward (a soft cap's tanh; Dory's learned scale on each logit); what
    SDPA's inputs in the blocks alone keep beyond their own values (a fused projection's output
    a V slices; less an input slicing what something else keeps), which Ulysses' all-to-alls
    change; how many of SDPA's calls had their output (or a copy) kept by an op after, of
    how many calls; and whether a block saved an s × s tensor (Inkling's relative position
    bias, handed to SDPA as a mask it must keep for the bias's gradient). What a
    module keeps of its own inputs (the norm's output the projections read) is the rest's. SDPA
    is counted as its flash kernels keep (query, key, value, output, an fp32
    log-sum-exp per head and query), where meta would run its math form, which keeps the s × s
    scores."""
    # the model's own tensors are resident whatever runs, as the meter takes them
    # (parallel/saved.resident_storages): its weights, and its buffers (MiniMax's decay tables,
    # 1 MiB of the tiny model's keep, were read as a token's bytes). Held while listed: XGLM's
    # forward remakes its sinusoidal table once the positions pass its length, and the table it
    # dropped left its address to an activation, which was then not counted (1 reading in 6)
    params: dict[int, torch.UntypedStorage] = {}
    _hold(params, [*model.parameters(), *model.buffers()])
    ids = torch.zeros(batch, length, dtype=torch.long, device=device)
    state: dict[str, Any] = {"block": False, "region": False, "mixer": False, "sliced": False, "whole": False,
                             "whole made": {},
                             "region inputs": set(), "mixer inputs": set(), "block inputs": set(),
                             "sdpa": False, "after": False, "tables": {}, "repeated": 0,
                             "ids": ids.untyped_storage()._cdata, "read": set(), "square": False, "index": -1}
    # (a reference to what was saved, its part, extra bytes, its kind, the block that saved it,
    # the form of SDPA that keeps it: "" any, "fused" a GPU's kernel alone, "math" a CPU's alone)
    seen: list[tuple[Any, int, int, str, int, str]] = []
    outputs: list[torch.Tensor] = []  # what SDPA returned, in order

    def keep(tensor: torch.Tensor, extra: int = 0, held: bool = False, kind: str = "", form: str = "") -> None:
        """`tensor` as saved, alive while autograd keeps it, or for the forward's length (`held`);
        `kind` "copy": a copy of SDPA's output; `form`: kept by one form of SDPA alone."""
        if state["block"]:
            # (a GPU's keep: a CPU's math form's softmax is read apart, `_cpu_terms`)
            state["square"] |= form != "math" and tensor.dim() >= 2 and tensor.shape[-2:] == (length, length)
            # made inside the region (the mixer) entered last: not one of its inputs. An experts
            # region's input is made inside the MoE module holding it, read as a mixer (Llama 4's
            # tokens repeated for every expert: whole on every rank under SP)
            made = {flag: tensor.untyped_storage()._cdata not in state[f"{flag} inputs"] for flag in ("region", "mixer")}
            part = 1 if state["region"] and made["region"] or state["sliced"] else \
                2 if state["mixer"] and made["mixer"] else 0
            # what runs whole inside a split region (a latent attention's down-projections and norms,
            # on the gathered sequence under SP): read with the mixers, whole on every rank
            part = 2 if state["whole"] or tensor.untyped_storage()._cdata in state["whole made"] else part
            part = 4 if tensor.untyped_storage()._cdata in state["tables"] else part
            kind = "sliced" if state["sliced"] and not kind else kind
            seen.append(((lambda: tensor) if held else weakref.ref(tensor), part, extra, kind, state["index"], form))
        elif state["after"]:  # a vocab-wide tensor is the head's: its logits, kept a token
            seen.append((weakref.ref(tensor), 8 if tensor.shape[-1:] == (vocab,) else 3, extra, "", -1, form))
        elif tensor.untyped_storage()._cdata != state["ids"]:  # outside the blocks, before the last
            seen.append((weakref.ref(tensor), 7, extra, "", -1, form))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # an alias, as plait's ActivationMeter hands back: a tensor saved as its own op's output,
        # handed back itself, ties it to its grad_fn in a cycle no collector sees, and every
        # measurement's graph stayed (28 MB a shape read of a 2-block, 256-wide model on the CPU)
        alias = tensor.detach()
        if not state["sdpa"]:
            copy = bool(outputs) and _copies_of(tensor, outputs)
            if copy or (outputs and tensor.untyped_storage()._cdata == outputs[-1].untyped_storage()._cdata):
                state["read"].add(len(outputs))  # an op after SDPA keeps its output, or a copy of it
            keep(alias, kind="copy" if copy else "")
        elif state["sdpa"] == "math":  # SDPA's own saves, in the math form meta runs too
            keep(alias, form="math")
        return alias

    def flagged(flag: str, value: bool | int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            state[flag] = value
        return hook

    def enter(flag: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            state[flag] = True
            state[f"{flag} inputs"] = {t.untyped_storage()._cdata for t in _tensors_in((args, kwargs))}
        return hook

    hooks = [layers[-1].register_forward_hook(flagged("after", True))]  # until a block runs again (a loop's)

    def left_block(*_: Any) -> None:  # its inputs no longer tell what a block made
        state["block"] = False
        state["block inputs"] = set()

    def tables(module: nn.Module, args: Any, output: Any) -> None:
        _hold(state["tables"], _tensors_in(output))

    hooks += [module.register_forward_hook(tables) for module in model.modules() if "Rotary" in type(module).__name__]

    def made_whole(module: nn.Module, args: Any, output: Any) -> None:
        state["whole"] = False
        _hold(state["whole made"], _tensors_in(output))  # held while listed, as the tables are

    for module in (m for block in parts.whole for m in block):
        hooks += [module.register_forward_pre_hook(flagged("whole", True)), module.register_forward_hook(made_whole)]
    for index, (block, inside, whole) in enumerate(zip(layers, parts.regions, parts.mixers)):
        hooks += [block.register_forward_pre_hook(enter("block"), with_kwargs=True),
                  block.register_forward_pre_hook(flagged("index", index)),
                  block.register_forward_pre_hook(flagged("after", False)),
                  block.register_forward_hook(left_block)]
        for flag, modules in (("region", inside), ("mixer", whole)):
            for module in modules:
                hooks += [module.register_forward_pre_hook(enter(flag), with_kwargs=True),
                          module.register_forward_hook(flagged(flag, False))]
    for module in (m for block in parts.sliced for m in block):
        hooks += [module.register_forward_pre_hook(flagged("sliced", True)),
                  module.register_forward_hook(flagged("sliced", False))]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        trained = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        given = _sdpa_options(args, kwargs)
        # a call a CPU runs in the math form: its saves are read too, for a CPU's keep alone
        math = trained and state["block"] and _cpu_takes_math(query, key, value, given)
        form = "fused" if math else ""
        state["sdpa"] = "math" if math else True
        try:
            out = sdpa(query, key, value, *args, **kwargs)
        finally:
            state["sdpa"] = False
        if trained:
            # what the flash kernel's node would save, which lives as long as the graph on the
            # output's path does: held, as no node here keeps these very tensors
            for tensor in (query, key, value):
                keep(tensor, held=True, kind="handed", form=form)
            keep(out, extra=query.shape[:-1].numel() * 4, held=True, form=form)  # and the log-sum-exp
            mask = given.get("attn_mask")
            handed_mask = isinstance(mask, torch.Tensor)
            made_here = handed_mask and state["block"] and _made_here_to_add(mask, state["block inputs"])
            if handed_mask and (mask.requires_grad or made_here):
                # a learned bias, kept for its gradient; a fused kernel keeps an additive mask the
                # block made for its backward too (MiniMax-M3's block index: 16 B a pair, 0.97-0.90)
                keep(mask, held=True, form=form)
            outputs.append(out)
            if state["block"] and handed and key.dim() == 4 and key.shape[1] > handed[-1][2]:
                share = 1 - handed[-1][2] / key.shape[1]  # K/V heads repeated past the ones handed
                state["repeated"] += share * sum(t.numel() * t.element_size() for t in (key, value))
        return out

    torch.nn.functional.scaled_dot_product_attention = flash
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            # as training runs it, without a key/value cache, which copies K and V (GPT-NeoX's,
            # Persimmon's, GPT-2's: views of a fused projection, which cost nothing more kept)
            with _one_sequence(), _TablesMade(state["tables"]):
                output = model(input_ids=ids, **no_cache(model))
        # what the graph still holds now the forward is done (a branch nothing reads is freed)
        kept: dict[int, tuple[int, int, str, int]] = {}
        views: dict[int, int] = {}  # a storage SDPA's inputs in a block view: the bytes they span
        others: set[int] = set()  # the storages anything else keeps
        sliced_views = 0  # what the row layers taking their slice save of a storage kept before them
        cpu_more = tuple(cpu - fused for cpu, fused in zip(_block_parts_kept(seen, params, "fused"),
                                                           _block_parts_kept(seen, params, "math")))
        for ref, part, extra, kind, index, form in seen:
            tensor = ref()
            if tensor is None or form == "math":
                continue
            storage = tensor.untyped_storage()
            if kind == "sliced" and storage._cdata in kept and kept[storage._cdata][2] != "sliced":
                sliced_views += tensor.numel() * tensor.element_size()
            if storage._cdata not in params and storage._cdata not in kept:
                kept[storage._cdata] = (storage.nbytes(), part, kind, index)
            if extra:
                kept[id(ref)] = (extra, part, "", index)
            if kind == "handed" and part < 3:
                views[storage._cdata] = views.get(storage._cdata, 0) + tensor.numel() * tensor.element_size()
            else:
                others.add(storage._cdata)
        # what SDPA's inputs alone keep beyond their own values: the rest of a fused projection's
        # output where nothing else keeps it, less the inputs that view what something else keeps
        beyond = (sum(kept[c][0] for c in views if c in kept and c not in others)
                  - sum(spanned for c, spanned in views.items() if c in kept))
        del output
        calls = len(outputs)
    finally:
        # the graph holds `pack` (so `keep`, and `seen`), and `seen` holds SDPA's tensors, whose
        # graph that is: a cycle through autograd's C++ that no collector sees, broken here
        seen.clear()
        outputs.clear()
        torch.nn.functional.scaled_dot_product_attention = sdpa
        for hook in hooks:
            hook.remove()
    rest, split, whole, after, tables, outside, head = (sum(size for size, part, _, _ in kept.values()
                                                            if part == which) for which in (0, 1, 2, 3, 4, 7, 8))
    copies = sum(size for size, part, kind, _ in kept.values() if kind == "copy" and part < 3)
    by_block = tuple(sum(size for size, part, _, index in kept.values() if part < 3 and index == block)
                     for block in range(len(layers)))
    return Kept(rest, split, whole, after, tables, copies, int(state["repeated"]), outside, head, beyond,
                len(state["read"]), calls, state["square"], by_block, sliced_views, cpu_more)


def _made_here_to_add(mask: torch.Tensor, inputs: set[int]) -> bool:
    """Whether SDPA's `mask` is an additive one a block made (not one of its inputs, `inputs`:
    their storages), which a fused kernel keeps as it is for its backward, on a CPU and a GPU
    alike. A boolean mask is kept as an additive copy, priced apart where transformers makes one
    (activations.sdpa_mask_copy_bytes); one the model made before the blocks serves them all."""
    return mask.is_floating_point() and mask.untyped_storage()._cdata not in inputs


def _block_parts_kept(seen: list[tuple[Any, int, int, str, int, str]], params: dict[int, Any],
                      left_out: str) -> tuple[int, int, int]:
    """Bytes the graph holds of the blocks' saves in `seen` (`_kept_in_blocks`'), by part (the
    rest, the split regions', the mixers'), each storage once, the parameters' not, leaving out
    what one form of SDPA alone keeps (`left_out`: "fused" for a CPU's keep, "math" for a GPU's)."""
    kept: dict[int, tuple[int, int]] = {}
    for ref, part, extra, _, _, form in seen:
        tensor = ref()
        if tensor is None or form == left_out or part > 2:
            continue
        storage = tensor.untyped_storage()
        if storage._cdata not in params and storage._cdata not in kept:
            kept[storage._cdata] = (storage.nbytes(), part)
        if extra:
            kept[id(ref)] = (extra, part)
    return tuple(sum(size for size, part in kept.values() if part == which) for which in range(3))


def _sdpa_options(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call of SDPA's options after query, key and value, by name, however they were passed."""
    names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    return {**dict(zip(names, args)), **kwargs}


def _cpu_takes_math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, given: dict[str, Any]) -> bool:
    """Whether a CPU runs this call of SDPA (its options `given`: `_sdpa_options`) in its math
    form, as torch chooses on CPU tensors of the same shapes, strides and needs (its fused
    kernel takes no mask that needs its gradient, no V narrower than K, no dropout), where a
    GPU's fused kernels take it. False where torch does not say."""

    def on_cpu(tensor: Any) -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                   device="cpu").requires_grad_(tensor.requires_grad)

    try:
        from torch.nn.attention import SDPBackend

        choice = torch._fused_sdp_choice(on_cpu(query), on_cpu(key), on_cpu(value), on_cpu(given.get("attn_mask")),
                                         float(given.get("dropout_p", 0.0)), bool(given.get("is_causal", False)),
                                         scale=given.get("scale"), enable_gqa=bool(given.get("enable_gqa", False)))
        return choice == SDPBackend.MATH.value
    except Exception:  # noqa: BLE001 - a torch without the choice, or a call it cannot place
        return False


def _declared_parts(model: nn.Module, blocks: str) -> Parts | None:
    """The cut the model's pp plan makes, declared or inferred, where its block list is
    `blocks`, with each piece on the side of the blocks its stage holds it; None where no such
    cut is read. Where the model's forward runs a declared piece on the other side of the blocks
    (OPT registers its final norm before its layers), or the plan leaves a piece with
    parameters unplaced (ModernBERT's head), the usual stages cannot be the model (their check
    on real weights fails), so the stages run the model's own forward (models/hf/plans.py) and
    hold the pieces as it runs them (`_own_cut`: about 0.3 s more for a 405 B Llama's config)."""
    plan = cut_plan(model)[0]
    try:
        parts: Parts | None = hf_stages.declared_parts(model, plan)
    except PlaitError:
        parts = None
    own = _own_cut(model, plan)
    if own is not None and (parts is None or (set(parts.first), set(parts.last)) != (set(own.first), set(own.last))):
        parts = own
    return parts if parts is not None and parts.blocks == blocks else None


def _own_cut(model: nn.Module, plan: dict[str, Any]) -> Parts | None:
    """own_forward.own_parts on the meta model, its forward stopped at the first block: the
    pieces it ran by then before the blocks, the others after. None where it does not run."""
    try:
        return own_parts(model, plan, model, until_blocks=True)
    except Exception:  # noqa: BLE001 - a forward that does not run on meta: the declared cut stands
        return None


def _after_blocks(model: nn.Module, parts: Parts | None, seen: set[int]) -> int | None:
    """The parameters of the pieces the pipeline's last stage holds after the blocks (by the
    cut `parts`: the final norm, the head and what a family adds beside them), less those in
    `seen` (the blocks') and a head tied to the embedding; None where no cut is read (all that
    is outside the blocks is then counted on the first stage). A cut whose stages run the
    model's own forward holds its pieces as that forward runs them (`_declared_parts`)."""
    if parts is None:
        return None
    embedding = getattr(model, "get_input_embeddings", lambda: None)()
    tied = {id(p) for p in embedding.parameters()} if isinstance(embedding, nn.Module) else set()
    held = {id(p): p for key in parts.last for p in model.get_submodule(key).parameters()
            if id(p) not in seen and id(p) not in tied}
    return sum(p.numel() for p in held.values())


def _inside(plan: dict[str, str], blocks: str, index: int, whole: set[str] = frozenset()) -> dict[str, str]:
    """The entries of `plan` inside block `index` ("model.layers.*.mlp.up_proj"), named from the
    block, less those at or under the modules `whole` names (where SP keeps a block whole)."""
    block = f"{blocks}.{index}"
    kept = [name[len(block):].lstrip(".") for name in whole if name == block or name.startswith(f"{block}.")]
    inside = {key[len(blocks) + 3:]: style for key, style in plan.items() if key.startswith(f"{blocks}.*.")}
    return {key: style for key, style in inside.items()
            if not any(not name or key == name or key.startswith(f"{name}.") for name in kept)}


def _block_tally(block: nn.Module, params: list[nn.Parameter], plans: list[dict[str, str]],
                 shape: GPTConfig) -> tuple[int, int, int, int]:
    """(split, whole, routed, split under SP) of `params`, the block's own parameters
    (`_owned_by_block`), under `plans` (the block's tp plan, and its SP form): a parameter is
    split where an entry naming its module splits the module's weights (a row layer's bias is
    added after its sum, whole), or names the parameter itself; routed where it is one of an
    MoE's `experts` (an ep plan deals them out; tp splits them only as `moe_tp_experts`,
    routed_split_by_tp)."""
    experts = {id(p) for module in block.modules() if shape.is_moe
               and isinstance(getattr(module, "experts", None), nn.Module) for p in module.experts.parameters()}
    # experts the plan splits with no ep to deal them out are split (LongCat's); Llama 4's, whose
    # dense experts ep can also deal out, stay routed (split by tp only at ep 1: routed_split_by_tp)
    splits = [_split_by(block, plan) for plan in plans]  # once each: not again for every parameter
    routed = experts if shape.tp_expert_rows else experts - splits[0]
    n_routed = sum(p.numel() for p in params if id(p) in routed)
    split, split_sp = (sum(p.numel() for p in params if id(p) in not_routed)
                       for not_routed in [ids - routed for ids in splits])
    return split, sum(p.numel() for p in params) - split - n_routed, n_routed, split_sp


def _split_by(block: nn.Module, plan: dict[str, str]) -> set[int]:
    """The ids of the block's parameters `plan` (named from the block) splits."""
    split: set[int] = set()
    for inside, style in plan.items():
        for name, module in block.named_modules():
            if name and fnmatchcase(name, inside):
                split.update(id(p) for pname, p in module.named_parameters() if style in SPLIT_SUBTREE
                             or style in COLUMN_STYLES or (style in ROWS and pname != "bias"))
        for name, param in block.named_parameters():
            if fnmatchcase(name, inside) and style in (*COLUMN_STYLES, *ROWS, "packed_rowwise"):
                split.add(id(param))
    return split


def _in_block(block: nn.Module, name: str) -> nn.Module | None:
    """The block's module a plan entry names, or None where that block lacks it (an MoE
    block's layer in a dense block, a hybrid's other kind of layer: OLMo-hybrid's linear
    attention has no self_attn); the first it matches where the entry has a wildcard inside
    the block (LongCat's two attentions a layer: "self_attn.*.o_proj")."""
    if "*" in name:
        return next((module for inner, module in block.named_modules() if fnmatchcase(inner, name)), None)
    try:
        return block.get_submodule(name)
    except AttributeError:
        return None


def _vocabulary_vectors(head: nn.Module | None, vocab: int) -> int:
    """How many vectors over the vocabulary the head holds beside its weight (tensor/layers.
    head_vectors: a bias, a learned scale a logit), which a vocabulary split cuts with it."""
    return len(head_vectors(head, vocab)) if isinstance(head, nn.Module) else 0


def _bias(layer: nn.Module | None) -> int:
    bias = getattr(layer, "bias", None)
    return bias.numel() if isinstance(bias, torch.Tensor) else 0


MLP_NAMES = ("mlp", "feed_forward", "ffn")  # a block's MLP, by the names families give it (LFM2's, MPT's)


def _mlp_of(block: nn.Module | None) -> nn.Module | None:
    """A block's MLP module, or None (OPT's fc1 and fc2 sit in the block itself)."""
    return next((getattr(block, name) for name in MLP_NAMES if isinstance(getattr(block, name, None), nn.Module)),
                None)


def _mlp_layers(block: nn.Module) -> list[nn.Module]:
    """A block's MLP's linear layers: those under its MLP (`_mlp_of`), or, where it has none, its
    own linear children (OPT's fc1 and fc2)."""
    mlp = _mlp_of(block)
    if mlp is not None:
        return [module for module in mlp.modules() if isinstance(module, nn.Linear)]
    return [module for module in block.children() if isinstance(module, nn.Linear)]


def _adds_residual(module: nn.Module | None) -> bool:
    """Whether a module's forward takes the residual it adds (MPT's MLP): under SP its output is
    not what a row layer inside returned, so it is read whole (models/hf/styles._probe_regions)."""
    try:
        return module is not None and "residual" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _mlp_width(layers: nn.ModuleList | None, shape: GPTConfig) -> int:
    """The hidden width of the first dense block's MLP, read off its down projection (the linear
    layer back to d_model from another width), where it differs from config.json's: LFM2 sizes
    its MLP from block_ff_dim, cut to two thirds and rounded to a multiple of 256. 0 where the
    config's stands or no such layer is found."""
    downs = [layer.in_features for layer in _mlp_layers(_first_dense_block(layers, shape) or nn.Module())
             if layer.out_features == shape.d_model and layer.in_features != shape.d_model]
    return downs[0] if len(downs) == 1 and downs[0] != shape.ffn_hidden else 0


def _moe_fields(model: nn.Module, layers: nn.ModuleList | None, shape: GPTConfig) -> dict[str, Any]:
    """What an MoE's config.json does not say, or says under a name the family does not read,
    read off its first MoE block (the module holding `experts`): its experts' width (Mixtral's
    are intermediate_size wide whatever moe_intermediate_size says), its shared experts' width
    (Llama 4 always has one, sized by the experts' intermediate_size), a gate on their output
    (Qwen2-MoE's `shared_expert_gate`), and whether tp splits its experts
    (GPTConfig.tp_expert_rows: a tp plan marking them "moe_tp_experts", every expert on every
    token, and no ep plan; tp_routed_split: the same plan, the experts routed top-k), and whether
    training counts its routing (GPTConfig.counts_routing). {} for a dense model. A width is
    taken only where the weights make whole SwiGLUs of it."""
    block = next((m for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module)), None)
    if not shape.is_moe or block is None:
        return {}
    fields: dict[str, Any] = {}
    layers = layers or []
    moe = tuple(i for i, layer in enumerate(layers)
                if any(isinstance(getattr(m, "experts", None), nn.Module) for m in layer.modules()))
    every = tuple(i for i in range(shape.n_layers) if shape.moe_layer(i))
    if moe and len(layers) == shape.n_layers and moe != every:
        fields["moe_blocks"] = moe  # DeepSeek's dense first blocks (first_k_dense_replace), and the like
    h = shape.d_model
    routed = sum(p.numel() for p in block.experts.parameters() if p.ndim >= 2)
    if routed and routed % (3 * h * shape.experts) == 0:
        fields["expert_hidden"] = routed // (3 * h * shape.experts)
    # the shared experts: inside the MoE module, or beside it in its block (GraniteMoE-shared's shared_mlp)
    holders = [block, *([layers[moe[0]]] if moe else [])]
    shared = next((getattr(holder, name) for holder in holders for name in SHARED_EXPERTS
                   if isinstance(getattr(holder, name, None), nn.Module)), None)
    weights = sum(p.numel() for p in shared.parameters() if p.ndim >= 2) if isinstance(shared, nn.Module) else 0
    if weights and weights % (3 * h) == 0:
        width = weights // (3 * h)
        expert = fields.get("expert_hidden", shape.expert_width)
        fields["shared_experts"] = max(1, round(width / expert))
        fields["shared_hidden"] = 0 if width == fields["shared_experts"] * expert else width
    fields["shared_expert_gate"] = isinstance(getattr(block, "shared_expert_gate", None), nn.Module)
    fields["counts_routing"] = counts_routing(model, declared(model, "ep"))
    tp = declared(model, "tp")
    if not declared(model, "ep") and dense_experts(model, tp):
        fields["tp_expert_rows"] = shape.experts
    elif not declared(model, "ep") and "moe_tp_experts" in tp.values():  # LongCat's routed top-k experts
        fields["tp_routed_split"] = True
    return fields


def _mlp_matrices(layers: nn.ModuleList | None, shape: GPTConfig) -> int:
    """The weight matrices of the first dense block's MLP (`_mlp_layers`), counted in
    d_model × ffn_hidden units (a fused gate|up counts two); 0 when there is no dense block,
    no MLP found, or a count that is not 2 or 3."""
    dense = _first_dense_block(layers, shape)
    mlp = _mlp_of(dense)
    if mlp is not None:  # every matrix under it (fused, grouped or plain)
        weights = sum(p.numel() for p in mlp.parameters() if p.ndim == 2)
    else:
        weights = sum(layer.weight.numel() for layer in _mlp_layers(dense)) if dense is not None else 0
    matrices = round(weights / (shape.d_model * shape.ffn_hidden))
    return matrices if matrices in (2, 3) else 0


def _first_line(exc: BaseException) -> str:
    """An exception's kind and the first line of its message: plait's errors are one line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
