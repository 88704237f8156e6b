"""Output that cannot be written, stopping by hand, and no process outliving its job
(issue 31, items 5-7). The whole classes run as tools/fault_matrix.py classes 14-16; here
the pieces, each in a second or a few:

- the --save lock: a live holder is refused by name; a dead one's lock is taken over (its
  pid ended on this machine; its beat stopped elsewhere, whatever its clock says);
- HandStop: a stop signal raises in the main thread, waits for a save in progress, and a
  second one stops the save at once;
- a forked process dies with its rank; a rank leaves when its torchrun launcher is gone; a
  save whose forked writer is killed ends the rank with one line;
- write errors: a full disk named for torch_dist's writer, the metrics file and
  TensorBoard; preprocessing leaves nothing partial and an earlier output as it was.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from megatron_2bw.checkpointing import files as cf
from megatron_2bw.checkpointing import save_lock as sl
from megatron_2bw.training.signals import HAND_STOP, HandStop, Interrupted
from tests.entry_harness import ROOT

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=ROOT)


# ---------------------------------------------------------------- the --save lock


def _lock_doc(path: str, **fields) -> dict:
    """Another host's lock, written as a holder does (whole, by a rename)."""
    doc = {"host": "node-elsewhere", "machine": "m", "pid": 4242, "start": "1",
           "job": "slurm job 7", "token": "t", "beat": 0, "period": 0.05, **fields}
    with open(os.path.join(path, "w.json"), "w") as f:
        json.dump(doc, f)
    os.replace(os.path.join(path, "w.json"), os.path.join(path, sl.LOCK))
    return doc


def test_a_live_holder_is_refused_by_name_and_release_frees(tmp_path) -> None:
    root = str(tmp_path / "ckpt")
    first = sl.SaveLock.acquire(root, period=0.05)
    try:
        with pytest.raises(cf.CheckpointError, match=rf"in use by another job: .*pid "
                                                     rf"{os.getpid()} on "):
            sl.SaveLock.acquire(root, period=0.05)
        sl.check_save_lock(root)  # still ours
    finally:
        first.release()
    assert not os.path.exists(os.path.join(root, sl.LOCK))
    sl.SaveLock.acquire(root, period=0.05).release()


def test_a_dead_process_lock_on_this_machine_is_taken_over_at_once(tmp_path) -> None:
    root = str(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    owner = sl.LockOwner.of_this_process(0.05)
    with open(os.path.join(root, sl.LOCK), "w") as f:
        f.write(owner.__class__(**{**owner.__dict__, "pid": dead.pid}).to_json())
    notes: list[str] = []
    start = time.monotonic()
    lock = sl.SaveLock.acquire(root, period=30.0, note=notes.append)
    lock.release()
    assert time.monotonic() - start < 5  # no waiting on a beat: the pid tells
    assert len(notes) == 1 and f"its process (pid {dead.pid}) has ended" in notes[0]


@pytest.mark.parametrize("skew", [0.0, 3600.0, -3600.0])
def test_another_hosts_lock_is_judged_by_its_beat_not_its_clock(tmp_path, skew) -> None:
    """A stopped beat is stale whatever the timestamp (a node's clock an hour ahead or
    behind); a moving beat is a live job, refused by name."""
    root = str(tmp_path)
    _lock_doc(root, time=time.time() + skew)
    notes: list[str] = []
    sl.SaveLock.acquire(root, period=0.05, note=notes.append).release()
    assert "slurm job 7 (pid 4242 on node-elsewhere)" in notes[0]
    assert "its beat did not move" in notes[0]

    stop = threading.Event()
    _lock_doc(root, time=time.time() + skew)

    def beat() -> None:
        n = 0
        while not stop.wait(0.03):
            n += 1
            _lock_doc(root, beat=n, time=time.time() + skew)
    beating = threading.Thread(target=beat)
    beating.start()
    try:
        with pytest.raises(cf.CheckpointError, match=r"slurm job 7 \(pid 4242 on "
                                                     r"node-elsewhere\) still writes there"):
            sl.SaveLock.acquire(root, period=0.05)
    finally:
        stop.set()
        beating.join()


def test_a_lock_taken_over_meanwhile_stops_the_next_save(tmp_path) -> None:
    root = str(tmp_path)
    lock = sl.SaveLock.acquire(root, period=60.0)
    try:
        _lock_doc(root)  # another job judged it stale (a frozen node) and took it
        with pytest.raises(cf.CheckpointError, match="was taken over by slurm job 7"):
            sl.check_save_lock(root)
    finally:
        lock.release()
    assert json.load(open(os.path.join(root, sl.LOCK)))["job"] == "slurm job 7"  # not ours


# ---------------------------------------------------------------- stopping by hand


def test_a_stop_signal_waits_for_a_save_and_a_second_one_does_not() -> None:
    stop = HandStop()
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    # a process's own defaults, whatever an earlier test in this process left behind
    # (a stopped run leaves the stop signals ignored on purpose)
    inherited = {sig: signal.getsignal(sig) for sig in signals}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    before = {sig: signal.getsignal(sig) for sig in signals}
    stop.install(graceful_sigterm=True)
    try:
        with pytest.raises(Interrupted) as raised:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert raised.value.signum == signal.SIGINT
        stop.reset()
        saved = []
        with pytest.raises(Interrupted):
            with stop.saving(5):
                os.kill(os.getpid(), signal.SIGHUP)
                time.sleep(0.05)
                saved.append(5)  # the save goes on to its end
        assert saved == [5] and stop.received == signal.SIGHUP
        stop.reset()
        with pytest.raises(Interrupted):
            with stop.saving(6):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGINT)  # the impatient second Ctrl-C
                time.sleep(1)
                saved.append(6)
        assert saved == [5]
        stop.reset()
        with pytest.raises(Interrupted):
            with stop.saving(7):
                stop._fork_begins()  # a save forks its writers: inside the fork's hooks a
                os.kill(os.getpid(), signal.SIGINT)  # raise would be printed and dropped
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                stop._fork_ends()
                saved.append(7)  # so both wait for the save's end
        assert saved == [5, 7]
        os.kill(os.getpid(), signal.SIGTERM)  # --exit-signal-handler: only noted
        assert stop.early_sigterm == signal.SIGTERM
        stop.quiet = True
        os.kill(os.getpid(), signal.SIGINT)  # leaving: noted, never raised
        stopped = dict(stop._previous)
        stop.uninstall()  # a run a signal stopped: its process is leaving
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        stop._previous.update(stopped)
        for sig in signals:
            signal.signal(sig, stop._on_signal)
        stop.reset()
    finally:
        stop.uninstall()  # a run that finished
        after = {sig: signal.getsignal(sig) for sig in signals}
        for sig, handler in inherited.items():
            signal.signal(sig, handler)
    # Python's Ctrl-C comes back; SIGTERM and SIGHUP (default: end the process) stay
    # ignored until the process exits
    assert after[signal.SIGINT] is before[signal.SIGINT]
    assert before[signal.SIGTERM] == signal.SIG_DFL and after[signal.SIGTERM] == signal.SIG_IGN
    assert HAND_STOP is not stop


# ------------------------------------------------------ no process outlives its job


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_a_forked_child_dies_with_its_rank(tmp_path) -> None:
    """What megatron-core's torch_dist writers are: forked from the rank's main thread."""
    rank = subprocess.Popen([sys.executable, _script(tmp_path, """
        import os, sys, time
        from megatron_2bw.training.watchdog import children_die_with_rank
        children_die_with_rank()
        pid = os.fork()
        if pid == 0:
            time.sleep(120)
            os._exit(0)
        print(pid, flush=True)
        time.sleep(120)
    """)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        child = int(rank.stdout.readline())
        rank.kill()
        rank.wait()
        assert _gone(child, 5)
    finally:
        rank.kill()


def test_the_writers_spawned_queue_server_dies_with_its_rank(tmp_path) -> None:
    """On CUDA megatron-core's torch_dist writers report through a Manager queue whose
    server is a spawned process, out of the fork hook's reach: ours gets the same death
    signal (the guard: the script's own main, spawn re-imports it)."""
    rank = subprocess.Popen([sys.executable, _script(tmp_path, """
        import time
        from megatron_2bw.training import watchdog
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

        if __name__ == "__main__":
            watchdog.writer_queue_dies_with_rank()
            queue = fa._get_write_results_queue()
            queue.put("written")
            assert queue.get() == "written" and fa._get_write_results_queue() is queue
            print(watchdog._MANAGERS[0]._process.pid, flush=True)
            time.sleep(120)
    """)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        server = int(rank.stdout.readline())
        assert not _gone(server, 0.5)
        rank.kill()
        rank.wait()
        assert _gone(server, 5)
    finally:
        rank.kill()


def test_a_torchrun_worker_leaves_when_its_launcher_is_killed(tmp_path) -> None:
    worker = _script(tmp_path, """
        import time
        from megatron_2bw.training.watchdog import LauncherWatch
        assert LauncherWatch.start() is not None
        print("ready", flush=True)
        time.sleep(120)
    """)
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys, time
        w = subprocess.Popen([sys.executable, {worker!r}], stdout=sys.stdout, stderr=sys.stdout)
        print(w.pid, flush=True)
        time.sleep(120)
    """)], env=dict(ENV, TORCHELASTIC_RUN_ID="test"), stdout=subprocess.PIPE, text=True)
    try:
        pid = int(launcher.stdout.readline())
        assert launcher.stdout.readline().strip() == "ready"
        launcher.kill()
        launcher.wait()
        assert _gone(pid, 10)
        line = launcher.stdout.readline()
        assert line.startswith("error: the launcher (torchrun, pid ") and "is gone" in line
    finally:
        launcher.kill()


def test_a_killed_writer_ends_its_save_with_one_line(tmp_path) -> None:
    """Without the watch the rank waits for it forever (megatron-core's join)."""
    proc = subprocess.run([sys.executable, _script(tmp_path, """
        import multiprocessing, os, signal, time
        from megatron_2bw.training.watchdog import save_guard
        fork = multiprocessing.get_context("fork")
        with save_guard(7):
            done = fork.JoinableQueue()
            done.put(1)  # the child would take it and mark it done
            child = fork.Process(target=time.sleep, args=(60,))
            child.start()
            os.kill(child.pid, signal.SIGKILL)
            done.join()  # megatron-core's writer waits so: never returns here
    """)], env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "checkpoint iteration 7" in lines[0], proc.stderr[-2000:]
    assert "killed by SIGKILL" in lines[0] and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- write errors


def test_a_writer_error_without_errno_is_named_by_the_free_space(tmp_path, monkeypatch) -> None:
    """megatron-core's writers report a full disk as torch's zip writer's 'unexpected pos'."""
    opaque = RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . "
                          "unexpected pos 704 vs 598")
    monkeypatch.setattr(cf, "nearly_full", lambda path: True)
    assert "the disk is full" in str(cf.writer_error(str(tmp_path), opaque))
    monkeypatch.setattr(cf, "nearly_full", lambda path: False)
    errno_text = RuntimeError("Worker failure: [Errno 28] No space left on device")
    assert "the disk is full" in str(cf.writer_error(str(tmp_path), errno_text))
    other = str(cf.writer_error(str(tmp_path), RuntimeError("boom")))
    import resource
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] == resource.RLIM_INFINITY:
        assert "the writer failed (boom)" in other and "intact" in other


def test_a_failed_save_is_discarded_unless_committed(tmp_path) -> None:
    root = str(tmp_path)
    os.makedirs(cf.iteration_dir(root, 1))
    cf.write_tracker(root, 1)
    os.makedirs(cf.iteration_dir(root, 2))
    assert cf.discard_partial(root, 1) is None and os.path.isdir(cf.iteration_dir(root, 1))
    assert cf.discard_partial(root, 2) == cf.iteration_dir(root, 2)
    assert not os.path.exists(cf.iteration_dir(root, 2))


def test_a_full_metrics_disk_names_the_flag(tmp_path) -> None:
    from megatron_2bw.training.errors import UserError
    from megatron_2bw.training.metrics import MetricsSink

    class Full:
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def close(self) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    sink = MetricsSink.__new__(MetricsSink)
    sink._file, sink.t = Full(), type("T", (), {"metrics_file": str(tmp_path / "m.jsonl")})
    with pytest.raises(UserError, match=r"the disk is full \(--metrics-file\)"):
        sink._write_row({"iteration": 1})


def test_tensorboards_writer_thread_keeps_its_os_error_quiet() -> None:
    from megatron_2bw.training.log_writers import _quiet_writer_thread

    seen = []
    hook = _quiet_writer_thread(seen.append)
    writer = type("_AsyncWriterThread", (), {})()
    hook(type("A", (), {"thread": writer, "exc_value": OSError(errno.ENOSPC, "full")})())
    hook(type("A", (), {"thread": writer, "exc_value": ValueError("a bug")})())
    assert [type(a.exc_value) for a in seen] == [ValueError]


def test_preprocessing_that_fails_leaves_the_earlier_output(tmp_path, monkeypatch) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_2bw.data.preprocess import PreprocessConfig, preprocess
    from megatron_2bw.data.tokenizers import TokenizerSpec

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"{i} {i + 1} 3"}) + "\n" for i in range(50)))
    config = PreprocessConfig(input=str(src), output_prefix=str(tmp_path / "out"),
                              tokenizer=TokenizerSpec("NullTokenizer", vocab_size=100))
    preprocess(config)
    files = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out"))
    before = {n: (tmp_path / n).read_bytes() for n in files}
    calls = []

    def full(self, ids, lengths) -> None:
        calls.append(1)
        if len(calls) > 20:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(IndexedDatasetBuilder, "add_document", full)
    with pytest.raises(OSError):
        preprocess(config)
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("out")}
    assert after == before and len(files) == 2


# ---------------------------------------------------------------- ranks that disagree


def _rank_view(host: str, torch_version: str = "2.13.0", **flags) -> dict:
    from megatron_2bw.training import agreement

    software = dict(agreement.software(), torch=torch_version)
    return {"host": host, "package": "/opt/m2bw", "software": software,
            "flags": {k: repr(v) for k, v in flags.items()}}


@pytest.mark.parametrize("rank1, says", [
    (_rank_view("n1", torch_version="2.12.0", lr=0.01),
     "the ranks of this job run different software: torch 2.12.0 on rank 1 (n1), 2.13.0 on "
     "rank 0 (n0) (the installed packages); run every rank from one environment"),
    (_rank_view("n1", lr=0.02, seed=2, save="b", load=None, data_path=["x"]),
     "rank 1 (n1) was started with other flags than rank 0 (n0): --data-path ['x'] on rank 1, "
     "unset on rank 0; --load unset on rank 1, a on rank 0; --lr 0.02 on rank 1, 0.01 on rank "
     "0 (and 2 more) (the command line); give every rank the same flags"),
])
def test_ranks_that_disagree_are_refused_naming_what_differs(monkeypatch, rank1, says) -> None:
    """Every rank shows the others its software and flags; rank 0's are the reference and
    the first difference is one UserError (the matrix runs two real ranks: class 16)."""
    from argparse import Namespace

    from megatron_2bw.training import agreement
    from megatron_2bw.training.errors import UserError

    rank0 = _rank_view("n0", lr=0.01, seed=1, save="a", load="a")
    monkeypatch.setattr(agreement.comm, "all_gather_object", lambda mine: [rank0, rank1])
    with pytest.raises(UserError) as err:
        agreement.check_ranks_agree(Namespace(lr=0.01), world_size=2)
    assert str(err.value).startswith(says), str(err.value)
    monkeypatch.setattr(agreement.comm, "all_gather_object", lambda mine: [rank0, rank0])
    agreement.check_ranks_agree(Namespace(lr=0.01), world_size=2)  # agreeing ranks pass
