"""`plait` on the command line: train, eval, launch, ckpt, data, report, estimate, plan, bench, calibrate.

Errors caused by the input print one line and a hint; a traceback appears only with
`--debug`. This module imports torch only once a rank actually trains, so the spawner
and `--help` start instantly.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from pathlib import Path
import traceback
from dataclasses import fields
from typing import Any

from plait.errors import EXIT_CRASH, EXIT_INPUT, EXIT_PREEMPTED, CommandParser, PlaitError, Preempted


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        return _dispatch(argv)
    except PlaitError as exc:
        _print_error(exc, debug)
        if _after_failed_collective(exc):
            # Tearing down a process group whose collective failed can hang or abort in
            # torch's destructors: leave now, with the error already printed (the store's
            # host first waits a few seconds for the other ranks to read what they need).
            sys.modules["plait.runtime.comm"].settle_after_failure(exc)
            sys.stdout.flush()
            os._exit(getattr(exc, "exit_code", EXIT_INPUT))
        return getattr(exc, "exit_code", EXIT_INPUT)  # bad input, or a stop a restart can mend (EXIT_CORRUPT)
    except Preempted as stop:
        if stop.message:  # said once, by the main rank
            say(f"plait: {stop.message}")
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        return 130
    except OSError as exc:  # a path the input named: too long, not permitted, a full disk
        what = f"{exc.filename}: " if exc.filename else ""
        _print_error(PlaitError(f"{what}{exc.strerror or exc}", hint="check the path, its permissions and the "
                                                                     "free space"), debug)
        return EXIT_INPUT
    except Exception as exc:  # noqa: BLE001 - the last line of defence prints, never hides
        where = f"rank {os.environ['RANK']}: " if "RANK" in os.environ else ""
        if debug:
            traceback.print_exc()
        tail = "" if debug else "\n  (run again with --debug for the traceback)"
        say(f"plait: {where}{type(exc).__name__}: {exc}{tail}")
        return EXIT_CRASH


def _after_failed_collective(exc: PlaitError) -> bool:
    comm = sys.modules.get("plait.runtime.comm")  # never imported here: it would load torch
    return comm is not None and isinstance(exc, comm.CommError)


def _print_error(exc: PlaitError, debug: bool) -> None:
    if debug:
        traceback.print_exc()
    where = f"rank {os.environ['RANK']}: " if "RANK" in os.environ and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    if exc.message.startswith(where):
        where = ""  # the message names its rank already (a failed collective's does)
    say(f"plait: error: {where}{exc.message}" + (f"\n  hint: {exc.hint}" if exc.hint else ""))


def say(text: str) -> None:
    """Write `text` and its newline to stderr in one call, on a line of its own even when rank
    0's progress bar is drawn on the same stderr (plait.runtime.console)."""
    from plait.runtime import console

    console.say(text)


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):  # the only use of the top-level parser: built for it alone
        _parser().print_help()
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        return cmd_train(rest)
    if command == "eval":
        return cmd_eval(rest)
    if command == "launch":
        return cmd_launch(rest)
    if command == "ckpt":
        return cmd_ckpt(rest)
    if command == "data":
        from plait.train.data.prepare import data_main

        return data_main(rest)
    if command == "estimate":
        from plait.estimate.cli import estimate_main
        from plait.families import shape_of

        return estimate_main([a for a in rest if a != "--debug"], shape_of)
    if command == "plan":
        from plait.estimate.cli import plan_main
        from plait.families import shape_of

        return plan_main([a for a in rest if a != "--debug"], shape_of)
    if command == "bench":
        from plait.bench.cli import bench_main

        return bench_main([a for a in rest if a != "--debug"])
    if command == "calibrate":
        from plait.bench.calibrate_cli import calibrate_main

        return calibrate_main([a for a in rest if a != "--debug"])
    if command == "report":
        return cmd_report(rest)
    if command == "--version":
        from plait import __version__

        print(f"plait {__version__}")
        return 0
    raise _unknown_command(command)


COMMANDS = {
    "train": "train plait's GPT (the demo, by default), a ResNet or a local Hugging Face model on N processes",
    "eval": "a language model's mean loss and perplexity over every document of a corpus, any layout",
    "launch": "run your own script as N local processes (like torchrun)",
    "ckpt": "inspect a checkpoint, or export it (one safetensors file, or a Hugging Face directory)",
    "data": "prepare a corpus: tokenize it once into a file every rank maps",
    "report": "plots of a finished run (loss, speed, memory, traffic, timeline) in RUN_DIR/report.md",
    "estimate": "memory, traffic and step time of one layout, before launching",
    "plan": "rank every layout that fits a GPU count by predicted step time",
    "bench": "the collective primitives, checked and timed: bench collectives --nproc N",
    "calibrate": "measure this machine for the time model: --out hw.toml",
}


def _parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="plait", description="Train PyTorch models across many processes.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in COMMANDS.items():
        sub.add_parser(name, help=text)
    parser.add_argument("--version", action="store_true", help="print the version")
    return parser


def _unknown_command(command: str) -> PlaitError:
    near = difflib.get_close_matches(command, list(COMMANDS), n=1)
    return PlaitError(f"unknown command {command!r}", hint=(f"did you mean {near[0]}? " if near else "")
                      + "the commands: " + ", ".join(COMMANDS))


# -- plait train -----------------------------------------------------------------------------------
def train_parser() -> argparse.ArgumentParser:
    """One flag per TrainConfig field, so the dataclass is the one place options are defined;
    `--model`'s help lists the registered families (plait.families)."""
    from plait.families import registered
    from plait.train.config.settings import TrainConfig

    parser = CommandParser(
        prog="plait train",
        description="Train a model with plait's parallelism: plait's GPT, a ResNet (--model resnet18) or a local "
                    "Hugging Face model (--model hf:DIR). With no flags: the demo (small GPT, 2 processes).",
    )  # each flag's help names its default itself (its argparse default is None: "not given")
    parser.add_argument("--config", metavar="FILE.toml", help="TOML file of defaults; flags override it")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    for f in fields(TrainConfig):
        names = [f"--{f.name.replace('_', '-')}"] + (["--timeout"] if f.name == "timeout_s" else [])
        text = f.metadata.get("help", "")
        if f.name == "model":
            text += ": " + "; ".join(family.models for family in registered())
        help_text = f"{text} (default: {f.default})"
        if str(f.type) == "bool" and f.default is True:  # on by default: the flag takes true or false
            parser.add_argument(*names, dest=f.name, nargs="?", const="true", default=None, metavar="true|false",
                                help=help_text)
        elif str(f.type) == "bool":
            parser.add_argument(*names, dest=f.name, action="store_const", const=True, default=None, help=help_text)
        else:
            parser.add_argument(*names, dest=f.name, type=_flag_type(f.type), default=None, help=help_text)
    return parser


def eval_parser() -> argparse.ArgumentParser:
    """`plait eval`: train's flags that apply to scoring a corpus, and --json."""
    from plait.train.config.settings import TrainConfig
    from plait.train.loop.evaluate import EVAL_FIELDS

    parser = CommandParser(
        prog="plait eval",
        description="The mean next-token loss over every loss-carrying token of every document of --data, and its "
                    "perplexity, under any layout: the same figure for every layout.")
    parser.add_argument("--json", action="store_true", help="print one JSON object: loss, perplexity, tokens, documents")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    helps = {"model": "a preset, hf:DIR (its weights), or a finished run's --out (the weights it wrote)",
             "packing": "how documents become sequences: best-fit (default when the corpus has documents: each "
                        "scored whole) or concat", "doc_mask": "attention inside each document (default true when "
                                                              "the corpus has documents)"}
    for f in fields(TrainConfig):
        if f.name not in EVAL_FIELDS:
            continue
        names = [f"--{f.name.replace('_', '-')}"] + (["--timeout"] if f.name == "timeout_s" else [])
        text = helps.get(f.name, f.metadata.get("help", ""))
        if str(f.type) == "bool":
            parser.add_argument(*names, dest=f.name, action="store_const", const=True, default=None, help=text)
        else:
            parser.add_argument(*names, dest=f.name, type=str, default=None, help=f"{text} (default: {f.default})")
    return parser


def cmd_eval(argv: list[str]) -> int:
    from plait.families import family_of, import_families
    from plait.train.config.settings import build_config, validate
    from plait.train.loop.evaluate import eval_config, eval_line, evaluate, run_model_spec

    import_families(_flag(argv, "--imports") or "")
    args = eval_parser().parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k not in ("json", "debug")}
    if flags.get("model") is None:
        raise PlaitError("plait eval needs --model", hint="e.g. plait eval --model runs/latest --data data/corpus")
    flags["model"], run_dir = run_model_spec(flags["model"])
    config = eval_config(build_config({}, flags, family_of))
    family = family_of(config)
    validate(config, family)
    if _inside_job() or config.nproc == 1:
        import json

        result = evaluate(config, family, run_dir)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result) if args.json else eval_line(result))
        return 0
    from plait.runtime.launch import spawn

    return spawn([sys.executable, "-m", "plait", "eval", *argv], config.nproc)


def _flag_type(annotation: Any) -> Any:
    # Flags arrive as text: train/config/check.py converts and range-checks them with the
    # TOML values, so a wrong one is one PlaitError naming the flag, like a wrong TOML value.
    return str


def cmd_train(argv: list[str]) -> int:
    from plait.families import family_of, import_families
    from plait.train.config.settings import build_config, load_toml, validate

    file_values = load_toml(_config_file(argv)) if _config_file(argv) else {}
    import_families(_flag(argv, "--imports") or file_values.get("imports", ""))  # their families join --help
    args = train_parser().parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "debug")}
    config = build_config(file_values, flags, family_of)
    family = family_of(config)
    validate(config, family)
    if _inside_job() or config.nproc == 1:
        from plait.train.loop.run import train

        train(config, family)
        return 0
    from plait.runtime.launch import spawn
    from plait.train.checkpoint.restart import warn_restarts_without_saves

    warn_restarts_without_saves(config.max_restarts, config.save_every)
    command = [sys.executable, "-m", "plait", "train"]
    return spawn([*command, *argv], config.nproc, max_restarts=config.max_restarts,
                 restart_command=lambda nproc: [*command, *_restart_argv(argv, config, nproc)],
                 sizes=_smaller_worlds(config))


def _restart_argv(argv: list[str], config: Any, nproc: int) -> list[str]:
    """A restarted world's flags: the same, resumed; on another size, its --nproc and
    --grad-accum (plait.train.checkpoint.elastic keeps the global batch)."""
    from plait.layout import Layout
    from plait.train.checkpoint.elastic import accumulation
    from plait.train.checkpoint.restart import restart_argv

    if nproc == config.nproc:
        return restart_argv(argv, config.out)
    dp = Layout.fill(nproc, **config.layout_choices()).dp
    return restart_argv(argv, config.out, nproc, accumulation(config.global_batch, config.micro_batch, dp))


def _smaller_worlds(config: Any) -> list[int]:
    """The world sizes from --min-nproc to --nproc that keep the run's global batch (none
    without --min-nproc: the spawner then never shrinks the world)."""
    from plait.train.checkpoint.elastic import world_sizes

    if config.min_nproc is None:
        return []
    layout = config.layout
    sizes = world_sizes(config.global_batch, config.micro_batch, tp=layout.tp, pp=layout.pp, cp=layout.cp,
                        up_to=config.nproc, ep=layout.ep, dp_shard=layout.dp_shard, sync_bn=config.sync_bn)
    return [n for n in sizes if n >= config.min_nproc]


def _flag(argv: list[str], name: str) -> str | None:
    """A flag's value read ahead of the parser (`--name V` or `--name=V`), or None."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _config_file(argv: list[str]) -> str | None:
    return _flag(argv, "--config")


def _inside_job() -> bool:
    """True when a launcher (ours, torchrun, srun, mpirun) already started this process as a rank."""
    return any(name in os.environ for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"))


def cmd_report(argv: list[str]) -> int:
    parser = CommandParser(prog="plait report",
                                     description="Draw a finished run's plots and write RUN_DIR/report.md embedding them.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the --out directory of a `plait train` run")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    args = parser.parse_args(argv)
    from plait.report import write_report

    page = write_report(args.run_dir)
    print(f"wrote {page} (plots in {page.parent / 'report'})")
    return 0


# -- plait launch ----------------------------------------------------------------------------------
def cmd_launch(argv: list[str]) -> int:
    parser = CommandParser(
        prog="plait launch",
        description="Run SCRIPT as NPROC local ranks with RANK/WORLD_SIZE/MASTER_* set; "
                    "if one rank fails, the others are stopped and its exit code is returned.",
    )
    parser.add_argument("--nproc", type=int, required=True, help="number of processes")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as python -m MODULE does")
    parser.add_argument("script", nargs="?", help="a Python file (or, after -m MODULE, its first argument)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        raise PlaitError(f"--nproc must be at least 1, got {args.nproc}")
    from plait.runtime.launch import check_local_nproc, spawn

    check_local_nproc(args.nproc)
    rest = ([args.script] if args.script is not None else []) + args.args
    if rest[:1] == ["-m"] and args.module is None and len(rest) > 1:  # plait launch --nproc 2 -- -m MODULE
        args.module, rest = rest[1], rest[2:]
    if args.module is not None:
        command = [sys.executable, "-m", args.module, *rest]
    elif args.script is None:
        raise PlaitError("plait launch needs a script or -m MODULE", hint="e.g. plait launch --nproc 2 train.py")
    elif not Path(args.script).is_file():
        raise PlaitError(f"{args.script} is not a file", hint="give a Python file, or -m MODULE for a module")
    else:
        command = [sys.executable, args.script, *args.args]
    return spawn(command, args.nproc)


# -- plait ckpt ------------------------------------------------------------------------------------
def cmd_ckpt(argv: list[str]) -> int:
    parser = CommandParser(prog="plait ckpt", description="Look into and export plait checkpoints.")
    sub = parser.add_subparsers(dest="action", required=True)
    inspect = sub.add_parser("inspect", help="tensors, shapes, the layout that wrote it, its step")
    inspect.add_argument("path", help="a step-N directory, or a run's --out (its latest checkpoint)")
    exporter = sub.add_parser("export", help="the model's weights as one plain safetensors file, or (--hf) as a "
                                             "Hugging Face model directory")
    exporter.add_argument("path", help="a step-N directory, or a run's --out")
    target = exporter.add_mutually_exclusive_group(required=True)
    target.add_argument("--to", help="the .safetensors file to write")
    target.add_argument("--hf", metavar="OUT", help="the directory to write for transformers' from_pretrained(OUT) "
                                                    "(a --model hf:DIR run's checkpoint)")
    exporter.add_argument("--max-shard-size", help="--hf: cut the weights into safetensors files of at most this size, "
                                                   "with model.safetensors.index.json (default 50GB, transformers')")
    for p in (inspect, exporter):
        p.add_argument("--debug", action="store_true", help="show tracebacks")
    args = parser.parse_args(argv)
    from plait.train.checkpoint import read as checkpoint_read

    if args.action == "export" and not (args.hf or args.to):
        raise PlaitError(f"{'--hf' if args.hf is not None else '--to'} needs a name",
                         hint="--to FILE.safetensors, or --hf DIR")
    if args.action == "export" and args.to and args.max_shard_size is not None:
        raise PlaitError("--max-shard-size cuts an --hf export into files; --to writes one file",
                         hint="drop --max-shard-size, or export with --hf DIR")
    if args.action == "inspect":
        print(checkpoint_read.describe(args.path))
    elif args.hf:
        from plait.families.hf.export import DEFAULT_MAX_SHARD, export_hf
        from plait.train.config.check import parse_bytes

        size = parse_bytes(args.max_shard_size) if args.max_shard_size is not None else DEFAULT_MAX_SHARD
        out, count = export_hf(args.path, args.hf, size)
        print(f"wrote {count} tensors, config.json and the model's files to {out} "
              f"(load it with transformers.AutoModelForCausalLM.from_pretrained)")
    else:
        count = checkpoint_read.export(args.path, args.to)
        print(f"wrote {count} tensors to {args.to}")
    return 0
