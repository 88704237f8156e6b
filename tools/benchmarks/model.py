"""The stage modules both systems run: a stack of pre-norm MLP blocks.

The same `build_blocks` (same seed, same shapes) feeds our engine through `EngineStage`
(`module(input_or_None, batch)`, loss inside on the last stage) and
torch.distributed.pipelining through `TorchStage` (`module(x)`, loss in the schedule's
`loss_fn`). Only the blocks run under the activation meter, so the loss is counted for
neither system.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import BenchConfig
from .memory import SavedTensorMeter


class Block(nn.Module):
    """x + W2 gelu(W1 layernorm(x)): a transformer MLP sublayer."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def build_blocks(cfg: BenchConfig, stage: int, num_stages: int | None = None) -> nn.Sequential:
    """Blocks of `stage` (all stages' blocks when num_stages is 1), seeded per block."""
    count = cfg.blocks_per_stage * (cfg.stages if num_stages == 1 else 1)
    first = 0 if num_stages == 1 else stage * cfg.blocks_per_stage
    blocks = []
    for idx in range(first, first + count):
        torch.manual_seed(cfg.seed + idx)
        blocks.append(Block(cfg.hidden))
    return nn.Sequential(*blocks)


def build_chunk_blocks(cfg: BenchConfig, virtual_stage: int, chunks: int) -> nn.Sequential:
    """Blocks of one virtual stage when each of the cfg.stages ranks holds `chunks` of
    them: blocks_per_stage / chunks consecutive blocks, the same blocks (global index,
    seed) `build_blocks` gives, so every system trains the same d * blocks_per_stage
    blocks whatever its placement of them."""
    if cfg.blocks_per_stage % chunks:
        raise ValueError(f"blocks_per_stage={cfg.blocks_per_stage} does not split into "
                         f"{chunks} chunks")
    per = cfg.blocks_per_stage // chunks
    blocks = []
    for idx in range(virtual_stage * per, (virtual_stage + 1) * per):
        torch.manual_seed(cfg.seed + idx)
        blocks.append(Block(cfg.hidden))
    return nn.Sequential(*blocks)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


class EngineStage(nn.Module):
    """Our executor's stage protocol around the blocks."""

    def __init__(self, blocks: nn.Sequential, first: bool, last: bool, meter: SavedTensorMeter):
        super().__init__()
        self.blocks, self.first, self.last = blocks, first, last
        self.meter = meter

    def forward(self, inp: torch.Tensor | None, batch: dict) -> torch.Tensor:
        h = batch["x"] if self.first else inp
        with self.meter.scope():
            h = self.blocks(h)
        return mse(h, batch["y"]) if self.last else h


class EngineChunks(nn.Module):
    """A rank's model chunks for our executor's interleaved schedules (`module.chunks`)."""

    def __init__(self, chunks: list[EngineStage]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)


class TorchStage(nn.Module):
    """torch.distributed.pipelining's stage protocol around the same blocks."""

    def __init__(self, blocks: nn.Sequential, meter: SavedTensorMeter):
        super().__init__()
        self.blocks, self.meter = blocks, meter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.meter.scope():
            return self.blocks(x)


def microbatch_pool(cfg: BenchConfig, m: int, device: torch.device) -> list[dict]:
    """m deterministic microbatches (x, y); runs cycle through them (values do not matter)."""
    g = torch.Generator().manual_seed(cfg.seed)
    shape = (cfg.microbatch_size, cfg.hidden)
    return [{"x": torch.randn(shape, generator=g).to(device),
             "y": torch.randn(shape, generator=g).to(device)} for _ in range(m)]
