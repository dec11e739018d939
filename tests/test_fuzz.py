"""Every command's flags fuzzed: whatever text a user types, plait answers in one line and a
hint (exit code 2) or does the work; it never ends in a raw exception (exit code 1).

Hypothesis draws, for one command at a time, a few of its flags (read from its own parser,
so a new flag is fuzzed the day it lands) with hostile values: empty and blank text, signs,
zero, huge and non-finite numbers, lists, words, paths that are files, directories or
nothing, and long text. The work the command would start is stubbed (the spawner, the
training loop, the measurements), so what is fuzzed is everything a command does with its
input before that: parsing, checking, estimating. Every flag of every command is a case of
its own (its hostile values beside up to two other flags); `FUZZ_EXAMPLES` (the environment)
sets the examples per flag: 8 by default. `test_the_fuzzer_finds_a_planted_raw_int` checks
the fuzzer itself.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plait import cli
from plait.errors import EXIT_CRASH, EXIT_INPUT

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "8"))  # per flag
HOSTILE = ["", " ", "0", "-1", "1", "2", "3", "8", "-0", "1.5", "1e309", "-1e309", "nan", "inf", "1e18",
           "99999999999999999999", "abc", "1,2", ",", "2,", "true", "false", "none", "auto", "x" * 300, "é∞",
           "-", "--", "1:2", "0.7:embedded,0.3:stdlib", "hf:", "hf:/nowhere", "/nowhere/at/all", "DIR", "FILE",
           "4GB", "-5GB", "tiny", "small", "resnet18", "digits", "bf16", "fp8", "ring", "1f1b", "crop,flip"]


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def _options(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """{option string: takes a value} of a parser (help and --debug aside)."""
    out = {}
    for action in parser._actions:
        strings = [s for s in action.option_strings if s.startswith("--")]
        if strings and strings[0] not in ("--help", "--debug"):
            out[strings[0]] = action.nargs != 0
    return out


def _argv(draw, options: dict[str, bool], directory: Path, whole: bool = False) -> list[str]:
    """Some of `options` (all of them when `whole`), each with a hostile value if it takes one."""
    chosen = sorted(options) if whole else draw(st.lists(st.sampled_from(sorted(options)), max_size=2, unique=True))
    argv = []
    for flag in chosen:
        argv.append(flag)
        if options[flag]:
            value = draw(st.sampled_from(HOSTILE) | st.integers(-3, 10**6).map(str))
            argv.append({"DIR": str(directory), "FILE": str(directory / "file.txt")}.get(value, value))
    return argv


@pytest.fixture
def stubbed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Nothing the commands would start runs: no processes, no training, no measurement."""
    import plait.bench.calibrate_cli as calibrate
    import plait.runtime.launch as launch
    import plait.train.loop.evaluate as evaluate
    import plait.train.loop.run as run

    monkeypatch.setattr(launch, "spawn", lambda *a, **k: 0)
    monkeypatch.setattr(run, "train", lambda *a, **k: None)
    monkeypatch.setattr(evaluate, "evaluate", lambda *a, **k: {"loss": 1.0, "perplexity": 2.7, "tokens": 1,
                                                              "documents": 1, "pieces": 1, "data": "d"})
    monkeypatch.setattr(calibrate, "_rank_main", lambda *a, **k: 0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file.txt").write_text("some text\n" * 10)
    return tmp_path


def _check(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    code = cli.main(argv)  # a flag argparse cannot read is refused as any input is: no SystemExit, no usage block
    err = capsys.readouterr().err
    assert code != EXIT_CRASH and "Traceback" not in err and "usage:" not in err, (argv, err[-600:])
    if code == EXIT_INPUT:
        line = next(line for line in err.splitlines() if line.startswith("plait: error:"))
        assert len(line) < 2000, argv


def _parser_of(command: str) -> argparse.ArgumentParser:
    if command == "train":
        return cli.train_parser()
    if command == "eval":
        return cli.eval_parser()
    if command == "estimate":
        from plait.estimate.cli import estimate_parser

        return estimate_parser()
    if command == "plan":
        from plait.estimate.cli import plan_parser

        return plan_parser()
    if command == "calibrate":
        from plait.bench.calibrate_cli import calibrate_parser

        return calibrate_parser()
    if command == "bench collectives":
        from plait.bench.cli import collectives_parser

        return collectives_parser()
    if command == "data prepare":
        parser = argparse.ArgumentParser()
        for flag in ("--tokenizer", "--data", "--out", "--field", "--workers", "--eos", "--format"):
            parser.add_argument(flag)
        return parser
    raise KeyError(command)


REQUIRED = {"calibrate": ["--out", "hw.toml"], "data prepare": ["--tokenizer", "bytes", "--data", "file.txt",
                                                                 "--out", "prepared"],
            "plan": ["--model", "tiny", "--gpus", "2", "--global-batch", "16"], "estimate": ["--model", "tiny"],
            "train": ["--nproc", "1", "--out", "run"], "bench collectives": [],
            "eval": ["--model", "tiny", "--data", "file.txt", "--nproc", "1"]}


def _cases() -> list[tuple[str, str]]:
    return [(command, flag) for command in sorted(REQUIRED) for flag in sorted(_options(_parser_of(command)))]


def fuzz_flag(command: str, flag: str, directory: Path, capsys: pytest.CaptureFixture, examples: int) -> None:
    """Each hostile value of `flag` alone, then hypothesis's draws of it beside up to two other
    flags of `command`, each checked."""
    options = _options(_parser_of(command))

    for value in HOSTILE if options[flag] else [None]:  # every hostile value alone, in turn
        typed = {"DIR": str(directory), "FILE": str(directory / "file.txt")}.get(value, value)
        _check([*command.split(), *REQUIRED[command], flag, *([typed] if value is not None else [])], capsys)

    @settings(max_examples=examples, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def fuzz(data):  # and beside other flags (the same draws every run: the suite is not flaky)
        argv = [*command.split(), *REQUIRED[command], *_argv(data.draw, {flag: options[flag]}, directory, whole=True),
                *_argv(data.draw, {k: v for k, v in options.items() if k != flag}, directory)]
        _check(argv, capsys)

    fuzz()


@pytest.mark.parametrize("command, flag", _cases())
def test_hostile_flags_get_one_line_never_a_raw_exception(command, flag, stubbed, capsys):
    fuzz_flag(command, flag, stubbed, capsys, EXAMPLES)


def test_the_fuzzer_finds_a_planted_raw_int(stubbed, capsys, monkeypatch):
    """A raw int() planted on --steps (the bug this suite exists to catch) is found."""
    from plait.train.config import check

    real = check._typed

    def planted(name, value, kind, source):
        if name == "steps":
            int(value)
        return real(name, value, kind, source)

    monkeypatch.setattr(check, "_typed", planted)
    with pytest.raises(AssertionError, match="ValueError"):
        fuzz_flag("train", "--steps", stubbed, capsys, EXAMPLES)
