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
- REFUSED: flags that would change numerics or memory and are not implemented, with why;
  REFUSED_VALUES: values of honored flags that ask for such a feature (the flex MoE
  dispatcher, the global-batch aux loss, a per-layer MoE pattern), named with the value.
- REMOVED: spellings Megatron-LM dropped, with what replaced them (as Megatron-LM says).

A command line hears of all its problems in one error, before any process group starts,
not one per run: every unknown flag (Megatron-LM's own that are not implemented here told
apart from typos, which get their closest matches), every value argparse refuses, and every
refused or removed flag, one `error:` line per reason (the fp8 flags under their one
reason; a DeepSeek-V3 recipe's MoE flags likewise). `--sequence-parallel` (an ordinary
flag, arguments.py) at TP=1 is accepted with one warning that it is off, as Megatron-LM
warns, and recorded off.

Every flag not in arguments.py or here is unknown; docs/megatron-flags.md lists
Megatron-LM's flags and their status here. `--help` lists every flag the parser takes,
these included, each with its status.
"""
from __future__ import annotations

import argparse
import difflib
import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ..data import tokenizers
from .errors import UserError
from .megatron_lm_names import FLAGS as MEGATRON_LM_FLAGS
from .model_flags import as_list

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
    _switch("--export-force-local-attention"),
    # mixture of experts: fused kernels and overlaps (Transformer Engine, DeepEP), the same
    # numbers; what runs instead is INSTEAD's where it is more than "selects a kernel"
    _switch("--moe-permute-fusion"),
    _switch("--moe-router-fusion"),
    _switch("--moe-use-legacy-grouped-gemm"),
    _switch("--overlap-moe-expert-parallel-comm"),
    _switch("--moe-shared-expert-overlap"),
    _value("--moe-flex-dispatcher-backend", choices=["deepep", "hybridep"]),
    _value("--moe-deepep-num-sms", int),
    _value("--moe-hybridep-num-sms", int),
    # NCCL user-buffer registration of the data-parallel buffers: communication speed only
    _switch("--use-nccl-ub", dest="nccl_ub"),
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
    (_switch("--moe-extended-tp"), "megatron-core ignores it (deprecated); "
     "--expert-tensor-parallel-size replaced it"),
    (_switch("--moe-pad-experts-for-cuda-graph-inference"), "acts only in Megatron-LM's "
     "inference under CUDA graphs; training does not read it"),
    (_switch("--enable-gpt-oss"), "acts only in Megatron-LM's ModelOpt model builder (a "
     "ModelOpt checkpoint or distillation), where it switches the rotary embedding to "
     "YaRN; the pretrain_gpt.py model, which is the one built here, ignores it"),
    (_switch("--attention-softmax-in-fp32"), "attention's softmax runs in fp32 here with or "
     "without it: megatron-core's unfused attention is built with its fp32 softmax on, and "
     "PyTorch's SDPA kernels compute the softmax in fp32 for bf16 and fp16 inputs"),
    (_switch("--accumulate-allreduce-grads-in-fp32"), "gradients are accumulated and "
     "reduced in fp32 buffers here with or without it (Megatron-LM's main_grad; "
     "--grad-reduce-in-bf16 wins over it, as in Megatron-LM); the args a checkpoint "
     "records keep it, so its optimizer layout is Megatron-LM's for the same flags"),
    (_switch("--auto-detect-ckpt-format"), "the format of --load's checkpoint (torch or "
     "torch_dist) is always read from its files here, whatever --ckpt-format says"),
)

# the fp8 flags (and the MoE router's padding for fp8) share one reason, so a command line
# with all of them hears it once
FP8_WHY = ("fp8 needs Transformer Engine on a GPU, which this build does not use; drop the "
           "fp8 flags and use --bf16")

# Megatron-LM's mixture-of-experts features that models/moe.py does not build, one reason
# per feature (its flags are named together)
MTP_WHY = ("MTP layers on a pipeline stage of their own (a custom pipeline layout) are not "
           "implemented; the MTP layers sit on the last pipeline stage")
FSDP_WHY = ("Megatron FSDP (parameters, gradients and optimizer state sharded over the "
            "data-parallel ranks, with its fsdp_dtensor checkpoints) is not implemented, and "
            "these flags act only with it; drop them and use --use-distributed-optimizer "
            "(the optimizer state sharded over the data-parallel ranks, gradients "
            "reduce-scattered: --data-parallel-sharding-strategy optim) with --ckpt-format "
            "torch_dist")
FLEX_WHY = ("the flex token dispatcher runs DeepEP or HybridEP kernels on GPUs, which this "
            "build does not use; use --moe-token-dispatcher-type alltoall (or allgather)")


def _mtp(a: argparse.Namespace) -> bool:
    return bool(a.mtp_num_layers)


def _fsdp(a: argparse.Namespace) -> bool:
    return a.use_megatron_fsdp


def _rope(a: argparse.Namespace) -> bool:
    return a.position_embedding_type == "rope" or a.use_rotary_position_embeddings


# (flag, does it change something here? (flags, world size), why it is refused)
REFUSED: tuple[tuple[Flag, Callable[[argparse.Namespace, int], bool], str], ...] = (
    (_value("--fp8-format", choices=["e4m3", "hybrid"]), lambda a, w: a.fp8_format is not None,
     FP8_WHY),
    # Megatron-LM's defaults (1, most_recent) change nothing: its checkpoints' args hold them
    (_value("--fp8-amax-history-len", int),
     lambda a, w: a.fp8_amax_history_len not in (None, 1), FP8_WHY),
    (_value("--fp8-amax-compute-algo", choices=["max", "most_recent"]),
     lambda a, w: a.fp8_amax_compute_algo not in (None, "most_recent"), FP8_WHY),
    (_switch("--fp8-param-gather"), lambda a, w: a.fp8_param_gather, FP8_WHY),
    # Megatron-LM's deprecated switch, which it too refuses except with rotary embeddings
    # (not under Megatron-LM's dest, add_position_embedding: checkpoints' args derive that
    # one from the model, and a checkpoint's flags are read back onto this parser)
    (_switch("--no-position-embedding"), lambda a, w: a.no_position_embedding and not _rope(a),
     "deprecated in Megatron-LM, which accepts it only with rotary embeddings (where it "
     "changes nothing); use --position-embedding-type none"),
    # mixture of experts
    (_switch("--mtp-standalone"), lambda a, w: a.mtp_standalone and _mtp(a), MTP_WHY),
    (_switch("--moe-enable-deepep"), lambda a, w: a.moe_enable_deepep, FLEX_WHY),
    (_switch("--moe-router-padding-for-quantization"),
     lambda a, w: a.moe_router_padding_for_quantization, FP8_WHY),
    (_switch("--moe-router-padding-for-fp8"), lambda a, w: a.moe_router_padding_for_fp8,
     FP8_WHY),
    (_switch("--moe-layer-recompute"), lambda a, w: a.moe_layer_recompute,
     "recomputing the MoE layers alone is not implemented; --recompute-granularity full "
     "recomputes whole layers, MoE layers included"),
    (_value("--moe-token-drop-policy", choices=["probs", "position"]),
     lambda a, w: a.moe_token_drop_policy == "position",
     "dropping an expert's last tokens by position is not implemented; past an expert's "
     "capacity its lowest-probability tokens are dropped (probs, the default)"),
    (_value("--moe-input-jitter-eps", float), lambda a, w: a.moe_input_jitter_eps is not None,
     "jitter on the router's input is not implemented"),
    (_switch("--moe-apply-probs-on-input"), lambda a, w: a.moe_apply_probs_on_input,
     "scaling the experts' input by the routing probabilities is not implemented (they "
     "scale the experts' output)"),
    (_value("--moe-latent-size", int), lambda a, w: a.moe_latent_size is not None,
     "latent projections around the experts are not implemented"),
    (_switch("--moe-use-upcycling"), lambda a, w: a.moe_use_upcycling,
     "turning a dense checkpoint into a MoE model (upcycling) is not implemented"),
    (_value("--moe-upcycling-granularity", int),
     lambda a, w: a.moe_upcycling_granularity not in (None, 1),
     "turning a dense checkpoint into a MoE model (upcycling) is not implemented"),
    # Megatron FSDP: its flags do nothing without --use-megatron-fsdp (Megatron-LM reads
    # them only there), except the meta-device build, which serves FSDP's sharded
    # materialisation and leaves other models' weights unset
    (_switch("--use-megatron-fsdp"), lambda a, w: _fsdp(a), FSDP_WHY),
    (_value("--data-parallel-sharding-strategy",
            choices=["no_shard", "optim", "optim_grads", "optim_grads_params"]),
     lambda a, w: _fsdp(a) and a.data_parallel_sharding_strategy is not None, FSDP_WHY),
    (_switch("--init-model-with-meta-device"), lambda a, w: a.init_model_with_meta_device,
     FSDP_WHY),
    (_switch("--fsdp-double-buffer"), lambda a, w: _fsdp(a) and a.fsdp_double_buffer,
     FSDP_WHY),
    (_value("--megatron-fsdp-grad-comm-dtype", choices=["fp32", "fp16", "bf16", "auto"]),
     lambda a, w: _fsdp(a) and a.megatron_fsdp_grad_comm_dtype not in (None, "auto"),
     FSDP_WHY),
    (_value("--megatron-fsdp-main-grads-dtype", choices=["fp32", "bf16", "fp16", "auto"]),
     lambda a, w: _fsdp(a) and a.megatron_fsdp_main_grads_dtype not in (None, "auto"),
     FSDP_WHY),
    (_switch("--moe-enable-routing-replay"), lambda a, w: a.moe_enable_routing_replay,
     "routing replay (recording routing decisions to replay them, for reinforcement "
     "learning) is not implemented"),
)


@dataclass(frozen=True)
class RefusedValue:
    """A value of an honored flag (model_flags.py) that asks for a Megatron-LM feature not
    implemented here: `label` says which values (for docs/megatron-flags.md)."""

    name: str
    label: str
    refused: Callable[[argparse.Namespace, int], bool]
    why: str

    def shown(self, args: argparse.Namespace) -> str:
        """The flag with the value the command line gave it."""
        value = getattr(args, self.name.lstrip("-").replace("-", "_"))
        values = value if isinstance(value, list) else [value]
        return f"{self.name} {' '.join(str(v) for v in values)}"


def _several(value) -> bool:
    return isinstance(value, list) and len(value) > 1


SEVERAL_WHY = ("combining several load-balancing losses is not implemented; give one "
               "--moe-router-load-balancing-type and one --moe-aux-loss-coeff")

REFUSED_VALUES: tuple[RefusedValue, ...] = (
    RefusedValue("--moe-token-dispatcher-type", "flex",
                 lambda a, w: a.moe_token_dispatcher_type == "flex", FLEX_WHY),
    RefusedValue("--moe-router-load-balancing-type", "global_aux_loss",
                 lambda a, w: "global_aux_loss" in as_list(a.moe_router_load_balancing_type),
                 "the global-batch aux loss keeps token counts over the whole global batch in "
                 "router state that Megatron-LM resets after each step, not implemented "
                 "here; use aux_loss or seq_aux_loss"),
    RefusedValue("--moe-router-load-balancing-type", "several types",
                 lambda a, w: _several(a.moe_router_load_balancing_type), SEVERAL_WHY),
    RefusedValue("--moe-aux-loss-coeff", "several values",
                 lambda a, w: _several(a.moe_aux_loss_coeff), SEVERAL_WHY),
    RefusedValue("--dist-ckpt-strictness", "return_unexpected, return_all",
                 lambda a, w: a.dist_ckpt_strictness in ("return_unexpected", "return_all"),
                 "these values make megatron-core's load return the mismatched tensors' "
                 "names beside the state, for callers of its Python API (Megatron-LM's "
                 "training cannot use them either); use log_all to see them, or raise_all"),
    RefusedValue("--tokenizer-type", "types not offered",
                 lambda a, w: (a.tokenizer_type is not None
                               and a.tokenizer_type not in tokenizers.TOKENIZER_TYPES),
                 "this tokenizer type is not offered here (TikTokenizer, the multimodal and "
                 "SFT tokenizers are Megatron-LM's only); choose one of "
                 + ", ".join(tokenizers.TOKENIZER_TYPES)),
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
    """The mapped, honored-as-no-op, refused and removed flags, in their own groups, each
    with its status as its help (--help lists every flag the parser takes)."""
    groups = (("Megatron-LM kernel and performance selections (mapped, see " + DOC + ")",
               [(f, _mapped_help(f.name)) for f in MAPPED]),
              ("Megatron-LM flags with nothing to do here (honored)",
               [(f, f"honored, nothing to do here: {why}") for f, why in HONORED_NOOP]),
              ("Megatron-LM flags refused unless they change nothing",
               [(f, f"refused where it changes something: {why}") for f, _, why in REFUSED]))
    for title, flags in groups:
        g = parser.add_argument_group(title)
        for flag, text in flags:
            g.add_argument(flag.name, help=text.replace("%", "%%"), **flag.kwargs)
    g = parser.add_argument_group("removed Megatron-LM spellings")
    for name, instead in REMOVED.items():
        g.add_argument(name, nargs="?", const=True, default=None, metavar="VALUE",
                       help=f"removed from Megatron-LM: {instead}".replace("%", "%%"))


def _mapped_help(name: str) -> str:
    return INSTEAD.get(name, "selects a kernel or an overlap; megatron-core's local layer "
                             "specs run here and the numbers do not depend on it")


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
    for value in REFUSED_VALUES:
        if value.refused(args, world_size):
            found.setdefault((value.why, False), []).append(value.shown(args))
    return [Refusal(tuple(flags), why, removed) for (why, removed), flags in found.items()]


class FlagErrors(UserError):
    """Several problems of one command line, told together: each its own `error:` line.

    The entry point prints `error: ` before str(err); the lines after the first carry
    their own, so a terminal shows one `error:` line per problem and no traceback.
    """

    def __init__(self, problems: Sequence[UserError]):
        self.problems = list(problems)
        ValueError.__init__(self, "\nerror: ".join(str(p) for p in self.problems))
        self.what = f"{len(self.problems)} problems with the command line"
        self.where = ", ".join(p.where for p in self.problems)
        self.fix = " | ".join(p.fix for p in self.problems)


def raise_problems(problems: Sequence[UserError]) -> None:
    """Nothing for no problem; the one UserError itself; else FlagErrors of them all."""
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise FlagErrors(problems)


def refusal_errors(found: Sequence[Refusal]) -> list[UserError]:
    """One UserError per reason: its flags named together (the fp8 flags, the DeepSeek-V3
    router's), said once."""
    out = []
    for refusal in found:
        names = ", ".join(refusal.flags)
        if refusal.removed:
            what = (f"{names} is no longer a Megatron-LM flag" if len(refusal.flags) == 1
                    else f"{names} are no longer Megatron-LM flags")
            out.append(UserError(what, names, refusal.why))
            continue
        what = (f"{names} is not supported" if len(refusal.flags) == 1
                else f"{len(refusal.flags)} Megatron-LM flags are not supported")
        out.append(UserError(what, names, f"{refusal.why} ({DOC})"))
    return out


def check_megatron_flags(args: argparse.Namespace, world_size: int) -> None:
    """Refuse removed spellings and refused flags that would change something: all of them
    in one error (a line per reason), so a copied command line is fixed in one go, not one
    flag per run."""
    raise_problems(refusal_errors(refusals(args, world_size)))


# ------------------------------------------------------------------ unknown flags

def is_flag(token: str) -> bool:
    """Whether argparse reads `token` as an option (`--x`, `--x=v`, `-x`), not a value
    (a negative number, a path, a lone `-`)."""
    return bool(re.match(r"--[^-\s]|-[A-Za-z]", token))


def unknown_flags(accepted: set[str], argv: Sequence[str]) -> list[int]:
    """The positions in `argv` of the flags the parser does not take (no abbreviations,
    as Megatron-LM's parser), up to a lone `--`."""
    found = []
    for i, token in enumerate(argv):
        if token == "--":
            break
        if is_flag(token) and token.split("=", 1)[0] not in accepted:
            found.append(i)
    return found


def close_matches(flag: str, accepted: set[str]) -> list[str]:
    """The flags `flag` may be a typo of: this parser's and Megatron-LM's, the same
    spelling with '-' for '_' first."""
    hyphens = flag.replace("_", "-")
    if hyphens != flag and hyphens in accepted | MEGATRON_LM_FLAGS:
        return [hyphens]
    pool = sorted(accepted | MEGATRON_LM_FLAGS)
    return difflib.get_close_matches(flag, pool, n=2, cutoff=0.8)


def unknown_flags_error(flags: Sequence[str], accepted: set[str], prog: str) -> UserError:
    """One error naming every unknown flag: Megatron-LM's own that are not implemented here,
    and the others with their closest matches (a match that is Megatron-LM's only says so)."""
    def shown(match: str) -> str:
        return match if match in accepted else f"{match} (Megatron-LM's, not implemented here)"

    megatron = [f for f in flags if f in MEGATRON_LM_FLAGS]
    typos = {f: close_matches(f, accepted) for f in flags if f not in MEGATRON_LM_FLAGS}
    parts = []
    if megatron:
        parts.append(f"{', '.join(megatron)}: Megatron-LM's, not implemented here")
    guessed = [f"{f} -> {' or '.join(shown(m) for m in ms)}" for f, ms in typos.items() if ms]
    if guessed:
        parts.append(f"did you mean {'; '.join(guessed)}?")
    strangers = [f for f, ms in typos.items() if not ms]
    if strangers:
        parts.append(f"{', '.join(strangers)}: not a Megatron-LM flag either")
    where = ", ".join(flags)
    what = f"unknown flag {where}" if len(flags) == 1 else f"{len(flags)} unknown flags"
    them = "it" if len(flags) == 1 else "them"
    return UserError(what, where, f"{prog} does not take {them}: {'; '.join(parts)}; {DOC} "
                                  "lists Megatron-LM's flags and their status here")


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
    "--moe-use-legacy-grouped-gemm": "--moe-grouped-gemm runs megatron-core's GroupedMLP (the "
    "legacy grouped GEMM's weights and checkpoint keys), computed in torch, with or without "
    "this flag",
    "--overlap-moe-expert-parallel-comm": "each MoE layer's token exchange between expert-"
    "parallel ranks runs in line, not overlapped with another microbatch's compute",
    "--moe-shared-expert-overlap": "the shared experts run in line before the router, not "
    "overlapped with the token dispatch; the same numbers, except the order in which the "
    "router's and the shared experts' input gradients are summed (as in Megatron-LM)",
    "--moe-flex-dispatcher-backend": "acts only with the flex token dispatcher, which is "
    "refused here",
    "--moe-deepep-num-sms": "acts only with the flex token dispatcher, which is refused here",
    "--moe-hybridep-num-sms": "acts only with the flex token dispatcher, which is refused here",
    "--export-force-local-attention": "megatron-core's local DotProductAttention runs where "
    "a model needs it (--softmax-type off-by-one / learnable, --window-size), otherwise "
    "--attention-backend chooses; Megatron-LM reads the flag only in its ModelOpt model "
    "builder, where it replaces Transformer Engine's attention, which is not used here",
    "--use-nccl-ub": "registers the data-parallel communication buffers with NCCL (fewer "
    "GPU cores busy with the collectives); the collectives here run on ordinary buffers, "
    "and the numbers do not depend on it",
}


def mapped_notes(args: argparse.Namespace, on_gpu: bool) -> list[str]:
    """One line per mapped flag the command line set: what runs instead."""
    runs = ("megatron-core's local layer specs run here (no Transformer Engine or apex); "
            "the attention kernel is --attention-backend's")
    notes = []
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
