"""plait checkpoints vs torch.distributed.checkpoint (DCP): save and load time, same state;
and with --training, what a save costs the training loop, synchronous vs in the background.

    python benchmarks/checkpoint.py                  # 2 ranks, the small GPT + AdamW state
    python benchmarks/checkpoint.py --nproc 2 4 --repeats 5 --no-write
    python benchmarks/checkpoint.py --training       # sync vs --async-save vs DCP's async_save

--training: each round trains the same model `--steps` steps four times in a row, with no save,
with plait's synchronous save, with plait's background save (`--async-save`: a thread copies
to host memory during the next forward/backward, the update waits for the copy, the write
runs beside training and the poll publishes at a later boundary) and with DCP's
`async_save` (its own gloo group, as its docs ask), saving every `--every` steps. A save's cost
to training is (that variant's time - the no-save time of the same round) / saves, including
the wait for the last write at the end; the table gives the median over `--repeats` rounds.

Each world trains one step (so AdamW has its state), then saves and loads the same model and
optimizer state alternately with plait and with DCP, `--repeats` times each, into a fresh
directory every time. plait's numbers include what makes its checkpoints safe: fsync of every
file, a sha256 per file written and verified on load, the atomic rename.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import disk_usage, finish, machine, new_parser, run_world, timed_on_all_ranks  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import plait
    from plait.models.gpt.config import get_preset
    from plait.models.gpt.model import build_gpt
    from plait.train.checkpoint import read as checkpoint_read, write as checkpoint
    from plait.runtime.env import prepare_host

    mesh = plait.init_mesh()
    prepare_host(mesh.size("world"))  # as plait train does: the ranks share the cores
    model = plait.parallelize(build_gpt(get_preset(args.model), 0), mesh)
    opt = plait.build_optimizer(model, torch.optim.AdamW, lr=1e-4)
    batch = torch.randint(0, 256, (2, 33))
    F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
    opt.step()
    world = mesh.axis("world")
    root = Path(tempfile.mkdtemp(prefix="plait-ckpt-bench-")) if mesh.is_main else None

    def timed(action) -> float:
        return timed_on_all_ranks(world, action)

    shared = [str(root) if root else ""]
    torch.distributed.broadcast_object_list(shared, src=0)
    base = Path(shared[0])
    times: dict[str, list[float]] = {"plait save": [], "plait load": [], "dcp save": [], "dcp load": []}
    sizes = {}
    for i in range(args.repeats):
        plait_dir, dcp_dir = base / f"plait-{i}", base / f"dcp-{i}"
        times["plait save"].append(timed(lambda: checkpoint.save(plait_dir, 1, model, opt, mesh, {})))
        times["plait load"].append(timed(lambda: checkpoint_read.load(plait_dir, model, opt, mesh)))
        model_sd, optim_sd = get_state_dict(model, opt)
        times["dcp save"].append(timed(lambda: dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(dcp_dir))))

        def dcp_load() -> None:
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=str(dcp_dir))
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

        times["dcp load"].append(timed(dcp_load))
        sizes = {"plait": disk_usage(plait_dir), "dcp": disk_usage(dcp_dir)}
    if mesh.is_main:
        Path(args.result).write_text(json.dumps({
            "n": mesh.size("dp"), "params": sum(p.numel() for p in model.parameters()),
            "median": {k: statistics.median(v) for k, v in times.items()}, "bytes": sizes}))
        shutil.rmtree(base, ignore_errors=True)
    mesh.close()



def training_worker(args: argparse.Namespace) -> None:
    """Rounds of four variants of the same training loop; rank 0 writes the medians."""
    import time

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import plait
    from plait.models.gpt.config import get_preset
    from plait.models.gpt.model import build_gpt
    from plait.runtime import comm
    from plait.runtime.env import prepare_host
    from plait.train.checkpoint import write as checkpoint

    if os.environ.get("WORLD_SIZE") == "1":  # DCP needs a process group even for one rank (plait does not)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=0,
                                world_size=1)
    mesh = plait.init_mesh()
    prepare_host(mesh.size("world"))
    model = plait.parallelize(build_gpt(get_preset(args.model), 0), mesh)
    opt = plait.build_optimizer(model, torch.optim.AdamW, lr=1e-4)
    gen = torch.Generator().manual_seed(mesh.global_rank)
    batch = torch.randint(0, 256, (args.micro_batch, args.seq_len + 1), generator=gen)
    world = mesh.axis("world")
    dcp_group = dist.new_group(backend="gloo")
    shared = [tempfile.mkdtemp(prefix="plait-async-bench-") if mesh.is_main else ""]
    dist.broadcast_object_list(shared, src=0)
    base = Path(shared[0])

    def step(saves: checkpoint.AsyncSaves) -> None:
        F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
        saves.before_update()  # as the trainer does: a background copy finishes before the weights change
        opt.step()
        opt.zero_grad()

    def run(variant: str, root: Path) -> float:
        saves, pending = checkpoint.AsyncSaves(), None
        comm.barrier(world)
        start = time.perf_counter()
        for i in range(args.steps):
            step(saves)
            due = (i + 1) % args.every == 0
            if variant == "plait sync" and due:
                checkpoint.save(root, i + 1, model, opt, mesh, {}, keep=2)
            elif variant == "plait async" and due:
                saves.save(root, i + 1, model, opt, mesh, {}, keep=2)
            elif variant == "dcp async" and due:
                if pending is not None:
                    pending.result()
                model_sd, optim_sd = get_state_dict(model, opt)
                pending = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root / f"{i + 1}"),
                                         process_group=dcp_group)
            # Every variant ends a step as plait train does: one small all-reduce (a preemption
            # signal, a background write still running), which publishes a finished async save.
            flags = torch.tensor([0, int(saves.writing())], dtype=torch.int32)
            comm.all_reduce(flags, world, op="max", purpose=comm.CONTROL)
            saves.poll(any_writing=bool(flags[1]))
        saves.finish()
        if pending is not None:
            pending.result()
        comm.barrier(world)
        return time.perf_counter() - start

    variants = ("none", "plait sync", "plait async", "dcp async")
    times: dict[str, list[float]] = {v: [] for v in variants}
    run("none", base / "warm-up")
    for r in range(args.repeats):
        for variant in variants:
            times[variant].append(run(variant, base / f"{variant.replace(' ', '-')}-{r}"))
    if mesh.is_main:
        saves = args.steps // args.every
        cost = {v: statistics.median((t - n) / saves for t, n in zip(times[v], times["none"])) for v in variants[1:]}
        Path(args.result).write_text(json.dumps({
            "n": mesh.size("dp"), "params": sum(p.numel() for p in model.parameters()), "saves": saves,
            "step_s": statistics.median(times["none"]) / args.steps, "cost": cost,
            "noise": statistics.stdev(times["none"]) / saves if len(times["none"]) > 1 else 0.0,
            "load": os.getloadavg()[0], "free_cores": (os.cpu_count() or 1) - mesh.size("world") * torch.get_num_threads()}))
        shutil.rmtree(base, ignore_errors=True)
    mesh.close()


def training_table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = _heading(
        "What a save costs training: synchronous vs --async-save vs DCP async_save",
        f"--training --model {args.model} --steps {args.steps} --every {args.every} --repeats {args.repeats}", args,
        f"data parallel, micro-batch {args.micro_batch} × {args.seq_len} tokens per rank; {rows[0]['saves']} saves "
        f"in {args.steps} steps per variant; median over {args.repeats} rounds of (variant - no-save) / saves", rows)
    lines += [
        "| processes (1 thread each) | cores left free | step s (no save) | noise s/save | sync save: cost s | "
        "async save: cost s | async / sync | DCP async_save: cost s | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        c = row["cost"]
        lines.append(f"| {row['n']} | {row['free_cores']} | {row['step_s']:.3f} | {row['noise']:.3f} | "
                     f"{c['plait sync']:.3f} | {c['plait async']:.3f} | {c['plait async'] / c['plait sync']:.2f} | "
                     f"{c['dcp async']:.3f} | {row['load']:.1f} |")
    ratios = ", ".join(f"{r['cost']['plait async'] / r['cost']['plait sync']:.2f} at {r['n']} rank(s)" for r in rows)
    met = all(r["cost"]["plait async"] < 0.1 * r["cost"]["plait sync"] for r in rows)
    lines += ["", f"Goal, a background save under 0.10 of a synchronous one: {'met' if met else 'not met'} ({ratios})."]
    lines += ["", "Noise: the standard deviation of the no-save variant's time over the rounds, per save; a cost "
              "below it is not told apart from zero."]
    lines += ["", "A cost is the training time a save adds, waits for the last background write included. The "
              "background write runs under SCHED_IDLE (only on cycles training leaves idle), but its work (the "
              "host copy, serialising, sha256) is CPU work: where the ranks fill every core it takes the same "
              "cycles from training as a synchronous save (and its memory traffic slows the steps beside it), and "
              "only a free core (or, on a GPU machine, the host CPUs the GPU leaves idle) hides it."]
    return "\n".join(lines)


def _heading(title: str, flags: str, args: argparse.Namespace, state: str, rows: list[dict]) -> list[str]:
    """A section's title, command, machine, date and state lines."""
    return [
        f"## {title}", "",
        f"- command: `python benchmarks/checkpoint.py {flags} --nproc {' '.join(map(str, args.nproc))}`",
        f"- machine: {machine()}, Gloo, local disk",
        f"- date: {datetime.date.today().isoformat()}",
        f"- state: `{args.model}` GPT ({rows[0]['params'] / 1e6:.2f} M params) with AdamW state, {state}", "",
    ]


def table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = _heading(
        "Checkpoints: plait vs torch.distributed.checkpoint", f"--model {args.model} --repeats {args.repeats}", args,
        "data parallel (replicated: plait writes each tensor once, the dp ranks sharing the tensors out); median of "
        f"{args.repeats} saves and loads each", rows)
    lines += [
        "| processes | plait save s | DCP save s | plait load s | DCP load s | plait bytes | DCP bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        m = row["median"]
        lines.append(f"| {row['n']} | {m['plait save']:.3f} | {m['dcp save']:.3f} | {m['plait load']:.3f} | "
                     f"{m['dcp load']:.3f} | {row['bytes']['plait']:,} | {row['bytes']['dcp']:,} |")
    lines += ["", "plait's save and load include fsync, sha256 of every file (computed on save, verified once between "
              "the ranks on load) and the atomic rename; DCP does none of the checksums."]
    return "\n".join(lines)


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2])
    parser.add_argument("--model", default="small")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--training", action="store_true", help="what a save costs the training loop")
    parser.add_argument("--steps", type=int, default=14)  # the last save (step 12) has two steps to finish
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    forwarded = ["--model", args.model, "--repeats", str(args.repeats)]
    if args.training:
        forwarded += ["--training", "--steps", str(args.steps), "--every", str(args.every),
                      "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len)]
        one_thread = {"OMP_NUM_THREADS": "1"}  # one core per rank: fewer ranks than cores leave one to the writer
        finish("checkpoint-training", args, training_worker,
               lambda a: [run_world(__file__, n, forwarded, env=one_thread) for n in a.nproc], training_table)
        return
    finish("checkpoint", args, worker, lambda a: [run_world(__file__, n, forwarded) for n in a.nproc], table)

if __name__ == "__main__":
    main()
