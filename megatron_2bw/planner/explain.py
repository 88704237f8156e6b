"""Turn a search result into words: a table for people, a paragraph on why the best won.

The paragraph says which recomputation option and stage split the best plan uses, whether
it splits sequences (sequence and context parallelism), and what the alternatives of the
same plan would cost, compares the best plan with the best plan of every other group (each
schedule, interleaved Flush, and no pipeline at all) and with the fastest configurations
that do not fit, and names the cost that separates them: memory, pipeline bubble, exposed
data-parallel all-reduce, tensor-parallel traffic, context parallelism's key/value exchange,
a mixture of experts' token dispatch or recomputation. For a mixture of experts a sentence
says how the experts are split (expert parallelism) and what the best plan with another
split costs. A group where nothing fits gets the memory its smallest plan needs and
the term that dominates it (`memory_sentence`). The seconds come from the cost model
(`Estimate.breakdown`, `CostModel.exposed_allreduce_s`), not from new formulas.
"""
from __future__ import annotations

from dataclasses import replace

from ..schedules import SCHEDULES
from .cost_model import CostModel, Estimate
from .hardware import GB
from .search import (INTERLEAVED, SearchResult, chunks_fit, plan_group,
                     sequence_parallel_option)
from .spec import Recompute

RECOMPUTE_WORDS = {"none": "none", "selective": "selective (the core attention of every layer)",
                   "full": "full"}



def _group_names() -> dict[tuple[str, bool], str]:
    """Words for each `plan_group`, from the registry: a schedule's display name, its
    interleaved form, and, where the planner runs it without a pipeline, plain tensor +
    data parallelism (for a delayed schedule: with its delayed all-reduce)."""
    names: dict[tuple[str, bool], str] = {}
    for spec in SCHEDULES:
        names[(spec.name, False)] = spec.display_name
        if spec.supports_virtual_stages:
            names[(INTERLEAVED, False)] = (f"interleaved {spec.display_name} (Megatron's "
                                           "interleaved 1F1B)")
    for spec in SCHEDULES:
        if spec.planner_min_depth <= 1:
            names[(spec.name, True)] = (
                f"no pipeline with {spec.display_name}'s delayed all-reduce" if spec.delayed
                else "no pipeline (tensor + data parallel)")
    return names


GROUP_NAMES = _group_names()
NOT_REPORTED_MISSING = frozenset((s.name, True) for s in SCHEDULES if s.delayed)
"""Groups "No plan fits with" leaves out: without a pipeline a delayed schedule needs
what the vanilla one does and more, so that group's sentence covers it."""
MEMORY_WORDS = {"weights": "weights", "weight_versions": "extra weight versions",
                "gradients": "gradient buffers", "optimizer_state": "optimizer state",
                "optimizer_buffers": "the distributed optimizer's gather buffers",
                "stashed_activations": "stashed activations"}


def dominant_term(terms: dict[str, float]) -> str:
    """The largest of `CostModel.memory_terms` apart from the reserved memory."""
    return max((k for k in terms if k != "reserved"), key=lambda k: terms[k])


def memory_sentence(cm: CostModel, est: Estimate) -> str:
    """"needs 21.3 GB of 16 GB per device, 14.2 GB of it stashed activations"."""
    terms = cm.memory_terms(est)
    top = dominant_term(terms)
    return (f"needs {est.memory_gb:.1f} GB of {cm.hardware.memory_per_device_gb:g} GB per "
            f"device, {terms[top] / GB:.1f} GB of it {MEMORY_WORDS[top]}")


def interleaving_sentence(cm: CostModel, est: Estimate) -> str:
    """For an interleaved plan: v, the layers per chunk, the bubble and the transfers."""
    cfg = est.config
    p, v, m = cfg.pipeline_depth, cfg.virtual_stages, cfg.num_microbatches
    plain = cm.evaluate(replace(cfg, virtual_stages=1))
    return (f"Interleaving: {v} model chunks of {cfg.chunk_layers(cm.model.num_layers)} "
            f"layer(s) per device (--num-layers-per-virtual-pipeline-stage), bubble "
            f"(p - 1) / (v m) = {(p - 1) / (v * m):.1%} of compute against {(p - 1) / m:.1%} "
            f"without, for {v}x the stage-to-stage transfers ({est.p2p_s * 1e3:.2f} ms each); "
            f"plain Flush of the same shape: {plain.iteration_time_s / est.iteration_time_s:.2f}x "
            f"the time at {plain.memory_gb:.1f} GB.")


def costs_by_cause(cm: CostModel, est: Estimate) -> dict[str, float]:
    """Seconds per iteration by cause, on the busiest stage; they add up to the iteration."""
    parts = est.breakdown()
    exposed = max(0.0, cm.exposed_allreduce_s(est))
    causes = {"compute": parts["compute_s"], "recomputation": parts["recompute_s"],
              "tensor-parallel all-reduces": parts["tensor_parallel_s"],
              "context-parallel key/value exchange": parts["context_parallel_s"]}
    if cm.experts is not None:
        causes[EXPERT_CAUSE] = parts["expert_parallel_s"]
    return {**causes, "exposed data-parallel all-reduce": min(exposed, parts["idle_s"]),
            "pipeline bubble and transfers": max(0.0, parts["idle_s"] - exposed)}


EXPERT_CAUSE = "expert token dispatch"
"""`costs_by_cause`'s name for a mixture of experts' dispatch and combine traffic."""


def _cause_clause(cm: CostModel, other: Estimate, cause: str, seconds: float,
                  extra: float) -> str:
    if cause == "exposed data-parallel all-reduce":
        size = max(s.params for s in other.stages) * cm.precision.grad_bytes / GB
        what = "reduce-scatter" if other.config.distributed_optimizer else "all-reduce"
        return f"{seconds:.2f} s of its {size:.2f} GB gradient {what} is not hidden"
    if cause == "pipeline bubble and transfers":
        return f"its pipeline idles {other.bubble_fraction:.0%} of the time"
    if cause == "tensor-parallel all-reduces":
        what = ("reduce-scatters and all-gathers" if other.config.sequence_parallel
                else "all-reduces")
        return f"tensor-parallel {what} take {seconds:.2f} s per iteration"
    if cause == "context-parallel key/value exchange":
        return (f"context parallelism's key/value exchange takes {seconds:.2f} s per "
                "iteration")
    if cause == EXPERT_CAUSE:
        return (f"its token dispatch ({cm.experts.dispatcher(other.config.expert_parallel)}) "
                f"takes {seconds:.2f} s per iteration")
    if cause == "recomputation":
        return f"recomputing activations costs {seconds:.2f} s per iteration"
    stage = other.busiest_stage()
    part = (" + the output layer" if stage.stage == len(other.stages) - 1 else
            " + the embedding" if stage.stage == 0 and len(other.stages) > 1 else "")
    return (f"its busiest stage ({stage.layers} layers{part}) computes {extra:.2f} s more "
            "per iteration")


def _why_slower(cm: CostModel, best: Estimate, other: Estimate) -> str:
    """The one or two causes whose seconds grew most from `best` to `other`."""
    mine, theirs = costs_by_cause(cm, best), costs_by_cause(cm, other)
    grown = sorted(((theirs[k] - mine[k], k) for k in theirs), reverse=True)
    (top, cause), (second, runner) = grown[0], grown[1]
    clauses = [f"{_cause_clause(cm, other, cause, theirs[cause], top)} (+{top:.2f} s)"]
    if second > 0.3 * top:
        clauses.append(f"{_cause_clause(cm, other, runner, theirs[runner], second)} "
                       f"(+{second:.2f} s)")
    return ", and ".join(clauses)


def _recompute_words(rc: Recompute) -> str:
    """What the option recomputes, in words (a reader may not know Megatron's flags)."""
    if rc.granularity != "full":
        return RECOMPUTE_WORDS[rc.granularity]
    if rc.method == "block":
        return f"full for the first {rc.num_layers} layer(s) of each stage (block)"
    if rc.num_layers == 1:
        return "full (every layer recomputed in backward, only its input kept)"
    return f"full (every layer, in chunks of {rc.num_layers}, only each chunk's input kept)"


def _alternative(cm: CostModel, est: Estimate, other: Estimate) -> str:
    """"none needs 17.2 GB" (does not fit) or "full: 1.20x the time at 10.3 GB"."""
    if not other.fits:
        return f"{other.config.recompute.name} needs {other.memory_gb:.1f} GB"
    timed = cm.evaluate(other.config)
    return (f"{other.config.recompute.name}: {timed.iteration_time_s / est.iteration_time_s:.2f}x "
            f"the time at {timed.memory_gb:.1f} GB")


def recompute_sentence(cm: CostModel, est: Estimate, options: tuple[Recompute, ...]) -> str:
    """Which recomputation the plan uses, its cost, and the other searched options for the
    same plan (the cheaper ones usually do not fit; the costlier ones are slower)."""
    rc = est.config.recompute
    text = f"Recomputation: {_recompute_words(rc)}"
    if rc.granularity != "none":
        text += f", {est.breakdown()['recompute_s']:.3f} s per iteration"
    layers = est.config.stage_layers(cm.model.num_layers)
    others = [cm.evaluate(replace(est.config, recompute=o), simulate_time=False)
              for o in options if o != rc and chunks_fit(o, layers, est.config.virtual_stages)]
    if others:
        text += "; " + ", ".join(_alternative(cm, est, o) for o in others)
    return text + "."


def sharding_sentence(cm: CostModel, est: Estimate) -> str:
    """At DP x CP >= 2: whether the plan shards its optimizer state
    (--use-distributed-optimizer), what that does to its memory, and what the same plan
    costs the other way."""
    cfg = est.config
    if cfg.gradient_ranks == 1:
        return ""
    other = cm.evaluate(replace(cfg, distributed_optimizer=not cfg.distributed_optimizer),
                        simulate_time=False)
    mine, theirs = cm.memory_terms(est), cm.memory_terms(other)
    if cfg.distributed_optimizer:
        text = (f"Distributed optimizer: on (--use-distributed-optimizer), optimizer state "
                f"{mine['optimizer_state'] / GB:.2f} GB per device instead of "
                f"{theirs['optimizer_state'] / GB:.2f} GB, plus "
                f"{mine['optimizer_buffers'] / GB:.2f} GB of gather buffers; without it")
    else:
        text = "Distributed optimizer: off; with it (--use-distributed-optimizer)"
    if not other.fits:
        return f"{text} the plan needs {other.memory_gb:.1f} GB."
    timed = cm.evaluate(other.config)
    return (f"{text}: {timed.iteration_time_s / est.iteration_time_s:.3f}x the time at "
            f"{timed.memory_gb:.1f} GB.")


def sequence_parallel_sentence(cm: CostModel, est: Estimate) -> str:
    """At TP > 1: whether the plan uses sequence parallelism and what the same plan costs
    the other way."""
    cfg = est.config
    if cfg.tensor_parallel == 1:
        return ""
    if not cfg.sequence_parallel and not sequence_parallel_option(
            cm.model, cfg.tensor_parallel, cfg.context_parallel, True):
        return ""  # not possible here (BERT, or a sequence that does not split over TP)
    other = replace(cfg, sequence_parallel=not cfg.sequence_parallel)
    if cfg.sequence_parallel:
        text = (f"Sequence parallelism: on (--sequence-parallel), the activations outside "
                f"the tensor-parallel layers and the stage boundary split over the "
                f"{cfg.tensor_parallel} TP ranks (reduce-scatter + all-gather instead of "
                "each all-reduce); without it")
    else:
        text = "Sequence parallelism: off; with it (--sequence-parallel)"
    sized = cm.evaluate(other, simulate_time=False)
    if not sized.fits:
        return f"{text} the plan needs {sized.memory_gb:.1f} GB."
    timed = cm.evaluate(other)
    return (f"{text}: {timed.iteration_time_s / est.iteration_time_s:.3f}x the time at "
            f"{timed.memory_gb:.1f} GB.")


def context_parallel_sentence(cm: CostModel, est: Estimate, result: SearchResult) -> str:
    """For a context-parallel plan: the split, the key/value exchange's cost, and the best
    plan without context parallelism (or the memory the smallest one needs)."""
    cfg = est.config
    c = cfg.context_parallel
    if c == 1:
        return ""
    ring = est.breakdown()["context_parallel_s"]
    text = (f"Context parallelism: {c} ranks hold {cm.model.seq_length // c} tokens of each "
            f"sequence (--context-parallel-size {c}), activations / {c}; the key/value "
            f"exchange takes {ring:.3f} s per iteration")
    plain = next((e for e in result.ranked if e.config.context_parallel == 1), None)
    if plain is not None:
        ratio = plain.iteration_time_s / est.iteration_time_s
        return (f"{text}; the best plan without it, {plain.config.label()}, is {ratio:.2f}x "
                f"the time ({plain.memory_gb:.1f} GB).")
    smallest = next((e for e in result.not_fitting if e.config.context_parallel == 1), None)
    if smallest is not None:
        return (f"{text}; no plan without it fits (the smallest, {smallest.config.label()}, "
                f"{memory_sentence(cm, smallest)}).")
    return text + "."


def expert_parallel_sentence(cm: CostModel, est: Estimate, result: SearchResult) -> str:
    """For a mixture of experts: how the plan splits the experts, what the token dispatch
    costs, the experts' share of the memory, and the best plan with another
    expert-parallel size (or the memory the smallest one needs)."""
    experts, cfg = cm.experts, est.config
    if experts is None:
        return ""
    e, n = cfg.expert_parallel, experts.num_experts
    stage = max(est.stages, key=lambda s: s.memory_bytes)
    per_param = stage.state.total / max(stage.params, 1)
    share = (f"expert weights, gradients and optimizer state "
             f"{stage.expert_params * per_param / GB:.1f} of its {est.memory_gb:.1f} GB per "
             "device")
    dispatch = est.breakdown()["expert_parallel_s"]
    if e > 1:
        x = cfg.expert_data_parallel
        reduced = (f"expert gradients reduced over {x} ranks" if x > 1 else
                   "no other rank holds the same experts")
        text = (f"Expert parallelism: {e} ranks share each MoE layer's {n} experts "
                f"({n // e} each, --expert-model-parallel-size {e}, "
                f"{experts.dispatcher(e)} dispatcher; {reduced}), {share}; the token "
                f"dispatch takes {dispatch:.3f} s per iteration")
    else:
        text = (f"Expert parallelism: none, every rank holds all {n} experts of its MoE "
                f"layers, {share}")
        if dispatch > 0:
            text += (f"; the token dispatch ({experts.dispatcher(1)}) takes {dispatch:.3f} s "
                     "per iteration")
    other = next((o for o in result.ranked if o.config.expert_parallel != e), None)
    if other is not None:
        ratio = other.iteration_time_s / est.iteration_time_s
        return (f"{text}; the best plan with {_ep_words(other.config.expert_parallel)}, "
                f"{other.config.label()}, is {ratio:.2f}x the time ({other.memory_gb:.1f} GB).")
    smallest = next((o for o in result.not_fitting if o.config.expert_parallel != e), None)
    if smallest is not None:
        return (f"{text}; no plan with another split fits (the smallest, "
                f"{smallest.config.label()}, {memory_sentence(cm, smallest)}).")
    return text + "."


def _ep_words(e: int) -> str:
    return "no expert parallelism" if e == 1 else f"EP {e}"


def stages_sentence(cm: CostModel, est: Estimate) -> str:
    """For an uneven split: the layers per stage and what even stages would cost."""
    cfg = est.config
    if not cfg.uneven:
        return ""
    layers = cfg.stage_layers(cm.model.num_layers)
    even = cm.evaluate(replace(cfg, first_stage_layers=0, last_stage_layers=0))
    ratio = even.iteration_time_s / est.iteration_time_s
    cost = (f"need {even.memory_gb:.1f} GB" if not even.fits else
            f"are within 1% ({even.memory_gb:.1f} GB)" if ratio < 1.01 else
            f"are {ratio:.2f}x slower")
    return (f"Stages: {layers[0]} layers on the first (with the embedding), {layers[-1]} on "
            f"the last (with the output layer and loss), {'/'.join(map(str, layers))} in "
            f"all; even stages ({cm.model.num_layers // cfg.pipeline_depth} layers each) "
            f"{cost}.")


def explain(cm: CostModel, result: SearchResult) -> str:
    """One paragraph: the chosen plan, and why each runner-up lost."""
    best = result.best
    if best is None:
        return "No configuration fits in memory."
    cap = cm.hardware.memory_per_device_gb
    text = [f"Chosen: {best.config.label()}, {best.samples_per_s:.1f} samples/s "
            f"({best.iteration_time_s:.3f} s per iteration of {best.config.global_batch_size}), "
            f"{best.memory_gb:.1f} of {cap:g} GB per device, pipeline idle "
            f"{best.bubble_fraction:.0%}."]
    options = result.space.recompute if result.space else (best.config.recompute,)
    text.append(recompute_sentence(cm, best, options))
    searched = result.space.distributed_optimizer if result.space else (False, True)
    if len(searched) > 1:
        text.append(sharding_sentence(cm, best))
    if best.config.tensor_parallel > 1:
        text.append(sequence_parallel_sentence(cm, best))
    if best.config.context_parallel > 1:
        text.append(context_parallel_sentence(cm, best, result))
    if cm.experts is not None:
        text.append(expert_parallel_sentence(cm, best, result))
    if best.config.uneven:
        text.append(stages_sentence(cm, best))
    if best.config.interleaved:
        text.append(interleaving_sentence(cm, best))
    if result.too_big:
        big = result.too_big[0]
        text.append(f"The fastest configuration, {big.config.label()} "
                    f"({big.samples_per_s:.1f} samples/s), {memory_sentence(cm, big)} and "
                    f"does not fit (memory).")
    for group, other in best_per_group(result).items():
        if group == plan_group(best.config):
            continue
        ratio = best.samples_per_s / other.samples_per_s
        if ratio < 1.01:
            text.append(f"The best {GROUP_NAMES[group]} plan, {other.config.label()}, is "
                        f"within 1% ({other.memory_gb:.1f} GB per device).")
            continue
        text.append(f"The best {GROUP_NAMES[group]} plan, {other.config.label()}, is "
                    f"{ratio:.2f}x slower: {_why_slower(cm, best, other)}.")
    missing = [g for g in GROUP_NAMES if g not in NOT_REPORTED_MISSING
               and g not in best_per_group(result)
               and g in searched_groups(result)]
    if missing:
        closest = closest_per_group(result)
        text.append("No plan fits with " + "; ".join(
            GROUP_NAMES[g] + (f" (the smallest, {closest[g].config.label()}, "
                              f"{memory_sentence(cm, closest[g])})" if g in closest else "")
            for g in missing) + ".")
    return " ".join(t for t in text if t)


def searched_groups(result: SearchResult) -> set[tuple[str, bool]]:
    """The `plan_group`s of every enumerated configuration (fitting or not)."""
    return {plan_group(e.config) for e in result.ranked + result.not_fitting}


def closest_per_group(result: SearchResult) -> dict[tuple[str, bool], Estimate]:
    """The non-fitting plan needing the least memory in each `plan_group`
    (`not_fitting` is sorted by memory)."""
    found: dict[tuple[str, bool], Estimate] = {}
    for est in result.not_fitting:
        found.setdefault(plan_group(est.config), est)
    return found


def best_per_group(result: SearchResult) -> dict[tuple[str, bool], Estimate]:
    """The fastest fitting plan of each `plan_group` (ranked is fastest first)."""
    found: dict[tuple[str, bool], Estimate] = {}
    for est in result.ranked:
        found.setdefault(plan_group(est.config), est)
    return found


def format_table(result: SearchResult, top: int = 10) -> str:
    """The ranked plans as a fixed-width table (`sp`: yes with --sequence-parallel; `cp`:
    context-parallel size; `ep`: a mixture of experts' expert-parallel size, a column only
    for one; `v`: model chunks per device, 1 without interleaving; `dopt`: yes with
    --use-distributed-optimizer)."""
    ep = f" {'ep':>3}" if result.experts else ""
    head = (f"{'#':>3} {'schedule':8} {'tp':>3} {'sp':>3} {'cp':>3} {'pp':>3}{ep} {'v':>2} "
            f"{'dp':>3} {'b':>4} {'m':>5} "
            f"{'recompute':>9} {'stages':>8} {'dopt':>4} {'samples/s':>10} {'iter s':>8} "
            f"{'bubble':>7} {'mem GB':>7}")
    rows = [head, "-" * len(head)]
    for i, est in enumerate(result.ranked[:top], 1):
        c = est.config
        rows.append(f"{i:>3} {c.schedule:8} {c.tensor_parallel:>3} "
                    f"{'yes' if c.sequence_parallel else '':>3} {c.context_parallel:>3} "
                    f"{c.pipeline_depth:>3}"
                    + (f" {c.expert_parallel:>3}" if result.experts else "")
                    + f" {c.virtual_stages:>2} {c.data_parallel_width:>3} {c.micro_batch_size:>4} "
                    f"{c.num_microbatches:>5} "
                    f"{c.recompute.name:>9} {_stages_cell(est):>8} "
                    f"{'yes' if c.distributed_optimizer else '':>4} {est.samples_per_s:>10.1f} "
                    f"{est.iteration_time_s:>8.3f} {est.bubble_fraction:>7.1%} "
                    f"{est.memory_gb:>7.1f}")
    return "\n".join(rows)


def _stages_cell(est: Estimate) -> str:
    """"even", or first/middle/last layer counts of an uneven split ("3/5/3")."""
    if not est.config.uneven:
        return "even"
    layers = [s.layers for s in est.stages]
    return "/".join(str(n) for n in (layers[0], *layers[1:-1][:1], layers[-1]))
