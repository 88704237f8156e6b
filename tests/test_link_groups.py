"""One process group per direction of every pipeline link (runtime/topology.link_groups).

On NCCL the two directions of a link must not share a stream (see link_groups), so the
executor sends and receives over these groups. gloo cannot hang the way NCCL would, so
what is checked here is that every rank gets exactly its links' groups, with the run's
timeout, and that a transfer posted in an order that would cross on a shared stream
arrives over them. (That the groups keep --distributed-timeout-minutes is
proven end to end by test_reliability_stop's stalled pipeline neighbour.)"""
from __future__ import annotations

import torch

from tests.dist_harness import run_distributed


def test_directed_links_cover_both_directions_and_the_ring() -> None:
    from megatron_2bw.runtime.p2p import directed_links
    assert directed_links([(0, 2), (1, 3)], ring=False) == [(0, 2), (2, 0), (1, 3), (3, 1)]
    # a ring of two stages has one link; of three, three
    assert directed_links([(0, 1)], ring=True) == [(0, 1), (1, 0)]
    assert directed_links([(0, 1, 2)], ring=True) == [
        (0, 1), (1, 0), (1, 2), (2, 1), (2, 0), (0, 2)]


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_2bw.runtime.p2p import P2P, group_timeout
    from megatron_2bw.runtime.topology import stage_links

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    links = stage_links((2, 3), torch.float32, torch.device("cpu"))
    p2p = P2P(links)
    peer = links.next_rank if links.is_first else links.prev_rank
    # each stage posts its receive before its send: crossed, as 1F1B's steady state is
    p2p.post(links.stage ^ 1)
    ticket = p2p.send(torch.full((2, 3), float(rank)), links.stage ^ 1)
    got = p2p.recv(links.stage ^ 1, "a tensor")
    p2p.release(ticket)
    out = {"keys": sorted(links.groups), "got": got[0, 0].item(), "peer": peer,
           "sizes": [dist.get_world_size(g) for g in links.groups.values()],
           "timeouts": {group_timeout(g) for g in links.groups.values()},
           "world_timeout": group_timeout()}
    ps.destroy_model_parallel()
    return out


def test_each_rank_gets_its_links_groups_and_transfers_use_them() -> None:
    results = run_distributed(_worker, 4)
    for rank, out in enumerate(results):
        peer = out["peer"]
        assert out["keys"] == sorted([(rank, peer), (peer, rank)])
        assert out["sizes"] == [2, 2] and out["got"] == float(peer)
        assert out["world_timeout"] is not None and out["timeouts"] == {out["world_timeout"]}
