"""`python -m megatron_2bw.planner`: choose TP (with sequence parallelism), CP (context
parallelism, for long sequences), PP, DP, EP (expert parallelism, for a mixture of experts:
--num-experts), microbatch, recomputation, schedule (Flush also interleaved, v model chunks
per device) and (with a large vocabulary) uneven first/last stages.

Takes Megatron-LM's model flags, the batch, the device count and the cluster; prints a
ranked table and a paragraph on why the best plan won; `--json FILE` writes
{"best": ..., "candidates": [...]} with the command line of each plan. `--emit
{command,torchrun,sbatch}` with the data, --train-iters and --lr writes a runnable launch
of the best plan instead (docs/launch.md); trainer flags the planner does not take go
after `--`. `python -m megatron_2bw.planner profile ...` measures the layers first, and
`torchrun ... -m megatron_2bw.planner profile-network ...` the collectives' latency and
bandwidth (a hardware JSON).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import sys
from pathlib import Path
from typing import NoReturn

from ..schedules import SCHEDULE_NAMES, canonical_name
from ..shape import ModelShape, parse_layer_freq
from .compute import FlopsCompute, LayerModel, ProfiledCompute, load_profile
from .cost_model import CostModel
from .experts import DISPATCHERS, Experts
from .explain import format_table
from .hardware import PRESETS, Hardware, LaunchEnv, load_hardware, load_launch_env
from .launch import (FORMS, Job, LaunchError, add_launch_flags, check_launch_args,
                     default_time, emit, nodes_for, trainer_groups)
from .report import ENTRY_POINTS, plan_groups, to_json
from .search import (CONTEXT_PARALLEL_MIN_SEQ_LENGTH, SearchResult, SearchSpace,
                     no_configuration_reason, search)
from .spec import (COMPENSATIONS, DEFAULT_RECOMPUTE_OPTIONS, OPTIMIZERS, SCHEDULES,
                   Recompute, optimizer_precision)

logger = logging.getLogger(__name__)
DEFAULT_VOCAB = {"gpt": 50257, "bert": 30522}
SHARDING = {"search": (False, True), "on": (True,), "off": (False,)}
"""--distributed-optimizer: the settings of --use-distributed-optimizer searched."""


class PlannerArgumentError(ValueError):
    """Bad input; the message names the flag."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line naming the flag (no usage block)."""

    def error(self, message: str) -> NoReturn:
        raise PlannerArgumentError(message)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _layer_freq(text: str) -> int | tuple[int, ...]:
    """--moe-layer-freq as Megatron-LM takes it: N >= 1, or one 0 / 1 per layer as a list
    expression (a tuple here; its length is checked against --num-layers later)."""
    try:
        value = parse_layer_freq(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if isinstance(value, list):
        return tuple(value)
    return _positive_int(str(value))


def _count(text: str) -> int:
    """A whole number, 0 or more (--num-experts 0 is a dense model, as in Megatron-LM)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(_positive_int(t) for t in text.split(",") if t)


def _schedule_list(text: str) -> tuple[str, ...]:
    """Registered schedules (aliases too), as canonical names."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n.lower() not in SCHEDULE_NAMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown schedule(s) {bad}; valid: "
                                         f"{', '.join(SCHEDULE_NAMES)}")
    return tuple(dict.fromkeys(canonical_name(n) for n in names))


def _recompute_list(text: str) -> tuple[Recompute, ...]:
    try:
        options = tuple(Recompute.parse(t) for t in text.split(",") if t.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if not options:
        raise argparse.ArgumentTypeError("give at least one recompute option")
    return tuple(dict.fromkeys(options))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m megatron_2bw.planner", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model (Megatron-LM flags)")
    m.add_argument("--model", choices=("gpt", "bert"), default="gpt")
    m.add_argument("--num-layers", type=_positive_int, required=True)
    m.add_argument("--hidden-size", type=_positive_int, required=True)
    m.add_argument("--ffn-hidden-size", type=_positive_int,
                   help="default 4 * hidden size (with --swiglu 2/3 of that, rounded down "
                        "to a multiple of 64)")
    m.add_argument("--swiglu", action="store_true", help="gated MLP with SiLU (Llama)")
    m.add_argument("--num-attention-heads", type=_positive_int, required=True)
    m.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups key/value heads")
    m.add_argument("--num-query-groups", type=_positive_int,
                   help="key/value heads with --group-query-attention")
    m.add_argument("--multi-latent-attention", action="store_true",
                   help="DeepSeek-V2/V3's attention: queries and keys / values through "
                        "low-rank latents (no context parallelism)")
    for flag, kind, default, text in MLA_FLAGS:
        m.add_argument(flag, type=kind, default=default,
                       help=f"with --multi-latent-attention: {text} (default {default})")
    m.add_argument("--mtp-num-layers", type=int, default=None, metavar="D",
                   help="GPT: multi-token prediction layers on the last stage (DeepSeek-V3; "
                        "0 or unset: none); plans without sequence or context parallelism")
    m.add_argument("--seq-length", type=_positive_int, required=True)
    m.add_argument("--vocab-size", type=_positive_int,
                   help="unpadded; default 50257 (GPT-2 BPE) or 30522 (BERT WordPiece)")
    e = p.add_argument_group("mixture of experts (Megatron-LM flags; GPT)")
    e.add_argument("--num-experts", type=_count,
                   help="experts per MoE layer (default: none, dense MLPs; 0 also means none)")
    e.add_argument("--moe-ffn-hidden-size", type=_positive_int,
                   help="each expert's MLP width (default --ffn-hidden-size)")
    e.add_argument("--moe-router-topk", type=_positive_int, default=2,
                   help="experts each token is routed to (default 2)")
    e.add_argument("--moe-layer-freq", type=_layer_freq, default=1,
                   help="every N-th layer from the first is an MoE layer (default 1: all), "
                        "or one 0 (dense) / 1 (MoE) per layer, e.g. ([0]*3+[1]*29)")
    e.add_argument("--moe-shared-expert-intermediate-size", type=_positive_int,
                   help="the shared experts' MLP width, all of them together: a dense MLP "
                        "beside the routed experts in every MoE layer (default: none)")
    e.add_argument("--moe-token-dispatcher-type", choices=DISPATCHERS,
                   help="how tokens reach their experts (default: alltoall with expert "
                        "parallelism, as Megatron-LM's Mixtral example, else allgather)")
    j = p.add_argument_group("job and cluster")
    j.add_argument("--global-batch-size", type=_positive_int, required=True)
    j.add_argument("--num-gpus", type=_positive_int, required=True)
    j.add_argument("--hardware", default="p3.16xlarge",
                   help=f"a preset ({', '.join(PRESETS)}) or FILE.json with Hardware's fields")
    j.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                   help="the optimizer state the memory model counts (muon: less)")
    j.add_argument("--delay-compensation", choices=COMPENSATIONS, default="none",
                   help="2BW's delay compensation, whose state 2bw plans then count")
    j.add_argument("--distributed-optimizer", choices=tuple(SHARDING), default="search",
                   help="Megatron-LM's --use-distributed-optimizer (optimizer state sharded "
                        "over data-parallel ranks): search plans with and without it "
                        "(default), on: every plan with DP >= 2 uses it, off: none")
    j.add_argument("--profile", help="profile JSON from `python -m megatron_2bw.planner profile`; "
                                     "without it compute is estimated from FLOPs")
    s = p.add_argument_group("search and output")
    s.add_argument("--schedules", type=_schedule_list, default=SCHEDULES,
                   help=f"comma-separated, of {','.join(SCHEDULE_NAMES)} (default "
                        f"{','.join(SCHEDULES)})")
    s.add_argument("--micro-batch-sizes", type=_int_list, help="only these, e.g. 1,2,4")
    s.add_argument("--tensor-parallel-sizes", type=_int_list,
                   help="only these, e.g. 1 for the paper's pipeline x data search")
    s.add_argument("--no-sequence-parallel", action="store_true",
                   help="plans with TP > 1 without --sequence-parallel (default: with it, "
                        "activations and stage boundaries split over the TP ranks)")
    s.add_argument("--context-parallel-sizes", type=_int_list,
                   help="context-parallel sizes to try, e.g. 1 for none or 1,2,4,8 at any "
                        "sequence length; default 1 and every power of two that divides the "
                        "devices and splits the sequence into 2 x CP chunks, from "
                        f"--seq-length {CONTEXT_PARALLEL_MIN_SEQ_LENGTH} on (GPT only)")
    s.add_argument("--expert-parallel-sizes", type=_int_list,
                   help="expert-parallel sizes to try with --num-experts, e.g. 1 for none or "
                        "8; default 1 and every power of two that divides the experts and "
                        "the DP x CP ranks (expert parallelism is carved out of them)")
    s.add_argument("--recompute", type=_recompute_list, default=DEFAULT_RECOMPUTE_OPTIONS,
                   help="comma-separated recomputation options to try: none, selective, "
                        "full (= full-uniform-1), full-uniform-N, full-block-N "
                        "(default none,selective,full)")
    s.add_argument("--virtual-stages", type=_int_list,
                   help="model chunks per device to try for flush (Megatron-LM's interleaved "
                        "1F1B), e.g. 1 for none; default 1 and every power of two Megatron's "
                        "rules allow (pp >= 2, layers per stage divisible, m a multiple of pp)")
    s.add_argument("--no-uneven-stages", action="store_true",
                   help="equal stages only (default: with a large vocabulary also try the "
                        "first/last stage with 1 or 2 layers fewer)")
    s.add_argument("--exhaustive", action="store_true",
                   help="simulate every fitting configuration (slower; same best plan)")
    s.add_argument("--top", type=_positive_int, default=10, help="rows of the table")
    s.add_argument("--json", metavar="FILE", help="write the plans as JSON")
    s.add_argument("--quiet", action="store_true", help="no table or explanation on stdout")
    add_launch_flags(p)
    return p


MLA_FLAGS = (("--q-lora-rank", _positive_int, None, "rank of the query's latent (none: "
               "queries projected directly)"),
             ("--kv-lora-rank", _positive_int, 32, "rank of the keys' and values' latent"),
             ("--qk-head-dim", _positive_int, 128, "query / key channels per head"),
             ("--qk-pos-emb-head-dim", _positive_int, 64, "rotary channels per head"),
             ("--v-head-dim", _positive_int, 128, "value channels per head"))
"""Megatron-LM's "mla" flags with its defaults (`ModelShape`'s MLA fields)."""


def _mla_fields(args: argparse.Namespace) -> dict:
    """The shape's MLA fields; ValueError for an MLA flag without --multi-latent-attention
    (Megatron-LM would ignore it) or MLA beside what the trainer runs without it."""
    fields = {f[2:].replace("-", "_"): default for f, _, default, _ in MLA_FLAGS}
    given = [f for f, _, default, _ in MLA_FLAGS
             if getattr(args, f[2:].replace("-", "_")) != default]
    if not args.multi_latent_attention:
        if given:
            raise ValueError(f"{given[0]} acts on multi-latent attention only: add "
                             "--multi-latent-attention, or drop it")
        return {}
    if args.group_query_attention:
        raise ValueError("--group-query-attention: grouped-query attention is mutually "
                         "exclusive with --multi-latent-attention (Megatron-LM's rule)")
    if args.profile:
        raise ValueError("--profile: profiles time multi-head attention layers; leave it "
                         "out to plan --multi-latent-attention from FLOPs")
    if args.context_parallel_sizes and set(args.context_parallel_sizes) != {1}:
        raise ValueError("--context-parallel-sizes: multi-latent attention has no "
                         "context-parallel form in the trainer; give 1 or leave it out")
    fields.update({name: getattr(args, name) for name in fields})
    return dict(multi_latent_attention=True, **fields)


def model_from_args(args: argparse.Namespace) -> ModelShape:
    vocab = args.vocab_size or DEFAULT_VOCAB[args.model]
    mla = _mla_fields(args)
    if args.num_query_groups and not args.group_query_attention:
        raise ValueError("--num-query-groups needs --group-query-attention (as in "
                         "Megatron-LM, which ignores it otherwise)")
    groups = args.num_query_groups or 1 if args.group_query_attention else None
    return ModelShape(args.model, args.num_layers, args.hidden_size, args.num_attention_heads,
                     args.seq_length, vocab, args.ffn_hidden_size, swiglu=args.swiglu,
                     num_query_groups=groups, **mla, **_mtp_fields(args))


def _mtp_fields(args: argparse.Namespace) -> dict:
    """The shape's MTP depth (Megatron-LM reads 0 as none); ValueError where the trainer
    would refuse the plan (a negative depth, context parallelism)."""
    depth = args.mtp_num_layers
    if not depth:
        return {}
    if depth < 0:
        raise ValueError(f"--mtp-num-layers {depth}: give 0 (none) or a positive count")
    if args.context_parallel_sizes and set(args.context_parallel_sizes) != {1}:
        raise ValueError("--context-parallel-sizes: multi-token prediction has no "
                         "context-parallel form in the trainer; give 1 or leave it out")
    return {"mtp_num_layers": depth}


MOE_SHAPE_FLAGS = ("--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size",
                   "--moe-token-dispatcher-type", "--expert-parallel-sizes")


def experts_from_args(args: argparse.Namespace) -> Experts | None:
    """The MoE layers of --num-experts (None without it, or with 0); ValueError naming the
    flag when the MoE flags do not make one."""
    if not args.num_experts:
        given = [f for f in MOE_SHAPE_FLAGS if getattr(args, f[2:].replace("-", "_"))]
        given += [f"--{name.replace('_', '-')}" for name, default in
                  (("moe_router_topk", 2), ("moe_layer_freq", 1))
                  if getattr(args, name) != default]
        given += [f for f in ROUTER_LOSS_FLAGS if getattr(args, f[2:].replace("-", "_"))]
        if given:
            raise ValueError(f"{given[0]} acts on mixture-of-experts layers: add "
                             "--num-experts N")
        return None
    if args.model != "gpt":
        raise ValueError("--num-experts: a mixture of experts is GPT only (--model gpt)")
    experts = Experts(args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size,
                      args.moe_layer_freq, args.moe_shared_expert_intermediate_size,
                      moe_token_dispatcher_type=args.moe_token_dispatcher_type,
                      moe_grouped_gemm=args.optimizer != "muon")  # the trainer's rule
    problem = experts.pattern_problem(args.num_layers)
    if problem:
        raise ValueError(problem)
    return experts


ROUTER_LOSS_FLAGS = ("--moe-router-load-balancing-type", "--moe-aux-loss-coeff",
                     "--moe-z-loss-coeff", "--moe-router-score-function",
                     "--moe-router-pre-softmax", "--moe-router-topk-scaling-factor",
                     "--moe-router-num-groups", "--moe-router-group-topk",
                     "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate")
"""Passed on to the emitted launch (launch.TRAINER_FLAGS); they act on MoE layers only."""


def _hardware(args: argparse.Namespace) -> Hardware:
    try:
        return load_hardware(args.hardware)
    except ValueError as err:
        raise PlannerArgumentError(f"--hardware: {err}") from None


def _check_gpus(args: argparse.Namespace, hw: Hardware) -> None:
    per_node = hw.devices_per_node
    if args.num_gpus > per_node and args.num_gpus % per_node:
        raise PlannerArgumentError(f"--num-gpus {args.num_gpus} is not a multiple of the "
                                   f"{per_node} devices per server of {hw.name}")


def _layers(args: argparse.Namespace, model: ModelShape, hw: Hardware) -> LayerModel:
    if not args.profile:
        return FlopsCompute(model, hw)
    try:
        profile = load_profile(args.profile)
    except ValueError as err:
        raise PlannerArgumentError(f"--profile: {err}") from None
    mismatch = profile.matches(model)
    if mismatch:
        raise PlannerArgumentError(f"--profile {args.profile} measured another model: "
                                   + "; ".join(mismatch))
    return ProfiledCompute(profile, model)


def _split_extra(argv: list[str]) -> tuple[list[str], list[str]]:
    """The planner's flags, and the trainer flags after `--` for the emitted launch."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def _check_launch(args: argparse.Namespace, hw: Hardware, extra: list[str]) -> LaunchEnv:
    """The cluster's launch environment, once the --emit flags are known to make a launch
    that can run (before the search, so a mistake costs nothing)."""
    if extra and not args.emit:
        raise PlannerArgumentError(f"{extra[0]} (after --) is for the emitted launch: add "
                                   f"--emit {{{','.join(FORMS)}}}")
    if "--use-distributed-optimizer" in extra:
        raise PlannerArgumentError("--use-distributed-optimizer (after --) changes the "
                                   "memory the plan needs: give --distributed-optimizer on "
                                   "before --, and the plan passes it on")
    planned = {"--sequence-parallel": "plans with TP > 1 use it (--no-sequence-parallel: "
                                      "none do)",
               "--context-parallel-size": "give --context-parallel-sizes N before --",
               "--expert-model-parallel-size": "give --expert-parallel-sizes N before --",
               "--expert-tensor-parallel-size": "the plan keeps it at the tensor-parallel "
                                                "size, megatron-core's default",
               "--moe-token-dispatcher-type": "give --moe-token-dispatcher-type before --"}
    planned.update({flag: f"give {flag} before --" for flag in
                    ("--num-experts", "--moe-ffn-hidden-size", "--moe-router-topk",
                     "--moe-layer-freq")})
    for word in extra:
        flag = word.split("=")[0]
        if flag in planned:
            raise PlannerArgumentError(f"{flag} (after --) changes the plan's memory and "
                                       f"time: {planned[flag]}, and the plan passes it on")
    try:
        env = load_launch_env(args.hardware)
    except ValueError as err:
        raise PlannerArgumentError(f"--hardware: {err}") from None
    try:
        check_launch_args(args, nodes_for(args.num_gpus, hw.devices_per_node))
    except LaunchError as err:
        raise PlannerArgumentError(str(err)) from None
    return env


def plan(argv: list[str]) -> tuple[CostModel, SearchResult, argparse.Namespace]:
    """Parse, validate, search. Raises PlannerArgumentError on bad input. The namespace
    also holds `trainer_extra` (what came after `--`) and `launch_env`."""
    argv, extra = _split_extra(argv)
    args = build_parser().parse_args(argv)
    try:
        model = model_from_args(args)
        experts = experts_from_args(args)
    except ValueError as err:
        raise PlannerArgumentError(str(err)) from None
    hw = _hardware(args)
    _check_gpus(args, hw)
    args.trainer_extra, args.launch_env = extra, _check_launch(args, hw, extra)
    cm = CostModel(model, _layers(args, model, hw), hw,
                   optimizer_precision(args.optimizer, args.delay_compensation), experts)
    space = SearchSpace(args.num_gpus, args.global_batch_size, schedules=args.schedules,
                        micro_batch_sizes=args.micro_batch_sizes,
                        tensor_parallel_sizes=args.tensor_parallel_sizes,
                        recompute=args.recompute, uneven_stages=not args.no_uneven_stages,
                        virtual_stages=args.virtual_stages,
                        distributed_optimizer=SHARDING[args.distributed_optimizer],
                        sequence_parallel=not args.no_sequence_parallel,
                        context_parallel_sizes=args.context_parallel_sizes,
                        expert_parallel_sizes=args.expert_parallel_sizes)
    return cm, search(cm, space, keep=max(args.top, 20), exhaustive=args.exhaustive), args


def launch_job(cm: CostModel, result: SearchResult, args: argparse.Namespace,
               argv: list[str]) -> Job:
    """The emitted launch of the best plan (`args` passed `_check_launch`)."""
    best, hw = result.best, cm.hardware
    cfg = best.config
    nodes = nodes_for(cfg.num_gpus, hw.devices_per_node)
    iterations = args.train_iters or math.ceil(args.train_samples / cfg.global_batch_size)
    summary = (f"Plan: {cfg.label()} on {nodes.count} node(s) x {nodes.per_node} {hw.name} "
               f"devices; predicted {best.iteration_time_s:.3g} s/iteration, "
               f"{best.memory_gb:.3g} GB per device.",
               "Written by: python -m megatron_2bw.planner " + shlex.join(argv))
    if cfg.spec.delayed and args.optimizer == "adam" and args.delay_compensation == "none":
        summary += (f"Note: {cfg.spec.display_name}'s one-step delay costs plain AdamW "
                    "accuracy; --optimizer muon --delay-compensation error-feedback recovers "
                    "it (docs/convergence.md).",)
    return Job(entry_point=ENTRY_POINTS[cm.model.model],
               groups=trainer_groups(plan_groups(cm.model, cfg, args, cm.experts), args,
                                     args.trainer_extra),
               nodes=nodes, env=args.launch_env, name=args.job_name,
               master_addr=args.master_addr, master_port=args.master_port,
               time=args.time or default_time(best.iteration_time_s, iterations),
               partition=args.partition, workdir=args.workdir,
               env_file=args.env_file and os.path.abspath(args.env_file), summary=summary)


def _write_launch(job: Job, args: argparse.Namespace) -> None:
    """stdout (alone, so it can be piped) or --output (executable for the scripts)."""
    text = emit(args.emit, job)
    if not args.output:
        sys.stdout.write(text)
        sys.stderr.write("".join(f"python -m megatron_2bw.planner: {line}\n"
                                 for line in job.summary if not line.startswith("Written")))
        return
    Path(args.output).write_text(text)
    if args.emit != "command":
        os.chmod(args.output, 0o755)
    sys.stdout.write(f"Wrote {args.output} ({args.emit}, {job.nodes.count} node(s) x "
                     f"{job.nodes.per_node} processes).\n")


def _print_report(cm: CostModel, result: SearchResult, args: argparse.Namespace,
                  report: dict) -> None:
    """The search in one line, the table, why the best won, and the best plan's flags."""
    out = sys.stdout
    active = ("" if cm.experts is None else
              f" ({cm.experts.active_params(cm.model) / 1e9:.2f}B active per token, "
              f"{cm.experts.num_experts} experts, top-{cm.experts.moe_router_topk})")
    out.write(f"{cm.model.model.upper()} {cm.total_params() / 1e9:.2f}B parameters{active}, "
              f"batch {args.global_batch_size}, {args.num_gpus} x {cm.hardware.name} devices, "
              f"compute from {cm.layers.source}; {result.num_enumerated} configurations, "
              f"{result.num_fitting} fit, {len(result.ranked)} simulated "
              f"({result.seconds:.1f} s)\n\n")
    out.write(format_table(result, args.top) + "\n\n" + report["best"]["explanation"] + "\n\n")
    if result.not_fitting:
        out.write(f"{len(result.not_fitting)} configurations do not fit; --json lists each "
                  "with the memory that rules it out.\n\n")
    out.write("The plan's flags (add data, --train-iters and --lr, or let --emit write the "
              "whole launch):\n  " + report["best"]["command"] + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cm, result, args = plan(argv)
    except PlannerArgumentError as err:
        sys.stderr.write(f"python -m megatron_2bw.planner: error: {err}\n")
        return 2
    report = to_json(cm, result)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if result.num_enumerated == 0 and result.space is not None:
        sys.stderr.write("python -m megatron_2bw.planner: error: "
                         f"{no_configuration_reason(cm, result.space)}\n")
        return 1
    if result.best is None:
        sys.stderr.write(f"python -m megatron_2bw.planner: error: no configuration of "
                         f"{result.num_enumerated} fits in {cm.hardware.memory_per_device_gb:g} GB "
                         f"per device: raise --num-gpus or lower --global-batch-size\n")
        return 1
    if not args.quiet and not (args.emit and not args.output):
        _print_report(cm, result, args, report)
    if args.emit:
        _write_launch(launch_job(cm, result, args, argv), args)
    return 0
