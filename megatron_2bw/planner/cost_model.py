"""Predict a configuration's iteration time and per-device memory.

Pure functions over frozen dataclasses; no torch, no process groups. The pieces and
their sources:

- per-stage compute: a `LayerModel` (measured profile, or FLOPs per Narayanan et al.
  SC21) divided by the tensor-parallel size;
- recomputation (`spec.Recompute`, Megatron-LM's options): full recomputation runs a
  recomputed layer's forward again in backward, selective only the core attention
  (4bs^2h FLOPs per layer);
- tensor-parallel traffic: Megatron's layer does 2 all-reduces of the [s, b, h]
  activation in forward and 2 in backward (Shoeybi et al. 2019, "Megatron-LM", Section 3,
  the f and g operators); full recomputation repeats the forward's 2 in backward;
- point-to-point and data-parallel all-reduce: bytes over bandwidth, with which groups
  cross servers decided by megatron-core's rank order (`placement.py`), ring all-reduce
  2 (n - 1) / n * bytes / bandwidth;
- pipeline bubbles, exposed all-reduce, optimizer-step synchronisation and stash counts:
  from the schedules package itself, i.e. the same action lists the executor runs, through
  its simulator, and the schedules' declarations (`weight_versions`, `grad_buffers`,
  `stash_limit`); nothing here re-derives a bubble formula;
- memory per stage: weights x declared versions + gradient buffers + optimizer state
  (`Precision`) + activation stashes (Korthikanti et al. 2022 per-layer bytes, or the
  profile, by recomputation option: `_kept_bytes`), the first stage also holding the
  embedding and the last the output layer. The paper's Section 3 table is the special
  case without the embedding and output layer;
- stages: each has its own layer count (`ParallelConfig.stage_layers`, megatron-core's
  split with `--decoder-first/last-pipeline-num-layers`); the simulator makes the
  slowest stage the bottleneck, and the largest stage decides memory.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from megatron_2bw.schedules import Costs, Schedule, build_schedule, simulate

from .compute import LayerModel
from .hardware import GB, Hardware
from .placement import Layout, collective_bandwidth, p2p_bandwidth, ring_allreduce_s
from .spec import ModelSpec, ParallelConfig, Precision, Recompute, padded_vocab_size

# 2BW never flushes: its iteration time is the steady state between two minibatches,
# makespan(3 minibatches) - makespan(2); Flush and GPipe flush every minibatch, so one
# minibatch is one iteration.
STEADY_STATE_MINIBATCHES = {"2bw": (2, 3), "flush": (0, 1), "gpipe": (0, 1)}


@dataclass(frozen=True)
class StageCost:
    """One pipeline stage of one configuration: per-microbatch times, per-device bytes."""

    stage: int
    layers: int
    params: int
    forward_s: float
    backward_s: float
    compute_s: float
    """Of forward_s + backward_s: the model's own compute (no recomputation, no TP traffic)."""
    recompute_s: float
    """Of forward_s + backward_s: the forward run again inside backward."""
    tensor_parallel_s: float
    """Of forward_s + backward_s: tensor-parallel all-reduces."""
    allreduce_s: float
    """Data-parallel gradient all-reduce (and tied-embedding sync) once per minibatch."""
    step_s: float
    weight_bytes: float
    activation_bytes: float
    stash: int

    @property
    def memory_bytes(self) -> float:
        return self.weight_bytes + self.activation_bytes


@dataclass(frozen=True)
class PipelineTiming:
    """What the schedule simulator says about one minibatch in steady state."""

    iteration_s: float
    busy_s: tuple[float, ...]
    peak_stashes: tuple[int, ...]

    @property
    def bubble_fraction(self) -> float:
        """Share of device time idle (not in F/B) in one iteration."""
        if self.iteration_s <= 0:
            return 0.0
        return max(0.0, 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.iteration_s))


@dataclass(frozen=True)
class Estimate:
    """The planner's prediction for one configuration."""

    config: ParallelConfig
    iteration_time_s: float
    memory_bytes: float
    """Busiest stage's bytes, reserved memory included."""
    fits: bool
    stages: tuple[StageCost, ...]
    p2p_s: float
    timing: PipelineTiming

    @property
    def samples_per_s(self) -> float:
        return self.config.global_batch_size / self.iteration_time_s

    @property
    def bubble_fraction(self) -> float:
        return self.timing.bubble_fraction

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / GB

    def busiest_stage(self) -> StageCost:
        return max(self.stages, key=lambda s: s.forward_s + s.backward_s)

    def breakdown(self) -> dict[str, float]:
        """Seconds per iteration on the busiest stage, by cause; `idle_s` is the rest of the
        iteration (pipeline bubble, exposed all-reduce, p2p waits, optimizer step)."""
        st, m = self.busiest_stage(), self.config.num_microbatches
        busy = m * (st.forward_s + st.backward_s)
        return {"compute_s": m * st.compute_s, "recompute_s": m * st.recompute_s,
                "tensor_parallel_s": m * st.tensor_parallel_s,
                "idle_s": max(0.0, self.iteration_time_s - busy),
                "allreduce_s": max(s.allreduce_s for s in self.stages)}


@dataclass(frozen=True)
class CostModel:
    """Everything fixed during one search: model, compute source, cluster, number formats."""

    model: ModelSpec
    layers: LayerModel
    hardware: Hardware
    precision: Precision = Precision()

    def evaluate(self, cfg: ParallelConfig, *, simulate_time: bool = True) -> Estimate:
        """Predict `cfg`; with simulate_time=False only memory is computed (time = inf)."""
        stages, p2p_s = self.stage_costs(cfg)
        memory = max(s.memory_bytes for s in stages) + self.hardware.reserved_memory_gb * GB
        fits = memory <= self.hardware.memory_bytes
        if simulate_time:
            timing = pipeline_timing(cfg.schedule, cfg.pipeline_depth, cfg.num_microbatches,
                                     costs_for(stages, p2p_s))
        else:
            timing = PipelineTiming(float("inf"), tuple(0.0 for _ in stages), ())
        return Estimate(cfg, timing.iteration_s, memory, fits, stages, p2p_s, timing)

    def lower_bound_s(self, cfg: ParallelConfig) -> float:
        """A time the simulator cannot beat for `cfg`, cheap to compute; used only to skip
        simulating configurations that cannot make the table (`pipeline_lower_bound_s`)."""
        stages, p2p_s = self.stage_costs(cfg)
        return pipeline_lower_bound_s(cfg.schedule, cfg.num_microbatches,
                                      costs_for(stages, p2p_s))

    def exposed_allreduce_s(self, est: Estimate) -> float:
        """How much of the iteration the data-parallel all-reduce costs: the simulated
        time minus the time of the same schedule with a free all-reduce."""
        free = costs_for(tuple(_without_allreduce(s) for s in est.stages), est.p2p_s)
        cfg = est.config
        return est.iteration_time_s - pipeline_timing(
            cfg.schedule, cfg.pipeline_depth, cfg.num_microbatches, free).iteration_s

    # ---- per-stage pieces ----
    def stage_costs(self, cfg: ParallelConfig) -> tuple[tuple[StageCost, ...], float]:
        return _stage_costs(self, cfg)

    def network(self, cfg: ParallelConfig) -> "Bandwidths":
        return bandwidths(self.hardware, cfg.tensor_parallel, cfg.data_parallel_width,
                          cfg.pipeline_depth)

    def tensor_parallel_allreduce_s(self, cfg: ParallelConfig) -> float:
        """One all-reduce of the [s, b, h] activation over the tensor-parallel group."""
        size = self.model.boundary_bytes(cfg.micro_batch_size, self.precision.activation_bytes)
        return ring_allreduce_s(size, cfg.tensor_parallel, self.network(cfg).tensor_parallel)

    def p2p_s(self, cfg: ParallelConfig) -> float:
        """Slowest stage-to-stage transfer of one [s, b, h] tensor (the simulator takes
        one p2p time for every boundary)."""
        if cfg.pipeline_depth == 1:
            return 0.0
        size = self.model.boundary_bytes(cfg.micro_batch_size, self.precision.activation_bytes)
        return size / self.network(cfg).p2p

    def allreduce_s(self, cfg: ParallelConfig, stage: int, params: int) -> float:
        """Data-parallel gradient all-reduce of one stage, plus the tied-embedding sync
        between first and last stage (pp > 1), which Megatron runs right after it."""
        net, grad_bytes = self.network(cfg), self.precision.grad_bytes
        seconds = ring_allreduce_s(params * grad_bytes, cfg.data_parallel_width,
                                   net.data_parallel[stage])
        if cfg.pipeline_depth > 1 and stage in (0, cfg.pipeline_depth - 1):
            vocab = padded_vocab_size(self.model.vocab_size, cfg.tensor_parallel)
            embedding = vocab // cfg.tensor_parallel * self.model.hidden_size
            seconds += ring_allreduce_s(embedding * grad_bytes, 2, net.embedding)
        return seconds


@dataclass(frozen=True)
class Bandwidths:
    """Bytes/s each kind of communication gets in one layout (slowest group of its kind)."""

    tensor_parallel: float
    data_parallel: tuple[float, ...]
    """Per stage."""
    embedding: float
    p2p: float


@lru_cache(maxsize=1024)
def bandwidths(hw: Hardware, tp: int, dp: int, pp: int) -> Bandwidths:
    """Where the groups of a (tp, dp, pp) layout sit decides their bandwidth (placement.py)."""
    lay = Layout(tp, dp, pp, hw.devices_per_node)

    def slowest(groups: list, concurrent: list) -> float:
        return min((collective_bandwidth(lay, g, concurrent, hw) for g in groups),
                   default=hw.intra_bytes_per_s)
    every_dp = lay.dp_groups()
    return Bandwidths(
        tensor_parallel=slowest(lay.tp_groups(), lay.tp_groups()),
        data_parallel=tuple(slowest(lay.dp_groups(s), every_dp) for s in range(pp)),
        embedding=slowest(lay.embedding_groups(), lay.embedding_groups()),
        p2p=min((p2p_bandwidth(lay, s, hw) for s in range(pp - 1)),
                default=hw.intra_bytes_per_s))


def _without_allreduce(stage: StageCost) -> StageCost:
    return replace(stage, allreduce_s=0.0)


def costs_for(stages: tuple[StageCost, ...], p2p_s: float) -> Costs:
    """The simulator's per-action costs (seconds) for these stages."""
    return Costs(forward=tuple(s.forward_s for s in stages),
                 backward=tuple(s.backward_s for s in stages), p2p=p2p_s,
                 allreduce=tuple(s.allreduce_s for s in stages),
                 step=tuple(s.step_s for s in stages))


@dataclass(frozen=True)
class _MicrobatchTimes:
    forward: float
    backward: float
    compute: float
    recompute: float
    tensor_parallel: float


@dataclass(frozen=True)
class _LayerTimes:
    """One transformer layer at this tp and b, per microbatch, before recomputation (which
    depends on the stage's layer count under `--recompute-method block`)."""

    plain: _MicrobatchTimes
    full_recompute_s: float
    """The forward run again inside backward, compute only."""
    full_recompute_tp_s: float
    """Its 2 tensor-parallel all-reduces."""
    selective_recompute_s: float
    """The core attention (QK^T, softmax, attention over V) run again: no all-reduce."""


def _layer_times(cm: CostModel, cfg: ParallelConfig) -> _LayerTimes:
    """One transformer layer at this tp and b: per-microbatch seconds."""
    b, t = cfg.micro_batch_size, cfg.tensor_parallel
    ar = cm.tensor_parallel_allreduce_s(cfg)
    fwd, bwd = cm.layers.layer_forward_s(b) / t, cm.layers.layer_backward_s(b) / t
    plain = _MicrobatchTimes(forward=fwd + 2 * ar, backward=bwd + 2 * ar, compute=fwd + bwd,
                             recompute=0.0, tensor_parallel=4 * ar)
    return _LayerTimes(plain, full_recompute_s=cm.layers.layer_recompute_backward_s(b) / t - bwd,
                       full_recompute_tp_s=2 * ar,
                       selective_recompute_s=cm.layers.attention_core_forward_s(b) / t)


def _stage_layer_times(layer: _LayerTimes, rc: Recompute, n: int) -> _MicrobatchTimes:
    """n layers of one stage under `rc`: full recomputation adds one forward (and its 2
    all-reduces) per recomputed layer, selective the core attention of every layer."""
    full = rc.full_layers(n)
    selective = n if rc.granularity == "selective" else 0
    rc_s = full * layer.full_recompute_s + selective * layer.selective_recompute_s
    rc_tp = full * layer.full_recompute_tp_s
    p = layer.plain
    return _MicrobatchTimes(forward=n * p.forward, backward=n * p.backward + rc_s + rc_tp,
                            compute=n * p.compute, recompute=rc_s,
                            tensor_parallel=n * p.tensor_parallel + rc_tp)


def _ends_times(cm: CostModel, cfg: ParallelConfig, first: bool, last: bool) -> _MicrobatchTimes:
    """Embedding (first stage) and output layer (last stage): per-microbatch seconds.

    With tp > 1 the vocab-parallel embedding all-reduces its output in forward and the
    output layer all-reduces its input gradient in backward (one [s, b, h] each).
    """
    b, t = cfg.micro_batch_size, cfg.tensor_parallel
    ar = cm.tensor_parallel_allreduce_s(cfg)
    fwd = bwd = tp = 0.0
    if first:
        ef, eb = cm.layers.embedding_s(b)
        fwd, bwd, tp = fwd + ef, bwd + eb, tp + ar
    if last:
        of, ob = cm.layers.output_s(b)
        fwd, bwd, tp = fwd + of / t, bwd + ob / t, tp + ar
    compute = fwd + bwd
    return _MicrobatchTimes(forward=fwd + (ar if first else 0.0),
                            backward=bwd + (ar if last else 0.0),
                            compute=compute, recompute=0.0, tensor_parallel=tp)


def _stage_params(model: ModelSpec, cfg: ParallelConfig, stage: int, layers: int) -> int:
    t, d = cfg.tensor_parallel, cfg.pipeline_depth
    params = layers * _layer_params_per_rank(model, t)
    if stage == 0:
        params += model.embedding_params(t)
    if stage == d - 1:
        params += model.output_params(t, d)
    return params


def _layer_params_per_rank(model: ModelSpec, t: int) -> int:
    """Weights split by tensor parallelism; LayerNorms and the row-parallel biases are not."""
    h = model.hidden_size
    replicated = 4 * h + 2 * h  # 2 LayerNorms, 2 row-parallel output biases
    return (model.layer_params() - replicated) // t + replicated


@dataclass(frozen=True)
class _LayerBytes:
    """What one layer keeps for backward at this b and tp, per recomputation option."""

    full: float
    """No recomputation (Korthikanti et al.: sbh(34 + 5as/h) at t = 1), or the profile."""
    selective: float
    """Core attention dropped (34sbh at t = 1)."""
    layer_input: float
    """The [s, b, h] input a fully recomputed chunk keeps (2sbh at 16 bit)."""


def _layer_bytes(cm: CostModel, b: int, t: int) -> _LayerBytes:
    return _LayerBytes(full=cm.layers.layer_activation_bytes(b, t),
                       selective=cm.layers.layer_selective_activation_bytes(b, t),
                       layer_input=cm.model.boundary_bytes(b, cm.precision.activation_bytes))


def _kept_bytes(per: _LayerBytes, rc: Recompute, n: int) -> float:
    """Bytes n layers of a stage keep per stashed microbatch under `rc`.

    none: n x full; selective: n x selective; full: one input per recomputed chunk
    (uniform: ceil(n / N) chunks, block: each of the first N layers) and the full bytes
    of the layers not recomputed (block: n - N).
    """
    if rc.granularity == "none":
        return n * per.full
    if rc.granularity == "selective":
        return n * per.selective
    return rc.kept_inputs(n) * per.layer_input + (n - rc.full_layers(n)) * per.full


def _rebuilt_bytes(per: _LayerBytes, rc: Recompute, n: int) -> float:
    """Bytes backward rebuilds at once, held beside the stash: a chunk of N layers
    (uniform) or one layer (block); selective, one layer's core attention."""
    if rc.granularity == "selective":
        return per.full - per.selective
    return rc.rebuilt_layers(n) * per.full


def _activation_bytes(cm: CostModel, cfg: ParallelConfig, stage: int, layers: int,
                      stash: int) -> float:
    """Stashed microbatches x bytes each, + what backward rebuilds when recomputing.

    Without recomputation a stashed microbatch keeps every layer's activations; with
    full recomputation it keeps only each recomputed chunk's input, and backward
    rebuilds one chunk at a time (paper Section 3; Korthikanti et al. 2022 Sections 4-5).
    """
    b, t, d = cfg.micro_batch_size, cfg.tensor_parallel, cfg.pipeline_depth
    per = _layer_bytes(cm, b, t)
    per_microbatch = _kept_bytes(per, cfg.recompute, layers)
    if stage == 0:
        per_microbatch += cm.model.embedding_activation_bytes(b)
    if stage == d - 1:
        per_microbatch += cm.model.output_activation_bytes(b, t)
    return stash * per_microbatch + _rebuilt_bytes(per, cfg.recompute, layers)


def _stage_costs(cm: CostModel, cfg: ParallelConfig) -> tuple[tuple[StageCost, ...], float]:
    d, m, prec = cfg.pipeline_depth, cfg.num_microbatches, cm.precision
    layer = _layer_times(cm, cfg)
    declared = _declared(cfg.schedule, d, m)  # what the runtime allocates, per stage
    per_param = prec.bytes_per_param(declared.weight_versions, declared.grad_buffers,
                                     compensated=cfg.schedule == "2bw")
    out = []
    for s, n in enumerate(cfg.stage_layers(cm.model.num_layers)):
        body = _stage_layer_times(layer, cfg.recompute, n)
        ends = _ends_times(cm, cfg, s == 0, s == d - 1)
        params = _stage_params(cm.model, cfg, s, n)
        stash = declared.stash_limit[s]
        out.append(StageCost(
            stage=s, layers=n, params=params,
            forward_s=body.forward + ends.forward,
            backward_s=body.backward + ends.backward,
            compute_s=body.compute + ends.compute,
            recompute_s=body.recompute,
            tensor_parallel_s=body.tensor_parallel + ends.tensor_parallel,
            allreduce_s=cm.allreduce_s(cfg, s, params),
            step_s=params * prec.step_bytes_touched / cm.hardware.hbm_bytes_per_s,
            weight_bytes=float(params * per_param),
            activation_bytes=_activation_bytes(cm, cfg, s, n, stash), stash=stash))
    return tuple(out), cm.p2p_s(cfg)


def pipeline_lower_bound_s(schedule: str, m: int, costs: Costs) -> float:
    """Lower bound on `pipeline_timing(schedule, d, m, costs).iteration_s`.

    Not a prediction (the simulator makes those), only a pruning bound; tests check it
    against the simulator on random costs. Three facts about every schedule here:
    - a stage runs its m forwards and m backwards one after another;
    - Flush/GPipe: stage s cannot start before the first forward has crossed the stages
      before it, and the minibatch ends with every stage's all-reduce and the step;
    - 1F1B (Flush, 2BW): the last stage's forward of microbatch i + 1 waits for stage
      d - 2 to finish the backward of i - 1 and the forward of i + 1, two transfers in
      between, so every two microbatches cost at least 2 p2p + both stages' F + B.
    """
    d = len(costs.forward) if not isinstance(costs.forward, (int, float)) else 1
    work = [costs.of("forward", s) + costs.of("backward", s) for s in range(d)]
    bound = m * max(work)
    if schedule != "2bw":
        fill = 0.0
        for s in range(d):
            bound = max(bound, fill + m * work[s] + costs.of("allreduce", s) + costs.of("step", s))
            fill += costs.of("forward", s) + costs.p2p
    if schedule in ("flush", "2bw") and d >= 2:
        bound = max(bound, (m - 1) // 2 * (2 * costs.p2p + work[d - 2] + work[d - 1]))
    return bound


@dataclass(frozen=True)
class _Declared:
    """What a schedule declares about its memory: stashes per stage, weight versions and
    gradient buffers."""

    stash_limit: tuple[int, ...]
    weight_versions: int
    grad_buffers: int


@lru_cache(maxsize=4096)
def _declared(name: str, d: int, m: int) -> _Declared:
    """The declarations only, cached on their own: every configuration of a search asks,
    and `_schedule` keeps only a few action lists. Flush and 2BW stash at most d - s
    microbatches on stage s, so they declare the same for every m >= d and are built
    with min(m, d) microbatches (a test checks this against full builds); GPipe stashes
    all m and is built whole."""
    built = m if name == "gpipe" else min(m, d)
    sched = build_schedule(name, d, built, 1, tied_embedding=True, check=False)
    return _Declared(tuple(sched.stash_limit), sched.weight_versions, sched.grad_buffers)


@lru_cache(maxsize=8)
def _schedule(name: str, d: int, m: int, n: int) -> Schedule:
    """The schedule the runtime would run (tied embeddings, the default step placement),
    built once per shape: many configurations share (schedule, d, m). Validation is the
    schedules package's job (its tests); the simulator still raises on a deadlock."""
    return build_schedule(name, d, m, n, tied_embedding=True, check=False)


@lru_cache(maxsize=65536)
def pipeline_timing(schedule: str, d: int, m: int, costs: Costs) -> PipelineTiming:
    """Steady-state time of one minibatch of `schedule`, from the simulator."""
    before, after = STEADY_STATE_MINIBATCHES[schedule]
    end = simulate(_schedule(schedule, d, m, after), costs)
    if before == 0:
        return PipelineTiming(end.makespan, tuple(end.busy[s] for s in range(d)),
                              tuple(end.peak_stashes[s] for s in range(d)))
    start = simulate(_schedule(schedule, d, m, before), costs)
    return PipelineTiming(end.makespan - start.makespan,
                          tuple(end.busy[s] - start.busy[s] for s in range(d)),
                          tuple(end.peak_stashes[s] for s in range(d)))
