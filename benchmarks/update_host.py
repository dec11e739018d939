"""The host's share of plait's compiled update: `optimizer.step()` under ZeRO-1 with the
compiled pass replaced by a no-op, so what is timed is the Python and the small ops the host
does around it (finding the runs, the step counts, the hyperparameters).

    python benchmarks/update_host.py                   # the 1.04 B GPT's 146 pieces (16 layers)
    python benchmarks/update_host.py --layers 32

On a GPU that work follows the clip's device sync, so the device waits for all of it (the
trained step's profile, RESULTS.md, GPU section, 2026-12-04, fourth). The model's widths do
not matter here, only its count of pieces: a tiny GPT with the 1 B model's 16 layers has the
same 146. Prints the median milliseconds and how often the runs were cut.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from plait.api import parallelize  # noqa: E402
from plait.models.gpt.config import get_preset  # noqa: E402
from plait.models.gpt.model import build_gpt  # noqa: E402
from plait.parallel.compose import ParallelConfig, build_optimizer  # noqa: E402
from plait.runtime.env import ProcessEnv  # noqa: E402
from plait.runtime.mesh import init_mesh  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    mesh = init_mesh(zero=1, env=ProcessEnv("single", 0, 1, 0, "127.0.0.1", 29513))
    config = get_preset("tiny", n_layers=args.layers)
    model = parallelize(build_gpt(config, 0).to(torch.bfloat16), mesh, ParallelConfig())
    optimizer = build_optimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.1, fused=True, compiled_update=True)
    optimizer.compiled.compiled = lambda *_args: None  # the pass itself is the device's share
    tokens = torch.randint(0, config.vocab_size, (2, 9))
    model(tokens[:, :-1]).float().square().mean().backward()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    pieces = sum(len(part.pieces) for part in optimizer.slices)
    cuts = getattr(optimizer.compiled, "plans_made", None)
    print(f"pieces {pieces}, runs {optimizer.compiled.tensors}, runs cut {'at every step' if cuts is None else f'{cuts}x'};"
          f" host ms a step, median after 20: {1e3 * statistics.median(times[20:]):.3f}")


if __name__ == "__main__":
    main()
