"""Two torchrun agents as two nodes, no SLURM (issue 13): `--nnodes 2 --node-rank 0/1`,
each with 2 processes, meeting by torchrun's c10d rendezvous on localhost, train PP=2 x
DP=2 with 2BW; the losses equal one agent's 4-process run of the same flags, bit for bit.
With c10d, torchrun orders the agents as they join (the node rank is a hint): either order
gives the same world of four ranks."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.dist_harness import free_port
from tests.entry_harness import ROOT, TINY, launch, losses

pytestmark = pytest.mark.slow

FLAGS = ["--global-batch-size", "8", "--pipeline-model-parallel-size", "2",
         "--pipeline-schedule", "2bw", "--train-iters", "6"]


def _agent(node_rank: int, endpoint: str, metrics: str, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
           str(node_rank), "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes",
           os.path.join(ROOT, "pretrain_gpt.py"), *TINY, *FLAGS, "--metrics-file", metrics]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def test_two_agents_train_as_one(tmp_path) -> None:
    metrics = str(tmp_path / "two.jsonl")
    endpoint = f"127.0.0.1:{free_port()}"
    logs = [str(tmp_path / f"agent{rank}.out") for rank in (0, 1)]
    agents = []
    try:
        for rank, log in enumerate(logs):
            with open(log, "w") as f:
                agents.append(_agent(rank, endpoint, metrics, f))
        for agent in agents:
            agent.wait(timeout=240)
    finally:
        for agent in agents:
            if agent.poll() is None:  # its workers first: each is in a session of its own
                with open(f"/proc/{agent.pid}/task/{agent.pid}/children") as f:
                    for pid in f.read().split():
                        os.kill(int(pid), signal.SIGKILL)
                agent.kill()
                agent.wait()
    for agent, log in zip(agents, logs):
        with open(log) as f:
            assert agent.returncode == 0, f.read()[-4000:]
    with open(metrics) as f:
        two = [r for r in map(json.loads, f) if r.get("split", "train") == "train"]
    assert [r["iteration"] for r in two] == list(range(1, 7))  # one writer: the last rank
    one = launch("gpt", 4, FLAGS, str(tmp_path / "one.jsonl"))
    assert losses(two) == losses(one)
