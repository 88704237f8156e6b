"""Runnable launches of a plan: one torchrun line, a script for every node, an sbatch job.

The planner's `command` (report.py) holds the plan's flags only; a run also needs data, a
learning rate and a length, and a multi-node run needs a rendezvous every node can reach.
`python -m megatron_2bw.planner ... --emit FORM` adds those (docs/launch.md):

- `command`: one line. One node: `torchrun --standalone`; several: the same line on every
  node, with a c10d rendezvous at `--master-addr`.
- `torchrun`: a bash script to run on every node of a cluster without a scheduler.
- `sbatch`: a Slurm batch script: one srun task per node, each a torchrun agent.

Every form uses torchrun's c10d rendezvous, not its static one (`--node-rank`,
`--master-addr`): nodes get their ranks as they join, so every node runs the same line and
nobody hands out node ranks. The host at the endpoint serves the rendezvous. Any assignment
of whole nodes to consecutive ranks gives the planner's placement (servers are alike).

Pure Python, no torch, like the rest of the planner: the emitted flags are checked against
the trainer's parser by tests/test_planner_emit.py, not here.
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from .hardware import LaunchEnv

FORMS = ("command", "torchrun", "sbatch")
DEFAULT_PORT = 29500  # torchrun's default rendezvous port
SIGNAL_LEAD_S = 120   # sbatch --signal=TERM@120: time to finish a minibatch and save
REPO_ROOT = Path(__file__).resolve().parents[2]


class LaunchError(ValueError):
    """Input no runnable launch can be made from; the message names the flag and a fix."""


def float_text(text: str) -> str:
    """An argparse type: a number, passed on as the user wrote it (1.5e-4, not 0.00015)."""
    try:
        float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    return text


def _absolute(value: str, mode: str = "always") -> str:
    """`value` made absolute against the planner's working directory; a blend weight (a
    number) stays, and with mode "existing" so does what is no file here (a hub name)."""
    try:
        float(value)
        return value
    except ValueError:
        pass
    if mode == "existing" and not os.path.exists(value):
        return value
    return os.path.abspath(value)


def count(text: str) -> int:
    """An argparse type: a whole number, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


class Shell(str):
    """A word that is already shell text (it expands a variable): written unquoted."""


def _quote(word: str) -> str:
    return word if isinstance(word, Shell) else shlex.quote(word)


@dataclass(frozen=True)
class TrainerFlag:
    """A flag of pretrain_{gpt,bert}.py that the planner takes and passes on unchanged,
    so one planner command line says everything the job needs."""

    flag: str
    group: str
    """The bash array of the emitted scripts that holds it."""
    help: str
    type: Callable[[str], object] = str
    nargs: Optional[str] = None
    switch: bool = False
    choices: Optional[tuple[str, ...]] = None
    path: str = ""
    """"always" or "existing" (a tokenizer can also be a hub name): made absolute, as the
    scripts cd to --workdir and every node must find the same file."""

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    def words(self, value: object) -> list[str]:
        """The flag and its value(s) as the trainer spells them; none when not given."""
        if value is None or value is False:
            return []
        if self.switch:
            return [self.flag]
        values = [str(v) for v in (value if isinstance(value, list) else [value])]
        return [self.flag] + ([_absolute(v, self.path) for v in values] if self.path else values)


TRAINER_FLAGS: tuple[TrainerFlag, ...] = (
    TrainerFlag("--data-path", "DATA_ARGS", "[WEIGHT] PREFIX ... from tools/preprocess_data.py "
                "(on storage every node reads)", nargs="+", path="always"),
    TrainerFlag("--mock-data", "DATA_ARGS", "synthetic data instead of --data-path", switch=True),
    TrainerFlag("--split", "DATA_ARGS", "train,valid,test proportions (trainer default 969,30,1)"),
    TrainerFlag("--tokenizer-type", "DATA_ARGS", "the trainer's default: GPT2BPETokenizer (GPT), "
                "BertWordPieceLowerCase (BERT)"),
    TrainerFlag("--vocab-file", "DATA_ARGS", "GPT-2 vocab.json or BERT vocab.txt", path="always"),
    TrainerFlag("--merge-file", "DATA_ARGS", "GPT-2 merges.txt", path="always"),
    TrainerFlag("--tokenizer-model", "DATA_ARGS", "SentencePiece .model or HuggingFace tokenizer",
                path="existing"),
    TrainerFlag("--data-cache-path", "DATA_ARGS", "where dataset index caches go", path="always"),
    TrainerFlag("--train-iters", "TRAINING_ARGS", "optimizer steps (or --train-samples)", count),
    TrainerFlag("--train-samples", "TRAINING_ARGS", "samples to train on", count),
    TrainerFlag("--lr", "TRAINING_ARGS", "peak learning rate (required with --emit)", float_text),
    TrainerFlag("--min-lr", "TRAINING_ARGS", "final learning rate", float_text),
    TrainerFlag("--lr-decay-style", "TRAINING_ARGS", "decay after warm-up", str,
                choices=("constant", "linear", "cosine")),
    TrainerFlag("--lr-decay-iters", "TRAINING_ARGS", "decay length (default --train-iters)",
                count),
    TrainerFlag("--lr-decay-samples", "TRAINING_ARGS", "decay length in samples", count),
    TrainerFlag("--lr-warmup-iters", "TRAINING_ARGS", "warm-up iterations", count),
    TrainerFlag("--lr-warmup-samples", "TRAINING_ARGS", "warm-up samples", count),
    TrainerFlag("--lr-warmup-fraction", "TRAINING_ARGS", "warm-up as a fraction of the decay",
                float_text),
    TrainerFlag("--weight-decay", "TRAINING_ARGS", "AdamW weight decay", float_text),
    TrainerFlag("--clip-grad", "TRAINING_ARGS", "global-norm clip", float_text),
    TrainerFlag("--seed", "TRAINING_ARGS", "random seed", count),
    TrainerFlag("--moe-router-load-balancing-type", "TRAINING_ARGS", "with --num-experts: the "
                "router's balancing (aux_loss as Megatron-LM's Mixtral example; the trainer's "
                "default)", str, choices=("aux_loss", "seq_aux_loss", "sinkhorn", "none")),
    TrainerFlag("--moe-aux-loss-coeff", "TRAINING_ARGS", "with --num-experts: weight of the "
                "load-balancing loss (the trainer's default 0 adds none; the Mixtral "
                "example gives 1e-2)", float_text),
    TrainerFlag("--moe-z-loss-coeff", "TRAINING_ARGS", "with --num-experts: weight of the "
                "router z-loss", float_text),
    TrainerFlag("--moe-router-score-function", "TRAINING_ARGS", "with --num-experts: the "
                "router's scores (the trainer's default softmax; sigmoid as DeepSeek-V3)", str,
                choices=("softmax", "sigmoid")),
    TrainerFlag("--moe-router-pre-softmax", "TRAINING_ARGS", "with --num-experts: softmax "
                "over all experts before the top-k choice", switch=True),
    TrainerFlag("--moe-router-topk-scaling-factor", "TRAINING_ARGS", "with --num-experts: "
                "factor on the chosen experts' probabilities", float_text),
    TrainerFlag("--moe-router-num-groups", "TRAINING_ARGS", "with --num-experts: group-limited "
                "routing, the experts in this many equal groups", count),
    TrainerFlag("--moe-router-group-topk", "TRAINING_ARGS", "with --moe-router-num-groups: "
                "each token's experts from this many groups", count),
    TrainerFlag("--moe-router-enable-expert-bias", "TRAINING_ARGS", "with --num-experts and "
                "sigmoid scores: aux-loss-free balancing",
                switch=True),
    TrainerFlag("--moe-router-bias-update-rate", "TRAINING_ARGS", "with "
                "--moe-router-enable-expert-bias: how far each step moves the bias",
                float_text),
    TrainerFlag("--save", "CHECKPOINT_ARGS", "checkpoint directory on a file system every node "
                "sees (required for sbatch)", path="always"),
    TrainerFlag("--load", "CHECKPOINT_ARGS", "resume from here (default: --save)", path="always"),
    TrainerFlag("--save-interval", "CHECKPOINT_ARGS", "iterations between checkpoints", count),
    TrainerFlag("--distributed-timeout-minutes", "CHECKPOINT_ARGS", "how long a rank waits for "
                "another before the job ends (docs/launch.md)", count),
    TrainerFlag("--eval-interval", "LOGGING_ARGS", "iterations between validation runs", count),
    TrainerFlag("--eval-iters", "LOGGING_ARGS", "validation iterations per run", count),
    TrainerFlag("--log-interval", "LOGGING_ARGS", "iterations between log lines", count),
    TrainerFlag("--tensorboard-dir", "LOGGING_ARGS", "TensorBoard scalars", path="always"),
)
GROUPS = ("DATA_ARGS", "TRAINING_ARGS", "CHECKPOINT_ARGS", "LOGGING_ARGS")
LAUNCH_ONLY = ("--output", "--master-addr", "--master-port", "--time", "--partition", "--bf16",
               "--env-file")
"""Flags without a default that only the emitted launch reads."""


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """The --emit flags and the trainer flags it passes on (docs/launch.md)."""
    g = parser.add_argument_group(
        "launch (--emit): a runnable launch of the best plan; pretrain flags the planner does "
        "not know go after `--`")
    g.add_argument("--emit", choices=FORMS, help="command: one torchrun line; torchrun: a "
                   "script for every node; sbatch: a Slurm batch script")
    g.add_argument("--output", metavar="FILE", help="write the launch here (default: stdout, "
                   "and the table is not printed)")
    g.add_argument("--master-addr", help="address of the node that hosts the rendezvous "
                   "(required by a multi-node `command`; a default for `torchrun`)")
    g.add_argument("--master-port", type=int, help=f"rendezvous port (default {DEFAULT_PORT}; "
                   "sbatch: 10000 + job id %% 20000, as examples/slurm)")
    g.add_argument("--job-name", default="megatron-2bw", help="sbatch job name; rendezvous id")
    g.add_argument("--time", help="sbatch time limit (default: the predicted run time x 1.25 "
                   "+ 15 minutes)")
    g.add_argument("--partition", help="sbatch partition (default: the cluster's)")
    g.add_argument("--workdir", default=str(REPO_ROOT), help="the scripts cd here, where "
                   "pretrain_gpt.py is, on every node (default: this checkout)")
    g.add_argument("--env-file", help="the scripts source this file (e.g. examples/aws/efa.env) "
                   "instead of writing the hardware preset's network variables")
    g.add_argument("--bf16", action="store_true", help="bf16 instead of the fp16 the plan "
                   "assumes (same bytes)")
    for f in TRAINER_FLAGS:
        if f.switch:
            g.add_argument(f.flag, action="store_true", help=f.help)
        else:
            g.add_argument(f.flag, type=f.type, nargs=f.nargs, choices=f.choices, help=f.help)


@dataclass(frozen=True)
class Nodes:
    """Servers and processes per server of a plan (tensor-parallel groups stay inside one)."""

    count: int
    per_node: int


def nodes_for(num_devices: int, devices_per_node: int) -> Nodes:
    """Full servers, or one server partly used when the plan needs fewer devices."""
    per_node = min(devices_per_node, num_devices)
    return Nodes(-(-num_devices // per_node), per_node)


def check_launch_args(args: argparse.Namespace, nodes: Nodes) -> None:
    """Refuse, before the search, what would give a launch that cannot run: LaunchError
    naming the flag and what would work."""
    if not args.emit:
        given = [f.flag for f in TRAINER_FLAGS if getattr(args, f.dest) not in (None, False)]
        given += [flag for flag in LAUNCH_ONLY if getattr(args, flag[2:].replace("-", "_"))]
        if given:
            raise LaunchError(f"{given[0]} is for the emitted launch: add --emit "
                              f"{{{','.join(FORMS)}}}")
        return
    for problem in _problems(args, nodes):
        raise LaunchError(problem)


def _problems(args: argparse.Namespace, nodes: Nodes) -> Iterator[str]:
    """Each reason the emitted launch would not run, as `flag: what; fix`."""
    if (args.train_iters is None) == (args.train_samples is None) \
            or 0 in (args.train_iters, args.train_samples):
        yield "--train-iters/--train-samples: give one training length (1 or more)"
    if args.lr is None:
        yield "--lr: the emitted launch needs a peak learning rate, e.g. --lr 1.5e-4"
    if bool(args.data_path) == bool(args.mock_data):
        yield ("--data-path: give the training data (PREFIX from tools/preprocess_data.py), "
               "or --mock-data for synthetic data, not both")
    if args.data_path and not (args.vocab_file or args.tokenizer_model
                               or args.tokenizer_type == "NullTokenizer"):
        yield ("--vocab-file: the tokenizer of --data-path needs its files: --vocab-file (and "
               "--merge-file for GPT-2 BPE) or --tokenizer-model")
    if args.emit == "command" and nodes.count > 1 and not args.master_addr:
        yield (f"--master-addr: the plan spans {nodes.count} nodes; give the address of one of "
               "them (it hosts the rendezvous), or use --emit torchrun or --emit sbatch")
    if args.emit == "sbatch" and not args.save:
        yield ("--save: an sbatch job saves when Slurm signals its time limit and resumes "
               "from there; give a checkpoint directory on shared storage")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        yield f"--master-port {args.master_port}: give a TCP port, 1-65535"
    yield from _router_problems(args)


def _router_problems(args: argparse.Namespace) -> Iterator[str]:
    """The router flags the trainer would refuse (megatron-core's rules), before the
    search rather than at the job's start."""
    for flag in ("--moe-router-num-groups", "--moe-router-group-topk"):
        if getattr(args, flag[2:].replace("-", "_")) == 0:
            yield f"{flag} 0: give 1 or more, or leave it out"
    if args.moe_router_group_topk and not args.moe_router_num_groups:
        yield "--moe-router-group-topk: group-limited routing needs --moe-router-num-groups"
    if args.moe_router_num_groups and (args.num_experts or 0) % args.moe_router_num_groups:
        yield (f"--moe-router-num-groups {args.moe_router_num_groups}: give a divisor of "
               f"--num-experts {args.num_experts}")
    if args.moe_router_bias_update_rate is not None and not args.moe_router_enable_expert_bias:
        yield "--moe-router-bias-update-rate: add --moe-router-enable-expert-bias"
    if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
        yield ("--moe-router-enable-expert-bias: the expert bias needs "
               "--moe-router-score-function sigmoid")


@dataclass(frozen=True)
class Job:
    """Everything an emitted launch says: the trainer's argv by group, where it runs, how."""

    entry_point: str
    groups: tuple[tuple[str, tuple[str, ...]], ...]
    nodes: Nodes
    env: LaunchEnv
    name: str
    master_addr: Optional[str]
    master_port: Optional[int]
    """None: DEFAULT_PORT, or in an sbatch job one derived from the job id."""
    time: str
    partition: Optional[str]
    workdir: str
    env_file: Optional[str]
    """Sourced by the scripts in place of `env` (absolute)."""
    summary: tuple[str, ...]
    """Comment lines: the plan and its predictions, the planner command that wrote it."""

    def argv(self) -> list[str]:
        return [w for _, words in self.groups for w in words]


def trainer_groups(plan_groups: Sequence[tuple[str, list[str]]], args: argparse.Namespace,
                   extra: Sequence[str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The plan's flags, then the passed-on trainer flags by group, then what came after
    `--`. With --save, --load defaults to it and --exit-signal-handler is added: a SIGTERM
    (Slurm's time limit, a preemption) then saves before the job ends."""
    passed: dict[str, list[str]] = {g: [] for g in GROUPS}
    for f in TRAINER_FLAGS:
        passed[f.group] += f.words(getattr(args, f.dest))
        if f.flag == "--save" and args.save and not args.load:
            passed[f.group] += ["--load", _absolute(args.save)]
    if args.save:
        passed["CHECKPOINT_ARGS"].append("--exit-signal-handler")
    out = [(name, tuple(words)) for name, words in plan_groups]
    out += [(g, tuple(passed[g])) for g in GROUPS if passed[g]]
    return tuple(out + ([("EXTRA_ARGS", tuple(extra))] if extra else []))


def slurm_time(seconds: float) -> str:
    """Slurm's [D-]HH:MM:SS, rounded up to the minute."""
    minutes = max(1, math.ceil(seconds / 60))
    days, rest = divmod(minutes, 24 * 60)
    clock = f"{rest // 60:02d}:{rest % 60:02d}:00"
    return f"{days}-{clock}" if days else clock


def default_time(iteration_s: float, iterations: int) -> str:
    """The predicted run time with room for start-up and a misprediction; a job that hits it
    saves and resumes (--exit-signal-handler, --load)."""
    return slurm_time(1.25 * iteration_s * iterations + 900)


# ---------------------------------------------------------------- the three forms

def emit(form: str, job: Job) -> str:
    """The launch of `job` in `form` (one of FORMS)."""
    writers = {"command": command_line, "torchrun": torchrun_script, "sbatch": sbatch_script}
    return writers[form](job)


def rendezvous_words(nodes: Nodes, endpoint: Optional[str], rdzv_id: str) -> list[str]:
    """torchrun's flags: --standalone on one node without an endpoint (a free local port),
    else c10d at `endpoint`."""
    per_node = ["--nproc-per-node", str(nodes.per_node)]
    if nodes.count == 1 and endpoint is None:
        return ["--standalone"] + per_node
    return (["--nnodes", str(nodes.count)] + per_node
            + ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id])


def command_line(job: Job) -> str:
    """One line, run from the repository root (on every node when there are several)."""
    multi = job.nodes.count > 1
    endpoint = f"{job.master_addr}:{job.master_port or DEFAULT_PORT}" if multi else None
    env = [f"{k}={shlex.quote(v)}" for k, v in job.env.env] if multi else []
    if job.env_file:
        env = ["source", shlex.quote(job.env_file), "&&"]
    words = ["torchrun"] + rendezvous_words(job.nodes, endpoint, job.name) + [job.entry_point]
    return " ".join(env + [_quote(w) for w in words + job.argv()]) + "\n"


def _array(name: str, words: Sequence[str]) -> str:
    """`NAME=(` one flag and its values a line `)`, as the examples/ scripts write them."""
    lines: list[list[str]] = []
    for w in words:
        if w.startswith("--") or not lines:
            lines.append([w])
        else:
            lines[-1].append(w)
    return f"{name}=(\n" + "".join(f"    {' '.join(map(_quote, line))}\n" for line in lines) + ")"


def _env_block(job: Job) -> list[str]:
    """The network environment: --env-file sourced, or the hardware preset's variables."""
    if job.env_file:
        return ["# the cluster's network environment (exported by the file)",
                f"source {shlex.quote(job.env_file)}", ""]
    if not job.env.env:
        return []
    sources = [f"#   {url}" for url in job.env.source.split("; ")]
    return (["# the cluster's network environment; sources:"] + sources
            + [f"export {k}={shlex.quote(v)}" for k, v in job.env.env] + [""])


def _header(job: Job, lines: Sequence[str]) -> list[str]:
    """The shebang, then the summary and `lines` as comments wrapped at 96 columns."""
    wrapped = [textwrap.wrap(s, 94, subsequent_indent="    ", break_long_words=False,
                             break_on_hyphens=False) for s in list(job.summary) + list(lines)]
    return ["#!/bin/bash"] + [f"# {row}" for rows in wrapped for row in rows]


def _run_line(prefix: str, job: Job) -> str:
    """`prefix "$PY" -m torch.distributed.run "${LAUNCH_ARGS[@]}" ENTRY "${GROUP[@]}" ...`
    over several lines (torchrun of the Python that runs the training, not of PATH)."""
    arrays = [f'"${{{name}[@]}}"' for name, _ in job.groups]
    rows = [f'{prefix}"$PY" -m torch.distributed.run "${{LAUNCH_ARGS[@]}}" {job.entry_point}']
    rows += ["    " + " ".join(arrays[i:i + 3]) for i in range(0, len(arrays), 3)]
    return " \\\n".join(rows)


def _body(job: Job, launch: Sequence[str], prefix: str,
          before_run: Sequence[str] = ()) -> list[str]:
    """cd to the checkout, the arrays, `before_run`, the launch."""
    missing = (f'[ -f {job.entry_point} ] || {{ echo "error: no {job.entry_point} in $PWD: emit '
               'again with --workdir set to the checkout every node sees" >&2; exit 2; }')
    return ([f"cd {shlex.quote(job.workdir)}", missing, "", _array("LAUNCH_ARGS", launch)]
            + [_array(name, words) for name, words in job.groups]
            + [""] + list(before_run) + [_run_line(prefix, job), ""])


def _master_addr(job: Job) -> str:
    """The rendezvous host: the environment's, else --master-addr, else (one node) this
    machine; several nodes and no --master-addr: the script stops, saying what to set."""
    if job.master_addr:
        return f"MASTER_ADDR=${{MASTER_ADDR:-{shlex.quote(job.master_addr)}}}"
    if job.nodes.count == 1:
        return "MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}"
    return (f"MASTER_ADDR=${{MASTER_ADDR:?set MASTER_ADDR to the address of one of the "
            f"{job.nodes.count} nodes, the same on every node}}")


def torchrun_script(job: Job) -> str:
    """A script for plain servers (no scheduler): the same command on every node. Here a
    SIGTERM reaches only torchrun (a `kill`, a spot-interruption handler), which passes it
    to its workers, so torchrun keeps handling it (no ignore-trap as in sbatch) and waits
    SIGNAL_LEAD_S for them to save before it kills them (its default is 30 s)."""
    launch = rendezvous_words(job.nodes, Shell('"$MASTER_ADDR:$MASTER_PORT"'),
                              Shell('"$RDZV_ID"')) + ["--shutdown-timeout", str(SIGNAL_LEAD_S)]
    usage = [f"Run it on each of the {job.nodes.count} node(s), all at once: `bash THIS_FILE` "
             "(the same on every node; torchrun's c10d rendezvous gives each node its rank "
             "as it joins, and the node at MASTER_ADDR hosts it). Override MASTER_ADDR, "
             "MASTER_PORT, RDZV_ID or PYTHON in the environment."]
    settings = ["set -euo pipefail", "", _master_addr(job),
                f"MASTER_PORT=${{MASTER_PORT:-{job.master_port or DEFAULT_PORT}}}",
                f"RDZV_ID=${{RDZV_ID:-{shlex.quote(job.name)}}}", "PY=${PYTHON:-python}", ""]
    return "\n".join(_header(job, usage) + settings + _env_block(job)
                     + _body(job, launch, "exec "))


def _sbatch_directives(job: Job) -> list[str]:
    d = [f"--job-name={job.name}", f"--nodes={job.nodes.count}", "--ntasks-per-node=1"]
    if job.env.gpus:
        d.append(f"--gpus-per-node={job.nodes.per_node}")
    d += ["--exclusive", f"--time={job.time}", f"--signal=TERM@{SIGNAL_LEAD_S}", "--requeue",
          "--output=%x-%j.out", "--open-mode=append"]  # a requeued run appends to the log
    if job.partition:
        d.append(f"--partition={job.partition}")
    return [f"#SBATCH {x}" for x in d]


# No `| head -n 1`: under `set -o pipefail` a head that exits early ends scontrol with
# SIGPIPE (status 141) and `set -e` the job; sed reads to the end.
MASTER_FROM_SLURM = [
    "# the rendezvous: the first node of the allocation hosts it, at its Slurm NodeAddr",
    'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
    'MASTER_ADDR=$(scontrol show node "$HEAD_NODE" | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\')',
    'MASTER_ADDR=${MASTER_ADDR:-$HEAD_NODE}',
]

# SIGTERM in a Slurm job, as examples/slurm/pretrain_gpt_2bw.sbatch launches (keep the two
# alike): torchrun ignores it (a trap kept through exec, and --signals-to-handle without
# SIGTERM), the workers inherit the ignore until the training's handler is in, and that
# handler saves and exits 0.
IGNORE_TERM = [
    "# SIGTERM (the time limit's --signal, a preemption, scancel) reaches every process of the",
    "# step, node by node: torchrun too, and ranks that already saved and are on their way out.",
    "# Those ignore it (a trap kept through exec; torchrun is told not to handle it, as its own",
    "# answer would be to stop its workers and exit 1). The training's handler",
    "# (--exit-signal-handler) notes it while training, saves at the next segment end and",
    "# exits 0, and torchrun with it.",
    """IGNORE_TERM=(bash -c 'trap "" TERM; exec "$@"' ignore-term)""",
]


FREE_PORT = '$("$PY" -c \'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])\')'


def sbatch_script(job: Job) -> str:
    """A Slurm batch script: one task per node, each a torchrun agent for its GPUs."""
    usage = ["Submit: sbatch THIS_FILE. Near the time limit Slurm sends SIGTERM; the job saves "
             "to --save and ends; submitting it again (or a requeue) resumes from --load."]
    launch = ["--nnodes", Shell('"$SLURM_NNODES"'), "--nproc-per-node", str(job.nodes.per_node),
              "--rdzv-backend", "c10d", "--rdzv-endpoint", Shell('"$MASTER_ADDR:$MASTER_PORT"'),
              "--rdzv-id", Shell('"$SLURM_JOB_ID"'), "--signals-to-handle",
              "SIGINT,SIGHUP,SIGQUIT", "--shutdown-timeout", str(SIGNAL_LEAD_S)]
    # a port free on the first node, where the batch script runs and the rendezvous is
    n, port = job.nodes.count, job.master_port or FREE_PORT
    guard = [f'if [ "$SLURM_NNODES" -ne {n} ]; then',
             f'    echo "error: the plan is for {n} node(s), this job has $SLURM_NNODES: submit '
             'it without --nodes, or plan again" >&2',
             "    exit 2", "fi", ""]
    lines = (_header(job, usage) + _sbatch_directives(job)
             + ["set -euo pipefail", ""] + guard + MASTER_FROM_SLURM
             + ["PY=${PYTHON:-python}", f"MASTER_PORT=${{MASTER_PORT:-{port}}}", ""])
    srun = ('srun --nodes "$SLURM_NNODES" --ntasks-per-node 1 --kill-on-bad-exit=1 '
            '"${IGNORE_TERM[@]}" ')
    return "\n".join(lines + _env_block(job) + _body(job, launch, srun, IGNORE_TERM))
