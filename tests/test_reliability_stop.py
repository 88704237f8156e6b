"""Graceful stop, stalled ranks and launcher misdetection (issue 11, items 4, 5, 8).

- SIGTERM with --exit-signal-handler: the run saves the iteration it stopped at (a stop
  check, i.e. a segment end), exits 0, and resuming from there gives the uninterrupted
  run's losses bit for bit.
- A SIGSTOPped rank ends its neighbour within the distributed timeout (the seconds-level
  test hook), with a message naming the frozen stage and rank.
- Tasks started by srun without torchrun's rendezvous are refused with one line.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_2bw.runtime import p2p
from megatron_2bw.schedules import build_schedule
from megatron_2bw.schedules.simulate import simulate
from megatron_2bw.training import distributed
from megatron_2bw.training.signals import DRAIN_BUDGET, GracefulStop, stop_check_interval
from tests.dist_harness import free_port
from tests.entry_harness import ROOT, TINY, launch, losses

PP2_2BW = ["--global-batch-size", "8", "--pipeline-model-parallel-size", "2",
           "--pipeline-schedule", "2bw", "--train-iters", "2000"]
CHECK = stop_check_interval("2bw", 2, 4)  # m = 8 / 2: a stop check every 13 minibatches
LAST = 3 * CHECK                           # the reference and the resumed run end here
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def _torchrun(extra: list[str], metrics: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), os.path.join(ROOT, "pretrain_gpt.py"), *TINY,
           "--metrics-file", metrics, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _records(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [line for line in f if line.endswith("\n")]
    return [r for r in map(json.loads, lines) if r.get("split", "train") == "train"]


def _wait_for(path: str, count: int, procs: list[subprocess.Popen], limit: float) -> None:
    """Until `path` holds `count` training records (fail if a process ends first)."""
    deadline = time.monotonic() + limit
    while len(_records(path)) < count:
        for p in procs:
            assert p.poll() is None, p.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"no {count} records in {path} in {limit} s"
        time.sleep(0.05)


def _workers(proc: subprocess.Popen) -> list[int]:
    """torchrun's worker processes (each in its own session, so signalled one by one)."""
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
        return [int(pid) for pid in f.read().split()]


def _kill_job(proc: subprocess.Popen) -> None:
    """End a torchrun job left running by a failed assertion, workers first."""
    if proc.poll() is None:
        for pid in _workers(proc):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.communicate()


def _finish(proc: subprocess.Popen, limit: float) -> str:
    out, _ = proc.communicate(timeout=limit)
    assert proc.returncode == 0, out[-5000:]
    return out


@pytest.mark.slow
def test_sigterm_saves_where_it_stopped_and_resumes_exactly(tmp_path) -> None:
    """SIGTERM mid-run: a checkpoint at the next stop check, exit 0, exact resume."""
    ckpt, stopped_m, ref_m = (str(tmp_path / name) for name in ("ckpt", "a.jsonl", "r.jsonl"))
    stopped = _torchrun(PP2_2BW + ["--exit-signal-handler", "--save", ckpt], stopped_m)
    reference = _torchrun(PP2_2BW + ["--exit-interval", str(LAST)], ref_m)  # meanwhile
    try:
        _wait_for(stopped_m, 2, [stopped], 120)
        # SLURM signals every process of the step; torchrun's own answer to SIGTERM is
        # exit status 1 (after its workers end), so only the workers get it here
        for pid in _workers(stopped):
            os.kill(pid, signal.SIGTERM)
        out = _finish(stopped, 120)
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
            k = int(f.read())
        assert k % CHECK == 0 and 0 < k < LAST, (k, out[-2000:])
        assert f"exiting at iteration {k} after receiving SIGTERM" in out
        first = _records(stopped_m)
        assert [r["iteration"] for r in first] == list(range(1, k + 1))
        rest = launch("gpt", 2, PP2_2BW + ["--exit-signal-handler", "--load", ckpt,
                                           "--exit-interval", str(LAST)],
                      str(tmp_path / "b.jsonl"))
        _finish(reference, 120)
    finally:
        for proc in (stopped, reference):
            _kill_job(proc)
    assert [r["iteration"] for r in rest] == list(range(k + 1, LAST + 1))
    assert losses(first) + losses(rest) == losses(_records(ref_m))  # bit for bit


def _ranks_by_hand(cmd: list[str], timeout: float, world: int = 2,
                   ranks: tuple = (0, 1)) -> list[subprocess.Popen]:
    """Ranks started with torchrun's variables but no agent: rank 0 hosts the store."""
    port = free_port()
    return [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=dict(ENV, RANK=str(r), WORLD_SIZE=str(world),
                                                 LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                                 MASTER_PORT=str(port),
                                                 **{distributed.TIMEOUT_ENV: str(timeout)}))
            for r in ranks]


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_stalled_rank_is_named_within_the_timeout(tmp_path, victim: int) -> None:
    """One rank frozen by SIGSTOP: the other fails within the timeout (plus the
    heartbeat's 1.5 periods) naming it. Ranks are started by hand: torchrun would add its
    fixed 30 s wait before it SIGKILLs a process that does not answer its SIGTERM (a
    frozen one). A frozen rank 0 also freezes the store it hosts: the survivor must not
    wait on it while it leaves (it once did, forever)."""
    timeout = 4.0
    metrics = str(tmp_path / "m.jsonl")
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *TINY, "--metrics-file",
           metrics, *PP2_2BW, "--pipeline-schedule", "flush"]
    procs = _ranks_by_hand(cmd, timeout)
    survivor = procs[1 - victim]
    try:
        _wait_for(metrics, 2, procs, 120)
        procs[victim].send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        out, _ = survivor.communicate(timeout=timeout + 30)
        took = time.monotonic() - frozen_at
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert survivor.returncode == 1, out[-3000:]
    last = out.strip().splitlines()[-1]  # the pipeline receive or a collective timed out
    assert f"within {timeout:g} s (--distributed-timeout-minutes)" in last, out[-3000:]
    if victim == 1:
        assert last.endswith("frozen or gone (no heartbeat): stage 1 (rank 1)"), out[-3000:]
    else:
        # the receive from stage 0 or the tied-embedding sum with it ran out, whichever
        # rank 1 was in; either way the store's host is named
        assert last.endswith("(rank 0 when no torchrun agent hosts it) is frozen, gone or "
                             "unreachable"), out[-3000:]
    assert took < timeout + 60, took  # ends (no gloo default 30-minute hang), even on a loaded machine


@pytest.mark.parametrize("present", [0, 1])
def test_a_rank_that_never_starts_is_one_line(present: int) -> None:
    """WORLD_SIZE=2 with one rank started: the rendezvous ends within the timeout with
    one line saying who is missing, exit status 1, no C++ or Python stack trace."""
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *TINY, *PP2_2BW]
    (proc,) = _ranks_by_hand(cmd, 2.0, ranks=(present,))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out and "frame #" not in out, out[-3000:]
    expected = ("only 1 of 2 ranks joined the rendezvous" if present == 0
                else "rank 1 found no rendezvous at 127.0.0.1:")
    assert out.strip().splitlines()[-1].startswith(f"error: {expected}"), out[-3000:]


@pytest.mark.slow
def test_srun_without_torchrun_is_refused() -> None:
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                      "MASTER_PORT", "LOCAL_RANK")}
    env.update(SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="0")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *TINY,
                           "--train-iters", "2", "--global-batch-size", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if "arn" not in line]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert [line for line in lines if "error:" in line] == [lines[-1]]
    assert "srun (SLURM_STEP_NUM_TASKS=2)" in lines[-1] and "torchrun" in lines[-1]


@pytest.mark.parametrize("env,refused", [
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "1"}, True),   # srun, quiet task
    ({"OMPI_COMM_WORLD_SIZE": "2"}, True),                        # mpirun
    ({"SLURM_NTASKS": "4"}, False),       # a batch script's one plain process
    ({"SLURM_STEP_NUM_TASKS": "2", "RANK": "0", "WORLD_SIZE": "2",
      "MASTER_ADDR": "x"}, False),        # torchrun under srun
])
def test_launcher_detection(monkeypatch, capsys, env, refused) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS",
                "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    if refused:
        with pytest.raises(SystemExit) as exc:
            distributed.refuse_foreign_launcher()
        assert exc.value.code == 2
        quiet = env.get("SLURM_PROCID", "0") != "0"
        assert (capsys.readouterr().err == "") == quiet
    else:
        distributed.refuse_foreign_launcher()


def test_timeout_hook(monkeypatch) -> None:
    """--distributed-timeout-minutes in minutes; the test hook in seconds; 0 refused."""
    monkeypatch.delenv(distributed.TIMEOUT_ENV, raising=False)
    assert distributed.distributed_timeout(10).total_seconds() == 600
    with pytest.raises(SystemExit):
        distributed.distributed_timeout(0)
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "2.5")
    assert distributed.distributed_timeout(10).total_seconds() == 2.5


@pytest.mark.parametrize("d,m", [(2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 32)])
def test_stop_checks_cost_under_two_percent(d: int, m: int) -> None:
    """2BW segments cut for stop checks drain and refill: at most 2 % more time."""
    n = stop_check_interval("2bw", d, m)
    segment = simulate(build_schedule("2bw", d, m, n)).makespan
    whole = simulate(build_schedule("2bw", d, m, 4 * n)).makespan
    assert 4 * segment / whole - 1 < DRAIN_BUDGET
    assert n <= math.ceil(1 / DRAIN_BUDGET) and stop_check_interval("flush", d, m) == 1


def test_sigterm_is_noted_not_fatal() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    stop = GracefulStop(on_signal=True, duration_mins=None, device=None)
    try:
        assert stop.reason() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.reason() == "receiving SIGTERM (--exit-signal-handler)"
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGTERM) == previous
    assert not GracefulStop(on_signal=False, duration_mins=0, device=None).active
    late = GracefulStop(on_signal=False, duration_mins=1e-9, device=None)
    assert "(--exit-duration-in-mins 1e-09)" in late.reason()


def test_receive_timeout_names_the_peer(monkeypatch) -> None:
    """gloo's anonymous timeout becomes an error naming the neighbour and the flag."""
    def stalled(*args, **kwargs):
        raise RuntimeError("[gloo] Timed out waiting 3000ms for recv operation to complete")

    monkeypatch.setattr(p2p.dist, "recv", stalled)
    links = p2p.StageLinks(stage=1, num_stages=3, prev_rank=2, next_rank=6,
                           boundary_shape=(2,))
    with pytest.raises(p2p.PeerTimeout, match=r"^stage 0 \(rank 2\) stopped answering: "
                       r"stage 1's receive of an activation got nothing within the timeout "
                       r"\(--distributed-timeout-minutes\)") as exc:
        p2p.P2P(links).recv_activation()
    assert p2p.is_timeout(exc.value)
    monkeypatch.setattr(p2p.dist, "recv", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("Connection closed by peer [127.0.0.1]:1234")))
    with pytest.raises(p2p.PeerTimeout, match=r"^lost the connection to stage 2 \(rank 6\)"
                       ) as exc:
        p2p.P2P(links).recv_gradient()
    assert not p2p.is_timeout(exc.value)
