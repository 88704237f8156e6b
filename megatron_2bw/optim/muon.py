"""Muon's update direction with Megatron-LM's numerics, as functions and a stateful direction.

The updater needs the *direction* ``u`` of every Muon parameter, not a finished step, so that
delay compensation can extrapolate it. Megatron-LM (megatron-core 0.16.1 with
emerging_optimizers v0.1.0, see docs/notes/muon-megatron-reference.md) steps a Muon parameter
``W`` (fp32 master) with gradient ``g`` (unscaled, globally clipped together with the AdamW
parameters) as

    W <- W + (-lr * wd) * W                         decoupled weight decay, uses the lr
    m <- lerp(m, g, 1 - beta) = beta * m + (1 - beta) * g       (EMA, i.e. dampened)
    v <- lerp(g, m, beta)   if nesterov   else   m
    u <- NS(v) * scale(rows, cols) * extra_scale_factor
    W <- W + (-lr) * u

so ``W_new = W * (1 - lr * wd) - lr * u`` (bit-exactly: the two in-place adds above, which
:func:`apply_megatron_update` reproduces). No learning-rate adjustment is made; the shape
dependence lives in ``scale``. This module computes ``u`` and owns ``m``.

torch.distributed is never imported at module level: tensor-parallel gathers are injected
(:class:`TensorParallel`), so everything runs in one process for tests.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

# Newton-Schulz coefficient sets of emerging_optimizers v0.1.0 (muon_utils._COEFFICIENT_SETS);
# step i uses set i % len(sets). Megatron always uses "quintic" (no flag selects another).
COEFFICIENT_SETS: dict[str, tuple[tuple[float, float, float], ...]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "polar_express": (
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
    "aol": (
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ),
}

SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MATMUL_PRECISIONS = ("low", "medium", "high")
TP_MODES = ("blockwise", "duplicated", "distributed")
FP16_REFUSAL = "muon with fp16 is not supported."  # Megatron's message (muon.py:195-196)
_TORCH_PRECISIONS = ("highest", "high", "medium")


@dataclass(frozen=True)
class MuonConfig:
    """Megatron-LM's Muon flags (megatron/training/arguments.py:1838-1857 at core_v0.16.1).

    Defaults are the command-line defaults, which is what Megatron-LM training uses; note that
    megatron-core's OptimizerConfig dataclass says ``muon_momentum=0.95`` but the flag says 0.9.
    """

    momentum: float = 0.9               # --muon-momentum (float)
    split_qkv: bool = True              # --muon-no-split-qkv sets False (store_false)
    use_nesterov: bool = False          # --muon-use-nesterov (store_true; no negation flag)
    scale_mode: str = "spectral"        # --muon-scale-mode {spectral,unit_rms_norm,shape_scaling}
    fp32_matmul_prec: str = "medium"    # --muon-fp32-matmul-prec {low,medium,high}
    num_ns_steps: int = 5               # --muon-num-ns-steps (int)
    tp_mode: str = "blockwise"          # --muon-tp-mode {blockwise,duplicated,distributed}
    extra_scale_factor: float = 1.0     # --muon-extra-scale-factor (float)
    coefficient_type: str = "quintic"   # no flag: TensorParallelMuon's default, always used
    eps: float = 1e-7                   # no flag: newton_schulz's normalisation floor

    def __post_init__(self) -> None:
        _check_choice("scale_mode", self.scale_mode, SCALE_MODES)
        _check_choice("fp32_matmul_prec", self.fp32_matmul_prec, MATMUL_PRECISIONS)
        _check_choice("tp_mode", self.tp_mode, TP_MODES)
        _check_choice("coefficient_type", self.coefficient_type, tuple(COEFFICIENT_SETS))
        _check_steps(self.num_ns_steps, self.coefficient_type)


@dataclass(frozen=True)
class MuonParamSpec:
    """What the direction needs to know about one Muon parameter (this rank's shard).

    partition_dim: Megatron's ``param.partition_dim`` (0 column-parallel, 1 row-parallel;
    None or -1: not split over tensor parallelism). qkv_split: rows per query group
    ``(q, k, v)`` of a fused ``linear_qkv.weight`` (see :func:`qkv_split_rows`), else None.
    """

    shape: tuple[int, int]
    partition_dim: Optional[int] = None
    qkv_split: Optional[tuple[int, int, int]] = None

    def __post_init__(self) -> None:
        if len(self.shape) != 2:
            raise ValueError(f"Muon handles 2D parameters only, got shape {self.shape}")
        if self.partition_dim is not None and self.partition_dim not in (-1, 0, 1):
            raise ValueError(f"partition_dim must be 0, 1, -1 or None, got {self.partition_dim}")
        if self.qkv_split is not None and self.shape[0] % sum(self.qkv_split):
            raise ValueError(f"{self.shape[0]} rows are not whole query groups of "
                             f"{self.qkv_split} rows; Megatron's split needs them to be")


Gather = Callable[[Tensor, int], Tensor]


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the tensor-parallel group, and how to all-gather a shard.

    ``gather(shard, dim)`` returns the concatenation of all ranks' shards along ``dim`` in rank
    order (the trainer passes `comm.gather_concat` over the tensor-parallel group); it is
    needed only by ``tp_mode='duplicated'``, and with it Muon gathers at every size (a group
    of one when the trainer exercises collectives).
    """

    rank: int = 0
    size: int = 1
    gather: Optional[Gather] = field(default=None, compare=False)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_steps(steps: int, coefficient_type: str) -> None:
    """emerging_optimizers refuses a step count that does not cycle whole coefficient sets."""
    period = len(COEFFICIENT_SETS[coefficient_type])
    if steps < 1 or steps % period:
        raise ValueError(f"num_ns_steps ({steps}) must be a positive multiple of {period}, "
                         f"the number of '{coefficient_type}' coefficient sets")


def qkv_split_rows(num_attention_heads: int, num_query_groups: int,
                   kv_channels: int) -> tuple[int, int, int]:
    """Rows of q, k and v per query group in megatron-core's fused ``linear_qkv.weight``.

    The weight's rows are laid out per query group as ``[q heads of the group..., k, v]``
    (attention.py, ``get_query_key_value_tensors``); Megatron's Muon orthogonalises the q, k
    and v blocks of all (local) groups as three separate matrices (muon.py:234-238).
    """
    return (num_attention_heads // num_query_groups * kv_channels, kv_channels, kv_channels)


def is_megatron_muon_param(param: Tensor) -> bool:
    """Megatron's rule (muon.py:251-258): 2D and not the word embedding / output layer.

    Everything else (biases, norms, any 1D tensor, ``embedding.word_embeddings.weight`` and
    ``output_layer.weight``, which carry ``is_embedding_or_output_parameter``) goes to AdamW.
    Learned position embeddings are 2D and unflagged, so Megatron gives them to Muon.
    """
    return param.dim() == 2 and not getattr(param, "is_embedding_or_output_parameter", False)


def is_megatron_qkv_param(name: str, param: Tensor) -> bool:
    """Megatron marks a parameter fused QKV by name (muon.py:249-250)."""
    return "linear_qkv.weight" in name and param.dim() == 2


def check_not_fp16(fp16: bool) -> None:
    """Megatron refuses Muon under fp16 (it supports bf16 without loss scaling only)."""
    if fp16:
        raise ValueError(FP16_REFUSAL)


def muon_scale_factor(rows: int, cols: int, mode: str = "spectral", extra: float = 1.0) -> float:
    """Factor the orthogonalised matrix is multiplied by (emerging's get_muon_scale_factor).

    spectral: sqrt(max(rows, cols)); unit_rms_norm: sqrt(rows / cols);
    shape_scaling: sqrt(max(1, rows / cols)) (Keller Jordan's; torch.optim.Muon's 'original').
    Megatron multiplies by the factor and then by ``extra``, in two roundings; so does
    :meth:`MuonDirection.direction`. The product returned here is for reading and logging.
    """
    if mode == "spectral":
        base = max(rows, cols) ** 0.5
    elif mode == "unit_rms_norm":
        base = (rows / cols) ** 0.5
    elif mode == "shape_scaling":
        base = max(1, rows / cols) ** 0.5
    else:
        raise ValueError(f"Invalid mode for Muon update scale factor: {mode}")
    return base * extra


@contextmanager
def _matmul_precision(precision: str) -> Iterator[None]:
    """Set torch's fp32 matmul precision for the block, as emerging_optimizers does."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def resolve_precision(fp32_matmul_prec: str) -> str:
    """The torch precision Megatron's Newton-Schulz actually runs under.

    Megatron passes the flag to ``torch.set_float32_matmul_precision``; 'low' is not a torch
    value, so torch warns and keeps the current setting (normally 'highest').
    """
    if fp32_matmul_prec in _TORCH_PRECISIONS:
        return fp32_matmul_prec
    return torch.get_float32_matmul_precision()


def newton_schulz(G: Tensor, steps: int, coefficient_type: str = "quintic", eps: float = 1e-7,
                  precision: str = "highest") -> Tensor:
    """Approximate the orthogonal polar factor U V^T of G (emerging_optimizers' newton_schulz).

    Works on the wide orientation (a tall G is transposed, so the Gram matrix is the small
    one), divides by the Frobenius norm (so every singular value is <= 1), then runs
    X <- a X + (b A + c A^2) X with A = X X^T, cycling the coefficient sets. The tuned
    coefficients do not converge to exactly 1: singular values end in a band around 1, which
    is what Megatron trains with. ``precision='medium'`` runs the iterations in bf16 (input and
    output fp32), as Megatron's default ``--muon-fp32-matmul-prec medium`` does; 'high' allows
    TF32 matmuls; 'highest' is plain fp32. The result is fp32.
    """
    if G.dim() != 2:
        raise ValueError(f"newton_schulz needs a 2D matrix, got shape {tuple(G.shape)}")
    _check_steps(steps, coefficient_type)
    coefficients = COEFFICIENT_SETS[coefficient_type]
    transpose = G.size(0) > G.size(1)
    X = G.float().mT if transpose else G.float()
    X = X / X.norm().clamp_min(eps)
    with _matmul_precision(precision):
        if precision == "medium":
            X = X.to(torch.bfloat16)
        for i in range(steps):
            a, b, c = coefficients[i % len(coefficients)]
            A = X @ X.mT
            X = torch.addmm(X, torch.addmm(A, A, A, beta=b, alpha=c), X, beta=a)
    X = X.float()
    return X.mT if transpose else X


class MuonDirection:
    """Momentum state of the Muon parameters and their per-step update direction ``u``."""

    def __init__(self, specs: Sequence[MuonParamSpec], config: MuonConfig = MuonConfig(),
                 tp: TensorParallel = TensorParallel(),
                 device: Optional[torch.device] = None):
        if config.tp_mode == "distributed":
            raise ValueError(
                "muon tp_mode 'distributed' (Newton-Schulz on shards with all-reduced Gram "
                "matrices) is not implemented; 'duplicated' computes the same matrix function "
                "on the gathered matrix")
        if config.tp_mode == "duplicated" and tp.size > 1 and tp.gather is None:
            raise ValueError("tp_mode 'duplicated' with tensor parallelism needs tp.gather")
        self.specs, self.config, self.tp = list(specs), config, tp
        self.precision = resolve_precision(config.fp32_matmul_prec)
        self.buffers = [torch.zeros(s.shape, dtype=torch.float32, device=device)
                        for s in self.specs]

    def direction(self, grads: Sequence[Tensor]) -> list[Tensor]:
        """Advance the momentum with this step's gradients; return u for every parameter.

        ``grads`` are the unscaled, clipped fp32 gradients in spec order. The returned
        tensors are new fp32 tensors (never the momentum buffers themselves).
        """
        if len(grads) != len(self.buffers):
            raise ValueError(f"expected {len(self.buffers)} gradients, got {len(grads)}")
        grads = [g.float() for g in grads]
        beta = self.config.momentum
        torch._foreach_lerp_(self.buffers, grads, 1.0 - beta)
        inputs = (torch._foreach_lerp(grads, self.buffers, beta) if self.config.use_nesterov
                  else self.buffers)
        return [self._orthogonalize(spec, v) for spec, v in zip(self.specs, inputs)]

    def _orthogonalize(self, spec: MuonParamSpec, v: Tensor) -> Tensor:
        """Split a fused QKV into its q, k, v matrices (Megatron's default), else one matrix."""
        dim = None if self.config.tp_mode == "blockwise" else spec.partition_dim
        dim = None if dim == -1 else dim
        if not (self.config.split_qkv and spec.qkv_split):
            return self._scaled_orthogonal(v, dim)
        groups = v.size(0) // sum(spec.qkv_split)
        blocks = torch.split(v.view(groups, sum(spec.qkv_split), -1), spec.qkv_split, dim=1)
        outs = [self._scaled_orthogonal(b.reshape(-1, v.size(1)), dim).view(groups, -1, v.size(1))
                for b in blocks]
        return torch.cat(outs, dim=1).view(v.shape)

    def _scaled_orthogonal(self, x: Tensor, partition_dim: Optional[int]) -> Tensor:
        """NS of the full matrix (gathered if TP-split and duplicated), this rank's part, scaled.

        The scale uses the full matrix's shape whenever the matrix was gathered, the local
        shape in blockwise mode (muon.py:78-90).
        """
        size = [x.size(0), x.size(1)]
        cfg, tp = self.config, self.tp
        if partition_dim is not None and tp.gather is not None:
            size[partition_dim] *= tp.size
            full = newton_schulz(tp.gather(x, partition_dim), cfg.num_ns_steps,
                                 cfg.coefficient_type, cfg.eps, self.precision)
            out = full.chunk(tp.size, dim=partition_dim)[tp.rank]
        else:
            out = newton_schulz(x, cfg.num_ns_steps, cfg.coefficient_type, cfg.eps,
                                self.precision)
        return out * muon_scale_factor(size[0], size[1], cfg.scale_mode) * cfg.extra_scale_factor

    def state_dict(self) -> dict:
        """Momentum buffers (copies) and the shapes they belong to."""
        return {"momentum_buffers": [b.detach().clone() for b in self.buffers],
                "shapes": [tuple(s.shape) for s in self.specs]}

    def load_state_dict(self, state: dict) -> None:
        """Restore the momentum exactly; refuses a state saved for other parameter shapes."""
        shapes = [tuple(s) for s in state["shapes"]]
        if shapes != [tuple(s.shape) for s in self.specs]:
            raise ValueError(f"Muon state is for shapes {shapes}, not "
                             f"{[tuple(s.shape) for s in self.specs]}")
        with torch.no_grad():
            for buf, saved in zip(self.buffers, state["momentum_buffers"]):
                buf.copy_(saved)


def apply_megatron_update(weights: Sequence[Tensor], directions: Sequence[Tensor], lr: float,
                          weight_decay: float) -> None:
    """W <- W * (1 - lr * wd) - lr * u, with Megatron's two in-place adds (bit-exact).

    emerging_optimizers decays first (``W.add_(W, alpha=-wd * lr)``, skipped when wd == 0)
    and then adds ``-lr * u``. Megatron's Muon parameters are all 2D non-bias weights, so
    they all get the full weight decay (wd_mult 1).
    """
    weights = list(weights)
    if weight_decay != 0.0:
        torch._foreach_add_(weights, weights, alpha=-weight_decay * lr)
    torch._foreach_add_(weights, list(directions), alpha=-lr)


__all__ = [
    "COEFFICIENT_SETS", "FP16_REFUSAL", "MuonConfig", "MuonDirection", "MuonParamSpec",
    "TensorParallel", "apply_megatron_update", "check_not_fp16", "is_megatron_muon_param",
    "is_megatron_qkv_param", "muon_scale_factor", "newton_schulz",
    "qkv_split_rows", "resolve_precision",
]
