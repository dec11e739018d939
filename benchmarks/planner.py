"""How long `plait plan` takes to answer for published-size models on 512 to 16,384 GPUs.

Each row plans one model on one GPU count (H100 SXM, 8 per node) and times the ranking (the
top 10) and, after it, `--explain` (the best layout without each of its choices). Models:
Llama 2 70B (the `llama-70b` preset), Llama 3.1 405B (126 layers, hidden 16384, 128 heads, 8 KV
heads, MLP 53248, vocabulary 128256) and Nemotron-4 340B (96 layers, hidden 18432, 96 heads,
8 KV heads, relu² MLP 73728, vocabulary 256000), at their published sequences and batches.
Pure arithmetic, one process. `--previous REF` also times the planner of git commit REF on
each row (that commit's plait/, extracted to /tmp), in a process of its own, for at most
`--limit` seconds.

    python benchmarks/planner.py                          # writes its section of RESULTS.md
    python benchmarks/planner.py --previous 3b54779 --no-write
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import new_parser, write_section  # noqa: E402
from plait.estimate.layout import stages  # noqa: E402
from plait.estimate.ops import _block_gemm_s  # noqa: E402
from plait.estimate.planner import alike_stages, explain, plan_layouts, plan_request, search_for  # noqa: E402
from plait.estimate.report import layout_text  # noqa: E402
from plait.families import shape_of  # noqa: E402

# name -> (--model, sequence, global batch)
MODELS = {
    "Llama 2 70B": ("llama-70b", 4096, 1024),
    "Llama 3.1 405B": ("llama-70b,n_layers=126,d_model=16384,n_heads=128,n_kv_heads=8,ffn_hidden=53248,"
                       "vocab_size=128256,max_seq_len=8192", 8192, 2048),
    "Nemotron-4 340B": ("llama-70b,n_layers=96,d_model=18432,n_heads=96,n_kv_heads=8,ffn_hidden=73728,"
                        "mlp_matrices=2,vocab_size=256000,max_seq_len=4096", 4096, 2304),
}
GPUS = (512, 6144, 16384)
PREVIOUS = """
import sys, time
from plait.estimate.planner import plan
from plait.families import shape_of
start = time.perf_counter()
plan(shape_of(sys.argv[1]), gpus=int(sys.argv[2]), global_batch=int(sys.argv[3]), seq_len=int(sys.argv[4]),
     hardware="h100-sxm", top=10)
print(time.perf_counter() - start)
"""


def plan_row(model: str, gpus: int, seq: int, batch: int) -> dict:
    """Time the ranking and the explanation of one request, from cold caches."""
    for cache in (search_for, alike_stages, stages, _block_gemm_s):
        cache.cache_clear()
    request = plan_request(shape_of(model), gpus=gpus, global_batch=batch, seq_len=seq, hardware="h100-sxm")
    start = time.perf_counter()
    rows = plan_layouts(request, 10)
    ranked = time.perf_counter()
    explain(request)
    explained = time.perf_counter()
    return {"plan_s": ranked - start, "explain_s": explained - ranked, "best": rows[0],
            **search_for(request).counts()}


def previous_s(ref: str, model: str, gpus: int, seq: int, batch: int, limit: int) -> str:
    """The planner of commit `ref` on the same request, in its own process over that commit's
    whole tree (its planner reads its own time model): seconds, or '> limit'."""
    tree = Path(f"/tmp/plait-planner-{ref}")
    if not tree.exists():
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", ref, "plait"], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    try:
        proc = subprocess.run([sys.executable, "-c", PREVIOUS, model, str(gpus), str(batch), str(seq)],
                              cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True,
                              timeout=limit)
    except subprocess.TimeoutExpired:
        return f"> {limit}"
    return f"{float(proc.stdout.split()[-1]):.1f}" if proc.returncode == 0 else "failed"


def table(rows: list[dict], previous: str | None) -> str:
    head = ["model", "GPUs", "batch × seq", "shapes", "bounded", "estimated", "plan s", "--explain s"]
    head += [f"{previous}'s plan s"] if previous else []
    head += ["best layout", "step s", "MFU"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["name"], f"{r['gpus']:,}", f"{r['batch']} × {r['seq']}", f"{r['shapes']:,}", f"{r['bounded']:,}",
                 f"{r['estimated']:,}", f"{r['plan_s']:.1f}", f"{r['explain_s']:.1f}"]
        cells += [r["previous"]] if previous else []
        cells += [layout_text(r["best"]), f"{r['best']['step_s']:.2f}", f"{r['best']['mfu']:.1%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--previous", help="also time the planner of this git commit")
    parser.add_argument("--limit", type=int, default=300, help="seconds the previous planner gets per row")
    args = parser.parse_args()
    rows = []
    for name, (model, seq, batch) in MODELS.items():
        for gpus in GPUS:
            row = {"name": name, "gpus": gpus, "seq": seq, "batch": batch, **plan_row(model, gpus, seq, batch)}
            if args.previous:
                row["previous"] = previous_s(args.previous, model, gpus, seq, batch, args.limit)
            print(f"{name} on {gpus}: plan {row['plan_s']:.1f} s, explain {row['explain_s']:.1f} s", file=sys.stderr)
            rows.append(row)
    command = "python benchmarks/planner.py" + (f" --previous {args.previous} --limit {args.limit}"
                                                if args.previous else "")
    text = "\n".join([
        "## Planner: time to answer on 512 to 16,384 GPUs",
        "",
        f"- command: `{command}`",
        f"- machine: {os.cpu_count()}-core CPU ({platform.machine()}), Python {platform.python_version()}; "
        "one process, H100 SXM presets, 8 GPUs a node",
        f"- date: {datetime.date.today().isoformat()}; load average (1 min) at the end: {os.getloadavg()[0]:.1f}",
        "- shapes: layouts but for ZeRO's stage, dp_shard and offload, each costed once; bounded: layouts whose "
        "step was bounded below (rule 3 of plait/estimate/planner.py); estimated: whose memory was estimated",
        "",
        table(rows, args.previous),
    ])
    print(text)
    if not args.no_write:
        write_section("planner", text)


if __name__ == "__main__":
    main()
