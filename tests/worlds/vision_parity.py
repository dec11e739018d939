"""A data-parallel world of CNNs with BatchNorm: SyncBN against one process, buffers as torch DDP.

Every rank trains tiny networks several ways on the same global batches and reports, step by
step, losses, parameters and running statistics:
  - one process with the whole global batch in one micro-batch (plain torch BatchNorm),
    computed on every rank: the reference;
  - plait DDP with --sync-bn (plait's SyncBatchNorm), each rank its contiguous share;
  - the same under ZeRO-3 with recomputation and accumulation (two micro-batches per rank,
    against one process accumulating the same global micro-batches);
  - plait DDP without SyncBN, and torch's DDP (broadcast_buffers=True) on the same split;
  - a user CNN plait has never seen, through the public API with sync_bn=True;
and the ledger's bytes for one SyncBN forward and backward.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

import plait
from plait.models.resnet.model import build_resnet
from plait.models.resnet.config import ResNetConfig
from plait.parallel.data.syncbn import SyncBatchNorm
from tests.worldlib import save_report

STEPS, SEED, GLOBAL = 3, 7, 8
TINY = ResNetConfig("basic", (1, 1), width=4, in_channels=1, num_classes=5)
torch.set_num_threads(1)


def batches() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED)
    images = torch.randn(STEPS, GLOBAL, 1, 8, 8, generator=generator) * 2 + 1
    return images, torch.randint(0, 5, (STEPS, GLOBAL), generator=generator)


def stats_of(model: nn.Module) -> dict[str, list[float]]:
    """Parameters and running statistics (the counter too), by name, as plain lists."""
    state = {n: p for n, p in model.named_parameters()}
    state.update({n: b for n, b in model.named_buffers() if "running" in n or "num_batches" in n})
    return {n: t.detach().double().flatten().tolist() for n, t in state.items()}


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, size: int, micro: int = 0,
          no_sync=plait.no_sync, order: list[int] | None = None) -> dict:
    """STEPS steps on this rank's contiguous share of each global batch (its samples first put
    in `order`), cut in micro-batches of `micro` (0: one); the loss is the mean over ranks.
    Reports every step."""
    images, labels = batches()
    if order is not None:
        images, labels = images[:, order], labels[:, order]
    out: dict = {"losses": [], "states": []}
    for step in range(STEPS):
        x, y = images[step].chunk(size)[rank], labels[step].chunk(size)[rank]
        chunks = list(zip(x.split(micro or len(x)), y.split(micro or len(y))))
        total = 0.0
        for k, (xs, ys) in enumerate(chunks):
            with contextlib.nullcontext() if k == len(chunks) - 1 else no_sync(model):
                loss = F.cross_entropy(model(xs), ys)
                (loss / len(chunks)).backward()
            total += loss.item() / len(chunks)
        opt.step()
        opt.zero_grad()
        mean = torch.tensor([total])
        if size > 1:
            torch.distributed.all_reduce(mean)
        out["losses"].append(mean.item() / size)
        with plait.full_parameters(model) as whole:
            out["states"].append(stats_of(whole))
    return out


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return plait.build_optimizer(model, torch.optim.AdamW, lr=1e-2)


class UserCNN(nn.Module):
    """A CNN plait has never seen: no adapter, BatchNorm1d and 2d, a Sequential body. (No
    bias before a BatchNorm: its gradient is zero but for rounding, which Adam would amplify
    into updates of ±lr that no two layouts share.)"""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
                                  nn.Conv2d(6, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.fc = nn.Linear(8 * 16, 16, bias=False)
        self.norm = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.norm(self.fc(self.body(x).flatten(1)))))


def user_cnn() -> UserCNN:
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        return UserCNN()


def ledger_checks(mesh) -> dict:
    """One SyncBN layer of C channels: its forward and its backward, as the ledger saw them."""
    layer = SyncBatchNorm(5, mesh.axis("dp"))
    x = torch.randn(4, 5, 3, 3, requires_grad=True)
    before = mesh.ledger.snapshot()
    out = layer(x)
    forward = mesh.ledger.since(before)
    middle = mesh.ledger.snapshot()
    out.pow(2).sum().backward()
    return {"forward": forward, "backward": mesh.ledger.since(middle)}


def main() -> None:
    mesh = plait.init_mesh()
    n, r = mesh.size("dp"), mesh.rank("dp")
    report: dict = {"world": n}

    ref = build_resnet(TINY, SEED)
    report["single"] = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), 0, 1)
    # Accumulating global micro-batches: under SyncBN the k-th global micro-batch is every
    # rank's k-th, normalised as one (with 2 ranks of 2 micro-batches of 2: samples 0 1 4 5,
    # then 2 3 6 7).
    ref, half = build_resnet(TINY, SEED), GLOBAL // n // 2
    order = [r * GLOBAL // n + k * half + i for k in range(2) for r in range(n) for i in range(half)]
    report["single_accum"] = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), 0, 1, micro=GLOBAL // 2,
                                   order=order)

    model = plait.parallelize(build_resnet(TINY, SEED), mesh, plait.ParallelConfig(sync_bn=True))
    report["sync"] = train(model, adam(model), r, n)
    report["sync_layers"] = sum(isinstance(m, SyncBatchNorm) for m in model.modules())

    model = plait.parallelize(build_resnet(TINY, SEED), mesh.with_layout(zero=3),
                              plait.ParallelConfig(sync_bn=True, recompute="full"))
    report["sync_zero3"] = train(model, adam(model), r, n, micro=GLOBAL // n // 2)

    model = plait.parallelize(build_resnet(TINY, SEED), mesh, plait.ParallelConfig())
    report["plain"] = train(model, adam(model), r, n)
    native = nn.parallel.DistributedDataParallel(build_resnet(TINY, SEED), broadcast_buffers=True)
    report["torch"] = train(native, torch.optim.AdamW(native.parameters(), lr=1e-2), r, n,
                            no_sync=lambda m: m.no_sync())
    report["torch"]["states"] = [{k.removeprefix("module."): v for k, v in s.items()} for s in report["torch"]["states"]]

    ref = user_cnn()
    report["user_single"] = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), 0, 1)
    model = plait.parallelize(user_cnn(), mesh.with_layout(zero=2), plait.ParallelConfig(sync_bn=True))
    report["user_sync"] = train(model, adam(model), r, n)

    report["ledger"] = ledger_checks(mesh)
    try:
        plait.parallelize(nn.Linear(2, 2), mesh, plait.ParallelConfig(sync_bn=True))
    except plait.PlaitError as exc:
        report["no_bn_error"] = str(exc)
    save_report(report)
    mesh.close()


if __name__ == "__main__":
    main()
