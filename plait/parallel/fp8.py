"""FP8 training: the blocks' linear layers multiply in float8, through torchao.

`--precision fp8` is bf16 training (bf16 weights, activations and gradients, fp32 masters and
Adam state: plait.parallel.precision) whose block linears run their three products (output,
input gradient, weight gradient) in float8: e4m3 for the input and weight, e5m2 for the
output gradient, each cast with a scale from its own largest value, per tensor
("tensorwise", the faster cuBLAS kernel) or per row ("rowwise", more accurate);
"tensorwise-fast" also accumulates the two backward products the fast way (Hopper's float8
units add partial sums in lower precision; torchao's recipe does so for the forward's product
alone), about 4% off a forward and backward of the 1 B model on an H200. This is
torchao's float8 training (`Float8Linear`); plait swaps the modules and leaves the rest as
bf16 training has it:

* only linears inside the adapter's blocks are converted: the embedding, the head and the
  loss stay bf16 (the logits' precision is the loss's), as torchtitan leaves its output
  layer;
* a linear whose two dimensions are not multiples of 16 stays bf16 (the float8 kernels'
  tile), and so does a subclass with its own forward;
* the weight stays the same `nn.Parameter` (bf16), so ZeRO flattens, shards and gathers it,
  the pipeline cuts it and checkpoints write it exactly as in bf16: a checkpoint moves
  between fp8 and bf16 runs freely;
* no loss scale: each cast scales by its tensor's amax.

Data parallelism, ZeRO, the pipeline and expert parallelism give each rank whole weights and
whole rows of a micro-batch, so each cast sees what one process's would, and fp8 trains the
same model at any of those layouts. Tensor parallelism would scale a shard by its own amax:
refused (plait.rules.check_fp8).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

import torch
from torch import nn

from plait.errors import PlaitError
from plait.rules import FLOAT8_TILE, check_fp8_device
from plait.runtime.env import have_torchao, torch_release

log = logging.getLogger(__name__)


def check_device(device: torch.device, scaling: str) -> None:
    """The rank's own check (the launcher's guessed the device): torchao, float8 units, and a
    CPU product that takes `scaling`'s scales."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    check_fp8_device(device.type, capability, have_torchao(), scaling, torch_release())


def converts(module: nn.Module) -> bool:
    """A plain nn.Linear whose weight fits the float8 kernels' tiles."""
    return (type(module) is nn.Linear and module.in_features % FLOAT8_TILE == 0
            and module.out_features % FLOAT8_TILE == 0)


def apply_fp8(blocks: Iterable[nn.Module], scaling: str, device: torch.device) -> int:
    """Swap each convertible linear inside `blocks` for torchao's Float8Linear, in place, the
    weight and bias kept as they are; returns how many were swapped (logged)."""
    check_device(device, scaling)
    config, convert, float8_linear = _torchao(scaling)
    swapped = kept = 0
    for block in blocks:
        kept += sum(1 for m in block.modules() if isinstance(m, nn.Linear) and not converts(m))
        convert(block, module_filter_fn=lambda module, _: converts(module), config=config)
        swapped += sum(1 for m in block.modules() if isinstance(m, float8_linear))
    if not swapped:
        raise PlaitError("--precision fp8 found no linear layer to convert in the model's blocks",
                         hint=f"fp8 converts nn.Linear layers whose dimensions are multiples of {FLOAT8_TILE}; "
                              "use --precision bf16")
    log.info("fp8 (%s scaling): %d linear layers of the blocks multiply in float8; %d stay bf16",
             scaling, swapped, kept)
    return swapped


def _torchao(scaling: str) -> tuple:
    """(torchao's recipe for `scaling`, its converter, its Float8Linear). Importing torchao
    logs warnings about kernels built for other torch builds and a deprecation inside it,
    which say nothing about float8 training (torch's own scaled products): silenced."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    if scaling != "tensorwise-fast":
        return Float8LinearConfig.from_recipe_name(scaling), convert_to_float8_training, Float8Linear
    from torchao.float8.config import Float8GemmConfig

    fast = Float8GemmConfig(use_fast_accum=True)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), gemm_config_output=fast,
                                 gemm_config_grad_input=fast, gemm_config_grad_weight=fast)
    return config, convert_to_float8_training, Float8Linear
