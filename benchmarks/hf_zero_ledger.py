"""Every transformers family of the sweep under `plait train` with ZeRO: the ledger against the estimate.

    python benchmarks/hf_zero_ledger.py                                   # ZeRO-3 on 2 ranks, every family
    python benchmarks/hf_zero_ledger.py --flags "--zero 3 --tp 2 --nproc 4" --families llama dbrx --no-write

The transformers sweep (tests/test_hf_sweep.py) holds each family's tp, tp + SP, pp and ep
traffic to the estimate in its own training loop. This runs the families through `plait train`
itself, under the flags given (ZeRO-3 on 2 ranks by default), each a tiny model of the sweep's
configs (tests/worlds/hf_sweep_world.py: family_config, a 256-token vocabulary for the byte
data), 2 steps, and compares what the run measured with what it predicted: every collective on
every axis, byte for byte, and the parameters at the peak, gradients and optimizer state each
rank holds. The experts' all-to-all is left out (the estimate takes the routing uniform; the
run's own formula on its routing is reported beside it). The activations' prediction is given
beside its measurement for each family, outside the verdict (their bar is the matrix's:
tests/matrix.py). A family is "exact", "differs" (what
differs, measured against predicted), or "refused" (plait's one-line error). About 12 s a
family on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine, new_parser, publish  # noqa: E402

HELD = ("params", "grads", "optim")  # the memory the ledger measures exactly


def differences(summary: dict) -> dict[str, tuple[float, float]]:
    """{what: (measured, predicted)} for every collective and held memory that differ, the ep
    all-to-all aside."""
    measured, predicted = summary["comm_per_step"], summary["predicted"]["comm"]
    out = {}
    for axis in sorted({*measured, *predicted} - {"ep"}):
        for op in sorted({*measured.get(axis, {}), *predicted.get(axis, {})}):
            got, want = measured.get(axis, {}).get(op, 0), predicted.get(axis, {}).get(op, 0)
            if got != want:
                out[f"{axis} {op}"] = (got, want)
    for kind in HELD:
        got, want = summary["mem"][kind], summary["predicted"]["memory"][kind]
        if got != want:
            out[kind] = (got, want)
    return out


def run_family(family: str, flags: list[str], where: Path) -> dict:
    """One family's run under `flags`: its verdict and what differs."""
    from tests.worlds.hf_sweep_world import family_config

    config = family_config(family)
    config.vocab_size = 256  # the byte data's ids
    for table in ("unpadded_vocab_size", "vocab_size_per_layer_input"):  # Inkling's, Gemma 3n's and 4's
        if hasattr(config, table):
            setattr(config, table, 256)
    config.save_pretrained(where / "model")
    proc = subprocess.run([sys.executable, "-m", "plait", "train", "--model", f"hf:{where / 'model'}", *flags,
                           "--steps", "2", "--seq-len", "16", "--micro-batch", "2", "--sample-tokens", "0",
                           "--eval-every", "0", "--no-report", "--out", str(where / "run")],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode:
        lines = [line for line in proc.stderr.splitlines() if line.startswith("plait: error:")]
        ranks = [line for line in proc.stderr.splitlines() if re.match(r"plait: rank \d+: ", line)]
        return {"family": family, "verdict": "refused" if lines else "crash",
                "why": (lines or ranks[:1] or proc.stderr.strip().splitlines()[-1:] or ["?"])[0]}
    summary = json.loads((where / "run" / "summary.json").read_text())
    found = differences(summary)
    activations = [summary["mem"]["activations_peak"], summary["predicted"]["memory"]["activations"]]
    return {"family": family, "verdict": "differs" if found else "exact", "differs": found,
            "activations": activations}


def activations_lines(rows: list[dict]) -> list[str]:
    """The activations' prediction against the meter's, the busiest rank's: how many families
    within 2% and 10%, the median, and each family outside 10%."""
    ratios = {row["family"]: row["activations"][1] / row["activations"][0]
              for row in rows if row.get("activations") and row["activations"][0] and row["activations"][1] is not None}
    if not ratios:
        return []
    unpredicted = sorted(row["family"] for row in rows  # a shape known by its parameters alone (RWKV's)
                         if row.get("activations") and row["activations"][1] is None)
    ordered = sorted(ratios.values())
    within = {bar: sum(abs(r - 1) <= bar for r in ordered) for bar in (0.02, 0.10)}
    lines = [f"Activations, predicted / measured (the busiest rank's): median {ordered[len(ordered) // 2]:.3f}, "
             f"{within[0.02]} of {len(ordered)} within 2%, {within[0.10]} within 10%."]
    outside = sorted((r, family) for family, r in ratios.items() if abs(r - 1) > 0.10)
    if outside:
        lines[-1] += " Outside 10%: " + ", ".join(f"{family} {r:.2f}" for r, family in outside) + "."
    if unpredicted:
        lines[-1] += " Not predicted (known by their parameters alone): " + ", ".join(unpredicted) + "."
    return lines + [""]


def drive(args: argparse.Namespace) -> list[dict]:
    from tests.worlds.hf_sweep_world import FAMILIES

    families = args.families or list(FAMILIES)
    flags = shlex.split(args.flags)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for family in families:
            row = run_family(family, flags, Path(scratch) / family)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def table(rows: list[dict], args: argparse.Namespace) -> str:
    counts = {verdict: sum(row["verdict"] == verdict for row in rows) for verdict in ("exact", "differs", "refused",
                                                                                      "crash")}
    lines = [f"## transformers families under `plait train {args.flags}`: the ledger against the estimate",
             "",
             f"- command: `python benchmarks/hf_zero_ledger.py --flags \"{args.flags}\"`",
             f"- machine: {machine()}; date: {datetime.date.today().isoformat()}",
             "- each family of the transformers sweep, tiny, 2 steps of 2 x 16 tokens: every collective on every axis "
             "but the experts' all-to-all, and each rank's parameters at the peak, gradients and optimizer state",
             "",
             f"**{counts['exact']} of {len(rows)} exact**, {counts['differs']} differ, {counts['refused']} refused, "
             f"{counts['crash']} crashed.",
             "",
             *activations_lines(rows)]
    odd = [row for row in rows if row["verdict"] != "exact"]
    if odd:
        lines += ["| family | verdict | what |", "|---|---|---|"]
        for row in odd:
            what = row.get("why") or "; ".join(f"{key} measured {got:,.0f}, predicted {want:,.0f}"
                                               for key, (got, want) in row["differs"].items())
            lines.append(f"| {row['family']} | {row['verdict']} | {what} |")
    return "\n".join(lines)


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--flags", default="--zero 3 --nproc 2", help="plait train's layout flags")
    parser.add_argument("--families", nargs="*", help="families of the sweep (default: all)")
    args = parser.parse_args()
    name = "hf-zero-ledger-" + "-".join(flag.lstrip("-") for flag in shlex.split(args.flags))
    publish(name, table(drive(args), args), args)


if __name__ == "__main__":
    main()
