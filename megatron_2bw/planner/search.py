"""Enumerate every valid configuration, keep those that fit, rank by predicted throughput.

Search space (paper Section 4, extended with tensor parallelism, the schedule, Megatron's
recomputation options and uneven stages): TP x PP x DP = number of devices, TP inside one
server and dividing the attention heads, PP dividing the layers (transformer blocks
repeat), every microbatch size dividing the per-replica batch, recomputation none /
selective / full (uniform, one layer per chunk), the schedules GPipe (PP > 1), Flush and
2BW (2BW only where m >= d), Flush also interleaved with v = 2, 4, 8, ... model chunks
per stage where Megatron-LM allows it (`virtual_stage_options`), for PP > 1 when the
vocabulary is large, the first and/or last stage given one or two layers fewer than the
even share (`uneven_splits`), and at DP >= 2 each plan with and without Megatron-LM's
distributed optimizer (`--use-distributed-optimizer`: optimizer state sharded over DP),
which the cost model decides between like any other choice (memory first, then time).

Sequence and context parallelism (GPT only; megatron-core's BERT supports neither here):
every plan with TP > 1 uses sequence parallelism (`--sequence-parallel`, what Megatron-LM
runs always use; `SearchSpace.sequence_parallel` False turns it off), and the
context-parallel size CP is searched like the other sizes: 1 and the powers of two that
divide the devices left by TP and split the sequence into 2 x CP equal load-balanced
chunks (each over TP with sequence parallelism), by default only for sequences of at least
`CONTEXT_PARALLEL_MIN_SEQ_LENGTH` tokens (`context_parallel_sizes`). The world is
TP x CP x PP x DP.

A mixture of experts (`CostModel.experts`) adds the expert-parallel size EP, carved out of
the DP x CP ranks: 1 and the powers of two dividing the experts and DP x CP
(`experts.expert_parallel_sizes`); TP also divides the experts' MLP width, and a plan with
TP > 1 needs sequence parallelism (megatron-core's MoE layer refuses to train without it).
The distributed optimizer is tried with expert parallelism too (the dense part sharded
over DP x CP, the experts over their expert-data-parallel ranks). A dense model's search
has EP = 1 only and is what it was.
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Iterator

from ..schedules import schedule_spec
from ..shape import ModelShape
from .cost_model import CostModel, Estimate
from .experts import expert_parallel_sizes
from .spec import (DEFAULT_RECOMPUTE_OPTIONS, SCHEDULES, ParallelConfig, Recompute,
                   as_recompute, split_layers)

logger = logging.getLogger(__name__)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


CONTEXT_PARALLEL_MIN_SEQ_LENGTH = 4096
"""Context parallelism is searched by default from this sequence length on, where
Megatron-LM's long-context recipes turn it on: below it a rank's s/c tokens are too few to
keep the GEMMs efficient, which the FLOPs estimate (a fixed FLOP rate) does not see, and a
context-parallel plan competes with data parallelism only through its smaller activations.
`SearchSpace.context_parallel_sizes` searches given sizes at any length."""


@dataclass(frozen=True)
class SearchSpace:
    """The job: how many devices, what global batch; optional restrictions of the space."""

    num_gpus: int
    global_batch_size: int
    schedules: tuple[str, ...] = SCHEDULES
    micro_batch_sizes: tuple[int, ...] | None = None
    """Only these microbatch sizes (None: every divisor of the per-replica batch)."""
    recompute: tuple[Recompute, ...] = DEFAULT_RECOMPUTE_OPTIONS
    """Recomputation options to try (bools and names are accepted: True is full)."""
    tensor_parallel_sizes: tuple[int, ...] | None = None
    """Only these tensor-parallel sizes (None: every valid one)."""
    uneven_stages: bool = True
    """Also try first/last stages with fewer layers (`uneven_splits`) where it may pay."""
    virtual_stages: tuple[int, ...] | None = None
    """Model chunks per stage to try for Flush (interleaved 1F1B); None: 1 and every power
    of two Megatron-LM's rules allow (`virtual_stage_options`); (1,): no interleaving."""
    distributed_optimizer: tuple[bool, ...] = (False, True)
    """`--use-distributed-optimizer` off and/or on, tried at DP >= 2 (`sharding_options`);
    (False,): never, (True,): always where DP >= 2."""
    sequence_parallel: bool = True
    """`--sequence-parallel` on every plan with TP > 1 (GPT; where the sequence splits
    evenly over TP); False: never."""
    context_parallel_sizes: tuple[int, ...] | None = None
    """Context-parallel sizes to try (None: 1 and every power of two that fits, from
    `CONTEXT_PARALLEL_MIN_SEQ_LENGTH` tokens on; (1,): none)."""
    expert_parallel_sizes: tuple[int, ...] | None = None
    """A mixture of experts: expert-parallel sizes to try (None: 1 and every power of two
    that divides the experts and DP x CP; (1,): none). Ignored for a dense model."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", tuple(as_recompute(r) for r in self.recompute))
        if not self.distributed_optimizer:
            raise ValueError("distributed_optimizer: give True, False or both")


def sharding_options(w: int, allowed: tuple[bool, ...], ep: int = 1) -> tuple[bool, ...]:
    """The distributed optimizer settings to try over w ranks holding the same weights
    (DP x CP): at w = 1 only off (with one replica there is nothing to shard; the flag
    would only add the gather buffer), else `allowed` (with expert parallelism too: the
    experts shard over their own group)."""
    return (False,) if w == 1 else allowed


def virtual_stage_options(name: str, num_layers: int, d: int, m: int,
                          allowed: tuple[int, ...] | None = None) -> list[int]:
    """Model chunks per stage v a plan may use: 1, and for a schedule with an interleaved
    form (`ScheduleSpec.supports_virtual_stages`: Flush) Megatron-LM's interleaved
    1F1B rules (d >= 2, the d stages' layers split into v equal chunks: num_layers
    divisible by d v; m a multiple of d, its default microbatch group being d), even
    stages. v runs over powers of two (or `allowed`)."""
    options = [1] if allowed is None or 1 in allowed else []
    if not schedule_spec(name).supports_virtual_stages or d < 2 or m % d or num_layers % d:
        return options
    per_stage = num_layers // d
    v = 2
    candidates = ([k for k in sorted(set(allowed)) if k > 1] if allowed is not None else [])
    while allowed is None and v <= per_stage:
        candidates.append(v)
        v *= 2
    return options + [k for k in candidates if per_stage % k == 0]


def tensor_parallel_sizes(cm: CostModel, num_gpus: int) -> list[int]:
    """TP divides the server (groups stay inside it), the device count, the heads and the
    MLP width of the model's dense layers and of its experts (expert tensor parallelism
    is TP; a model whose every layer is an MoE layer has no dense MLP to split); the
    key/value heads are a multiple or a divisor of it (megatron-core replicates them
    below TP); multi-latent attention's down projections, split over TP, divide too."""
    per_node = min(cm.hardware.devices_per_node, num_gpus)
    groups = cm.model.query_groups
    layers, experts = cm.model.num_layers, cm.experts
    widths = ([cm.model.ffn_size] if experts is None or experts.moe_layers(0, layers) < layers
              else []) + ([experts.ffn_size(cm.model)] if experts is not None else [])
    if cm.model.multi_latent_attention:  # the trainer's mla_split_problem
        widths += [cm.model.kv_lora_rank + cm.model.qk_pos_emb_head_dim,
                   cm.model.q_lora_rank or per_node]
    return [t for t in divisors(per_node) if num_gpus % t == 0
            and cm.model.num_attention_heads % t == 0 and all(f % t == 0 for f in widths)
            and (groups % t == 0 or t % groups == 0)]


def sequence_parallel_option(model: ModelShape, t: int, c: int, allowed: bool) -> bool:
    """Whether a plan at TP t and CP c uses sequence parallelism: `allowed`, TP > 1, a GPT,
    and the sequence splitting into the 2c load-balanced chunks (one chunk at c = 1),
    each over t ranks."""
    chunks = 2 * c if c > 1 else 1
    return (allowed and t > 1 and model.model == "gpt" and not model.mtp_depth
            and model.seq_length % (chunks * t) == 0)  # the trainer's MTP has no SP form


def context_parallel_sizes(model: ModelShape, devices: int,
                           allowed: tuple[int, ...] | None = None) -> list[int]:
    """CP sizes for the `devices` left by TP: 1, and (a GPT; by default from
    `CONTEXT_PARALLEL_MIN_SEQ_LENGTH` tokens on) every power of two (or `allowed` size)
    dividing `devices` with the sequence divisible by 2 CP (megatron-core's load-balanced
    causal split: 2 CP chunks, rank i holding chunks i and 2 CP - 1 - i)."""
    options = [1] if allowed is None or 1 in allowed else []
    if model.model != "gpt" or model.multi_latent_attention or model.mtp_depth:
        # the trainer has no context-parallel MLA or MTP
        return options
    if allowed is None:
        if model.seq_length < CONTEXT_PARALLEL_MIN_SEQ_LENGTH:
            return options
        candidates, c = [], 2
        while c <= devices:
            candidates.append(c)
            c *= 2
    else:
        candidates = sorted(k for k in set(allowed) if k > 1)
    return options + [c for c in candidates
                      if devices % c == 0 and model.seq_length % (2 * c) == 0]


def large_vocabulary(model: ModelShape, layer_params: float | None = None) -> bool:
    """Whether the embedding and output layer are worth moving layers for: the word
    embedding (first stage; its tied copy on the last) weighs at least half a transformer
    layer, V h >= layer params / 2, i.e. V >= ~6h, which is also where the logits' 2bshV
    FLOPs pass half a layer's 24bsh^2 (GPT-2.2B: V = 50304, 6h = 13824; the logit layer
    costs ~1.75 layers). Below it a whole layer moved overshoots the imbalance. A
    mixture of experts passes its mean layer (`layer_params`)."""
    vocab = model.padded_vocab(1)
    layer = model.layer_params() if layer_params is None else layer_params
    return 2 * vocab * model.hidden_size >= layer


_FEWER = ((1, 0), (2, 0), (0, 1), (0, 2), (1, 1), (2, 2), (1, 2), (2, 1))
# a per-layer MoE pattern also makes an end stage with its dense layers lighter: give it more
_MORE = ((-1, 0), (-2, 0), (0, -1), (0, -2), (-1, -1), (-2, -2))


def uneven_splits(num_layers: int, depth: int, more: bool = False) -> list[tuple[int, int]]:
    """(first, last) stage layer counts to try (0: not given): each of them the even share
    e = L / d, e - 1 or e - 2 (with `more`, also e + 1 or e + 2), not both e, kept where
    megatron-core can split the rest evenly over the other stages; one per distinct
    split, fewest flags first."""
    if depth < 2 or num_layers % depth:
        return []
    even = num_layers // depth
    seen = {split_layers(num_layers, depth)}
    found = []
    for less_first, less_last in _FEWER + (_MORE if more else ()):
        first = even - less_first if less_first else 0
        last = even - less_last if less_last else 0
        if (less_first and first < 1) or (less_last and last < 1):
            continue
        try:
            split = split_layers(num_layers, depth, first, last)
        except ValueError:
            continue
        if split not in seen:
            seen.add(split)
            found.append((first, last))
    return found


def enumerate_configs(cm: CostModel, space: SearchSpace) -> Iterator[ParallelConfig]:
    """Every valid configuration, memory not yet considered."""
    mean = None if cm.experts is None else cm.experts.mean_layer_params(cm.model)
    patterned = cm.experts is not None and isinstance(cm.experts.moe_layer_freq, tuple)
    uneven = space.uneven_stages and (patterned or large_vocabulary(cm.model, mean))
    layers = cm.model.num_layers
    for cfg in _even_configs(cm, space):
        splits = (uneven_splits(layers, cfg.pipeline_depth, more=patterned)
                  if uneven and not cfg.interleaved else [])
        for first, last in [(0, 0)] + splits:
            split = replace(cfg, first_stage_layers=first, last_stage_layers=last)
            if chunks_fit(split.recompute, split.stage_layers(layers), split.virtual_stages):
                yield split


def chunks_fit(rc: Recompute, stage_layers: tuple[int, ...], virtual_stages: int = 1) -> bool:
    """Uniform full recomputation checkpoints whole chunks of N layers, so N must divide
    every stage's layer count, and with v model chunks every model chunk's (n / v; each
    is its own megatron-core TransformerBlock; the trainer refuses the flags otherwise)."""
    if rc.granularity != "full" or rc.method != "uniform":
        return True
    return all((n // virtual_stages) % rc.num_layers == 0 for n in stage_layers)


def _even_configs(cm: CostModel, space: SearchSpace) -> Iterator[ParallelConfig]:
    """Every valid configuration with equal stages."""
    for t in tensor_parallel_sizes(cm, space.num_gpus):
        if space.tensor_parallel_sizes and t not in space.tensor_parallel_sizes:
            continue
        for c in context_parallel_sizes(cm.model, space.num_gpus // t,
                                        space.context_parallel_sizes):
            sp = sequence_parallel_option(cm.model, t, c, space.sequence_parallel)
            if cm.experts is not None and t > 1 and not sp:
                continue  # megatron-core's MoE layer needs sequence parallelism at TP > 1
            yield from _configs_at(cm, space, t, c, sp)


def _configs_at(cm: CostModel, space: SearchSpace, t: int, c: int,
                sp: bool) -> Iterator[ParallelConfig]:
    """The equal-stage configurations at TP t (sequence parallel or not) and CP c."""
    for d in divisors(space.num_gpus // (t * c)):
        if cm.model.num_layers % d:
            continue
        w = space.num_gpus // (t * c * d)
        if space.global_batch_size % w:
            continue
        per_replica = space.global_batch_size // w
        for b in divisors(per_replica):
            if space.micro_batch_sizes and b not in space.micro_batch_sizes:
                continue
            m = per_replica // b
            for name in space.schedules:
                spec = schedule_spec(name)
                if d < spec.planner_min_depth or m < spec.min_microbatches(d):
                    continue  # GPipe at d = 1 is Flush with m stashes; 2BW needs m >= d
                for v in virtual_stage_options(name, cm.model.num_layers, d, m,
                                               space.virtual_stages):
                    for rc in space.recompute:
                        for e in expert_parallel_sizes(cm.experts, w * c,
                                                       space.expert_parallel_sizes):
                            for shard in sharding_options(w * c, space.distributed_optimizer,
                                                          e):
                                yield ParallelConfig(name, t, d, w, b, m, rc,
                                                     virtual_stages=v,
                                                     distributed_optimizer=shard,
                                                     context_parallel=c,
                                                     sequence_parallel=sp,
                                                     expert_parallel=e)


# The restrictions of `SearchSpace` a flag sets: (field, flag, the configuration's value,
# the rule that decides which values a model and job allow)
_RESTRICTIONS = (
    ("tensor_parallel_sizes", "--tensor-parallel-sizes", "tensor_parallel",
     "TP must divide the devices per node, --num-gpus, the attention heads and the MLP width"),
    ("micro_batch_sizes", "--micro-batch-sizes", "micro_batch_size",
     "a micro-batch size must divide the batch of a data-parallel replica"),
    ("context_parallel_sizes", "--context-parallel-sizes", "context_parallel",
     "CP must divide the devices left by TP and split the sequence into 2 x CP chunks"),
    ("virtual_stages", "--virtual-stages", "virtual_stages",
     "more than 1 needs flush at PP >= 2 with the stages' layers split evenly"),
    ("expert_parallel_sizes", "--expert-parallel-sizes", "expert_parallel",
     "EP must divide the experts and the DP x CP ranks"),
    ("schedules", "--schedules", "schedule",
     "2bw needs at least PP microbatches, gpipe PP >= 2"))


def no_configuration_reason(cm: CostModel, space: SearchSpace) -> str:
    """Why `space` holds no valid configuration, in one line: the flag whose values left
    none, the rule they break and the values that would work (the first flag whose removal
    alone gives configurations), else the job itself. Without it the user reads "no
    configuration of 0 fits", which blames memory for a flag's values."""
    for name, flag, attr, rule in _RESTRICTIONS:
        given = getattr(space, name)
        wider = SCHEDULES if name == "schedules" else None
        if not given or given == wider:
            continue
        works = sorted({getattr(c, attr) for c in enumerate_configs(
            cm, replace(space, **{name: wider}))})
        if works:
            return (f"{flag} {','.join(map(str, given))} leaves no configuration ({rule}); "
                    f"{flag} {','.join(map(str, works))} would")
    return (f"no valid configuration of {space.num_gpus} devices for --global-batch-size "
            f"{space.global_batch_size} and --num-layers {cm.model.num_layers} with these "
            "flags together")


@dataclass
class SearchResult:
    """Ranked estimates (fastest first) of the configurations that fit, and the rest."""

    ranked: list[Estimate]
    too_big: list[Estimate] = field(default_factory=list)
    """Configurations that do not fit but would beat every plan that does, fastest first."""
    not_fitting: list[Estimate] = field(default_factory=list)
    """Every configuration that does not fit, memory only (not simulated: time inf),
    the closest to fitting first."""
    num_enumerated: int = 0
    num_fitting: int = 0
    num_pruned: int = 0
    """Fitting configurations not simulated: their lower bound could not make the table."""
    seconds: float = 0.0
    space: SearchSpace | None = None
    experts: bool = False
    """The model has MoE layers (the table shows the expert-parallel size)."""

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


EXACT_SEMANTICS_MARGIN = 0.01
"""2BW is picked over the fastest plan with vanilla semantics (Flush, GPipe) only when it
is predicted this much faster: its one-step weight delay and second weight copy buy
nothing at equal speed (at PP = 1 the two schedules do the same work), and a gap smaller
than this is inside the cost model's precision."""

INTERLEAVED = "interleaved"
"""`plan_group`'s name for Flush with model chunks (Megatron-LM's interleaved 1F1B)."""


def plan_group(cfg: ParallelConfig) -> tuple[str, bool]:
    """Plans compared in the explanation: best per schedule (interleaved Flush apart), and
    pure tensor/data parallel."""
    return (INTERLEAVED if cfg.interleaved else cfg.schedule), cfg.pipeline_depth == 1


def search(cm: CostModel, space: SearchSpace, *, keep: int = 20,
           exhaustive: bool = False) -> SearchResult:
    """Rank every configuration that fits by predicted samples per second.

    Memory needs no simulation, so it is checked first. The fitting configurations are
    then simulated in order of a lower bound on their time; one whose bound cannot beat
    the `keep`-th best time nor the best of its group (`plan_group`) is skipped, unless
    `exhaustive`. Configurations that do not fit are simulated only while one could beat
    the best plan: they feed the explanation ("the fastest plan needs 21 GB").
    """
    start = time.perf_counter()
    configs = list(enumerate_configs(cm, space))
    sized = [cm.evaluate(c, simulate_time=False) for c in configs]
    fitting = [e.config for e in sized if e.fits]
    ranked, pruned = _simulate_promising(cm, fitting, keep, exhaustive)
    ranked = prefer_exact_semantics(ranked)
    # the fastest that fits, not the pick: a vanilla plan may lead a slightly faster 2BW one
    best_time = min((e.iteration_time_s for e in ranked), default=float("inf"))
    too_big = _fastest_too_big(cm, [e.config for e in sized if not e.fits], best_time)
    not_fitting = sorted((e for e in sized if not e.fits),
                         key=lambda e: (e.memory_bytes, e.config))
    seconds = time.perf_counter() - start
    logger.info("planner: %d configurations, %d fit, %d simulated, %.2f s", len(configs),
                len(fitting), len(ranked), seconds)
    return SearchResult(ranked, too_big, not_fitting, len(configs), len(fitting), pruned,
                        seconds, space, cm.experts is not None)


def _simulate_promising(cm: CostModel, configs: list[ParallelConfig], keep: int,
                        exhaustive: bool) -> tuple[list[Estimate], int]:
    bounded = sorted(((cm.lower_bound_s(c), c) for c in configs), key=lambda x: (x[0], x[1]))
    done: list[Estimate] = []
    times: list[float] = []
    group_best: dict[tuple[str, bool], float] = {}
    pruned = 0
    for bound, cfg in bounded:
        kth = times[keep - 1] if len(times) >= keep else float("inf")
        if not exhaustive and bound >= kth and bound >= group_best.get(plan_group(cfg), float("inf")):
            pruned += 1
            continue
        est = cm.evaluate(cfg)
        done.append(est)
        bisect.insort(times, est.iteration_time_s)
        group = plan_group(cfg)
        group_best[group] = min(group_best.get(group, float("inf")), est.iteration_time_s)
    return sorted(done, key=_rank_key), pruned


def prefer_exact_semantics(ranked: list[Estimate],
                           margin: float = EXACT_SEMANTICS_MARGIN) -> list[Estimate]:
    """`ranked` (fastest first) with the fastest vanilla-semantics plan moved to the front
    when the 2BW plans ahead of it are predicted less than `margin` faster."""
    exact = next((i for i, e in enumerate(ranked) if not e.config.spec.delayed), None)
    if not exact or ranked[exact].samples_per_s * (1 + margin) < ranked[0].samples_per_s:
        return ranked
    return [ranked[exact]] + ranked[:exact] + ranked[exact + 1:]


def _rank_key(est: Estimate) -> tuple:
    return (-est.samples_per_s, est.memory_bytes, est.config)


def _fastest_too_big(cm: CostModel, configs: list[ParallelConfig], best_time: float,
                     limit: int = 3) -> list[Estimate]:
    """Up to `limit` non-fitting configurations faster than `best_time`, fastest first."""
    bounded = sorted(((cm.lower_bound_s(c), c) for c in configs), key=lambda x: x[0])
    found: list[Estimate] = []
    for tried, (bound, cfg) in enumerate(bounded):
        if bound >= best_time or tried >= 16 * limit:
            break
        est = cm.evaluate(cfg)
        if est.iteration_time_s < best_time:
            found.append(est)
        if len(found) >= 4 * limit:
            break
    return sorted(found, key=_rank_key)[:limit]
