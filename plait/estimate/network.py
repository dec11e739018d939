"""The network model: how long a collective or a message takes on the links a group rides.

A ring collective on n ranks takes steps·α + wire_bytes/bandwidth, where steps is 2(n-1)
for all-reduce, n-1 for all-gather and reduce-scatter, 1 for a send; α and the bandwidth are
the intra-node link's if the group fits in one node (ranks are numbered tp fastest, then cp,
then dp, then pp; a calibrated hardware file gives them per group size). A group that spans
nodes is priced as NCCL's tuning model prices it: the network's α only on the steps that
cross nodes, its bytes on the NICs of its ranks in each node (k ranks a node: k times a
GPU's share of the network, up to the node's link), an all-reduce's double binary tree when
faster; an all-to-all or a send on one NIC.

Pure arithmetic on a Hardware record: time.py and the planner price every transfer here.
"""

from __future__ import annotations

from plait.estimate.hardware import Hardware
from plait.estimate.layout import Workload
from plait.estimate.traffic import ring_bytes

ASSUMPTION = (
    "ring collective time = steps·latency + wire bytes / link bandwidth; a group uses the "
    "intra-node link when it fits in one node (ranks numbered tp fastest, then cp, then dp, then pp); "
    "across nodes the network's latency only on the steps that cross, the bytes on the NICs of the "
    "group's k ranks a node (k x inter_node_gb_s, up to the node's link); all-to-all and sends on one NIC; "
    "where the calibration measured the ranks' lag (a CPU: hardware.lags), each tp, cp and ep collective adds "
    "it after its share of the micro-batch's compute")


def collective_s(op: str, payload: float, n: int, hw: Hardware, inter: int | bool, count: float = 1) -> float:
    """Time of `count` collectives on n ranks moving `payload` bytes in total, as NCCL's own
    tuning model prices them (src/graph/tuning.cc): a ring pays the network's latency only on
    the steps that cross nodes (2(N-1) of an all-reduce's 2(n-1) on N nodes, N-1 of a gather's
    or scatter's) and the link's on the rest; an all-reduce may instead take the double
    binary tree, 2·((ranks per node - 1)·intra + ⌊log2 N⌋·inter) latency with 2S through each
    link at 0.9 of its bandwidth, whichever is faster (NCCL picks so). A cross-node ring's
    steps inside a node take the preset's intra-node latency, not a calibrated group's.
    `inter` is 0 (or False) for a group inside one node, else how many of its ranks share
    each node (True: one; `inter_node` gives it per axis).

    Across nodes a ring runs one channel per NIC, each at that NIC's bandwidth (tuning.cc:
    busBw = nChannels · bwInter), and only one hop a node crosses the network; so a group
    with k ranks in each node moves its bytes on those k ranks' NICs together, k times one
    rank's share of the node's network, up to the node's own links (`Hardware.ring_bandwidth`).
    A point-to-point message or an all-to-all's crosses on the sender's own NIC."""
    if n <= 1 or payload <= 0:
        return 0.0
    bandwidth = ring_link_bandwidth(n, hw, inter, op) if op in RINGS else hw.link(n, bool(inter))[1]
    ring = count * ring_latency_s(op, n, hw, inter) + ring_bytes(op, payload, n) / bandwidth
    if op != "all_reduce" or not inter:
        return ring
    per_node = ranks_a_node(n, inter)
    depth = (-(-n // per_node)).bit_length() - 1  # NCCL's log2i of the node count: the floor
    hops = (per_node - 1) * hw.latency(False) + depth * hw.link(n, True)[0]
    tree = count * 2 * hops + 2 * payload / (TREE_BANDWIDTH * bandwidth)
    return min(ring, tree)


RINGS = ("all_reduce", "all_gather", "reduce_scatter")


def ranks_a_node(n: int, inter: int | bool) -> int:
    """How many of a cross-node group's n ranks share each node (`inter`: True for one)."""
    return max(1, min(n, int(inter)))


def ring_link_bandwidth(n: int, hw: Hardware, inter: int | bool, op: str = "all_reduce") -> float:
    """Bytes/s through each rank of a ring on n ranks: the node's link (calibrated per group
    size where measured, and per op where an op was measured apart: Hardware.op_bandwidth)
    inside a node, its ranks' NICs across nodes (Hardware.ring_bandwidth)."""
    if inter:
        return hw.ring_bandwidth(ranks_a_node(n, inter))
    return hw.op_bandwidth(op, n) or hw.link(n, False)[1]


def ring_latency_s(op: str, n: int, hw: Hardware, inter: int | bool) -> float:
    """One collective's latency on n ranks: a step's latency for each of its steps, the
    network's only on the steps that cross nodes when a ring spans them (collective_s)."""
    steps = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1, "all_to_all": n - 1}.get(op, 1)
    latency = hw.link(n, bool(inter))[0]
    if not inter or op not in RINGS:
        return steps * latency
    nodes = -(-n // ranks_a_node(n, inter))
    crossings = min(steps, 2 * (nodes - 1) if op == "all_reduce" else nodes - 1)
    return (steps - crossings) * hw.latency(False) + crossings * latency


TREE_BANDWIDTH = 0.9  # NCCL's tree all-reduce: each rank's link at 0.9 of the ring's bus bandwidth, 2S through it


def inter_node(layout: Workload, gpus_per_node: int) -> dict[str, int]:
    """For each axis's group (and the whole world): 0 when its ranks share one node, else how
    many of them share each node, with ranks numbered tp fastest, then cp, dp, pp."""
    t, c = layout.tp, layout.cp
    groups = {"tp": (1, t), "cp": (t, c), "dp": (t * c, layout.dp), "ep": (t * c, layout.ep),
              "dp_shard": (t, layout.zero_ranks), "dp_replicate": (t * layout.zero_ranks, layout.replicas),
              "pp": (t * c * layout.dp, layout.pp), "world": (1, layout.world)}
    return {axis: _ranks_per_node(stride, size, gpus_per_node) for axis, (stride, size) in groups.items()}


def _ranks_per_node(stride: int, size: int, gpus_per_node: int) -> int:
    """0 if a group of `size` ranks `stride` apart fits in one node (or is one rank), else its
    ranks per node."""
    if size <= 1 or stride * size <= gpus_per_node:
        return 0
    return max(1, min(size, gpus_per_node // stride))


def collectives_s(counts: dict[str, int], wire: dict[str, float], t: int, hw: Hardware, inter: int) -> float:
    """Seconds of `counts` ring collectives over t ranks moving `wire` bytes a rank (by op):
    each ring step's latency, and each op's bytes over its link's bandwidth; across nodes,
    priced as collective_s prices a ring (the network's latency where a step crosses, the
    bytes on the group's NICs)."""
    latency = sum(count * ring_latency_s(op, t, hw, inter) for op, count in counts.items())
    return latency + sum(moved / ring_link_bandwidth(t, hw, inter, op) for op, moved in wire.items())
