"""A model no rank should hold whole: a 254 M-parameter Llama from sharded safetensors on 8 ranks.

    python benchmarks/large_model.py                       # this checkout
    python benchmarks/large_model.py --code ../old --label before --no-write

Writes (once, under --cache) a Llama of hidden 1024, 16 layers and a 32,000-token vocabulary
(970 MiB in fp32) as three safetensors shards with model.safetensors.index.json, and a 4 M
one of the same family for the empty process. Then, for each layout, it runs `plait train
--model hf:DIR --nproc 8 --steps 1` as a user types it, with the checkout given by --code
(default: this one), and reads each rank's process peak (ru_maxrss at exit, from a small
sitecustomize on PYTHONPATH, so any checkout reports it alike), the same for the 4 M model
(the empty process: torch, transformers and plait loaded), and `plait estimate`'s model
states per rank from the run's summary (each rank's pipeline stage). The goal: each rank's
peak minus its empty peak at most 1.15 x its predicted states + 100 MiB, through loading,
training and writing the outputs. Also `plait ckpt export --hf` of the run: its peak minus
the empty export's, against the largest tensor. The wall time of each command is setup plus
one step plus the outputs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, new_parser, publish  # noqa: E402

LAYOUTS = {
    "tp 2 × pp 2 × dp 2": ["--tp", "2", "--pp", "2"],
    "ZeRO-3 over dp 8": ["--zero", "3"],
    "ZeRO-3 with --dp-shard 4": ["--zero", "3", "--dp-shard", "4"],
}
BIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
           num_key_value_heads=16, max_position_embeddings=256, tie_word_embeddings=False)
EMPTY = {**BIG, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4, "vocab_size": 32000 // 16}
SITE = '''import atexit, os, resource
def _peak():
    where = os.environ.get("PLAIT_BENCH_PEAKS")
    if where and os.environ.get("RANK") is not None:
        with open(os.path.join(where, "rank" + os.environ["RANK"]), "w") as f:
            f.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
    elif where and os.environ.get("PLAIT_BENCH_EXPORT"):
        with open(os.path.join(where, "export"), "w") as f:
            f.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
atexit.register(_peak)
'''
MiB = 2**20


def make_models(cache: Path) -> dict[str, Path]:
    """The two model directories (written once), and a corpus."""
    import torch
    import transformers

    out = {"big": cache / "llama-254m", "empty": cache / "llama-4m", "corpus": cache / "corpus.txt"}
    for key, shape, shard in (("big", BIG, "400MB"), ("empty", EMPTY, "50GB")):
        if not (out[key] / "config.json").is_file():
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
            model.save_pretrained(out[key], max_shard_size=shard)
            del model
    if not out["corpus"].is_file():
        out["corpus"].write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(3000)))
    return out


def run(code: Path, argv: list[str], peaks: Path, extra_env: dict[str, str] | None = None) -> tuple[int, float]:
    """One plait command with `code` first on the path; (exit code, seconds)."""
    site = peaks / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITE)
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{code}", "PLAIT_BENCH_PEAKS": str(peaks),
           "PLAIT_REPORT": "off", **(extra_env or {})}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "plait", *argv], cwd=code, env=env, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stdout[-2000:], proc.stderr[-3000:], file=sys.stderr)
    return proc.returncode, time.perf_counter() - start


def train(code: Path, model: Path, corpus: Path, layout: list[str], work: Path) -> dict:
    peaks, out = work / "peaks", work / "out"
    shutil.rmtree(work, ignore_errors=True)
    peaks.mkdir(parents=True)
    code_rc, seconds = run(code, ["train", "--model", f"hf:{model}", "--data", str(corpus), "--nproc", "8", *layout,
                                  "--steps", "1", "--micro-batch", "1", "--seq-len", "64", "--eval-every", "0",
                                  "--eval-samples", "1", "--sample-tokens", "0", "--no-report", "--out", str(out)],
                           peaks)
    by_rank = {int(p.name[4:]): int(p.read_text()) for p in peaks.glob("rank*")}
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    return {"rc": code_rc, "seconds": seconds, "peaks": [by_rank.get(r, 0) for r in range(8)],
            "predicted": _predicted_by_rank(summary, layout), "out": str(out)}


def _predicted_by_rank(summary: dict, layout: list[str]) -> list[float]:
    """Each rank's predicted model states (params + grads + optimizer), from its pipeline stage's row."""
    predicted = summary.get("predicted") or {}
    states = ("params", "grads", "optim")
    stages = predicted.get("stages") or []
    whole = sum(predicted.get("memory", {}).get(k, 0) for k in states)
    if not stages:
        return [whole] * 8
    pp = int(layout[layout.index("--pp") + 1]) if "--pp" in layout else 1
    per_stage = [sum(row["memory"][k] for k in states) for row in stages]
    return [per_stage[rank // (8 // pp)] for rank in range(8)]


def export(code: Path, run_out: str, work: Path) -> dict:
    peaks = work / "export-peaks"
    shutil.rmtree(peaks, ignore_errors=True)
    peaks.mkdir(parents=True)
    target = work / "exported"
    shutil.rmtree(target, ignore_errors=True)
    rc, seconds = run(code, ["ckpt", "export", run_out, "--hf", str(target)], peaks, {"PLAIT_BENCH_EXPORT": "1"})
    peak = int((peaks / "export").read_text()) if (peaks / "export").is_file() else 0
    return {"rc": rc, "seconds": seconds, "peak": peak, "dir": str(target)}


def drive(args: argparse.Namespace) -> dict:
    cache, code = Path(args.cache), Path(args.code).resolve()
    models = make_models(cache)
    work = Path(tempfile.mkdtemp(prefix="plait-large-"))
    results: dict = {"layouts": {}}
    try:
        for name, layout in LAYOUTS.items():
            if args.only and not any(word in name for word in args.only):
                continue
            empty = train(code, models["empty"], models["corpus"], layout, work / "empty")
            big = train(code, models["big"], models["corpus"], layout, work / "big")
            row = {"empty": empty, "big": big}
            if name == next(iter(LAYOUTS)) and big["rc"] == 0:
                row["export"] = export(code, big["out"], work / "big")
                row["export_empty"] = export(code, empty["out"], work / "empty")
                row["export_equal"] = _export_equal(Path(row["export"]["dir"]), Path(big["out"]))
            results["layouts"][name] = row
            print(name, json.dumps({k: v for k, v in big.items() if k != "out"}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def _export_equal(exported: Path, run: Path) -> bool:
    """from_pretrained of the export holds the run's weights, byte for byte."""
    import torch
    import transformers
    from safetensors import safe_open

    if not (exported / "config.json").is_file():
        return False
    model = transformers.AutoModelForCausalLM.from_pretrained(str(exported)).state_dict()
    files = sorted(run.glob("model*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if not torch.equal(model[name], handle.get_tensor(name)):
                    return False
    return bool(files)


def table(results: dict, args: argparse.Namespace) -> str:
    largest = 32000 * 1024 * 4 / MiB
    lines = [
        f"### {args.label}: a 254 M-parameter Llama from three safetensors shards, 8 ranks",
        "",
        f"- command: `python benchmarks/large_model.py{' --code ' + args.code if args.code != '.' else ''}`",
        f"- machine: {machine()}, Gloo, 8 processes; date: {datetime.date.today().isoformat()}",
        "- each rank: process peak (ru_maxrss at exit: loading, one step, writing the outputs) minus the same "
        "rank's peak with a 4 M model of the same family (the empty process), against `plait estimate`'s model "
        "states for that rank; goal: at most 1.15 × predicted + 100 MiB",
        "",
        "| layout | empty (MiB, max) | peak − empty, each rank (MiB) | predicted states (MiB, max) | "
        "worst (peak − empty) ÷ (1.15 × predicted + 100) | command s (empty → 254 M) |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in results["layouts"].items():
        big, empty = row["big"], row["empty"]
        if big["rc"] or empty["rc"]:
            lines.append(f"| {name} | — | failed (exit {big['rc'] or empty['rc']}) | — | — | — |")
            continue
        over = [(b - e) / MiB for b, e in zip(big["peaks"], empty["peaks"])]
        bars = [1.15 * p / MiB + 100 for p in big["predicted"]]
        worst = max(o / bar for o, bar in zip(over, bars))
        lines.append(f"| {name} | {max(empty['peaks']) / MiB:,.0f} | {', '.join(f'{o:,.0f}' for o in over)} | "
                     f"{max(big['predicted']) / MiB:,.0f} | {worst:.2f} | {empty['seconds']:.0f} → "
                     f"{big['seconds']:.0f} |")
    first = results["layouts"].get(next(iter(LAYOUTS)), {})
    if first.get("export"):
        ex, base = first["export"], first["export_empty"]
        lines += ["", f"`plait ckpt export --hf` of the tp 2 × pp 2 × dp 2 run: peak − empty export "
                  f"{(ex['peak'] - base['peak']) / MiB:,.0f} MiB against the largest tensor's {largest:,.0f} MiB "
                  f"(goal: at most twice), {ex['seconds']:.0f} s; from_pretrained of it holds the run's weights "
                  f"byte for byte: {first.get('export_equal')}."]
    return "\n".join(lines)


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--code", default=".", help="the plait checkout to run (default: this one)")
    parser.add_argument("--label", default="after", help="the table's name (before / after)")
    parser.add_argument("--only", action="append", help="run only the layouts whose name holds this (repeatable)")
    parser.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "plait-bench-models"))
    args = parser.parse_args()
    publish(f"large_model_{args.label}", table(drive(args), args), args)


if __name__ == "__main__":
    main()
