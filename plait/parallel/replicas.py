"""--check-replicas N: the ranks that should hold equal values compare them as the run goes.

Hardware can flip a bit of a weight or of an optimizer state without a word (Llama 3's report
counts silent data corruption among its interruptions); a data-parallel run then trains on
with one replica apart, and every later checkpoint carries it. Every N steps, and before each
checkpoint (so that a saved checkpoint is a checked one), each rank hashes every piece it holds
(plait.parallel.pieces: the model's and the optimizer's tensors as blocks of logical tensors,
the one account of what a rank holds under any layout) with torch.hash_tensor, and the ranks
gather (block, hash) pairs: a block several ranks hold must hash alike on all of them. That
covers dp's replicas, --dp-shard's replica groups, tp's replicated norms and biases and pp's
tied embeddings alike, with one all-gather of two integers per piece.

A mismatch names the block and the ranks that differ from the others, and stops the run on
every rank (`ReplicaMismatch`, exit code EXIT_CORRUPT): plait's spawner restarts such a world
(--max-restarts) from the latest checkpoint, which the check before each save vouches for.
`--inject bitflip:rank=R,step=S` flips one bit on rank R as step S begins, to rehearse it.
"""

from __future__ import annotations

import hashlib
from collections import Counter

import torch
from torch import nn

from plait.errors import EXIT_CORRUPT, PlaitError
from plait.parallel.pieces import Piece, local_pieces
from plait.runtime import comm
from plait.runtime.mesh import Mesh


class ReplicaMismatch(PlaitError):
    """Ranks that should hold equal values do not: silent data corruption, stopped."""

    exit_code = EXIT_CORRUPT


def _key(piece: Piece) -> int:
    """A block's identity as a signed 64-bit integer: its name, where it starts, its shape."""
    text = f"{piece.name}|{piece.offsets}|{tuple(piece.tensor.shape)}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


def _hash(tensor: torch.Tensor) -> int:
    """The tensor's bits folded into 64 (torch.hash_tensor: any one flipped bit changes it)."""
    return int(torch.hash_tensor(tensor.detach().contiguous()).view(torch.int64).item())


def check_replicas(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh, step: int) -> int:
    """Compare every block held by several ranks (collective); the number of blocks compared,
    or ReplicaMismatch naming the first that differs."""
    pieces = local_pieces(model, optimizer, mesh)
    keys = [_key(p) for p in pieces]
    names = dict(zip(keys, (p.name for p in pieces)))
    mine = torch.tensor([[key, _hash(p.tensor)] for key, p in zip(keys, pieces)] or [[0, 0]], dtype=torch.int64)
    world = mesh.axis("world")
    counts = torch.zeros(world.size, dtype=torch.int64, device=mesh.device)
    counts[world.rank] = len(pieces)
    comm.all_reduce(counts, world, purpose=comm.CONTROL)
    width = int(counts.max().item())
    padded = torch.zeros((width, 2), dtype=torch.int64)
    padded[:len(pieces)] = mine[:len(pieces)]
    gathered = torch.empty((world.size * width, 2), dtype=torch.int64, device=mesh.device)
    comm.all_gather(gathered, padded.to(mesh.device), world, purpose=comm.CONTROL)
    held: dict[int, list[tuple[int, int]]] = {}
    for rank, rows in enumerate(gathered.view(world.size, width, 2).cpu().tolist()):
        for key, value in rows[:int(counts[rank])]:
            held.setdefault(key, []).append((rank, value))
    shared = {key: copies for key, copies in held.items() if len(copies) > 1}
    for key, copies in sorted(shared.items()):
        values = Counter(value for _, value in copies)
        if len(values) > 1:
            usual = values.most_common(1)[0][0]
            apart = [rank for rank, value in copies if value != usual]
            agree = [rank for rank, value in copies if value == usual]
            name = names.get(key, "a block another rank holds")
            raise ReplicaMismatch(f"silent data corruption at step {step}: {name} differs on rank(s) "
                                  f"{', '.join(map(str, apart))} from its copies on rank(s) "
                                  f"{', '.join(map(str, agree))}; the run stops",
                                  hint="with --resume auto and --max-restarts, plait's spawner restarts from the "
                                       "latest checkpoint (checked before it was saved); a rank that keeps "
                                       "differing is a machine to replace")
    return len(shared)


def flip_bit(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh) -> str:
    """Flip one bit of this rank's first weight block, in place; the block's name."""
    piece = next(p for p in local_pieces(model, optimizer, mesh)
                 if p.name.startswith("model/") and not p.buffer and p.tensor.is_contiguous() and p.tensor.numel())
    flat = piece.tensor.detach().view(-1)  # a view: the flip lands in the weight itself
    bits = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    bits[0] ^= 1 << (8 * flat.element_size() - 10)  # a high bit of the mantissa (of the exponent in fp8)
    return piece.name
