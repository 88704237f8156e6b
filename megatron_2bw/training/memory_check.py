"""Will this run fit? The planner's memory model asked before the model is built, and the
host's limits read the same way when an allocation or an open fails later.

Megatron-LM finds out by running: an out-of-memory error from deep inside the first
forward (or, with a large micro-batch, minutes later in the validation after training),
a traceback that names no flag. Here, after the flags are parsed and before anything big
is allocated, every rank asks the planner's memory model (`planner/cost_model.py`: weights
x the schedule's declared versions, gradient buffers, optimizer state, stashed
activations, per its busiest stage) what one rank of this configuration needs, and
compares it with what it has:

- CUDA: the device's total memory (the planner counts the CUDA context and allocator
  slack as 1 GB reserved);
- CPU: this host's memory (or its cgroup's limit) shared by the ranks on it, and the
  address-space limit (`ulimit -v`) against the process's virtual size; the process's own
  footprint so far (the interpreter, torch) is added.

In fp32 the activations count 4 bytes an element (the planner's per-layer constants are
16-bit ones).

Clearly impossible (the estimate above the total) is refused with one line naming the
flags that drive it and a micro-batch size that fits; above what is free right now it is a
warning. The estimate is a model (no allocator fragmentation, no temporary buffers): it
refuses only past the hard limit, and MEGATRON_2BW_MEMORY_CHECK=0 turns the refusal off
for a run that knows better. The open-file limit is checked the same way: each gloo
process group holds a pipe, an epoll instance and a socket per peer.
"""
from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass
from typing import Optional

import psutil
import torch

from ..planner.compute import FlopsCompute
from ..planner.cost_model import CostModel
from ..planner.experts import Experts
from ..planner.hardware import Hardware
from ..planner.spec import ParallelConfig, Precision, Recompute, optimizer_precision
from .config import RunConfig
from .errors import UserError

logger = logging.getLogger("megatron_2bw.train")

ENV = "MEGATRON_2BW_MEMORY_CHECK"  # =0: warn instead of refusing
GIB = 2 ** 30
FP32 = Precision(param_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=4)
# open files: what a rank needed here (100 at world 1, 128 at world 2, `ulimit -n`
# bisected) is about 96 + 16 per rank; below 80 + 8 per rank it cannot start at all
FILES_PER_RANK, FILES_BASE, FILES_FLOOR = 16, 128, 80
THREADS, ARENAS = 64, 256 * 2 ** 20  # `_thread_stacks`
MAX_MICROBATCHES = 16384  # a suggestion skips micro-batches this small (GPipe builds all)


@dataclass(frozen=True)
class Capacity:
    """What one rank may use: at most `total`, `free` right now, described by `what`."""

    total: float
    free: float
    what: str


@dataclass(frozen=True)
class Fit:
    """The planner's estimate for this run against this rank's capacity."""

    need: float              # bytes one rank needs, its footprint so far included
    capacity: Capacity
    drivers: str             # the flags that drive the estimate, as typed
    smaller: Optional[tuple[int, float]]  # a --micro-batch-size that fits, and its need


_LAST: dict = {}  # "fit": the check's Fit, for the out-of-memory line of a later failure


def last_fit() -> Optional[Fit]:
    return _LAST.get("fit")


def _planner_config(run: RunConfig, micro_batch_size: int) -> ParallelConfig:
    par, m = run.parallel, run.model
    granularity = m.recompute_granularity or "none"
    recompute = (Recompute(granularity, m.recompute_method or "uniform",
                           m.recompute_num_layers or 1) if granularity == "full"
                 else Recompute(granularity))
    samples = micro_batch_size * par.data_parallel
    return ParallelConfig(par.schedule, par.tensor_parallel, par.pipeline_parallel,
                          par.data_parallel, micro_batch_size,
                          max(1, run.train.global_batch_size // samples), recompute,
                          m.num_layers_in_first_pipeline_stage or 0,
                          m.num_layers_in_last_pipeline_stage or 0,
                          par.virtual_stages, par.distributed_optimizer,
                          par.context_parallel, m.sequence_parallel, par.expert_parallel)


def _cost_model(run: RunConfig, cuda: bool) -> CostModel:
    m, opt = run.model, run.optimizer
    hw = Hardware("this machine", 1, 1e6, 1.0, 1.0, 1.0,
                  reserved_memory_gb=1.0 if cuda else 0.0)
    base = FP32 if run.precision == "fp32" else Precision()
    experts = (Experts(m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size,
                       m.moe_layer_freq, m.moe_shared_expert_intermediate_size,
                       moe_token_dispatcher_type=m.moe_token_dispatcher_type)
               if m.is_moe else None)
    return CostModel(m, FlopsCompute(m, hw), hw,
                     optimizer_precision(opt.optimizer, opt.delay_compensation, base), experts)


def estimate(run: RunConfig, cuda: bool, micro_batch_size: Optional[int] = None) -> float:
    """Bytes the busiest rank of `run` holds at its peak, by the planner's model; in fp32
    the activations at 4 bytes an element (the model's per-layer constants are 16-bit)."""
    cm = _cost_model(run, cuda)
    est = cm.evaluate(_planner_config(run, micro_batch_size or run.train.micro_batch_size),
                      simulate_time=False)
    if run.precision != "fp32":
        return est.memory_bytes
    return est.memory_bytes + cm.memory_terms(est)["stashed_activations"]


def _cgroup_limit() -> Optional[float]:
    """This container's memory limit (cgroup v2, then v1), None when unlimited."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < 2 ** 60:
            return float(value)
    return None


def capacity(device: torch.device, local_ranks: int) -> Capacity:
    """This rank's share of its device (CUDA) or host (CPU)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        name = torch.cuda.get_device_name(device)
        return Capacity(float(total), float(free), f"GPU {device.index} ({name})")
    vm = psutil.virtual_memory()
    total, free, what = float(vm.total), float(vm.available), "this host's memory"
    limit = _cgroup_limit()
    if limit is not None and limit < total:
        total, free, what = limit, min(free, limit), "this container's memory limit"
    if local_ranks > 1:
        total, free = total / local_ranks, free / local_ranks
        what += f", shared by {local_ranks} ranks"
    return Capacity(total, free, what)


def address_space_limit() -> Optional[float]:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else float(soft)


def drivers(run: RunConfig) -> str:
    """The flags the estimate grows with, as they were given."""
    m, par, t = run.model, run.parallel, run.train
    parts = [f"--micro-batch-size {t.micro_batch_size}", f"--seq-length {m.seq_length}",
             f"--num-layers {m.num_layers}", f"--hidden-size {m.hidden_size}"]
    if run.num_microbatches > 1 and par.pipeline_parallel > 1:
        parts.append(f"--global-batch-size {t.global_batch_size}")
    if m.mtp_num_layers:  # the last stage's MTP block (`planner.cost_model`)
        parts.append(f"--mtp-num-layers {m.mtp_num_layers}")
    return ", ".join(parts)


def _smaller(run: RunConfig, cuda: bool, room: float, used: float) -> Optional[tuple[int, float]]:
    """The largest micro-batch size below the run's that divides its batch and fits `room`
    (the estimate grows with it: a bisection over the divisors)."""
    t, dp = run.train, run.parallel.data_parallel
    per_replica = t.global_batch_size // dp
    sizes = [b for b in range(1, min(t.micro_batch_size, per_replica + 1))
             if per_replica % b == 0 and per_replica // b <= MAX_MICROBATCHES]
    found, low, high = None, 0, len(sizes) - 1
    while low <= high:
        mid = (low + high) // 2
        need = used + estimate(run, cuda, sizes[mid])
        if need <= room:
            found, low = (sizes[mid], need), mid + 1
        else:
            high = mid - 1
    return found


def _thread_stacks() -> float:
    """Address space the threads still to come reserve: gloo starts two per process
    group, and a tiny run here peaked at 65 threads and 0.9 GiB more virtual memory than
    at this check (`ulimit -s` each, 8 MiB by default, plus allocator arenas)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    stack = 8 * 2 ** 20 if soft == resource.RLIM_INFINITY else soft
    return THREADS * stack + ARENAS


def _capacity_with_limit(cap: Capacity, used: float, virtual: float) -> Capacity:
    """The address-space limit (ulimit -v) counts virtual memory (thread stacks, mapped
    libraries): what is left of it, on top of what the process holds now, when that is
    the tighter bound. (A thread gloo cannot start aborts the process in C++: no error
    can be caught then.)"""
    limit = address_space_limit()
    stacks = _thread_stacks()
    if limit is None or used + (limit - virtual - stacks) >= cap.total:
        return cap
    room = max(0.0, used + limit - virtual - stacks)
    return Capacity(room, min(cap.free, room),
                    f"the address-space limit (ulimit -v {limit / GIB:.1f} GiB: "
                    f"{virtual / GIB:.1f} GiB mapped already, {stacks / GIB:.1f} GiB for "
                    f"threads' stacks)")


def check_memory(run: RunConfig, device: torch.device, local_ranks: int,
                 logs: bool) -> None:
    """Refuse (UserError) a run whose estimate exceeds what this rank can ever have; warn
    (where `logs`) when it exceeds what is free now. Records the estimate for the line of
    a later out-of-memory error."""
    cuda = device.type == "cuda"
    try:
        model_bytes = estimate(run, cuda)
    except (ValueError, ZeroDivisionError, KeyError) as err:  # a layout the model lacks
        logger.debug(f"memory check skipped: {err}")
        return
    cap = capacity(device, local_ranks)
    used = 0.0
    if not cuda:
        info = psutil.Process().memory_info()
        used = float(info.rss)
        cap = _capacity_with_limit(cap, used, float(info.vms))
    need = used + model_bytes
    fit = Fit(need, cap, drivers(run),
              _smaller(run, cuda, min(cap.total, cap.free), used) if need > cap.free else None)
    _LAST["fit"] = fit
    if need > cap.total:
        message = (f"this run needs about {need / GIB:.1f} GiB per rank by the planner's "
                   f"memory model; {cap.what} leaves {cap.total / GIB:.1f} GiB")
        if os.environ.get(ENV) == "0":
            logger.warning(f"WARNING: {message}; going on ({ENV}=0)")
            return
        raise UserError(message, fit.drivers, f"{fit_advice(fit)} (or {ENV}=0 to try anyway)")
    if need > cap.free and logs:
        logger.warning(f"WARNING: this run needs about {need / GIB:.1f} GiB per rank by the "
                       f"planner's memory model and {cap.what} has {cap.free / GIB:.1f} GiB "
                       f"free now ({fit.drivers}); {fit_advice(fit)}")


def fit_advice(fit: Fit) -> str:
    """What would fit: a smaller micro-batch, else more ranks for the model (and first a
    higher address-space limit where that is what binds)."""
    if "ulimit -v" in fit.capacity.what:
        return "raise the address-space limit (ulimit -v), or: " + _smaller_run_advice(fit)
    return _smaller_run_advice(fit)


def _smaller_run_advice(fit: Fit) -> str:
    if fit.smaller is not None:
        b, need = fit.smaller
        return (f"--micro-batch-size {b} fits (about {need / GIB:.1f} GiB); so may a lower "
                f"--seq-length, or the model spread over more ranks "
                f"(--pipeline-model-parallel-size, --tensor-model-parallel-size)")
    return ("lower --micro-batch-size or --seq-length, spread the model over more ranks "
            "(--pipeline-model-parallel-size, --tensor-model-parallel-size), or shrink it "
            "(--num-layers, --hidden-size)")


# ------------------------------------------------------------------- open files


def files_needed(world_size: int) -> int:
    return FILES_BASE + FILES_PER_RANK * world_size


def check_open_files(world_size: int) -> None:
    """Before the process group: refuse a hard open-file limit the job cannot start under,
    raise a soft limit that is too low up to the hard one (what `ulimit -n` allows
    without privileges), warn when even the hard limit is below the rough need."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need, floor = files_needed(world_size), FILES_FLOOR + 8 * world_size
    unlimited = resource.RLIM_INFINITY
    if hard != unlimited and hard < floor:
        raise UserError(f"the open-file limit (ulimit -n) is {hard}; a rank of a "
                        f"{world_size}-rank job needs at least {floor} (about {need}): each "
                        f"process group holds a pipe, an epoll instance and a socket per peer",
                        "ulimit -n", f"raise it before launching (ulimit -n {max(need, 4096)})")
    if soft != unlimited and soft < need:
        target = max(need, 4096) if hard == unlimited else min(hard, max(need, 4096))
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < need:
            logger.warning(f"WARNING: the open-file limit (ulimit -n) is {target}; a rank of "
                           f"a {world_size}-rank job needs about {need}")


def open_files_line() -> str:
    """Why open files ran out, and the fix, for an EMFILE anywhere."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        opened = len(os.listdir("/proc/self/fd"))
    except OSError:
        opened = -1
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return (f"the open-file limit (ulimit -n {soft}, hard limit {_limit(hard)}) is used up"
            f"{f' ({opened} open)' if opened >= 0 else ''}: each process group of this "
            f"{world}-rank job holds a pipe, an epoll instance and a socket per peer; raise "
            f"it before launching (ulimit -n {max(files_needed(world), 4096)})")


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else str(value)


def memory_line(requested: Optional[float], cuda: bool) -> str:
    """Why an allocation failed, against the estimate when the check ran."""
    asked = f"an allocation of {requested / 2**20:.1f} MiB failed" if requested else \
        "an allocation failed"
    fit = last_fit()
    if cuda:
        where = "on the GPU"
    else:
        vm = psutil.virtual_memory()
        limit = address_space_limit()
        where = (f"on the CPU; {vm.available / GIB:.1f} GiB of this host's memory is "
                 f"available" + (f", the address-space limit (ulimit -v) is "
                                 f"{limit / GIB:.1f} GiB" if limit else ""))
    if fit is None:
        return (f"{asked} ({where}); lower --micro-batch-size or --seq-length, or spread the "
                f"model over more ranks (--pipeline-model-parallel-size, "
                f"--tensor-model-parallel-size)")
    return (f"{asked} ({where}); the planner's memory model puts this run at about "
            f"{fit.need / GIB:.1f} GiB per rank ({fit.drivers}), and {fit.capacity.what} "
            f"leaves {fit.capacity.total / GIB:.1f} GiB; {fit_advice(fit)}")
