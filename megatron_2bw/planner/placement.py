"""Where ranks sit, which communication groups cross server boundaries, and their bandwidth.

megatron-core numbers ranks in the order "tp-cp-ep-dp-pp" (`parallel_state.
initialize_model_parallel(order=...)`, default): tensor-parallel rank varies fastest, then
context-parallel, then data-parallel, then pipeline stage. With ep = 1:

    rank = tp_rank + TP * (cp_rank + CP * (dp_rank + DP * stage)),
    node = rank // devices_per_node

so tensor-parallel groups are consecutive ranks (inside a server when TP divides the
server size), context-parallel groups stride by TP, data-parallel groups by TP * CP, and
neighbouring stages are TP * CP * DP apart. Gradients are reduced over the DP x CP ranks
of one (tp_rank, stage) (`gradient_groups`; megatron-core's data-parallel group with
context parallelism). Whether a group crosses servers follows from this, not from a guess.

Expert parallelism (a mixture of experts) numbers the same ranks a second way, megatron-
core's expert grid in the same order with CP folded away: expert-tensor-parallel rank
(ETP = TP here) fastest, then the expert-parallel rank, then the expert-data-parallel rank
(DP x CP / EP of them), then the stage,

    rank = tp_rank + TP * (ep_rank + EP * (edp_rank + EDP * stage)),

so an expert-parallel group strides by TP over the ranks a stage's CP and DP ranks occupy
(inside a server when TP x EP fits in it and divides it), and the expert-data-parallel
group, which reduces expert gradients, strides by TP x EP.

Bandwidth of a group that crosses servers: each server's network is shared by the groups
that cross it at the same time (all-reduces: conservatively every group of that kind;
point-to-point: the lockstep replicas of one stage boundary).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .hardware import Hardware

Group = tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """The rank grid of one configuration on a cluster."""

    tp: int
    dp: int
    pp: int
    devices_per_node: int
    cp: int = 1
    ep: int = 1
    """Expert-parallel size (1: no expert grid); must divide cp x dp."""

    def rank(self, tp_rank: int, dp_rank: int, stage: int, cp_rank: int = 0) -> int:
        return tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * stage))

    def node(self, rank: int) -> int:
        return rank // self.devices_per_node

    def _replicas(self):
        """Every (cp_rank, dp_rank)."""
        return [(c, d) for d in range(self.dp) for c in range(self.cp)]

    def tp_groups(self) -> list[Group]:
        return [tuple(self.rank(t, d, s, c) for t in range(self.tp))
                for s in range(self.pp) for c, d in self._replicas()]

    def cp_groups(self) -> list[Group]:
        """The ranks that split one sequence: one group per (tp_rank, dp_rank, stage)."""
        return [tuple(self.rank(t, d, s, c) for c in range(self.cp))
                for s in range(self.pp) for d in range(self.dp) for t in range(self.tp)]

    def dp_groups(self, stage: int | None = None) -> list[Group]:
        stages = range(self.pp) if stage is None else (stage,)
        return [tuple(self.rank(t, d, s, c) for d in range(self.dp))
                for s in stages for c in range(self.cp) for t in range(self.tp)]

    def gradient_groups(self, stage: int | None = None) -> list[Group]:
        """The DP x CP ranks holding the same weights (the data-parallel groups at cp = 1)."""
        stages = range(self.pp) if stage is None else (stage,)
        return [tuple(self.rank(t, d, s, c) for c, d in self._replicas())
                for s in stages for t in range(self.tp)]

    def boundary_pairs(self, stage: int) -> list[tuple[int, int]]:
        """(sender, receiver) of the activation from `stage` to `stage + 1`, one per
        (tp, cp, dp); from the last stage to stage 0 (the wrap-around between model chunks
        of an interleaved schedule) for `stage = pp - 1`."""
        nxt = (stage + 1) % self.pp
        return [(self.rank(t, d, stage, c), self.rank(t, d, nxt, c))
                for t in range(self.tp) for c, d in self._replicas()]

    def boundary_crosses(self, stage: int) -> bool:
        """Whether the transfers from `stage` to the next leave a server."""
        return any(self.node(a) != self.node(b) for a, b in self.boundary_pairs(stage))

    def embedding_groups(self) -> list[Group]:
        """First and last stage ranks that keep the tied word embedding equal (pp > 1)."""
        if self.pp == 1:
            return []
        return [(self.rank(t, d, 0, c), self.rank(t, d, self.pp - 1, c))
                for t in range(self.tp) for c, d in self._replicas()]

    def crosses(self, group: Group) -> bool:
        return len({self.node(r) for r in group}) > 1

    # ---- the expert grid (megatron-core's expert RankGenerator, ETP = TP)
    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the cp x dp ranks of a stage over EP."""
        return self.cp * self.dp // self.ep

    def expert_rank(self, tp_rank: int, ep_rank: int, edp_rank: int, stage: int) -> int:
        return tp_rank + self.tp * (ep_rank + self.ep * (edp_rank + self.edp * stage))

    def ep_groups(self) -> list[Group]:
        """The ranks one MoE layer's experts are spread over (all-to-all dispatch)."""
        return [tuple(self.expert_rank(t, e, x, s) for e in range(self.ep))
                for s in range(self.pp) for x in range(self.edp) for t in range(self.tp)]

    def tp_ep_groups(self) -> list[Group]:
        """Expert-tensor x expert-parallel ranks (the allgather dispatcher's group)."""
        return [tuple(self.expert_rank(t, e, x, s) for e in range(self.ep)
                      for t in range(self.tp))
                for s in range(self.pp) for x in range(self.edp)]

    def expert_gradient_groups(self, stage: int | None = None) -> list[Group]:
        """The ranks holding the same experts, over which their gradients are reduced."""
        stages = range(self.pp) if stage is None else (stage,)
        return [tuple(self.expert_rank(t, e, x, s) for x in range(self.edp))
                for s in stages for e in range(self.ep) for t in range(self.tp)]


def _sharing(layout: Layout, groups: list[Group]) -> Counter:
    """Per node: how many of `groups` cross servers and touch that node."""
    count: Counter = Counter()
    for g in groups:
        if layout.crosses(g):
            for node in {layout.node(r) for r in g}:
                count[node] += 1
    return count


def collective_bandwidth(layout: Layout, group: Group, concurrent: list[Group],
                         hw: Hardware) -> float:
    """Bytes/s per link for a ring over `group` while `concurrent` groups run too.

    Inside one server: the intra-node bandwidth. Across servers: the ring's slowest hop
    is a server's network link, shared by the crossing groups touching that server.
    """
    if not layout.crosses(group):
        return hw.intra_bytes_per_s
    share = _sharing(layout, concurrent)
    busiest = max(share[layout.node(r)] for r in group)
    return hw.inter_bytes_per_s / max(busiest, 1)


def alltoall_bandwidth(layout: Layout, groups: list[Group], hw: Hardware) -> float:
    """Bytes/s at which an all-to-all over each of `groups`, all at once, moves one rank's
    buffer: time = alpha + buffer bytes / this.

    Each rank sends 1/n of its buffer to each of the n - 1 others: the share for ranks of
    its own server over NVLink ((same - 1) / n of the buffer at the intra-node
    bandwidth), the rest over its server's network, which carries the off-server shares of
    every rank of every group on that server at once; the slower of the two decides. A
    ring collective sends a server's data across once; an all-to-all across servers sends
    most of every rank's buffer, which is why expert parallelism across servers costs
    more than its bytes suggest.
    """
    node_out: Counter = Counter()
    intra = 0.0
    for g in groups:
        n = len(g)
        here = Counter(layout.node(r) for r in g)
        for r in g:
            same = here[layout.node(r)]
            intra = max(intra, (same - 1) / n)
            node_out[layout.node(r)] += (n - same) / n
    seconds_per_byte = max(intra / hw.intra_bytes_per_s,
                           max(node_out.values(), default=0.0) / hw.inter_bytes_per_s)
    return 1.0 / seconds_per_byte if seconds_per_byte > 0 else float("inf")


def p2p_bandwidth(layout: Layout, stage: int, hw: Hardware) -> float:
    """Bytes/s of one transfer across the boundary between `stage` and `stage + 1`.

    Across servers, a server's network is shared by the transfers of that boundary that
    leave it at the same moment: the tensor-parallel ranks and data-parallel replicas of
    a stage run the same schedule in lockstep, so they send together (each tensor-parallel
    rank its own full copy: megatron-core's p2p has no scatter-gather). Forward
    activations and backward gradients leave at different times (after F, after B) and
    use opposite directions of a full-duplex link, so they are not added up.
    """
    pairs = layout.boundary_pairs(stage)
    leaving: Counter = Counter(layout.node(a) for a, b in pairs if layout.node(a) != layout.node(b))
    arriving: Counter = Counter(layout.node(b) for a, b in pairs if layout.node(a) != layout.node(b))
    if not leaving:
        return hw.intra_bytes_per_s
    return hw.inter_bytes_per_s / max(max(leaving.values()), max(arriving.values()))


def ring_allreduce_s(num_bytes: float, n: int, bytes_per_s: float,
                     latency_s: float = 0.0) -> float:
    """Ring all-reduce time: a fixed `latency_s` per collective (alpha) + each rank
    sending and receiving 2 (n - 1) / n * bytes at the bus bandwidth.

    Source: Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
    workstations", JPDC 2009; NCCL's "bus bandwidth" uses the same 2 (n - 1) / n factor,
    and its tuning model the same alpha + bytes / bandwidth form (`hardware.py`).
    """
    if n <= 1 or num_bytes <= 0:
        return 0.0
    return latency_s + 2.0 * (n - 1) / n * num_bytes / bytes_per_s


def ring_allgather_s(num_bytes: float, n: int, bytes_per_s: float,
                     latency_s: float = 0.0) -> float:
    """Ring all-gather, or ring reduce-scatter, of a `num_bytes` buffer (every rank's
    chunk together): `latency_s` + each rank sending and receiving (n - 1) / n * bytes,
    half a ring all-reduce's traffic (an all-reduce is a reduce-scatter then an
    all-gather; Patarasuk and Yuan 2009; NCCL's bus bandwidth uses (n - 1) / n for both)."""
    if n <= 1 or num_bytes <= 0:
        return 0.0
    return latency_s + (n - 1) / n * num_bytes / bytes_per_s
