"""Graceful stop, stalled ranks and launcher misdetection (issue 11, items 4, 5, 8).

- SIGTERM with --exit-signal-handler: the run saves the iteration it stopped at (a stop
  check, i.e. a segment end), exits 0, and resuming from there gives the uninterrupted
  run's losses bit for bit.
- A SIGSTOPped rank ends its neighbour within the distributed timeout (the seconds-level
  test hook), with a message naming the frozen stage and rank.
- Tasks started by srun itself take their ranks from SLURM's variables and train;
  mpirun and PMI launches without torchrun's rendezvous are refused with one line.
"""
from __future__ import annotations

import math
import os
import signal
import socket
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
from tests.entry_harness import ROOT, TINY, complete_records, launch, losses

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


def _wait_for(path: str, count: int, procs: list[subprocess.Popen], limit: float) -> None:
    """Until `path` holds `count` training records (fail if a process ends first)."""
    deadline = time.monotonic() + limit
    while len(complete_records(path)) < count:
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
        # exit status 1 (after its workers end), so only the workers get it here. It
        # keeps coming until they are gone (SLURM signals node by node, so a rank can get
        # one after it saved): none of them may end a worker (exit 143 under srun).
        workers = _workers(stopped)
        while stopped.poll() is None:
            for pid in workers:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        out = _finish(stopped, 120)
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
            k = int(f.read())
        assert k % CHECK == 0 and 0 < k < LAST, (k, out[-2000:])
        assert f"exiting at iteration {k} after receiving SIGTERM" in out
        first = complete_records(stopped_m)
        assert [r["iteration"] for r in first] == list(range(1, k + 1))
        rest = launch("gpt", 2, PP2_2BW + ["--exit-signal-handler", "--load", ckpt,
                                           "--exit-interval", str(LAST)],
                      str(tmp_path / "b.jsonl"))
        _finish(reference, 120)
    finally:
        for proc in (stopped, reference):
            _kill_job(proc)
    assert [r["iteration"] for r in rest] == list(range(k + 1, LAST + 1))
    assert losses(first) + losses(rest) == losses(complete_records(ref_m))  # bit for bit


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
# a frozen rank 1 (make test-matrix): rank 0's case is the harder one, it hosts the store
@pytest.mark.parametrize("victim", [pytest.param(1, marks=pytest.mark.matrix), 0])
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
        assert "frozen or gone (no heartbeat): stage 1 (rank 1)" in last, out[-3000:]
    else:
        # the receive from stage 0 or the tied-embedding sum with it ran out, whichever
        # rank 1 was in; either way the store's host is named
        assert ("(rank 0 when no torchrun agent hosts it) is frozen, gone or unreachable"
                in last), out[-3000:]
    # the frozen rank by its pid (it runs on this machine), and the checkpoint
    assert f"rank {victim} (pid {procs[victim].pid}) is stopped (SIGSTOP)" in last, last
    assert last.endswith("nothing is saved (no --save)"), last
    assert took < timeout + 60, took  # ends (no gloo 30-minute hang), even when loaded


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


def _srun_task_env(task: int, tasks: int, job_id: int) -> dict:
    """What srun gives each task it starts, with no torchrun variables."""
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                      "MASTER_PORT", "LOCAL_RANK")}
    env.update(SLURM_NTASKS=str(tasks), SLURM_STEP_NUM_TASKS=str(tasks),
               SLURM_PROCID=str(task), SLURM_LOCALID=str(task), SLURM_JOB_ID=str(job_id),
               SLURM_STEP_NODELIST="localhost", SLURM_JOB_NODELIST="localhost")
    return env


def _job_id_with_free_port() -> int:
    """A job id whose derived rendezvous port (10000 + id mod 20000) is free here."""
    for job_id in range(os.getpid() % 20000, os.getpid() % 20000 + 20000):
        port = distributed.srun_master_port(job_id)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return job_id
    raise AssertionError("no free port in 10000-29999")


@pytest.mark.slow
def test_srun_tasks_train_without_torchrun(tmp_path) -> None:
    """Two tasks as srun starts them (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, the
    step's node list, no MASTER_ADDR/MASTER_PORT) form one world of two and train PP=2."""
    metrics = str(tmp_path / "m.jsonl")
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *TINY, *PP2_2BW,
           "--train-iters", "4", "--metrics-file", metrics]
    job_id = _job_id_with_free_port()
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=_srun_task_env(task, 2, job_id),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for task in (0, 1)]
    try:
        outs = [_finish(p, 120) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert [r["iteration"] for r in complete_records(metrics)] == [1, 2, 3, 4], outs[1][-3000:]


def _fake_scontrol(*args: str) -> str:
    """scontrol's answers on a cluster whose node names differ from their addresses."""
    if args[:2] == ("show", "hostnames"):
        return "n01\nn02\nn03\nn04\n"
    if args[:2] == ("show", "node"):
        return f"NodeName={args[2]} Arch=x86_64 CoresPerSocket=8\n   NodeAddr=10.0.0.1 " \
               f"NodeHostName={args[2]} Version=22.05.8\n"
    return ""


SRUN_TASK = {"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
             "SLURM_JOB_ID": "123", "SLURM_STEP_NODELIST": "n[01-04]"}
ADOPTED = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_PORT": "10123"}


@pytest.mark.parametrize("env,scontrol,outcome", [
    (SRUN_TASK, True, dict(ADOPTED, MASTER_ADDR="10.0.0.1")),  # srun: the first node's NodeAddr
    (SRUN_TASK, False, dict(ADOPTED, MASTER_ADDR="n01")),      # no scontrol: its name
    (dict(SRUN_TASK, MASTER_ADDR="head", MASTER_PORT="6000"), True,
     dict(ADOPTED, MASTER_ADDR="head", MASTER_PORT="6000")),   # the batch script's exports
    (dict(SRUN_TASK, SLURM_PROCID="x"), True, "refused"),     # a broken SLURM environment
    (dict(SRUN_TASK, SLURM_PROCID="4"), True, "refused"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, True, "refused"),          # mpirun
    ({"PMI_SIZE": "2", "PMI_RANK": "1"}, True, "quiet"),       # a PMI launcher, not task 0
    ({"SLURM_NTASKS": "4"}, True, {}),   # a batch script's one plain process
    ({"SLURM_STEP_NUM_TASKS": "2", "RANK": "0", "WORLD_SIZE": "2",
      "MASTER_ADDR": "x"}, True, {}),     # torchrun under srun: its variables win
])
def test_launcher_detection(monkeypatch, capsys, env, scontrol, outcome) -> None:
    """srun's tasks are adopted (init_distributed runs both checks, adoption first);
    mpirun and PMI launches without torchrun's variables are refused with one line."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
                "SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK"):
        # set, then delete: monkeypatch then restores the variable as it was (absent too),
        # so what adopt_srun_env writes into os.environ does not leak into later tests
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(distributed, "_scontrol", _fake_scontrol if scontrol else lambda *a: "")

    def start() -> None:
        distributed.adopt_srun_env()
        distributed.refuse_foreign_launcher()
    if isinstance(outcome, str):
        with pytest.raises(SystemExit) as exc:
            start()
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert (err == "") == (outcome == "quiet"), err
        assert outcome == "quiet" or len(err.splitlines()) == 1
        return
    before = {v: os.environ.get(v) for v in ADOPTED.keys() | {"MASTER_ADDR"}}
    start()
    after = {v: os.environ.get(v) for v in before}
    assert after == (dict(before, **outcome) if outcome else before)


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
    stop = GracefulStop(on_signal=True, duration_mins=None)
    try:
        assert stop.reason() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.reason() == "receiving SIGTERM (--exit-signal-handler)"
    finally:
        stop.close()
        after = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous)
    # a late SIGTERM (SLURM signals node by node) must not end a rank that saved: it stays
    # ignored after training, not back to the default action (exit 143)
    assert after == signal.SIG_IGN
    assert not GracefulStop(on_signal=False, duration_mins=0).active
    late = GracefulStop(on_signal=False, duration_mins=1e-9)
    assert "(--exit-duration-in-mins 1e-09)" in late.reason()


def test_sigterm_after_training_is_ignored_or_the_embedders_handler() -> None:
    """close() keeps SIGTERM from killing the process until it exits; a Python handler
    installed before (a program embedding the loop) gets SIGTERM back instead."""
    previous = signal.getsignal(signal.SIGTERM)
    seen = []
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        GracefulStop(on_signal=True, duration_mins=None).close()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGTERM)  # ignored: this process goes on

        def own(signum, frame):
            seen.append(signum)
        signal.signal(signal.SIGTERM, own)
        GracefulStop(on_signal=True, duration_mins=None).close()
        assert signal.getsignal(signal.SIGTERM) is own
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]

        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # without the flag nothing changes
        GracefulStop(on_signal=False, duration_mins=5).close()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


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


def test_a_send_to_a_lost_peer_names_it(monkeypatch) -> None:
    """gloo may find the connection reset already when a send or a receive is posted (a
    node's ranks killed: tests/test_slurm.py's lost node, once); the error names the stage
    as a wait's would, instead of a traceback from the backend."""
    reset = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:14999: "
                         "Connection reset by peer.")
    monkeypatch.setattr(p2p.dist, "isend", lambda *a, **k: (_ for _ in ()).throw(reset))
    monkeypatch.setattr(p2p.dist, "irecv", lambda *a, **k: (_ for _ in ()).throw(reset))
    links = p2p.StageLinks(stage=1, num_stages=3, prev_rank=2, next_rank=6,
                           boundary_shape=(2,))
    with pytest.raises(p2p.PeerTimeout, match=r"^lost the connection to stage 2 \(rank 6\) "
                                              r"\(stage 1's send\)"):
        p2p.P2P(links).send_activation(p2p.torch.zeros(2, device="cpu"))
    with pytest.raises(p2p.PeerTimeout, match=r"^lost the connection to stage 0 \(rank 2\) "
                                              r"\(stage 1's receive posted ahead\)"):
        p2p.P2P(links).post(0)
