"""A sweep over transformers' causal-LM families: each trains like one process, or is refused. One spawn.

For every family of FAMILIES (a tiny model built by `AutoConfig.for_model` from one seed, no
plan and no adapter from the user) and every mode it declares a plan for, 3 AdamW steps of 2
micro-batches on the same global batches, against one process training the whole batch:

- "tp": init_mesh(tp=2), run where `model.tp_plan` is non-empty;
- "tp_sp": the same with sequence parallelism;
- "pp": init_mesh(pp=2, schedule="1f1b"), the 2 micro-batches through a PipelineRunner;
  always tried (plait may find the cut without a pp_plan);
- "ep" (the families declaring an ep plan): init_mesh(dp=2, ep=2), each rank its half of
  every batch, plait.no_sync on the first micro-batch, the dp-mean loss.

Each case is classified (`verdict`): "exact" (every loss within rtol 1e-4 of the reference,
the final parameters, gathered whole, within rtol 1e-4 / atol 5e-6 elementwise), "refused"
(a PlaitError: its first line), "different" (ran, numbers differ: the worst loss or
parameter), "crash" (any other exception, or a PlaitError on one rank only: a rank left
waiting for the other), "n/a" (the model declares no plan for the mode). One case cannot
stop the sweep: each is caught, and the ranks agree on the verdict after it (over a group
of their own); a rank stuck in a collective its peer never entered gives up after
COLLECTIVE_TIMEOUT_S and the case is a crash naming the timeout. Every rank rewrites its
report after each case, so a world that dies still shows where.

Report (every rank): "cases" {family/mode: {verdict, detail, seconds}} (the ranks' agreed
verdicts), "mine" (this rank's own), "plans", "seconds"; rank 0 adds "table" {family: {mode:
verdict}} and "counts" {verdict: n}, for docs.

argv (for a partial sweep by hand): [families,comma,separated [modes,comma,separated]].
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

import plait
from plait.errors import PlaitError
from plait.parallel.placement import placement_of
from plait.parallel.tensor.ops import all_gather_stacked
from plait.parallel.tensor.plan import gather_full_params
from plait.runtime import comm
from tests.worldlib import save_report
from tests.worlds.hf_common import pipeline_steps

SEED, STEPS, BATCH, ACCUM, SEQ, VOCAB = 0, 3, 4, 2, 16, 128
# Adam moves an element whose gradient is near zero by up to lr·δg/eps for a last-bit δg (another
# summation order: tests/worlds/hf_plans_world.py). At eps 1e-6 olmo2's tp embedding drifted by
# 1.1e-5 on one 2-core AVX2 machine and not on another; eps 1e-5 keeps such noise a tenth of that,
# under the parameters' atol, while a real split error still moves the losses and parameters.
ADAM = dict(lr=1e-3, weight_decay=0.0, eps=1e-5)
LOSS_RTOL, PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-4, 5e-6
COLLECTIVE_TIMEOUT_S = 30  # a rank left alone in a collective gives up after this (the process group's timeout)
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)  # 4 experts, top 2, under each family's names
# model_type -> what SHAPE does not say (overrides SHAPE's fields where both name one).
# Of the ~150 model types whose config declares base_model_tp_plan, these build tiny and train
# one process in well under a second. Left out (transformers 5.24, this shape), with why:
#   deepseek_v32, minicpm3, glm4_moe_lite, glm_moe_dsa, longcat_flash, axk1/2: other MLA
#     attentions; the one-process forward fails at SHAPE (deepseek_v2 and v3 stand for them, with their dims);
#   codegen, gptj: the one-process forward fails at SHAPE (rotary_dim against head_dim);
#   gemma3, gemma4, llama4, qwen3_5(_moe): AutoModelForCausalLM builds the multimodal model, its
#     vision tower at the default size: over a minute on CPU (gemma3_text is Gemma 3's text model);
#   jamba, bamba, granitemoehybrid, lfm2_moe, dots3_note, glm5_next, esmc: fail to build or to run at
#     SHAPE (hybrid mamba/conv stacks, config validation);
#   bailing_hybrid, flex_olmo, kimi_linear, olmo_hybrid, lfm3, hy_v4, glm4, phi4_multimodal: a default
#     pad_token_id beyond the vocabulary (glm, phi3 and smollm3 here take pad_token_id=0);
#   falcon_h1, nemotron_h, afmoe, mimo_v2_flash, kolibri1, hy_v3 and other MoE families: build, but
#     with their default expert counts or mamba sizes too slowly for this sweep (untuned);
#   ministral, olmo3, exaone, internlm3, iquestcoder, granitemoe...: llama/mistral/olmo2/mixtral
#     again (all exact when tried: the world's time goes to families that differ);
#   the *_vl / omni / ocr / audio / encoder families: no AutoModelForCausalLM class.
FAMILIES: dict[str, dict[str, Any]] = {
    # dense
    "llama": {},
    "mistral": dict(sliding_window=6),
    "qwen2": {},
    "qwen3": dict(tie_word_embeddings=True),
    "gemma": {},
    "gemma2": {},
    "gemma3_text": {},
    "cohere": {},
    "cohere2": {},
    "olmo": {},
    "olmo2": {},
    "phi3": dict(pad_token_id=0),
    "granite": {},
    "starcoder2": {},
    "glm": dict(pad_token_id=0),
    "helium": {},
    "smollm3": dict(pad_token_id=0),
    "exaone4": {},
    "ernie4_5": {},
    "seed_oss": {},
    "arcee": {},
    "apertus": {},
    "hunyuan_v1_dense": {},
    "granite_swa": {},  # attention sinks, a parameter split by its heads ("sinks": colwise)
    # mixtures of experts
    "olmoe": dict(num_experts=4, **MOE),
    "phimoe": dict(num_local_experts=4, router_jitter_noise=0.0, input_jitter_noise=0.0, **MOE),
    "mixtral": dict(num_local_experts=4, **MOE),
    "qwen2_moe": dict(num_experts=4, shared_expert_intermediate_size=48, **MOE),
    "qwen3_moe": dict(num_experts=4, **MOE),
    "qwen3_next": dict(num_hidden_layers=4, num_experts=4, shared_expert_intermediate_size=48,
                       linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                       linear_num_value_heads=4, **MOE),
    "minimax": dict(num_local_experts=4, **MOE),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2, moe_intermediate_size=32),
    "dots1": dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, **MOE),
    # MLA: no grouped kv heads, the rotary part of q/k as wide as head_dim (the rotary angles' width)
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                        n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=8, **MOE),
    # MLA with its key projection split as declared ("mla_kv_a_proj": the rotary key enters whole)
    "deepseek_v2": dict(num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **MOE),
    # Llama 4's text model: experts packed as (E, hidden, 2·d) and run densely on every token,
    # scaled by a sigmoid of the router's top scores; a dense layer, then an MoE one; a layer
    # without rotary angles; attention chunks of 8 tokens (shorter than the sequence)
    "llama4_text": dict(intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=2,
                        interleave_moe_layer_step=2, no_rope_layers=[1, 0], attention_chunk_size=8),
}
# PhiMoE's router samples in training (sparsemixer: Gumbel noise among the experts within
# router_jitter_noise of the best, and a random midpoint mask in backward), like dropout: the
# stages of a pipeline or the ranks of ep draw from their own generators. With the jitter at
# 0 only the best expert is ever a candidate and the mask is always on: its training, random
# numbers drawn and all, is deterministic, as dropout 0 makes the others'.
MODES = ("tp", "tp_sp", "pp", "ep")
torch.set_num_threads(1)
warnings.filterwarnings("ignore")
hf_logging.set_verbosity_error()


def build(family: str) -> torch.nn.Module:
    config = AutoConfig.for_model(family, **{**SHAPE, **FAMILIES[family]})
    for key, value in list(vars(config).items()):  # every dropout off (names differ by family)
        if "dropout" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(config)


def plans(model: torch.nn.Module) -> dict[str, bool]:
    return {"tp": bool(getattr(model, "tp_plan", None)), "pp": bool(getattr(model, "pp_plan", None)),
            "ep": bool(getattr(model.config, "base_model_ep_plan", None) or getattr(model, "ep_plan", None)
                       or "moe_tp_experts" in (getattr(model, "tp_plan", None) or {}).values())}


def applies(mode: str, declared: dict[str, bool]) -> bool:
    return {"tp": declared["tp"], "tp_sp": declared["tp"], "pp": True, "ep": declared["ep"]}[mode]


def data() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train(model: Any, batches: list[torch.Tensor], optimizer: Any, sync: Any = None) -> list[float]:
    """AdamW steps of ACCUM micro-batches (loss / ACCUM); `sync` wraps all but the last."""
    losses = []
    for rows in batches:
        micro, total = rows.chunk(ACCUM), 0.0
        for i, part in enumerate(micro):
            with sync(model) if sync and i < len(micro) - 1 else contextlib.nullcontext():
                loss = loss_fn(model(input_ids=part[:, :-1]).logits, part[:, 1:])
                (loss / len(micro)).backward()
            total += loss.item() / len(micro)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def detached(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in params.items()}


def reference(family: str, batches: list[torch.Tensor]) -> dict[str, Any]:
    model = build(family)
    losses = train(model, batches, torch.optim.AdamW(model.parameters(), **ADAM))
    return {"losses": losses, "params": detached(dict(model.named_parameters()))}


def tensor_parallel(family: str, batches: list[torch.Tensor], sp: bool = False) -> dict[str, Any]:
    mesh = plait.init_mesh(tp=2, sp=sp)
    try:
        model = plait.parallelize(build(family), mesh, plait.ParallelConfig())
        losses = train(model, batches, plait.build_optimizer(model, torch.optim.AdamW, **ADAM))
        whole = gather_full_params(model, purpose=comm.TELEMETRY)  # a collective: every rank gathers
        return {"losses": losses, "params": detached(whole), "whole": True}
    finally:
        quiet(mesh)


def pipelined(family: str, batches: list[torch.Tensor]) -> dict[str, Any]:
    """pp 2, 1F1B: a step's ACCUM micro-batches are the pipeline's; each rank its stages' parameters."""
    mesh = plait.init_mesh(pp=2, schedule="1f1b")
    try:
        stages = plait.parallelize(build(family), mesh, plait.ParallelConfig())
        optimizer = plait.build_optimizer(stages, torch.optim.AdamW, **ADAM)
        out = pipeline_steps(stages, mesh, batches, ACCUM, loss_fn, optimizer)
        return {"losses": out["losses"], "params": detached(out["held"]), "whole": False}
    finally:
        quiet(mesh)


def expert_parallel(family: str, batches: list[torch.Tensor]) -> dict[str, Any]:
    """dp 2 × ep 2: each rank trains its half of every global batch; the dp-mean loss; the
    experts' halves gathered whole."""
    mesh = plait.init_mesh(dp=2, ep=2)
    try:
        model = plait.parallelize(build(family), mesh, plait.ParallelConfig())
        optimizer = plait.build_optimizer(model, torch.optim.AdamW, **ADAM)
        half = [rows.chunk(2)[mesh.rank("dp")] for rows in batches]
        losses = [dp_mean(loss, mesh) for loss in train(model, half, optimizer, sync=plait.no_sync)]
        whole = {}
        for name, param in model.named_parameters():
            placement = placement_of(param)
            tensor = param.detach()
            if placement.split("ep") is not None:  # every ep rank's experts, joined in ep-rank order
                tensor = placement.join(all_gather_stacked(tensor.contiguous(), mesh.axis("ep"), comm.TELEMETRY), "ep")
            whole[name] = tensor.clone()
        return {"losses": losses, "params": whole, "whole": True}
    finally:
        quiet(mesh)


def dp_mean(value: float, mesh: Any) -> float:
    mean = torch.tensor([value], dtype=torch.float64)
    comm.all_reduce(mean, mesh.axis("dp"), purpose=comm.TELEMETRY)
    return mean.item() / mesh.size("dp")


def quiet(mesh: Any) -> None:
    """Stop a finished case's flight-recorder publisher (one thread per mesh otherwise); the
    process groups stay (closing one tears the world's down)."""
    recorder = getattr(mesh.ledger, "recorder", None)
    if recorder is not None:
        with contextlib.suppress(Exception):
            recorder.stop()


RUNS = {"tp": tensor_parallel, "tp_sp": lambda family, batches: tensor_parallel(family, batches, sp=True),
        "pp": pipelined, "ep": expert_parallel}


def compare(found: dict[str, Any], expected: dict[str, Any]) -> tuple[str, str]:
    """("exact" | "different", detail): the worst loss, then the worst parameter element."""
    losses, want = found["losses"], expected["losses"]
    if len(losses) != len(want):
        return "different", f"{len(losses)} losses, expected {len(want)}"
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
    if not rel <= LOSS_RTOL:
        return "different", f"loss rel diff {rel:.2e} (losses {[round(x, 6) for x in losses]}, " \
                            f"expected {[round(x, 6) for x in want]})"
    params, reference_params = found["params"], expected["params"]
    missing = sorted(set(params) - set(reference_params))
    if missing or (found["whole"] and set(params) != set(reference_params)):
        extra, absent = missing[:3], sorted(set(reference_params) - set(params))[:3]
        return "different", f"parameter names differ: extra {extra}, missing {absent}"
    worst, worst_name = float("-inf"), ""
    for name, tensor in params.items():
        ref = reference_params[name]
        if tensor.shape != ref.shape:
            return "different", f"parameter {name} has shape {tuple(tensor.shape)}, expected {tuple(ref.shape)}"
        excess = ((tensor.float() - ref.float()).abs() - PARAM_ATOL - PARAM_RTOL * ref.float().abs()).max().item()
        if not excess <= worst:
            worst, worst_name = excess, name
    if worst > 0 or worst != worst:
        return "different", f"parameter {worst_name} off by {worst:.2e} beyond rtol {PARAM_RTOL}/atol {PARAM_ATOL}"
    return "exact", f"loss rel diff {rel:.1e}"


def run_case(family: str, mode: str, batches: list[torch.Tensor], expected: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        found = RUNS[mode](family, batches)
        verdict, detail = compare(found, expected)
        held = sorted(found["params"]) if not found["whole"] else None
    except PlaitError as error:
        verdict, detail, held = "refused", first_line(error), None
    except Exception as error:  # noqa: BLE001 - a sweep: any other exception is this case's finding
        verdict, detail, held = "crash", f"{type(error).__name__}: {first_line(error)}", None
    return {"verdict": verdict, "detail": detail, "seconds": round(time.perf_counter() - start, 3), "held": held}


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:400] if text else type(error).__name__


def agree(mine: dict[str, Any], expected: dict[str, Any], group: Any) -> dict[str, Any]:
    """The ranks' verdicts, as one: the same on every rank, or the worst, saying which rank."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=group)
    verdicts = [case["verdict"] for case in everyone]
    seconds = max(case["seconds"] for case in everyone)
    if len(set(verdicts)) == 1 and verdicts[0] == "exact" and everyone[0]["held"] is not None:
        held = {name for case in everyone for name in case["held"]}  # pp: the stages hold the whole model
        if held != set(expected["params"]):
            return {"verdict": "different", "seconds": seconds,
                    "detail": f"the stages hold {len(held)} parameters, the model {len(expected['params'])}: "
                              f"missing {sorted(set(expected['params']) - held)[:3]}"}
    if len(set(verdicts)) == 1:
        return {"verdict": verdicts[0], "detail": everyone[0]["detail"], "seconds": seconds}
    if "refused" in verdicts and "crash" not in verdicts and "different" not in verdicts:
        rank = verdicts.index("refused")  # refused on one rank only: the other would have hung
        return {"verdict": "crash", "seconds": seconds,
                "detail": f"refused on rank {rank} only: {everyone[rank]['detail']}"}
    for worst in ("crash", "different", "refused"):
        if worst in verdicts:
            rank = verdicts.index(worst)
            return {"verdict": worst, "seconds": seconds,
                    "detail": f"rank {rank}: {everyone[rank]['detail']} (ranks: {verdicts})"}
    raise AssertionError(verdicts)


def main() -> None:
    families = sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1] else list(FAMILIES)
    modes = sys.argv[2].split(",") if len(sys.argv) > 2 else list(MODES)
    started = time.perf_counter()
    plait.init_mesh(timeout_s=COLLECTIVE_TIMEOUT_S)  # the world's process group, with the sweep's timeout
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=4 * COLLECTIVE_TIMEOUT_S))
    rank = dist.get_rank()
    batches = data()
    report: dict[str, Any] = {"cases": {}, "mine": {}, "plans": {}, "families": families, "modes": modes}
    for family in families:
        try:
            declared = plans(build(family))
            expected = reference(family, batches)
        except Exception as error:  # noqa: BLE001 - the family itself does not build or train here
            for mode in modes:
                report["cases"][f"{family}/{mode}"] = {"verdict": "crash", "seconds": 0.0,
                                                       "detail": f"reference: {type(error).__name__}: "
                                                                 f"{first_line(error)}"}
            continue
        report["plans"][family] = declared
        for mode in modes:
            key = f"{family}/{mode}"
            if not applies(mode, declared):
                report["cases"][key] = report["mine"][key] = {"verdict": "n/a", "detail": "", "seconds": 0.0}
                continue
            report["in_progress"] = key
            save_report(report)  # a world that hangs or dies here still shows which case
            mine = run_case(family, mode, batches, expected)
            report["cases"][key] = agree(mine, expected, group)
            report["mine"][key] = {k: v for k, v in mine.items() if k != "held"}
    report.pop("in_progress", None)
    report["seconds"] = round(time.perf_counter() - started, 2)
    if rank == 0:
        report["table"] = {family: {mode: report["cases"].get(f"{family}/{mode}", {}).get("verdict")
                                    for mode in modes} for family in families}
        counts: dict[str, int] = {}
        for case in report["cases"].values():
            counts[case["verdict"]] = counts.get(case["verdict"], 0) + 1
        report["counts"] = counts
    save_report(report)
    if os.environ.get("PLAIT_SWEEP_PRINT") and rank == 0:
        for key, case in report["cases"].items():
            print(f"{key:28s} {case['verdict']:9s} {case['seconds']:6.2f}s  {case['detail'][:160]}")
        print(f"counts {report['counts']}  world {report['seconds']}s")


if __name__ == "__main__":
    main()
