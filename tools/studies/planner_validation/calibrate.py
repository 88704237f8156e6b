"""Step 1, calibrate: this machine as the planner's hardware JSON.

Profile the model with the planner's own profiler (`python -m megatron_2bw.planner
profile`, one thread per process, fp32: the pieces in both processes at once, each timing
its own copy as the two "devices" compute at once in the runs, `--concurrent-processes
2`, and the layer split over the two processes by tensor parallelism,
`--tensor-parallel-sizes 1,2`); run.py profiles again before every pass over the plans.
Then, in two worker processes (the two "devices", workers.py): gloo all-reduce and
point-to-point times between them at message sizes from the loss's [s, b] all-reduces to
the gradient buffer (the planner's `netprofile.time_links`), fitted to `t = alpha + bytes
x beta` (`hardware.fit_link`: the latency and bandwidth of the planner's alpha-beta
model), the time of this project's
optimizer step (`MegatronUpdater`, AdamW) per parameter, and the memory a near-empty
training run costs beyond an idle process. From these it writes a hardware JSON
(`planner.hardware.Hardware`'s fields). None of it comes from the runs that are
validated: those are held out.

A diagnostic (`layer_in_parallel`, not used by the planner) times the profiled layer
with both processes busy and split over them by tensor parallelism, in the calibration's
workers, to explain where the model and the runs part.

The functions that run inside the workers import torch lazily.
"""
from __future__ import annotations

import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from megatron_2bw.planner.compute import load_profile
from megatron_2bw.planner.hardware import GB, Hardware, LinkFit, calibrated, fit_link
from megatron_2bw.planner.spec import ParallelConfig

from benchmarks.probe import cpu_busy_s, other_load, proc_status_kb, wait_for_quiet

from .plans import FP32, Setup, null_setup, plan_flags, plan_key, profile_sizes
from .workers import ROOT, run_jobs, worker_env


# ----------------------------------------------------------------------------------
# In this process: the profile, the calibration jobs, the hardware
# ----------------------------------------------------------------------------------
def run_profile(setup: Setup, path: str, repeats: int = 2, rounds: int = 3) -> float:
    """Profile with the planner's profiler (`rounds` passes over the sizes, `repeats`
    timed runs per size in each; the one-process pieces in `num_procs` processes at once,
    as the runs compute); returns the share of the CPUs other processes used meanwhile."""
    cmd = [sys.executable, "-m", "megatron_2bw.planner", "profile", "--hidden-size",
           str(setup.hidden_size), "--num-attention-heads", str(setup.num_attention_heads),
           "--seq-length", str(setup.seq_length), "--vocab-size", str(setup.vocab_size),
           "--micro-batch-sizes", ",".join(map(str, profile_sizes(setup))), "--dtype", "fp32",
           "--tensor-parallel-sizes", f"1,{setup.num_procs}",
           "--concurrent-processes", str(setup.num_procs),
           "--repeats", str(repeats), "--rounds", str(rounds), "--output", path]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0, start = cpu_busy_s(), time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True)
    wall, busy = time.monotonic() - start, cpu_busy_s() - busy0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise RuntimeError(f"profiling failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    mine = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return max(0.0, busy - mine) / (wall * (os.cpu_count() or 1))


def profile_layer(setup: Setup, work: Path, log=print) -> tuple[str, list[float]]:
    """work/profile.json, the profile taken with the least load from other processes (up
    to `setup.retries` more tries); and the other load of each try."""
    log(f"profiling the layer at b = {profile_sizes(setup)} ...")
    profile_path = str(work / "profile.json")
    profile_loads = []
    for attempt in range(1 + setup.retries):  # keep the profile taken with the least load
        wait_for_quiet(setup.max_other_load, setup.wait_quiet_s, log)
        path = str(work / f"profile.{attempt}.json")
        profile_loads.append(run_profile(setup, path))
        if profile_loads[-1] <= min(profile_loads):
            shutil.copyfile(path, profile_path)
        if profile_loads[-1] <= setup.max_other_load:
            break
        log(f"  other processes took {profile_loads[-1]:.0%} of the CPUs; profiling again")
    return profile_path, profile_loads


def calibration_jobs(setup: Setup, work: Path) -> list[dict]:
    """Bandwidth and optimizer step ("calibrate"), a near-empty run in each of the three
    layouts ("null-..."), and the layer diagnostic at TP 1 and TP 2 ("layer-tp...")."""
    model = setup.model()
    grad_bytes = model.total_params() * 4
    act_bytes = [int(model.boundary_bytes(b, 4)) for b in profile_sizes(setup)]
    loss_bytes = [4 * setup.seq_length * b for b in profile_sizes(setup)]
    tiny = null_setup(setup)
    null_plans = [ParallelConfig("flush", 1, 1, setup.num_procs, 1, 1, False),
                  ParallelConfig("flush", 1, setup.num_procs, 1, 1, setup.num_procs, False),
                  ParallelConfig("flush", setup.num_procs, 1, 1, 1, 1, False)]
    calib_jobs = [{"name": "calibrate", "kind": "call", "timeout_s": 300,
                   "function": f"{__name__}:calibrate_worker", "result": "calibration",
                   "args": {"message_bytes": sorted(set(loss_bytes + act_bytes + [grad_bytes])),
                            "step_params": model.total_params()}}]
    for cfg in null_plans:
        calib_jobs.append({"name": "null-" + plan_key(cfg), "kind": "pretrain", "timeout_s": 120,
                           "argv": plan_flags(tiny, cfg, str(work / f"null-{plan_key(cfg)}.jsonl"),
                                              iterations=2)})
    for tp in (1, setup.num_procs):
        calib_jobs.append({"name": f"layer-tp{tp}", "kind": "call", "timeout_s": 300,
                           "function": f"{__name__}:layer_job", "result": "layer",
                           "args": {"tensor_parallel": tp,
                                    "micro_batch_sizes": [1, max(profile_sizes(setup))],
                                    "hidden_size": setup.hidden_size,
                                    "num_attention_heads": setup.num_attention_heads,
                                    "seq_length": setup.seq_length,
                                    "vocab_size": setup.vocab_size}})
    return calib_jobs


def run_calibration(setup: Setup, work: Path, profile_loads: list[float], log=print) -> dict:
    """Run the calibration jobs in the workers; what `hardware_from_calibration` reads."""
    grad_bytes = setup.model().total_params() * 4
    calib_jobs = calibration_jobs(setup, work)
    log("measuring gloo bandwidth, the optimizer step and a near-empty run's memory ...")
    calib_results = run_jobs(calib_jobs, str(work / "calibrate"), setup.num_procs)
    failed = [j["name"] for j, res in zip(calib_jobs, calib_results)
              if any(r.get("status") != "ok" for r in res)]
    if failed:
        raise RuntimeError(f"calibration jobs failed: {failed}; see {work / 'calibrate'}")
    cal = calib_results[0]
    per_rank = [r["calibration"] for r in cal]
    null_bytes = {j["name"]: max(r["added_bytes"] for r in res)
                  for j, res in zip(calib_jobs, calib_results) if j["name"].startswith("null-")}
    diagnostics = {j["name"]: {"by_rank": [r["layer"] for r in res],
                               "other_load": other_load(res)}
                   for j, res in zip(calib_jobs, calib_results) if j.get("result") == "layer"}
    calib = {"allreduce_s": per_rank[0]["allreduce_s"], "p2p_s": per_rank[0]["p2p_s"],
             "step_s_per_param": statistics.fmean(r["step_s_per_param"] for r in per_rank),
             "step_transient_bytes_per_param": max(r["step_transient_bytes_per_param"]
                                                   for r in per_rank),
             "profile_other_load": profile_loads,
             "calibration_other_load": other_load(cal),
             "layer_diagnostics": diagnostics,
             "null_run_bytes": null_bytes,
             "reserved_bytes": statistics.median(null_bytes.values()),
             "bandwidth_basis_bytes": grad_bytes}
    calib["bandwidth_gb_s"] = calibrate_bandwidth(calib, grad_bytes)
    allreduce, p2p = link_fits(calib)
    calib["allreduce_fit"], calib["p2p_fit"] = _fit_dict(allreduce), _fit_dict(p2p)
    return calib


def link_fits(calib: dict) -> tuple[LinkFit, LinkFit]:
    """`t = alpha + bytes x beta` fitted to the all-reduce and to the transfer timings."""
    def samples(kind: str) -> list[tuple[float, float]]:
        return [(float(k), float(t)) for k, t in calib[kind].items()]
    return fit_link(samples("allreduce_s")), fit_link(samples("p2p_s"))


def _fit_dict(fit: LinkFit) -> dict:
    return {"latency_us": fit.latency_s * 1e6, "bandwidth_gb_s": 1 / fit.seconds_per_byte / GB,
            "points": fit.points, "max_rel_residual": fit.max_rel_residual}


def calibrate_bandwidth(calib: dict, basis_bytes: int) -> float:
    """GB/s of a 2-process gloo all-reduce at `basis_bytes` (bus bandwidth: for n = 2
    the ring sends and receives the whole buffer once, so bytes / time). For the record:
    the hardware takes the bandwidth of the fit (`link_fits`)."""
    sizes = sorted(int(k) for k in calib["allreduce_s"])
    size = min(sizes, key=lambda s: abs(s - basis_bytes))
    return size / calib["allreduce_s"][str(size)] / GB


def hardware_from_calibration(calib: dict, profile_path: str, setup: Setup) -> Hardware:
    """This machine as the planner sees it: 2 devices (processes) on one node.

    - intra-node latency and bandwidth: `t = alpha + bytes x beta` fitted to the gloo
      all-reduce timings between the two processes (alpha: the collective latency; for
      n = 2 the ring moves the whole buffer once, so 1 / beta is the bus bandwidth), and
      the transfer latency fitted to the ping-pong timings (`hardware.calibrated`);
      calibrations without timings (older reports) keep the bandwidth at the gradient
      buffer's size (`calibrate_bandwidth`) and no latency;
    - achieved TFLOP/s: the profiled layer's forward FLOPs over its forward time, at the
      largest profiled microbatch (used only for the record: with a profile the cost
      model takes times from it);
    - memory bandwidth: chosen so the planner's step time (28 B/param over it) equals the
      measured time of this project's optimizer step per parameter;
    - reserved memory: what a near-empty training run adds to an idle process;
    - memory per device: half the machine's RAM.
    """
    profile = load_profile(profile_path)
    biggest = profile.entries[-1]
    flops = setup.model().layer_forward_flops(biggest.micro_batch_size)
    tflops = flops / biggest.layer.forward_s / 1e12
    step_s_per_param = calib["step_s_per_param"]
    mem_bw = FP32.step_bytes_touched / step_s_per_param / GB
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    bw = calib["bandwidth_gb_s"]
    hw = Hardware(name="this-machine-cpu-2proc", devices_per_node=setup.num_procs,
                  memory_per_device_gb=round(ram / setup.num_procs, 3),
                  achieved_tflops=round(tflops, 6), intra_node_bandwidth_gb_s=round(bw, 4),
                  inter_node_bandwidth_gbit_s=round(bw * 8, 4),
                  memory_bandwidth_gb_s=round(mem_bw, 4),
                  reserved_memory_gb=round(calib["reserved_bytes"] / GB, 6),
                  layer_overhead_ms=0.0, intra_node_latency_us=0.0, inter_node_latency_us=0.0,
                  intra_node_p2p_latency_us=0.0, inter_node_p2p_latency_us=0.0)
    if "allreduce_s" not in calib:
        return hw
    allreduce, p2p = link_fits(calib)
    hw = calibrated(hw, allreduce=allreduce, group_size=setup.num_procs, p2p=p2p)
    # one server: nothing crosses servers; the inter-node fields mirror the intra-node ones
    return calibrated(hw, allreduce=allreduce, group_size=setup.num_procs, p2p=p2p,
                      inter_node=True)


# ----------------------------------------------------------------------------------
# Inside the workers (forked children, see workers.py)
# ----------------------------------------------------------------------------------
def calibrate_worker(rank: int, world: int, message_bytes: list[int], step_params: int,
                     repeats: int = 20) -> dict:
    """gloo all-reduce and point-to-point times between the two processes, and the
    optimizer step's time per parameter (both ranks step at once, as in a run)."""
    import torch
    import torch.distributed as dist
    from megatron_2bw import comm
    from megatron_2bw.planner.netprofile import time_links

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = time_links(message_bytes, repeats, rank, torch.device("cpu"))
    comm.barrier()
    out["step_s_per_param"], out["step_transient_bytes_per_param"] = _time_step(step_params)
    return out


def _time_step(num_params: int, repeats: int = 5) -> tuple[float, float]:
    """Seconds per parameter of `MegatronUpdater`'s step (AdamW, global norm, clipping),
    on parameters shaped like a transformer layer's, fp32, no process group; and the
    bytes per parameter the step allocates for the time it runs (its temporaries,
    beyond the Adam state it keeps), from the peak resident set."""
    import torch
    from megatron_2bw.optim.updater import MegatronUpdater, OptimizerConfig, ParamInfo

    side = 256
    count = max(1, num_params // (side * side))
    params = [torch.nn.Parameter(torch.randn(side, side, device="cpu") * 0.02)
              for _ in range(count)]
    infos = [ParamInfo(f"w{i}", True, True, False) for i in range(count)]
    upd = MegatronUpdater(params, infos, OptimizerConfig(lr=1e-4, global_batch_size=1,
                                                          lr_decay_samples=1000))
    flat = torch.randn(count * side * side, device="cpu") * 1e-3
    views = [flat[i * side * side:(i + 1) * side * side].view(side, side) for i in range(count)]
    times, transient = [], 0.0
    for i in range(repeats + 2):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = proc_status_kb()["VmRSS"]
        start = time.perf_counter()
        if hasattr(upd, "start_step"):  # the step split in two (actions G and S)
            upd.start_step(i, flat, views)
            upd.finish_step(i, flat, views, params, params)
        else:
            upd.step(i, flat, views, params, params, 1.0)
        if i >= 2:  # the Adam state exists from the first step on
            times.append(time.perf_counter() - start)
            transient = max(transient, (proc_status_kb()["VmHWM"] - before) * 1024.0)
    n = count * side * side
    return statistics.median(times) / n, transient / n


def layer_job(rank: int, world: int, **args) -> dict:
    """`layer_in_parallel` as a worker job (every rank runs it; the placement is unused)."""
    del rank, world
    return layer_in_parallel(**args)


def layer_in_parallel(tensor_parallel: int, micro_batch_sizes: list[int], hidden_size: int,
                      num_attention_heads: int, seq_length: int, vocab_size: int,
                      repeats: int = 5) -> dict:
    """Diagnostic, not used by the planner: the profiler's measurements of one layer and
    the output layer, taken here in both processes at once -- with tensor_parallel 1 each
    process times its own copy while the other core is busy too; with 2 the layer is
    split over the two processes and its all-reduces run over gloo."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron_2bw.models.compat import apply_cpu_shims
    from megatron_2bw.planner.profile import one_layer_parts

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_parallel, 1)
    apply_cpu_shims("cpu")
    shape = {"model": "gpt", "hidden_size": hidden_size,
             "num_attention_heads": num_attention_heads, "seq_length": seq_length,
             "vocab_size": vocab_size, "repeats": repeats, "warmup": 2}
    parts = one_layer_parts(shape, torch.float32, torch.device("cpu"), tensor_parallel)
    out = {}
    for b in micro_batch_sizes:
        e = parts.entry(b)
        out[str(b)] = {"layer_forward_s": e.layer.forward_s,
                       "layer_backward_s": e.layer.backward_s,
                       "layer_recompute_backward_s": e.layer.recompute_backward_s,
                       "output_forward_s": e.output.forward_s,
                       "output_backward_s": e.output.backward_s}
    parallel_state.destroy_model_parallel()
    return out
