"""The 16-bit update alone, on this machine: plait's clip + step against a plain loop's.

    python benchmarks/update.py                         # bf16, ZeRO 0 and 1, one process
    python benchmarks/update.py --model small --steps 20

One process, no backward worth timing: every parameter's gradient is made by a backward of
sum(w · c) (an elementwise pass, through ZeRO's hooks as in training), then the timed part is
what the trainer times as "optimizer": `StepGuard.clip` (finite check, norm, clip factor) and
`optimizer.step()` (fp32 masters, fused AdamW, the round back to bf16). The plain loop is
torch's recipe for the same model in fp32 (`clip_grad_norm_` and fused AdamW), which moves
about as many bytes as plait's 16-bit update must (fp32 gradients and weights, Adam state).
Prints the median milliseconds of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from plait.models.gpt.config import get_preset  # noqa: E402
from plait.models.gpt.model import build_gpt  # noqa: E402
from plait.api import parallelize  # noqa: E402
from plait.parallel.compose import ParallelConfig, build_optimizer  # noqa: E402
from plait.parallel.precision import StepGuard  # noqa: E402
from plait.runtime.env import ProcessEnv  # noqa: E402
from plait.runtime.mesh import init_mesh  # noqa: E402


def fake_backward(model: nn.Module, weights: list[torch.Tensor]) -> None:
    loss = sum((p * c).sum() for p, c in zip(model.parameters(), weights))
    loss.backward()


def median_update_ms(model: nn.Module, optimizer: torch.optim.Optimizer, update: Callable[[int], None],
                     steps: int) -> float:
    """The median of `update(step)`, timed after gradients made by `fake_backward` (2 warm-up steps)."""
    weights = [torch.randn_like(p) for p in model.parameters()]
    times = []
    for step in range(steps):
        optimizer.zero_grad()
        fake_backward(model, weights)
        start = time.perf_counter()
        update(step)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def plait_update(spec: str, zero: int, steps: int) -> float:
    mesh = init_mesh(zero=zero, env=ProcessEnv("single", 0, 1, 0, "127.0.0.1", 29500))
    model = parallelize(build_gpt(get_preset(spec), 0).to(torch.bfloat16), mesh, ParallelConfig())
    optimizer = build_optimizer(model, torch.optim.AdamW, lr=1e-4, weight_decay=0.1, fused=True)
    guard = StepGuard("bf16", mesh.axis("world"), mesh.device)
    ms = median_update_ms(model, optimizer, lambda step: guard.step(step, model, optimizer, 1.0, 1.0), steps)
    mesh.close()
    return ms


def plain_update(spec: str, steps: int) -> float:
    model = build_gpt(get_preset(spec), 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

    def update(_: int) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return median_update_ms(model, optimizer, update, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    torch.manual_seed(0)
    params = sum(p.numel() for p in build_gpt(get_preset(args.model), 0).parameters())
    print(f"{args.model}: {params / 1e6:.2f} M parameters, {torch.get_num_threads()} threads")
    print(f"plain loop fp32 (clip_grad_norm_ + fused AdamW): {plain_update(args.model, args.steps):.2f} ms")
    for zero in (0, 1):
        print(f"plait bf16 --zero {zero} (StepGuard.clip + step): {plait_update(args.model, zero, args.steps):.2f} ms")


if __name__ == "__main__":
    main()
