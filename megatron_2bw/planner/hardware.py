"""Cluster descriptions the planner reads: presets for common AWS servers, or a JSON file.

A `Hardware` holds the few numbers the cost model needs. They are *effective* numbers
(what a training job achieves), not datasheet peaks; each preset says where its values
come from so a reader can replace them with measured ones (`--hardware FILE.json`).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

GB = 1e9
GBIT = 1e9 / 8


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

    def to_dict(self) -> dict:
        return asdict(self)


# Sources: AWS instance pages (devices, memory, network); NVIDIA datasheets (NVLink, HBM).
# Achieved TFLOP/s: the PipeDream-2BW paper measured ~45 TFLOP/s per V100 on a 355M GPT
# (docs/pipedream-2bw.md section 5); Megatron-LM (Narayanan et al., SC21) reports 138-163
# TFLOP/s per A100; ~400 TFLOP/s per H100 is ~40% of its 989 TFLOP/s dense bf16 peak.
# Intra-node bandwidths are NCCL all-reduce bus bandwidths one can expect (about half the
# NVLink/NVSwitch aggregate), not the aggregate.
PRESETS: dict[str, Hardware] = {
    "p3.16xlarge": Hardware(
        name="p3.16xlarge", devices_per_node=8, memory_per_device_gb=16.0, achieved_tflops=45.0,
        intra_node_bandwidth_gb_s=100.0, inter_node_bandwidth_gbit_s=25.0,
        memory_bandwidth_gb_s=900.0, reserved_memory_gb=1.0, layer_overhead_ms=0.1),
    "p4d.24xlarge": Hardware(
        name="p4d.24xlarge", devices_per_node=8, memory_per_device_gb=40.0, achieved_tflops=150.0,
        intra_node_bandwidth_gb_s=230.0, inter_node_bandwidth_gbit_s=400.0,
        memory_bandwidth_gb_s=1555.0, reserved_memory_gb=1.5, layer_overhead_ms=0.05),
    "p5.48xlarge": Hardware(
        name="p5.48xlarge", devices_per_node=8, memory_per_device_gb=80.0, achieved_tflops=400.0,
        intra_node_bandwidth_gb_s=400.0, inter_node_bandwidth_gbit_s=3200.0,
        memory_bandwidth_gb_s=3350.0, reserved_memory_gb=2.0, layer_overhead_ms=0.03),
}


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
