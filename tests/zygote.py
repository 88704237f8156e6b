"""Start training ranks by forking a process that has already imported everything.

Most of a tiny training job's wall time here is start-up: each rank imports torch and
megatron-core (about 5.5 s of CPU on this machine) and torchrun imports torch again
before it starts them. The equality tests launch a hundred such jobs, so the suite
spent most of its time importing. The zygote imports once; each job forks its ranks
from it, and they run `megatron_2bw.training.entry.main` with the environment torchrun
would give them (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0 hosts
the store, as under `srun` or a bare env:// launch). Tests of the launchers themselves
(torchrun, SLURM, signals, exit codes) start real launchers and do not come here;
`M2BW_TEST_LAUNCHER=torchrun` sends every job back through torchrun.

The zygote must stay single-threaded and must never run torch code, so that a fork
is safe: it only imports, reads one request per line on stdin, forks, and waits.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron_2bw.training.entry",
           "megatron_2bw.training.loop", "megatron_2bw.models")


def _child(request: dict, rank: int) -> None:
    """In a forked rank: become `pretrain_<model>.py argv` under env://; never returns."""
    code = 1
    try:
        fd = os.open(request["logs"][rank], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.chdir(request["cwd"])
        nproc = request["nproc"]
        os.environ.update(request["env"], RANK=str(rank), LOCAL_RANK=str(rank),
                          WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                          GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(request["port"]))
        sys.argv = [os.path.join(ROOT, f"pretrain_{request['model']}.py"), *request["argv"]]
        from megatron_2bw.training.entry import main
        try:
            code = main(request["model"], request["argv"])
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # noqa: BLE001 - the traceback goes to the rank's log
        traceback.print_exc()
    finally:
        from megatron_2bw.runtime.process import exit_now  # preloaded
        exit_now(code)


def _reap(pids: list[int], codes: dict[int, int]) -> None:
    for rank, pid in enumerate(pids):
        if rank not in codes:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[rank] = os.waitstatus_to_exitcode(status)


def _run(request: dict) -> dict:
    """Fork the job's ranks and wait for them; as torchrun's agent does, once one fails
    the others get a few seconds, then they are killed, as at the timeout."""
    pids = []
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            _child(request, rank)
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + request["timeout"]
    while len(codes) < len(pids) and time.monotonic() < deadline:
        time.sleep(0.02)
        _reap(pids, codes)
        if any(codes.values()):
            deadline = min(deadline, time.monotonic() + 5)
    killed = [rank for rank in range(len(pids)) if rank not in codes]
    for rank in killed:
        os.kill(pids[rank], signal.SIGKILL)
        os.waitpid(pids[rank], 0)
        codes[rank] = -signal.SIGKILL
    return {"codes": [codes[r] for r in range(len(pids))], "killed": killed}


def serve() -> None:
    """The zygote: import, then one job per request line, one reply line per job."""
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:
        raise RuntimeError("the zygote started a thread; forking it would not be safe")
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        out.write(json.dumps(_run(json.loads(line))) + "\n")
        out.flush()


class Zygote:
    """The test session's zygote process (started on first use, ended at exit)."""

    _proc: Optional[subprocess.Popen] = None

    @classmethod
    def _get(cls) -> subprocess.Popen:
        if cls._proc is None or cls._proc.poll() is not None:
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
            cls._proc = subprocess.Popen(
                [sys.executable, "-c", "from tests.zygote import serve; serve()"],
                cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            ready = cls._proc.stdout.readline()
            if not ready:
                raise RuntimeError("the test zygote did not start")
            atexit.register(cls._proc.stdin.close)
        return cls._proc

    @classmethod
    def run(cls, model: str, nproc: int, argv: list[str], env: dict, port: int,
            logs: list[str], timeout: float) -> dict:
        proc = cls._get()
        request = {"model": model, "nproc": nproc, "argv": argv, "env": env, "port": port,
                   "logs": logs, "timeout": timeout, "cwd": ROOT}
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        reply = proc.stdout.readline()
        if not reply:
            raise RuntimeError("the test zygote died")
        return json.loads(reply)
