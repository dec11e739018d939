"""--precision fp8: which devices and layouts take it, which layers it converts, what it costs.

The parity of fp8 training across layouts is in test_precision_worlds.py (one 2-rank world).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from plait.errors import PlaitError
from plait.estimate.hardware import PRESETS
from plait.estimate.layout import Workload
from plait.layout import Layout
from plait.rules import check_fp8, check_fp8_device

pytest.importorskip("torchao", reason="fp8 needs the optional torchao")


def test_devices_without_float8_units_or_torchao_are_refused_in_one_line():
    check_fp8_device("cuda", (9, 0), True)  # Hopper
    check_fp8_device("cuda", (8, 9), True)  # Ada
    check_fp8_device("cpu", None, True)  # torch's own scaled products: exact, slow (the tests run them)
    with pytest.raises(PlaitError, match=r"compute capability 8\.0\) has no float8 matrix units") as err:
        check_fp8_device("cuda", (8, 0), True)
    assert "\n" not in str(err.value) and "--precision bf16" in err.value.hint
    with pytest.raises(PlaitError, match="needs torchao, which is not installed") as err:
        check_fp8_device("cpu", None, False)
    assert "plait[fp8]" in err.value.hint
    check_fp8_device("cpu", None, True, "rowwise", (2, 13))
    check_fp8_device("cuda", (9, 0), True, "rowwise", (2, 11))  # the GPU's product takes row scales
    with pytest.raises(PlaitError, match="rowwise on the CPU needs torch 2.13 or later: torch 2.11 multiplies") as err:
        check_fp8_device("cpu", None, True, "rowwise", (2, 11))
    assert "--fp8-scaling tensorwise" in err.value.hint


def test_tensor_parallelism_and_unknown_scalings_are_refused():
    check_fp8(Layout(dp=2, pp=2, zero=1), "rowwise")
    with pytest.raises(PlaitError, match="--tp 2: each tp rank would scale its shard"):
        check_fp8(Layout(tp=2), "tensorwise")
    with pytest.raises(PlaitError, match="unknown --fp8-scaling 'delayed'"):
        check_fp8(Layout(), "delayed")


def test_the_blocks_linears_convert_and_the_head_and_odd_shapes_stay_bf16():
    from torchao.float8.float8_linear import Float8Linear

    from plait.models.gpt.model import GPT
    from plait.models.gpt.config import GPTConfig
    from plait.parallel.fp8 import apply_fp8
    from plait.parallel.seam import adapter_of

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=2, max_seq_len=16, ffn_hidden=64))
    weights = {name: p for name, p in model.named_parameters()}
    blocks = adapter_of(model).blocks(model)
    odd = nn.Linear(32, 24)  # 24 is no multiple of 16: stays bf16
    blocks[0].add_module("odd", odd)
    swapped = apply_fp8(blocks, "tensorwise", torch.device("cpu"))
    converted = [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert swapped == len(converted) == 2 * sum(1 for m in GPT(model.config).blocks[0].modules()
                                                if type(m) is nn.Linear)
    assert all(name.startswith("blocks.") for name in converted)
    assert type(model.lm_head) is nn.Linear and type(blocks[0].odd) is nn.Linear
    # the same Parameter objects: ZeRO, the pipeline and checkpoints see the bf16 weights as before
    assert all(p is weights[name] for name, p in model.named_parameters() if name in weights)
    ids = torch.randint(0, 64, (2, 16))
    loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for name, p in model.named_parameters() if ".odd." not in name)


def test_the_estimate_runs_the_block_products_at_the_float8_peak_and_reports_mfu_against_bf16():
    """Compiled, fp8's faster products outweigh its casts (the H200 measured 1.16x on this
    shape, and the estimate says 1.29x); eager, its casts move 33 bytes an element and outweigh
    them (estimate.ops.FP8_CASTS); without float8 units only the casts are left."""
    from plait.estimate.time import estimate_time
    from plait.models.gpt.config import GPTConfig

    config = GPTConfig(vocab_size=32000, d_model=2048, n_heads=32, n_kv_heads=8, n_layers=16, ffn_hidden=8192,
                       max_seq_len=2048)
    times = {}
    for hardware in ("h100-sxm", "a100-80gb"):
        for precision in ("bf16", "fp8"):
            for compiled in (False, True):
                work = Workload.of(Layout(zero=1), precision=precision, micro_batch=8, seq_len=2048,
                                   compiled=compiled)
                times[hardware, precision, compiled] = estimate_time(config, work, PRESETS[hardware], 8)
    h100 = times["h100-sxm", "bf16", True].step_s / times["h100-sxm", "fp8", True].step_s
    assert 1.2 < h100 < 2.0  # the block GEMMs at twice the rate, less the fused casts
    assert times["h100-sxm", "fp8", True].mfu > times["h100-sxm", "bf16", True].mfu  # both of the bf16 peak
    assert times["h100-sxm", "fp8", False].step_s > times["h100-sxm", "bf16", False].step_s  # eager casts
    # no float8 units: the products run at the 16-bit rate (the run itself is refused there), the casts remain
    assert times["a100-80gb", "fp8", True].step_s > times["a100-80gb", "bf16", True].step_s


def test_plait_train_refuses_fp8_under_tp_before_spawning():
    proc = subprocess.run([sys.executable, "-m", "plait", "train", "--model", "tiny", "--nproc", "2", "--tp", "2",
                           "--precision", "fp8", "--steps", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("plait: error: --precision fp8 with --tp 2"), proc.stderr
    assert "Traceback" not in proc.stderr and "spawn" not in proc.stdout.lower()


def test_tensorwise_fast_accumulates_fast_in_all_three_products():
    """torchao's tensorwise recipe accumulates fast in the forward's product only; tensorwise-fast
    in the input gradient's and the weight gradient's too, with the same scales."""
    pytest.importorskip("torchao")
    from plait.parallel.fp8 import _torchao

    def fast(scaling: str) -> tuple[bool, ...]:
        config = _torchao(scaling)[0]
        return tuple(getattr(config, f"gemm_config_{name}").use_fast_accum
                     for name in ("output", "grad_input", "grad_weight"))

    assert fast("tensorwise") == (True, False, False)
    assert fast("tensorwise-fast") == (True, True, True)
    assert _torchao("tensorwise-fast")[0].cast_config_input == _torchao("tensorwise")[0].cast_config_input
