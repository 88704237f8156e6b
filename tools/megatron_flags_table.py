"""Which of Megatron-LM's flags pretrain_gpt.py / pretrain_bert.py honor, map or refuse.

    python tools/megatron_flags_table.py --megatron-lm PATH [--markdown docs/megatron-flags.md]
        [--names megatron_2bw/training/megatron_lm_names.py]

PATH is a clone of Megatron-LM (a bare one too); nothing is fetched. The tool reads, with
`git show`, Megatron-LM's example scripts at `--examples-rev` (core_v0.16.1) and its recipes
for Llama, GPT-OSS, DeepSeek-V3 and Qwen3-MoE at `--recipes-rev` (HEAD of PATH unless
given), and Megatron-LM's own flag names at both revisions (`megatron/training/arguments.py`:
its `add_argument` names and the flags its ArgumentGroupFactory makes of config dataclass
fields). From a directory that is not a git repository it reads the files as they are.

Each script's command line (the flags of its `*_ARGS` arrays and strings, every branch of
the script, its variables resolved as the script sets them; a value the script leaves to
its caller, such as `$1`, reads as 1) goes through the trainer's own reader
(`read_command_line`, as `pretrain_gpt.py` reads it) and `refusals`, so the counts are what
the trainer says of that script. Beside the scripts, the table lists commonly used flags
and every mixture-of-experts flag of Megatron-LM (their own sources below). Statuses:

- honored: parsed and used with Megatron-LM's meaning;
- honored (no-op): Megatron-LM's meaning is what happens here anyway;
- mapped: selects a kernel or an overlap; megatron-core's local implementation runs;
- refused where it changes something: accepted where it changes nothing (as Megatron-LM
  itself does), else named in the one error with the reason;
- removed: Megatron-LM's own removed spelling, answered with its replacement;
- unknown: not a flag here; the trainer names it (Megatron-LM's, or a close match).

`--names` writes Megatron-LM's flag names (both revisions) as the module the trainer reads to
tell a Megatron-LM flag it does not implement from a typo.
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.training import megatron_flags as M  # noqa: E402
from megatron_2bw.training.arguments import build_parser, read_command_line  # noqa: E402

EXAMPLES_REV = "core_v0.16.1"
# (label, path, model): Megatron-LM's example scripts at EXAMPLES_REV
EXAMPLES = (
    ("GPT-3 175B", "examples/gpt3/train_gpt3_175b_distributed.sh", "gpt"),
    ("BERT 340M", "examples/bert/train_bert_340m_distributed.sh", "bert"),
    ("Llama-3 8B fp8", "examples/llama/train_llama3_8b_h100_fp8.sh", "gpt"),
    ("Mixtral 8x7B", "examples/mixtral/train_mixtral_8x7b_distributed.sh", "gpt"),
)
# its recipes at the recipes revision (main): a training script for each, or the model
# definition of its post-training configurations where it has no training script
RECIPES = (
    ("Llama-3 8B fp8 (main)", "examples/llama/train_llama3_8b_h100_fp8.sh", "gpt"),
    ("GPT-OSS", "examples/gptoss/02_train.sh", "gpt"),
    ("DeepSeek-V3", "examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh", "gpt"),
    ("Qwen3-30B-A3B (MoE)", "examples/post_training/modelopt/conf/Qwen/Qwen3-30B-A3B.sh", "gpt"),
)

COMMON = """--use-flash-attn --no-masked-softmax-fusion --recompute-activations
--recompute-granularity --recompute-method --recompute-num-layers --normalization --cp-comm-type
--lr-warmup-iters --timing-log-level --wandb-project --checkpoint-activations
--transformer-impl --qk-layernorm --decoder-first-pipeline-num-layers
--decoder-last-pipeline-num-layers --seed --adam-eps --loss-scale --initial-loss-scale
--min-loss-scale --loss-scale-window --hysteresis --make-vocab-size-divisible-by
--exit-interval --exit-signal-handler --optimizer --num-layers-per-virtual-pipeline-stage
--override-opt_param-scheduler --use-checkpoint-opt_param-scheduler --ffn-hidden-size"""
# every mixture-of-experts flag of Megatron-LM core_v0.16.1 the scripts above may not carry
MOE = """--expert-tensor-parallel-size --moe-ffn-hidden-size --moe-router-dtype
--moe-layer-freq --moe-z-loss-coeff --moe-router-score-function --moe-router-enable-expert-bias
--moe-router-bias-update-rate --moe-router-num-groups --moe-router-group-topk
--moe-router-pre-softmax --moe-router-topk-scaling-factor --moe-shared-expert-intermediate-size
--moe-shared-expert-overlap --moe-shared-expert-gate --moe-token-drop-policy
--moe-layer-recompute --mtp-num-layers --mtp-loss-scaling-factor --moe-permute-fusion
--moe-router-fusion --overlap-moe-expert-parallel-comm --moe-apply-probs-on-input
--moe-enable-deepep --moe-flex-dispatcher-backend --moe-pad-experts-for-cuda-graph-inference
--moe-expert-capacity-factor --moe-pad-expert-input-to-capacity
--moe-use-legacy-grouped-gemm --moe-extended-tp --moe-input-jitter-eps --moe-per-layer-logging
--moe-router-force-load-balancing --moe-router-padding-for-quantization
--moe-router-padding-for-fp8 --moe-latent-size --moe-use-upcycling --moe-upcycling-granularity
--moe-enable-routing-replay --moe-deepep-num-sms --moe-hybridep-num-sms --mtp-standalone"""
# Megatron-LM's kernel switches (its defaults: the fusions on, cross-entropy fusion off)
KERNELS = """--no-bias-gelu-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion
--no-masked-softmax-fusion --cross-entropy-loss-fusion"""
# GPT data flags that go with --calculate-per-token-loss in Megatron-LM's users' scripts
DATA = """--eod-mask-loss --reset-position-ids --reset-attention-mask"""
# flags about a run that stopped learning (the NaN/inf check, resuming a chosen checkpoint)
NAN = """--no-check-for-nan-in-loss-and-grad --ckpt-step --exit-on-missing-checkpoint"""
LISTS = {"common": COMMON, "GPT data": DATA, "kernels": KERNELS, "run health": NAN,
         "MoE": MOE}
# what an honored flag's row adds (where this project's meaning has a part of its own)
NOTES = {"--no-check-for-nan-in-loss-and-grad":
         "the check is on by default and ends the run at the first NaN/inf (one error line, "
         "a checkpoint with --save); off under fp16's dynamic loss scaling, as Megatron-LM; "
         "this project's --max-consecutive-skipped-iterations (default 10) bounds skipped "
         "iterations then (docs/training.md)",
         "--dist-ckpt-strictness":
         "torch_dist loads; by default (and with raise_all) every tensor the checkpoint and "
         "the model do not share is refused, naming it; Megatron-LM's other values pass over "
         "the checkpoint's extra tensors (log_all names them); loading past a tensor the "
         "checkpoint lacks (log_*, ignore_all) is refused as not implemented, return_* as "
         "values for megatron-core's Python API (docs/checkpoints.md)",
         "--logging-level":
         "the level of megatron-core's and torch's Python loggers on every rank; the "
         "trainer's own lines stay, as Megatron-LM's printed lines do"}


# ------------------------------------------------------------------ reading a checkout

class Checkout:
    """A Megatron-LM clone (a work tree or a bare repository) read at a revision, or a
    plain directory read as it is (the revision is then ignored)."""

    def __init__(self, path: str):
        self.path = path
        self.git = subprocess.run(["git", "-C", path, "rev-parse", "--git-dir"],
                                  capture_output=True).returncode == 0

    def commit(self, rev: str) -> str:
        """The full commit a revision names (the revision itself outside git)."""
        if not self.git:
            return rev
        return self._git("rev-parse", f"{rev}^{{commit}}").strip()

    def read(self, rev: str, path: str, missing_ok: bool = False) -> str:
        """The file's text at `rev` ("" for a missing one where `missing_ok`)."""
        if not self.git:
            full = os.path.join(self.path, path)
            if missing_ok and not os.path.exists(full):
                return ""
            with open(full) as f:
                return f.read()
        if missing_ok and subprocess.run(["git", "-C", self.path, "cat-file", "-e",
                                          f"{rev}:{path}"], capture_output=True).returncode:
            return ""
        return self._git("show", f"{rev}:{path}")

    def class_file(self, rev: str, name: str) -> Optional[str]:
        """The file under megatron/ that defines class `name`, or None."""
        pattern = rf"^class {name}\b"
        if self.git:
            out = subprocess.run(["git", "-C", self.path, "grep", "-l", "-E", pattern, rev,
                                  "--", "megatron"], capture_output=True, text=True).stdout
            files = [line.split(":", 1)[1] for line in out.splitlines() if ":" in line]
        else:
            files = []
            for root, _, names in os.walk(os.path.join(self.path, "megatron")):
                for n in names:
                    full = os.path.join(root, n)
                    if n.endswith(".py") and re.search(pattern, open(full).read(), re.M):
                        files.append(os.path.relpath(full, self.path))
        return files[0] if files else None

    def _git(self, *args: str) -> str:
        proc = subprocess.run(["git", "-C", self.path, *args], capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"error: git {' '.join(args)} in {self.path}: "
                             f"{proc.stderr.strip()}")
        return proc.stdout


# ------------------------------------------------------------------ Megatron-LM's flag names

# Megatron-LM's parser and the extra flags of its post-training scripts (an
# extra_args_provider that modelopt recipes such as GPT-OSS's use)
ARGUMENTS = ("megatron/training/arguments.py", "megatron/post_training/arguments.py")
_QUOTED_FLAG = re.compile(r"""['"](--[A-Za-z0-9][\w-]*)['"]""")


def megatron_lm_flags(checkout: Checkout, rev: str) -> set[str]:
    """Every flag name Megatron-LM's parsers have at `rev`: the names its arguments files
    give add_argument, and those ArgumentGroupFactory makes of config dataclass fields."""
    names: set[str] = set()
    for path in ARGUMENTS:
        text = checkout.read(rev, path, missing_ok=path != ARGUMENTS[0])
        names |= set(_QUOTED_FLAG.findall(text))
        for cls, exclude in _factories(text):
            names |= _dataclass_flags(checkout, rev, cls, exclude)
    return names


def _factories(text: str) -> list[tuple[str, set[str]]]:
    """(dataclass name, excluded fields) of each ArgumentGroupFactory(...) call; an
    `exclude=` given as a variable is that function's list assignment to it."""
    found = []
    for func in ast.walk(ast.parse(text)):
        if not isinstance(func, ast.FunctionDef):
            continue
        lists = {t.id: _strings(node.value) for node in ast.walk(func)
                 if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}
        for call in ast.walk(func):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and call.func.id == "ArgumentGroupFactory" and call.args
                    and isinstance(call.args[0], ast.Name)):
                exclude: set[str] = set()
                for kw in call.keywords:
                    if kw.arg == "exclude":
                        exclude = (lists.get(kw.value.id, set()) if isinstance(kw.value, ast.Name)
                                   else _strings(kw.value))
                found.append((call.args[0].id, exclude))
    return found


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)} if isinstance(node, (ast.List, ast.BinOp)) else set()


def _dataclass_flags(checkout: Checkout, rev: str, cls: str, exclude: set[str]) -> set[str]:
    """The flags ArgumentGroupFactory makes of class `cls` (and its first base class): a
    field's --name; a bool that defaults to anything but False: --no-name and
    --disable-name; the `arg_names` of its argparse metadata where it gives them."""
    path = checkout.class_file(rev, cls)
    if path is None:
        return set()
    tree = ast.parse(checkout.read(rev, path))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    names: set[str] = set()
    for item in node.body:
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        field, call = item.target.id, item.value
        kwargs = ({k.arg: k.value for k in call.keywords} if isinstance(call, ast.Call)
                  and getattr(call.func, "id", "") == "field" else {})
        if field in exclude or field.startswith("_") or _is_false(kwargs.get("init")):
            continue
        given = _arg_names(kwargs.get("metadata"))
        if given:
            names |= given
            continue
        flag = field.replace("_", "-")
        default = kwargs.get("default", call if not kwargs else None)
        if ast.unparse(item.annotation).replace(" ", "") in ("bool", "bool|None", "None|bool",
                                                               "Optional[bool]"):
            if not _is_false(default):
                names |= {f"--no-{flag}", f"--disable-{flag}"}
                continue
        names.add(f"--{flag}")
    for base in node.bases:
        if isinstance(base, ast.Name):
            names |= _dataclass_flags(checkout, rev, base.id, exclude)
    return names


def _is_false(node: Optional[ast.AST]) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def _arg_names(metadata: Optional[ast.AST]) -> set[str]:
    """The `arg_names` of a field's {"argparse_meta": {...}} metadata."""
    if not isinstance(metadata, ast.Dict):
        return set()
    for key, value in zip(metadata.keys, metadata.values):
        if isinstance(key, ast.Constant) and key.value == "argparse_meta" \
                and isinstance(value, ast.Dict):
            for k, v in zip(value.keys, value.values):
                if isinstance(k, ast.Constant) and k.value == "arg_names":
                    return _strings(v) if isinstance(v, ast.List) else set()
    return set()


def write_names(path: str, names: set[str], revs: list[str]) -> None:
    """The module megatron_flags.py reads: Megatron-LM's flag names, sorted."""
    body = "\n".join(f"    {name!r}," for name in sorted(names))
    text = (f'"""Megatron-LM\'s flag names ({", ".join(revs)}),\nto tell its flags that '
            "are not implemented here from typos.\n\nWritten by tools/megatron_flags_table.py "
            '--names; do not edit.\n"""\n\nFLAGS = frozenset((\n' + body + "\n))\n")
    with open(path, "w") as f:
        f.write(text)


# ------------------------------------------------------------------ a script's command line

_ARRAY = re.compile(r"^\s*([A-Za-z_]\w*)\+?=\((.*?)\)\s*$", re.S | re.M)
_STRING = re.compile(r'^\s*([A-Za-z_]\w*)\+?="(.*?)"\s*$', re.S | re.M)
_SCALAR = re.compile(r"^\s*([A-Za-z_]\w*)=(\S*)", re.M)
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}|\$(\w+)|\$\(\(.*?\)\)|\$\([^)]*\)")


def _carries_flags(name: str) -> bool:
    """The arrays and strings a Megatron-LM script hands pretrain_*.py (not torchrun's)."""
    return bool(re.search(r"ARGS(_LIST)?$", name)) and name != "DISTRIBUTED_ARGS"


def _decomment(text: str) -> str:
    text = text.replace("\\\n", " ")
    return "\n".join(re.sub(r"(^|\s)#.*$", "", line) for line in text.splitlines())


def script_argv(text: str) -> list[str]:
    """The flags and values a Megatron-LM launch script passes to pretrain_*.py: its
    `*_ARGS` arrays and strings in order, every branch, variables resolved."""
    text = _decomment(text)
    variables = _variables(text)
    argv: list[str] = []
    bodies = [(m.start(), m.group(1), m.group(2)) for m in _ARRAY.finditer(text)]
    bodies += [(m.start(), m.group(1), m.group(2)) for m in _STRING.finditer(text)]
    for _, name, body in sorted(bodies):
        if not _carries_flags(name):
            continue
        for item in shlex.split(_resolve(body, variables)):
            argv += item.split()  # "${ARR[@]}" unquoted: bash splits each item again
    return [t for t in argv if "[@]" not in t]


def _variables(text: str) -> dict[str, str]:
    """The script's first value of each plain variable (a default `${X:-d}` taken)."""
    found: dict[str, str] = {}
    for name, value in _SCALAR.findall(text):
        if name not in found and not value.startswith("("):
            found[name] = value.strip("'\"")
    for name in list(found):
        for _ in range(5):  # values that name other variables
            found[name] = _resolve(found[name], found)
    return found


def _resolve(text: str, variables: dict[str, str]) -> str:
    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if name is None or name.isdigit():
            return (m.group(2) or "1").strip("'\"") if name else "1"
        got = variables.get(name)
        if got is None or got.startswith("$"):
            return (m.group(2) or "1").strip("'\"")
        return got
    return _VAR.sub(value, text)


# ------------------------------------------------------------------ the trainer's verdict

@dataclass
class Verdict:
    """What the trainer says of one script's command line."""

    label: str
    rev: str
    path: str
    flags: list[str]
    mapped: list[str]
    refused: list[tuple[str, str]]  # (flag or "flag value", why)
    unknown: list[str]

    @property
    def accepted(self) -> int:
        named = {_name(f) for f, _ in self.refused} | set(self.unknown) | set(self.mapped)
        return len([f for f in self.flags if f not in named])


def _name(shown: str) -> str:
    return shown.split()[0]


def verdict(label: str, rev: str, path: str, model: str, argv: list[str],
            known: set[str]) -> Verdict:
    line = read_command_line(model, argv, required=False)
    flags = list(dict.fromkeys(t.split("=")[0] for t in argv if t.startswith("--")))
    refused = [(shown, ("no longer a Megatron-LM flag: " if r.removed else "") + r.why)
               for r in (M.refusals(line.args, 1) if line.args else []) for shown in r.flags]
    refused += [(flag, message) for flag, message in line.invalid]
    mapped = [f for f in flags if classify(f, known)[0] == "mapped"]
    return Verdict(label, rev, path, flags, mapped, refused, list(line.unknown))


def classify(flag: str, known: set[str]) -> tuple[str, str]:
    """(status, note) of one Megatron-LM flag here (`known`: Megatron-LM's flag names)."""
    if flag in M.REMOVED:
        return "removed", M.REMOVED[flag]
    for f, _, why in M.REFUSED:
        if f.name == flag:
            return "refused where it changes something", why
    if flag in M.INSTEAD:
        return "mapped", M.INSTEAD[flag]
    if any(f.name == flag for f in M.MAPPED):
        return "mapped", "selects a kernel or an overlap; megatron-core's local code runs"
    for f, why in M.HONORED_NOOP:
        if f.name == flag:
            return "honored (no-op)", why
    if flag in _parsed("gpt") | _parsed("bert"):
        note = _kernel_help(flag) or NOTES.get(flag, "")
        refused = [f"Refused {v.label}: {v.why}" for v in M.REFUSED_VALUES if v.name == flag]
        if refused:  # the values of an honored flag that ask for what is not implemented
            note = " ".join(n.rstrip(".") + "." for n in [note] + refused if n)
        return "honored", note
    if flag in known:
        return "unknown", "Megatron-LM's flag, not implemented here; the trainer names it"
    return "unknown", "not a Megatron-LM flag; the trainer names it with its closest match"


def _parsed(model: str) -> set[str]:
    return {s for a in build_parser(model)._actions for s in a.option_strings}


# honored flags whose row quotes the parser's help (beside the kernel and MoE flags)
NOTED = ("--use-distributed-optimizer", "--expert-model-parallel-size",
         "--expert-tensor-parallel-size", "--disable-bf16-reduced-precision-matmul",
         "--enable-experimental", "--skip-train")
QUOTED_GROUPS = ("kernels", "mixture of experts")


def _kernel_help(flag: str) -> str:
    """The parser's help of a kernel or MoE flag (what runs on CUDA and on CPU) or of a
    NOTED one, else ""."""
    for group in build_parser("gpt")._action_groups:
        if flag in NOTED or (group.title and group.title.startswith(QUOTED_GROUPS)):
            for action in group._group_actions:
                if flag in action.option_strings:
                    off = flag.startswith("--no-") and action.default
                    return ("turns off (on by default): " if off else "") + (action.help or "")
    return ""


# ------------------------------------------------------------------ the page

def table(verdicts: list[Verdict], known: set[str]) -> tuple[list[tuple], dict[str, int]]:
    """One row per flag of the scripts and the lists, in first-seen order."""
    sources: dict[str, list[str]] = {}
    for v in verdicts:
        for flag in v.flags:
            sources.setdefault(flag, []).append(v.label)
    for label, text in LISTS.items():
        for flag in text.split():
            sources.setdefault(flag, []).append(label)
    rows, counts = [], {}
    for flag, used in sources.items():
        status, note = classify(flag, known)
        counts[status] = counts.get(status, 0) + 1
        rows.append((flag, status, ", ".join(dict.fromkeys(used)), note))
    return rows, counts


def markdown(verdicts: list[Verdict], command: str, revs: dict[str, str],
             known: set[str]) -> str:
    rows, counts = table(verdicts, known)
    total = sum(counts.values())
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    lines = ["# Megatron-LM flags in megatron-2bw", "",
             "Which of Megatron-LM's flags `pretrain_gpt.py` and `pretrain_bert.py` take, and "
             "what each of Megatron-LM's example scripts and recipes hears from them. "
             "Generated from the trainer's own parser and tables and a Megatron-LM clone "
             "(nothing is fetched; see the tool's docstring for what each status means):", "",
             "```bash", command, "```", "",
             "## Megatron-LM's scripts", "",
             "Each script's command line (its `*_ARGS` arrays and strings, every branch) read as "
             "the trainer reads it. Accepted as-is: honored, or refused only where it would "
             "change something and here it does not. All refused and unknown flags of a "
             "command line are named in one error before any process starts its group, one "
             "`error:` line per reason.", "",
             "| script | revision | flags | accepted as-is | mapped | refused | unknown |",
             "|---|---|---|---|---|---|---|"]
    for v in verdicts:
        lines.append(f"| {v.label} (`{v.path}`) | {revs[v.rev]} | {len(v.flags)} | "
                     f"{v.accepted} | {len(v.mapped)} | {len(v.refused)} | {len(v.unknown)} |")
    lines.append("")
    for v in verdicts:
        if not (v.refused or v.unknown):
            continue
        lines += [f"**{v.label}**", ""]
        reasons: dict[str, list[str]] = {}
        for shown, why in v.refused:  # one line per reason, as the trainer's error says it
            reasons.setdefault(why, []).append(f"`{shown}`")
        lines += [f"- refused {', '.join(shown)}: {why}" for why, shown in reasons.items()]
        if v.unknown:
            theirs = [f for f in v.unknown if f in known]
            other = [f for f in v.unknown if f not in known]
            if theirs:
                lines.append("- unknown, Megatron-LM's and not implemented here: "
                             + ", ".join(f"`{f}`" for f in theirs))
            if other:
                lines.append("- unknown, not Megatron-LM's flags at either revision: "
                             + ", ".join(f"`{f}`" for f in other))
        lines.append("")
    lines += ["## Every flag", "",
              f"{total} flags of the scripts and of the lists in the tool (common flags, "
              f"kernels, GPT data, run health, every MoE flag): {summary}.", "",
              "| flag | status | used by | note |", "|---|---|---|---|"]
    lines += [f"| `{f}` | {s} | {src} | {note} |" for f, s, src, note in rows]
    return "\n".join(lines + [""] + MOE_NOTE) + "\n"


MOE_NOTE = [
    "## Mixture of experts",
    "",
    "`pretrain_gpt.py --num-experts N` builds Megatron-LM's mixture-of-experts GPT: every "
    "`--moe-layer-freq`-th layer (by default every layer) has megatron-core's MoE layer in "
    "place of its MLP, with a top-k router (`--moe-router-topk`, softmax after the top-k "
    "choice), N experts of inner width `--moe-ffn-hidden-size` and the allgather or alltoall "
    "token dispatcher. The flags take Megatron-LM's names, meanings and defaults: load "
    "balancing by `aux_loss`, `seq_aux_loss`, `sinkhorn` or `none` weighted by "
    "`--moe-aux-loss-coeff`, the router z-loss, `--moe-router-dtype`, token dropping with "
    "`--moe-expert-capacity-factor` (and padding to capacity), grouped experts "
    "(`--moe-grouped-gemm`: megatron-core's GroupedMLP weights, computed in torch, without "
    "biases), expert parallelism (`--expert-model-parallel-size`) and expert tensor "
    "parallelism (`--expert-tensor-parallel-size`, by default the tensor-parallel size). "
    "A `--moe-layer-freq` list pattern is taken when it is every N-th layer from the first. "
    "MoE is GPT only.",
    "",
    "The expert layers split the ranks as megatron-core does: within a pipeline stage, the "
    "TP x CP x DP ranks are expert-tensor-parallel x expert-parallel x expert-data-parallel "
    "ranks, so the world size must be divisible by ETP x EP x PP, and `--num-experts` by "
    "EP. As in megatron-core, a MoE model at tensor-parallel size above 1 needs "
    "`--sequence-parallel`, and experts with linear biases (the default) need "
    "expert-tensor-parallel size 1 (else `--disable-bias-linear`).",
    "",
    "Not implemented, and refused in the one error that names every such flag of a command "
    "line: the DeepSeek-V3 router (sigmoid scores, the per-expert bias of aux-loss-free "
    "balancing, group-limited routing, score scaling, pre-softmax routing), shared experts, "
    "multi-token prediction, the flex dispatcher (DeepEP / HybridEP), the global-batch aux "
    "loss and several load-balancing losses at once, a layer pattern other than every N-th "
    "layer (such as dense first layers), recomputing the MoE layers alone, dropping tokens "
    "by position, router input jitter, upcycling, routing replay and per-layer MoE logging. "
    "The fusion and overlap switches (`--moe-permute-fusion`, `--moe-router-fusion`, "
    "`--overlap-moe-expert-parallel-comm`, `--moe-use-legacy-grouped-gemm`, ...) are mapped: "
    "the numbers do not depend on them.",
]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--megatron-lm", required=True, metavar="PATH",
                    help="a clone of Megatron-LM (git work tree or bare repository)")
    ap.add_argument("--examples-rev", default=EXAMPLES_REV,
                    help="revision of the example scripts (default %(default)s)")
    ap.add_argument("--recipes-rev", default="HEAD",
                    help="revision of the recipes (default: the clone's HEAD)")
    ap.add_argument("--markdown", help="write the page here (else print it)")
    ap.add_argument("--names", help="write Megatron-LM's flag names (both revisions) as "
                                    "this Python module")
    args = ap.parse_args(argv)
    checkout = Checkout(args.megatron_lm)
    recipes = checkout.commit(args.recipes_rev)
    known = megatron_lm_flags(checkout, args.examples_rev) | megatron_lm_flags(checkout, recipes)
    if args.names:
        write_names(args.names, known, [args.examples_rev, f"main at {recipes}"])
    verdicts = [verdict(label, args.examples_rev, path, model,
                        script_argv(checkout.read(args.examples_rev, path)), known)
                for label, path, model in EXAMPLES]
    verdicts += [verdict(label, recipes, path, model,
                         script_argv(checkout.read(recipes, path)), known)
                 for label, path, model in RECIPES]
    command = ("python tools/megatron_flags_table.py --megatron-lm PATH --recipes-rev "
               f"{recipes} --markdown docs/megatron-flags.md"
               + (f" --names {args.names}" if args.names else ""))
    revs = {args.examples_rev: args.examples_rev, recipes: "main (`--recipes-rev`)"}
    text = markdown(verdicts, command, revs, known)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
