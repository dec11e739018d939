"""What a run leaves for people to look at: `plait report`'s plots, TensorBoard events,
rank-aware log lines, and what `--measure light|off` keeps of each step."""

from __future__ import annotations

import json
import logging

import pytest
from PIL import Image

from plait.errors import PlaitError
from plait.schedule.build import build_schedule, simulate
from plait.schedule.timeline import timeline_from_dict, timeline_to_dict
from plait.report.closing import process_peak_text, reserved_text
from plait.report.page import figures, read_run
from plait.train.observe.logs import setup_logging
from plait.train.loop.measure import MeasurePolicy
from plait.train.observe.tboard import scalars
from tests.worldlib import run_plait

SHORT = ["--model", "tiny", "--steps", "5", "--micro-batch", "2", "--seq-len", "32", "--eval-every", "2",
         "--sample-tokens", "0", "--warmup-steps", "1"]


def _train(out, *flags):
    proc = run_plait("train", *SHORT, "--out", str(out), *flags, env_extra={"PLAIT_REPORT": "on"})
    assert proc.returncode == 0, proc.stderr
    return proc, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    """dp 2 with ZeRO-1 (its log.info line), TensorBoard, and light measurement."""
    out = tmp_path_factory.mktemp("dp")
    return (out, *_train(out, "--nproc", "2", "--zero", "1", "--tensorboard", "--log-level", "info",
                         "--measure", "light"))


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory):
    """pp 2, 1F1B over 4 micro-batches, measuring nothing between the first and last step."""
    out = tmp_path_factory.mktemp("pp")
    return (out, *_train(out, "--nproc", "2", "--pp", "2", "--grad-accum", "4", "--measure", "off"))


def _not_blank(path):
    image = Image.open(path).convert("L")
    low, high = image.getextrema()
    assert image.size[0] > 300 and high - low > 100, f"{path} looks blank"


def test_dp_report_pictures_and_figures(dp_run):
    out, proc, _ = dp_run
    assert f"report      {out}/report.md" in proc.stdout
    for name in ("loss", "throughput", "memory", "comm"):
        _not_blank(out / "report" / f"{name}.png")
        assert f"![{name}](report/{name}.png)" in (out / "report.md").read_text()
    assert not (out / "report" / "timeline.png").exists()  # no pipeline, no timeline
    records, summary = read_run(out)
    drawn = figures(records, summary)
    loss = drawn["loss"].axes[0]
    assert (loss.get_xlabel(), loss.get_ylabel()) == ("step", "loss (nats/token)")
    train_line, val_line = loss.get_lines()
    assert list(train_line.get_xdata()) == [1, 2, 3, 4, 5]
    assert list(val_line.get_xdata()) == [2, 4, 5]  # every 2 steps, and at the end
    assert list(val_line.get_ydata()) == [summary["val_losses"][k] for k in ("2", "4", "5")]
    memory = drawn["memory"].axes[0]
    assert [t.get_text() for t in memory.get_xticklabels()] == ["params", "grads", "optimizer", "activations"]
    predicted, measured = memory.containers
    assert measured[0].get_height() == pytest.approx(summary["mem"]["params"] / 2**20)
    assert predicted[2].get_height() == pytest.approx(summary["predicted"]["memory"]["optim"] / 2**20)
    comm = drawn["comm"].axes[0]
    assert [t.get_text() for t in comm.get_xticklabels()] == ["dp"]
    wire = sum(summary["comm_per_step"]["dp"].values())
    assert comm.containers[1][0].get_height() == pytest.approx(wire / 2**20) and wire > 0


def test_pp_report_draws_the_measured_timeline(pp_run):
    out, _, _ = pp_run
    for name in ("loss", "throughput", "memory", "comm", "timeline"):
        _not_blank(out / "report" / f"{name}.png")
    timeline = timeline_from_dict(json.loads((out / "timeline.json").read_text()))
    assert timeline.pp == 2 and [len(row) for row in timeline.rows] == [8, 8]  # 4 F + 4 B per rank
    assert [s.action.label() for s in timeline.rows[1][:2]] == ["F0", "B0"]  # 1F1B on the last stage
    assert all(s.end > s.start >= 0 for row in timeline.rows for s in row)


@pytest.fixture(scope="module")
def image_run(tmp_path_factory):
    """A ResNet on digits: the closing path of an image task, report included."""
    out = tmp_path_factory.mktemp("image")
    proc = run_plait("train", "--model", "resnet18,width=4", "--data", "digits", "--nproc", "2", "--sync-bn",
                     "--steps", "4", "--eval-every", "2", "--micro-batch", "16", "--lr", "0.01", "--warmup-steps", "1",
                     "--out", str(out), env_extra={"PLAIT_REPORT": "on"})
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_an_image_run_reports_images_and_accuracy(image_run):
    out, proc = image_run
    assert f"report      {out}/report.md" in proc.stdout
    assert "global batch 32 images" in proc.stdout and "images/s" in proc.stdout and "top-1 accuracy" in proc.stdout
    for name in ("loss", "throughput", "val_accuracy", "memory", "comm"):
        _not_blank(out / "report" / f"{name}.png")
    records, summary = read_run(out)
    drawn = figures(records, summary)
    assert drawn["throughput"].axes[0].get_ylabel() == "images/s"
    assert drawn["loss"].axes[0].get_ylabel() == "loss (nats/image)"
    accuracy = drawn["val_accuracy"].axes[0].get_lines()[0]
    assert list(accuracy.get_xdata()) == [2, 4]
    assert list(accuracy.get_ydata()) == [summary["evaluations"][k]["val_accuracy"] for k in ("2", "4")]
    page = (out / "report.md").read_text()
    assert "global batch 32 images" in page and "images/s" in page and "top-1 accuracy" in page
    # predicted before it measured: a CNN's activations and step time too (plait/estimate/cnn.py)
    predicted = summary["predicted"]
    assert predicted["memory"]["activations"] == pytest.approx(summary["mem"]["activations_peak"], rel=0.02)
    assert predicted["time"]["step_s"] > 0 and summary["step_time"]["ratio"] > 0
    assert "not predicted" not in proc.stdout


def test_tensorboard_events_read_back(dp_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _, records = dp_run
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mem/params", "comm/dp"} <= tags
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4, 5]
    assert [e.value for e in events.Scalars("lr")] == pytest.approx([r["lr"] for r in records])
    assert [e.step for e in events.Scalars("mem/params")] == [1, 5]  # measured in full: first and last step
    assert events.Scalars("comm/dp")[0].value == sum(records[0]["comm"]["dp"].values())


def test_info_logs_show_with_rank_prefixes(dp_run):
    _, proc, _ = dp_run
    lines = proc.stderr.splitlines()
    assert any(line.startswith("plait.parallel.zero.stages: ZeRO-1 over 2 dp ranks") for line in lines), proc.stderr
    assert any(line.startswith("[rank 1] plait.parallel.zero.stages: ZeRO-1 over 2 dp ranks") for line in lines)


def test_light_and_off_measure_only_first_and_last_step_in_full(dp_run, pp_run):
    _, _, light = dp_run
    assert [("mem" in r) for r in light] == [True, False, False, False, True]
    assert all(r["loss"] > 0 and r["comm"]["dp"] for r in light)  # the ledger counts for free
    assert [r.get("measure") for r in light] == [None, "light", "light", "light", None]
    _, _, off = pp_run
    assert [("loss" in r) for r in off] == [True, False, False, False, True]
    assert all(r["tokens_per_s"] > 0 for r in off)


# -- pieces without processes ----------------------------------------------------------------------
def test_timeline_survives_json():
    timeline = simulate(build_schedule("interleaved", 2, 4, 2), 2, 2)
    again = timeline_from_dict(json.loads(json.dumps(timeline_to_dict(timeline))))
    assert again == timeline


def test_measure_policy():
    policy = MeasurePolicy("light", steps=10)
    policy.first_step = 4  # resumed
    assert [s for s in range(4, 10) if policy.full(s)] == [4, 9]
    assert MeasurePolicy("full", 10).full(5) and not MeasurePolicy("off", 10).reads_loss(False)


def test_tensorboard_tags_of_a_metrics_line():
    line = {"step": 3, "loss": 2.5, "lr": 0.1, "tokens_per_s": 10.0, "mem": {"params": 8},
            "comm": {"dp": {"all_reduce": 6, "broadcast": 2}, "pp": {"send": 4}}}
    assert scalars(line) == {"loss": 2.5, "lr": 0.1, "tokens_per_s": 10.0, "mem/params": 8.0,
                             "comm/dp": 8.0, "comm/pp": 4.0}


def test_log_prefix_names_the_rank(capsys):
    for rank, prefix in ((0, ""), (3, "[rank 3] ")):
        setup_logging("info", rank=rank)
        logging.getLogger("plait.parallel.tensor.plan").info("split %d layers", 4)
        logging.getLogger("plait.parallel.tensor.plan").debug("not shown at info")
        assert capsys.readouterr().err == f"{prefix}plait.parallel.tensor.plan: split 4 layers\n"
    setup_logging("warning", rank=0)


def test_without_matplotlib_one_line_says_how(monkeypatch, tmp_path):
    import plait.report as report

    monkeypatch.setattr(report, "has_matplotlib", lambda: False)
    assert report.report_after_training(tmp_path) == (
        f"  report      no plots: pip install matplotlib, then run `plait report {tmp_path}`")
    with pytest.raises(PlaitError, match="matplotlib, which is not installed"):
        report.write_report(tmp_path)


def test_report_of_a_directory_without_a_run(tmp_path):
    with pytest.raises(PlaitError, match="metrics.jsonl does not exist") as err:
        read_run(tmp_path)
    assert "--out directory of a finished" in err.value.hint


def test_the_allocators_reservation_is_reported_beside_the_allocated_peak(dp_run):
    """On a GPU the closing line says what the caching allocator reserved over the allocated
    peak: the measure of the estimate's 10% allowance. A CPU has no such allocator: its runs
    record 0 and say nothing of it."""
    out, proc, _ = dp_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["peak_reserved_bytes"] == 0 and "reserved" not in process_peak_text(summary)
    gpu = {"peak_process_bytes": 50 * 2**30, "peak_reserved_bytes": 56 * 2**30}
    assert reserved_text(gpu) == "; the allocator reserved 56.0 GiB, +12% over the allocated peak"


def test_the_compile_line_shows_when_only_the_update_compiles():
    """The closing report's compile line follows whatever the run compiles: a run with
    --optimizer-kernel compiled and eager blocks compiles its update at the first step too."""
    from torch import nn

    from plait.parallel.compiled import COMPILED_ATTR
    from plait.train.config.settings import TrainConfig
    from plait.train.loop.run import compiles

    eager, blocks = nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2))
    setattr(blocks[0], COMPILED_ATTR, True)
    assert not compiles(eager, TrainConfig())
    assert compiles(eager, TrainConfig(precision="bf16", optimizer_kernel="compiled"))
    assert compiles(blocks, TrainConfig())
