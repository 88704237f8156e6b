"""Megatron-LM flags that a copied command line carries but that do not shape the model.

A Megatron-LM user's script keeps working here only if every one of its flags is either
honored, mapped (it selects a kernel or a tool; what runs here is said in one line), or
refused with its reason. Silent acceptance is never an option: a flag that changes the
numbers or the memory and is not implemented is refused, so nobody compares a run
against one it is not.

- MAPPED: kernel and performance selections this build has no second implementation
  for (Transformer Engine, apex, overlaps): megatron-core's local layer specs run, and
  the numbers do not depend on them. The kernel flags that do choose something here
  (--attention-backend, the bias / dropout / cross-entropy fusions) are model flags
  (model_flags.py, models/kernels.py).
- HONORED_NOOP: flags whose Megatron-LM meaning is already what happens here
  (`--use-mcore-models`: there are no legacy models; `--num-workers`: samples come from
  the dataset in the training process, no DataLoader).
- REFUSED: flags that would change numerics or memory and are not implemented, with why.
- REMOVED: spellings Megatron-LM dropped, with what replaced them (as Megatron-LM says).

A command line with several refused or removed flags hears of all of them in one line
(the four fp8 flags under their one reason), not one per run. `--sequence-parallel` (an
ordinary flag, arguments.py) at TP=1 is accepted with one warning that it is off, as
Megatron-LM warns.

Every flag not in arguments.py or here is unknown: the parser names it and points to
docs/megatron-flags.md, which lists Megatron-LM's flags and their status here.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Optional

from .errors import UserError

DOC = "docs/megatron-flags.md"


@dataclass(frozen=True)
class Flag:
    """One Megatron-LM flag as argparse needs it: name and add_argument keywords."""

    name: str
    kwargs: dict

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.name.lstrip("-").replace("-", "_")


def _switch(name: str, dest: Optional[str] = None) -> Flag:
    return Flag(name, dict(action="store_true", dest=dest or name[2:].replace("-", "_")))


def _value(name: str, type_: type = str, choices: Optional[list] = None) -> Flag:
    kwargs: dict = dict(type=type_, default=None)
    if choices:
        kwargs["choices"] = choices
    return Flag(name, kwargs)


MAPPED: tuple[Flag, ...] = (
    _switch("--use-flash-attn"),
    _value("--transformer-impl", choices=["local", "transformer_engine", "inference_optimized"]),
    _value("--cross-entropy-fusion-impl", choices=["native", "te"]),
    _switch("--no-rope-fusion"),
    _switch("--no-persist-layer-norm"),
    _switch("--no-gradient-accumulation-fusion"),
    _switch("--overlap-grad-reduce"),
    _switch("--overlap-param-gather"),
    _value("--empty-unused-memory-level", int),
)

# (flag, why Megatron-LM's meaning is already what happens here)
HONORED_NOOP: tuple[tuple[Flag, str], ...] = (
    (_switch("--use-mcore-models"), "megatron-core models are the only models here"),
    (_value("--num-workers", int), "samples are read in the training process (no "
     "DataLoader workers); the order is Megatron-LM's sampler order either way"),
    (_value("--tiktoken-pattern"), "only read by TikTokenizer, which is not offered; "
     "Megatron-LM ignores it for the other tokenizers too"),
    (_switch("--no-create-attention-mask-in-dataloader"), "the model builds the causal "
     "mask itself; Megatron-LM's data-loader mask is the same mask"),
)

# the four fp8 flags share one reason, so a command line with all of them hears it once
FP8_WHY = ("fp8 needs Transformer Engine on a GPU, which this build does not use; drop the "
           "fp8 flags and use --bf16")

# (flag, does it change something here? (flags, world size), why it is refused)
REFUSED: tuple[tuple[Flag, Callable[[argparse.Namespace, int], bool], str], ...] = (
    (_value("--fp8-format", choices=["e4m3", "hybrid"]), lambda a, w: a.fp8_format is not None,
     FP8_WHY),
    (_value("--fp8-amax-history-len", int), lambda a, w: a.fp8_amax_history_len is not None,
     FP8_WHY),
    (_value("--fp8-amax-compute-algo", choices=["max", "most_recent"]),
     lambda a, w: a.fp8_amax_compute_algo is not None, FP8_WHY),
    (_switch("--fp8-param-gather"), lambda a, w: a.fp8_param_gather, FP8_WHY),
)

# Megatron-LM's removed spellings and what it tells the user instead
REMOVED: dict[str, str] = {
    "--checkpoint-activations": "use --recompute-activations, or, for more control, "
                                "--recompute-granularity and --recompute-method",
    "--batch-size": "use --micro-batch-size",
    "--warmup": "use --lr-warmup-fraction",
    "--model-parallel-size": "use --tensor-model-parallel-size",
}


def _data_parallel(args: argparse.Namespace, world_size: int) -> int:
    grid = (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
            * args.context_parallel_size)
    return max(world_size // grid, 1)


def add_megatron_flags(parser: argparse.ArgumentParser) -> None:
    """The mapped, honored-as-no-op, refused and removed flags, in their own groups."""
    groups = (("Megatron-LM kernel and performance selections (mapped, see " + DOC + ")",
               MAPPED),
              ("Megatron-LM flags with nothing to do here (honored)",
               tuple(f for f, _ in HONORED_NOOP)),
              ("Megatron-LM flags refused unless they change nothing",
               tuple(f for f, _, _ in REFUSED)))
    for title, flags in groups:
        g = parser.add_argument_group(title)
        for flag in flags:
            g.add_argument(flag.name, help=argparse.SUPPRESS, **flag.kwargs)
    g = parser.add_argument_group("removed Megatron-LM spellings")
    for name in REMOVED:
        g.add_argument(name, nargs="?", const=True, default=None, help=argparse.SUPPRESS)


@dataclass(frozen=True)
class Refusal:
    """Flags the command line sets that are refused for one reason (the fp8 flags share
    theirs). `removed`: Megatron-LM's dropped spellings, told what replaced them."""

    flags: tuple[str, ...]
    why: str
    removed: bool = False


def refusals(args: argparse.Namespace, world_size: int) -> list[Refusal]:
    """Every removed spelling and every refused flag that would change something, in the
    tables' order, flags with the same reason together."""
    found: dict[tuple[str, bool], list[str]] = {}
    for name, instead in REMOVED.items():
        if getattr(args, name[2:].replace("-", "_")) is not None:
            found.setdefault((instead, True), []).append(name)
    for flag, changes, why in REFUSED:
        if changes(args, world_size):
            found.setdefault((why, False), []).append(flag.name)
    return [Refusal(tuple(flags), why, removed) for (why, removed), flags in found.items()]


def check_megatron_flags(args: argparse.Namespace, world_size: int) -> None:
    """Refuse removed spellings and refused flags that would change something: all of them
    in one line, so a copied command line is fixed in one go, not one flag per run."""
    found = refusals(args, world_size)
    if not found:
        return
    if len(found) == 1 and len(found[0].flags) == 1:
        (name,), why = found[0].flags, found[0].why
        if found[0].removed:
            raise UserError(f"{name} is no longer a Megatron-LM flag", name, why)
        raise UserError(f"{name} is not supported", name, f"{why} ({DOC})")
    names = [name for refusal in found for name in refusal.flags]
    if len(found) == 1:
        fix = found[0].why
    else:  # " | " between reasons: a reason may hold a ";" of its own
        fix = " | ".join(f"{', '.join(r.flags)}: "
                         + (f"no longer a Megatron-LM flag, {r.why}" if r.removed else r.why)
                         for r in found)
    raise UserError(f"{len(names)} Megatron-LM flags are not supported", ", ".join(names),
                    f"{fix} ({DOC})")


def inert_notes(args: argparse.Namespace) -> list[str]:
    """One line per flag that the command line set where it changes nothing and
    that Megatron-LM then turns off with a warning: --sequence-parallel at
    --tensor-model-parallel-size 1 (said, not silently dropped)."""
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        return ["--sequence-parallel is off: it splits activations over tensor-parallel "
                "ranks, and at --tensor-model-parallel-size 1 there is one (as in "
                "Megatron-LM, which turns it off there too)"]
    return []


# mapped flags whose line says more than "selects a kernel": what runs instead
INSTEAD: dict[str, str] = {
    "--overlap-grad-reduce": "the data-parallel gradient reduction (all-reduce, or the "
    "distributed optimizer's reduce-scatter) is one asynchronous call per minibatch: 2BW "
    "starts it after the minibatch's last backward and waits at the step, overlapping the "
    "next minibatch's compute; flush and GPipe run it at the flush (not in buckets during "
    "the backward)",
    "--overlap-param-gather": "the distributed optimizer all-gathers the new weights at the "
    "optimizer step, before the next forward (not overlapped with it); under 2BW the step "
    "already sits where the next weight version is first needed",
}


def mapped_notes(args: argparse.Namespace, on_gpu: bool) -> list[str]:
    """One line per mapped flag the command line set: what runs instead."""
    runs = ("megatron-core's local layer specs run here (no Transformer Engine or apex); "
            "the attention kernel is --attention-backend's")
    notes = []
    if getattr(args, "timing_log_level", 0):  # parsed with the logging flags
        notes.append(f"--timing-log-level {args.timing_log_level}: per-phase timers are not "
                     "measured here; the log line and TensorBoard get the iteration time only")
    for flag in MAPPED:
        value = getattr(args, flag.dest)
        if value not in (None, False):
            shown = flag.name if value is True else f"{flag.name} {value}"
            if flag.name in INSTEAD:
                notes.append(f"{shown}: {INSTEAD[flag.name]}")
                continue
            notes.append(f"{shown} selects a kernel or an overlap: {runs}; the numbers "
                         "do not depend on it")
    return notes
