"""The order in which a rank of an interleaved pipeline runs its chunks (Megatron's).

Torch-free and at the bottom, so that the schedule the runner executes
(plait/schedule/build.py) and the estimator that prices its peak of held activations
(plait/estimate/activations.py, memory.py) read one definition of it.

Micro-batches go in rounds: a rank runs a round on chunk 0, then the same round on chunk 1,
and so on. A round of pp keeps every rank busy, since by the time a rank has run the round
on a chunk, the round's first micro-batch has come back round the pipe for its next chunk;
a shorter round would leave it idle. So m is spread over ⌊m/pp⌋ rounds of at least pp, the
larger ones first (one round of m where m < pp): any m runs, m a multiple of pp as Megatron
runs it. torch's flexible interleaved schedule takes rounds of at least pp too, but only of
one size; Llama 3's paper (section 3.3.2) names "m a multiple of pp" as the usual schedule's
constraint on the batch.
"""

from __future__ import annotations

import functools


def round_sizes(pp: int, m: int) -> list[int]:
    """How many micro-batches each round holds, in order: ⌊m/pp⌋ rounds (at least one) that
    differ by at most one, the larger first."""
    rounds = max(1, m // pp)
    size, larger = divmod(m, rounds)
    return [size + (i < larger) for i in range(rounds)]


def warmup(pp: int, m: int, v: int, rank: int) -> int:
    """Chunk-forwards `rank` runs before its first backward (Megatron's count, for its largest
    round N): enough to fill every later chunk of a round ((v-1)·N), plus two per downstream
    rank (the forward and the backward that must cross it before this rank's first backward
    arrives); never more than the m·v there are."""
    return min((pp - rank - 1) * 2 + (v - 1) * max(round_sizes(pp, m)), m * v)


def rank_order(pp: int, m: int, v: int, rank: int) -> list[tuple[str, int, int]]:
    """("F" or "B", micro-batch, chunk) in the order `rank` runs them: its warm-up forwards,
    then one forward and one backward in turn, then the backwards left. The k-th forward runs
    the k-th (micro-batch, chunk) of the rounds in turn; the k-th backward the same, chunks
    reversed."""
    units, start = [], 0
    for size in round_sizes(pp, m):
        units += [(start + offset, chunk) for chunk in range(v) for offset in range(size)]
        start += size
    first = warmup(pp, m, v, rank)

    def step(kind: str, k: int) -> tuple[str, int, int]:
        micro_batch, chunk = units[k]
        return kind, micro_batch, (v - 1 - chunk) if kind == "B" else chunk

    order = [step("F", k) for k in range(first)]
    for i in range(len(units) - first):
        order += [step("F", first + i), step("B", i)]
    return order + [step("B", k) for k in range(len(units) - first, len(units))]


State = tuple[tuple[int, ...], tuple[int, ...]]  # (chunk-forwards held per chunk, 1 per chunk whose backward began)


@functools.lru_cache(maxsize=4096)
def held_frontier(pp: int, m: int, v: int, rank: int) -> tuple[State, ...]:
    """What `rank` holds as it runs its order, each state no other covers: how many forwards of
    each chunk it holds, and which chunks' first backward has run (a backward's state is taken
    before it frees its chunk).

    The estimator prices a rank's peak as the most, over its order, of held chunk-forwards
    times each chunk's bytes, with or without the gradients of the chunks begun
    (estimate/activations.py, memory.py). Every weight is at least 0, so a state that another
    is at least as large as in every count never sets the peak: the few left stand for the
    m·v·2 steps, and a planner that prices thousands of layouts walks each order once."""
    held, begun = [0] * v, [0] * v
    states: set[State] = set()
    for kind, _, chunk in rank_order(pp, m, v, rank):
        if kind == "F":
            held[chunk] += 1
            states.add((tuple(held), tuple(begun)))
        else:
            begun[chunk] = 1
            states.add((tuple(held), tuple(begun)))
            held[chunk] -= 1
    return tuple(_uncovered(states))


def _uncovered(states: set[State]) -> list[State]:
    """The states no other state is at least as large as in every count."""
    flat = sorted((held + begun for held, begun in states), key=sum, reverse=True)
    kept: list[tuple[int, ...]] = []
    for state in flat:
        if not any(all(a >= b for a, b in zip(other, state)) for other in kept):
            kept.append(state)
    half = len(flat[0]) // 2 if flat else 0
    return [(state[:half], state[half:]) for state in kept]
