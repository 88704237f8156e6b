"""Running jobs in two warm worker processes (the two "devices").

To avoid paying ~10 s of imports per job, each worker imports torch and megatron-core
once and `fork`s one child per job; the child joins a fresh gloo group and runs the job:
a training run (`megatron_2bw.training.entry.main`, the body of `pretrain_gpt.py`), a
calibration or the layer diagnostic (calibrate.py). Memory: the child's peak resident
set (`VmHWM`, reset at fork through /proc/self/clear_refs) minus its resident set at
fork, i.e. what the job added to an idle process that had already imported everything.

The workers run as `python -m planner_validation _worker RANK WORLD WORKDIR` with
tools/studies/, tools/ and the repository root on PYTHONPATH (`worker_env`).
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

from benchmarks.probe import cpu_busy_s, proc_status_kb

ROOT = Path(__file__).resolve().parents[3]
TOOLS = ROOT / "tools"

# glibc's malloc raises its mmap threshold to the size of each large block freed, after
# which freed tensors stay in the heap and the resident set no longer falls: measured
# peaks were ~30% above the live tensors. A fixed threshold (which also turns the
# adjustment off) returns every tensor of 64 KiB or more to the kernel when freed, so the
# peak resident set follows the live tensors. The profile runs with it too, so profiled
# and measured times pay the same page faults.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def worker_env() -> dict:
    """One thread, the fixed mmap threshold, this package and megatron_2bw importable, no
    torchrun variables."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join(
                   [str(TOOLS / "studies"), str(TOOLS), str(ROOT),
                    os.environ.get("PYTHONPATH", "")]), **ALLOCATOR_ENV)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(key, None)
    return env


def run_jobs(jobs: list[dict], workdir: str, num_procs: int = 2,
             timeout_s: float = 3600.0) -> list[list[dict]]:
    """Run `jobs` in `num_procs` warm workers (see `worker_main`); results[job][rank].

    A job is {"name", "kind": "pretrain", "argv": [...], "timeout_s"}, or {"name", "kind":
    "call", "function": "module:name", "args": {...}, "result": KEY, "timeout_s"}: each
    rank's `name(rank, world, **args)` goes into its result under KEY.
    """
    if Path(workdir).exists():  # stale port or result files would mislead the workers
        shutil.rmtree(workdir)
    Path(workdir).mkdir(parents=True)
    jobs_file = Path(workdir) / "jobs.json"
    jobs_file.write_text(json.dumps(jobs))
    procs = []
    for rank in range(num_procs):
        log = open(Path(workdir) / f"worker{rank}.log", "w")
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "planner_validation", "_worker", str(rank),
             str(num_procs), str(workdir)], cwd=ROOT, env=worker_env(), stdout=log,
            stderr=subprocess.STDOUT), log))
    _wait_workers(procs, workdir, timeout_s)
    return _read_results(workdir, len(jobs), num_procs)


def _wait_workers(procs: list, workdir: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for proc, _ in procs:
            proc.kill()
        raise RuntimeError(f"validation workers did not finish in {timeout_s:.0f} s "
                           f"(logs in {workdir})") from None
    finally:
        for _, log in procs:
            log.close()
    bad = [rank for rank, (p, _) in enumerate(procs) if p.returncode]
    if bad:
        tail = (Path(workdir) / f"worker{bad[0]}.log").read_text()[-3000:]
        raise RuntimeError(f"validation worker {bad[0]} failed:\n{tail}")


def _read_results(workdir: str, num_jobs: int, num_procs: int) -> list[list[dict]]:
    results = []
    for i in range(num_jobs):
        per_rank = []
        for rank in range(num_procs):
            f = Path(workdir) / f"result.{i}.{rank}.json"
            per_rank.append(json.loads(f.read_text()) if f.exists()
                            else {"status": "no result"})
        results.append(per_rank)
    return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_port(work: Path, i: int, rank: int) -> int:
    """Rank 0 picks a free port for job i; the others wait for its file."""
    port_file = work / f"port.{i}"
    if rank == 0:
        tmp = work / f"port.{i}.tmp"
        tmp.write_text(str(_free_port()))
        tmp.rename(port_file)
    else:
        while not port_file.exists():
            time.sleep(0.01)
    return int(port_file.read_text())


def worker_main(rank: int, world: int, workdir: str) -> int:
    """Import the heavy modules once, then fork one child per job (see `run_jobs`)."""
    import torch  # noqa: F401  (imported before fork on purpose)
    import megatron.core  # noqa: F401
    from megatron_2bw.runtime.process import exit_now
    from megatron_2bw.training import entry, loop  # noqa: F401

    work = Path(workdir)
    jobs = json.loads((work / "jobs.json").read_text())
    for i, job in enumerate(jobs):
        port = _job_port(work, i, rank)
        result_file = work / f"result.{i}.{rank}.json"
        pid = os.fork()
        if pid == 0:  # child
            code = 1
            try:
                _child(job, rank, world, port, work / f"log.{i}.{rank}.txt", result_file)
                code = 0
            finally:
                exit_now(code)  # the child's logs flushed, no finalization
        _wait_child(pid, job, result_file)
    return 0


def _wait_child(pid: int, job: dict, result_file: Path) -> None:
    """Wait for the job's child (killed at the job's timeout); add its CPU time and the
    machine's busy time over the job to its result."""
    deadline = time.monotonic() + float(job.get("timeout_s", 600))
    busy0, start = cpu_busy_s(), time.monotonic()
    while time.monotonic() < deadline:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        result_file.write_text(json.dumps({"status": "timeout"}))
        return
    accounting = {"cpu_s": usage.ru_utime + usage.ru_stime,
                  "machine_busy_s": cpu_busy_s() - busy0,
                  "job_wall_s": time.monotonic() - start}
    result = (json.loads(result_file.read_text()) if result_file.exists()
              else {"status": f"died (wait status {status})"})
    result_file.write_text(json.dumps({**result, **accounting}))


def _child(job: dict, rank: int, world: int, port: int, log_path: Path,
           result_file: Path) -> None:
    log = os.open(str(log_path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak RSS to the current RSS
        f.write("5")
    base = proc_status_kb()["VmRSS"]
    start = time.perf_counter()
    out: dict = {"status": "ok"}
    try:
        _run_job(job, rank, world, out)
        from megatron_2bw import comm
        if comm.is_initialized():
            comm.barrier()
    except BaseException:  # the traceback goes to the job's log and result
        out["status"] = "error"
        out["error"] = traceback.format_exc()[-4000:]
        sys.stderr.write(out["error"])
    status = proc_status_kb()
    out.update(rss_at_fork_kb=base, peak_rss_kb=status["VmHWM"],
               added_bytes=(status["VmHWM"] - base) * 1024.0,
               wall_s=time.perf_counter() - start)
    sys.stdout.flush()
    sys.stderr.flush()
    result_file.write_text(json.dumps(out))


def _run_job(job: dict, rank: int, world: int, out: dict) -> None:
    """Run one job in the forked child; what it measured goes into `out`."""
    if job["kind"] == "pretrain":
        from megatron_2bw.training.entry import main
        rc = main("gpt", job["argv"])
        if rc:
            out["status"] = f"exit {rc}"
    elif job["kind"] == "call":  # named, not imported here: the callers import this module
        module, name = job["function"].split(":")
        function = getattr(importlib.import_module(module), name)
        out[job["result"]] = function(rank, world, **job["args"])
    else:
        raise ValueError(f"unknown job kind {job['kind']}")
