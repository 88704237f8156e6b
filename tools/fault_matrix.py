"""Fault matrix: bad inputs and faults against pretrain_gpt.py, tools/preprocess_data.py
and the planner, one probe at a time, each in its own temporary directory with a timeout.

    OMP_NUM_THREADS=1 python tools/fault_matrix.py --markdown runs/fault_matrix.md \\
        --json runs/fault_matrix.json [--only CLASS] [--probe NAME] [--jobs 1]

Classes: 1 resume semantics, 2 checkpoints, 3 late failures / output paths, 4 graceful stop,
5 hangs, 6 tracebacks for user errors, 7 bad data, 8 launcher misdetection, 9 the bugs,
10 a run that stopped learning (NaN, skipped iterations), 11 a checkpoint that
does not fit the model (shapes, vocabulary; a note for another seed or data flag), 12 data
the tokenizer cannot have produced, or that changes under a run, 13 data set
specifications (blend weights, splits, BERT sentences, stale index caches), 14 output that
cannot be written, 15 stopping a job by hand, 16 no rank outlives its job, 17 saves killed
at any moment (a SIGKILL at an exact step of a save, then the same command again), 21
messages that are right (the checkpoint's value first, the model type, a missing iteration),
18 peers dying at any moment (a rank SIGKILLed inside a save of either format, a validation,
the start-up; a store that never answers), 19 resources (memory past the planner's estimate,
an address-space or open-file limit, a validation that takes long).

Class 20, requests dropped in silence: a flag or an input the run cannot honour must be an
`error:` line or a `WARNING:` line naming it (validation asked of a --split without it, a
corpus shorter than one sequence, input bytes that are not UTF-8, a --metrics-file that a
new run appends to, flags that do nothing where they are given).

Classes 14-16 fill filesystems with a small tmpfs mounted in the probe's directory where this
process may mount one (root), else with a file size limit (RLIMIT_FSIZE, EFBIG) or /proc for
a read-only place; they start torchrun itself where the launcher is the point (Ctrl-C,
SIGTERM and SIGKILL to it), with each worker's output in its own file (--redirects 3).

A probe expects one of
- "error": a clean refusal: the expected exit status (2 for the trainer, 1 for preprocessing,
  2 for argparse), an `error:` line, no traceback, within the timeout;
- "ok": exit status 0 and the probe's check (a log line, the checkpoints, the metrics);
- "fault": an injected fault (a killed or frozen rank) ends every process within the timeout.
Its outcome is "pass", or one of "traceback" (a user error shown as a traceback), "silent"
(exit 0 where an error was due, or a wrong result without a word), "hang" (the timeout ran
out), "wrong" (any other mismatch). "traceback" means 'Traceback (most recent call last)' in
the workers' output (ranks are started directly with torchrun's variables, so no launcher
traceback is mixed in). "data intact": for probes that touch checkpoints, every iteration
that verified against its manifest before the fault still verifies afterwards and at least
one does (checksums through megatron_2bw.checkpointing.files); "-" for the others.
"""
from __future__ import annotations

import argparse
import warnings
import json
import os
import re
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PY = sys.executable
warnings.filterwarnings("ignore")
GPT = os.path.join(ROOT, "pretrain_gpt.py")
PREP = os.path.join(ROOT, "tools", "preprocess_data.py")
TIMEOUT_ENV = "MEGATRON_2BW_TIMEOUT_SECONDS"
CLASSES = {1: "resume semantics", 2: "checkpoints", 3: "late failures / output paths",
           4: "graceful stop", 5: "hangs", 6: "tracebacks for user errors", 7: "bad data",
           8: "launcher misdetection", 9: "the bugs", 10: "a run that stopped learning",
           11: "a checkpoint that does not fit", 12: "data the tokenizer cannot have made",
           13: "data set specifications",
           14: "output that cannot be written", 15: "stopping a job by hand",
           16: "no rank outlives its job", 17: "saves killed at any moment",
           21: "messages that are right", 20: "requests dropped in silence",
           18: "peers dying at any moment", 19: "resources"}
TB = "Traceback (most recent call last)"

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "1",
         "--log-interval", "1"]
MOCK = ["--mock-data", "--vocab-size", "127", "--make-vocab-size-divisible-by", "64"]
# the checkpoint probes damage the legacy format's per-rank files (--ckpt-format torch);
# torch_dist's manifest check is tested in tests/test_sharded_checkpoint.py
TINY = MODEL + MOCK + ["--lr", "1e-2", "--lr-decay-style", "constant", "--ckpt-format", "torch"]
# the shared checkpoint's schedule: linear decay, so every scheduler flag changes something
LIN = MODEL + MOCK + ["--lr", "1e-2", "--min-lr", "1e-3", "--lr-decay-style", "linear",
                      "--train-iters", "4", "--ckpt-format", "torch"]
PP2 = ["--global-batch-size", "8", "--pipeline-model-parallel-size", "2"]
DIST = LIN[:-1] + ["torch_dist"]  # LIN saved by dist_checkpointing (reshardable)
VOCAB = 1000  # the probe dataset: NullTokenizer ids 0..999
BERT_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT_WORDS = ["the", "cat", "dog", "sat", "ran", "on", "a", "mat", "fast", "slow", "red",
              "big", ".", "and", "it", "was"]


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS",
        "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID",
        "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- running


@dataclass
class Run:
    codes: list            # exit status per process (None: still running at the timeout)
    out: str               # all processes' stdout+stderr
    seconds: float
    timed_out: bool = False
    parts: list = field(default_factory=list)  # each worker's own output, where kept apart


def run1(argv: list, work: str, timeout: float = 90, env: Optional[dict] = None,
         preexec: Optional[Callable] = None) -> Run:
    """One process, its output merged."""
    start = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=work, env=env or _clean_env(), capture_output=True,
                              text=True, timeout=timeout, preexec_fn=preexec)
        return Run([proc.returncode], proc.stdout + proc.stderr, time.monotonic() - start)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return Run([None], out, time.monotonic() - start, True)


def gpt1(flags: list, work: str, **kw) -> Run:
    return run1([PY, GPT, *flags], work, **kw)


class Ranks:
    """nproc ranks started directly with torchrun's variables (no agent): their own exit
    codes, and signals delivered to one rank at a time."""

    def __init__(self, argv: list, nproc: int, work: str, env: Optional[dict] = None,
                 rank_argv: Optional[dict] = None, rank_env: Optional[dict] = None) -> None:
        """`rank_argv` maps a rank to its own command line (a job whose ranks disagree),
        `rank_env` a rank to variables of its own (another machine's identity)."""
        base = _clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                          **{"WORLD_SIZE": str(nproc), **(env or {})})
        self.logs = [open(os.path.join(work, f"rank{r}.log"), "w+") for r in range(nproc)]
        self.start = time.monotonic()
        self.procs = [subprocess.Popen((rank_argv or {}).get(r, argv), cwd=work,
                                       stdout=self.logs[r],
                                       stderr=subprocess.STDOUT,
                                       env=dict(base, RANK=str(r), LOCAL_RANK=str(r),
                                                **(rank_env or {}).get(r, {})))
                      for r in range(nproc)]

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def wait(self, timeout: float) -> Run:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        timed_out = any(p.poll() is None for p in self.procs)
        codes = [p.poll() for p in self.procs]
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.kill()
            p.wait()
        out = ""
        for f in self.logs:
            f.seek(0)
            out += f.read()
            f.close()
        return Run(codes, out, time.monotonic() - self.start, timed_out)


def metrics_rows(path: str, split: str = "train") -> list:
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            if line.endswith("\n"):
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if r.get("split", "train") == split:
                    rows.append(r)
    return rows


def wait_rows(path: str, count: int, alive: Callable[[], bool], limit: float = 120) -> bool:
    deadline = time.monotonic() + limit
    while len(metrics_rows(path)) < count:
        if not alive() or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ---------------------------------------------------------------------------- checkpoints


def sound_iterations(root: str) -> set:
    """Iterations whose every file matches its manifest's checksum."""
    from megatron_2bw.checkpointing import files as cf

    good = set()
    if not os.path.isdir(root):
        return good
    for it in cf.list_iterations(root):
        try:
            manifest = cf.read_manifest(root, it)
            if manifest and all(cf.verify(root, it, rel) for rel in manifest):
                good.add(it)
        except Exception:  # noqa: BLE001 - any failure means "not sound"
            pass
    return good


def flip_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 1]))


def rank_file(ckpt: str, it: int, rank: str = "mp_rank_00") -> str:
    return os.path.join(ckpt, f"iter_{it:07d}", rank, "model_optim_rng.pt")


# ---------------------------------------------------------------------------- shared inputs


class Shared:
    """Inputs built once per matrix run and copied into each probe's directory."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._cache: dict = {}

    def _once(self, key: str, build: Callable[[str], None]) -> str:
        if key not in self._cache:
            path = os.path.join(self.root, key)
            os.makedirs(path)
            build(path)
            self._cache[key] = path
        return self._cache[key]

    def ckpt(self) -> str:
        """1-process run of LIN stopped at iteration 2: checkpoints 1 and 2, metrics."""
        def build(path: str) -> None:
            r = gpt1(LIN + ["--save", "ckpt", "--save-interval", "1", "--exit-interval", "2",
                            "--metrics-file", "m.jsonl"], path, timeout=180)
            if r.codes != [0]:
                raise RuntimeError("shared checkpoint failed:\n" + r.out[-3000:])
        return self._once("ckpt1", build)

    def ckpt_2bw(self) -> str:
        """2-process 2BW PP2 run stopped at iteration 2 (checkpoints 1 and 2)."""
        def build(path: str) -> None:
            r = Ranks([PY, GPT, *TINY, *PP2, "--pipeline-schedule", "2bw", "--train-iters",
                       "4", "--save", "ckpt", "--save-interval", "1", "--exit-interval", "2",
                       "--metrics-file", "m.jsonl"], 2, path).wait(180)
            if r.codes != [0, 0]:
                raise RuntimeError("shared 2bw checkpoint failed:\n" + r.out[-3000:])
        return self._once("ckpt2bw", build)

    def ckpt_dist(self) -> str:
        """LIN in --ckpt-format torch_dist stopped at iteration 2 (checkpoints 1 and 2)."""
        def build(path: str) -> None:
            r = gpt1(DIST + ["--save", "ckpt", "--save-interval", "1", "--exit-interval", "2",
                             "--metrics-file", "m.jsonl"], path, timeout=180)
            if r.codes != [0]:
                raise RuntimeError("shared torch_dist checkpoint failed:\n" + r.out[-3000:])
        return self._once("ckptdist", build)

    def data(self, documents: int = 60) -> str:
        """A sound uint16 dataset made by the project's preprocessing (the first
        `documents` of the same 60)."""
        def build(path: str) -> None:
            import random

            from megatron_2bw.data.preprocess import PreprocessConfig, preprocess
            from megatron_2bw.data.tokenizers import TokenizerSpec

            rng = random.Random(3)
            with open(os.path.join(path, "in.jsonl"), "w") as f:
                for _ in range(documents):
                    doc = [str(rng.randrange(VOCAB)) for _ in range(rng.randrange(20, 80))]
                    f.write(json.dumps({"text": " ".join(doc)}) + "\n")
            preprocess(PreprocessConfig(input=os.path.join(path, "in.jsonl"),
                                        output_prefix=os.path.join(path, "data"),
                                        tokenizer=TokenizerSpec("NullTokenizer",
                                                                vocab_size=VOCAB),
                                        append_eod=True))
        key = "data" if documents == 60 else f"data{documents}"
        return os.path.join(self._once(key, build), "data_text_document")

    def bert_data(self) -> str:
        """BERT data preprocessed without --split-sentences: every document one sequence
        (of several sentences), and the vocab.txt it was made with beside it."""
        def build(path: str) -> None:
            from megatron_2bw.data.preprocess import PreprocessConfig, preprocess
            from megatron_2bw.data.tokenizers import TokenizerSpec

            with open(os.path.join(path, "vocab.txt"), "w") as f:
                f.write("\n".join(BERT_SPECIAL + BERT_WORDS) + "\n")
            with open(os.path.join(path, "in.jsonl"), "w") as f:
                for i in range(40):
                    sentences = [" ".join(BERT_WORDS[(i + j + k) % len(BERT_WORDS)]
                                          for k in range(6)) + "." for j in range(4)]
                    f.write(json.dumps({"text": " ".join(sentences)}) + "\n")
            preprocess(PreprocessConfig(input=os.path.join(path, "in.jsonl"),
                                        output_prefix=os.path.join(path, "bert"),
                                        tokenizer=TokenizerSpec(
                                            "BertWordPieceLowerCase",
                                            vocab_file=os.path.join(path, "vocab.txt"))))
        return os.path.join(self._once("bert", build), "bert_text_document")


def copy_ckpt(src_dir: str, work: str, name: str = "ckpt") -> str:
    dst = os.path.join(work, name)
    shutil.copytree(os.path.join(src_dir, "ckpt"), dst)
    if os.path.exists(os.path.join(src_dir, "m.jsonl")):
        shutil.copy(os.path.join(src_dir, "m.jsonl"), os.path.join(work, "m.jsonl"))
    return dst


def copy_data(prefix: str, work: str) -> str:
    folder = os.path.join(work, "d")
    os.makedirs(folder)
    for s in (".bin", ".idx"):
        shutil.copy(prefix + s, os.path.join(folder, "x" + s))
    return os.path.join(folder, "x")


def data_flags(prefix: str, work: str, vocab: int = VOCAB) -> list:
    return MODEL + ["--lr", "1e-3", "--train-iters", "200", "--data-path", prefix, "--split",
                    "90,10,0", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab),
                    "--data-cache-path", os.path.join(work, "cache")]


# ---------------------------------------------------------------------------- probes


@dataclass
class Ctx:
    work: str
    shared: Shared
    ckpt: Optional[str] = None    # the checkpoint dir whose soundness is "data intact"
    before: set = field(default_factory=set)
    cleanups: list = field(default_factory=list)  # run after judging (unmount, kill)
    notes: dict = field(default_factory=dict)     # what the act saw, for the check


@dataclass
class Probe:
    name: str
    klass: int
    expect: str                     # "error" | "ok" | "fault"
    act: Callable[[Ctx], Run]       # set up in ctx.work, run, return the run
    match: str = ""                 # must appear in the output
    check: Optional[Callable[[Ctx, Run], str]] = None  # "" if fine, else what is wrong
    code: int = 2                   # the exit status of a clean refusal
    slow: bool = False              # a multi-process probe
    quiet: bool = False             # a refusal left to another task to explain: no output


def _ck(ctx: Ctx, src: str = "ckpt1") -> str:
    """Copy a shared checkpoint into the probe dir and remember what verified there."""
    shared = {"ckpt1": ctx.shared.ckpt, "ckptdist": ctx.shared.ckpt_dist}.get(
        src, ctx.shared.ckpt_2bw)()
    ctx.ckpt = copy_ckpt(shared, ctx.work)
    return ctx.ckpt


def _mark(ctx: Ctx) -> None:
    ctx.before = sound_iterations(ctx.ckpt) if ctx.ckpt else set()


def gpt_err(name, klass, flags, match="", **kw) -> Probe:
    return Probe(name, klass, "error", lambda c: gpt1(flags, c.work), match, **kw)


def resume(extra: list, corrupt: Optional[Callable[[str], None]] = None,
           base: list = LIN, env: Optional[dict] = None, src: str = "ckpt1",
           preexec=None) -> Callable[[Ctx], Run]:
    def act(ctx: Ctx) -> Run:
        ck = _ck(ctx, src)
        if corrupt:
            corrupt(ck)
        _mark(ctx)
        flags = [*base, "--load", ck, "--save", ck, "--metrics-file", "m.jsonl", *extra]
        if src == "ckpt2bw":
            return Ranks([PY, GPT, *flags], 2, ctx.work, env).wait(120)
        return gpt1(flags, ctx.work, env=_clean_env(**(env or {})), preexec=preexec)
    return act


def tracker_is(it: int) -> Callable[[Ctx, Run], str]:
    def check(ctx: Ctx, r: Run) -> str:
        from megatron_2bw.checkpointing import files as cf

        got = cf.read_tracker(ctx.ckpt)
        return "" if got == it else f"tracker says {got}, expected {it}"
    return check


def rows_once(n: int) -> Callable[[Ctx, Run], str]:
    def check(ctx: Ctx, r: Run) -> str:
        its = [row["iteration"] for row in metrics_rows(os.path.join(ctx.work, "m.jsonl"))]
        return "" if its == list(range(1, n + 1)) else f"metrics iterations {its}"
    return check


def _rm(rel: str) -> Callable[[str], None]:
    return lambda ck: os.remove(os.path.join(ck, rel))


def _write(rel: str, text: str) -> Callable[[str], None]:
    def f(ck: str) -> None:
        with open(os.path.join(ck, rel), "w") as fh:
            fh.write(text)
    return f


def _truncate_file(path: str, frac: float = 0.5) -> None:
    os.truncate(path, int(os.path.getsize(path) * frac))


def class1() -> list:
    ok_sched = "learning-rate schedule"
    sched_err = "--override-opt_param-scheduler"
    P = []
    for name, extra in [("new --lr", ["--lr", "2e-2"]),
                        ("new --min-lr", ["--min-lr", "1e-4"]),
                        ("new --lr-decay-style", ["--lr-decay-style", "cosine"]),
                        ("new --lr-decay-iters", ["--lr-decay-iters", "10"]),
                        ("larger --train-iters", ["--train-iters", "8"]),
                        ("new --lr-warmup-iters", ["--lr-warmup-iters", "1"])]:
        P.append(Probe(f"resume with {name}", 1, "error", resume(extra), sched_err))
    P += [
        Probe("resume new --lr with --override-opt_param-scheduler", 1, "ok",
              resume(["--lr", "2e-2", "--override-opt_param-scheduler"]), ok_sched,
              check=tracker_is(4)),
        Probe("resume new --lr with --use-checkpoint-opt_param-scheduler", 1, "ok",
              resume(["--lr", "2e-2", "--use-checkpoint-opt_param-scheduler"]),
              check=tracker_is(4)),
        Probe("resume --train-iters below the checkpoint", 1, "error",
              resume(["--train-iters", "1"]), "below the checkpoint's iteration"),
        Probe("resume with the same flags", 1, "ok", resume([]), check=tracker_is(4)),
        Probe("resume after a crash keeps one metrics row per iteration", 1, "ok",
              resume([], corrupt=lambda ck: _append_rows(ck)), check=rows_once(4)),
        Probe("requeued resume with --exit-interval moves on to its next multiple", 1, "ok",
              resume(["--exit-interval", "2"]), "saved checkpoint at iteration 4",
              check=tracker_is(4)),
        Probe("resume with a larger --global-batch-size continues the data", 1, "ok",
              resume(["--global-batch-size", "4", "--override-opt_param-scheduler"]),
              "continues from sample 4", check=_data_continues(4, 4)),
        Probe("resume 2bw checkpoint into flush says so", 1, "ok",
              resume(["--pipeline-schedule", "flush", "--train-iters", "3"], base=TINY + PP2,
                     src="ckpt2bw"), "continuing from its newest weight version",
              check=tracker_is(3), slow=True),
    ]
    return P


def _data_continues(saved: int, gbs: int) -> Callable[[Ctx, Run], str]:
    """The first resumed iteration takes `gbs` samples after the checkpoint's `saved`
    (Megatron-LM's consumed_train_samples), not iteration x the new size."""
    def check(ctx: Ctx, r: Run) -> str:
        rows = metrics_rows(os.path.join(ctx.work, "m.jsonl"))
        got = [row["consumed_samples"] for row in rows if row["iteration"] == 3]
        return "" if got == [saved + gbs] else f"iteration 3 at consumed samples {got}, " \
            f"expected {saved + gbs}"
    return check


def _append_rows(ck: str) -> None:
    """The crashed run had logged iteration 3 and a torn line after its last save."""
    with open(os.path.join(os.path.dirname(ck), "m.jsonl"), "a") as f:
        f.write(json.dumps({"split": "train", "iteration": 3, "loss": 99.0}) + '\n{"spl')


def _fsize_limit(limit: int) -> Callable[[], None]:
    def pre() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return pre


def _tmp_leftovers(ck: str) -> None:
    for rel in ("latest_checkpointed_iteration.txt.tmp", "iter_0000002/mp_rank_00/x.pt.tmp",
                "iter_0000003/mp_rank_00/model_optim_rng.pt"):
        os.makedirs(os.path.dirname(os.path.join(ck, rel)), exist_ok=True)
        open(os.path.join(ck, rel), "w").close()


def _no_tmp(ctx: Ctx, r: Run) -> str:
    left = [os.path.join(d, n) for d, _, ns in os.walk(ctx.ckpt) for n in ns
            if n.endswith(".tmp")]
    return f"leftovers {left}" if left else tracker_is(4)(ctx, r)


def _fresh_over(ctx: Ctx) -> Run:
    ck = _ck(ctx)
    _mark(ctx)
    return gpt1([*LIN, "--save", ck, "--save-interval", "1"], ctx.work)


def class2() -> list:
    it2 = rank_file("", 2).lstrip("/")
    return [
        Probe("flipped byte in the newest checkpoint", 2, "error",
              resume([], lambda ck: flip_byte(os.path.join(ck, it2))), "sha256"),
        Probe("truncated checkpoint file", 2, "error",
              resume([], lambda ck: _truncate_file(os.path.join(ck, it2))), "truncated"),
        Probe("corrupt manifest", 2, "error",
              resume([], _write("iter_0000002/manifest.json", '{"files": {')),
              "manifest is unreadable"),
        Probe("checkpoint without manifest (Megatron-LM) loads with a warning", 2, "ok",
              resume([], _rm("iter_0000002/manifest.json")),
              "without checksum verification", check=tracker_is(4)),
        Probe("tracker gone, --save equal to --load", 2, "error",
              resume([], _rm("latest_checkpointed_iteration.txt")),
              "no latest_checkpointed_iteration.txt"),
        Probe("tracker gone with --overwrite-checkpoints starts fresh", 2, "ok",
              resume(["--overwrite-checkpoints"], _rm("latest_checkpointed_iteration.txt")),
              check=tracker_is(4)),
        Probe("tracker names a missing iteration", 2, "error",
              resume([], _write("latest_checkpointed_iteration.txt", "7"))),
        Probe("tracker holds garbage", 2, "error",
              resume([], _write("latest_checkpointed_iteration.txt", "abc"))),
        Probe("fresh run onto existing checkpoints without --load", 2, "error", _fresh_over,
              "starts from iteration 0"),
        Probe("leftovers of a failed save are removed", 2, "ok",
              resume([], _tmp_leftovers), check=_no_tmp),
        Probe("full disk (file size limit) during a save", 2, "error",
              resume([], preexec=_fsize_limit(60_000)), "file size limit"),
        Probe("checkpoint of another pipeline layout", 2, "error",
              resume(["--pipeline-schedule", "flush", "--train-iters", "3"], base=TINY,
                     src="ckpt2bw_as1")),
    ]


def _file(ctx: Ctx) -> str:
    path = os.path.join(ctx.work, "plain-file")
    open(path, "w").close()
    return path


def out_probe(name: str, flag: str, target: Callable[[Ctx], str], match: str = "") -> Probe:
    return Probe(name, 3, "error",
                 lambda c: gpt1([*TINY, "--train-iters", "3", flag, target(c)], c.work), match)


def class3() -> list:
    return [
        out_probe("--save under a plain file", "--save",
                  lambda c: os.path.join(_file(c), "sub", "ck"), "(--save)"),
        out_probe("--metrics-file under a plain file", "--metrics-file",
                  lambda c: os.path.join(_file(c), "m.jsonl"), "(--metrics-file)"),
        out_probe("--tensorboard-dir under a plain file", "--tensorboard-dir",
                  lambda c: os.path.join(_file(c), "tb"), "(--tensorboard-dir)"),
        out_probe("--save is a plain file", "--save", _file, "is not a directory"),
        out_probe("--metrics-file is a directory", "--metrics-file", lambda c: c.work,
                  "is a directory"),
        out_probe("--save on a read-only filesystem (/proc)", "--save",
                  lambda c: "/proc/fm_ckpt", "(--save)"),
        out_probe("--metrics-file on a read-only filesystem (/proc)", "--metrics-file",
                  lambda c: "/proc/fm/m.jsonl", "(--metrics-file)"),
        out_probe("--tensorboard-dir on a read-only filesystem (/sys)", "--tensorboard-dir",
                  lambda c: "/sys/fm_tb", "(--tensorboard-dir)"),
        Probe("--data-cache-path under a plain file", 3, "error",
              lambda c: gpt1(data_flags(copy_data(c.shared.data(), c.work), c.work)[:-1]
                             + [os.path.join(_file(c), "cache")], c.work), "cache"),
    ]


def _signal_run(sig: Optional[int], extra: list, after_rows: int = 2, nproc: int = 1,
                base: list = LIN) -> Callable[[Ctx], Run]:
    """Train with --save; after `after_rows` metrics rows send `sig` to every rank."""
    def act(ctx: Ctx) -> Run:
        ctx.ckpt = os.path.join(ctx.work, "ckpt")
        flags = [*base, "--save", ctx.ckpt, "--metrics-file", "m.jsonl", *extra]
        ranks = Ranks([PY, GPT, *flags], nproc, ctx.work)
        if sig is not None:
            if wait_rows(os.path.join(ctx.work, "m.jsonl"), after_rows, ranks.alive):
                for p in ranks.procs:
                    p.send_signal(sig)
        return ranks.wait(120)
    return act


def _stopped_and_saved(ctx: Ctx, r: Run) -> str:
    from megatron_2bw.checkpointing import files as cf

    m = re.search(r"exiting at iteration (\d+)", r.out)
    if not m:
        return "no 'exiting at iteration' line"
    k, got = int(m.group(1)), cf.read_tracker(ctx.ckpt)
    if got != k or k not in sound_iterations(ctx.ckpt):
        return f"stopped at {k}, checkpoint tracker {got}"
    its = [row["iteration"] for row in metrics_rows(os.path.join(ctx.work, "m.jsonl"))]
    return "" if its == list(range(1, k + 1)) else f"metrics {its}"


def _sigterm_then_resume(ctx: Ctx) -> Run:
    first = _signal_run(signal.SIGTERM, ["--exit-signal-handler", "--save-interval", "1000",
                                         "--train-iters", "2000"], 3)(ctx)
    if first.codes != [0]:
        return first
    second = gpt1([*LIN, "--train-iters", "2000", "--exit-signal-handler", "--load", ctx.ckpt,
                   "--save", ctx.ckpt, "--save-interval", "1000", "--exit-interval",
                   str(_tracker(ctx) + 2), "--metrics-file", "m.jsonl"], ctx.work)
    second.seconds += first.seconds
    return second


def _tracker(ctx: Ctx) -> int:
    from megatron_2bw.checkpointing import files as cf

    return cf.read_tracker(ctx.ckpt) or 0


def _rows_continuous(ctx: Ctx, r: Run) -> str:
    its = [row["iteration"] for row in metrics_rows(os.path.join(ctx.work, "m.jsonl"))]
    return "" if its == list(range(1, len(its) + 1)) and len(its) >= 4 else f"metrics {its}"


def _prev_sound(ctx: Ctx, r: Run) -> str:
    return "" if sound_iterations(ctx.ckpt) else "no sound checkpoint left"


def class4() -> list:
    long = ["--train-iters", "2000", "--save-interval", "1000"]  # --exit-duration-in-mins: int
    return [
        Probe("SIGTERM with --exit-signal-handler (1 process)", 4, "ok",
              _signal_run(signal.SIGTERM, ["--exit-signal-handler", *long]),
              "after receiving SIGTERM", check=_stopped_and_saved),
        Probe("SIGTERM with --exit-signal-handler, 2BW PP2 (2 processes)", 4, "ok",
              _signal_run(signal.SIGTERM, ["--exit-signal-handler", "--pipeline-schedule", "2bw",
                                           *long], 2, 2, TINY + PP2),
              "after receiving SIGTERM", check=_stopped_and_saved, slow=True),
        Probe("SIGTERM, then resume from where it stopped", 4, "ok", _sigterm_then_resume,
              check=_rows_continuous),
        Probe("--exit-duration-in-mins reached", 4, "ok",
              _signal_run(None, ["--exit-duration-in-mins", "1", *long, "--train-iters", "1000000"]),
              "exit-duration-in-mins", check=_stopped_and_saved),
        Probe("--exit-interval", 4, "ok",
              _signal_run(None, ["--exit-interval", "3", *long]), check=tracker_is(3)),
        Probe("SIGTERM without --exit-signal-handler keeps the last save", 4, "fault",
              _signal_run(signal.SIGTERM, ["--save-interval", "1", "--train-iters", "2000"], 3),
              check=_prev_sound),
        Probe("SIGKILL during frequent saves keeps a complete checkpoint", 4, "fault",
              _signal_run(signal.SIGKILL, ["--save-interval", "1", "--train-iters", "2000"], 3),
              check=_prev_sound),
    ]


def _stall(sig: int, victim: int, schedule: str = "flush", nproc: int = 2,
           timeout: float = 4.0) -> Callable[[Ctx], Run]:
    def act(ctx: Ctx) -> Run:
        flags = [*TINY, *PP2, "--pipeline-schedule", schedule, "--train-iters", "2000",
                 "--metrics-file", "m.jsonl"]
        ranks = Ranks([PY, GPT, *flags], nproc, ctx.work, {TIMEOUT_ENV: str(timeout)})
        if wait_rows(os.path.join(ctx.work, "m.jsonl"), 2, ranks.alive):
            ranks.procs[victim].send_signal(sig)
            t0 = time.monotonic()
            others = [p for i, p in enumerate(ranks.procs) if i != victim]
            while any(p.poll() is None for p in others) and time.monotonic() - t0 < 90:
                time.sleep(0.05)
            # the frozen rank itself cannot end: end it as the job's launcher would
            if all(p.poll() is not None for p in others):
                ranks.procs[victim].kill()
            else:
                return _hung(ranks)
        return ranks.wait(30)
    return act


def _hung(ranks: Ranks) -> Run:
    r = ranks.wait(0)
    r.timed_out = True
    return r


def _missing_peer(ctx: Ctx) -> Run:
    """WORLD_SIZE 2 but rank 1 never starts."""
    base = _clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
                      RANK="0", LOCAL_RANK="0", **{TIMEOUT_ENV: "4"})
    return run1([PY, GPT, *TINY, *PP2, "--train-iters", "3"], ctx.work, timeout=90, env=base)


def class5() -> list:
    return [
        Probe("rank 1 frozen (SIGSTOP), flush", 5, "fault", _stall(signal.SIGSTOP, 1),
              "stage 1 (rank 1)", slow=True),
        Probe("rank 0 frozen (SIGSTOP), flush", 5, "fault", _stall(signal.SIGSTOP, 0),
              "rank 0", slow=True),
        Probe("rank 1 frozen (SIGSTOP), 2bw", 5, "fault", _stall(signal.SIGSTOP, 1, "2bw"),
              "stage 1 (rank 1)", slow=True),
        Probe("rank 1 killed (SIGKILL)", 5, "fault", _stall(signal.SIGKILL, 1),
              "rank 1", slow=True),
        Probe("rank 0 killed (SIGKILL)", 5, "fault", _stall(signal.SIGKILL, 0),
              "rank 0", slow=True),
        Probe("a rank that never starts", 5, "fault", _missing_peer, "1 of 2 ranks joined",
              slow=True),
        Probe("user error on one of 3 blocked ranks", 5, "error",
              lambda c: Ranks([PY, os.path.join(ROOT, "tests", "_user_error_worker.py"), "1"],
                              3, c.work).wait(90), "injected on rank 1", slow=True),
    ]


def planner(flags: list) -> Callable[[Ctx], Run]:
    return lambda c: run1([PY, "-m", "megatron_2bw.planner", *flags], c.work,
                          env=_clean_env(PYTHONPATH=ROOT))


PLAN = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
        "--seq-length", "1024", "--global-batch-size", "64", "--num-gpus", "8"]


def _replace(flags: list, key: str, value: str) -> list:
    out = list(flags)
    out[out.index(key) + 1] = value
    return out


def class6() -> list:
    T = [*TINY, "--train-iters", "3"]
    P = [gpt_err(f"pretrain {' '.join(x)}", 6, T + x, m) for x, m in [
        (["--micro-batch-size", "0"], "(--micro-batch-size)"),
        (["--eval-interval", "0"], "(--eval-interval)"),
        (["--lr=-1e-3"], "(--lr)"),
        (["--lr", "nan"], "(--lr)"),
        (["--hidden-size", "30"], "--num-attention-heads"),
        (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size"),
        (["--num-layers", "0"], "(--num-layers)"),
        (["--seq-length", "32"], "--max-position-embeddings"),
        (["--bogus-flag"], "unknown flag --bogus-flag"),
        (["--fp16", "--bf16"], "--bf16"),
        (["--global-batch-size", "5"], "--global-batch-size"),
        (["--min-lr", "1"], "--min-lr"),
        (["--hidden-dropout", "1.5"], "--hidden-dropout"),
        (["--seed", "-1"], "--seed"),
        (["--pipeline-model-parallel-size", "2"], "world size"),
        (["--clip-grad", "-1"], "--clip-grad"),
    ]]
    P += [
        Probe("resume with another --hidden-size", 6, "error",
              resume(["--hidden-size", "64"]), "--hidden-size"),
        Probe("resume with another --num-layers", 6, "error",
              resume(["--num-layers", "2"]), "--num-layers"),
    ]
    P += [Probe(f"planner {name}", 6, "error", planner(flags), m) for name, flags, m in [
        ("--num-gpus 0", _replace(PLAN, "--num-gpus", "0"), "--num-gpus"),
        ("--global-batch-size 0", _replace(PLAN, "--global-batch-size", "0"),
         "--global-batch-size"),
        ("heads not dividing hidden", _replace(PLAN, "--num-attention-heads", "7"), "heads"),
        ("missing --num-layers", PLAN[2:], "--num-layers"),
        ("--profile missing file", PLAN + ["--profile", "/nonexistent/p.json"], "p.json"),
        ("--hardware unknown", PLAN + ["--hardware", "bogus-gpu"], "bogus"),
        ("--seq-length -1", _replace(PLAN, "--seq-length", "-1"), "--seq-length"),
    ]]
    return P


def _data_probe(corrupt: Callable[[str], None], vocab: int = VOCAB) -> Callable[[Ctx], Run]:
    def act(ctx: Ctx) -> Run:
        prefix = copy_data(ctx.shared.data(), ctx.work)
        corrupt(prefix)
        return gpt1(data_flags(prefix, ctx.work, vocab), ctx.work)
    return act


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _cut(path: str, by: int) -> None:
    os.truncate(path, os.path.getsize(path) - by)


def prep(lines: list, extra: list = ()) -> Callable[[Ctx], Run]:
    def act(ctx: Ctx) -> Run:
        src = os.path.join(ctx.work, "in.jsonl")
        with open(src, "w") as f:
            f.write("".join(line + "\n" for line in lines))
        flags = ["--input", src, "--output-prefix", os.path.join(ctx.work, "out"),
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", *extra]
        return run1([PY, PREP, *flags], ctx.work, env=_clean_env(PYTHONPATH=ROOT))
    return act


def class7() -> list:
    def bin_(p):
        return p + ".bin"

    def idx(p):
        return p + ".idx"
    P = [Probe(f"data: {name}", 7, "error", _data_probe(c), m) for name, c, m in [
        (".bin truncated by 1%", lambda p: _cut(bin_(p), os.path.getsize(bin_(p)) // 100),
         "data file truncated"),
        (".bin tail cut inside the validation split", lambda p: _cut(bin_(p), 20),
         "data file truncated"),
        (".bin longer than the index", lambda p: open(bin_(p), "ab").write(b"\1\0"),
         "do not match"),
        (".bin missing", lambda p: os.remove(bin_(p)), ".bin"),
        (".idx bad magic", lambda p: _patch(idx(p), 0, b"NOTANIDX\0"), "not a megatron"),
        (".idx cut short", lambda p: _cut(idx(p), 8), "index file truncated"),
        (".idx float dtype", lambda p: _patch(idx(p), 17, struct.pack("<B", 7)), "dtype"),
        (".idx bad pointer", lambda p: _patch(idx(p), 34 + 4 * 60 + 8 * 30,
                                              struct.pack("<q", 12345)), "corrupt index"),
    ]]
    P.append(Probe("data: token ids above the vocabulary", 7, "error",
                   _data_probe(lambda p: None, vocab=500), "vocabulary size"))
    P += [Probe(f"preprocess: {name}", 7, "error", prep(lines, extra), m, code=1)
          for name, lines, extra, m in [
        ("token id outside the vocabulary", ['{"text": "1 2"}', '{"text": "3 11"}'], [],
         "in.jsonl:2"),
        ("negative token id", ['{"text": "1 -1"}'], [], "in.jsonl:1"),
        ("malformed JSON line", ['{"text": "1 2"}', '{"text": "3'], [], "in.jsonl:2"),
        ("missing json key", ['{"body": "1 2"}'], [], "in.jsonl:1"),
        ("empty input", [], [], "in.jsonl"),
    ]]
    P.append(Probe("preprocess: missing input file", 7, "error",
                   lambda c: run1([PY, PREP, "--input", "/nonexistent/in.jsonl",
                                   "--output-prefix", os.path.join(c.work, "o"),
                                   "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"],
                                  c.work, env=_clean_env(PYTHONPATH=ROOT)),
                   "/nonexistent/in.jsonl", code=1))
    return P


def _launcher(env: dict, flags: Optional[list] = None) -> Callable[[Ctx], Run]:
    return lambda c: gpt1(flags or [*TINY, "--train-iters", "2"], c.work,
                          env=_clean_env(**env))


# what srun gives a task it starts itself (no torchrun); srun's tasks are adopted
# (ranks from SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID), so the probes break it
SRUN_TASK = {"SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost"}


def class8() -> list:
    return [
        Probe("srun task with a broken SLURM_PROCID", 8, "error",
              _launcher(dict(SRUN_TASK, SLURM_PROCID="x")), "SLURM_PROCID='x'"),
        Probe("srun, 4 tasks, task 1 without SLURM_LOCALID (quiet refusal)", 8, "error",
              _launcher({k: v for k, v in dict(SRUN_TASK, SLURM_NTASKS="4",
                                                  SLURM_STEP_NUM_TASKS="4",
                                                  SLURM_PROCID="1").items()
                         if k != "SLURM_LOCALID"}), quiet=True),
        Probe("mpirun, 2 tasks", 8, "error", _launcher({"OMPI_COMM_WORLD_SIZE": "2"}),
              "OMPI_COMM_WORLD_SIZE"),
        Probe("PMI launcher, 2 tasks", 8, "error", _launcher({"PMI_SIZE": "2"}), "PMI_SIZE"),
        Probe("sbatch script's single process (SLURM_NTASKS=4) trains", 8, "ok",
              _launcher({"SLURM_NTASKS": "4"}), "iteration"),
        Probe("torchrun variables under srun train", 8, "ok",
              _launcher({"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0", "RANK": "0",
                         "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": str(free_port())}), "iteration"),
        Probe("RANK set, WORLD_SIZE missing", 8, "error",
              _launcher({"RANK": "0", "MASTER_ADDR": "127.0.0.1", TIMEOUT_ENV: "4"})),
        Probe("RANK beyond WORLD_SIZE", 8, "error",
              _launcher({"RANK": "1", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                         TIMEOUT_ENV: "4"})),
    ]


def _dp2_sized(ctx: Ctx) -> Run:
    """DP 2 without --global-batch-size on a small real dataset: it must hold the samples
    both replicas consume (a dataset sized for half runs out or repeats silently)."""
    prefix = copy_data(ctx.shared.data(), ctx.work)
    flags = data_flags(prefix, ctx.work)
    flags = _replace(flags, "--train-iters", "6") + ["--metrics-file", "m.jsonl"]
    return Ranks([PY, GPT, *flags], 2, ctx.work).wait(150)


def _bf16_masters(ctx: Ctx) -> Run:
    ck = _ck(ctx)
    _mark(ctx)
    out = os.path.join(ctx.work, "out")
    return gpt1([*LIN, "--bf16", "--lr", "0", "--min-lr", "0", "--override-opt_param-scheduler",
                 "--train-iters", "3", "--load", ck, "--save", out], ctx.work)


def _masters_are_weights(ctx: Ctx, r: Run) -> str:
    from megatron_2bw.checkpointing import files as cf

    import torch
    rel = "mp_rank_00/model_optim_rng.pt"
    before = cf.load_state(ctx.ckpt, 2, rel)
    after = cf.load_state(os.path.join(ctx.work, "out"), 3, rel)
    weights = [t for t in before["model"].values() if t is not None]
    masters = after["optimizer"].get("masters") or []
    if len(masters) != len(weights):
        return f"{len(masters)} masters for {len(weights)} weights"
    bad = sum(not torch.equal(m, w) for m, w in zip(masters, weights))
    return f"{bad} masters differ from the restored weights" if bad else ""


def _bitexact(base: list, nproc: int) -> Callable[[Ctx], Run]:
    """Uninterrupted 4 iterations vs 2 + resume 2: identical losses."""
    def go(ctx: Ctx, flags: list, metrics: str) -> Run:
        argv = [PY, GPT, *base, "--train-iters", "4", "--metrics-file", metrics, *flags]
        if nproc == 1:
            return run1(argv, ctx.work, timeout=120)
        return Ranks(argv, nproc, ctx.work).wait(150)

    def act(ctx: Ctx) -> Run:
        ctx.ckpt = os.path.join(ctx.work, "ckpt")
        total = 0.0
        for flags, m in ((["--save", ctx.ckpt, "--save-interval", "2", "--exit-interval", "2"],
                          "a.jsonl"),
                         (["--load", ctx.ckpt, "--save", ctx.ckpt, "--save-interval", "2"],
                          "a.jsonl"), ([], "ref.jsonl")):
            r = go(ctx, flags, m)
            total += r.seconds
            if any(c != 0 for c in r.codes) or r.timed_out:
                return r
        r.seconds = total
        return r
    return act


def _same_losses(ctx: Ctx, r: Run) -> str:
    a = [x["loss"] for x in metrics_rows(os.path.join(ctx.work, "a.jsonl"))]
    b = [x["loss"] for x in metrics_rows(os.path.join(ctx.work, "ref.jsonl"))]
    return "" if a == b and len(a) == 4 else f"resumed {a} vs uninterrupted {b}"


def _dp2_rows(ctx: Ctx, r: Run) -> str:
    its = [x["iteration"] for x in metrics_rows(os.path.join(ctx.work, "m.jsonl"))]
    return "" if its == list(range(1, 7)) else f"metrics {its}"


def class9() -> list:
    return [
        Probe("DP2 without --global-batch-size: datasets sized for both replicas", 9, "ok",
              _dp2_sized, check=_dp2_rows, slow=True),
        Probe("fp32 checkpoint resumed with --bf16: masters are the restored weights", 9, "ok",
              _bf16_masters, check=_masters_are_weights),
        Probe("resume is bit-exact (1 process, flush)", 9, "ok", _bitexact(LIN, 1),
              check=_same_losses),
        Probe("resume is bit-exact (2BW PP2)", 9, "ok",
              _bitexact(TINY + PP2 + ["--pipeline-schedule", "2bw"], 2), check=_same_losses,
              slow=True),
        Probe("resume is bit-exact (flush PP2)", 9, "ok",
              _bitexact(TINY + PP2 + ["--pipeline-schedule", "flush"], 2), check=_same_losses,
              slow=True),
        Probe("resume is bit-exact with Muon", 9, "ok",
              _bitexact(LIN + ["--optimizer", "muon"], 1), check=_same_losses),
        Probe("resume at --train-iters equal to the checkpoint ends at once", 9, "ok",
              resume(["--train-iters", "2", "--lr-decay-iters", "4"]), check=tracker_is(2)),
    ]


# --------------------------------------------------------- 10: a run that stopped learning

# a learning rate that makes the weights NaN after one step (fp32) or a few (fp16)
HUGE = [a if a != "1e-2" else "1e6" for a in TINY]


def _stops(flags: list, nproc: int = 1) -> Callable[[Ctx], Run]:
    """A run with --save into a fresh directory (the "data intact" column reads it)."""
    def act(ctx: Ctx) -> Run:
        ctx.ckpt = os.path.join(ctx.work, "ckpt")
        argv = [PY, GPT, *flags, "--save", ctx.ckpt, "--metrics-file", "m.jsonl"]
        if nproc == 1:
            return run1(argv, ctx.work, timeout=120)
        return Ranks(argv, nproc, ctx.work).wait(120)
    return act


def _tracked_below(it: int) -> Callable[[Ctx, Run], str]:
    """The tracker names an iteration before `it` (the refused save left it alone)."""
    def check(ctx: Ctx, r: Run) -> str:
        from megatron_2bw.checkpointing import files as cf

        got = cf.read_tracker(ctx.ckpt)
        return "" if got is not None and got < it else f"tracker says {got}"
    return check


def _holds(it: int, same_as: Optional[int] = None,
           ranks: tuple = ("mp_rank_00",)) -> Callable[[Ctx, Run], str]:
    """The tracker says `it`; with `same_as`, that iteration's checkpoint is still there
    and iteration `it` holds its weights (the skipped steps changed nothing)."""
    def check(ctx: Ctx, r: Run) -> str:
        from megatron_2bw.checkpointing import files as cf

        import torch
        why = tracker_is(it)(ctx, r)
        if why or same_as is None:
            return why
        if same_as not in cf.list_iterations(ctx.ckpt):
            return f"iteration {same_as}'s checkpoint is gone"
        for rank in ranks:
            rel = f"{rank}/model_optim_rng.pt"
            a = cf.load_state(ctx.ckpt, same_as, rel)["model"]
            b = cf.load_state(ctx.ckpt, it, rel)["model"]
            if a.keys() != b.keys() or not all(
                    torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor)):
                return f"{rank}: iteration {it} holds other weights than iteration {same_as}"
        return ""
    return check


def _one_line_each(check: Callable[[Ctx, Run], str]) -> Callable[[Ctx, Run], str]:
    """`check`, and the ranks' output holds exactly one `error:` line, from a rank that
    exited with status 2 like the others."""
    def both(ctx: Ctx, r: Run) -> str:
        lines = [ln for ln in r.out.splitlines() if ln.startswith("error:")]
        if len(lines) != 1 or r.codes != [2] * len(r.codes):
            return f"{len(lines)} error lines, exit {r.codes}"
        return check(ctx, r)
    return both


def _start_skips_then_ends(ctx: Ctx, r: Run) -> str:
    rows = metrics_rows(os.path.join(ctx.work, "m.jsonl"))
    skipped = sum(row["skipped"] for row in rows)
    if len(rows) != 25 or skipped < 10:
        return f"{len(rows)} iterations ({skipped} skipped), expected 25 with >= 10 skipped"
    return ""


def class10() -> list:
    return [
        Probe("huge --lr (fp32): the first NaN ends the run, state saved", 10, "error",
              _stops([*HUGE, "--train-iters", "8"]), "stopped at iteration 2",
              check=_holds(2)),
        Probe("huge --lr stopping at a --save-interval iteration keeps the earlier one",
              10, "error", _stops([*HUGE, "--train-iters", "8", "--save-interval", "1"]),
              "weights after iteration 1 are saved as iteration 2", check=_holds(2, 1)),
        Probe("huge --lr (fp16): the skip bound ends the run", 10, "error",
              _stops([*HUGE, "--fp16", "--train-iters", "100"]),
              "--max-consecutive-skipped-iterations 10"),
        Probe("huge --lr with --no-check-for-nan-in-loss-and-grad: 11 skips end the run", 10,
              "error", _stops([*HUGE, "--no-check-for-nan-in-loss-and-grad",
                               "--train-iters", "50"]), "11 iterations in a row"),
        Probe("fp16 start skips while the scale falls: a bound of 1 does not trip", 10, "ok",
              _stops([*TINY, "--fp16", "--train-iters", "25",
                      "--max-consecutive-skipped-iterations", "1"]),
              check=_start_skips_then_ends),
        Probe("fp16 weights made NaN by a step taken: not saved, earlier checkpoints kept", 10,
              "error", _stops([*HUGE, "--fp16", "--train-iters", "20", "--save-interval",
                               "5"]), "weights are NaN or inf after iteration 20",
              check=_tracked_below(20)),
        Probe("huge --lr (2BW PP2): both ranks stop mid-segment, one line", 10, "error",
              _stops([*HUGE, *PP2, "--pipeline-schedule", "2bw", "--train-iters", "8",
                      "--save-interval", "2"], nproc=2), "stopped at iteration 3",
              check=_one_line_each(_holds(3, 2, ("mp_rank_00_000", "mp_rank_00_001"))),
              slow=True),
    ]


# ------------------------------------------------- 11: a checkpoint that does not fit


def class11() -> list:
    def dist(extra: list) -> Callable[[Ctx], Run]:
        return resume(extra, base=DIST, src="ckptdist")
    return [
        Probe("torch_dist resume with a larger --vocab-size", 11, "error",
              dist(["--vocab-size", "200"]), "--vocab-size 127 in the checkpoint, 200 in this run"),
        Probe("torch_dist resume with a smaller --vocab-size", 11, "error",
              dist(["--vocab-size", "60"]), "--vocab-size 127 in the checkpoint, 60 in this run"),
        Probe("torch resume with another --vocab-size names the flag", 11, "error",
              resume(["--vocab-size", "200"]), "--vocab-size 127 in the checkpoint, 200 in this run"),
        Probe("torch_dist resume with another tokenizer of the same padded size: a note", 11,
              "ok", dist(["--vocab-size", "100"]), "the tokenizer differs from the checkpoint's",
              check=tracker_is(4)),
        Probe("resume with another --seed: a note on the data order", 11, "ok",
              resume(["--seed", "7"]), "--seed 1234 in the checkpoint, 7 in this run",
              check=tracker_is(4)),
        Probe("resume with another --seq-length: a note on the data order", 11, "ok",
              resume(["--seq-length", "8"]), "--seq-length 16 in the checkpoint, 8 in this run",
              check=tracker_is(4)),
    ]


# ------------------------------------- 12: data the tokenizer cannot have made, or changing

BIG_TOKENS = (1 << 29) + (1 << 20)  # a 1.0 GiB + 2 MiB uint16 .bin: above a 1 GiB bound
BIG_DOCS = 64
BIG_SEQ = ["--seq-length", "1024", "--max-position-embeddings", "1024"]


def _sampled_windows(itemsize: int) -> list:
    """[begin, end) token ranges of main's sampled scan of a .bin above 1 GiB (32 evenly
    spaced windows of 2 MiB, the first and the last included)."""
    import numpy as np

    window = (2 << 20) // itemsize
    starts = np.linspace(0, BIG_TOKENS - window, 32).astype(np.int64)
    return [(int(b), int(b) + window) for b in np.unique(starts)]


def _write_big(prefix: str, fill: int, bad: dict, dtype: str = "uint16") -> None:
    """A .bin of BIG_TOKENS ids in BIG_DOCS documents: `fill` outside the sampled windows
    (0 there; the file is sparse when `fill` is 0), the ids of `bad` ({token index: id})
    written over; and its .idx (megatron-core's layout)."""
    import numpy as np

    item = np.dtype(dtype).itemsize
    with open(prefix + ".bin", "wb") as f:
        f.truncate(BIG_TOKENS * item)
    if fill:
        tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r+")
        for begin in range(0, BIG_TOKENS, 1 << 24):
            tokens[begin:begin + (1 << 24)] = fill
        for begin, end in _sampled_windows(item):
            tokens[begin:end] = 0
        tokens.flush()
        del tokens
    with open(prefix + ".bin", "r+b") as f:
        for index, token in bad.items():
            f.seek(index * item)
            f.write(np.array([token], dtype=dtype).tobytes())
    lengths = np.full(BIG_DOCS, BIG_TOKENS // BIG_DOCS, dtype=np.int32)
    lengths[-1] += BIG_TOKENS - int(lengths.sum())
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * item
    code = {"uint16": 8, "int32": 4}[dtype]
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", BIG_DOCS) + struct.pack("<Q", BIG_DOCS + 1))
        f.write(lengths.tobytes() + pointers.astype(np.int64).tobytes())
        f.write(np.arange(BIG_DOCS + 1, dtype=np.int64).tobytes())


def _windows_gap(itemsize: int = 2) -> int:
    """A token index main's sampled scan does not see: just past its first window."""
    return _sampled_windows(itemsize)[0][1] + 10


def _big_probe(fill: int, bad: dict, dtype: str = "uint16") -> Callable[[Ctx], Run]:
    def act(ctx: Ctx) -> Run:
        prefix = os.path.join(ctx.work, "big")
        _write_big(prefix, fill, bad, dtype)
        flags = _replace(data_flags(prefix, ctx.work), "--train-iters", "2")
        return gpt1(flags + BIG_SEQ, ctx.work, timeout=180)
    return act


def _under_run(change: Callable[[str], None], iters: str = "1000") -> Callable[[Ctx], Run]:
    """Train on a copy of the probe data; after 3 iterations `change` its prefix."""
    def act(ctx: Ctx) -> Run:
        prefix = copy_data(ctx.shared.data(), ctx.work)
        flags = _replace(data_flags(prefix, ctx.work), "--train-iters", iters)
        ranks = Ranks([PY, GPT, *flags, "--metrics-file", "m.jsonl"], 1, ctx.work)
        if wait_rows(os.path.join(ctx.work, "m.jsonl"), 3, ranks.alive):
            change(prefix)
        return ranks.wait(120)
    return act


def _reverse_tokens(prefix: str) -> None:
    """Rewrite the .bin in place: the same ids, in reverse order (same size)."""
    import numpy as np

    tokens = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r+")
    tokens[:] = tokens[::-1].copy()
    tokens.flush()


def class12() -> list:
    eod_vocab = VOCAB + 1  # NullTokenizer --vocab-size 1000: ids 0..1000, padded to 1024
    return [
        Probe("id between the vocabulary and its padding, unsampled part of a 1 GiB .bin", 12,
              "error", _big_probe(0, {_windows_gap(): eod_vocab}),
              f"token id {eod_vocab} in document 0"),
        Probe("ids beyond the padded vocabulary wherever main's sampled scan does not look",
              12, "error", _big_probe(5000, {}), "token id 5000"),
        Probe("negative id in an int32 .bin, unsampled part", 12, "error",
              _big_probe(0, {_windows_gap(4): -3}, "int32"),
              "token id -3 in document 0"),
        Probe(".bin cut short while training (SIGBUS)", 12, "error",
              _under_run(lambda p: os.truncate(p + ".bin", 100)), "cut short while training"),
        Probe(".idx cut short while training", 12, "error",
              _under_run(lambda p: os.truncate(p + ".idx", 40)), "cut short while training"),
        Probe(".bin rewritten in place while training", 12, "error",
              _under_run(_reverse_tokens), "rewritten in place while training"),
    ]


# ------------------------------------------------------ 13: data set specifications


def _data_spec(words: Callable[[str], list], split: str = "90,10,0") -> Callable[[Ctx], Run]:
    def act(ctx: Ctx) -> Run:
        prefix = copy_data(ctx.shared.data(), ctx.work)
        flags = _replace(_replace(data_flags(prefix, ctx.work), "--train-iters", "2"),
                         "--split", split)
        i = flags.index("--data-path")
        return gpt1(flags[:i + 1] + words(prefix) + flags[i + 2:], ctx.work)
    return act


def _bert_unsplit(ctx: Ctx) -> Run:
    prefix = ctx.shared.bert_data()
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "32", "--max-position-embeddings", "32",
             "--micro-batch-size", "2", "--eval-iters", "1", "--lr", "1e-3",
             "--train-iters", "2", "--data-path", prefix, "--split", "90,10,0",
             "--tokenizer-type", "BertWordPieceLowerCase",
             "--vocab-file", os.path.join(os.path.dirname(prefix), "vocab.txt"),
             "--data-cache-path", os.path.join(ctx.work, "cache")]
    return run1([PY, os.path.join(ROOT, "pretrain_bert.py"), *flags], ctx.work)


def _twice(between: Callable[[Ctx, str], None]) -> Callable[[Ctx], Run]:
    """Train 2 iterations (the index cache is built), `between`, train again."""
    def act(ctx: Ctx) -> Run:
        prefix = copy_data(ctx.shared.data(), ctx.work)
        flags = _replace(data_flags(prefix, ctx.work), "--train-iters", "2")
        first = gpt1(flags, ctx.work)
        if first.codes != [0]:
            return first
        between(ctx, prefix)
        second = gpt1(flags, ctx.work)
        second.seconds += first.seconds
        return second
    return act


def _regenerate(ctx: Ctx, prefix: str) -> None:
    """tools/preprocess_data.py run again into the prefix, on 30 of the documents."""
    smaller = ctx.shared.data(30)
    for suffix in (".bin", ".idx"):
        shutil.copy(smaller + suffix, prefix + suffix)


def _cut_cache(ctx: Ctx, prefix: str) -> None:
    """A rank killed while megatron-core wrote the sample index."""
    folder = os.path.join(ctx.work, "cache")
    name = next(n for n in sorted(os.listdir(folder)) if n.endswith("train-sample_index.npy"))
    _truncate_file(os.path.join(folder, name), 0.3)


def class13() -> list:
    return [
        Probe("blend weight negative", 13, "error",
              _data_spec(lambda p: ["-1", p, "2", p]), "is negative (--data-path)"),
        Probe("blend weight NaN", 13, "error",
              _data_spec(lambda p: ["nan", p, "1", p]), "is not finite (--data-path)"),
        Probe("blend weights sum to 0", 13, "error",
              _data_spec(lambda p: ["0", p, "0", p]), "sum to 0 (--data-path)"),
        Probe("blend weight that is not a number", 13, "error",
              _data_spec(lambda p: ["1x", p, "2", p]), "is not a number (--data-path)"),
        Probe("--split 0,50,50 gives training nothing", 13, "error",
              _data_spec(lambda p: [p], "0,50,50"), "gives training no documents"),
        Probe("BERT on data made without --split-sentences", 13, "error", _bert_unsplit,
              "--split-sentences"),
        Probe("index cache built from another version of the files is rebuilt", 13, "ok",
              _twice(_regenerate), "has changed since they were built"),
        Probe("index cache file cut short by a killed build is rebuilt", 13, "ok",
              _twice(_cut_cache), "is cut short"),
    ]


# ------------------------------------------- 14-16: outputs, stopping by hand, orphans

_MOUNT: dict = {}


def can_mount() -> bool:
    """Whether this process may mount a tmpfs (root, or CAP_SYS_ADMIN): tried once."""
    if "ok" not in _MOUNT:
        path = tempfile.mkdtemp(prefix="fm-mount-")
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", path],
                            capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", path], capture_output=True)
        os.rmdir(path)
        _MOUNT["ok"] = ok
    return _MOUNT["ok"]


def small_fs(ctx: Ctx, kib: int, read_only: bool = False) -> Optional[str]:
    """A tmpfs of `kib` KiB at <work>/fs (unmounted after the probe), or None where no
    mount is allowed (the probe then uses a file size limit or /proc)."""
    if not can_mount():
        return None
    path = os.path.join(ctx.work, "fs")
    os.makedirs(path, exist_ok=True)
    opts = f"size={kib}k" + (",ro" if read_only else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], check=True,
                   capture_output=True)
    ctx.cleanups.append(lambda: subprocess.run(["umount", "-l", path], capture_output=True))
    return path


def _alive(pid: int) -> bool:
    """A process that runs (a zombie has ended: it only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def children(pid: int) -> list:
    """The child processes of `pid`, from every one of its threads."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _first_children(pid: int, limit: float = 30) -> list:
    """The first processes `pid`'s main thread forks, as soon as they are there."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                found = [int(c) for c in f.read().split()]
        except OSError:
            return []
        if found:
            return found
        time.sleep(0.002)
    return []


def _reap_later(ctx: Ctx, pids: list) -> None:
    """SIGKILL whatever of `pids` is left after the probe (the row says it was)."""
    def undo() -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    ctx.cleanups.append(undo)


class Launched:
    """torchrun itself, in a session of its own (where a terminal's Ctrl-C or a job's
    SIGTERM reaches it: torchrun starts each worker in a session of its own), every
    worker's output in its own file (--redirects 3 --log-dir). The judged output is the
    workers'; torchrun's own (it prints a traceback for the signal that stops it) is kept
    in ctx.notes["launcher"]."""

    def __init__(self, ctx: Ctx, flags: list, nproc: int = 2, env: Optional[dict] = None):
        self.ctx, self.logdir = ctx, os.path.join(ctx.work, "tr-logs")
        self.log = open(os.path.join(ctx.work, "launcher.log"), "w+")
        cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), "--redirects", "3", "--log-dir",
               self.logdir, GPT, *flags]
        self.start = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=ctx.work, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env=_clean_env(**(env or {})),
                                     preexec_fn=_as_from_a_terminal)
        self.pids: list = []
        _reap_later(ctx, [self.proc.pid])

    def workers(self, count: int, limit: float = 120) -> list:
        deadline = time.monotonic() + limit
        while len(self.pids) < count and time.monotonic() < deadline:
            self.pids = children(self.proc.pid)
            time.sleep(0.05)
        _reap_later(self.ctx, self.pids)
        return self.pids

    def alive(self) -> bool:
        return self.proc.poll() is None or any(_alive(p) for p in self.pids)

    def wait(self, timeout: float) -> Run:
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        timed_out = self.alive()
        for pid in [p for p in self.pids if _alive(p)] + (
                [self.proc.pid] if self.proc.poll() is None else []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        code = self.proc.wait()
        self.log.seek(0)
        self.ctx.notes["launcher"] = self.log.read()
        self.log.close()
        parts = []
        for rank in range(len(self.pids)):
            text = ""
            for root, _, names in sorted(os.walk(self.logdir)):
                if os.path.basename(root) == str(rank):
                    for name in sorted(names):
                        with open(os.path.join(root, name), errors="replace") as f:
                            text += f.read()
            parts.append(text)
        return Run([code], "".join(parts), time.monotonic() - self.start, timed_out, parts)


def _as_from_a_terminal() -> None:
    """The stop signals at their default actions, as for a job a terminal starts (a
    background shell's children inherit SIGINT ignored, and so would never see Ctrl-C)."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _session(argv: list, work: str, env: Optional[dict] = None) -> subprocess.Popen:
    """One process in a session of its own (so a signal to its group reaches it and the
    processes it forks, as a terminal's Ctrl-C or torchrun's stop does)."""
    log = open(os.path.join(work, "proc.log"), "w+")
    return subprocess.Popen(argv, cwd=work, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env=_clean_env(**(env or {})),
                            preexec_fn=_as_from_a_terminal)


def _finish(proc: subprocess.Popen, start: float, timeout: float) -> Run:
    """Wait for a `_session` process; its whole group is SIGKILLed at the timeout."""
    try:
        code, timed_out = proc.wait(timeout), False
    except subprocess.TimeoutExpired:
        code, timed_out = None, True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return Run([code], "", time.monotonic() - start, timed_out)


def _read(work: str, name: str = "proc.log") -> str:
    with open(os.path.join(work, name), errors="replace") as f:
        return f.read()


# ---- 14: output that cannot be written

def _prep_input(path: str, docs: int, seed: int = 5) -> None:
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": " ".join(str(rng.randrange(VOCAB))
                                                 for _ in range(200))}) + "\n")


def _prep_argv(src: str, prefix: str) -> list:
    return [PY, PREP, "--input", src, "--output-prefix", prefix, "--tokenizer-type",
            "NullTokenizer", "--vocab-size", str(VOCAB)]


def _prep_onto(kib: int, read_only: bool = False, earlier: bool = False
               ) -> Callable[[Ctx], Run]:
    """Preprocess ~1.2 MB of tokens onto a small (or read-only) filesystem; `earlier`: a
    smaller earlier output at the same prefix first (it must stay as it was)."""
    def act(ctx: Ctx) -> Run:
        src = os.path.join(ctx.work, "in.jsonl")
        _prep_input(src, 3000)
        fs = small_fs(ctx, kib, read_only and not earlier)
        preexec = None
        if fs is None and read_only:  # no mount allowed: /proc takes no new files
            fs = "/proc/fm_out"
        elif fs is None:  # no mount allowed: a file size limit (EFBIG)
            fs, preexec = os.path.join(ctx.work, "fs"), _fsize_limit(kib * 1024)
            os.makedirs(fs, exist_ok=True)
        prefix = os.path.join(fs, "out")
        env = _clean_env(PYTHONPATH=ROOT)
        if earlier:
            small = os.path.join(ctx.work, "small.jsonl")
            _prep_input(small, 20, seed=6)
            first = run1(_prep_argv(small, prefix), ctx.work, env=env)
            if first.codes != [0]:
                return first
            ctx.notes["earlier"] = {n: _digest(os.path.join(fs, n)) for n in os.listdir(fs)}
        ctx.notes["fs"] = fs
        return run1(_prep_argv(src, prefix), ctx.work, env=env, preexec=preexec)
    return act


def _digest(path: str) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _left_as_before(ctx: Ctx, r: Run) -> str:
    """The output folder holds what it held before the failed run (nothing, or the earlier
    output byte for byte): no partial output."""
    fs = ctx.notes.get("fs", "")
    if not os.path.isdir(fs):
        return ""
    now = {n: _digest(os.path.join(fs, n)) for n in os.listdir(fs)
           if os.path.isfile(os.path.join(fs, n))}
    before = ctx.notes.get("earlier", {})
    return "" if now == before else f"left {sorted(now)} (before: {sorted(before)})"


def _save_onto_full(fmt: str, nproc: int = 1, kib: int = 1500) -> Callable[[Ctx], Run]:
    """Train with --save every iteration onto a filesystem with room for one checkpoint
    (about 1 MB): the second save fails."""
    def act(ctx: Ctx) -> Run:
        fs = small_fs(ctx, kib)
        preexec = None
        if fs is None:
            fs, preexec = os.path.join(ctx.work, "fs"), _fsize_limit(400_000)
            os.makedirs(fs)
        ctx.ckpt = os.path.join(fs, "ckpt")
        flags = [*TINY, *(PP2 if nproc == 2 else []), "--ckpt-format", fmt, "--train-iters",
                 "6", "--save", ctx.ckpt, "--save-interval", "1"]
        if nproc == 1:
            return gpt1(flags, ctx.work, preexec=preexec)
        return Ranks([PY, GPT, *flags], nproc, ctx.work).wait(120)
    return act


def _saved_until_full(ctx: Ctx, r: Run) -> str:
    """The tracker names a sound checkpoint and no iteration directory without a manifest
    is left (the failed save's partial output is removed)."""
    from megatron_2bw.checkpointing import files as cf

    tracked = cf.read_tracker(ctx.ckpt)
    if can_mount() and (tracked is None or tracked not in sound_iterations(ctx.ckpt)):
        return f"tracker {tracked}, sound {sorted(sound_iterations(ctx.ckpt))}"
    partial = [i for i in cf.list_iterations(ctx.ckpt) if cf.read_manifest(ctx.ckpt, i) is None]
    return f"partial iterations left: {partial}" if partial else ""


def _log_onto_full(flag: str, kib: int = 100) -> Callable[[Ctx], Run]:
    def act(ctx: Ctx) -> Run:
        fs = small_fs(ctx, kib)
        preexec = None
        if fs is None:
            fs, preexec = os.path.join(ctx.work, "fs"), _fsize_limit(kib * 1024)
            os.makedirs(fs)
        target = os.path.join(fs, "m.jsonl" if flag == "--metrics-file" else "tb")
        return gpt1([*TINY, "--train-iters", "100000", flag, target], ctx.work,
                    preexec=preexec, timeout=180)
    return act


def _cache_onto_full(ctx: Ctx) -> Run:
    """--data-cache-path on a filesystem with room for two of the index cache's files."""
    prefix = copy_data(ctx.shared.data(), ctx.work)
    fs = small_fs(ctx, 8)
    preexec = None
    if fs is None:
        fs, preexec = os.path.join(ctx.work, "fs"), _fsize_limit(512)
        os.makedirs(fs)
    flags = _replace(data_flags(prefix, ctx.work), "--data-cache-path",
                     os.path.join(fs, "cache"))
    return gpt1(_replace(flags, "--train-iters", "4"), ctx.work, preexec=preexec)


def _export_onto_full(ctx: Ctx) -> Run:
    src = ctx.shared.ckpt()
    fs = small_fs(ctx, 100)
    preexec = None
    if fs is None:
        fs, preexec = os.path.join(ctx.work, "fs"), _fsize_limit(100 * 1024)
        os.makedirs(fs)
    ctx.notes["fs"] = os.path.join(fs, "hf")
    return run1([PY, os.path.join(ROOT, "tools", "checkpoint", "export_hf.py"), "--load",
                 os.path.join(src, "ckpt"), "--output", ctx.notes["fs"]], ctx.work,
                preexec=preexec, timeout=180)


def class14() -> list:
    return [
        Probe("preprocess: --output-prefix on a read-only filesystem", 14, "error",
              _prep_onto(256, read_only=True), "--output-prefix", code=1,
              check=_left_as_before),
        Probe("preprocess: the filesystem fills up, no partial output left", 14, "error",
              _prep_onto(200), "--output-prefix", code=1, check=_left_as_before),
        Probe("preprocess: the filesystem fills up, an earlier output stays as it was", 14,
              "error", _prep_onto(200, earlier=True), "--output-prefix", code=1,
              check=_left_as_before),
        Probe("torch_dist save onto a full filesystem", 14, "error",
              _save_onto_full("torch_dist"), "cannot save the checkpoint",
              check=_saved_until_full),
        Probe("torch_dist save onto a full filesystem, PP2: one line for the job", 14,
              "error", _save_onto_full("torch_dist", 2), "cannot save the checkpoint",
              check=_one_line_each(_saved_until_full), slow=True),
        Probe("torch save onto a full filesystem leaves no partial iteration", 14, "error",
              _save_onto_full("torch"), "cannot save the checkpoint",
              check=_saved_until_full),
        Probe("--metrics-file fills its filesystem mid-run", 14, "error",
              _log_onto_full("--metrics-file"), "(--metrics-file)"),
        Probe("--tensorboard-dir fills its filesystem mid-run", 14, "error",
              _log_onto_full("--tensorboard-dir"), "(--tensorboard-dir)"),
        Probe("Hugging Face export onto a full filesystem", 14, "error", _export_onto_full,
              "(--output)", check=_left_as_before),
        Probe("--data-cache-path on a full filesystem names the folder", 14, "error",
              _cache_onto_full, "(--data-cache-path"),
    ]


# ---- 15: stopping a job by hand

LONG = ["--train-iters", "2000", "--save-interval", "2"]


def _stop_lines(sig: str, ranks: int = 1, checkpoint: bool = True
                ) -> Callable[[Ctx, Run], str]:
    """Each rank's output ends its run with exactly one `stopped:` line that names `sig`
    (and, with --save, the checkpoint to resume from); no traceback; the checkpoint sound."""
    def check(ctx: Ctx, r: Run) -> str:
        outs = r.parts or [r.out]
        if len(outs) != ranks:
            return f"{len(outs)} outputs for {ranks} ranks"
        for rank, out in enumerate(outs):
            if TB in out:
                return f"rank {rank}: a traceback"
            lines = [ln for ln in out.splitlines() if ln.startswith("stopped:")]
            if len(lines) != 1 or sig not in lines[0]:
                return f"rank {rank}: stop lines {lines[:3]}"
            if checkpoint and "--load" not in lines[0]:
                return f"rank {rank}: the line does not say how to resume: {lines[0]}"
        if checkpoint and ctx.ckpt and not sound_iterations(ctx.ckpt):
            return "no sound checkpoint"
        return ""
    return check


def _torchrun_signal(sig: int, extra: list = ()) -> Callable[[Ctx], Run]:
    """torchrun, 2 ranks PP2; after 3 iterations `sig` to the launcher."""
    def act(ctx: Ctx) -> Run:
        ctx.ckpt = os.path.join(ctx.work, "ckpt")
        job = Launched(ctx, [*TINY, *PP2, *LONG, "--save", ctx.ckpt, "--metrics-file",
                             "m.jsonl", *extra], 2, {TIMEOUT_ENV: "10"})
        job.workers(2)
        if wait_rows(os.path.join(ctx.work, "m.jsonl"), 3, job.alive):
            job.proc.send_signal(sig)
        return job.wait(90)
    return act


def _group_signal(sigs: list, when: str = "rows", flags: Optional[list] = None,
                  gap: float = 0.3) -> Callable[[Ctx], Run]:
    """One process in a session of its own; `sigs` to its process group (a terminal's
    Ctrl-C reaches every process of the foreground group) after 3 iterations, or
    (when="save") while a torch_dist save has its writer processes out."""
    def act(ctx: Ctx) -> Run:
        ctx.ckpt = os.path.join(ctx.work, "ckpt")
        base = flags or [*TINY, *LONG]
        proc = _session([PY, GPT, *base, "--save", ctx.ckpt, "--metrics-file", "m.jsonl"],
                        ctx.work)
        _reap_later(ctx, [proc.pid])
        start = time.monotonic()
        alive = lambda: proc.poll() is None  # noqa: E731
        if wait_rows(os.path.join(ctx.work, "m.jsonl"), 3, alive):
            if when == "save":
                _first_children(proc.pid)
            for sig in sigs:
                os.killpg(proc.pid, sig)
                time.sleep(gap)
        r = _finish(proc, start, 60)
        r.out = _read(ctx.work)
        return r
    return act


def _one_rank_signal(sig: int) -> Callable[[Ctx], Run]:
    """2 ranks PP2 started directly; `sig` to rank 1 alone (a user's `kill PID`)."""
    def act(ctx: Ctx) -> Run:
        ctx.ckpt = os.path.join(ctx.work, "ckpt")
        ranks = Ranks([PY, GPT, *TINY, *PP2, *LONG, "--save", ctx.ckpt, "--metrics-file",
                       "m.jsonl"], 2, ctx.work, {TIMEOUT_ENV: "10"})
        if wait_rows(os.path.join(ctx.work, "m.jsonl"), 3, ranks.alive):
            ranks.procs[1].send_signal(sig)
        r = ranks.wait(60)
        r.parts = [p for p in _rank_logs(ctx.work, 2)]
        return r
    return act


def _rank_logs(work: str, n: int) -> list:
    return [_read(work, f"rank{r}.log") for r in range(n)]


def _exit_status(code: int) -> Callable[[Ctx, Run], str]:
    def check(ctx: Ctx, r: Run) -> str:
        return "" if r.codes == [code] else f"exit {r.codes}, expected {code}"
    return check


def _both(*checks: Callable[[Ctx, Run], str]) -> Callable[[Ctx, Run], str]:
    def check(ctx: Ctx, r: Run) -> str:
        return next((why for why in (c(ctx, r) for c in checks) if why), "")
    return check


def _sigterm_during_startup(ctx: Ctx) -> Run:
    """--exit-signal-handler, started as the Slurm scripts start it (SIGTERM ignored until
    the handler is in); SIGTERM once the flags are checked, before the first iteration."""
    ctx.ckpt = os.path.join(ctx.work, "ckpt")

    def ignore_term() -> None:
        _as_from_a_terminal()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log = open(os.path.join(ctx.work, "proc.log"), "w+")
    proc = subprocess.Popen([PY, GPT, *TINY, *LONG, "--exit-signal-handler", "--save",
                             ctx.ckpt, "--metrics-file", "m.jsonl"], cwd=ctx.work, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env=_clean_env(), preexec_fn=ignore_term)
    _reap_later(ctx, [proc.pid])
    start = time.monotonic()
    while proc.poll() is None and time.monotonic() - start < 120:
        if "kernels:" in _read(ctx.work):  # logged after the flags' checks, before training
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.01)
    r = _finish(proc, start, 60)
    r.out = _read(ctx.work)
    return r


def _prep_interrupted(ctx: Ctx) -> Run:
    """tools/preprocess_data.py --workers 2 (a pool in the terminal's process group), Ctrl-C
    once it has written some documents."""
    src = os.path.join(ctx.work, "in.jsonl")
    _prep_input(src, 20000)
    ctx.notes["fs"] = out = os.path.join(ctx.work, "out")
    os.makedirs(out)
    proc = _session([*_prep_argv(src, os.path.join(out, "x")), "--workers", "2",
                     "--log-interval", "500"], ctx.work, {"PYTHONPATH": ROOT})
    _reap_later(ctx, [proc.pid])
    start = time.monotonic()
    while proc.poll() is None and time.monotonic() - start < 120:
        if "processed 500 documents" in _read(ctx.work):
            os.killpg(proc.pid, signal.SIGINT)
            break
        time.sleep(0.02)
    r = _finish(proc, start, 60)
    r.out = _read(ctx.work)
    return r


def _signal_at_rendezvous(ctx: Ctx) -> Run:
    """Rank 0 of 2 alone, waiting at the rendezvous for a rank that never comes (a node
    still booting); SIGTERM 5 s in (the job cancelled): it must leave at once, not when
    the 60 s --distributed-timeout-minutes run out."""
    ranks = Ranks([PY, GPT, *TINY, *PP2, "--train-iters", "4"], 1, ctx.work,
                  env={"WORLD_SIZE": "2", TIMEOUT_ENV: "60"})
    time.sleep(5)
    ranks.procs[0].send_signal(signal.SIGTERM)
    return ranks.wait(20)


def class15() -> list:
    dist = [*TINY, *LONG, "--ckpt-format", "torch_dist", "--save-interval", "1"]
    return [
        Probe("Ctrl-C to torchrun: each rank one line, no traceback", 15, "fault",
              _torchrun_signal(signal.SIGINT), "stopped:",
              check=_stop_lines("SIGINT", 2), slow=True),
        Probe("SIGTERM to torchrun without --exit-signal-handler: each rank says so", 15,
              "fault", _torchrun_signal(signal.SIGTERM), "stopped:",
              check=_stop_lines("SIGTERM", 2), slow=True),
        Probe("Ctrl-C to a single process: one line, exit 130", 15, "fault",
              _group_signal([signal.SIGINT]), "stopped:",
              check=_both(_stop_lines("SIGINT"), _exit_status(130))),
        Probe("Ctrl-C during a torch_dist save (the rank and its writers)", 15, "fault",
              _group_signal([signal.SIGINT], "save", dist), "stopped:",
              check=_both(_stop_lines("SIGINT"), _exit_status(130))),
        Probe("SIGTERM to one rank by hand: every rank says which and why", 15, "fault",
              _one_rank_signal(signal.SIGTERM), "stopped:",
              check=_stop_lines("SIGTERM", 2), slow=True),
        Probe("SIGHUP (its terminal closed) to a single process: one line", 15, "fault",
              _group_signal([signal.SIGHUP]), "stopped:",
              check=_both(_stop_lines("SIGHUP"), _exit_status(129))),
        Probe("Ctrl-C twice during a torch_dist save: stops at once, no traceback", 15,
              "fault", _group_signal([signal.SIGINT, signal.SIGINT], "save", dist, 0.02),
              "stopped:", check=_both(_stop_lines("SIGINT"), _exit_status(130))),
        Probe("Ctrl-C to tools/preprocess_data.py --workers 2: one line, nothing left", 15,
              "fault", _prep_interrupted, "stopped:",
              check=_both(_stop_lines("SIGINT", checkpoint=False), _exit_status(130),
                          _left_as_before)),
        Probe("SIGTERM to a rank waiting at the rendezvous: it leaves at once", 15, "fault",
              _signal_at_rendezvous, "stopped: SIGTERM", check=_exit_status(143)),
        Probe("SIGTERM during start-up with --exit-signal-handler (Slurm scripts' launch) is "
              "not lost", 15, "ok", _sigterm_during_startup, "after receiving SIGTERM",
              check=_stopped_and_saved),
    ]


# ---- 16: no rank outlives its job

def _kill_launcher(after_rows: int = 3) -> Callable[[Ctx], Run]:
    """torchrun SIGKILLed (an OOM killer, a node agent): its workers must end by
    themselves, quickly, and save nothing more. after_rows 0: during start-up."""
    def act(ctx: Ctx) -> Run:
        ckpt = ctx.notes["ckpt"] = os.path.join(ctx.work, "ckpt")  # none due before 50
        env = {TIMEOUT_ENV: "10"} if after_rows else {}  # start-up: the default timeout
        job = Launched(ctx, [*TINY, *PP2, "--train-iters", "2000", "--save-interval", "50",
                             "--save", ckpt, "--metrics-file", "m.jsonl"], 2, env)
        job.workers(2)
        if after_rows:
            wait_rows(os.path.join(ctx.work, "m.jsonl"), after_rows, job.alive)
        else:
            time.sleep(0.5)
        os.kill(job.proc.pid, signal.SIGKILL)
        ctx.notes["rows_at_kill"] = len(metrics_rows(os.path.join(ctx.work, "m.jsonl")))
        return job.wait(45)
    return act


def _left_after_launcher(ctx: Ctx, r: Run) -> str:
    """Each rank says why it left; nothing saved after the first save point past the
    kill."""
    for rank, out in enumerate(r.parts):
        if "launcher" not in out or TB in out:
            return f"rank {rank} did not say that the launcher is gone"
    from megatron_2bw.checkpointing import files as cf

    ckpt = ctx.notes["ckpt"]
    tracked = cf.read_tracker(ckpt) if os.path.isdir(ckpt) else None
    if tracked and tracked > 50:
        return f"the ranks saved iteration {tracked} after the launcher was gone"
    return ""


def _kill_rank_mid_save(tries: int = 3) -> Callable[[Ctx], Run]:
    """2 ranks PP2, torch_dist; rank 1 SIGKILLed while its writer process is out, up to
    `tries` times (megatron-core's writer outlived its rank in 3 of 4 tries before)."""
    def act(ctx: Ctx) -> Run:
        total = 0.0
        for t in range(tries):
            work = os.path.join(ctx.work, f"try{t}")
            os.makedirs(work)
            ranks = Ranks([PY, GPT, *TINY, *PP2, "--ckpt-format", "torch_dist",
                           "--train-iters", "2000", "--save", "ckpt", "--save-interval", "1",
                           "--metrics-file", "m.jsonl"], 2, work, {TIMEOUT_ENV: "10"})
            writers: list = []
            if wait_rows(os.path.join(work, "m.jsonl"), 2 + t, ranks.alive):
                writers = _first_children(ranks.procs[1].pid)
                ranks.procs[1].kill()  # as soon as its writers are forked
            _reap_later(ctx, writers)
            r = ranks.wait(60)
            total += r.seconds
            time.sleep(3)
            ctx.notes["left"] = [w for w in writers if _alive(w)]
            if r.timed_out or ctx.notes["left"]:
                break
        r.seconds = total
        return r
    return act


def _no_orphans(ctx: Ctx, r: Run) -> str:
    left = ctx.notes.get("left")
    return f"writer processes {left} of the killed rank live on (parent pid 1)" if left else ""


def _kill_writer(ctx: Ctx) -> Run:
    """1 process, torch_dist: its writer process SIGKILLed (the OOM killer picks the
    largest process; a forked writer counts the rank's memory)."""
    ctx.ckpt = os.path.join(ctx.work, "ckpt")
    proc = _session([PY, GPT, *TINY, "--ckpt-format", "torch_dist", *LONG, "--save-interval",
                     "1", "--save", ctx.ckpt, "--metrics-file", "m.jsonl"], ctx.work,
                    {TIMEOUT_ENV: "10"})
    _reap_later(ctx, [proc.pid])
    start = time.monotonic()
    if wait_rows(os.path.join(ctx.work, "m.jsonl"), 2, lambda: proc.poll() is None):
        writers = _first_children(proc.pid)
        for w in writers:
            os.kill(w, signal.SIGKILL)
    r = _finish(proc, start, 60)
    r.out = _read(ctx.work)
    return r


def _second_job(ctx: Ctx) -> Run:
    """Job A trains into --save; job B (a requeue, a colleague's run) starts on the same
    directory while A runs: B is refused, naming A."""
    ctx.ckpt = os.path.join(ctx.work, "ckpt")
    a = Ranks([PY, GPT, *LIN[:-4], "--ckpt-format", "torch", "--train-iters", "100000",
               "--save", ctx.ckpt, "--save-interval", "5", "--metrics-file", "a.jsonl"], 1,
              ctx.work)
    _reap_later(ctx, [a.procs[0].pid])
    wait_rows(os.path.join(ctx.work, "a.jsonl"), 6, a.alive)
    ctx.notes["pid"] = a.procs[0].pid
    b = gpt1([*LIN[:-4], "--ckpt-format", "torch", "--train-iters", "100000", "--load",
              ctx.ckpt, "--save", ctx.ckpt, "--save-interval", "5", "--exit-interval",
              str(_tracker(ctx) + 10)], ctx.work, timeout=90)
    still = a.alive()
    a.wait(0)
    return b if still else Run([None], b.out + "\n(job A ended meanwhile)", b.seconds)


def _names_owner(ctx: Ctx, r: Run) -> str:
    pid = str(ctx.notes.get("pid", ""))
    lines = [ln for ln in r.out.splitlines() if ln.startswith("error:")]
    return "" if lines and pid in lines[0] else f"the error does not name pid {pid}"


LOCK = "save.lock"  # the lock file's name and fields, as docs/reliability.md states them


def _foreign_lock(beating: bool, clock_skew_s: float = 0.0) -> Callable[[Ctx], Run]:
    """A --save directory whose lock names a job on another host: one that still refreshes
    it (its beat goes up) is refused; one that stopped is taken over, whatever its
    timestamp says (another node's clock: `clock_skew_s` ahead)."""
    def act(ctx: Ctx) -> Run:
        import threading
        import uuid

        ckpt = os.path.join(ctx.work, "ckpt")
        os.makedirs(ckpt)
        if not beating:
            ctx.ckpt = ckpt  # the run takes it over and saves
        path = os.path.join(ckpt, LOCK)
        doc = {"host": "node-elsewhere", "machine": "feedface" * 4, "pid": 4242,
               "start": "1", "job": "slurm job 99", "token": uuid.uuid4().hex, "beat": 0,
               "time": time.time() + clock_skew_s}
        done = threading.Event()

        def beat() -> None:
            while True:
                doc["beat"] += 1
                doc["time"] = time.time() + clock_skew_s
                with open(path + ".w", "w") as f:
                    json.dump(doc, f)
                os.replace(path + ".w", path)
                if done.wait(0.2) or not beating:
                    return
        writer = threading.Thread(target=beat, daemon=True)
        writer.start()
        try:
            return gpt1([*TINY, "--train-iters", "3", "--save", ckpt], ctx.work,
                        env=_clean_env(**{TIMEOUT_ENV: "10"}))
        finally:
            done.set()
            writer.join()
    return act


def _stalled_log(ctx: Ctx) -> Run:
    """2 ranks PP2; rank 1's output goes to a pipe nobody reads (a terminal paused with
    Ctrl-S, a stalled log collector): it blocks in a write, rank 0 times out and leaves;
    rank 1 must not stay behind forever."""
    base = _clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
                      **{TIMEOUT_ENV: "4"})
    argv = [PY, GPT, *TINY, *PP2, "--train-iters", "100000", "--log-interval", "1"]
    log0 = open(os.path.join(ctx.work, "rank0.log"), "w+")
    start = time.monotonic()
    procs = [subprocess.Popen(argv, cwd=ctx.work, stdout=log0, stderr=subprocess.STDOUT,
                              env=dict(base, RANK="0", LOCAL_RANK="0")),
             subprocess.Popen(argv, cwd=ctx.work, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              env=dict(base, RANK="1", LOCAL_RANK="1"))]
    _reap_later(ctx, [p.pid for p in procs])
    deadline = time.monotonic() + 150
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    codes = [p.poll() for p in procs]
    timed_out = None in codes
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    procs[1].stdout.close()
    log0.seek(0)
    return Run(codes, log0.read(), time.monotonic() - start, timed_out)


def _ranks_disagree(rank1: Callable[[Ctx, list], list]) -> Callable[[Ctx], Run]:
    """DP 2 where rank 1's command line is `rank1(ctx, argv)`: another flag, or another
    copy of the program (a node whose install was not updated)."""
    def act(ctx: Ctx) -> Run:
        argv = [PY, GPT, *TINY, "--global-batch-size", "4", "--train-iters", "4",
                "--metrics-file", "m.jsonl"]
        return Ranks(argv, 2, ctx.work, rank_argv={1: rank1(ctx, argv)}).wait(120)
    return act


def _other_lr(ctx: Ctx, argv: list) -> list:
    return _replace(argv, "--lr", "2e-2")


def _stale_install(ctx: Ctx, argv: list) -> list:
    """A copy of pretrain_gpt.py and megatron_2bw with one file changed, as an older
    install on one node would be (the script's directory comes first on sys.path)."""
    node = os.path.join(ctx.work, "node1")
    shutil.copytree(os.path.join(ROOT, "megatron_2bw"), os.path.join(node, "megatron_2bw"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(GPT, node)
    with open(os.path.join(node, "megatron_2bw", "optim", "__init__.py"), "a") as f:
        f.write("# an older build of this file\n")
    return [argv[0], os.path.join(node, "pretrain_gpt.py"), *argv[2:]]


def _nothing_trained(ctx: Ctx, r: Run) -> str:
    rows = metrics_rows(os.path.join(ctx.work, "m.jsonl"))
    return f"{len(rows)} training rows written before the refusal" if rows else ""


def class16() -> list:
    return [
        Probe("torchrun SIGKILLed: the ranks leave, saving nothing more", 16, "fault",
              _kill_launcher(), "launcher", check=_left_after_launcher, slow=True),
        Probe("torchrun SIGKILLed during start-up: the ranks do not wait out the rendezvous",
              16, "fault", _kill_launcher(0), "launcher", check=_left_after_launcher,
              slow=True),
        Probe("a rank SIGKILLed mid torch_dist save: its writer processes go too", 16, "fault",
              _kill_rank_mid_save(), check=_no_orphans, slow=True),
        Probe("a torch_dist writer SIGKILLed (OOM killer): the rank ends, one line", 16,
              "fault", _kill_writer, "error:", check=_prev_sound),
        Probe("a second job on a --save in use is refused, naming the first", 16, "error",
              _second_job, LOCK, check=_names_owner),
        Probe("a --save locked by a live job on another host is refused", 16, "error",
              _foreign_lock(True), "node-elsewhere"),
        Probe("a rank stuck in a write (stalled log pipe) leaves when its peer does", 16,
              "fault", _stalled_log, "stopped answering", slow=True),
        Probe("a stale lock from another host, its clock 1 h ahead, is taken over (guard)",
              16, "ok", _foreign_lock(False, 3600.0), "node-elsewhere",
              check=tracker_is(3)),
        Probe("one rank started with another --lr (an edited per-node script)", 16, "error",
              _ranks_disagree(_other_lr), "--lr", check=_nothing_trained),
        Probe("one rank runs another install of megatron_2bw (a node not updated)", 16,
              "error", _ranks_disagree(_stale_install), "different software",
              check=_nothing_trained),
    ]


# ---------------------------------------------- 20: requests dropped in silence


def _corpus(ctx: Ctx, lengths: list) -> str:
    """A corpus of documents of these token counts (EOD included), made in the probe's
    folder by the project's preprocessing; returns its --data-path prefix."""
    from megatron_2bw.data.preprocess import PreprocessConfig, preprocess
    from megatron_2bw.data.tokenizers import TokenizerSpec

    src = os.path.join(ctx.work, "in.jsonl")
    with open(src, "w") as f:
        for i, n in enumerate(lengths):
            words = " ".join(str((7 * i + k) % VOCAB) for k in range(n - 1))
            f.write(json.dumps({"text": words}) + "\n")
    preprocess(PreprocessConfig(input=src, output_prefix=os.path.join(ctx.work, "c"),
                                tokenizer=TokenizerSpec("NullTokenizer", vocab_size=VOCAB),
                                append_eod=True))
    return os.path.join(ctx.work, "c_text_document")


def _small_corpus(lengths: list, split: str) -> Callable[[Ctx], Run]:
    """Train 2 iterations of --seq-length 16 (17 tokens a sample) on such a corpus."""
    def act(ctx: Ctx) -> Run:
        flags = _replace(data_flags(_corpus(ctx, lengths), ctx.work), "--train-iters", "2")
        return gpt1(_replace(flags, "--split", split), ctx.work)
    return act


NOT_UTF8 = b'{"text": "1 2"}\n{"text": "3", "by": "Andr\xe9"}\n{"text": "4 5"}\n'


def prep_bytes(raw: bytes, extra: list = ()) -> Callable[[Ctx], Run]:
    """tools/preprocess_data.py on an input of these bytes (NullTokenizer, 10 ids)."""
    def act(ctx: Ctx) -> Run:
        src = os.path.join(ctx.work, "in.jsonl")
        with open(src, "wb") as f:
            f.write(raw)
        flags = ["--input", src, "--output-prefix", os.path.join(ctx.work, "out"),
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", *extra]
        return run1([PY, PREP, *flags], ctx.work, env=_clean_env(PYTHONPATH=ROOT))
    return act


def _says(*texts: str) -> Callable[[Ctx, Run], str]:
    def check(ctx: Ctx, r: Run) -> str:
        missing = [t for t in texts if t not in r.out]
        return f"output lacks {missing}" if missing else ""
    return check


EARLIER = [{"split": "train", "iteration": i, "loss": 99.0, "run": "earlier"}
           for i in range(1, 7)]


def _earlier_rows(path: str, torn: bool = True) -> None:
    """An earlier run's rows (and the torn line of its crash) in a metrics file."""
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in EARLIER)
        if torn:
            f.write('{"spl')


def _fresh_over_metrics(ctx: Ctx) -> Run:
    _earlier_rows(os.path.join(ctx.work, "m.jsonl"))
    return gpt1([*TINY, "--train-iters", "2", "--metrics-file", "m.jsonl"], ctx.work)


def _resume_after_earlier(ctx: Ctx) -> Run:
    """The shared checkpoint's run (rows 1, 2, then a crash row 3) wrote after an earlier
    run's rows 1..6 in the same file; resume it at iteration 2."""
    ck = _ck(ctx)
    _mark(ctx)
    path = os.path.join(ctx.work, "m.jsonl")
    with open(path) as f:
        own = f.read()
    with open(path, "w") as f:
        f.write("")
    _earlier_rows(path, torn=False)
    with open(path, "a") as f:
        f.write(own)
    _append_rows(ck)
    return gpt1([*LIN, "--load", ck, "--save", ck, "--metrics-file", "m.jsonl"], ctx.work)


def _rows_after_earlier(new: int) -> Callable[[Ctx, Run], str]:
    """The earlier run's rows stay as they were, and this run's iterations follow once."""
    def check(ctx: Ctx, r: Run) -> str:
        rows = metrics_rows(os.path.join(ctx.work, "m.jsonl"))
        earlier = [row for row in rows if row.get("run") == "earlier"]
        its = [row["iteration"] for row in rows if row.get("run") != "earlier"]
        if earlier != EARLIER or rows[:len(EARLIER)] != EARLIER:
            return f"the earlier run's rows are {[row['iteration'] for row in earlier]}"
        return "" if its == list(range(1, new + 1)) else f"this run's iterations {its}"
    return check


def class20() -> list:
    replaced = "1 byte that is not UTF-8"
    return [
        Probe("--split 100,0,0 with --eval-iters: the run says it will not validate", 20,
              "ok", _data_spec(lambda p: [p], "100,0,0"), "gives validation no documents"),
        Probe("--split with --mock-data says it is not used", 20, "ok",
              lambda c: gpt1([*TINY, "--train-iters", "2", "--split", "100,0,0"], c.work),
              "--split 100,0,0 is not used with --mock-data"),
        Probe("corpus shorter than one sequence (--seq-length 16: 17 tokens)", 20, "error",
              _small_corpus([6, 4], "100,0,0"), "fewer than the 17 tokens"),
        Probe("validation split shorter than one sequence: a warning", 20, "ok",
              _small_corpus([30] * 9 + [5], "90,10,0"), "WARNING: --data-path",
              check=_says("the valid split of --split 90,10,0 holds 5 tokens")),
        Probe("preprocess: a line that is not UTF-8 is named, not replaced", 20, "error",
              prep_bytes(NOT_UTF8), "--invalid-utf8", code=1,
              check=_says("in.jsonl:2", replaced)),
        Probe("preprocess --invalid-utf8 replace says which line it changed", 20, "ok",
              prep_bytes(NOT_UTF8, ["--invalid-utf8", "replace"]), "in.jsonl:2",
              check=_says(" 3 documents,", replaced)),
        Probe("preprocess --invalid-utf8 skip says which line it skipped", 20, "ok",
              prep_bytes(NOT_UTF8, ["--invalid-utf8", "skip"]), "in.jsonl:2",
              check=_says(" 2 documents,", replaced)),
        Probe("preprocess --keep-newlines without --split-sentences says it does nothing", 20,
              "ok", prep(['{"text": "1 2"}'], ["--keep-newlines"]),
              "--keep-newlines has no effect"),
        Probe("fresh run appends to an existing --metrics-file, as --help says", 20, "ok",
              _fresh_over_metrics, "appends its rows after them", check=_rows_after_earlier(2)),
        Probe("resume keeps an earlier run's rows in the same --metrics-file", 20, "ok",
              _resume_after_earlier, check=_rows_after_earlier(4)),
    ]


# ---------------------------------------------- 17: saves killed at any moment

# Run the entry point with one function replaced by a SIGKILL of this process: the kill
# lands at an exact step of a save (before or after a call of `module.function`, the
# n-th call, on one rank), the same way on any version of the code that has the step.
KILL_AT = "M2BW_PROBE_KILL_AT"  # "module.function:before|after:rank:n"
_KILL_HOOK = r"""
import importlib, os, runpy, signal, sys
where, when, rank, nth = os.environ["M2BW_PROBE_KILL_AT"].split(":")
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
if os.environ.get("RANK", "0") == rank:
    module, name = where.rsplit(".", 1)
    original = getattr(importlib.import_module(module), name)
    calls = [0]
    def killer(*a, **k):
        calls[0] += 1
        if calls[0] < int(nth):
            return original(*a, **k)
        if when == "after":
            original(*a, **k)
        os.kill(os.getpid(), signal.SIGKILL)
    for m in list(sys.modules.values()):
        if getattr(m, name, None) is original:
            setattr(m, name, killer)
runpy.run_path(sys.argv[0], run_name="__main__")
"""
FILES = "megatron_2bw.checkpointing.files"
DIST_SAVE = "megatron.core.dist_checkpointing.save"
DP2 = ["--global-batch-size", "8", "--use-distributed-optimizer"]


def _killed_save(base: list, at: str, nproc: int = 1, every: str = "2",
                 iters: str = "4") -> Callable[[Ctx], Run]:
    """Train with --save every `every` iterations; `at` (KILL_AT) SIGKILLs a rank inside a
    save, then the rest of the job goes (as its launcher would end it); then the same
    command again, which must resume without hand work."""
    def act(ctx: Ctx) -> Run:
        ctx.ckpt = os.path.join(ctx.work, "ckpt")
        flags = [*base, "--train-iters", iters, "--save", ctx.ckpt, "--load", ctx.ckpt,
                 "--save-interval", every, "--metrics-file", "m.jsonl"]
        first = Ranks([PY, "-c", _KILL_HOOK, GPT, *flags], nproc, ctx.work,
                      {KILL_AT: at, TIMEOUT_ENV: "20"})
        while first.alive() and time.monotonic() - first.start < 120:
            time.sleep(0.05)
        time.sleep(0.5)  # a peer may still be leaving on its own
        killed = first.wait(0)
        ctx.notes["killed"] = killed.codes
        _mark(ctx)
        again = Ranks([PY, GPT, *flags], nproc, ctx.work).wait(150)
        again.seconds += killed.seconds
        return again
    return act


def _resumed(iters: int, saying: str) -> Callable[[Ctx, Run], str]:
    """The kill happened, the rerun said `saying`, its tracker is `iters` and the newest
    run's metrics rows are 1..iters once each."""
    def check(ctx: Ctx, r: Run) -> str:
        if -signal.SIGKILL not in (ctx.notes.get("killed") or []):
            return f"the first run was not killed (exit {ctx.notes.get('killed')})"
        if saying not in r.out:
            return f"output lacks {saying!r}"
        rows = [row["iteration"] for row in metrics_rows(os.path.join(ctx.work, "m.jsonl"))]
        newest = max((i for i in range(1, len(rows)) if rows[i] < rows[i - 1]), default=0)
        if rows[newest:] != list(range(1, iters + 1)):
            return f"metrics iterations {rows}"
        return tracker_is(iters)(ctx, r)
    return check


def class17() -> list:
    started_over = "a save that did not finish"
    return [
        Probe("first save killed after its file, before the manifest: the rerun starts over",
              17, "ok", _killed_save(LIN, f"{FILES}.write_manifest:before:0:1"),
              check=_resumed(4, started_over)),
        Probe("first save killed after its manifest, before the tracker: the rerun resumes "
              "from it", 17, "ok", _killed_save(LIN, f"{FILES}.write_tracker:before:0:1"),
              check=_resumed(4, "resuming from iteration 2")),
        Probe("later save killed between manifest and tracker: the rerun resumes from it",
              17, "ok", _killed_save(LIN, f"{FILES}.write_tracker:before:0:2", every="1"),
              check=_resumed(4, "resuming from iteration 2")),
        Probe("first torch_dist save killed after its files, before the manifest", 17, "ok",
              _killed_save(DIST, f"{DIST_SAVE}:after:0:1"), check=_resumed(4, started_over)),
        Probe("first torch_dist save of 2bw PP2: rank 1 killed as it starts writing", 17,
              "ok", _killed_save([*TINY[:-1], "torch_dist", *PP2, "--pipeline-schedule",
                                  "2bw"], f"{DIST_SAVE}:before:1:1", nproc=2),
              check=_resumed(4, started_over), slow=True),
        Probe("first save of the distributed optimizer (DP2, torch_dist) killed before the "
              "manifest", 17, "ok",
              _killed_save([*TINY[:-1], "torch_dist", *DP2], f"{FILES}.write_manifest:before:0:1",
                           nproc=2), check=_resumed(4, started_over), slow=True),
    ]


# ---------------------------------------------- 21: messages that are right

def _other_model(save_with: str, flags: list) -> Callable[[Ctx], Run]:
    """A checkpoint of one model type (`save_with`: pretrain_bert.py or pretrain_gpt.py)
    resumed by the other entry point."""
    def act(ctx: Ctx) -> Run:
        ctx.ckpt = os.path.join(ctx.work, "ckpt")
        first = run1([PY, os.path.join(ROOT, save_with), *flags, "--train-iters", "1",
                      "--save", ctx.ckpt], ctx.work, timeout=120)
        if first.codes != [0]:
            return first
        _mark(ctx)
        other = "pretrain_gpt.py" if save_with == "pretrain_bert.py" else "pretrain_bert.py"
        return run1([PY, os.path.join(ROOT, other), *flags, "--train-iters", "2", "--load",
                     ctx.ckpt], ctx.work, timeout=120)
    return act


def _interrupted_iteration(ck: str) -> None:
    """What a save of iteration 3 killed while writing its file leaves."""
    folder = os.path.join(ck, "iter_0000003", "mp_rank_00")
    os.makedirs(folder)
    with open(os.path.join(folder, "model_optim_rng.pt.tmp"), "wb") as f:
        f.write(b"PK\x03\x04" + bytes(100))


def _output_has(text: str) -> Callable[[Ctx, Run], str]:
    return lambda ctx, r: "" if text in r.out else f"output lacks {text!r}"


def class21() -> list:
    return [
        Probe("a BERT checkpoint into pretrain_gpt.py says it is BERT's", 21, "error",
              _other_model("pretrain_bert.py", TINY), "pretrain_bert.py",
              check=_output_has("is a BERT checkpoint")),
        Probe("a GPT checkpoint (torch_dist) into pretrain_bert.py says it is GPT's", 21,
              "error", _other_model("pretrain_gpt.py", [*TINY[:-1], "torch_dist"]),
              "pretrain_gpt.py", check=_output_has("is a GPT checkpoint")),
        Probe("tracker naming a missing iteration says it is missing", 21, "error",
              resume([], _write("latest_checkpointed_iteration.txt", "7")),
              "names iteration 7, which is missing", check=_output_has("complete iterations")),
        Probe("--ckpt-step of an interrupted save says so, not another layout", 21, "error",
              resume(["--ckpt-step", "3"], _interrupted_iteration),
              "iteration 3 is an interrupted save"),
        Probe("a flag mismatch gives the checkpoint's value first", 21, "error",
              resume(["--vocab-size", "200"]), "--vocab-size 127 in the checkpoint, 200 in "
              "this run"),
        Probe("resume with another --optimizer (torch format) names both", 21, "error",
              resume(["--optimizer", "muon"]),
              "saved with --optimizer adam, this run has --optimizer muon"),
    ]


# ---------------------------------------------- 18: peers dying at any moment

# rank 1 (or 0) SIGKILLed at an exact step (KILL_AT, class 17's hook): inside a save of
# either format, a validation, the start-up after the rendezvous
EVAL = "megatron_2bw.training.loop.build_eval_schedule"
ENTRY = "megatron_2bw.training.entry"
DP2_TORCH = [*TINY, "--global-batch-size", "4"]
MACHINE_ENV = "MEGATRON_2BW_MACHINE_FOR_TESTS"  # comm/peers.py: the machine a rank plays


def _peer_dies(base: list, at: str, nproc: int = 2, save: bool = True,
               extra: tuple = (), machines: Optional[dict] = None) -> Callable[[Ctx], Run]:
    """`nproc` ranks started directly, one SIGKILLed where `at` says; each rank's own
    output kept apart (r.parts) for the survivors' lines. `machines` maps a rank to the
    machine it plays (MEGATRON_2BW_MACHINE_FOR_TESTS): /proc then cannot tell them."""
    def act(ctx: Ctx) -> Run:
        flags = [*base, "--train-iters", "20", *extra]
        if save:
            ctx.ckpt = os.path.join(ctx.work, "ckpt")
            flags += ["--save", ctx.ckpt, "--save-interval", "2"]
        played = {r: {MACHINE_ENV: name} for r, name in (machines or {}).items()}
        r = Ranks([PY, "-c", _KILL_HOOK, GPT, *flags], nproc, ctx.work,
                  {KILL_AT: at, TIMEOUT_ENV: "20"}, rank_env=played).wait(120)
        r.parts = _rank_logs(ctx.work, nproc)
        return r
    return act


def _survivors_say(dead: int, checkpoint: bool = True) -> Callable[[Ctx, Run], str]:
    """The killed rank was killed; every other rank printed exactly one `error:` line that
    names the dead rank and where the last checkpoint is (or that nothing is saved), and
    no traceback: neither Python's nor torch's `[rankN]:` lines nor a C++ stack."""
    def check(ctx: Ctx, r: Run) -> str:
        if r.codes[dead] != -signal.SIGKILL:
            return f"rank {dead} was not killed (exit {r.codes})"
        for rank, out in enumerate(r.parts):
            if rank == dead:
                continue
            if TB in out or re.search(r"^\[rank\d+\]:", out, re.M) or "frame #" in out:
                return f"rank {rank}: a traceback or a C++ stack"
            lines = [ln for ln in out.splitlines() if ln.startswith("error:")]
            if len(lines) != 1:
                return f"rank {rank}: {len(lines)} error lines"
            if f"rank {dead}" not in lines[0]:
                return f"rank {rank} does not name rank {dead}: {lines[0][:120]}"
            said = ("--load" in lines[0] if checkpoint else
                    any(w in lines[0] for w in ("no --save", "no checkpoint", "--load")))
            if not said:
                return f"rank {rank} does not say where the last checkpoint is"
        return ""
    return check


def _silent_store(ctx: Ctx) -> Run:
    """Rank 1 pointed at a server that accepts connections and never answers (another
    program on MASTER_PORT, a frozen store host), with a 4 s timeout."""
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list = []
    done = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not done.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue
    threading.Thread(target=accept, daemon=True).start()
    ctx.cleanups.append(lambda: (done.set(), server.close(), [c.close() for c in held]))
    env = _clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.getsockname()[1]),
                     WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", **{TIMEOUT_ENV: "4"})
    return run1([PY, GPT, *TINY, *PP2, "--train-iters", "3"], ctx.work, timeout=60, env=env)


def _within(seconds: float) -> Callable[[Ctx, Run], str]:
    return lambda ctx, r: "" if r.seconds < seconds else f"took {r.seconds:.0f} s"


def class18() -> list:
    ends = "has ended"
    dist_pp2 = [*TINY[:-1], "torch_dist", *PP2]
    return [
        Probe("rank 1 SIGKILLed mid torch save (PP2): rank 0 says so in one line", 18,
              "fault", _peer_dies([*TINY, *PP2], f"{FILES}.write_state:before:1:2"), ends,
              check=_survivors_say(1), slow=True),
        Probe("rank 0, the store's host, SIGKILLed mid torch save: rank 1 says so", 18,
              "fault", _peer_dies([*TINY, *PP2], f"{FILES}.write_state:before:0:2"), ends,
              check=_survivors_say(0), slow=True),
        Probe("rank 1 SIGKILLed mid torch_dist save (PP2): rank 0 says so in one line", 18,
              "fault", _peer_dies(dist_pp2, f"{DIST_SAVE}:before:1:2"), ends,
              check=_survivors_say(1), slow=True),
        Probe("rank 1 SIGKILLed as the validation starts (DP2): rank 0 says so", 18, "fault",
              _peer_dies(DP2_TORCH, f"{EVAL}:before:1:1", save=False,
                         extra=("--eval-interval", "3")), ends,
              check=_survivors_say(1, checkpoint=False), slow=True),
        Probe("rank 1 SIGKILLed while the data sets and groups are built: rank 0 says so",
              18, "fault", _peer_dies([*TINY, *PP2], f"{ENTRY}.data_sources:before:1:1",
                                      save=False),
              ends, check=_survivors_say(1, checkpoint=False), slow=True),
        Probe("rank 1 SIGKILLed right after the rendezvous: rank 0 says so", 18, "fault",
              _peer_dies([*TINY, *PP2], f"{ENTRY}.check_ranks_agree:before:1:1", save=False),
              ends, check=_survivors_say(1, checkpoint=False), slow=True),
        Probe("rank 2 SIGKILLed on another machine (DP3, two machines): every survivor "
              "names it", 18, "fault",
              _peer_dies([*TINY, "--global-batch-size", "6"], f"{EVAL}:before:2:1", nproc=3,
                         save=False, extra=("--eval-interval", "3"),
                         machines={0: "a", 1: "b", 2: "b"}), ends,
              check=_survivors_say(2, checkpoint=False), slow=True),
        Probe("a store that accepts connections and never answers: one line in time", 18,
              "fault", _silent_store, "did not answer", check=_within(45)),
    ]


# ---------------------------------------------- 19: resources

GIB = 2 ** 30
HUGE_MB = ["--micro-batch-size", "20000", "--global-batch-size", "20000"]


def _limits(**limits: tuple) -> Callable[[], None]:
    """A preexec that sets resource limits (name: (soft, hard)), as `ulimit` would."""
    def preexec() -> None:
        for name, value in limits.items():
            resource.setrlimit(getattr(resource, name), value)
    return preexec


def _limited(flags: list, env: Optional[dict] = None, **limits: tuple) -> Callable[[Ctx], Run]:
    return lambda c: gpt1([*TINY, *flags], c.work, env=_clean_env(**(env or {})),
                          preexec=_limits(**limits))


def _hard_nofile() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def _one_error_says(*words: str) -> Callable[[Ctx, Run], str]:
    def check(ctx: Ctx, r: Run) -> str:
        lines = [ln for ln in r.out.splitlines() if ln.startswith("error:")]
        if len(lines) != 1:
            return f"{len(lines)} error lines"
        missing = [w for w in words if w not in lines[0]]
        return f"the line lacks {missing}" if missing else ""
    return check


def _progress_then_loss(ctx: Ctx, r: Run) -> str:
    """A progress line before the validation's loss after training."""
    at = r.out.find("Evaluating iter")
    loss = r.out.find("validation loss at iteration 2")
    return "" if 0 <= at < loss else "no progress line before the validation's loss"


def class19() -> list:
    three = (3 * GIB, 3 * GIB)
    big_eval = ["--num-layers", "2", "--hidden-size", "64", "--seq-length", "256",
                "--max-position-embeddings", "256", "--micro-batch-size", "256",
                "--global-batch-size", "256", "--eval-iters", "20", "--train-iters", "2"]
    return [
        Probe("--micro-batch-size far past memory (ulimit -v 3 GiB): refused before the "
              "model is built", 19, "error",
              _limited([*HUGE_MB, "--train-iters", "2"], RLIMIT_AS=three),
              "--micro-batch-size", check=_one_error_says("planner", "--micro-batch-size")),
        Probe("out of memory in the first step (the check off): one line naming the flag", 19,
              "error", _limited([*HUGE_MB, "--train-iters", "2"],
                                {"MEGATRON_2BW_MEMORY_CHECK": "0"}, RLIMIT_AS=three),
              "out of memory", check=_one_error_says("--micro-batch-size"), code=1),
        Probe("ulimit -v too small for the threads: one line, not a SIGABRT", 19, "error",
              _limited(["--train-iters", "2"], RLIMIT_AS=(int(1.4 * GIB), int(1.4 * GIB))),
              "ulimit -v", check=_one_error_says("ulimit -v")),
        Probe("ulimit -n 64: one line naming the open-file limit", 19, "error",
              _limited(["--train-iters", "2"], RLIMIT_NOFILE=(64, 64)), "ulimit -n",
              check=_one_error_says("ulimit -n")),
        Probe("open files run out past the start-up check (ulimit -n 90): one line", 19,
              "error", _limited(["--train-iters", "2"], RLIMIT_NOFILE=(90, 90)),
              "too many open files", check=_one_error_says("ulimit -n"), code=1),
        Probe("a soft ulimit -n 64 under a higher hard limit is raised: the run trains", 19,
              "ok", _limited(["--train-iters", "2"],
                             RLIMIT_NOFILE=(64, max(64, _hard_nofile()))),
              "iteration        2/"),
        Probe("the validation after training with large batches shows its progress", 19,
              "ok", lambda c: gpt1([*TINY, *big_eval], c.work, timeout=300),
              "Evaluating iter", check=_progress_then_loss, slow=True),
    ]


def all_probes() -> list:
    probes = class1() + class2() + class3() + class4() + class5() + class6() + class7() + \
        class8() + class9() + class10() + class11() + class12() + class13() + class14() + \
        class15() + class16() + class17() + class21() + class20() + class18() + class19()
    # the 'another pipeline layout' probe resumes a PP2 checkpoint in one process
    for p in probes:
        if p.name == "checkpoint of another pipeline layout":
            p.act = _layout_probe
    return probes


def _layout_probe(ctx: Ctx) -> Run:
    ctx.ckpt = copy_ckpt(ctx.shared.ckpt_2bw(), ctx.work)
    _mark(ctx)
    return gpt1([*TINY, "--train-iters", "3", "--load", ctx.ckpt, "--save", ctx.ckpt],
                ctx.work)


# ---------------------------------------------------------------------------- judging


def first_line(r: Run, match: str = "") -> str:
    lines = [ln.strip() for ln in r.out.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("error:") or " error: " in ln:
            return ln
    for ln in lines:
        if match and match in ln:
            return ln
    if r.timed_out:
        return "(timed out)"
    for ln in reversed(lines):
        if "arn" not in ln[:40] and not set(ln) <= set("-"):
            return ln
    return ""


def judge(p: Probe, r: Run, ctx: Ctx) -> tuple:
    tb = TB in r.out
    if r.timed_out:
        return "hang", "timed out"
    codes = r.codes
    if p.match and p.match not in r.out:
        missing = f"output lacks {p.match!r}"
    else:
        missing = ""
    if p.expect == "error":
        if all(c == 0 for c in codes):
            return "silent", "exit 0 where an error was due"
        if tb:
            return "traceback", "traceback shown"
        if p.quiet:
            return ("pass", "") if codes == [p.code] else ("wrong", f"exit {codes}")
        errs = [ln for ln in r.out.splitlines() if ln.startswith("error:") or
                re.search(r"\berror: ", ln)]
        if not errs and not all(c == p.code for c in codes if c is not None):
            return "wrong", f"exit {codes}, no error line"
        if not errs and p.code == 2 and codes[0] == 2:
            return "wrong", "exit 2 but no error line"
        if any(c not in (p.code, -9, 1, 2) for c in codes):
            return "wrong", f"exit {codes}"
        if missing:
            return "wrong", missing
        why = p.check(ctx, r) if p.check else ""  # what the refusal left (checkpoints)
        return ("wrong", why) if why else ("pass", "")
    if p.expect == "ok":
        if any(c != 0 for c in codes):
            return ("traceback" if tb else "wrong"), f"exit {codes}"
        if missing:
            return "silent", missing
        if p.check:
            why = p.check(ctx, r)
            if why:
                return "silent", why
        return "pass", ""
    # fault: every process ended (by the fault or by itself); the survivors said why
    if tb and p.match:
        return "traceback", "traceback shown"
    if missing:
        return "wrong", missing
    if p.check:
        why = p.check(ctx, r)
        if why:
            return "wrong", why
    return "pass", ""


def intact(ctx: Ctx) -> str:
    if not ctx.ckpt:
        return "-"
    after = sound_iterations(ctx.ckpt)
    return "yes" if after and ctx.before <= after else "no"


def _short_paths(line: str, work: str, shared: Shared) -> str:
    """The probe's own folder as PROBE/ and the shared inputs' as SHARED/: the table shows
    what the line says, not the temporary names."""
    return line.replace(work + "/", "PROBE/").replace(shared.root + "/", "SHARED/")


def run_probe(p: Probe, shared: Shared, tmp: str) -> dict:
    work = tempfile.mkdtemp(prefix="probe-", dir=tmp)
    ctx = Ctx(work, shared)
    start = time.monotonic()
    try:
        r = p.act(ctx)
        outcome, why = judge(p, r, ctx)
        row = dict(exit=",".join("-" if c is None else str(c) for c in r.codes),
                   first_line=_short_paths(first_line(r, p.match), work, shared)[:160],
                   traceback="yes" if TB in r.out else "no",
                   seconds=round(r.seconds, 1), data_intact=intact(ctx), outcome=outcome,
                   note=why)
    except Exception as exc:  # noqa: BLE001 - a broken probe is a row, not the end
        row = dict(exit="?", first_line=f"probe failed: {type(exc).__name__}: {exc}"[:160],
                   traceback="?", seconds=round(time.monotonic() - start, 1),
                   data_intact="?", outcome="probe-error", note=str(exc)[:300])
    finally:
        for undo in reversed(ctx.cleanups):
            try:
                undo()
            except Exception:  # noqa: BLE001 - cleaning up must not hide the row
                pass
    row.update(probe=p.name, klass=p.klass, klass_name=CLASSES[p.klass], expect=p.expect)
    shutil.rmtree(work, ignore_errors=True)
    return row


def to_markdown(rows: list) -> str:
    head = ("| # | probe | class | expect | exit | first line shown | traceback | s | "
            "data intact | outcome |\n|---|---|---|---|---|---|---|---|---|---|\n")
    body = ""
    for i, r in enumerate(rows, 1):
        line = r["first_line"].replace("|", "\\|")
        outcome = r["outcome"] + (f" ({r['note']})" if r["note"] else "")
        body += (f"| {i} | {r['probe']} | {r['klass']} | {r['expect']} | {r['exit']} | "
                 f"`{line}` | {r['traceback']} | {r['seconds']} | {r['data_intact']} | "
                 f"{outcome.replace('|', '/')} |\n")
    return head + body


def summary(rows: list) -> dict:
    out = {k: sum(r["outcome"] == k for r in rows)
           for k in ("pass", "traceback", "silent", "hang", "wrong", "probe-error")}
    out["probes"] = len(rows)
    out["data_not_intact"] = sum(r["data_intact"] == "no" for r in rows)
    out["per_class"] = {c: sum(r["klass"] == c for r in rows) for c in CLASSES}
    return out


def merged(path: str, rows: list, ran: set) -> tuple[list, dict]:
    """An earlier full run's rows (the JSON at `path`) with the classes in `ran` replaced
    by this run's `rows`, in the matrix's order, and the earlier counts' time and note."""
    with open(path) as f:
        earlier = json.load(f)
    order = {p.name: i for i, p in enumerate(all_probes())}
    kept = [r for r in earlier["rows"] if r["klass"] not in ran]
    both = sorted(kept + rows, key=lambda r: (r["klass"], order.get(r["probe"], len(order))))
    return both, earlier["counts"]


def write(args: argparse.Namespace, rows: list, start: float, complete: bool) -> dict:
    seconds = round(time.monotonic() - start, 1)
    if args.update:  # this run's classes replace those of an earlier full run
        ran = {r["klass"] for r in rows}
        rows, earlier = merged(args.update, rows, ran)
        only = " ".join(f"--only {c}" for c in sorted(ran))
        word = "class" if len(ran) == 1 else "classes"
        note = f"{word} {', '.join(map(str, sorted(ran)))} from {only} ({seconds} s)"
        if earlier.get("note") and f"--only {min(ran)} " not in earlier["note"] + " ":
            note = f"{earlier['note']}; {note}"  # earlier partial reruns stay named
        seconds = earlier["seconds"]
    counts = summary(rows)
    counts["seconds"] = seconds
    counts["complete"] = complete
    if args.update:
        counts["note"] = note
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(to_markdown(rows))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"counts": counts, "rows": rows}, f, indent=1)
    return counts


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", type=int, action="append", choices=sorted(CLASSES),
                    help="run only this class (repeatable)")
    ap.add_argument("--probe", action="append", help="run only probes whose name contains this")
    ap.add_argument("--json", help="write the rows and the counts here")
    ap.add_argument("--markdown", help="write the table here")
    ap.add_argument("--jobs", type=int, default=1, choices=[1], help="probes run one at a time")
    ap.add_argument("--list", action="store_true", help="list the probes and exit")
    ap.add_argument("--update", metavar="JSON",
                    help="an earlier full run's JSON: the classes run now replace its rows of "
                         "those classes, and --json / --markdown get the whole matrix")
    args = ap.parse_args(argv)
    probes = [p for p in all_probes() if (not args.only or p.klass in args.only)
              and (not args.probe or any(s in p.name for s in args.probe))]
    if args.list:
        for p in probes:
            print(f"{p.klass} {p.expect:5} {p.name}")
        return 0
    tmp = tempfile.mkdtemp(prefix="fault-matrix-")
    shared = Shared(os.path.join(tmp, "shared"))

    def interrupted(signum: int, frame) -> None:
        raise KeyboardInterrupt  # the probe's cleanups (unmount, kill) and rmtree still run
    signal.signal(signal.SIGTERM, interrupted)
    rows, start = [], time.monotonic()
    try:
        for i, p in enumerate(probes, 1):
            row = run_probe(p, shared, tmp)
            rows.append(row)
            elapsed = time.monotonic() - start
            eta = elapsed / i * (len(probes) - i)
            print(f"[{i}/{len(probes)}] {row['outcome']:9} {row['seconds']:6.1f}s "
                  f"class {p.klass} {p.name}: {row['first_line'][:90]}  (ETA {eta:.0f} s)",
                  flush=True)
            write(args, rows, start, complete=i == len(probes))  # a partial table survives
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    counts = write(args, rows, start, complete=len(rows) == len(probes))
    print(json.dumps(counts))
    bad = counts["traceback"] + counts["silent"] + counts["hang"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
