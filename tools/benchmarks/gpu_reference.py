"""A plain-PyTorch GPT training loop: what the GPU check measures our trainer against.

    PYTHONPATH=tools python -m benchmarks.gpu_reference [--layers 24 --hidden 2048
        --heads 16 --seq 2048 --vocab 50257 --micro 2 --m 4] [--iters 8 --skip 3]
        [--variants eager,compiled] [--dropout 0] [--compile-backend inductor]
        [--json OUT.json] [--tiny]

The GPU check asks our trainer for at least 0.9x the speed of what PyTorch alone reaches on
the same GPT. That ratio means something only against a strong reference, so this loop
is what a careful user writes around PyTorch for the model Megatron-LM's GPT defaults
describe, with every choice no slower than ../shared/bench/gpu_anchor.py's (the loop
that first measured the gap; tools/gpu_check.sh runs both, so the summary shows it):

- pre-LN layers with biases: LayerNorm, fused QKV projection, causal attention through
  `F.scaled_dot_product_attention(is_causal=True)` (PyTorch's flash / memory-efficient
  kernels, never the s x s scores in memory), output projection; LayerNorm, MLP h -> 4h
  -> h with the tanh GELU (Megatron-LM's default `--bias-gelu-fusion`), a final
  LayerNorm; learned position embeddings; the output layer is the word embedding
  (tied, Megatron's default), so there is one V x h matrix to step, not two;
- bf16 autocast over fp32 weights, the loss (cross-entropy) on fp32 logits;
- AdamW, fused on CUDA; m microbatches of gradient accumulation per step;
- dropout after the embeddings, the attention projection and the MLP, and inside
  attention, all `--dropout` (default 0: no dropout kernel runs at all);
- built directly on the device (no CPU initialisation to wait for); every microbatch
  already on the device, so the time is the model's and the optimizer's only.

Variants: `eager`, and `compiled` (torch.compile of the whole model; its first
iterations, which compile, fall among the `--skip` warm-up ones). Each variant prints one
JSON line and the list so far goes to `--json` after every variant, so a variant cut
short by a time limit leaves the ones before it. Seconds per iteration is the median over
the iterations after `--skip`; TFLOP/s uses Megatron-LM's count for a GPT step,
3 * tokens * (L * (24 h^2 + 2 s h) + 2 h V) with V padded as Megatron pads it and the
causal half of the score matrix (what `pretrain_gpt.py` logs,
`megatron_2bw.training.flops.megatron_flops`); MFU is over `--peak-tflops`
(790: a bf16 matmul on the H200). Peak memory is torch.cuda.max_memory_allocated over
the variant (weights, gradients, AdamW state, activations); None on the CPU. Exit
status 1 when a variant failed (its row carries the error).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

VARIANTS = ("eager", "compiled")
H200_BF16_DENSE_TFLOPS = 790.0
INIT_STD = 0.02  # Megatron-LM's --init-method-std
LR = 1e-4
WEIGHT_DECAY = 0.01  # Megatron-LM's default
# --tiny: the dry run's GPT (tools/gpu_check.sh --dry-run trains the same through
# pretrain_gpt.py)
TINY = {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 128, "micro": 2,
        "m": 2, "iters": 4, "skip": 1}


def padded_vocab(vocab: int, divisible_by: int) -> int:
    """Megatron-LM's padding of the vocabulary (one tensor-parallel rank): the next
    multiple of `divisible_by`, as pretrain_gpt.py's --make-vocab-size-divisible-by."""
    return -(-vocab // divisible_by) * divisible_by


@dataclass(frozen=True)
class Shape:
    """The GPT and the batch of one training step."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    """Rows of the word embedding: already padded (`padded_vocab`)."""
    micro: int
    """Samples per microbatch."""
    microbatches: int
    """m: microbatches accumulated per optimizer step."""

    @property
    def tokens(self) -> int:
        return self.micro * self.microbatches * self.seq

    def flops_per_iteration(self) -> float:
        """Megatron-LM's count for one GPT training step (its log's
        num_floating_point_operations, written per token): forward and backward of the
        layers' matmuls, of the causal half of attention's score matrix, and of the
        logits."""
        h, s = self.hidden, self.seq
        return 3.0 * self.tokens * (self.layers * (24 * h * h + 2 * s * h) + 2 * h * self.vocab)


@dataclass(frozen=True)
class Timing:
    """How a variant is run and measured."""

    iters: int
    skip: int
    """Warm-up iterations left out of the median (compilation, allocator growth)."""
    dropout: float
    peak_tflops: float
    compile_backend: str
    """torch.compile's backend for `compiled`: inductor on a GPU; the dry run takes
    aot_eager (it traces as inductor does, without generating C++ on the CPU)."""


class Layer(nn.Module):
    """One pre-LN transformer layer with biases, causal SDPA and a tanh-GELU MLP."""

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.attn_norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.mlp_in = nn.Linear(hidden, 4 * hidden)
        self.mlp_out = nn.Linear(4 * hidden, hidden)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.dropout, self.training) if self.dropout else x

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        # [b, s, 3h] -> q, k, v as [b, heads, s, head_dim] views (no copy)
        q, k, v = (t.transpose(1, 2) for t in
                   self.qkv(self.attn_norm(x)).unflatten(-1, (3, self.heads, -1)).unbind(2))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.attn_out(y.transpose(1, 2).reshape(b, s, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._drop(self.attention(x))
        hidden = F.gelu(self.mlp_in(self.mlp_norm(x)), approximate="tanh")
        return x + self._drop(self.mlp_out(hidden))


class GPT(nn.Module):
    """Word and learned position embeddings, the layers, a final LayerNorm, and logits
    through the word embedding (tied); forward returns the mean cross-entropy."""

    def __init__(self, shape: Shape, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout
        self.word = nn.Embedding(shape.vocab, shape.hidden)
        self.position = nn.Embedding(shape.seq, shape.hidden)
        self.layers = nn.ModuleList(Layer(shape.hidden, shape.heads, dropout)
                                    for _ in range(shape.layers))
        self.final_norm = nn.LayerNorm(shape.hidden)
        self._init(shape.layers)

    @torch.no_grad()
    def _init(self, layers: int) -> None:
        """Megatron-LM's initialisation: N(0, 0.02) weights, zero biases, and
        N(0, 0.02 / sqrt(2L)) for the two projections that add into the residual."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
            else:
                scaled = name.endswith(("attn_out.weight", "mlp_out.weight"))
                p.normal_(0.0, INIT_STD / math.sqrt(2 * layers) if scaled else INIT_STD)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.word(tokens) + self.position.weight[:tokens.shape[1]]
        if self.dropout:
            x = F.dropout(x, self.dropout, self.training)
        for layer in self.layers:
            x = layer(x)
        logits = F.linear(self.final_norm(x), self.word.weight)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _now(device: torch.device) -> float:
    """Wall time once the device's queued work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def microbatches(shape: Shape, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """m microbatches of random tokens (labels: the next token), drawn once, on the device."""
    g = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(shape.microbatches):
        seq = torch.randint(0, shape.vocab, (shape.micro, shape.seq + 1), generator=g)
        batches.append((seq[:, :-1].to(device), seq[:, 1:].to(device)))
    return batches


def train(model: nn.Module, step_model: nn.Module, shape: Shape, timing: Timing,
          device: torch.device) -> tuple[list[float], list[float]]:
    """`timing.iters` optimizer steps of m accumulated microbatches: each step's seconds
    and loss (the mean over its microbatches)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                  fused=device.type == "cuda")
    data = microbatches(shape, device)
    seconds, losses = [], []
    for _ in range(timing.iters):
        start = _now(device)
        total = torch.zeros((), device=device)
        for tokens, labels in data:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = step_model(tokens, labels) / shape.microbatches
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(_now(device) - start)
        losses.append(total.item())
    return seconds, losses


def run_variant(variant: str, shape: Shape, timing: Timing, device: torch.device) -> dict:
    """Build the model fresh (same seed), train it as `variant`, and measure."""
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with device:
        model = GPT(shape, timing.dropout).train()
    step_model = (torch.compile(model, backend=timing.compile_backend)
                  if variant == "compiled" else model)
    seconds, losses = train(model, step_model, shape, timing, device)
    steady = seconds[timing.skip:] or seconds
    s_per_iter = statistics.median(steady)
    tflops = shape.flops_per_iteration() / s_per_iter / 1e12
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"system": "reference", "variant": variant, "device": _device_name(device),
            "shape": asdict(shape), "parameters": sum(p.numel() for p in model.parameters()),
            "dropout": timing.dropout,
            "compile_backend": timing.compile_backend if variant == "compiled" else None,
            "iterations": len(seconds), "timed_iterations": len(steady),
            "s_per_iter": s_per_iter, "tflops": tflops, "mfu": tflops / timing.peak_tflops,
            "peak_bytes": peak, "peak_gib": None if peak is None else peak / 2 ** 30,
            "first_loss": losses[0], "last_loss": losses[-1]}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _release(variant: str, device: torch.device) -> None:
    """Drop what a variant left (its compiled graphs, cached blocks) before the next."""
    if variant == "compiled":
        import torch._dynamo

        torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(variants: list[str], shape: Shape, timing: Timing, json_path: Optional[Path]) -> int:
    """Every variant in turn; a failure is recorded and the next runs. 1 if any failed."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast, if any
    results, failed = [], False
    for variant in variants:
        try:
            result = run_variant(variant, shape, timing, device)
        except Exception as exc:  # noqa: BLE001 - recorded, and the next variant runs
            logger.exception("variant %s failed", variant)
            result, failed = {"system": "reference", "variant": variant,
                              "error": f"{type(exc).__name__}: {exc}"[:500]}, True
        _release(variant, device)
        results.append(result)
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
        if json_path is not None:
            json_path.write_text(json.dumps(results, indent=1) + "\n")
    return 1 if failed else 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default, what in (("--layers", 24, "transformer layers"),
                                ("--hidden", 2048, "hidden size"),
                                ("--heads", 16, "attention heads"),
                                ("--seq", 2048, "sequence length"),
                                ("--vocab", 50257, "vocabulary (padded as Megatron pads)"),
                                ("--make-vocab-size-divisible-by", 128, "the padding"),
                                ("--micro", 2, "micro-batch size"),
                                ("--m", 4, "microbatches per step"),
                                ("--iters", 8, "optimizer steps per variant"),
                                ("--skip", 3, "warm-up steps left out of the median")):
        p.add_argument(flag, type=int, default=default, help=what)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="hidden and attention dropout (default 0)")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    p.add_argument("--compile-backend", default="inductor", help="torch.compile's backend")
    p.add_argument("--json", type=Path, help="write the results here (after every variant)")
    p.add_argument("--tiny", action="store_true",
                   help="the dry run's tiny GPT (2 layers, hidden 64), 4 steps")
    return p


def _problem(args: argparse.Namespace, variants: list[str]) -> Optional[str]:
    """The first bad flag, in one line, or None."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        return f"--variants {args.variants!r}: give one or more of {', '.join(VARIANTS)}"
    sizes = ("layers", "hidden", "heads", "seq", "vocab", "make_vocab_size_divisible_by",
             "micro", "m", "iters")
    small = [s for s in sizes if getattr(args, s) < 1]
    if small:
        return f"--{small[0].replace('_', '-')} must be at least 1"
    if args.hidden % args.heads:
        return f"--hidden {args.hidden} is not divisible by --heads {args.heads}"
    if not 0 <= args.skip < args.iters:
        return f"--skip {args.skip} must be in [0, --iters {args.iters})"
    if not 0 <= args.dropout < 1:
        return f"--dropout {args.dropout} must be in [0, 1)"
    return None


def main(argv: Optional[list[str]] = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.tiny:
        for key, value in TINY.items():
            setattr(args, key, value)
    variants = [v for v in args.variants.split(",") if v]
    problem = _problem(args, variants)
    if problem:
        p.error(problem)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    shape = Shape(args.layers, args.hidden, args.heads, args.seq,
                  padded_vocab(args.vocab, args.make_vocab_size_divisible_by), args.micro,
                  args.m)
    timing = Timing(args.iters, args.skip, args.dropout, args.peak_tflops,
                    args.compile_backend)
    return run(variants, shape, timing, args.json)


if __name__ == "__main__":
    sys.exit(main())
