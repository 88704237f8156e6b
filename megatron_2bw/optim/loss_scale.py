"""Loss scaling for fp16, with Megatron-LM's flags and semantics.

`--loss-scale S` fixes the scale; otherwise the scale is dynamic: start at
`--initial-loss-scale`, halve after `--hysteresis` overflowing steps (not below
`--min-loss-scale`), double after `--loss-scale-window` clean steps.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LossScaleConfig:
    """Megatron-LM's loss-scale flags (bf16 and fp32 use a constant scale of 1)."""

    loss_scale: float | None = None       # --loss-scale: constant if set
    initial_loss_scale: float = 2.0 ** 32  # --initial-loss-scale
    min_loss_scale: float = 1.0           # --min-loss-scale
    loss_scale_window: int = 1000         # --loss-scale-window
    hysteresis: int = 2                   # --hysteresis
    enabled: bool = False                 # True for --fp16


class LossScaler:
    """The scale state machine; identical on every rank (fed the global overflow flag)."""

    def __init__(self, config: LossScaleConfig):
        self.config = config
        dynamic = config.enabled and config.loss_scale is None
        self.dynamic = dynamic
        self.scale = (config.initial_loss_scale if dynamic else
                      (config.loss_scale if config.enabled and config.loss_scale else 1.0))
        self._growth = 0
        self._hysteresis = config.hysteresis

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self._growth = 0
            self._hysteresis -= 1
            if self._hysteresis <= 0:
                self.scale = max(self.scale / 2.0, self.config.min_loss_scale)
        else:
            self._growth += 1
            if self._growth == self.config.loss_scale_window:
                self._growth = 0
                self._hysteresis = self.config.hysteresis
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth": self._growth, "hysteresis": self._hysteresis}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._growth, self._hysteresis = (state["scale"], state["growth"],
                                                      state["hysteresis"])
