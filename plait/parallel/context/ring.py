"""Ring attention: each cp rank holds a slice of the sequence; K and V travel round the ring.

Forward: rank r starts with its own K/V block. At each of the cp steps it posts the send of
the block it holds to rank r+1 and the receive of the next one from rank r−1, attends its
queries to the block it holds (this compute hides the transfer), then waits. Each step's
partial result is merged into the running one by their log-sum-exp (the online softmax), so
the output is exactly softmax(q·kᵀ)·v over the whole sequence. It saves q, k, v (its own
slices), the output and the log-sum-exp: O(seq / cp) memory per rank, never the whole K/V.

Backward: the ring again. K/V travel as in forward, and beside them the gradient
accumulators for that block (dK, dV in fp32): each rank adds what its queries contribute and
passes them on; after cp steps they reach the block's owner. With the final output O and
log-sum-exp L the gradient of one block is exact on its own (P = exp(q·kᵀ·scale − L),
D = rowsum(dO·O)), which is what lets blocks be differentiated one at a time.

Causal attention uses the head-tail split (plait.parallel.context.chunks): a query chunk
attends to an earlier key chunk whole, to its own chunk under the causal mask, and to a later
one not at all, so each step costs at most two small attention calls per query chunk. Each
call is, on a CPU, torch's flash-attention kernel and its backward (they return and take the
log-sum-exp the merge needs); on other devices the plain matmul/softmax ops, exact but
unfused (torch's CUDA kernels that return the log-sum-exp pad it in their own layouts, not
used yet).
Grouped K/V heads (GQA) travel unexpanded; they are expanded per call and their gradients
summed back, so the ring moves n_kv_heads, not n_heads. K and V travel as one message, packed
end to end (`pack_pair`), so V's heads may be narrower than K's (multi-head latent attention:
DeepSeek's), which torch's CPU kernel does not take: such blocks run the plain ops.

`ring_attention(q, k, v, axis, causal)`: q (batch, heads, local, head_dim); k, v (batch,
kv_heads, local, head_dim); the local tokens in head-tail order. Every transfer goes through
plait.runtime.comm, so the ledger shows the cp axis's sends.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from plait.parallel.context.chunks import chunk_ids
from plait.parallel.packed import block_causal
from plait.runtime import comm
from plait.runtime.comm import Axis


PLAIN_OPS = False  # True: the plain ops on a CPU too (what other devices run), for the tests
_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def block_calls(query_chunk: int, owner: int, cp: int, causal: bool) -> list[tuple[list[int], bool]]:
    """The attention calls a query chunk makes against `owner`'s K/V block: (the block's
    halves it reads, whether under the causal mask), at most two. Chunk numbers are global."""
    if not causal:
        return [([0, 1], False)]
    whole, masked = [], []
    for half, key_chunk in enumerate(chunk_ids(owner, cp)):
        if key_chunk < query_chunk:
            whole.append(half)
        elif key_chunk == query_chunk:
            masked.append(half)
    return [(halves, is_masked) for halves, is_masked in ((whole, False), (masked, True)) if halves]


def _keys(block: torch.Tensor, halves: list[int]) -> torch.Tensor:
    """The halves of a (…, local, d) block along the sequence, as one tensor (a view when whole)."""
    if halves == [0, 1]:
        return block
    return block.chunk(2, dim=-2)[halves[0]]


def _expand(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.repeat_interleave(group, dim=1) if group > 1 else x


def fused(k: torch.Tensor, v: torch.Tensor, mask: Any = None) -> bool:
    """Whether a block of these K and V runs torch's fused CPU flash kernels (else the plain
    ops; the tests run both). A mask other than causal (`mask`: a block's allowed keys, or
    anything not None saying some block may have one: packed documents, a sliding window)
    takes the plain ops, since the kernel knows only causal; so do V heads narrower than K's,
    which it does not take."""
    return k.device.type == "cpu" and not PLAIN_OPS and mask is None and k.shape[-1] == v.shape[-1]


def expansion(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: bool = False) -> int:
    """How many times each K/V head is repeated before a block's attention: never on a CPU,
    whose flash kernel takes grouped heads as they are, unless some block runs the plain ops
    under a mask (`masks`); q's heads per K/V head elsewhere."""
    return 1 if fused(k, v, masks or None) else q.shape[1] // k.shape[1]


def pack_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two tensors end to end in one flat message (K and V, or their gradients), whatever
    their shapes: one transfer a ring step."""
    return torch.cat([a.reshape(-1), b.reshape(-1)])


def unpack_pair(flat: torch.Tensor, a_shape: torch.Size, b_shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_pair`'s two tensors again, as views of `flat`."""
    cut = a_shape.numel()
    return flat[:cut].view(a_shape), flat[cut:].view(b_shape)


def allowed_keys(documents: torch.Tensor | None, window: int | None, query_chunk: int, owner: int,
                 halves: list[int], cp: int, chunk: int, masked: bool, device: torch.device) -> torch.Tensor | None:
    """(batch or 1, 1, chunk, keys): which of `owner`'s keys (its `halves`) each query of
    `query_chunk` may see, by packed documents' numbers (batch, whole seq) and a sliding
    window; None where the block needs no mask but the causal one `masked` gives."""
    key_chunks = [chunk_ids(owner, cp)[h] for h in halves]
    allowed = within_window(window, query_chunk, key_chunks, chunk, masked, device)
    if documents is not None:
        mine = documents[:, query_chunk * chunk:(query_chunk + 1) * chunk]
        theirs = torch.cat([documents[:, c * chunk:(c + 1) * chunk] for c in key_chunks], dim=1)
        same_document = block_causal(mine, theirs, masked)
        allowed = same_document if allowed is None else same_document & allowed
    return allowed


def within_window(window: int | None, query_chunk: int, key_chunks: list[int], chunk: int, masked: bool,
                  device: torch.device) -> torch.Tensor | None:
    """(1, 1, chunk, keys): the keys a query may see through a sliding window of `window`
    positions (a key at most window − 1 before it, transformers' rule), and under the causal
    diagonal (`masked`) none after it. None where every key before each query is within its
    window: the block needs only the causal mask, and keeps the fused kernel."""
    if window is None:
        return None
    queries = query_chunk * chunk + torch.arange(chunk, device=device)
    keys = torch.cat([c * chunk + torch.arange(chunk, device=device) for c in key_chunks])
    behind = queries.unsqueeze(-1) - keys.unsqueeze(0)  # how far each key lies before each query
    if bool((behind < window).all()):
        return None
    near = behind < window
    return (near & (behind >= 0) if masked else near)[None, None]


def wide(dtype: torch.dtype) -> torch.dtype:
    """What the softmax, the merge and the gradient accumulators run in: fp32, or fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, masked: bool,
            allowed: torch.Tensor | None = None) -> torch.Tensor:
    """q·kᵀ·scale in fp32 (at least), the upper triangle at −inf for the causal diagonal block,
    or −inf wherever `allowed` (documents, the diagonal included) says no."""
    s = torch.matmul(q, k.transpose(-1, -2)).to(wide(q.dtype)) * scale
    if allowed is not None:
        return s.masked_fill(~allowed, float("-inf"))
    if masked:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, masked: bool,
           allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: (softmax(q·kᵀ·scale)·v in fp32, its log-sum-exp per query). On a CPU, torch's
    flash kernel, which returns the log-sum-exp the merge needs (10× the plain ops' speed);
    elsewhere, and under documents' masks (`allowed`), the plain ops. A query that may see no
    key of the block gets 0 and a log-sum-exp of −inf: the merge gives it no weight."""
    if fused(k, v, allowed):
        out, lse = _CPU_FLASH(q, k, v, 0.0, masked, scale=scale)
        return out.to(wide(q.dtype)), lse.to(wide(q.dtype))
    s = _scores(q, k, scale, masked, allowed)
    lse = torch.logsumexp(s, dim=-1)
    finite = lse.masked_fill(lse == float("-inf"), 0.0)
    out = torch.matmul(torch.exp(s - finite.unsqueeze(-1)).to(v.dtype), v).to(s.dtype)
    return out, lse


def attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, delta: torch.Tensor | None, scale: float, masked: bool,
                    allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """One block's exact (dq, dk, dv) in fp32, from the final output and log-sum-exp (so
    rowsum(dO·O) = `delta` is the whole row's). On a CPU, torch's flash backward kernel."""
    if fused(k, v, allowed):
        grads = _CPU_FLASH_BACKWARD(dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, 0.0, masked, scale=scale)
        return tuple(g.to(dout.dtype) for g in grads)
    q, k, v = q.to(dout.dtype), k.to(dout.dtype), v.to(dout.dtype)
    p = torch.exp(_scores(q, k, scale, masked, allowed) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta.unsqueeze(-1))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, dv


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax results over disjoint keys as one, weighted by their log-sum-exp."""
    if out is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    finite = new.masked_fill(new == float("-inf"), 0.0)  # no key seen yet by either: weights 0, not nan
    return (out * torch.exp(lse - finite).unsqueeze(-1) + block_out * torch.exp(block_lse - finite).unsqueeze(-1),
            new)


class _Pass:
    """One step's transfer round the ring: send what this rank holds to the next rank,
    receive the next block from the previous one (one batched pair: plait.runtime.comm.
    send_recv); `wait` returns the received block."""

    def __init__(self, tensor: torch.Tensor, axis: Axis):
        self.received = torch.empty_like(tensor)
        nxt, prev = (axis.rank + 1) % axis.size, (axis.rank - 1) % axis.size
        self.handle = comm.send_recv(tensor, self.received, axis, nxt, prev)

    def wait(self) -> torch.Tensor:
        self.handle.wait()
        return self.received


Send = Callable[[torch.Tensor], Any]  # starts a tensor's trip to the next rank; `.wait()` gives the one arriving


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, rank: int, send: Send, causal: bool,
                 scale: float, documents: torch.Tensor | None,
                 window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's forward round the ring: (output, log-sum-exp), in the wide dtype."""
    group = expansion(q, k, v, documents is not None or window is not None)
    queries, query_chunks, chunk = q.chunk(2, dim=2), chunk_ids(rank, cp), q.shape[2] // 2
    outs: list[Any] = [None, None]
    lses: list[Any] = [None, None]
    block = pack_pair(k, v)
    for step in range(cp):
        transfer = send(block) if step < cp - 1 else None
        owner = (rank - step) % cp
        keys, values = (_expand(t, group) for t in unpack_pair(block, k.shape, v.shape))
        for i, query in enumerate(queries):
            for halves, masked in block_calls(query_chunks[i], owner, cp, causal):
                allowed = allowed_keys(documents, window, query_chunks[i], owner, halves, cp, chunk, masked,
                                       q.device)
                if allowed is not None and not bool(allowed.any()):
                    continue  # no query here shares a document with those keys
                o, s = attend(query, _keys(keys, halves), _keys(values, halves), scale, masked, allowed)
                outs[i], lses[i] = merge(outs[i], lses[i], o, s)
        if transfer is not None:
            block = transfer.wait()
    # Written sequence-major, as SDPA writes its output after plait's RoPE: the model's
    # (batch, seq, h) view of it for o_proj is then a view, not a copy kept beside this one.
    return torch.cat([out.transpose(1, 2) for out in outs], dim=1).transpose(1, 2), torch.cat(lses, dim=2)


def ring_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  dout: torch.Tensor, cp: int, rank: int, send: Send, causal: bool, scale: float,
                  documents: torch.Tensor | None,
                  window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rank's backward round the ring: dq, and dK, dV of its own block (wide dtype)."""
    masks = documents is not None or window is not None
    group, chunk = expansion(q, k, v, masks), q.shape[2] // 2
    dout = dout.to(out.dtype)
    # rowsum(dO·O) per query: the plain ops' backward needs it; the CPU kernel computes its own.
    deltas = (None, None) if fused(k, v, masks or None) else (dout * out).sum(-1).chunk(2, dim=2)
    dq = torch.zeros(q.shape, dtype=out.dtype, device=q.device)  # q's head size, which V's (and out's) may not be
    query_chunks = chunk_ids(rank, cp)
    parts = list(zip(q.chunk(2, dim=2), dout.chunk(2, dim=2), out.chunk(2, dim=2), lse.chunk(2, dim=2),
                     deltas, dq.chunk(2, dim=2)))
    block, returning = pack_pair(k, v), None
    for step in range(cp):
        transfer = send(block) if step < cp - 1 else None
        owner = (rank - step) % cp
        keys, values = (_expand(t, group) for t in unpack_pair(block, k.shape, v.shape))
        grads = [torch.zeros(t.shape, dtype=out.dtype, device=q.device) for t in (keys, values)]  # dK, dV, expanded
        for i, (query, d_out, o, l, d, d_q) in enumerate(parts):
            for halves, masked in block_calls(query_chunks[i], owner, cp, causal):
                allowed = allowed_keys(documents, window, query_chunks[i], owner, halves, cp, chunk, masked,
                                       q.device)
                if allowed is not None and not bool(allowed.any()):
                    continue
                gq, gk, gv = attend_backward(query, _keys(keys, halves), _keys(values, halves), d_out, o, l, d,
                                             scale, masked, allowed)
                d_q += gq
                _keys(grads[0], halves).add_(gk)
                _keys(grads[1], halves).add_(gv)
        if group > 1:  # the expanded heads' gradients, summed back onto their K/V head
            grads = [g.unflatten(1, (-1, group)).sum(2) for g in grads]
        travelling = pack_pair(*grads)
        if returning is not None:
            travelling += returning.wait()  # what the ranks before added to this same block
        returning = send(travelling)  # on to the next rank; after cp passes, home
        if transfer is not None:
            block = transfer.wait()
    dk, dv = unpack_pair(returning.wait(), k.shape, v.shape)
    return dq, dk, dv


class RingAttention(torch.autograd.Function):
    """Forward: attention over the whole sequence, K/V passed round the cp ring.
    Backward: the ring again, dK/dV travelling with their block back to its owner."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: Axis, causal: bool,
                scale: float, documents: torch.Tensor | None, window: int | None) -> torch.Tensor:
        out, lse = ring_forward(q, k, v, axis.size, axis.rank, lambda t: _Pass(t, axis), causal, scale, documents,
                                window)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.axis, ctx.causal, ctx.scale, ctx.documents, ctx.window = axis, causal, scale, documents, window
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        axis = ctx.axis
        dq, dk, dv = ring_backward(q, k, v, out, lse, dout, axis.size, axis.rank, lambda t: _Pass(t, axis),
                                   ctx.causal, ctx.scale, ctx.documents, ctx.window)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: Axis, causal: bool = True,
                   scale: float | None = None, documents: torch.Tensor | None = None,
                   window: int | None = None) -> torch.Tensor:
    """Attention of this rank's queries to every rank's keys (see the module docstring).
    `documents` (batch, whole seq): packed documents' numbers, the same on every cp rank.
    `window`: a sliding window, in positions (a key at most window − 1 before its query)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if (documents is not None or window is not None) and not causal:
        raise ValueError("packed documents' masks and sliding windows are causal")
    return RingAttention.apply(q, k, v, axis, causal, scale, documents, window)
