"""Peers dying at any moment, a store that never answers, and the host's resources (the
whole classes run as tools/fault_matrix.py classes 18 and 19; here the pieces):

- a rank pointed at a store that accepts connections and never answers ends within the
  distributed timeout with one line;
- a configuration the planner's memory model says cannot fit is refused before the model
  is built, naming the flags and a micro-batch size that fits; an out-of-memory error,
  EMFILE and a full disk become one line naming the resource and what drives it;
- an open-file limit the job cannot start under is refused, a low soft one raised;
- a peer killed during a checkpoint save: the survivor's one line (slow: two ranks).
"""
from __future__ import annotations

import errno
import os
import resource
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from megatron_2bw.training import faults, memory_check
from megatron_2bw.training.arguments import config_from_args, parse_args
from megatron_2bw.training.errors import UserError
from tests.entry_harness import ROOT, TINY

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=ROOT)
CPU = __import__("torch").device("cpu")


def _run(extra: list[str]):
    return config_from_args(parse_args("gpt", [*TINY, "--train-iters", "2", *extra]), "gpt",
                            1, 128)


# ---------------------------------------------------------------- a silent store

JOIN = """
import sys
from megatron_2bw.training.distributed import init_distributed, rendezvous_pending
from megatron_2bw.training.errors import end_process, guarded
status = guarded(lambda: init_distributed(10.0) and 0)
if rendezvous_pending():
    end_process(status)
sys.exit(status)
"""


def test_a_store_that_never_answers_ends_within_the_timeout() -> None:
    """Rank 1 of 2 at a server that accepts and never replies: one line, exit 1, within
    the (2 s) timeout plus start-up, where it used to wait for good."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    held: list = []
    threading.Thread(target=lambda: held.append(server.accept()), daemon=True).start()
    env = dict(ENV, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(server.getsockname()[1]), MEGATRON_2BW_TIMEOUT_SECONDS="2")
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-c", JOIN], env=env, capture_output=True,
                              text=True, timeout=60)
    finally:
        server.close()
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: the rendezvous store at "), lines
    assert "did not answer within 2 s" in lines[0]
    assert time.monotonic() - start < 30


# ---------------------------------------------------------------- memory


def test_a_run_past_memory_is_refused_naming_the_flag_and_what_fits(monkeypatch) -> None:
    """The estimate of --micro-batch-size 4096 (0.8 GiB here) past a host that has 0.4 GiB
    beside what the process holds."""
    run = _run(["--micro-batch-size", "4096", "--global-batch-size", "4096"])
    room = psutil.Process().memory_info().rss + 0.4 * 2 ** 30
    small = memory_check.Capacity(room, room, "this host's memory")
    monkeypatch.setattr(memory_check, "capacity", lambda device, ranks: small)
    with pytest.raises(UserError) as err:
        memory_check.check_memory(run, CPU, 1, logs=True)
    line = str(err.value)
    assert "planner's memory model" in line and "--micro-batch-size 4096" in line, line
    fits = memory_check.last_fit().smaller
    assert fits is not None and fits[0] < 4096 and f"--micro-batch-size {fits[0]} " in line
    monkeypatch.setenv(memory_check.ENV, "0")
    memory_check.check_memory(run, CPU, 1, logs=True)  # the refusal turned off: a warning


def test_out_of_memory_names_the_flag() -> None:
    """The CPU allocator's error, after the check recorded this run's estimate."""
    run = _run(["--micro-batch-size", "64", "--global-batch-size", "64"])
    memory_check.check_memory(run, CPU, 1, logs=False)
    err = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                       "can't allocate memory: you tried to allocate 409600000 bytes. Error "
                       "code 12 (Cannot allocate memory)")
    fault = faults.classify(err)
    assert fault is not None and fault.end
    assert fault.line.startswith("error: out of memory on rank 0 ")
    assert "390.6 MiB" in fault.line and "--micro-batch-size 64" in fault.line, fault.line
    cuda = faults.classify(__import__("torch").cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
        "79.19 GiB of which 3.06 MiB is free."))
    assert cuda is not None and "20.0 MiB failed (on the GPU)" in cuda.line, cuda


def test_open_files_and_a_full_disk_are_faults_that_say_so(monkeypatch) -> None:
    emfile = faults.classify(RuntimeError("[enforce fail at loop.cc:48] rv != -1. pipe: "
                                          "Too many open files"))
    assert emfile is not None and "ulimit -n" in emfile.line
    full = faults.classify(OSError(errno.ENOSPC, "No space left on device", "/ckpt/x"))
    assert full is not None and "the disk is full writing /ckpt/x" in full.line
    assert faults.classify(ValueError("a user's mistake")) is None
    monkeypatch.setattr(resource, "getrlimit", lambda which: (
        (40, 40) if which == resource.RLIMIT_NOFILE else (resource.RLIM_INFINITY,) * 2))
    with pytest.raises(UserError, match=r"open-file limit \(ulimit -n\) is 40"):
        memory_check.check_open_files(2)


# ---------------------------------------------------------------- a peer dies in a save


@pytest.mark.slow
def test_a_peer_killed_mid_save_leaves_one_line_naming_it(tmp_path) -> None:
    """Rank 1 of PP2 SIGKILLed inside its checkpoint write (tools/fault_matrix.py class
    18's probe): rank 0 ends with one line naming rank 1 and the last checkpoint."""
    from tests.test_fault_matrix import _tool

    fm = _tool()
    probe = next(p for p in fm.all_probes() if p.name.startswith("rank 1 SIGKILLed mid torch save"))
    row = fm.run_probe(probe, fm.Shared(str(tmp_path / "shared")), str(tmp_path))
    assert row["outcome"] == "pass", row
    assert "rank 1 (pid" in row["first_line"] and row["traceback"] == "no", row
