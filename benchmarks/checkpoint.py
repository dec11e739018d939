"""plait checkpoints vs torch.distributed.checkpoint (DCP): save and load time, same state.

    python benchmarks/checkpoint.py                  # 2 ranks, the small GPT + AdamW state
    python benchmarks/checkpoint.py --nproc 2 4 --repeats 5 --no-write

Each world trains one step (so AdamW has its state), then saves and loads the same model and
optimizer state alternately with plait and with DCP, `--repeats` times each, into a fresh
directory every time. plait's numbers include what makes its checkpoints safe: fsync of every
file, a sha256 per file written and verified on load, the atomic rename.
"""

from __future__ import annotations

import argparse
import datetime
import json
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
    from plait.models.config import get_preset
    from plait.models.gpt import build_gpt
    from plait.train import checkpoint, checkpoint_read
    from plait.runtime.env import set_cpu_threads

    mesh = plait.init_mesh()
    set_cpu_threads(mesh.size("world"))  # as plait train does: the ranks share the cores
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



def table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "## Checkpoints: plait vs torch.distributed.checkpoint",
        "",
        f"- command: `python benchmarks/checkpoint.py --model {args.model} --repeats {args.repeats} "
        f"--nproc {' '.join(map(str, args.nproc))}`",
        f"- machine: {machine()}, Gloo, local disk",
        f"- date: {datetime.date.today().isoformat()}",
        f"- state: `{args.model}` GPT ({rows[0]['params'] / 1e6:.2f} M params) with AdamW state, data parallel "
        f"(replicated: plait writes each tensor once, from dp rank 0); median of {args.repeats} saves and loads each",
        "",
        "| processes | plait save s | DCP save s | plait load s | DCP load s | plait bytes | DCP bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        m = row["median"]
        lines.append(f"| {row['n']} | {m['plait save']:.3f} | {m['dcp save']:.3f} | {m['plait load']:.3f} | "
                     f"{m['dcp load']:.3f} | {row['bytes']['plait']:,} | {row['bytes']['dcp']:,} |")
    lines += ["", "plait's save and load include fsync, sha256 of every file (computed on save, verified once between the ranks on "
              "load) and the atomic rename; DCP does none of the checksums."]
    return "\n".join(lines)


def main() -> None:
    parser = new_parser(__doc__)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2])
    parser.add_argument("--model", default="small")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    forwarded = ["--model", args.model, "--repeats", str(args.repeats)]
    finish("checkpoint", args, worker, lambda a: [run_world(__file__, n, forwarded) for n in a.nproc], table)

if __name__ == "__main__":
    main()
