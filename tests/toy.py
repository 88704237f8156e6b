"""A tiny model that can be cut into stages, its data, and two plain reference loops.

The references are deliberately independent of the engine: a plain loop of forward,
backward and Adam (vanilla, for flush and gpipe) and the paper's delayed-update loop
with W_prev / W_cur (for 2BW).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

WIDTH, LAYERS, MB = 8, 8, 3  # features, total layers, samples per microbatch
LR = 0.01


def full_model(seed: int = 1234) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


class ToyStage(nn.Module):
    """Layers [lo, hi) of the full model; the last stage returns the MSE loss."""

    def __init__(self, layers: nn.Sequential, first: bool, last: bool):
        super().__init__()
        self.layers, self.first, self.last = layers, first, last

    def forward(self, inp, batch):
        h = batch["x"] if self.first else inp
        for layer in self.layers:
            h = torch.tanh(layer(h))
        if self.last:
            return ((h - batch["y"]) ** 2).mean()
        return h


def toy_stage(stage: int, num_stages: int) -> ToyStage:
    per = LAYERS // num_stages
    layers = nn.Sequential(*list(full_model())[stage * per:(stage + 1) * per])
    return ToyStage(layers, stage == 0, stage == num_stages - 1)


def microbatch(index: int, replica: int, width: int) -> dict:
    """Microbatch `index` of data-parallel replica `replica` (of `width`), deterministic."""
    g = torch.Generator().manual_seed(10_000 * index + replica)
    return {"x": torch.randn(MB, WIDTH, generator=g), "y": torch.randn(MB, WIDTH, generator=g)}


def global_minibatch(k: int, m: int, w: int) -> list[dict]:
    return [microbatch(i, r, w) for r in range(w) for i in range(k * m, (k + 1) * m)]


def _loss_and_grads(model: nn.Module, batches: list[dict]) -> float:
    """Accumulate the mean-loss gradient over `batches` into model's .grad."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for b in batches:
        loss = model_loss(model, b)
        (loss / len(batches)).backward()
        total += loss.item()
    return total / len(batches)


def model_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    h = batch["x"]
    for layer in model:
        h = torch.tanh(layer(h))
    return ((h - batch["y"]) ** 2).mean()


def vanilla_reference(m: int, w: int, n: int) -> tuple[list[float], nn.Sequential]:
    """Non-pipelined training with gradient accumulation: W(k+1) = W(k) - step(grad at W(k))."""
    model = full_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for k in range(n):
        losses.append(_loss_and_grads(model, global_minibatch(k, m, w)))
        opt.step()
    return losses, model


def delayed_reference(m: int, w: int, n: int) -> tuple[list[float], nn.Sequential]:
    """The paper's single-process 2BW reference: gradient at W_prev, applied to W_cur."""
    current = full_model()
    previous = copy.deepcopy(current)
    opt = torch.optim.Adam(current.parameters(), lr=LR)
    losses = []
    for k in range(n):
        losses.append(_loss_and_grads(previous, global_minibatch(k, m, w)))
        snapshot = copy.deepcopy(current)
        for p_cur, p_prev in zip(current.parameters(), previous.parameters()):
            p_cur.grad = p_prev.grad.clone()
        opt.step()
        previous = snapshot
    return losses, current
