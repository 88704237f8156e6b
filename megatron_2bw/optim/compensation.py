"""How the update direction becomes new weights, and 2BW's delay compensations.

2BW applies minibatch k's gradient, computed at W(k-1), to W(k): a one-step delay
(docs/training.md, "Delay compensation"). With u_t the optimizer's direction at step t
(Adam's m_hat / (sqrt(v_hat) + eps), Muon's scaled orthogonalized momentum), lr_t and the
parameter's weight decay wd:

- ``none``: W(t+1) = W(t) (1 - lr_t wd) - lr_t u_t, the optimizer's own step (paper
  semantics).
- ``error-feedback``: W(t+1) = W(t) (1 - lr_t wd) - lr_t (u_t + alpha (u_t - u_{t-1})),
  u_{-1} = 0: the update is extrapolated by its last change, our reading of the
  error-feedback-style correction of Zmushko et al. (arXiv 2606.30634; the full text is
  not available here). Weight decay is not extrapolated. One fp32 buffer per parameter.
- ``weight-prediction`` (SpecTrain; PipeOptim, arXiv 2312.00839): the update is the
  optimizer's own, but the weights the next minibatches run on are a prediction of the
  version their gradient will be applied to, W(t+1) - lr_{t+1} u_t (`predicts`; the
  updater publishes it). The true weights live in the fp32 masters.

The direction is never modified here; the updater owns it.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

COMPENSATIONS = ("none", "error-feedback", "weight-prediction")


class DelayCompensation:
    """Applies directions to the true weights; holds u_{t-1} for error feedback."""

    def __init__(self, kind: str, alpha: float, weights: Sequence[Tensor]):
        if kind not in COMPENSATIONS:
            raise ValueError(f"--delay-compensation {kind!r}: choose one of {COMPENSATIONS}")
        self.kind, self.alpha = kind, alpha
        self.buffers = ([torch.zeros_like(w, dtype=torch.float32) for w in weights]
                        if kind == "error-feedback" else [])

    @property
    def predicts(self) -> bool:
        """Whether the published weights are a prediction (`weight-prediction`)."""
        return self.kind == "weight-prediction"

    def update(self, weights: list[Tensor], u: list[Tensor], lr: list[float],
               weight_decay: list[float]) -> None:
        """weights <- weights (1 - lr wd) - lr * (u, or its error-feedback extrapolation),
        lr and wd per parameter (--decoupled-lr gives the embedding and output layer
        their own lr; one foreach call per distinct value, so the arithmetic is that of a
        single lr)."""
        for rate, decay in dict.fromkeys(zip(lr, weight_decay)):
            if decay:
                torch._foreach_mul_([w for w, r, d in zip(weights, lr, weight_decay)
                                     if (r, d) == (rate, decay)], 1.0 - rate * decay)
        step = u
        if self.kind == "error-feedback":
            step = torch._foreach_mul(u, 1.0 + self.alpha)
            torch._foreach_add_(step, self.buffers, alpha=-self.alpha)
            torch._foreach_copy_(self.buffers, u)
        for rate in dict.fromkeys(lr):
            idx = [i for i, r in enumerate(lr) if r == rate]
            torch._foreach_add_([weights[i] for i in idx], [step[i] for i in idx], alpha=-rate)

    def state_dict(self) -> dict:
        return {"kind": self.kind, "previous_update": [b.clone() for b in self.buffers]}

    def load_state_dict(self, state: dict) -> None:
        if state["kind"] != self.kind:
            raise ValueError(f"the checkpoint was trained with --delay-compensation "
                             f"{state['kind']}, this run asks for {self.kind}")
        with torch.no_grad():
            for dst, src in zip(self.buffers, state["previous_update"]):
                dst.copy_(src)
