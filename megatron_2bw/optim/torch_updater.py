"""Any `torch.optim` optimizer as a weight-version updater.

The optimizer is built once over "slot" parameters, so it holds one optimizer state
whatever the number of weight buffers. Each step points the slots at the target
buffer (after copying the newest weights there when it is a different buffer) and at
the minibatch's reduced gradient, then calls `optimizer.step()`: the new version is
written in place, with no third copy of the weights.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class TorchOptimizerUpdater:
    """fp32 weights, no loss scaling: W(target) = step(W(newest), grad)."""

    loss_scale = 1.0

    def __init__(self, params: list[torch.Tensor], make_optimizer: OptimizerFactory):
        self.slots = [alias_parameter(p) for p in params]
        self.optimizer = make_optimizer(self.slots)

    def unscale(self, flat_grad: torch.Tensor, grad_scale: float) -> None:
        if grad_scale != 1.0:
            flat_grad.div_(grad_scale)

    def start_step(self, minibatch: int, flat_grad: torch.Tensor,
                   grads: list[torch.Tensor]) -> None:
        """Nothing model-wide to sum: no clipping, no overflow check."""

    def finish_step(self, minibatch: int, flat_grad: torch.Tensor, grads: list[torch.Tensor],
                    newest: list[torch.Tensor], target: list[torch.Tensor]) -> dict[str, float]:
        with torch.no_grad():
            if target[0] is not newest[0]:
                torch._foreach_copy_(target, newest)
        for slot, weight, grad in zip(self.slots, target, grads):
            slot.data = weight.data
            slot.grad = grad
        self.optimizer.step()
        for slot in self.slots:
            slot.grad = None
        return {"lr": self.optimizer.param_groups[0]["lr"]}


def alias_parameter(param: torch.Tensor) -> nn.Parameter:
    """A Parameter sharing `param`'s storage but with its own autograd version counter.

    (`param.detach()` would share the counter, and an update of the other weight
    buffer through this slot would then look like a change of `param` to autograd.)
    """
    slot = nn.Parameter(param.new_empty(0))
    slot.data = param.data
    return slot
