"""Bad input on every command ends in one line and a hint, exit code 2, no traceback, and
nothing started or written: the cases a review found ending in a raw traceback, or accepted
and then ignored (each was one before it was fixed)."""

from __future__ import annotations

import json

import pytest

from plait.cli import main
from plait.errors import EXIT_INPUT


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def _refused(capsys: pytest.CaptureFixture, argv: list[str], says: str) -> None:
    assert main(argv) == EXIT_INPUT, argv
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("plait: error: ") and says in lines[0], err
    assert len(lines) == 2 and lines[1].startswith("  hint: "), err
    assert "Traceback" not in err


TRAIN = ["train", "--model", "tiny", "--steps", "1", "--nproc", "1"]


@pytest.mark.parametrize("argv, says", [
    (TRAIN + ["--backend", "foo"], "--backend 'foo' is not one of: auto, nccl, gloo, mpi"),
    (TRAIN + ["--fp8-scaling", "foo"], "--fp8-scaling 'foo' is not one of"),
    (TRAIN + ["--augment", "foo"], "--augment 'foo' is not one of"),
    (TRAIN + ["--out", ""], "--out is empty"),
    (TRAIN + ["--data", " "], "--data is empty"),
    (["calibrate", "--seq-len", "0", "--out", "x.toml"], "--seq-len 0: give 1 or more"),
    (["calibrate", "--micro-batch", "-1", "--out", "x.toml"], "--micro-batch -1"),
    (["bench", "collectives", "--iters", "-1"], "--iters -1"),
    (["bench", "collectives", "--backend", "foo"], "--backend 'foo' is not one plait runs"),
    (["plan", "--model", "small", "--gpus", "2", "--global-batch", "16", "--seq-len", "128", "--top", "0"],
     "--top 0"),
    (["launch", "--nproc", "2", "nothere.py"], "nothere.py is not a file"),
])
def test_a_bad_flag_is_one_line(capsys, tmp_path, monkeypatch, argv, says):
    monkeypatch.chdir(tmp_path)
    _refused(capsys, argv, says)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_an_output_file_that_is_a_directory_is_refused_before_measuring(capsys, tmp_path):
    _refused(capsys, ["calibrate", "--out", str(tmp_path)], "is a directory")
    _refused(capsys, ["bench", "collectives", "--out", str(tmp_path)], "is a directory")
    _refused(capsys, ["calibrate", "--out", str(tmp_path / "no" / "x.toml")], "does not exist")


def test_a_link_to_nothing_in_a_corpus_is_named(capsys, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("some text " * 20)
    (data / "gone.txt").symlink_to(tmp_path / "nowhere")
    _refused(capsys, TRAIN + ["--data", str(data), "--out", str(tmp_path / "o")],
             f"{data / 'gone.txt'} is a link to {tmp_path / 'nowhere'}, which does not exist")
    _refused(capsys, ["data", "prepare", "--tokenizer", "bytes", "--data", str(data), "--out", str(tmp_path / "p")],
             "which does not exist")
    assert not (tmp_path / "o").exists() and not (tmp_path / "p" / "tokens.bin").exists()


@pytest.mark.parametrize("metrics, summary, says", [
    ('{"step": 1, "loss": 2\n', None, "metrics.jsonl:1 is not JSON"),
    ('{"step": 1}\n[1]\n', None, "metrics.jsonl:2 is not a step's record"),
    ('{"step": 1}\n', "{bad", "summary.json is not JSON"),
    ('{"step": 1}\n', "[]", "is not a plait run's summary"),
    ('{"step": 1}\n', '{"task": {"unit": "tokens"}}', "lacks what the report draws"),
    (b'{"step": 1}\n\xff\n', None, "metrics.jsonl is not UTF-8 text"),
])
def test_a_damaged_run_directory_is_named_by_the_report(capsys, tmp_path, metrics, summary, says):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(metrics if isinstance(metrics, bytes) else metrics.encode())
    (run / "summary.json").write_text(summary if summary is not None else json.dumps({"task": {"unit": "tokens"}}))
    _refused(capsys, ["report", str(run)], says)


def test_launch_takes_a_module_as_python_does(tmp_path, monkeypatch, capfd):
    (tmp_path / "hello_rank.py").write_text("import os, sys\nprint('rank', os.environ['RANK'], sys.argv[1:])\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert main(["launch", "--nproc", "1", "-m", "hello_rank", "a"]) == 0
    assert "rank 0 ['a']" in capfd.readouterr().out
    assert main(["launch", "--nproc", "1", "--", "-m", "hello_rank", "b"]) == 0
    assert "rank 0 ['b']" in capfd.readouterr().out


def test_an_hf_config_with_a_malformed_rope_table_is_one_line(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    model.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["rope_parameters"] = [1, 2]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # save_pretrained's progress
    _refused(capsys, ["train", "--model", f"hf:{tmp_path / 'm'}", "--steps", "1", "--nproc", "1", "--out",
                      str(tmp_path / "o")], "rope_parameters")


@pytest.mark.parametrize("argv, says", [
    (TRAIN + ["--cp-kind", "ulysses"], "--cp-kind ulysses does nothing in this run: it needs --cp 2 or more"),
    (TRAIN + ["--fp8-scaling", "rowwise"], "--fp8-scaling rowwise does nothing in this run: it needs --precision fp8"),
    (TRAIN + ["--loss-scale", "1024"], "--loss-scale 1024.0 does nothing in this run: it needs --precision fp16"),
    (TRAIN + ["--prefetch", "2"], "--prefetch tune ZeRO-3's weight gathers, and --zero is 0"),
    (TRAIN + ["--schedule", "gpipe"], "--schedule gpipe does nothing in this run: it needs --pp 2 or more"),
    (TRAIN + ["--reduce-dtype", "bf16"], "--reduce-dtype bf16 does nothing in this run: it needs data-parallel"),
    (TRAIN + ["--min-nproc", "1"], "--min-nproc 1 does nothing in this run: it needs --max-restarts 1 or more"),
    (TRAIN + ["--keep-checkpoints", "5"], "--keep-checkpoints 5 does nothing in this run: it needs --save-every N"),
    (TRAIN + ["--async-save"], "--async-save true does nothing in this run: it needs --save-every N"),
    (TRAIN + ["--augment", "crop"], "--augment crop does nothing for --model tiny"),
    (["train", "--model", "resnet18", "--data", "digits", "--steps", "1", "--nproc", "1", "--packing", "concat"],
     "--packing concat does nothing for --model resnet18 (resnet models do not read it)"),
    (["train", "--model", "resnet18", "--data", "digits", "--steps", "1", "--nproc", "1", "--prompt", "x"],
     "--prompt x does nothing for --model resnet18"),
])
def test_a_flag_that_does_not_apply_is_refused_not_ignored(capsys, tmp_path, monkeypatch, argv, says):
    monkeypatch.chdir(tmp_path)
    _refused(capsys, argv, says)
    assert not (tmp_path / "runs").exists()


def test_flags_that_apply_are_taken(monkeypatch, tmp_path):
    """The same flags where they mean something pass the check (nothing is started)."""
    import plait.runtime.launch as launch

    monkeypatch.setattr(launch, "spawn", lambda *a, **k: 0)
    monkeypatch.chdir(tmp_path)
    base = ["train", "--model", "tiny", "--steps", "1", "--nproc", "2"]
    for extra in (["--cp", "2", "--cp-kind", "ulysses"], ["--zero", "3", "--prefetch", "2"],
                  ["--pp", "2", "--schedule", "gpipe", "--grad-accum", "2"], ["--dp", "2", "--reduce-dtype", "bf16"],
                  ["--save-every", "1", "--keep-checkpoints", "5", "--async-save"],
                  ["--max-restarts", "1", "--min-nproc", "1"]):
        assert main(base + extra) == 0, extra
