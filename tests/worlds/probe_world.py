"""The probe refuses a split that would train another model: planted defects, one per axis. One spawn.

Each case plants, inside this world only, a defect a plan or a strategy could carry, and
asks `plait.parallelize` to split a tiny model; the probe (plait/parallel/probe.py) must
refuse it on every rank with one line naming the first module whose output differs:

- tp 2: Gemma's scaled embedding replaced by a plain vocabulary-parallel one (today's fix
  reverted: the split keeps no subclass arithmetic), for Gemma 1, 2 and 3, ± sp where the
  embedding is split;
- cp 2: the model's global positions dropped (each rank's rotary angles start at 0);
- ep 2: every expert's output doubled on the ranks that receive dispatched rows;
- tp 2 with a user plan splitting the MLP wrongly (its up projection as a row layer, which
  reads a split input), and one summing a whole norm's gradient over tp (its forward is
  the model's, its gradient twice the model's).

And the same models without the defects pass, so the probe is not a blanket refusal; each
pass reports the probe's cost (seconds, from the log line's clock).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import plait
from plait.errors import PlaitError
from plait.models.adapters import adapter_for
from plait.models.gpt.config import get_preset
from plait.models.gpt.model import GPT
from tests.worldlib import save_report

torch.set_num_threads(1)
SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def hf(family: str, **extra: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **SHAPE, **extra))


def gpt(name: str = "tiny") -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(get_preset(name))


@contextlib.contextmanager
def planted(target: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, old)


def attempt(make: Any, layout: dict[str, Any], plan: dict[str, str] | None = None) -> dict[str, Any]:
    """parallelize's verdict: {"refused": the one line} or {"seconds": what parallelize took}."""
    mesh = plait.init_mesh(**layout)
    start = time.perf_counter()
    try:
        plait.parallelize(make(), mesh, plait.ParallelConfig(tp_plan=plan))
    except PlaitError as error:
        return {"refused": str(error)}
    return {"seconds": time.perf_counter() - start}


def doubled_experts(dispatch_call: Any) -> Any:
    def call(self: Any, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return 2 * dispatch_call(self, x, index, weight)
    return call


def main() -> None:
    import plait.parallel.context.plan as context_plan
    import plait.parallel.tensor.plan as tensor_plan
    from plait.parallel.expert.dispatch import ExpertDispatch

    report: dict[str, Any] = {"defect": {}, "clean": {}}
    moe = dict(num_local_experts=4, num_experts_per_tok=2)
    for family in ("gemma", "gemma2", "gemma3_text"):
        report["clean"][f"{family}-tp"] = attempt(lambda f=family: hf(f), dict(tp=2))
        with planted(tensor_plan, "overrides_forward", lambda *_: False):
            report["defect"][f"{family}-tp"] = attempt(lambda f=family: hf(f), dict(tp=2))
    no_positions = lambda context: (lambda module, args, kwargs: None)  # noqa: E731
    for name, make in (("llama", lambda: hf("llama")), ("gpt", gpt)):
        report["clean"][f"{name}-cp"] = attempt(make, dict(cp=2))
        with planted(context_plan, "_global_positions", no_positions):
            report["defect"][f"{name}-cp"] = attempt(make, dict(cp=2))
    for name, make in (("mixtral", lambda: hf("mixtral", **moe)), ("gpt-moe", lambda: gpt("tiny-moe"))):
        report["clean"][f"{name}-ep"] = attempt(make, dict(dp=2, ep=2))
        with planted(ExpertDispatch, "__call__", doubled_experts(ExpertDispatch.__call__)):
            report["defect"][f"{name}-ep"] = attempt(make, dict(dp=2, ep=2))
    layers = "model.layers.*"
    wrong = {f"{layers}.mlp.gate_proj": "column", f"{layers}.mlp.up_proj": "row"}  # up_proj reads a whole input
    report["defect"]["llama-plan"] = attempt(lambda: hf("llama"), dict(tp=2), wrong)
    llama = hf("llama")
    declared = adapter_for(llama).tensor_plan(llama, 2, False)  # in plait's styles
    summed_twice = {**declared, f"{layers}.input_layernorm": "grad_sum"}  # a whole norm's gradient summed over tp
    report["defect"]["llama-grad"] = attempt(lambda: hf("llama"), dict(tp=2), summed_twice)
    import plait.parallel.probe as probe

    with planted(probe, "SMALL_PARAMETER", 0):  # every gradient compared through its projections
        report["defect"]["llama-grad-projected"] = attempt(lambda: hf("llama"), dict(tp=2), summed_twice)
        report["clean"]["llama-tp-projected"] = attempt(lambda: hf("llama"), dict(tp=2))
    save_report(report)


if __name__ == "__main__":
    main()
