"""Chaos: kill a training job N times at random moments, resume it each time, and check
that every iteration's loss equals an uninterrupted run's, bit for bit.

    OMP_NUM_THREADS=1 python tools/chaos.py --config 2bw --kills 8 --seed 0 --out runs/chaos

Each kill is one of: SIGKILL to one rank (torchrun then ends the others), SIGKILL to the
launcher (its workers notice and leave), SIGTERM to the launcher (torchrun passes it on;
the ranks stop as a Ctrl-C or a SLURM time limit would). Most kills are timed to land
inside a save: the tool watches the save directory for the save it aims at
(`save_in_progress.json`, written before any rank writes) and kills a random fraction of
a save's length later; the first kill always lands in the first save, before any
checkpoint is complete. The job runs with MEGATRON_2BW_SAVE_DELAY_FOR_TESTS, a pause at
each step of a save, so that a tiny model's save lasts long enough to be hit at any step.
After each kill, every process of the job has to end by itself within a minute; then the
same command starts again (`--load` = `--save`), and must resume without a hand on the
checkpoint directory. The last start runs to --train-iters. Then the metrics file's rows
(--metrics-file, one JSON row per iteration) are compared with an uninterrupted run's.

Configurations (two ranks each, the machine's two cores): `2bw` (PipeDream-2BW over two
pipeline stages, --ckpt-format torch_dist), `distopt` (--use-distributed-optimizer at
data-parallel size 2, torch_dist), `torch` (2BW over two stages, --ckpt-format torch).

Output: a progress line per launch and kill, then a summary (also `OUT/summary.json`);
exit status 0 when every iteration matched and no start needed a hand.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_2bw.checkpointing import files as cf  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
         "--lr", "1e-2", "--min-lr", "1e-3", "--lr-decay-style", "cosine",
         "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--mock-data",
         "--vocab-size", "127", "--make-vocab-size-divisible-by", "64", "--eval-iters", "0",
         "--log-interval", "1", "--global-batch-size", "8"]
CONFIGS = {
    "2bw": ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw",
            "--ckpt-format", "torch_dist"],
    "distopt": ["--use-distributed-optimizer", "--ckpt-format", "torch_dist"],
    "torch": ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw",
              "--ckpt-format", "torch"],
}
NPROC = 2
SAVE_INTERVAL = 2
DELAY = 0.25       # seconds of pause at each step of a save (MEGATRON_2BW_SAVE_DELAY_FOR_TESTS)
SAVE_SPAN = 1.5    # a save's length with those pauses: kills land up to this long after it began
KINDS = ("rank SIGKILL", "launcher SIGKILL", "launcher SIGTERM")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Kill:
    """One planned kill and what it found."""

    kind: str
    moment: str                 # "save" or "training"
    target: int                 # the save's iteration, or the metrics row to wait for
    offset: float = 0.0         # seconds after the save began
    landed: str = ""            # where it landed, read from the checkpoint directory
    resumed_from: Optional[int] = None
    notes: list = field(default_factory=list)


# ---------------------------------------------------------------------------- one launch


class Job:
    """One torchrun launch of the training command, its output in `log`."""

    def __init__(self, argv: list, log: str, env: dict) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(NPROC),
               "--master-port", str(free_port()), os.path.join(ROOT, "pretrain_gpt.py"), *argv]
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env)
        self.tree: set[int] = {self.proc.pid}

    def watch(self) -> None:
        """Remember every process of the job seen so far (workers, their writers)."""
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return
        self.tree |= {k.pid for k in kids}

    def workers(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children()
        except psutil.Error:
            return []

    def alive(self) -> bool:
        return self.proc.poll() is None

    def end(self, limit: float) -> list[int]:
        """Wait for every process of the job to end; SIGKILL (and return) those that are
        still there after `limit` seconds."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            self.watch()
            if self.proc.poll() is not None and not _living(self.tree - {self.proc.pid}):
                break
            time.sleep(0.1)
        left = _living(self.tree)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.log.close()
        return [p for p in left if p != self.proc.pid]


def _living(pids: set[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return sorted(out)


# ---------------------------------------------------------------------------- kills


def _marker_stamp(ckpt: str) -> Optional[tuple]:
    """(inode, mtime) of the save marker, None without one: a new save writes a new one."""
    try:
        st = os.stat(os.path.join(ckpt, cf.SAVING))
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _save_began(ckpt: str, iteration: int, before: Optional[tuple]) -> Optional[int]:
    """The save this launch began, when it is that of `iteration` or a later one (a
    marker written since `before`, naming it); else None."""
    stamp = _marker_stamp(ckpt)
    if stamp is None or stamp == before:
        return None
    try:
        with open(os.path.join(ckpt, cf.SAVING)) as f:
            seen = int(json.load(f)["iteration"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return seen if seen >= iteration else None


def _logged(log: str, iteration: int) -> bool:
    """Whether this launch's log has the line of `iteration` (Megatron-LM's
    ` iteration        7/      36 |`)."""
    try:
        with open(log, errors="replace") as f:
            text = f.read()
    except OSError:
        return False
    found = re.findall(r" iteration\s+(\d+)/", text)
    return bool(found) and int(found[-1]) >= iteration


def _rows(path: str) -> list[dict]:
    """The metrics file's whole train rows."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        if not line.endswith("\n"):
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("split", "train") == "train":
            rows.append(row)
    return rows


def _newest_run(rows: list[dict]) -> list[dict]:
    """The rows from the last place where the iterations go down (a start from iteration
    0 appends after an earlier run's rows; a resume drops its own rows past the
    checkpoint first)."""
    starts = [i for i in range(1, len(rows)) if rows[i]["iteration"] < rows[i - 1]["iteration"]]
    return rows[starts[-1]:] if starts else rows


def _wait_for(job: Job, ready: Callable[[], bool], limit: float = 600) -> bool:
    deadline, polls = time.monotonic() + limit, 0
    while time.monotonic() < deadline and job.alive():
        if polls % 50 == 0:
            job.watch()
        if ready():
            return True
        polls += 1
        time.sleep(0.002)
    return False


def _deliver(job: Job, kill: Kill, rng: random.Random) -> str:
    """Send the kill; returns whom it hit."""
    if kill.kind == "rank SIGKILL":
        workers = job.workers()
        if not workers:
            return "no worker left"
        victim = rng.choice(workers)
        try:
            rank = victim.environ().get("RANK", "?")
        except psutil.Error:
            rank = "?"
        victim.send_signal(signal.SIGKILL)
        return f"rank {rank}"
    job.proc.send_signal(signal.SIGKILL if kill.kind == "launcher SIGKILL" else signal.SIGTERM)
    return "torchrun"


def _state(ckpt: str) -> str:
    """The checkpoint directory as the kill left it, in a few words."""
    tracked = cf.tracker_file(ckpt)
    parts = [f"tracker {tracked if tracked is not None else 'none'}"]
    for i in cf.list_iterations(ckpt):
        if tracked is not None and i <= tracked:
            continue
        what = "complete, untracked" if cf.is_complete(ckpt, i) else "no manifest"
        parts.append(f"iter {i}: {what}")
    try:
        with open(os.path.join(ckpt, cf.SAVING)) as f:
            parts.append(f"marker of the save of {json.load(f)['iteration']}")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return ", ".join(parts)


# ---------------------------------------------------------------------------- the run


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.rng = args, random.Random(args.seed)
        self.began = time.monotonic()
        self.out = os.path.abspath(args.out)
        self.iters = SAVE_INTERVAL * 2 * (args.kills + 2)
        self.ckpt = os.path.join(self.out, "ckpt")
        self.metrics = os.path.join(self.out, "chaos.jsonl")
        self.launches = 0
        self.kills: list[Kill] = []
        self.problems: list[str] = []
        self.hand = False  # a launch that stopped by itself (a refusal): needs a hand
        self.order = self.rng.sample(KINDS, len(KINDS))  # kinds in turn: each one comes

    def say(self, text: str) -> None:
        print(f"[chaos {self.args.config}] {text}", flush=True)

    def problem(self, text: str) -> None:
        self.problems.append(text)
        self.say(f"PROBLEM: {text}")

    def argv(self, ckpt: str, metrics: str) -> list:
        return [*MODEL, *CONFIGS[self.args.config], "--train-iters", str(self.iters),
                "--save", ckpt, "--load", ckpt, "--save-interval", str(SAVE_INTERVAL),
                "--metrics-file", metrics, "--seed", str(1234 + self.args.seed)]

    def launch(self, ckpt: str, metrics: str, delay: bool = True) -> Job:
        self.launches += 1
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   MEGATRON_2BW_TIMEOUT_SECONDS="60")
        if delay:
            env[cf.SAVE_DELAY_ENV] = str(DELAY)
        log = os.path.join(self.out, f"launch{self.launches:02d}.log")
        return Job(self.argv(ckpt, metrics), log, env)

    def reference(self) -> list[dict]:
        """The uninterrupted run (same flags and saves, no pauses)."""
        ckpt, metrics = os.path.join(self.out, "ref_ckpt"), os.path.join(self.out, "ref.jsonl")
        job = self.launch(ckpt, metrics, delay=False)
        job.proc.wait()
        job.end(60)
        if job.proc.returncode != 0:
            raise SystemExit(f"the uninterrupted run failed (exit {job.proc.returncode}); "
                             f"see {job.log.name}")
        rows = _rows(metrics)
        self.say(f"uninterrupted run: {len(rows)} iterations ({job.log.name})")
        return rows

    def plan(self, index: int, committed: int) -> Kill:
        """The kinds in turn (a shuffled order); the first kill lands in the first save,
        before its manifest; then 3 in 4 in one of the next two saves, the others after a
        random iteration."""
        kind = self.order[index % len(self.order)]
        if index == 0:  # before its manifest: no checkpoint is complete yet
            return Kill(kind, "save", SAVE_INTERVAL, self.rng.uniform(0, 2 * DELAY))
        next_save = (committed // SAVE_INTERVAL + 1) * SAVE_INTERVAL
        if self.rng.random() < 0.75:
            target = next_save + SAVE_INTERVAL * self.rng.randrange(2)
            return Kill(kind, "save", min(target, self.iters), self.rng.uniform(0, SAVE_SPAN))
        return Kill(kind, "training", min(committed + self.rng.randrange(1, 2 * SAVE_INTERVAL),
                                          self.iters))

    def start(self, delay: bool = True) -> tuple[Job, Optional[int]]:
        """Launch the training command; with the iteration it should resume from."""
        expected = cf.read_tracker(self.ckpt) if os.path.isdir(self.ckpt) else None
        return self.launch(self.ckpt, self.metrics, delay), expected

    def started_right(self, job: Job, expected: Optional[int]) -> None:
        """The launch resumed from the newest complete checkpoint, or refused to start
        (a start that needs a hand: a problem)."""
        with open(job.log.name, errors="replace") as f:
            text = f.read()
        found = re.findall(r"resumed from \S+ at iteration (\d+)", text)
        got = int(found[-1]) if found else None
        if got != expected and found:
            self.problem(f"launch {self.launches} resumed from {got}, the newest complete "
                         f"checkpoint is {expected}")
        if self.kills:
            kill = self.kills[-1]
            kill.resumed_from = got
            for key, note in (("a save that did not finish", "ignored an unfinished save"),
                              ("its save was stopped after", "resumed a save committed late")):
                if key in text and note not in kill.notes:
                    kill.notes.append(note)

    def one_kill(self, index: int) -> Optional[Kill]:
        """Start the job, kill it as planned, wait for all of it to end; None when the job
        ended before the kill could land."""
        job, expected = self.start()
        kill = self.plan(index, expected or 0)
        before = _marker_stamp(self.ckpt)
        if kill.moment == "save":
            def ready() -> bool:
                seen = _save_began(self.ckpt, kill.target, before)
                if seen is not None:
                    kill.target = seen  # the save it saw begin (a later one if it was slow)
                return seen is not None
        else:
            ready = lambda: _logged(job.log.name, kill.target)  # noqa: E731
        landed = _wait_for(job, ready)
        if landed and kill.moment == "save":
            time.sleep(kill.offset)
        whom = _deliver(job, kill, self.rng) if landed and job.alive() else None
        in_save = _marker_stamp(self.ckpt) not in (None, before)
        left = job.end(60)
        self.started_right(job, expected)
        if whom is None:
            if job.proc.returncode != 0:
                self.hand = True
                self.problem(f"launch {self.launches} stopped with exit "
                             f"{job.proc.returncode} before its kill ({job.log.name})")
            return None
        kill.landed = ("in a save: " if in_save else "") + _state(self.ckpt)
        where = (f"{kill.offset:.2f} s after the save of iteration {kill.target} began"
                 if kill.moment == "save" else f"after iteration {kill.target}")
        self.say(f"kill {index + 1}/{self.args.kills}: {kill.kind} ({whom}) {where}; "
                 f"left: {kill.landed}")
        if left:
            self.problem(f"kill {index + 1}: processes {left} outlived the job by a minute")
        return kill

    def run(self) -> dict:
        os.makedirs(self.out, exist_ok=True)
        self.say(f"{self.args.kills} kills, seed {self.args.seed}, {self.iters} iterations, "
                 f"a save every {SAVE_INTERVAL}; output in {self.out}")
        reference = self.reference()
        for index in range(self.args.kills):
            kill = self.one_kill(index)
            if kill is None:
                self.say("the job ended before the kill could land; the other kills are "
                         "skipped")
                break
            self.kills.append(kill)
        final, expected = self.start(delay=False)
        final.proc.wait()
        final.end(60)
        self.started_right(final, expected)
        if final.proc.returncode != 0:
            self.hand = True
            self.problem(f"the last launch ended with exit {final.proc.returncode} "
                         f"({final.log.name})")
        self.say(f"last launch ({self.launches}): exit {final.proc.returncode}")
        return self.summary(reference, _newest_run(_rows(self.metrics)))

    def summary(self, reference: list[dict], rows: list[dict]) -> dict:
        ref = {r["iteration"]: r["loss"] for r in reference}
        got = [(r["iteration"], r["loss"]) for r in rows]
        its = [i for i, _ in got]
        same = sum(1 for i, loss in got if ref.get(i) == loss)
        if its != sorted(ref):
            self.problem(f"iterations {its[:5]}...{its[-5:]} logged, expected 1..{len(ref)} once")
        if same != len(ref):
            first = next((i for i, loss in got if ref.get(i) != loss), None)
            self.problem(f"{len(ref) - same} of {len(ref)} losses differ from the "
                         f"uninterrupted run (first at iteration {first})")
        counts = {k: sum(x.kind == k for x in self.kills) for k in KINDS}
        doc = {"config": self.args.config, "seed": self.args.seed, "kills": len(self.kills),
               "kinds": counts,
               "in_a_save": sum(x.landed.startswith("in a save") for x in self.kills),
               "first_save_hit": bool(self.kills) and self.kills[0].landed.startswith(
                   "in a save: tracker none"),
               "launches": self.launches, "iterations": len(ref), "bit_exact": same,
               "needed_a_hand": self.hand,
               "seconds": round(time.monotonic() - self.began),
               "problems": self.problems, "ok": not self.problems,
               "detail": [asdict(k) for k in self.kills]}
        with open(os.path.join(self.out, "summary.json"), "w") as f:
            json.dump(doc, f, indent=1)
        return doc


def summary_lines(doc: dict) -> list[str]:
    kinds = ", ".join(f"{n} {k}" for k, n in doc["kinds"].items())
    ignored = sum("ignored an unfinished save" in k["notes"] for k in doc["detail"])
    late = sum("resumed a save committed late" in k["notes"] for k in doc["detail"])
    return [f"config {doc['config']} (seed {doc['seed']}): {doc['kills']} kills ({kinds}); "
            f"{doc['in_a_save']} landed in a save, the first save (no checkpoint yet) "
            f"among them: {'yes' if doc['first_save_hit'] else 'no'}",
            f"  {doc['launches'] - 1} launches after the uninterrupted run, each resumed from "
            f"the newest complete checkpoint without a hand: "
            f"{'NO' if doc['needed_a_hand'] else 'yes'}; "
            f"unfinished saves ignored: {ignored}; saves killed after their manifest resumed "
            f"from: {late}",
            f"  losses bit-exact with the uninterrupted run: {doc['bit_exact']}/"
            f"{doc['iterations']} iterations; {'PASS' if doc['ok'] else 'FAIL'} "
            f"({doc['seconds']} s)"]


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="2bw")
    ap.add_argument("--kills", type=int, default=8, help="how many times to kill the job")
    ap.add_argument("--seed", type=int, default=0, help="chooses the kills and their moments")
    ap.add_argument("--out", default="runs/chaos", help="folder for the logs, checkpoints, "
                    "metrics and summary.json (emptied first)")
    args = ap.parse_args(argv)
    if args.kills < 0:
        ap.error("--kills must be 0 or more")
    args.out = os.path.join(args.out, args.config)
    if os.path.isdir(args.out):
        import shutil
        shutil.rmtree(args.out)
    doc = Chaos(args).run()
    print("\n".join(summary_lines(doc)), flush=True)
    for p in doc["problems"]:
        print(f"  problem: {p}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
