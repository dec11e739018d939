"""One definition per rule: what `plait plan` recommends, `plait train` accepts, and the
choices `parallel/`, `train/` and `estimate/` offer are the same objects."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from plait import rules
from plait.errors import PlaitError
from plait.estimate import estimate_layout
from plait.estimate.planner import plan
from plait.models.gpt.config import TRAINABLE, get_preset
from plait.runtime.env import have_torchao
from plait.families import family_of
from plait.train.config.settings import TrainConfig, check_strategies


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def train_checks(config: TrainConfig) -> None:
    """What `plait train` checks of a layout before spawning: its rules, then the model's."""
    check_strategies(config)
    family_of(config).check(config)


def _train_config(model: str, row: dict, precision: str, schedule: str, seq_len: int) -> TrainConfig:
    world = row["dp"] * row["tp"] * row["pp"]
    return replace(TrainConfig(), model=model, dp=row["dp"], tp=row["tp"], pp=row["pp"], zero=row["zero"],
                   sp=row["sp"], offload=row["offload"], micro_batch=row["micro_batch"],
                   grad_accum=row["grad_accum"], recompute=row["recompute"], precision=precision,
                   schedule=schedule, seq_len=seq_len, nproc=world)


@pytest.mark.parametrize("model", TRAINABLE)
@pytest.mark.parametrize("precision", rules.PRECISIONS)
def test_every_planned_layout_passes_train_validation(model: str, precision: str) -> None:
    if precision == "fp8" and not have_torchao():
        pytest.skip("--precision fp8 needs torchao (plait[fp8]), which this Python lacks: train refuses it")
    config, checked = get_preset(model), 0
    for gpus in (1, 2, 4, 8):
        for schedule in ("gpipe", "1f1b", "zb-h1"):
            for offload in (False, True):
                rows = plan(config, gpus=gpus, global_batch=8, hardware="h100-sxm", seq_len=30,
                            precision=precision, schedule=schedule, offload=offload)
                for row in rows:
                    train_checks(_train_config(model, row, precision, schedule, seq_len=30))
                    checked += 1
    assert checked > 100
    # seq_len 30 is not a multiple of 4: the planner offers SP only where tp divides it
    assert not any(r["sp"] and r["tp"] == 4 for r in plan(config, gpus=4, global_batch=8, hardware="h100-sxm",
                                                          seq_len=30, precision=precision))


def test_one_home_for_each_choice() -> None:
    from plait.estimate import layout
    from plait.parallel import recompute
    from plait.schedule import build as schedule
    from plait.models.gpt import adapter as gpt_adapter

    assert schedule.SCHEDULES is layout.SCHEDULES is rules.SCHEDULES
    assert recompute.POLICIES is layout.RECOMPUTE is rules.RECOMPUTE
    assert layout.PRECISIONS is rules.PRECISIONS and layout.REDUCE_DTYPES is rules.REDUCE_DTYPES
    assert "check_split" in gpt_adapter.GPTAdapter.tensor_plan.__code__.co_names  # the shape's own check, as estimate's
    assert rules.PRECISIONS == ("fp32", "bf16", "fp16", "fp8") and rules.RECOMPUTE == ("none", "selective", "full")


@pytest.mark.parametrize("kwargs, message", [
    (dict(model="tiny,vocab_size=255", tp=2), "vocab_size = 255 is not divisible by tp=2"),
    (dict(model="tiny", tp=2, sp=True, seq_len=31), "--sp needs the sequence length divisible by tp"),
    (dict(model="tiny", precision="fp4"), "unknown --precision 'fp4'"),
    (dict(model="tiny", precision="fp8", tp=2), "--precision fp8 with --tp 2"),
    (dict(model="tiny", precision="fp16", reduce_dtype="fp64"), "unknown --reduce-dtype 'fp64'"),
    (dict(model="tiny", recompute="attention"), "unknown --recompute 'attention'"),
    (dict(model="tiny", pp=2, zero=2, schedule="zb-h1", grad_accum=2), "--zero 2 cannot run the zb-h1 schedule"),
])
def test_estimate_and_train_refuse_alike(kwargs: dict, message: str) -> None:
    kwargs = dict(kwargs)
    model = kwargs.pop("model")
    with pytest.raises(PlaitError, match=message.replace("+", r"\+")):
        estimate_layout(get_preset(model), **{"seq_len": 32, **kwargs})
    world = kwargs.get("tp", 1) * kwargs.get("pp", 1)
    with pytest.raises(PlaitError, match=message.replace("+", r"\+")):
        train_checks(replace(TrainConfig(), model=model, dp=1, nproc=world, **{"seq_len": 32, **kwargs}))


def _flags(*argv: str) -> TrainConfig:
    from plait.cli import train_parser
    from plait.train.config.settings import build_config

    given = {k: v for k, v in vars(train_parser().parse_args(list(argv))).items() if k not in ("config", "debug")}
    return build_config({}, given)


def test_zero3_gather_flags_reach_the_layout() -> None:
    layout = _flags("--nproc", "2", "--zero", "3", "--prefetch", "2", "--reshard-after-forward", "false").layout
    assert (layout.prefetch, layout.reshard_after_forward) == (2, False)
    assert layout.describe() == "dp=2 tp=1 pp=1 zero=3 prefetch=2 no-reshard-after-forward"
    assert _flags("--nproc", "2", "--zero", "3", "--reshard-after-forward").layout.reshard_after_forward is True


@pytest.mark.parametrize("argv, message", [
    (["--zero", "2", "--prefetch", "2"], "--prefetch tune ZeRO-3's weight gathers, and --zero is 2"),
    (["--reshard-after-forward", "false"], "--reshard-after-forward false tune ZeRO-3's weight gathers, and --zero is 0"),
    (["--zero", "3", "--prefetch", "-1"], "--prefetch must be at least 0, got -1"),
    (["--zero", "3", "--reshard-after-forward", "maybe"], "--reshard-after-forward 'maybe' is not true or false"),
    (["--zero", "3", "--pp", "2", "--grad-accum", "2", "--reshard-after-forward", "false"],
     "--reshard-after-forward false is for pp = 1"),
])
def test_zero3_gather_flags_refused_with_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(PlaitError, match=re.escape(message)):
        _flags("--nproc", "2", *argv)
