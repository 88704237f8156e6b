"""Per-layer compute times and sizes: from a measured profile, or estimated from FLOPs.

Both sources answer the same questions for one device: forward/backward seconds of one
rank's share of a transformer layer, the embedding and the output layer at microbatch size
b and tensor-parallel size tp, compute only (the cost model adds the communication), and
activation bytes. The profile JSON is written by `python -m megatron_2bw.planner profile`
(see `profile.py`); reading it needs no torch.

Why tp is a question and not a division: a tensor-parallel rank computes its share of the
GEMMs and attention heads, but also the whole LayerNorms, residual adds, dropouts and bias
adds of the [s, b, h] activation, and the kernel launches, which tensor parallelism does
not split. A profile measured at tp = 1 and at some tp = k (`--tensor-parallel-sizes`)
fits each time to `u + s / tp` (unsplit + split, `amdahl_time`); a profile measured at
tp = 1 only, and the FLOPs estimate, keep the old `time / tp` (the FLOPs estimate's fixed
per-layer overhead is not split).

Context parallelism (`cp`) gives each rank s/c of every sequence: its share of a layer's
work is 1/c (the linear parts by tokens, the core attention its s/c queries against all s
keys, load-balanced over causal chunks), so every time is the time at cp = 1 / c (the
FLOPs estimate keeps its fixed per-layer overhead whole); sequence parallelism changes no
FLOPs. Activation bytes take sequence parallelism (`sp`) and `cp` as Korthikanti et al.'s
formula does (`ModelShape.layer_activation_bytes`).
"""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .hardware import Hardware
from ..shape import ModelShape

PROFILE_FORMAT = "megatron-2bw-profile/1"


class LayerModel(Protocol):
    """What the cost model asks about compute; times in seconds, sizes in bytes."""

    source: str

    def layer_forward_s(self, b: int, tp: int = 1, cp: int = 1) -> float: ...
    def layer_backward_s(self, b: int, tp: int = 1, cp: int = 1) -> float: ...
    def layer_recompute_backward_s(self, b: int, tp: int = 1, cp: int = 1) -> float: ...
    def embedding_s(self, b: int, cp: int = 1) -> tuple[float, float]: ...
    def output_s(self, b: int, tp: int = 1, cp: int = 1) -> tuple[float, float]: ...
    def layer_activation_bytes(self, b: int, tp: int, *, sp: bool = False,
                               cp: int = 1) -> float: ...
    def layer_selective_activation_bytes(self, b: int, tp: int, *, sp: bool = False,
                                         cp: int = 1) -> float: ...
    def attention_core_forward_s(self, b: int, tp: int = 1, cp: int = 1) -> float: ...


@dataclass(frozen=True)
class FlopsCompute:
    """Compute time = FLOPs / achieved FLOP/s + a fixed per-layer overhead.

    FLOPs: Narayanan et al. SC21 (see `ModelShape.layer_forward_flops`); backward = 2x
    forward; full recomputation runs the forward again inside backward, which is where
    the paper's "about 4/3" comes from ((1 + 2 + 1) / 3); selective recomputation runs
    only the core attention's 4bs^2h again. Embedding lookups are free.
    """

    model: ModelShape
    hardware: Hardware
    source: str = "flops"

    def layer_forward_s(self, b: int, tp: int = 1, cp: int = 1) -> float:
        return (self.model.layer_forward_flops(b) / (tp * cp) / self.hardware.flops_per_s
                + self.hardware.layer_overhead_ms * 1e-3)

    def layer_backward_s(self, b: int, tp: int = 1, cp: int = 1) -> float:
        return 2.0 * self.layer_forward_s(b, tp, cp)

    def layer_recompute_backward_s(self, b: int, tp: int = 1, cp: int = 1) -> float:
        return self.layer_backward_s(b, tp, cp) + self.layer_forward_s(b, tp, cp)

    def embedding_s(self, b: int, cp: int = 1) -> tuple[float, float]:
        return 0.0, 0.0

    def output_s(self, b: int, tp: int = 1, cp: int = 1) -> tuple[float, float]:
        forward = self.model.output_forward_flops(b) / (tp * cp) / self.hardware.flops_per_s
        return forward, 2.0 * forward

    def layer_activation_bytes(self, b: int, tp: int, *, sp: bool = False,
                               cp: int = 1) -> float:
        return self.model.layer_activation_bytes(b, tp, sp=sp, cp=cp)

    def layer_selective_activation_bytes(self, b: int, tp: int, *, sp: bool = False,
                                         cp: int = 1) -> float:
        return self.model.layer_selective_activation_bytes(b, tp, sp=sp, cp=cp)

    def attention_core_forward_s(self, b: int, tp: int = 1, cp: int = 1) -> float:
        """QK^T and attention over V (4bs^2h FLOPs, / c: s/c queries against s keys),
        what selective recomputation repeats; no per-layer overhead: it is a few kernels
        inside a layer already counted."""
        return (self.model.attention_core_forward_flops(b) / (tp * cp)
                / self.hardware.flops_per_s)


@dataclass(frozen=True)
class PartTiming:
    """One measured module (layer, embedding or output layer) at one microbatch size."""

    forward_s: float
    backward_s: float
    recompute_backward_s: float = 0.0
    activation_bytes_float: float = 0.0
    """Bytes of floating-point tensors saved for backward (scaled to the plan's dtype)."""
    activation_bytes_other: float = 0.0
    """Bytes of other saved tensors (dropout masks, indices): not scaled."""
    input_bytes: float = 0.0


@dataclass(frozen=True)
class ProfileEntry:
    micro_batch_size: int
    layer: PartTiming
    embedding: PartTiming
    output: PartTiming


LOSS_ALLREDUCES = 3
"""Forward all-reduces of megatron-core's vocab-parallel cross entropy (tp > 1): the
max logit, the target logit and the sum of exponentials, [s, b] fp32 each."""

_ALLREDUCES_INSIDE = {("layer", "forward_s"): (2, 0), ("layer", "backward_s"): (2, 0),
                      ("layer", "recompute_backward_s"): (4, 0),
                      ("output", "forward_s"): (0, LOSS_ALLREDUCES),
                      ("output", "backward_s"): (1, 0)}
"""(all-reduces of [s, b, h], of the loss's [s, b]) inside each timed piece at tp > 1."""


@dataclass(frozen=True)
class TensorParallelEntry:
    """The same pieces measured at tensor-parallel size k, in k processes, each timing
    its own share; the times include the all-reduces the pieces run, which are measured
    apart (`allreduce_s`: one of the [s, b, h] activation, `loss_allreduce_s`: one of the
    loss's [s, b] fp32) so that the reader can take them out (`compute_part`)."""

    micro_batch_size: int
    layer: PartTiming
    output: PartTiming
    allreduce_s: float
    loss_allreduce_s: float

    def compute_part(self, part: str, name: str) -> float:
        """Measured seconds less the all-reduces megatron-core runs inside them: a layer
        does 2 in forward and 2 in backward (4 with full recomputation), the output side
        3 small ones in forward (the vocab-parallel loss) and 1 in backward."""
        measured = getattr(getattr(self, part), name)
        big, small = _ALLREDUCES_INSIDE[(part, name)]
        return max(0.0, measured - big * self.allreduce_s - small * self.loss_allreduce_s)


def _part_dict(p: PartTiming) -> dict:
    return dict(p.__dict__)


@dataclass(frozen=True)
class Profile:
    """Measurements of one model shape on one device, at several microbatch sizes, and
    optionally at tensor-parallel sizes above 1 (`tensor_parallel`: k -> entries)."""

    device: str
    dtype_bytes: int
    model: dict
    entries: tuple[ProfileEntry, ...]
    params: dict = field(default_factory=dict)
    tensor_parallel: dict = field(default_factory=dict)
    """{k: tuple of TensorParallelEntry sorted by microbatch size}"""

    def matches(self, spec: ModelShape) -> list[str]:
        """Model fields that differ between the profile and `spec` (empty: usable)."""
        wanted = {"hidden_size": spec.hidden_size, "ffn_hidden_size": spec.ffn_size,
                  "num_attention_heads": spec.num_attention_heads,
                  "seq_length": spec.seq_length, "model": spec.model}
        return [f"{k}: profile {self.model.get(k)!r} vs plan {v!r}" for k, v in wanted.items()
                if self.model.get(k) != v]

    def to_dict(self) -> dict:
        out = {"format": PROFILE_FORMAT, "device": self.device, "dtype_bytes": self.dtype_bytes,
               "model": self.model, "params": self.params,
               "entries": [{"micro_batch_size": e.micro_batch_size,
                            "layer": _part_dict(e.layer), "embedding": _part_dict(e.embedding),
                            "output": _part_dict(e.output)} for e in self.entries]}
        if self.tensor_parallel:
            out["tensor_parallel"] = {
                str(k): [{"micro_batch_size": e.micro_batch_size, "layer": _part_dict(e.layer),
                          "output": _part_dict(e.output), "allreduce_s": e.allreduce_s,
                          "loss_allreduce_s": e.loss_allreduce_s} for e in entries]
                for k, entries in sorted(self.tensor_parallel.items())}
        return out


def tensor_parallel_entries(data: dict) -> dict:
    """The optional `tensor_parallel` section of a profile JSON."""
    return {int(k): tuple(sorted((TensorParallelEntry(int(e["micro_batch_size"]),
                                                      PartTiming(**e["layer"]),
                                                      PartTiming(**e["output"]),
                                                      float(e["allreduce_s"]),
                                                      float(e["loss_allreduce_s"]))
                                  for e in entries), key=lambda e: e.micro_batch_size))
            for k, entries in data.get("tensor_parallel", {}).items()}


def load_profile(path: str) -> Profile:
    """Read a profile JSON; ValueError with a one-line reason when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read profile {path}: {err}") from None
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{path} is not a {PROFILE_FORMAT} file")
    try:
        profile = profile_from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ValueError(f"profile {path} is malformed: {err}") from None
    if not profile.entries:
        raise ValueError(f"profile {path} has no measurements")
    return profile


def profile_from_dict(data: dict) -> Profile:
    """A `Profile` from its JSON dict (`Profile.to_dict`); KeyError etc. when malformed."""
    entries = tuple(sorted((ProfileEntry(int(e["micro_batch_size"]), PartTiming(**e["layer"]),
                                         PartTiming(**e["embedding"]),
                                         PartTiming(**e["output"]))
                            for e in data["entries"]), key=lambda e: e.micro_batch_size))
    return Profile(str(data["device"]), int(data["dtype_bytes"]), dict(data["model"]),
                   entries, dict(data.get("params", {})), tensor_parallel_entries(data))


def amdahl_time(points: list[tuple[int, float]], tp: int) -> float:
    """Seconds at tensor-parallel size `tp` from measured (size, seconds) points, one of
    them at size 1: least squares of `u + s / size` (u: what tensor parallelism does not
    split, s: what it does), both kept non-negative; a measured size is returned as is."""
    for size, seconds in points:
        if size == tp:
            return seconds
    xs = [1.0 / size for size, _ in points]
    ys = [seconds for _, seconds in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    split = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else my
    split = max(0.0, split)
    unsplit = max(0.0, my - split * mx)
    return unsplit + split / tp


def _interpolate(xs: list[int], ys: list[float], b: int) -> float:
    """Piecewise-linear in b; outside the measured range, proportional to the nearest point
    (time per sample held constant), which is what a saturated device does."""
    if b <= xs[0]:
        return ys[0] * b / xs[0]
    if b >= xs[-1]:
        return ys[-1] * b / xs[-1]
    i = bisect.bisect_left(xs, b)
    if xs[i] == b:
        return ys[i]
    w = (b - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i - 1] * (1 - w) + ys[i] * w


@dataclass(frozen=True)
class ProfiledCompute:
    """Compute times from a profile, activation bytes from it scaled to fp16 and to tp.

    Times at tp > 1: `amdahl_time` over the profile's tp = 1 entry and its tensor-parallel
    entries (all-reduces taken out), or the tp = 1 time / tp when it has none; at
    context-parallel size cp, / cp (the profile is measured on whole sequences). Activation
    bytes are measured at tp = 1 and scaled to (tp, sp, cp) by the ratio of Korthikanti et
    al.'s formula there and at tp = 1 (the part of a layer's activations that tensor,
    sequence and context parallelism split).
    """

    profile: Profile
    model: ModelShape
    activation_bytes: int = 2
    source: str = "profile"

    def _series(self, part: str, name: str) -> tuple[list[int], list[float]]:
        xs = [e.micro_batch_size for e in self.profile.entries]
        return xs, [getattr(getattr(e, part), name) for e in self.profile.entries]

    def _at(self, part: str, name: str, b: int, tp: int = 1, cp: int = 1) -> float:
        if cp > 1:
            return self._at(part, name, b, tp) / cp
        single = _interpolate(*self._series(part, name), b)
        if tp == 1:
            return single
        if not self.profile.tensor_parallel:
            return single / tp
        points = [(1, single)]
        for k, entries in sorted(self.profile.tensor_parallel.items()):
            xs = [e.micro_batch_size for e in entries]
            points.append((k, _interpolate(xs, [e.compute_part(part, name) for e in entries], b)))
        return amdahl_time(points, tp)

    def layer_forward_s(self, b: int, tp: int = 1, cp: int = 1) -> float:
        return self._at("layer", "forward_s", b, tp, cp)

    def layer_backward_s(self, b: int, tp: int = 1, cp: int = 1) -> float:
        return self._at("layer", "backward_s", b, tp, cp)

    def layer_recompute_backward_s(self, b: int, tp: int = 1, cp: int = 1) -> float:
        if self._at("layer", "recompute_backward_s", b) > 0:
            return self._at("layer", "recompute_backward_s", b, tp, cp)
        return self.layer_backward_s(b, tp, cp) + self.layer_forward_s(b, tp, cp)

    def embedding_s(self, b: int, cp: int = 1) -> tuple[float, float]:
        return (self._at("embedding", "forward_s", b, 1, cp),
                self._at("embedding", "backward_s", b, 1, cp))

    def output_s(self, b: int, tp: int = 1, cp: int = 1) -> tuple[float, float]:
        return (self._at("output", "forward_s", b, tp, cp),
                self._at("output", "backward_s", b, tp, cp))

    def layer_activation_bytes(self, b: int, tp: int, *, sp: bool = False,
                               cp: int = 1) -> float:
        scale = self.activation_bytes / self.profile.dtype_bytes
        measured = (self._at("layer", "activation_bytes_float", b) * scale
                    + self._at("layer", "activation_bytes_other", b))
        return (measured * self.model.layer_activation_bytes(b, tp, sp=sp, cp=cp)
                / self.model.layer_activation_bytes(b, 1))

    def layer_selective_activation_bytes(self, b: int, tp: int, *, sp: bool = False,
                                         cp: int = 1) -> float:
        """The measured bytes scaled by Korthikanti et al.'s selective / full ratio (the
        profile does not measure selective recomputation; the ratio keeps the measured
        level and the formula's share of the s^2 terms)."""
        spec = self.model
        return (self.layer_activation_bytes(b, tp, sp=sp, cp=cp)
                * spec.layer_selective_activation_bytes(b, tp, sp=sp, cp=cp)
                / spec.layer_activation_bytes(b, tp, sp=sp, cp=cp))

    def attention_core_forward_s(self, b: int, tp: int = 1, cp: int = 1) -> float:
        """The measured forward times the core attention's share of the layer's FLOPs."""
        spec = self.model
        return (self.layer_forward_s(b, tp, cp) * spec.attention_core_forward_flops(b)
                / spec.layer_forward_flops(b))
