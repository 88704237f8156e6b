"""Adam's update direction, so that the step can be compensated for 2BW's delay.

torch.optim.AdamW computes, per parameter, with decoupled weight decay,

    m <- lerp(m, g, 1 - beta1);  v <- beta2 * v + (1 - beta2) * g * g
    u  = (m / (1 - beta1^t)) / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    W <- W * (1 - lr * wd);  W <- W - lr * u

and applies u at once. The updater needs u itself (error feedback extrapolates it, weight
prediction moves the published weights along it), so this class owns m and v and returns
u; `megatron_2bw.optim.updater` applies it. The arithmetic follows torch's foreach AdamW
(same operations and order), so a run equals one with torch.optim.AdamW to rounding.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor


class AdamDirection:
    """First and second moments of a list of fp32 parameters, and their direction u."""

    def __init__(self, params: Sequence[Tensor], beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8):
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.exp_avg = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        self.step = 0

    def direction(self, grads: Sequence[Tensor]) -> list[Tensor]:
        """Advance the moments with this step's (unscaled, clipped) gradients; return u."""
        if not grads:
            return []
        grads = list(grads)
        self.step += 1
        torch._foreach_lerp_(self.exp_avg, grads, 1.0 - self.beta1)
        torch._foreach_mul_(self.exp_avg_sq, self.beta2)
        torch._foreach_addcmul_(self.exp_avg_sq, grads, grads, 1.0 - self.beta2)
        bias1 = 1.0 - self.beta1 ** self.step
        bias2_sqrt = math.sqrt(1.0 - self.beta2 ** self.step)
        denom = torch._foreach_sqrt(self.exp_avg_sq)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, self.eps)
        u = torch._foreach_div(self.exp_avg, denom)
        torch._foreach_div_(u, bias1)
        return u

    def state_dict(self) -> dict:
        return {"step": self.step, "exp_avg": [t.clone() for t in self.exp_avg],
                "exp_avg_sq": [t.clone() for t in self.exp_avg_sq]}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        with torch.no_grad():
            for dst, src in zip(self.exp_avg + self.exp_avg_sq,
                                list(state["exp_avg"]) + list(state["exp_avg_sq"])):
                dst.copy_(src)
