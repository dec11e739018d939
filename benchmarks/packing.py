"""What packing documents costs: best-fit's fill against concat's cuts, and a masked step's time.

    python benchmarks/packing.py              # 100,000 documents; the small GPT at 512 tokens
    python benchmarks/packing.py --documents 20000 --steps 3 --no-write

1. **Packing.** Document lengths drawn from a log-normal (median 400 tokens, a long tail past
   the sequence of 2,048), as web text's are. `--packing concat` fills every slot but its
   windows cut documents; `--packing best-fit` (plait/train/data/packing.py) cuts only those
   longer than a sequence and pads the rest. Measured: the share of slots holding tokens, the
   share of documents cut, and best-fit's time per million documents.
2. **The masked step.** plait's GPT `small` (fp32, one process, 2 threads), micro-batch 4 × 512
   tokens, forward and backward: the same ids as plain causal attention (SDPA's is_causal) and
   as packed documents with `--doc-mask` (SDPA with a boolean block mask, built each step), in
   one run, alternating. The native equivalent is the unmasked step; the goal is within 1.2×.
"""

from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import machine, new_parser, publish  # noqa: E402

from plait.models.gpt.config import get_preset  # noqa: E402
from plait.models.gpt.model import build_gpt  # noqa: E402
from plait.parallel.packed import Packed, run_model  # noqa: E402
from plait.train.data.packing import best_fit, pieces_of  # noqa: E402

SEQ = 2048


def lengths(count: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.maximum(1, rng.lognormal(mean=np.log(400), sigma=1.0, size=count).astype(np.int64))


def packing(count: int) -> dict[str, float]:
    sizes = lengths(count)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    begin = time.perf_counter()
    _, piece_lengths = pieces_of(starts, sizes, SEQ)
    bins = best_fit(piece_lengths, SEQ)
    seconds = time.perf_counter() - begin
    total = int(sizes.sum())
    ends = np.cumsum(sizes)
    cut = np.arange(SEQ, total, SEQ)  # window edges in the stream
    crossed = np.searchsorted(ends, cut, side="right")  # the document each edge falls in
    inside = cut - np.concatenate([[0], ends])[crossed] > 0
    return {"documents": count, "tokens": total, "concat_fill": 1.0,
            "concat_cut": len(np.unique(crossed[inside])) / count,
            "best_fit_fill": total / (len(bins) * SEQ), "best_fit_cut": float((sizes > SEQ).mean()),
            "seconds_per_million": seconds * 1e6 / count}


def step_times(steps: int) -> dict[str, float]:
    torch.set_num_threads(2)
    model = build_gpt(get_preset("small"), 0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (4, 512), generator=gen)
    sizes = [int(n) for n in np.minimum(512, lengths(64))]
    rows = []
    for _ in range(4):
        row, left = [], 512
        for n in sizes:
            take = min(n, left)
            row.append(torch.arange(take))
            left -= take
            if not left:
                break
        rows.append(torch.cat(row))
        sizes = sizes[len(row):] + sizes[:len(row)]
    packed = Packed.of(ids, torch.stack(rows))
    timings: dict[str, list[float]] = {"plain": [], "masked": []}
    for k in range(2 * steps + 2):
        name = "plain" if k % 2 == 0 else "masked"
        begin = time.perf_counter()
        logits = run_model(model, ids if name == "plain" else packed)
        logits.float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)
        if k >= 2:  # the first of each is warm-up
            timings[name].append(time.perf_counter() - begin)
    return {name: float(np.median(t)) for name, t in timings.items()}


def table(result: dict, args) -> str:
    pack, step = result["packing"], result["step"]
    return "\n".join([
        "### Packing documents",
        "",
        f"- command: `python benchmarks/packing.py --documents {args.documents} --steps {args.steps}`",
        f"- machine: {machine()}; date: {datetime.date.today().isoformat()}",
        "",
        f"{pack['documents']:,} documents (log-normal lengths, median 400 tokens), {pack['tokens']:,} tokens, "
        f"sequences of {SEQ}:",
        "",
        "| packing | slots holding tokens | documents cut |",
        "|---|---|---|",
        f"| concat | {pack['concat_fill']:.2%} | {pack['concat_cut']:.1%} |",
        f"| best-fit | {pack['best_fit_fill']:.2%} | {pack['best_fit_cut']:.1%} (only those longer than a sequence) |",
        "",
        f"Best-fit decreasing takes {pack['seconds_per_million']:.1f} s per million documents (once, at load).",
        "",
        "The small GPT, micro-batch 4 × 512, forward + backward, median of "
        f"{args.steps} steps each, alternating:",
        "",
        "| attention | step (s) | ratio |",
        "|---|---|---|",
        f"| causal (SDPA is_causal) | {step['plain']:.3f} | 1.00 |",
        f"| packed documents, block mask (--doc-mask) | {step['masked']:.3f} | {step['masked'] / step['plain']:.2f} |",
    ])


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--documents", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    result = {"packing": packing(args.documents), "step": step_times(args.steps)}
    publish("packing", table(result, args), args)


if __name__ == "__main__":
    main()
