"""Context-parallel attention (megatron_2bw/models/context_parallel.py) equals full causal
attention: each rank's output and q/k/v gradients are the slices, in megatron-core's
load-balanced layout, of full `scaled_dot_product_attention(is_causal=True)` over the
whole sequence, for both --cp-comm-type algorithms (all_gather and the p2p ring).

The workers also show that the checks can fail: the inputs are such that non-causal
attention, or the contiguous (unbalanced) split instead of chunks i and 2N-1-i, differ
from the reference by far more than the tolerance.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_2bw.models import context_parallel
from megatron_2bw.models.context_parallel import (context_parallel_attention, cp_positions,
                                                  cp_slice, cp_unslice)
from tests.dist_harness import run_distributed

TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _inputs(nq: int, nkv: int, seq: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(1234 + nq + nkv + seq)
    b, d = 2, 8
    q, k, v, do = (torch.randn(b, n, seq, d, generator=g).to(dtype)
                   for n in (nq, nkv, nkv, nq))
    return q, k, v, do


def _full(q, k, v, do, scale, gqa, causal=True):
    """Output and q/k/v gradients of full attention over the whole sequence."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                         enable_gqa=gqa)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def _local(q, k, v, do, group, scale, comm_type, gqa, rank, world):
    """Output and gradients of context-parallel attention on this rank's slices."""
    q, k, v, do = (cp_slice(t, 2, rank, world) for t in (q, k, v, do))
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(q, k, v, group, scale=scale, comm_type=comm_type,
                                     enable_gqa=gqa)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def _errors(rank, world, comm_type, nq, nkv, seq, dtype=torch.float32, tile=None):
    """Relative errors of (out, dq, dk, dv) against the reference slices (the ring's
    blocks by the CPU flash kernel, or with `tile` by the einsum tiles other devices run,
    `tile` query rows at a time)."""
    context_parallel.CPU_FUSED_KERNEL = tile is None
    context_parallel.QUERY_TILE = tile or 512
    group = torch.distributed.group.WORLD
    q, k, v, do = _inputs(nq, nkv, seq, dtype)
    scale, gqa = 0.3, nq != nkv
    ref = _full(*(t.float() for t in (q, k, v, do)), scale, gqa)
    got = _local(q, k, v, do, group, scale, comm_type, gqa, rank, world)
    dtypes = {t.dtype for t in got}
    return [_rel(g.float(), cp_slice(r, 2, rank, world)) for g, r in zip(got, ref)], dtypes


def _discriminates(rank, world, seq=16):
    """How far a wrong answer would be: non-causal attention, the contiguous split."""
    q, k, v, do = _inputs(2, 2, seq)
    ref = _full(q, k, v, do, 0.3, False)
    noncausal = _full(q, k, v, do, 0.3, False, causal=False)
    local = [cp_slice(t, 2, rank, world) for t in ref]
    wrong_mask = min(_rel(cp_slice(a, 2, rank, world), b) for a, b in zip(noncausal, local))
    wrong_order = min(_rel(t.chunk(world, dim=2)[rank], b) for t, b in zip(ref, local))
    return wrong_mask, wrong_order


def _worker_2(rank, world):
    from megatron.core.utils import get_batch_on_this_cp_rank

    group = torch.distributed.group.WORLD
    tokens = torch.arange(16).view(1, 16)
    mc = get_batch_on_this_cp_rank({"tokens": tokens.clone()}, cp_group=group)["tokens"]
    return {
        "layout": torch.equal(mc, cp_slice(tokens, 1, rank, world)),
        "p2p": _errors(rank, world, "p2p", 2, 2, 16),
        "all_gather_gqa": _errors(rank, world, "all_gather", 4, 2, 16),
        "p2p_gqa": _errors(rank, world, "p2p", 4, 2, 16, tile=3),
        "p2p_gqa_fused": _errors(rank, world, "p2p", 4, 2, 16),
        "p2p_tiles": _errors(rank, world, "p2p", 2, 2, 16, tile=512),
        "all_gather": _errors(rank, world, "all_gather", 2, 2, 16),
        "p2p_bf16": _errors(rank, world, "p2p", 4, 2, 16, torch.bfloat16),
        "discriminates": _discriminates(rank, world),
    }


def _worker_4(rank, world):
    return {"p2p_gqa": _errors(rank, world, "p2p", 4, 2, 24, tile=4),
            "p2p_gqa_fused": _errors(rank, world, "p2p", 4, 2, 24),
            "all_gather": _errors(rank, world, "all_gather", 2, 2, 24),
            "discriminates": _discriminates(rank, world, 24)}


def _assert_exact(results, names):
    for rank, res in enumerate(results):
        for name in names:
            errors, dtypes = res[name]
            assert max(errors) < TOL, (rank, name, errors)
            assert dtypes == {torch.float32}, (rank, name, dtypes)
        wrong_mask, wrong_order = res["discriminates"]
        assert wrong_mask > 100 * TOL and wrong_order > 100 * TOL, (rank, wrong_mask,
                                                                      wrong_order)


@pytest.mark.slow
def test_cp2_both_comm_types_equal_full_causal_attention() -> None:
    results = run_distributed(_worker_2, 2)
    _assert_exact(results, ["p2p", "all_gather", "p2p_gqa", "all_gather_gqa", "p2p_gqa_fused",
                            "p2p_tiles"])
    for rank, res in enumerate(results):
        assert res["layout"], f"rank {rank}: cp_slice differs from megatron-core's layout"
        errors, dtypes = res["p2p_bf16"]
        assert dtypes == {torch.bfloat16} and max(errors) < 2e-2, (rank, errors)


@pytest.mark.slow
def test_cp4_equal_full_causal_attention() -> None:
    _assert_exact(run_distributed(_worker_4, 4), ["p2p_gqa", "all_gather", "p2p_gqa_fused"])


def test_cp_slice_takes_chunks_i_and_2n_minus_1_minus_i() -> None:
    x = torch.arange(8)
    assert cp_slice(x, 0, 0, 2).tolist() == [0, 1, 6, 7]
    assert cp_slice(x, 0, 1, 2).tolist() == [2, 3, 4, 5]
    y = torch.arange(16).view(2, 8)
    assert cp_slice(y, 1, 3, 4).tolist() == [[3, 4], [11, 12]]
    parts = [cp_slice(y, 1, r, 4) for r in range(4)]
    assert torch.equal(cp_unslice(parts, 1), y)
    assert cp_positions(1, 2, 4, torch.device("cpu")).tolist() == [2, 3, 4, 5]


def test_cp_slice_refuses_a_length_not_divisible_by_2n() -> None:
    with pytest.raises(ValueError, match=r"^cp_slice: sequence length 10 is not divisible "
                                         r"by 2 x context-parallel size \(4\)$"):
        cp_slice(torch.arange(10), 0, 0, 2)


def test_without_a_group_it_is_causal_sdpa_and_refuses_bad_arguments() -> None:
    q, k, v, _ = _inputs(4, 2, 8)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5, enable_gqa=True)
    got = context_parallel_attention(q, k, v, None, scale=0.5, enable_gqa=True)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="comm_type 'ring'"):
        context_parallel_attention(q, k, v, None, scale=0.5, comm_type="ring")
    with pytest.raises(ValueError, match="needs enable_gqa"):
        context_parallel_attention(q, k, v, None, scale=0.5)
