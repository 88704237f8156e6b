"""Cluster descriptions the planner reads: presets for common AWS servers, or a JSON file.

A `Hardware` holds the few numbers the cost model needs. They are *effective* numbers
(what a training job achieves), not datasheet peaks; each preset says where its values
come from so a reader can replace them with measured ones (`--hardware FILE.json`, or
the fitted latency and bandwidth of `fit_link` / `calibrated`, which the profiler's
`profile-network` and the planner validation's calibration write).

Communication follows the alpha-beta (latency-bandwidth) model, Hockney's
`t = alpha + bytes / bandwidth` for one message, per collective:

    ring all-reduce of B bytes over n ranks:  alpha_coll + 2 (n - 1) / n * B / bus bandwidth
    point-to-point transfer of B bytes:       alpha_p2p  + B / bandwidth

with alpha per collective (a fixed cost every all-reduce pays whatever its size: kernel
launch, synchronisation, the ring's hop latencies) and per transfer, each inside a server
and across servers.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Sequence

GB = 1e9
GBIT = 1e9 / 8
US = 1e-6


@dataclass(frozen=True)
class FabricLatency:
    """Fixed cost of one collective and of one point-to-point transfer on a fabric, in µs."""

    collective_us: float
    p2p_us: float
    source: str


# Defaults where nothing was measured. NCCL's own tuning model (src/graph/tuning.cc,
# ncclTopoTuneModel) prices a ring all-reduce's latency as base + 2 (n - 1) x hop: base
# 3.6 µs (ring, LL protocol), hop 0.47 µs over NVLink and 2.7 µs over the network, i.e.
# ~10 µs for 8 GPUs on NVLink and ~30 µs once 2 servers are in the ring (their intra-node
# hops x 1.8); one transfer is about a kernel launch plus a hop. EFA's and TCP's per-message
# latencies are several times InfiniBand's. gloo between CPU processes on one machine
# pays far more per call than for its bytes: the planner validation's calibration
# (docs/results/planner_validation/report_head_to_head_run9.json, `calibration`) fitted
# 443 µs per all-reduce and 121 µs per transfer (a 131 kB all-reduce took 0.44 ms, its
# bytes alone 0.09 ms), a `profile-network` run 228 µs and 55 µs (docs/planner.md,
# "Network profile"); the default sits between the two, which move with the machine's load.
FABRICS: dict[str, FabricLatency] = {
    "nvlink": FabricLatency(10.0, 5.0, "NCCL tuning model, ring LL over NVLink, 8 GPUs"),
    "infiniband": FabricLatency(30.0, 10.0, "NCCL tuning model, ring LL, 2 servers"),
    "efa": FabricLatency(50.0, 20.0, "EFA (libfabric) messages: a few x InfiniBand's"),
    "tcp": FabricLatency(100.0, 50.0, "NCCL over TCP sockets (no EFA/RDMA)"),
    "gloo-loopback": FabricLatency(330.0, 100.0, "this project's gloo calibration (2 CPU "
                                   "processes); calibrate rather than trust"),
}


@dataclass(frozen=True)
class Hardware:
    """One homogeneous cluster of servers ("nodes"), each with the same accelerators."""

    name: str
    """Label shown in the plan."""
    devices_per_node: int
    """Accelerators per server; tensor-parallel groups stay inside one server."""
    memory_per_device_gb: float
    """Device memory in GB (1e9 bytes) per accelerator."""
    achieved_tflops: float
    """Dense fp16/bf16 matmul TFLOP/s one device achieves in training (not the peak)."""
    intra_node_bandwidth_gb_s: float
    """Effective per-device bandwidth inside a server (NVLink / NVSwitch), GB/s."""
    inter_node_bandwidth_gbit_s: float
    """Network bandwidth of one server (all its NICs together), Gbit/s, as AWS quotes it."""
    memory_bandwidth_gb_s: float = 900.0
    """Device memory (HBM) bandwidth, GB/s: bounds the optimizer step, which is memory-bound."""
    reserved_memory_gb: float = 1.0
    """Memory a job cannot use for tensors: CUDA context, NCCL buffers, allocator slack."""
    layer_overhead_ms: float = 0.1
    """Fixed time per transformer layer per forward pass (kernel launches, tiny ops) that a
    FLOP count misses; backward pays twice this. Only used without a profile."""
    intra_node_latency_us: float = FABRICS["nvlink"].collective_us
    """Fixed cost of one collective (all-reduce, all-gather) inside a server, µs: the alpha
    of `t = alpha + bytes x beta`; NVLink's by default (`FABRICS`)."""
    inter_node_latency_us: float = FABRICS["infiniband"].collective_us
    """The same for a collective whose group spans servers, µs."""
    intra_node_p2p_latency_us: float = FABRICS["nvlink"].p2p_us
    """Fixed cost of one point-to-point transfer inside a server, µs."""
    inter_node_p2p_latency_us: float = FABRICS["infiniband"].p2p_us
    """The same between servers, µs."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and (not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"hardware field {f.name} must be a non-negative number, "
                                 f"got {value!r}")
        if self.devices_per_node < 1 or self.memory_per_device_gb <= 0 or self.achieved_tflops <= 0:
            raise ValueError("hardware needs devices_per_node >= 1, memory_per_device_gb > 0 "
                             "and achieved_tflops > 0")
        if self.intra_node_bandwidth_gb_s <= 0 or self.inter_node_bandwidth_gbit_s <= 0:
            raise ValueError("hardware bandwidths must be > 0")

    @property
    def memory_bytes(self) -> float:
        return self.memory_per_device_gb * GB

    @property
    def usable_memory_bytes(self) -> float:
        return (self.memory_per_device_gb - self.reserved_memory_gb) * GB

    @property
    def flops_per_s(self) -> float:
        return self.achieved_tflops * 1e12

    @property
    def intra_bytes_per_s(self) -> float:
        return self.intra_node_bandwidth_gb_s * GB

    @property
    def inter_bytes_per_s(self) -> float:
        return self.inter_node_bandwidth_gbit_s * GBIT

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.memory_bandwidth_gb_s * GB

    def collective_latency_s(self, crosses_servers: bool) -> float:
        """alpha of one collective, seconds."""
        return (self.inter_node_latency_us if crosses_servers else self.intra_node_latency_us) * US

    def p2p_latency_s(self, crosses_servers: bool) -> float:
        """alpha of one point-to-point transfer, seconds."""
        return (self.inter_node_p2p_latency_us if crosses_servers
                else self.intra_node_p2p_latency_us) * US

    def to_dict(self) -> dict:
        return asdict(self)


# Sources: AWS instance pages (devices, memory, network); NVIDIA datasheets (NVLink, HBM).
# Achieved TFLOP/s: the PipeDream-2BW paper measured ~45 TFLOP/s per V100 on a 355M GPT
# (docs/pipedream-2bw.md section 5); Megatron-LM (Narayanan et al., SC21) reports 138-163
# TFLOP/s per A100; ~400 TFLOP/s per H100 is ~40% of its 989 TFLOP/s dense bf16 peak.
# Intra-node bandwidths are NCCL all-reduce bus bandwidths one can expect (about half the
# NVLink/NVSwitch aggregate), not the aggregate.
# Latencies: NVLink inside every server (`FABRICS`); between servers TCP sockets on
# p3.16xlarge (no EFA) and EFA on p4d / p5.


def _latencies(intra: str, inter: str) -> dict[str, float]:
    a, b = FABRICS[intra], FABRICS[inter]
    return {"intra_node_latency_us": a.collective_us, "intra_node_p2p_latency_us": a.p2p_us,
            "inter_node_latency_us": b.collective_us, "inter_node_p2p_latency_us": b.p2p_us}


PRESETS: dict[str, Hardware] = {
    "p3.16xlarge": Hardware(
        name="p3.16xlarge", devices_per_node=8, memory_per_device_gb=16.0, achieved_tflops=45.0,
        intra_node_bandwidth_gb_s=100.0, inter_node_bandwidth_gbit_s=25.0,
        memory_bandwidth_gb_s=900.0, reserved_memory_gb=1.0, layer_overhead_ms=0.1,
        **_latencies("nvlink", "tcp")),
    "p4d.24xlarge": Hardware(
        name="p4d.24xlarge", devices_per_node=8, memory_per_device_gb=40.0, achieved_tflops=150.0,
        intra_node_bandwidth_gb_s=230.0, inter_node_bandwidth_gbit_s=400.0,
        memory_bandwidth_gb_s=1555.0, reserved_memory_gb=1.5, layer_overhead_ms=0.05,
        **_latencies("nvlink", "efa")),
    "p5.48xlarge": Hardware(
        name="p5.48xlarge", devices_per_node=8, memory_per_device_gb=80.0, achieved_tflops=400.0,
        intra_node_bandwidth_gb_s=400.0, inter_node_bandwidth_gbit_s=3200.0,
        memory_bandwidth_gb_s=3350.0, reserved_memory_gb=2.0, layer_overhead_ms=0.03,
        **_latencies("nvlink", "efa")),
}


# ---------------------------------------------------------------- calibration (pure)

MIN_SECONDS_PER_BYTE = 1e-15  # 1 PB/s: "bandwidth not resolved", never a division by 0


@dataclass(frozen=True)
class LinkFit:
    """`t = latency_s + bytes x seconds_per_byte`, fitted to timings of one operation
    (a collective over a fixed group, or a transfer) at several message sizes."""

    latency_s: float
    seconds_per_byte: float
    points: int
    max_rel_residual: float
    """Largest |fitted - measured| / measured over the timings: how linear they were."""

    def time_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes * self.seconds_per_byte


def fit_link(samples: Sequence[tuple[float, float]], relative: bool = True) -> LinkFit:
    """Least-squares fit of `t = alpha + bytes x beta` to (bytes, seconds) samples.

    `relative` weighs each sample by 1 / t (minimises the relative residuals), so a
    17 MB message does not drown the microsecond ones that decide alpha; either way
    noise-free timings are recovered exactly. Needs 2 or more distinct sizes. A negative
    alpha (noise around a pure-bandwidth link) is clamped to 0 and beta refitted through
    the origin; a non-positive beta (timings that do not grow with size: noise on a
    latency-bound link) gives alpha = the fastest timing and beta from the largest message,
    at least MIN_SECONDS_PER_BYTE.
    """
    pts = [(float(x), float(t)) for x, t in samples]
    if len({x for x, _ in pts}) < 2 or any(t <= 0 or x < 0 for x, t in pts):
        raise ValueError("fit_link needs positive timings at 2 or more distinct message sizes, "
                         f"got {samples!r}")
    w = [1.0 / t if relative else 1.0 for _, t in pts]
    # weighted normal equations of [1, x] . (alpha, beta) = t, weights w^2
    s0 = sum(wi * wi for wi in w)
    s1 = sum(wi * wi * x for wi, (x, _) in zip(w, pts))
    s2 = sum(wi * wi * x * x for wi, (x, _) in zip(w, pts))
    t0 = sum(wi * wi * t for wi, (_, t) in zip(w, pts))
    t1 = sum(wi * wi * x * t for wi, (x, t) in zip(w, pts))
    det = s0 * s2 - s1 * s1
    alpha, beta = (s2 * t0 - s1 * t1) / det, (s0 * t1 - s1 * t0) / det
    if alpha < 0:
        alpha, beta = 0.0, t1 / s2
    if beta <= 0:  # noise hides the bandwidth at these sizes: latency-bound, as measured
        alpha = min(t for _, t in pts)
        big, t_big = max(pts)
        beta = max((t_big - alpha) / big, MIN_SECONDS_PER_BYTE) if big else MIN_SECONDS_PER_BYTE
    worst = max(abs(alpha + beta * x - t) / t for x, t in pts)
    return LinkFit(alpha, beta, len(pts), worst)


def calibrated(hw: Hardware, *, allreduce: LinkFit | None = None, group_size: int = 2,
               p2p: LinkFit | None = None, inter_node: bool = False) -> Hardware:
    """`hw` with the latency and bandwidth of one level (inside a server, or across
    servers with `inter_node`) taken from fits: the all-reduce fit over `group_size` ranks
    gives the collective latency and the bus bandwidth (beta = 2 (n - 1) / n / bus
    bandwidth, the ring's bytes per rank), the transfer fit the point-to-point latency."""
    changes: dict[str, float] = {}
    level = "inter_node" if inter_node else "intra_node"
    if allreduce is not None:
        if group_size < 2:
            raise ValueError("an all-reduce fit needs a group of 2 or more ranks")
        bus = 2.0 * (group_size - 1) / group_size / allreduce.seconds_per_byte
        changes[f"{level}_latency_us"] = round(allreduce.latency_s / US, 3)
        if inter_node:
            changes["inter_node_bandwidth_gbit_s"] = round(bus / GBIT, 4)
        else:
            changes["intra_node_bandwidth_gb_s"] = round(bus / GB, 4)
    if p2p is not None:
        changes[f"{level}_p2p_latency_us"] = round(p2p.latency_s / US, 3)
    return replace(hw, **changes)


@dataclass(frozen=True)
class LaunchEnv:
    """How a job starts on a cluster, beside the numbers the cost model reads. The emitted
    launches (`planner/launch.py`) need it: Slurm allocates GPUs only when asked
    (`--gpus-per-node`), and NCCL reaches EFA only with the environment below."""

    gpus: bool = True
    """The devices are GPUs (sbatch asks for them); False for CPU processes (gloo)."""
    env: tuple[tuple[str, str], ...] = ()
    """Variables every process of a multi-node job needs, in order."""
    source: str = ""
    """Where `env` comes from, written next to it in the emitted scripts."""


# EFA with NCCL on p4d/p5 (aws-ofi-nccl's "EFA cheatsheet", and the EC2 guide's NCCL test):
# FI_PROVIDER=efa selects libfabric's EFA provider (aws-ofi-nccl <= 1.5.0 needs it, later
# versions pick EFA themselves); FI_EFA_USE_DEVICE_RDMA=1 turns on GPUDirect RDMA (needed
# by aws-ofi-nccl 1.6.x, on by default since 1.7.0). Both are harmless with current
# versions. NCCL_PROTO=simple is left out: only for <= 1.5.0, it costs bandwidth after.
EFA_SOURCE = ("https://github.com/aws/aws-ofi-nccl/blob/master/doc/efa-env-var.md; "
              "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-start-nccl.html")
EFA_ENV = (("FI_PROVIDER", "efa"), ("FI_EFA_USE_DEVICE_RDMA", "1"))

# p3.16xlarge has no EFA (p3dn.24xlarge does): NCCL uses TCP sockets, nothing to set.
LAUNCH_PRESETS: dict[str, LaunchEnv] = {
    "p3.16xlarge": LaunchEnv(),
    "p4d.24xlarge": LaunchEnv(env=EFA_ENV, source=EFA_SOURCE),
    "p5.48xlarge": LaunchEnv(env=EFA_ENV, source=EFA_SOURCE),
}
LAUNCH_KEY = "launch"
"""The optional key of a hardware JSON file holding its `LaunchEnv`:
{"gpus": bool, "env": {"NAME": "value", ...}}."""


def _read_json(spec: str) -> dict:
    """A hardware file's JSON object; ValueError with a one-line reason."""
    path = Path(spec)
    if not path.suffix == ".json" and not path.exists():
        raise ValueError(f"unknown hardware {spec!r}: use a preset ({', '.join(PRESETS)}) "
                         "or a FILE.json")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read hardware file {spec}: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"hardware file {spec} must hold a JSON object")
    return data


def load_launch_env(spec: str) -> LaunchEnv:
    """The launch environment of a preset, or the "launch" object of a hardware file
    (default: GPUs, no variables). ValueError with a one-line reason."""
    if spec in LAUNCH_PRESETS:
        return LAUNCH_PRESETS[spec]
    launch = _read_json(spec).get(LAUNCH_KEY, {})
    gpus = launch.get("gpus", True) if isinstance(launch, dict) else None
    env = launch.get("env", {}) if isinstance(launch, dict) else None
    if (not isinstance(gpus, bool) or not isinstance(env, dict) or set(launch) - {"gpus", "env"}
            or not all(k.isidentifier() and isinstance(v, str) for k, v in env.items())):
        raise ValueError(f'hardware file {spec}: "{LAUNCH_KEY}" must be '
                         '{"gpus": true|false, "env": {"NAME": "value", ...}}')
    return LaunchEnv(gpus=gpus, env=tuple(env.items()), source=f"hardware file {Path(spec).name}")


def load_hardware(spec: str) -> Hardware:
    """A preset name, or a path to a JSON file holding `Hardware`'s fields.

    A JSON file may omit the fields that have defaults; `name` defaults to the file name;
    its "launch" object is read by `load_launch_env`. Raises ValueError with a one-line
    reason.
    """
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    data = _read_json(spec)
    data.pop(LAUNCH_KEY, None)
    known = {f.name for f in fields(Hardware)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"hardware file {spec}: unknown fields {unknown}; known: {sorted(known)}")
    data.setdefault("name", path.stem)
    try:
        return Hardware(**data)
    except TypeError as err:
        raise ValueError(f"hardware file {spec}: {err}") from None
