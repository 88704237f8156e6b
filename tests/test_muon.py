"""Muon direction numerics (megatron_2bw/optim/muon.py) against independent references.

References used: the scalar quintic map on singular values (Newton-Schulz acts on each singular
value independently); torch.optim.Muon (torch 2.13), whose Newton-Schulz is emerging_optimizers'
"simple" coefficient set in bf16 and whose 'original' lr adjustment equals the 'shape_scaling'
scale; hand-written momentum/Nesterov recurrences with an fp64 Newton-Schulz written here.
"""
from __future__ import annotations

import math
import threading

import pytest
import torch

from megatron_2bw.optim.muon import (
    COEFFICIENT_SETS, FP16_REFUSAL, MuonConfig, MuonDirection, MuonParamSpec, TensorParallel,
    apply_megatron_update, check_not_fp16, muon_scale_factor, newton_schulz, qkv_split_rows,
    resolve_precision)

QUINTIC = COEFFICIENT_SETS["quintic"]
SIMPLE = COEFFICIENT_SETS["simple"][0]


def _quintic_map(s: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Where Newton-Schulz sends a (normalised) singular value."""
    for i in range(steps):
        a, b, c = QUINTIC[i % len(QUINTIC)]
        s = a * s + b * s ** 3 + c * s ** 5
    return s


def _ns_reference(G: torch.Tensor, coefficients=QUINTIC, steps: int = 5) -> torch.Tensor:
    """fp64 Newton-Schulz on the short side, written independently of the module."""
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    X = X / X.norm()
    for i in range(steps):
        a, b, c = coefficients[i % len(coefficients)]
        A = X @ X.T
        X = a * X + b * (A @ X) + c * (A @ A @ X)
    return (X.T if tall else X).float()


@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (96, 32)])
def test_newton_schulz_singular_values_in_quintic_band(shape):
    torch.manual_seed(0)
    G = torch.randn(*shape)
    s_in = torch.linalg.svdvals(G.double()) / G.double().norm()
    out = newton_schulz(G, 5, precision="highest")
    assert out.shape == G.shape and out.dtype == torch.float32
    s_out = torch.linalg.svdvals(out.double())
    want = _quintic_map(s_in).sort(descending=True).values  # the map is not monotonic
    torch.testing.assert_close(s_out, want, atol=2e-4, rtol=0)
    # singular values normalised into [0.05, 1] land in [0.9777, 1.0318] (scalar map, fp64)
    assert 0.97 < s_out.min() and s_out.max() < 1.04
    s_bf16 = torch.linalg.svdvals(newton_schulz(G, 5, precision="medium").double())
    assert 0.95 < s_bf16.min() and s_bf16.max() < 1.06


def test_newton_schulz_orients_and_refuses_bad_steps():
    torch.manual_seed(1)
    G = torch.randn(40, 12)
    torch.testing.assert_close(newton_schulz(G, 5), newton_schulz(G.T, 5).T)
    torch.testing.assert_close(newton_schulz(G, 10), _ns_reference(G, steps=10), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="multiple of 5"):
        newton_schulz(G, 3)
    with pytest.raises(ValueError, match="multiple of 5"):
        MuonConfig(num_ns_steps=4)


@pytest.mark.parametrize("shape", [(16, 4), (4, 16), (8, 8)])
def test_newton_schulz_bitwise_equals_torch_on_exact_input(shape):
    """Entries +-1/8 over 64 cells: Frobenius norm exactly 1, so normalising in fp32 (us,
    Megatron) and in bf16 (torch) agree, and the bf16 iterations must then be identical."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    torch.manual_seed(2)
    G = (torch.randint(0, 2, shape) * 2 - 1).float() / 8
    ours = newton_schulz(G, 5, "simple", precision="medium")
    theirs = _zeropower_via_newtonschulz(G, SIMPLE, 5, 1e-7).float()
    assert torch.equal(ours, theirs)


def _torch_muon_run(shapes, grads, weights, patch_ns, monkeypatch):
    import torch.optim._muon as tm

    if patch_ns:
        monkeypatch.setattr(tm, "_zeropower_via_newtonschulz",
                            lambda g, coeffs, steps, eps: newton_schulz(g, steps, "simple",
                                                                        eps, "medium"))
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = torch.optim.Muon(params, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("patch_ns", [True, False])
def test_matches_torch_optim_muon(patch_ns, monkeypatch):
    """torch.optim.Muon = our config with 'simple' coefficients, 'shape_scaling', Nesterov.

    With torch's Newton-Schulz replaced by ours, the momentum, Nesterov, weight-decay and
    scale plumbing must agree to rounding. Unpatched, torch normalises in bf16 and we (like
    Megatron) in fp32 before the bf16 iterations, so the results agree to bf16 noise only.
    """
    torch.manual_seed(3)
    shapes = [(32, 8), (8, 32), (24, 24)]
    weights = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    cfg = MuonConfig(momentum=0.95, use_nesterov=True, coefficient_type="simple",
                     scale_mode="shape_scaling")
    direction = MuonDirection([MuonParamSpec(s) for s in shapes], cfg)
    ours = [w.clone() for w in weights]
    for step_grads in grads:
        apply_megatron_update(ours, direction.direction(step_grads), lr=0.02, weight_decay=0.1)
    theirs = _torch_muon_run(shapes, grads, weights, patch_ns, monkeypatch)
    atol = 1e-6 if patch_ns else 3e-3
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_and_nesterov_against_hand_reference(nesterov):
    torch.manual_seed(4)
    shapes, beta = [(24, 8), (8, 24)], 0.9
    cfg = MuonConfig(momentum=beta, use_nesterov=nesterov, fp32_matmul_prec="high")
    direction = MuonDirection([MuonParamSpec(s) for s in shapes], cfg)
    bufs = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for _ in range(3):
        grads = [torch.randn(s) for s in shapes]
        got = direction.direction(grads)
        for i, (g, (rows, cols)) in enumerate(zip(grads, shapes)):
            bufs[i] = beta * bufs[i] + (1 - beta) * g.double()
            v = (1 - beta) * g.double() + beta * bufs[i] if nesterov else bufs[i]
            want = _ns_reference(v) * math.sqrt(max(rows, cols))
            torch.testing.assert_close(got[i], want, atol=2e-4 * math.sqrt(max(rows, cols)),
                                       rtol=0)


class _FakeTPGroup:
    """In-process all-gather between threads, one per rank (what a collective does)."""

    def __init__(self, size: int):
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size)

    def gather_for(self, rank: int):
        def gather(shard: torch.Tensor, dim: int) -> torch.Tensor:
            self.slots[rank] = shard.clone()
            self.barrier.wait()
            full = torch.cat(self.slots, dim=dim)
            self.barrier.wait()
            return full
        return gather


def _sharded_directions(specs_full, grads_steps, cfg, size=2):
    """Run one MuonDirection per TP rank, in threads, on the rank's slices of the gradients."""
    results = [None] * size
    group = _FakeTPGroup(size)

    def shard(t, spec, rank):
        return t.chunk(size, dim=spec.partition_dim)[rank]

    def run(rank):
        specs = [MuonParamSpec(tuple(shard(torch.empty(s.shape), s, rank).shape),
                               s.partition_dim, s.qkv_split) for s in specs_full]
        d = MuonDirection(specs, cfg, TensorParallel(rank, size, group.gather_for(rank)))
        for grads in grads_steps:
            out = d.direction([shard(g, s, rank) for g, s in zip(grads, specs_full)])
        results[rank] = out

    # The ranks are threads here (processes in training), and torch's fp32 matmul
    # precision is one global: a rank leaving its Newton-Schulz block would put the
    # previous precision back while the other is still inside (a flaky mismatch). Holding
    # the configured precision around the threads makes every set and reset the same value.
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(resolve_precision(cfg.fp32_matmul_prec))
    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_float32_matmul_precision(previous)
    return results


def _tp_case():
    q = qkv_split_rows(num_attention_heads=4, num_query_groups=2, kv_channels=4)  # (8, 4, 4)
    specs = [MuonParamSpec((32, 16), 0),           # column-parallel (e.g. linear_fc1)
             MuonParamSpec((16, 32), 1),           # row-parallel (e.g. linear_proj)
             MuonParamSpec((32, 16), 0, q)]        # fused QKV, 2 query groups of 16 rows
    torch.manual_seed(5)
    grads_steps = [[torch.randn(s.shape) for s in specs] for _ in range(2)]
    return specs, grads_steps


def test_duplicated_tp2_equals_unsharded_sliced_and_blockwise_differs():
    specs, grads_steps = _tp_case()
    for precision in ("medium", "high"):
        cfg = MuonConfig(tp_mode="duplicated", fp32_matmul_prec=precision)
        full = MuonDirection(specs, cfg)
        for grads in grads_steps:
            want = full.direction(grads)
        got = _sharded_directions(specs, grads_steps, cfg)
        for rank in range(2):
            for w, g, s in zip(want, got[rank], specs):
                assert torch.equal(w.chunk(2, dim=s.partition_dim)[rank], g)
    blockwise = _sharded_directions(specs, grads_steps, MuonConfig(tp_mode="blockwise",
                                                                   fp32_matmul_prec="high"))
    for w, g, s in zip(want, blockwise[0], specs):
        assert (w.chunk(2, dim=s.partition_dim)[0] - g).abs().max() > 0.1


def test_qkv_split_orthogonalises_q_k_v_separately():
    specs, grads_steps = _tp_case()
    spec = specs[2]
    cfg = MuonConfig(momentum=0.0, fp32_matmul_prec="high")  # momentum 0: v is the gradient
    g = grads_steps[0][2]
    got = MuonDirection([spec], cfg).direction([g])[0]
    rows = torch.arange(32).view(2, 16)
    parts = [rows[:, :8].reshape(-1), rows[:, 8:12].reshape(-1), rows[:, 12:].reshape(-1)]
    for idx in parts:
        want = _ns_reference(g[idx]) * math.sqrt(max(len(idx), 16))
        torch.testing.assert_close(got[idx], want, atol=1e-3, rtol=0)
    unsplit = MuonDirection([spec], MuonConfig(momentum=0.0, split_qkv=False,
                                               fp32_matmul_prec="high")).direction([g])[0]
    torch.testing.assert_close(unsplit, _ns_reference(g) * math.sqrt(32), atol=1e-3, rtol=0)


def test_state_dict_round_trip_gives_identical_next_direction():
    torch.manual_seed(6)
    specs = [MuonParamSpec((20, 12)), MuonParamSpec((12, 20))]
    cfg = MuonConfig(use_nesterov=True)
    a = MuonDirection(specs, cfg)
    for _ in range(2):
        a.direction([torch.randn(s.shape) for s in specs])
    state = a.state_dict()
    b = MuonDirection(specs, cfg)
    b.load_state_dict(state)
    grads = [torch.randn(s.shape) for s in specs]
    for x, y in zip(a.direction(grads), b.direction(grads)):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="shapes"):
        MuonDirection([MuonParamSpec((4, 4))], cfg).load_state_dict(state)


@pytest.mark.parametrize("rows,cols,mode,want", [
    (1024, 4096, "spectral", 64.0), (4096, 1024, "spectral", 64.0),
    (1024, 4096, "unit_rms_norm", 0.5), (4096, 1024, "unit_rms_norm", 2.0),
    (1024, 4096, "shape_scaling", 1.0), (4096, 1024, "shape_scaling", 2.0),
])
def test_scale_factor_modes(rows, cols, mode, want):
    assert muon_scale_factor(rows, cols, mode) == pytest.approx(want)
    assert muon_scale_factor(rows, cols, mode, extra=0.2) == pytest.approx(0.2 * want)


def test_refusals():
    with pytest.raises(ValueError, match="distributed"):
        MuonDirection([MuonParamSpec((4, 4), 0)], MuonConfig(tp_mode="distributed"))
    with pytest.raises(ValueError, match="scale"):
        muon_scale_factor(4, 4, "rms")
    with pytest.raises(ValueError):
        MuonConfig(scale_mode="rms")
    with pytest.raises(ValueError, match="2D"):
        MuonParamSpec((4,))
    with pytest.raises(ValueError, match=FP16_REFUSAL):
        check_not_fp16(True)


def test_apply_update_is_decoupled_decay_then_step():
    torch.manual_seed(7)
    w, u = torch.randn(6, 3), torch.randn(6, 3)
    got = [w.clone()]
    apply_megatron_update(got, [u], lr=0.1, weight_decay=0.01)
    torch.testing.assert_close(got[0], w * (1 - 0.1 * 0.01) - 0.1 * u)
