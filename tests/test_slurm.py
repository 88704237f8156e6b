"""examples/slurm/*.sbatch on a real two-node SLURM cluster on this machine (issue 13).

tools/slurm/local_cluster.sh brings up slurmctld, two slurmd (nodes n1 and n2, both at
127.0.0.1) and a munged of its own, everything in a temp dir. The repository's scripts run
unedited: sizes through their variables, paths as their arguments, the metrics file in
EXTRA_ARGS (sbatch passes the environment on). The GPT jobs run PP=2 x DP=2 with 2BW over
the two nodes; their losses equal, bit for bit, those of the same script on one node with
4 processes (run by `bash` outside SLURM: torchrun --standalone), the reference, which
trains alongside the SLURM jobs (paused while they start up) and is read as far as needed.

- LAUNCHER=torchrun (one agent per node, c10d rendezvous), submitted with `--time=10
  --signal=TERM@90`. Once it trains, its time limit is cut to the minute after the next
  (`scontrol update TimeLimit=`): the SIGTERM is then due at once and SLURM sends it at its
  next time-limit check; every rank saves at the next stop check and the job ends
  COMPLETED. `scontrol requeue` runs it again, it resumes from that checkpoint, and the
  losses of both runs together equal the reference's.
- LAUNCHER=srun (SLURM starts all four processes; ranks from SLURM_PROCID and friends):
  SIGKILL of node n2's processes ends the whole job in seconds.
- The BERT script runs three iterations (default launcher).

Cost, measured here (2 cores shared with other work): time-limit test 65-70 s, node-loss
test about 20 s, BERT about 15-20 s, cluster up and down 3 s. slurmctld checks time limits
every 30 s, so the SIGTERM comes 0-30 s after the cut; `scancel --signal=TERM` (which ends
the resumed run here, the same path through SLURM and the training) would save 15 s on
average, but the issue asks for the time-limit path. The limit is cut only once the job
trains because a SIGTERM before the training's handler is in is ignored (the scripts
ignore SIGTERM outside it), and start-up took 10-47 s here depending on the load: a
`--time=1 --signal=TERM@5` submission (SIGTERM 25-55 s after the start) missed it once.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable, Optional

import pytest

from megatron_2bw.training.distributed import TIMEOUT_ENV
from megatron_2bw.training.errors import HOST_WAIT_S
from megatron_2bw.training.signals import stop_check_interval
from tests.entry_harness import ROOT, complete_records

pytestmark = pytest.mark.slow

CLUSTER = os.path.join(ROOT, "tools", "slurm", "local_cluster.sh")
SCRIPT = os.path.join(ROOT, "examples", "slurm", "pretrain_gpt_2bw.sbatch")
BERT_SCRIPT = os.path.join(ROOT, "examples", "slurm", "pretrain_bert_2bw.sbatch")
SIZES = dict(TP="1", PP="2", NUM_LAYERS="4", HIDDEN_SIZE="32", NUM_HEADS="4",
             SEQ_LENGTH="16", MICRO_BATCH_SIZE="2", GLOBAL_BATCH_SIZE="16",
             TRAIN_ITERS="2000", SAVE_INTERVAL="100000", EVAL_INTERVAL="100000",
             LOG_INTERVAL="10")
SPLIT = "--split 98,2,0"  # the session's small corpus (63 documents) has no 0.1 % for test
CHECK = stop_check_interval("2bw", 2, 4)  # 16 / (2 x DP 2) = 4 microbatches: every 13
TIMEOUT_S = 5.0                            # the distributed timeout of the node-loss test
ENDED = ("COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY")


def _losses(path: str) -> list[float]:
    return [r["loss"] for r in complete_records(path)]


def _wait(done: Callable[[], bool], limit: float, what: Callable[[], str]) -> None:
    deadline = time.monotonic() + limit
    while not done():
        assert time.monotonic() < deadline, f"not within {limit:g} s: {what()}"
        time.sleep(0.2)


def _tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except FileNotFoundError:
        return f"(no {path})"


class Cluster:
    """The local cluster's clients: sbatch, scontrol, scancel with its SLURM_CONF."""

    def __init__(self, conf: str, data: list[str], bert_data: list[str]):
        self.conf, self.data, self.bert_data = conf, data, bert_data

    def env(self, **extra: str) -> dict:
        """The test's environment without any SLURM job's or launcher's variables (a job
        would take an inherited MASTER_ADDR as its rendezvous), plus the sizes."""
        launcher = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("SLURM_") and k not in launcher}
        env.update(SLURM_CONF=self.conf, PYTHON=sys.executable, OMP_NUM_THREADS="1",
                   PYTHONWARNINGS="ignore", PATH=env.get("PATH", "") + ":/usr/sbin")
        env.update(SIZES)
        env.update(extra)
        return env

    def run(self, *cmd: str) -> str:
        proc = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{' '.join(cmd)}: {proc.stderr}"
        return proc.stdout

    def submit(self, out: str, args: list[str], sbatch: list[str], script: str = SCRIPT,
               **env: str) -> str:
        data = self.data if script == SCRIPT else self.bert_data
        proc = subprocess.run(["sbatch", "--parsable", f"--output={out}", *sbatch, script,
                               *args, *data], cwd=ROOT, env=self.env(**env),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().split(";")[0]

    def state(self, job: str) -> str:
        found = re.search(r"\bJobState=(\S+)", self.run("scontrol", "show", "job", "-o", job))
        return found.group(1) if found else "?"

    def wait_end(self, job: str, limit: float, out: str) -> str:
        _wait(lambda: self.state(job) in ENDED, limit, lambda: _tail(out))
        return self.state(job)


def _job_processes(job: str, node: str) -> dict[int, str]:
    """pid -> command line of this job's processes on `node` (their SLURM variables)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() in env and f"SLURMD_NODENAME={node}".encode() in env:
            found[int(pid)] = cmd
    return found


def _descendants(pid: int) -> list[int]:
    """pid's children, theirs, ... (torchrun's workers are in sessions of their own)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return []
    return children + [d for c in children for d in _descendants(c)]


class Reference:
    """The same script on one node with 4 processes, outside SLURM, in the background:
    it trains while the SLURM jobs train and is paused (SIGSTOP) while they start up."""

    def __init__(self, cluster: Cluster, work: str):
        self.cluster, self.work = cluster, work
        self.metrics = os.path.join(work, "reference.jsonl")
        self.proc: Optional[subprocess.Popen] = None

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def run(self) -> None:
        """Start it, or let it go on."""
        if self.proc is not None:
            self._signal(signal.SIGCONT)
            return
        env = self.cluster.env(NPROC_PER_NODE="4",
                               EXTRA_ARGS=f"{SPLIT} --metrics-file {self.metrics}")
        log = open(os.path.join(self.work, "reference.out"), "w")
        self.proc = subprocess.Popen(
            ["bash", SCRIPT, os.path.join(self.work, "ref-ckpt"),
             os.path.join(self.work, "ref-tb"), *self.cluster.data], cwd=ROOT, env=env,
            stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def losses(self, n: int, limit: float = 180) -> list[float]:
        """The first n losses (running it as far as that)."""
        if len(complete_records(self.metrics)) < n:
            self.run()
        proc = self.proc

        def ready() -> bool:
            done = len(complete_records(self.metrics)) >= n
            assert proc is None or proc.poll() is None or done, \
                _tail(os.path.join(self.work, "reference.out"))
            return done
        _wait(ready, limit, lambda: f"reference at {len(complete_records(self.metrics))} of {n}")
        return _losses(self.metrics)[:n]

    def stop(self) -> None:
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
        self.proc = None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, small_corpus):
    """The two-node cluster for this module (installs slurm-wlm and munge when missing)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: slurmd starts job steps as their user (CI runs as root)")
    env = dict(os.environ, LOCAL_SLURM_DIR=str(tmp_path_factory.mktemp("slurm")))
    up = subprocess.run(["bash", CLUSTER, "up"], env=env, capture_output=True, text=True,
                        timeout=900)
    if up.returncode:
        subprocess.run(["bash", CLUSTER, "down"], env=env, timeout=120)
        if not shutil.which("slurmctld", path=os.environ.get("PATH", "") + ":/usr/sbin"):
            pytest.skip(f"slurm-wlm and munge could not be installed: {up.stderr[-500:]}")
        pytest.fail(f"local_cluster.sh up failed:\n{up.stdout}\n{up.stderr}")
    gpt, bert = small_corpus.gpt_tokenizer, small_corpus.bert_tokenizer
    yield Cluster(os.path.join(env["LOCAL_SLURM_DIR"], "slurm.conf"),
                  [gpt.vocab_file, gpt.merge_file, small_corpus.gpt_data_prefix],
                  [bert.vocab_file, small_corpus.bert_data_prefix])
    # keep the logs in pytest's temp dir; the daemons go in any case
    subprocess.run(["bash", CLUSTER, "down"], env=dict(env, LOCAL_SLURM_KEEP="1"),
                   timeout=120)


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    ref = Reference(cluster, str(tmp_path_factory.mktemp("reference")))
    yield ref
    ref.stop()


def _latest(ckpt: str) -> int:
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        return int(f.read())


def _requeue(cluster: Cluster, job: str, tries: int = 3) -> None:
    """`scontrol requeue`, until the job is pending or running again. A requeue right
    after the job ended can be scheduled at once onto a slurmd that still lists the job
    as just killed ("Job 1 already killed, do not launch batch job"): it then ends again
    without running, and is requeued once more after a pause."""
    for _ in range(tries):
        time.sleep(2)
        cluster.run("scontrol", "requeue", job)
        deadline = time.monotonic() + 30  # a job still completing is requeued when done
        while time.monotonic() < deadline:
            if cluster.state(job) in ("PENDING", "RUNNING", "CONFIGURING"):
                return
            time.sleep(0.5)
    raise AssertionError(f"job {job} did not start again after {tries} requeues: "
                         f"{cluster.state(job)}")


def _shorten_limit(cluster: Cluster, job: str) -> None:
    """Time limit: the minute after the next (SLURM counts whole minutes), so that with
    --signal=TERM@90 the SIGTERM is due at once and comes at slurmctld's next check."""
    found = re.search(r"\bRunTime=(?:(\d+)-)?(\d+):(\d+):(\d+)",
                      cluster.run("scontrol", "show", "job", "-o", job))
    assert found, job
    d, h, m, sec = (int(x or 0) for x in found.groups())
    minutes = ((d * 24 + h) * 60 + m) + (1 if sec else 0) + 1
    cluster.run("scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}")


def test_time_limit_saves_and_requeue_resumes_exactly(cluster, reference, tmp_path) -> None:
    """torchrun per node; the time limit's SIGTERM saves; the requeued job resumes."""
    ckpt, out, metrics = (str(tmp_path / n) for n in ("ckpt", "job.out", "m.jsonl"))
    args = [ckpt, str(tmp_path / "tb")]
    job = cluster.submit(out, args, ["--time=10", "--signal=TERM@90"], LAUNCHER="torchrun",
                         EXTRA_ARGS=f"{SPLIT} --metrics-file {metrics}")
    _wait(lambda: bool(complete_records(metrics)) or cluster.state(job) in ENDED, 180,
          lambda: _tail(out))
    _shorten_limit(cluster, job)  # the handler is in now
    reference.run()  # not before: it would slow the job's start-up
    state = cluster.wait_end(job, 120, out)
    reference.pause()
    log = _tail(out, 100_000)
    assert os.path.exists(os.path.join(ckpt, "latest_checkpointed_iteration.txt")), (
        f"no checkpoint ({state}):\n{log[-3000:]}")
    k = _latest(ckpt)
    assert state == "COMPLETED", log[-3000:]  # every rank and both agents exited 0
    assert f"exiting at iteration {k} after receiving SIGTERM" in log, log[-3000:]
    iterations = [r["iteration"] for r in complete_records(metrics)]
    assert k % CHECK == 0 and iterations == list(range(1, k + 1))

    _requeue(cluster, job)
    # now, not in 2 minutes (SLURM's wait after a requeue); and ended by scancel below,
    # not by a second time limit
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now", "TimeLimit=10")
    _wait(lambda: len(complete_records(metrics)) > k or cluster.state(job) in ENDED, 180,
          lambda: _tail(out))
    reference.run()
    cluster.run("scancel", "--signal=TERM", job)  # the steps' processes, as the limit does
    state = cluster.wait_end(job, 120, out)
    log = _tail(out, 100_000)
    assert state == "COMPLETED", log[-3000:]
    assert f"resumed from {ckpt} at iteration {k}" in log, log[-3000:]
    k2 = _latest(ckpt)
    assert k2 > k and [r["iteration"] for r in complete_records(metrics)] == list(range(1, k2 + 1))
    expected = reference.losses(k2)
    reference.stop()
    assert _losses(metrics) == expected  # bit for bit, across the requeue


def test_srun_tasks_and_a_lost_node(cluster, reference, tmp_path) -> None:
    """srun starts every process; SIGKILL of node n2's ranks ends the whole job: n1's ranks
    see the connections reset (a silent peer would take the distributed timeout), say so in
    one line and exit 1 after rank 0 kept the store up for ranks still leaving (HOST_WAIT_S,
    10 s: this is most of the time measured, about 10 s)."""
    out, metrics = str(tmp_path / "job.out"), str(tmp_path / "m.jsonl")
    job = cluster.submit(out, [str(tmp_path / "ckpt"), str(tmp_path / "tb")], [],
                         LAUNCHER="srun", EXTRA_ARGS=f"{SPLIT} --metrics-file {metrics}",
                         **{TIMEOUT_ENV: str(TIMEOUT_S)})
    first = 10
    try:
        _wait(lambda: len(complete_records(metrics)) >= first or cluster.state(job) in ENDED, 120,
              lambda: _tail(out))
        ranks = {node: [c for c in _job_processes(job, node).values()  # not srun
                        if c.startswith(sys.executable) and "pretrain_gpt.py" in c]
                 for node in ("n1", "n2")}
        assert [len(r) for r in ranks.values()] == [2, 2], (ranks, _tail(out))
        lost = _job_processes(job, "n2")
        for pid in lost:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        state = cluster.wait_end(job, TIMEOUT_S + 60, out)
        took = time.monotonic() - killed
    finally:
        subprocess.run(["scancel", "--full", job], env=cluster.env(), timeout=60)
    assert state == "FAILED", _tail(out)
    assert took < TIMEOUT_S + HOST_WAIT_S + 10, (took, _tail(out))  # 10: a loaded machine
    # n1's ranks ended themselves, naming what they lost: the stage when a transfer
    # noticed, the group when a collective did (the tied-embedding sum, the stop check)
    assert re.search(r"error: .*(lost the connection to stage 1|lost a member)",
                     _tail(out)), _tail(out)
    assert not _job_processes(job, "n1") and not _job_processes(job, "n2")
    assert _losses(metrics)[:first] == reference.losses(first)


def test_bert_script_runs(cluster, tmp_path) -> None:
    """The BERT script as submitted (LAUNCHER unset: torchrun per node), three iterations."""
    out, ckpt = str(tmp_path / "job.out"), str(tmp_path / "ckpt")
    job = cluster.submit(out, [ckpt, str(tmp_path / "tb")], [], script=BERT_SCRIPT,
                         NUM_LAYERS="2", SEQ_LENGTH="32", GLOBAL_BATCH_SIZE="8",
                         TRAIN_ITERS="3", LOG_INTERVAL="1", EXTRA_ARGS=SPLIT)
    assert cluster.wait_end(job, 120, out) == "COMPLETED", _tail(out)
    log = _tail(out, 100_000)
    assert "2 node(s) x 2 processes by torchrun" in log
    assert re.search(r"iteration +3/ +3 .*pipeline schedule: 2bw", log), log[-3000:]
    assert _latest(ckpt) == 3
