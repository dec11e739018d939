"""The parity matrix: every `plait train` layout that must train the same model as one process,
declared once, as rows of family × layout × features, with the tier as a column.

One reference runner: `plait train --nproc 1` on the row's family, in the row's precision,
with the same seed and the same global batch (its micro-batches accumulated; a family whose
BatchNorm sees each micro-batch on its own takes the global batch as one micro-batch).
Features that change no number (recomputation, offload, compilation up to its fusion) share
their layout's reference.

One comparison (`compare`): the loss of every step, the gradient norm of every step before
the clip, the held-out losses, and every final weight elementwise. The bar is the row's
axes' loosest in one table (`TOLERANCE`), so adding an axis or a family adds rows and, for a
new source of rounding, one line of that table.

The library-level worlds (tests/test_*_worlds.py) hold each strategy to the same comparison
(tests/parity.py) through the Python API, against torch's native equivalents and the ledger.
Rows here are run through the command a user types, each once per session however many
tests read it (`matrix_runs`), and share the pool of pre-imported processes (tests/zygote.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from pathlib import Path
from typing import Any

import pytest

from tests.parity import assert_grad_norms_close, assert_losses_close, assert_params_close
from tests.worldlib import Runs, run_plait

TEST, ALL = "test", "all"  # the tier: `make test` and `make test-all`, or `make test-all` only

COMMON = ["--steps", "4", "--eval-every", "2", "--eval-samples", "8", "--sample-tokens", "0",
          "--warmup-steps", "1", "--no-report"]


@dataclasses.dataclass(frozen=True)
class Family:
    """A model and its data, as `plait train` takes them; `{dir}` names the session's folder."""

    flags: str
    micro_batch: int = 2
    batch_norm: bool = False  # statistics per micro-batch: the reference takes the global batch whole

    def argv(self, root: Path) -> list[str]:
        return ["--micro-batch", str(self.micro_batch), *shlex.split(self.flags.format(dir=root))]

    def reference_batch(self, micro_batches: int) -> list[str]:
        if self.batch_norm:
            return ["--micro-batch", str(self.micro_batch * micro_batches)]
        return ["--grad-accum", str(micro_batches)]


FAMILIES = {
    "gpt": Family("--model tiny --seq-len 32"),
    "gpt-4-layers": Family("--model tiny,n_layers=4 --seq-len 32"),  # two chunks per stage at pp 2
    "gpt-6-layers": Family("--model tiny,n_layers=6 --seq-len 32"),  # 4 chunks at pp 2: 1, 2, 2, 1 blocks
    "moe": Family("--model tiny-moe --seq-len 32"),
    "llama": Family("--model hf:{dir}/llama --data {dir}/corpus.txt --seq-len 16"),
    "qwen3": Family("--model hf:{dir}/qwen3 --data {dir}/corpus.txt --seq-len 16"),
    # BatchNorm over 4 images of 1×1 features (resnet18's last stage on 8×8 digits) divides by
    # a variance of four numbers and magnifies last-bit differences to 1e-4 by the second
    # step; 16 images per rank keep it at 1e-7.
    "resnet": Family("--model resnet18,width=4 --data digits --sync-bn", micro_batch=16, batch_norm=True),
}


# Each axis's rounding, against one process in the same precision: (loss rtol, gradient-norm
# rtol, weight rtol, weight atol). A row is held to the loosest of the axes it uses. What the
# rows showed on this machine (2026-11-27) is in brackets; tests/parity.py says why weights
# after AdamW get an atol.
# - dp, zero, ep, cp, pp: the same sums in another order (a ring, a reduce-scatter, a tied
#   embedding's two halves). [losses 5e-8, norms 2e-7, weights 2.3e-6 on the stdlib corpus;
#   5.8e-6 on the shipped one (one element of 16,384, moe/n2-ep2): which components have
#   near-zero gradients, and so how far AdamW carries a last-bit difference, is the data's]
# - tp: matmuls cut along their reduction; AdamW turns last-bit gradient differences of
#   near-zero components into up to a few 1e-5 of weight. [losses 1e-7, norms 1e-7, weights
#   1.9e-5 on the stdlib corpus; 2.4e-5 on the shipped one (one element of 12,288, the
#   tp2-sp rows), on torch 2.13 and 2.11 alike]
# - compile: Inductor fuses and reorders the block's arithmetic.
# - bf16, fp16: 16-bit sums in another order (tests/test_precision_worlds.py's bar). The
#   weights are 16-bit roundings of fp32 masters, and a component whose gradient rounds to
#   the other sign moves by up to lr per AdamW step (lr 2e-3 × 4 steps).
TOLERANCE = {
    "dp": (1e-5, 1e-4, 1e-5, 1e-5),
    "zero": (1e-5, 1e-4, 1e-5, 1e-5),
    "ep": (1e-5, 1e-4, 1e-5, 1e-5),
    "cp": (1e-5, 1e-4, 1e-5, 1e-5),
    "pp": (1e-5, 1e-4, 1e-5, 1e-5),
    "tp": (1e-5, 1e-4, 1e-4, 5e-5),
    "compile": (1e-4, 1e-3, 1e-4, 2e-5),
    "bf16": (2e-3, 1e-2, 2e-2, 1e-2),
    "fp16": (2e-3, 1e-2, 2e-2, 1e-2),
}


@dataclasses.dataclass(frozen=True)
class Row:
    family: str
    layout: str  # the flags that split the model (and its accumulation)
    features: str = ""  # flags that must change nothing: recompute, offload, compile, precision
    micro_batches: int = 1  # micro-batches in the global batch, the reference's accumulation
    tier: str = ALL
    # {what: why}: the quantities of plait estimate's prediction for this layout that do not
    # hold yet ("activations", "tp all_gather", ...), and why; the rest is still held.
    unpriced: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        """family/layout+features, e.g. gpt/n8-dp2-tp2-pp2-zero3-sp-ga2+bf16."""
        features = _words(self.features)
        return f"{self.family}/{_words(self.layout)}" + (f"+{features}" if features else "")

    @property
    def flags(self) -> list[str]:
        return shlex.split(self.layout) + shlex.split(self.features)

    def option(self, flag: str, default: str = "") -> str:
        flags = self.flags
        return flags[flags.index(flag) + 1] if flag in flags else default

    @property
    def precision(self) -> str:
        return self.option("--precision", "fp32")

    @property
    def axes(self) -> list[str]:
        degree = {axis: int(self.option(f"--{axis}", "1")) for axis in ("tp", "pp", "cp", "ep")}
        axes = [axis for axis, n in degree.items() if n > 1]
        if int(self.option("--nproc", "1")) > degree["tp"] * degree["pp"] * degree["cp"]:
            axes.append("dp")
        if self.option("--zero", "0") != "0":
            axes.append("zero")
        if "--compile" in self.flags:
            axes.append("compile")
        if self.precision != "fp32":
            axes.append(self.precision)
        return axes

    @property
    def activations_bar(self) -> float:
        """The relative bar on the activations' prediction: plait's own GPT run eagerly is
        priced to the byte (each op's saved tensors are derived, not measured); a transformers
        model within 2% (its blocks' bytes measured at one sequence, which counts its rotary
        tables once a sequence where a forward makes them once: docs/estimate.md); a compiled
        block keeps what Inductor chooses and a mixture of experts what its routing sent: 10%,
        as for the CNN."""
        if "compile" in self.axes:
            return 0.10
        return {"gpt": 0.0, "llama": 0.02, "qwen3": 0.02}.get(self.family.split("-")[0], 0.10)

    @property
    def tolerance(self) -> tuple[float, float, float, float]:
        return tuple(max(column) for column in zip(*(TOLERANCE[axis] for axis in self.axes)))  # type: ignore


SHORT = {"--nproc": "n{}", "--grad-accum": "ga{}", "--virtual-stages": "v{}", "--schedule": "{}", "--precision": "{}",
         "--stage-layers": "layers{}",
         "--recompute": "recompute-{}", "--reshard-after-forward": "reshard-{}"}


def _words(flags: str) -> str:
    words, argv = [], shlex.split(flags)
    for i, flag in enumerate(argv):
        if not flag.startswith("--"):
            continue
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        words.append(flag[2:] if value is None else SHORT.get(flag, flag[2:] + "{}").format(value))
    return "-".join(words)


def rows(*declared: Row) -> dict[str, Row]:
    table = {row.name: row for row in declared}
    assert len(table) == len(declared), "two rows share a name"
    return table


# What of a row's prediction is known not to hold, and why (Row.unpriced).
# A compiled block keeps for backward what Inductor's partitioner chooses: like plait's lean eager
# block, within 10% (the estimate prices eager's), but under full recompute.
COMPILED = (("activations", "Inductor saves other tensors for backward than eager does under full recompute; the "
                            "estimate prices eager's"),)
COMPILED_SP = (("tp all_gather", "a compiled block keeps a region's gathered input for backward where "
                                 "eager gathers it again; the estimate counts eager's gathers (its activations "
                                 "count the kept inputs)"),)
ROUTED = (("ep all_to_all", "its bytes follow the routing that happened; the estimate assumes even routing"),)

ROWS = rows(
    # Each strategy, and each product of them, on plait's GPT.
    Row("gpt", "--nproc 4 --zero 3", micro_batches=4),
    Row("gpt", "--nproc 2 --zero 2", "--offload", micro_batches=2),
    Row("gpt", "--nproc 2 --tp 2 --sp"),
    Row("gpt", "--nproc 2 --pp 2 --grad-accum 2", micro_batches=2),
    Row("gpt", "--nproc 4 --dp 2 --pp 2 --grad-accum 2 --schedule zb-h1", micro_batches=4),
    Row("gpt", "--nproc 2 --tp 2 --sp", "--recompute full", tier=TEST),
    Row("gpt", "--nproc 4 --dp 2 --pp 2 --zero 3 --grad-accum 2", "--recompute full", micro_batches=4),
    Row("gpt", "--nproc 4 --tp 2 --zero 1 --sp --grad-accum 2", micro_batches=4),
    # context parallelism: the rope rows each forward gathers, the ring's fp32 output that
    # o_proj reads as a view, Ulysses' output traded back and its reorderings, to the byte
    Row("gpt", "--nproc 2 --cp 2 --grad-accum 2", micro_batches=2),
    Row("gpt", "--nproc 2 --cp 2 --cp-kind ulysses", "--precision bf16"),
    Row("gpt", "--nproc 4 --tp 2 --pp 2 --grad-accum 2 --schedule zb-h1", micro_batches=2),
    Row("gpt", "--nproc 4 --dp 2 --pp 2 --zero 2 --grad-accum 2", micro_batches=4),
    Row("gpt", "--nproc 8 --dp 2 --tp 2 --pp 2 --zero 3 --sp --grad-accum 2", micro_batches=4, tier=TEST),
    # hybrid sharding: ZeRO inside groups of --dp-shard ranks, replicas across them
    Row("gpt", "--nproc 4 --zero 3 --dp-shard 2", micro_batches=4, tier=TEST),
    Row("gpt", "--nproc 4 --zero 1 --dp-shard 2", micro_batches=4),
    Row("gpt", "--nproc 4 --zero 2 --dp-shard 2 --grad-accum 2", micro_batches=8),
    Row("gpt", "--nproc 4 --dp 2 --pp 2 --zero 2 --dp-shard 1 --grad-accum 2", micro_batches=4),
    Row("llama", "--nproc 4 --cp 2 --zero 3 --dp-shard 2", micro_batches=2),
    Row("llama", "--nproc 4 --cp 2 --zero 3", micro_batches=2),
    # Two chunks per pipeline rank: each chunk's backward reduces only its own groups.
    *(Row("gpt-4-layers", f"--nproc 4 --dp 2 --pp 2 --grad-accum 2 --schedule interleaved --virtual-stages 2 "
          f"--zero {zero}", micro_batches=4) for zero in (2, 3)),
    # Uneven stages (--stage-layers), a chunk at either end holding no block: the first only
    # the embedding, the last only the head and the loss.
    Row("gpt-4-layers", "--nproc 2 --pp 2 --grad-accum 2 --schedule interleaved --virtual-stages 2 "
        "--stage-layers 0,2,2,0", micro_batches=2, tier=TEST),
    Row("gpt-4-layers", "--nproc 2 --pp 2 --grad-accum 4 --schedule interleaved --virtual-stages 2 "
        "--stage-layers 1,2,1,0", micro_batches=4),  # m = 2·pp: the uneven chunks' peak is the schedule's
    # Interleaving where neither divides: 3 micro-batches on pp 2 (one round of 3), and 6 blocks
    # in 4 chunks, balanced 1, 2, 2, 1 (plait.interleave; parallel/pipeline/split.py)
    Row("gpt-6-layers", "--nproc 2 --pp 2 --grad-accum 3 --schedule interleaved --virtual-stages 2", micro_batches=3),
    Row("gpt-4-layers", "--nproc 4 --dp 2 --pp 2 --zero 1 --grad-accum 2 --stage-layers 1,3", micro_batches=4),
    Row("gpt-4-layers", "--nproc 4 --dp 2 --pp 2 --zero 3 --grad-accum 2 --stage-layers 0,4", micro_batches=4),
    Row("gpt-4-layers", "--nproc 2 --pp 2 --grad-accum 2 --schedule zb-h1 --stage-layers 4,0", micro_batches=2),
    Row("gpt-4-layers", "--nproc 4 --tp 2 --sp --pp 2 --grad-accum 2 --schedule gpipe --stage-layers 3,1",
        "--recompute full", micro_batches=2),
    Row("qwen3", "--nproc 2 --pp 2 --grad-accum 2 --schedule interleaved --virtual-stages 2 --stage-layers 0,2,2,0",
        micro_batches=2),
    Row("llama", "--nproc 2 --pp 2 --grad-accum 2 --stage-layers 0,2", micro_batches=2),
    # 16-bit weights and gradients with fp32 masters, against one process in the same precision.
    Row("gpt", "--nproc 2 --zero 2 --grad-accum 2", "--offload --precision bf16", micro_batches=4),
    Row("gpt", "--nproc 8 --dp 2 --tp 2 --pp 2 --zero 3 --sp --grad-accum 2", "--precision bf16", micro_batches=4),
    # Each block compiled (Inductor's C++ on a CPU; a cold compile is ~25 s here).
    Row("gpt", "--nproc 2", "--compile", micro_batches=2),
    Row("gpt", "--nproc 2 --zero 3", "--compile", micro_batches=2),
    Row("gpt", "--nproc 2 --tp 2 --sp --grad-accum 2", "--compile", micro_batches=2, unpriced=COMPILED_SP),
    Row("gpt", "--nproc 2 --pp 2 --grad-accum 2", "--compile", micro_batches=2),
    Row("gpt", "--nproc 2", "--compile --recompute full", micro_batches=2, unpriced=COMPILED),
    Row("gpt", "--nproc 2 --zero 3 --reshard-after-forward false", "--compile --precision bf16", micro_batches=2),
    Row("gpt", "--nproc 2 --tp 2", "--compile --precision fp16 --recompute selective"),
    Row("gpt", "--nproc 4 --tp 2 --sp --zero 1", "--compile", micro_batches=2, unpriced=COMPILED_SP),
    # The other families: a mixture of experts, two transformers models (their declared
    # plans), a ResNet with SyncBN.
    Row("moe", "--nproc 2 --ep 2", micro_batches=2, unpriced=ROUTED),
    Row("moe", "--nproc 4 --ep 2 --zero 1", micro_batches=4, unpriced=ROUTED),
    Row("llama", "--nproc 4 --dp 2 --tp 2 --grad-accum 2", micro_batches=4),
    # SP cuts a transformers model's sequence at its blocks alone: the final norm keeps the whole
    # sequence (priced), and its blocks keep what was measured of them
    Row("llama", "--nproc 2 --tp 2 --sp --grad-accum 2", micro_batches=2),
    Row("llama", "--nproc 4 --pp 2 --cp 2 --grad-accum 2", micro_batches=2),
    Row("qwen3", "--nproc 4 --tp 2 --pp 2 --grad-accum 2 --schedule interleaved --virtual-stages 2",
        micro_batches=2),
    Row("resnet", "--nproc 2", micro_batches=2),
    Row("resnet", "--nproc 2 --zero 3", "--recompute full", micro_batches=2),
)


def parametrized() -> list[Any]:
    """pytest parameters of every row: those of tier ALL marked slow (`make test-all`)."""
    return [pytest.param(name, marks=[] if row.tier == TEST else [pytest.mark.slow], id=name)
            for name, row in ROWS.items()]


MEMORY_KINDS = (("params", "params", 0.01), ("grads", "grads", 0.01), ("optim", "optim", 0.01),
                ("activations", "activations_peak", None))  # (predicted, measured, relative bar)


def prediction_misses(summary: dict[str, Any], activations_bar: float = 0.10) -> dict[str, str]:
    """What of a run's prediction (plait estimate on its own layout) does not hold: {quantity:
    "measured, predicted"}. Model states within 1% (ZeRO-3's parameters: the shards plus the
    units gathered at once), activations within `activations_bar` (Row.activations_bar), every
    collective's bytes exact (the gradient norm's all-reduces of one or two float64 aside: 16 B)."""
    predicted, mem, measured = summary["predicted"], summary["mem"], summary["comm_per_step"]
    misses = {}
    for kind, measured_as, bar in MEMORY_KINDS:
        rel = activations_bar if bar is None else bar
        want, got = predicted["memory"][kind], mem[measured_as]
        if abs(want - got) > rel * abs(got):
            misses[kind] = f"{got:,.0f} B measured, {want:,.0f} B predicted"
    keys = {(a, o) for src in (predicted["comm"], measured) for a, ops in src.items() for o in ops}
    for axis, op in sorted(keys):
        got, want = measured.get(axis, {}).get(op, 0), predicted["comm"].get(axis, {}).get(op, 0)
        if not 0 <= got - want <= 16:
            misses[f"{axis} {op}"] = f"{got:,.0f} B measured, {want:,.0f} B predicted"
    return misses


@dataclasses.dataclass
class Run:
    metrics: list[dict[str, Any]]
    summary: dict[str, Any]
    weights: dict[str, list[float]]
    stdout: str


def train(out: Path, root: Path, family: str, flags: list[str], env: dict[str, str] | None = None) -> Run:
    """One `plait train` of `family` with `flags`; what it wrote."""
    from safetensors.torch import load_file

    argv = [*COMMON, *FAMILIES[family].argv(root), *flags, "--out", str(out)]
    proc = run_plait("train", *argv, env_extra=env, timeout=600)
    assert proc.returncode == 0, f"plait train {' '.join(argv)}\n{proc.stderr[-3000:]}"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    weights = {k: v.float().flatten().tolist() for k, v in load_file(out / "model.safetensors").items()}
    return Run(metrics, json.loads((out / "summary.json").read_text()), weights, proc.stdout)


def compare(row: Row, run: Run, reference: Run) -> None:
    """The one comparison: losses, gradient norms (steps a loss scale skipped have none), held-out
    losses and final weights, at the row's bar."""
    loss, norm, weight, atol = row.tolerance
    assert run.summary["layout"]["precision"] == reference.summary["layout"]["precision"] == row.precision
    assert_losses_close([m["loss"] for m in run.metrics], [m["loss"] for m in reference.metrics], rtol=loss)
    norms = [(m["grad_norm"], r["grad_norm"]) for m, r in zip(run.metrics, reference.metrics)
             if m["grad_norm"] is not None and r["grad_norm"] is not None]
    assert len(norms) >= len(run.metrics) - 1, "more than one step without a gradient norm"
    assert_grad_norms_close([a for a, _ in norms], [b for _, b in norms], rtol=norm)
    assert_losses_close(list(run.summary["val_losses"].values()), list(reference.summary["val_losses"].values()),
                        rtol=loss)
    assert_params_close(run.weights, reference.weights, rtol=weight, atol=atol)


def write_families(root: Path) -> None:
    """The transformers families' folders (config.json only: weights from the seed) and a corpus."""
    transformers = pytest.importorskip("transformers")
    shape = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaConfig(**shape, tie_word_embeddings=True).save_pretrained(root / "llama")
    transformers.Qwen3Config(**{**shape, "num_hidden_layers": 4}, head_dim=8,  # a block per chunk at pp 2 × v 2
                             tie_word_embeddings=False).save_pretrained(root / "qwen3")
    (root / "corpus.txt").write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(600)))


class MatrixRuns:
    """The session's rows and references, each run once on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        write_families(root)
        # every compiled row shares the suite's compile cache (set by tests/conftest.py)
        self.compile_env = {"TORCHINDUCTOR_CACHE_DIR": os.environ["TORCHINDUCTOR_CACHE_DIR"]}
        self.references = Runs(self._reference)
        self.rows = Runs(self._row)

    def _reference(self, key: tuple[str, str, int]) -> Run:
        family, precision, micro_batches = key
        flags = ["--nproc", "1", "--precision", precision, *FAMILIES[family].reference_batch(micro_batches)]
        return train(self.root / "ref" / f"{family}-{precision}-{micro_batches}", self.root, family, flags)

    def _row(self, name: str) -> Run:
        row = ROWS[name]
        env = self.compile_env if "--compile" in row.flags else None
        return train(self.root / "rows" / name.replace("/", "_").replace("+", "_"), self.root, row.family,
                     row.flags, env)

    def reference_of(self, row: Row) -> Run:
        return self.references[(row.family, row.precision, row.micro_batches)]


@pytest.fixture(scope="session")
def matrix_runs(tmp_path_factory: pytest.TempPathFactory) -> MatrixRuns:
    return MatrixRuns(tmp_path_factory.mktemp("matrix"))
