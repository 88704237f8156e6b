"""Predict a configuration's iteration time and per-device memory.

Pure functions over frozen dataclasses; no torch, no process groups. The pieces and
their sources:

- per-stage compute: a `LayerModel` (measured profile, or FLOPs per Narayanan et al.
  SC21) at the tensor-parallel size: one rank's share, which is the time / tp only for
  the part tensor parallelism splits when the profile was measured at tp > 1 too
  (`compute.amdahl_time`);
- recomputation (`spec.Recompute`, Megatron-LM's options): full recomputation runs a
  recomputed layer's forward again in backward, selective only the core attention
  (4bs^2h FLOPs per layer);
- tensor-parallel traffic: Megatron's layer does 2 all-reduces of the [s, b, h]
  activation in forward and 2 in backward (Shoeybi et al. 2019, "Megatron-LM", Section 3,
  the f and g operators); full recomputation repeats the forward's 2 in backward; the
  vocab-parallel embedding adds 1 in forward, the output layer 1 in backward, and the
  vocab-parallel cross entropy 3 small ones in forward (max, sum of exponentials, target
  logit: [s, b] fp32 each, megatron-core `_VocabParallelCrossEntropy`). With sequence
  parallelism (Korthikanti et al. 2022, Section 4.2.2) each all-reduce is a
  reduce-scatter + all-gather pair: the same ring bytes, two latencies; the embedding's
  pair is split between forward (reduce-scatter) and backward (all-gather), the output
  layer's too (all-gather, reduce-scatter); the all-gather megatron-core repeats in
  backward for the weight gradient of each column-parallel layer runs asynchronously
  beside the input-gradient GEMM and is not counted. Not overlapped with compute, like
  the all-reduces (megatron-core's local layers block on them);
- context parallelism, c ranks per sequence (`context_parallel_s`): compute / c (s/c
  tokens, and the s^2 attention as s/c queries against s keys); per layer in forward a
  ring of c - 1 steps, each sending one rank's keys and values, [s/c, b, 2 kv_heads
  head_dim / t] (megatron-core's and the trainer's default `--cp-comm-type p2p`), and in
  backward the ring again with the keys and values and with their gradients, which go
  back to their owners (the reduce-scatter of dK/dV): 2 passes; recomputation of the
  layer (full) or of its core attention (selective) runs the forward pass again. Counted
  in full on the critical path, like the tensor-parallel collectives, though the ring
  posts each step's transfer before computing the previous block: an upper bound that
  is tight when the transfer outlasts a block's attention;
- every collective and transfer: the alpha-beta model (`hardware.py`), a fixed latency
  per collective or transfer plus bytes over bandwidth, so that many small all-reduces
  (tensor parallelism at a small microbatch) cost what their count says, not only their
  bytes; which groups cross servers (latency and bandwidth of the network) follows
  megatron-core's rank order, tp-cp-dp-pp (`placement.py`); ring all-reduce
  alpha + 2 (n - 1) / n * bytes / bandwidth;
- pipeline bubbles, exposed all-reduce, optimizer-step synchronisation and stash counts:
  from the schedules package itself, i.e. the same action lists the executor runs, through
  its simulator, and the schedules' declarations (`weight_versions`, `grad_buffers`,
  `stash_limit`); nothing here re-derives a bubble formula;
- memory per stage: weights x declared versions + gradient buffers + optimizer state
  (`Precision`; with `--use-distributed-optimizer` the masters, moments and delay
  compensation of the largest rank's shard, C elements (`shards.py`), the gradient
  buffers padded to w C, and the sharded optimizer's gather and packing buffers:
  `_state_bytes`) + activation stashes (Korthikanti et al. 2022 per-layer bytes, or the
  profile, by recomputation option: `_kept_bytes`), the first stage also holding the
  embedding and the last the output layer. The paper's Section 3 table is the special
  case without the embedding and output layer. Sequence parallelism divides the
  activations (all of them, the stage boundary and the embedding's and output layer's
  included) by t, context parallelism by c; weights and optimizer state are unaffected by
  either, except that the distributed optimizer shards over the DP x CP ranks;
- the data-parallel gradient reduction runs over the DP x CP ranks that hold the same
  weights (`ParallelConfig.gradient_ranks`);
- the distributed optimizer's traffic: a ring reduce-scatter of the fp32 gradient
  (alpha + (w - 1) / w * bytes / bandwidth, half an all-reduce) where the all-reduce was,
  started at the same point (under 2BW overlapped with the next minibatch), plus, on the
  stages that tie the word embedding, an all-reduce of that gradient over DP (the tied sum
  adds whole tensors); in the step, which now touches C elements, an all-gather of the new
  weights in the parameter dtype (alpha + (w - 1) / w * w C * param bytes / bandwidth,
  blocking, as the runtime runs it) and the gradient norm's sum over DP (one alpha);
- stages: each has its own layer count (`ParallelConfig.stage_layers`, megatron-core's
  split with `--decoder-first/last-pipeline-num-layers`); the simulator makes the
  slowest stage the bottleneck, and the largest stage decides memory;
- interleaving (v model chunks per stage, Megatron-LM's interleaved 1F1B, flush only):
  the same simulator on the interleaved action lists (bubble (d - 1) / (v m), v times as
  many boundary transfers, each paying the transfer latency, plus the wrap-around link
  from the last stage to the first); a stage's time is its chunks' sum; memory is the
  peak of (microbatch, chunk) stashes, one unit = one chunk's activations, with the
  embedding's activations only in chunk 0 of stage 0 and the output layer's only in the
  last chunk of the last stage (`_chunk_peaks`);
- a mixture of experts (`CostModel.experts`, `planner/experts.py`): an MoE layer's compute
  is the dense layer's times the ratio of their FLOPs (k experts' MLPs and the router for
  the dense MLP; the profile, when there is one, measures the dense layer), its
  activations the dense layer's with the MLP's replaced by the k routed copies of each
  token; its weights per rank the router and E / EP experts split over ETP = TP; per
  microbatch in forward the dispatch and the combine (`expert_dispatch_s`), again in
  backward and again for a fully recomputed layer; expert gradients reduced over the
  expert-data-parallel group (DP x CP / EP ranks), the rest over DP x CP. A stage's time
  and memory count its own MoE and dense layers (`--moe-layer-freq`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from megatron_2bw.schedules import Costs, Schedule, build_schedule, schedule_spec, simulate
from megatron_2bw.schedules.actions import BACKWARD, FORWARD

from .compute import LOSS_ALLREDUCES, LayerModel
from .experts import Experts
from .hardware import GB, Hardware
from .placement import (Layout, alltoall_bandwidth, collective_bandwidth, p2p_bandwidth,
                        ring_allgather_s, ring_allreduce_s)
from .shards import Shard, SplitShard, divide, expert_matrices, stage_matrices
from ..shape import ModelShape
from .spec import ParallelConfig, Precision, Recompute


@dataclass(frozen=True)
class StateBytes:
    """One stage's bytes per device besides activations, by the terms of
    `CostModel.memory_terms`."""

    weights: float
    """One copy of the stage's parameters."""
    weight_versions: float
    """The extra copies the schedule keeps (2BW's second)."""
    gradients: float
    """The gradient buffers (padded to w C with the distributed optimizer)."""
    optimizer_state: float
    """fp32 master weights, moments, delay compensation: the shard's with sharding."""
    optimizer_buffers: float = 0.0
    """What the distributed optimizer's own buffers add to the peak (`_state_bytes`); 0
    without it."""

    @property
    def total(self) -> float:
        return (self.weights + self.weight_versions + self.gradients + self.optimizer_state
                + self.optimizer_buffers)


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
    tensor_parallel_collectives: int
    """Tensor-parallel collectives per microbatch (0 at tp = 1), each paying the latency:
    all-reduces, or with sequence parallelism reduce-scatters and all-gathers."""
    allreduce_s: float
    """Data-parallel gradient all-reduce (and tied-embedding sync) once per minibatch."""
    step_s: float
    weight_bytes: float
    """Everything but activations: `state.total`."""
    activation_bytes: float
    stash: int
    state: StateBytes
    context_parallel_s: float = 0.0
    """Of forward_s + backward_s: context parallelism's key/value exchange."""
    expert_parallel_s: float = 0.0
    """Of forward_s + backward_s: a mixture of experts' token dispatch and combine."""
    expert_params: int = 0
    """Of params: the routed experts' (reduced over the expert-data-parallel group)."""

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
                "context_parallel_s": m * st.context_parallel_s,
                "expert_parallel_s": m * st.expert_parallel_s,
                "idle_s": max(0.0, self.iteration_time_s - busy),
                "allreduce_s": max(s.allreduce_s for s in self.stages)}


@dataclass(frozen=True)
class CostModel:
    """Everything fixed during one search: model, compute source, cluster, number formats."""

    model: ModelShape
    layers: LayerModel
    hardware: Hardware
    precision: Precision = Precision()
    experts: Experts | None = None
    """A mixture of experts' MoE layers (`planner/experts.py`); None: a dense model."""

    def __post_init__(self) -> None:
        if self.experts is not None and self.model.model != "gpt":
            raise ValueError("a mixture of experts is GPT only (--num-experts)")

    def total_params(self) -> int:
        """The model's parameters, the experts' included."""
        if self.experts is None:
            return self.model.total_params()
        return self.experts.total_params(self.model)

    def evaluate(self, cfg: ParallelConfig, *, simulate_time: bool = True) -> Estimate:
        """Predict `cfg`; with simulate_time=False only memory is computed (time = inf)."""
        stages, p2p_s = self.stage_costs(cfg)
        memory = max(s.memory_bytes for s in stages) + self.hardware.reserved_memory_gb * GB
        fits = memory <= self.hardware.memory_bytes
        if simulate_time:
            timing = pipeline_timing(cfg.schedule, cfg.pipeline_depth, cfg.num_microbatches,
                                     costs_for(stages, p2p_s), cfg.virtual_stages)
        else:
            timing = PipelineTiming(float("inf"), tuple(0.0 for _ in stages), ())
        return Estimate(cfg, timing.iteration_s, memory, fits, stages, p2p_s, timing)

    def lower_bound_s(self, cfg: ParallelConfig) -> float:
        """A time the simulator cannot beat for `cfg`, cheap to compute; used only to skip
        simulating configurations that cannot make the table (`pipeline_lower_bound_s`)."""
        stages, p2p_s = self.stage_costs(cfg)
        return pipeline_lower_bound_s(cfg.schedule, cfg.num_microbatches,
                                      costs_for(stages, p2p_s), cfg.virtual_stages)

    def exposed_allreduce_s(self, est: Estimate) -> float:
        """How much of the iteration the data-parallel all-reduce costs: the simulated
        time minus the time of the same schedule with a free all-reduce."""
        free = costs_for(tuple(_without_allreduce(s) for s in est.stages), est.p2p_s)
        cfg = est.config
        return est.iteration_time_s - pipeline_timing(
            cfg.schedule, cfg.pipeline_depth, cfg.num_microbatches, free,
            cfg.virtual_stages).iteration_s

    def memory_terms(self, est: Estimate) -> dict[str, float]:
        """Bytes per device of the stage with the most memory, by term; they add up to
        `est.memory_bytes`: one weight copy, the extra weight versions the schedule keeps
        (2BW's second), gradient buffers, optimizer state (master weights, moments, delay
        compensation; the largest shard's with the distributed optimizer), the
        distributed optimizer's buffers, stashed activations (and what backward
        rebuilds), reserved."""
        stage = max(est.stages, key=lambda s: s.memory_bytes)
        st = stage.state
        return {"weights": st.weights, "weight_versions": st.weight_versions,
                "gradients": st.gradients, "optimizer_state": st.optimizer_state,
                "optimizer_buffers": st.optimizer_buffers,
                "stashed_activations": stage.activation_bytes,
                "reserved": self.hardware.reserved_memory_gb * GB}

    def shard(self, cfg: ParallelConfig, stage: int, params: int,
              layers: int) -> Shard | SplitShard | None:
        """The stage's shard layout under `--use-distributed-optimizer` (None without it):
        elementwise for Adam, Muon's matrices whole (`Precision.whole_matrices`). With
        expert parallelism the routed experts are sharded apart, over the
        expert-data-parallel ranks (`SplitShard`), as the trainer shards them."""
        if not cfg.distributed_optimizer:
            return None
        t, ep = cfg.tensor_parallel, cfg.expert_parallel
        moe = self.stage_moe_layers(cfg, stage) if self.experts is not None else 0
        whole = (stage_matrices(self.model, t, stage, cfg.pipeline_depth, layers,
                                self.experts, moe, ep)
                 if self.precision.whole_matrices else ())
        if ep == 1 or not moe:
            return divide(params, whole, cfg.gradient_ranks)
        routed = moe * _expert_params_per_rank(self.model, self.experts, t, ep)
        mine = (expert_matrices(self.model, t, self.experts, moe, ep)
                if self.precision.whole_matrices else ())
        dense = list(whole)
        for n in mine:
            dense.remove(n)
        return SplitShard(divide(params - routed, tuple(dense), cfg.gradient_ranks),
                          divide(routed, mine, cfg.expert_data_parallel))

    # ---- per-stage pieces ----
    def stage_costs(self, cfg: ParallelConfig) -> tuple[tuple[StageCost, ...], float]:
        return _stage_costs(self, cfg)

    def network(self, cfg: ParallelConfig) -> "Network":
        if self.experts is None:
            return network(self.hardware, cfg.tensor_parallel, cfg.data_parallel_width,
                           cfg.pipeline_depth, cfg.virtual_stages > 1, cfg.context_parallel)
        return network(self.hardware, cfg.tensor_parallel, cfg.data_parallel_width,
                       cfg.pipeline_depth, cfg.virtual_stages > 1, cfg.context_parallel,
                       cfg.expert_parallel, True)

    # ---- a mixture of experts
    def stage_chunks(self, cfg: ParallelConfig, stage: int) -> tuple[tuple[int, int], ...]:
        """(layers, of them MoE layers) of each model chunk of `stage`: its layers in
        order, or with v chunks chunk j holding the model's (j d + s)-th run of n / v
        layers (megatron-core's interleaved layer offsets)."""
        counts = cfg.stage_layers(self.model.num_layers)
        v, d = cfg.virtual_stages, cfg.pipeline_depth
        experts = self.experts
        if v == 1:
            first = sum(counts[:stage])
            moe = experts.moe_layers(first, counts[stage]) if experts is not None else 0
            return ((counts[stage], moe),)
        size = counts[stage] // v
        return tuple((size, experts.moe_layers((j * d + stage) * size, size)
                      if experts is not None else 0) for j in range(v))

    def stage_moe_layers(self, cfg: ParallelConfig, stage: int) -> int:
        """The stage's MoE layers, the last stage's MTP layers among them."""
        mtp = self.mtp_moe_layers() if stage == cfg.pipeline_depth - 1 else 0
        return sum(k for _, k in self.stage_chunks(cfg, stage)) + mtp

    def mtp_moe_layers(self) -> int:
        """MTP layers that are MoE layers (`Experts.mtp_moe_layers`; 0 for a dense model)."""
        return self.experts.mtp_moe_layers(self.model) if self.experts is not None else 0

    def expert_dispatch_s(self, cfg: ParallelConfig) -> float:
        """One MoE layer's token dispatch and combine for one microbatch, one direction
        (backward runs the same collectives, mirrored), a rank holding
        `ModelShape.boundary_bytes` of tokens ([s / (c t), b, h] with sequence parallelism):

        - alltoall (megatron-core's `MoEAlltoAllTokenDispatcher`): an all-to-all over the
          EP ranks of the k routed copies of the rank's tokens to dispatch, one back to
          combine (`placement.alltoall_bandwidth`); at TP > 1 the routed tokens are then
          all-gathered over the expert-tensor-parallel (= TP) ranks and the experts'
          outputs reduce-scattered back: the sequence-parallel pair of the dense MLP on k
          times its bytes;
        - allgather (`MoEAllGatherTokenDispatcher`): an all-gather of every rank's tokens
          over the TP x EP ranks, [s EP / c, b, h] gathered, and a reduce-scatter of the
          same size back: at EP = 1 the dense MLP's sequence-parallel pair.

        0 without experts, and at TP = EP = 1. The small exchange of per-expert token
        counts before an all-to-all is not counted."""
        experts = self.experts
        t, ep = cfg.tensor_parallel, cfg.expert_parallel
        if experts is None or t * ep == 1:
            return 0.0
        b, c = cfg.micro_batch_size, cfg.context_parallel
        act = self.precision.activation_bytes
        whole = self.model.boundary_bytes(b, act, cp=c)  # [s/c, b, h]
        net = self.network(cfg)
        if experts.dispatcher(ep) == "alltoall":
            seconds = 0.0
            if ep > 1:
                mine = experts.moe_router_topk * self.model.boundary_bytes(
                    b, act, tp=t, sp=cfg.sequence_parallel, cp=c)
                a2a = net.expert_alltoall
                seconds += 2 * (a2a.latency_s + mine / a2a.bytes_per_s)
            if t > 1:
                tp = net.tensor_parallel
                seconds += 2 * ring_allgather_s(experts.moe_router_topk * whole, t,
                                                tp.bytes_per_s, tp.latency_s)
            return seconds
        link = net.expert_dispatch
        return 2 * ring_allgather_s(whole * ep, t * ep, link.bytes_per_s, link.latency_s)

    def tensor_parallel_allreduce_s(self, cfg: ParallelConfig) -> float:
        """One all-reduce of the [s/c, b, h] activation over the tensor-parallel group:
        its latency + its bytes at the group's bandwidth; with sequence parallelism the
        reduce-scatter + all-gather pair that replaces it (the same bytes, two latencies:
        `tensor_parallel_collectives_per_allreduce`)."""
        size = self.model.boundary_bytes(cfg.micro_batch_size, self.precision.activation_bytes,
                                         cp=cfg.context_parallel)
        link = self.network(cfg).tensor_parallel
        if cfg.sequence_parallel:
            return 2 * ring_allgather_s(size, cfg.tensor_parallel, link.bytes_per_s,
                                        link.latency_s)
        return ring_allreduce_s(size, cfg.tensor_parallel, link.bytes_per_s, link.latency_s)

    @staticmethod
    def tensor_parallel_collectives_per_allreduce(cfg: ParallelConfig) -> int:
        """Collectives one of Megatron's tensor-parallel all-reduces is: 1, or 2 with
        sequence parallelism (reduce-scatter + all-gather); 0 at tp = 1."""
        if cfg.tensor_parallel == 1:
            return 0
        return 2 if cfg.sequence_parallel else 1

    def context_parallel_s(self, cfg: ParallelConfig) -> float:
        """One pass of context-parallel attention's ring for one layer: c - 1 steps, each a
        transfer of one rank's keys and values ([s/c, b, 2 kv_heads head_dim / t],
        `ModelShape.kv_block_bytes`) paying the transfer latency; 0 at cp = 1. Forward
        runs one pass, backward two (`_layer_times`)."""
        c = cfg.context_parallel
        if c == 1:
            return 0.0
        size = self.model.kv_block_bytes(cfg.micro_batch_size, self.precision.activation_bytes,
                                         tp=cfg.tensor_parallel, cp=c)
        link = self.network(cfg).context_parallel
        return (c - 1) * (link.latency_s + size / link.bytes_per_s)

    def loss_allreduce_s(self, cfg: ParallelConfig) -> float:
        """One of the vocab-parallel cross entropy's all-reduces of [s/c, b] fp32 values."""
        size = 4.0 * self.model.seq_length * cfg.micro_batch_size / cfg.context_parallel
        net = self.network(cfg)
        return ring_allreduce_s(size, cfg.tensor_parallel, net.tensor_parallel.bytes_per_s,
                                net.tensor_parallel.latency_s)

    def p2p_s(self, cfg: ParallelConfig) -> float:
        """Slowest stage-to-stage transfer of one rank's [s, b, h] tensor ([s/c, b, h],
        [s/(c t), b, h] with sequence parallelism), latency included (the simulator takes
        one p2p time for every boundary, the wrap-around one of an interleaved schedule
        too)."""
        if cfg.pipeline_depth == 1:
            return 0.0
        size = self.model.boundary_bytes(cfg.micro_batch_size, self.precision.activation_bytes,
                                         tp=cfg.tensor_parallel, sp=cfg.sequence_parallel,
                                         cp=cfg.context_parallel)
        link = self.network(cfg).p2p
        return link.latency_s + size / link.bytes_per_s

    def allreduce_s(self, cfg: ParallelConfig, stage: int, params: int,
                    shard: Shard | SplitShard | None = None,
                    expert_params: int = 0) -> float:
        """Data-parallel gradient all-reduce of one stage (over the DP x CP ranks), plus
        the tied-embedding sync between first and last stage (pp > 1), which Megatron runs
        right after it. With the distributed optimizer (`shard`) a reduce-scatter of the
        padded gradient instead, and on the tied stages the embedding gradient all-reduced
        whole besides. With expert parallelism the `expert_params` of `params` are
        all-reduced apart, over the expert-data-parallel ranks (DP x CP / EP; at EP = 1
        they are the DP x CP ranks and one all-reduce takes all)."""
        net, grad_bytes = self.network(cfg), self.precision.grad_bytes
        dp, w = net.data_parallel[stage], cfg.gradient_ranks
        tied = cfg.pipeline_depth > 1 and stage in (0, cfg.pipeline_depth - 1)
        embedding = self.tied_embedding_params(cfg)
        if shard is None and expert_params and cfg.expert_parallel > 1:
            edp = net.expert_data_parallel[stage]
            seconds = (ring_allreduce_s((params - expert_params) * grad_bytes, w,
                                        dp.bytes_per_s, dp.latency_s)
                       + ring_allreduce_s(expert_params * grad_bytes, cfg.expert_data_parallel,
                                          edp.bytes_per_s, edp.latency_s))
        elif shard is None:
            seconds = ring_allreduce_s(params * grad_bytes, w, dp.bytes_per_s, dp.latency_s)
        else:  # a reduce-scatter moves what an all-gather does
            if isinstance(shard, SplitShard):  # each part over its own group
                edp = net.expert_data_parallel[stage]
                seconds = (ring_allgather_s(shard.dense.padded * grad_bytes, w,
                                            dp.bytes_per_s, dp.latency_s)
                           + ring_allgather_s(shard.experts.padded * grad_bytes,
                                              shard.experts.ranks, edp.bytes_per_s,
                                              edp.latency_s))
            else:
                seconds = ring_allgather_s(shard.padded * grad_bytes, w, dp.bytes_per_s,
                                           dp.latency_s)
            if tied:
                seconds += ring_allreduce_s(embedding * grad_bytes, w, dp.bytes_per_s,
                                            dp.latency_s)
        if tied:
            seconds += ring_allreduce_s(embedding * grad_bytes, 2, net.embedding.bytes_per_s,
                                        net.embedding.latency_s)
        return seconds

    def tied_embedding_params(self, cfg: ParallelConfig) -> int:
        """The word embedding on one tensor-parallel rank (the tied copy's size)."""
        vocab = self.model.padded_vocab(cfg.tensor_parallel)
        return vocab // cfg.tensor_parallel * self.model.hidden_size

    def step_s(self, cfg: ParallelConfig, stage: int, params: int,
               shard: Shard | SplitShard | None = None) -> float:
        """The optimizer step: memory-bound over the elements it steps (the shard's C with
        the distributed optimizer), plus then the all-gather of the new weights in the
        parameter dtype and the gradient norm's sum over DP (its latency), both blocking."""
        prec = self.precision
        stepped = params if shard is None else shard.chunk
        seconds = stepped * prec.step_bytes_touched / self.hardware.hbm_bytes_per_s
        if isinstance(shard, SplitShard):
            net = self.network(cfg)
            dp, edp = net.data_parallel[stage], net.expert_data_parallel[stage]
            for part, link in ((shard.dense, dp), (shard.experts, edp)):
                seconds += ring_allgather_s(part.padded * prec.param_bytes, part.ranks,
                                            link.bytes_per_s, link.latency_s)
            seconds += dp.latency_s
        elif shard is not None and shard.ranks > 1:
            dp = self.network(cfg).data_parallel[stage]
            seconds += (ring_allgather_s(shard.padded * prec.param_bytes, shard.ranks,
                                         dp.bytes_per_s, dp.latency_s) + dp.latency_s)
        return seconds


@dataclass(frozen=True)
class Link:
    """What one kind of communication gets in one layout: the alpha-beta pair."""

    bytes_per_s: float
    latency_s: float


@dataclass(frozen=True)
class Network:
    """Each kind of communication in one layout (the slowest group of its kind)."""

    tensor_parallel: Link
    data_parallel: tuple[Link, ...]
    """Per stage: the gradient reduction's group, DP x CP ranks."""
    embedding: Link
    p2p: Link
    context_parallel: Link = Link(0.0, 0.0)
    """The ring of context-parallel attention: its slowest hop, with the transfer latency."""
    expert_alltoall: Link = Link(0.0, 0.0)
    """A mixture of experts: the all-to-all over the EP ranks, its bytes_per_s the rate at
    which one rank's buffer goes (`placement.alltoall_bandwidth`)."""
    expert_dispatch: Link = Link(0.0, 0.0)
    """The TP x EP ranks' ring (the allgather dispatcher)."""
    expert_data_parallel: tuple[Link, ...] = ()
    """Per stage: the expert gradients' reduction group, DP x CP / EP ranks."""


@lru_cache(maxsize=1024)
def network(hw: Hardware, tp: int, dp: int, pp: int, wrap: bool = False,
            cp: int = 1, ep: int = 1, experts: bool = False) -> Network:
    """Where the groups of a (tp, cp, dp, pp) layout sit decides their bandwidth and
    latency (placement.py): a group inside a server gets the intra-node pair, one across
    servers the network's. `wrap`: the last stage also sends to the first (interleaving).
    `experts`: also the expert grid's groups at expert-parallel size `ep`."""
    lay = Layout(tp, dp, pp, hw.devices_per_node, cp, ep)

    def slowest(groups: list, concurrent: list) -> Link:
        if not groups:
            return Link(hw.intra_bytes_per_s, hw.collective_latency_s(False))
        return Link(min(collective_bandwidth(lay, g, concurrent, hw) for g in groups),
                    hw.collective_latency_s(any(lay.crosses(g) for g in groups)))
    every_dp = lay.gradient_groups()
    boundaries = range(pp if wrap and pp > 1 else pp - 1)
    rings = lay.cp_groups() if cp > 1 else []
    if experts:
        every_edp = lay.expert_gradient_groups()
        groups = lay.ep_groups()
        expert_links = dict(
            expert_alltoall=Link(alltoall_bandwidth(lay, groups, hw),
                                 hw.collective_latency_s(any(lay.crosses(g) for g in groups))),
            expert_dispatch=slowest(lay.tp_ep_groups(), lay.tp_ep_groups()),
            expert_data_parallel=tuple(slowest(lay.expert_gradient_groups(s), every_edp)
                                       for s in range(pp)))
    else:
        expert_links = {}
    return Network(
        tensor_parallel=slowest(lay.tp_groups(), lay.tp_groups()),
        data_parallel=tuple(slowest(lay.gradient_groups(s), every_dp) for s in range(pp)),
        embedding=slowest(lay.embedding_groups(), lay.embedding_groups()),
        p2p=Link(min((p2p_bandwidth(lay, s, hw) for s in boundaries),
                     default=hw.intra_bytes_per_s),
                 hw.p2p_latency_s(any(lay.boundary_crosses(s) for s in boundaries))),
        context_parallel=Link(min((collective_bandwidth(lay, g, rings, hw) for g in rings),
                                  default=hw.intra_bytes_per_s),
                              hw.p2p_latency_s(any(lay.crosses(g) for g in rings))),
        **expert_links)


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
    collectives: int = 0
    """Tensor-parallel collectives (0 at tp = 1)."""
    context_parallel: float = 0.0
    """Context parallelism's key/value exchange."""
    expert_parallel: float = 0.0
    """A mixture of experts' token dispatch and combine."""

    def __add__(self, other: "_MicrobatchTimes") -> "_MicrobatchTimes":
        return _MicrobatchTimes(*(a + b for a, b in zip(_fields(self), _fields(other))))

    def __mul__(self, k: int) -> "_MicrobatchTimes":
        return _MicrobatchTimes(*(a * k for a in _fields(self)))


def _fields(t: _MicrobatchTimes) -> tuple:
    return (t.forward, t.backward, t.compute, t.recompute, t.tensor_parallel, t.collectives,
            t.context_parallel, t.expert_parallel)


@dataclass(frozen=True)
class _LayerTimes:
    """One transformer layer at this tp and b, per microbatch, before recomputation (which
    depends on the stage's layer count under `--recompute-method block`)."""

    plain: _MicrobatchTimes
    full_recompute_s: float
    """The forward run again inside backward, compute only."""
    full_recompute_tp_s: float
    """Its 2 tensor-parallel all-reduces (pairs with sequence parallelism)."""
    selective_recompute_s: float
    """The core attention (QK^T, softmax, attention over V) run again: no all-reduce."""
    recompute_cp_s: float = 0.0
    """The forward pass of context parallelism's ring, run again by either recomputation
    (the core attention holds it)."""
    collectives_per_allreduce: int = 0
    """`CostModel.tensor_parallel_collectives_per_allreduce`."""
    recompute_allreduces: int = 2
    """Tensor-parallel all-reduces a full recomputation runs again (an MoE layer: the
    attention's one, and the shared experts' if any; its routed experts' traffic is the
    dispatch)."""
    full_recompute_ep_s: float = 0.0
    """An MoE layer's forward dispatch and combine, run again by full recomputation."""


def _layer_times(cm: CostModel, cfg: ParallelConfig) -> _LayerTimes:
    """One transformer layer at this tp, cp and b: per-microbatch seconds. Context
    parallelism's ring runs once in forward, twice in backward (keys and values again,
    and their gradients back to their owners)."""
    b, t, c = cfg.micro_batch_size, cfg.tensor_parallel, cfg.context_parallel
    ar = cm.tensor_parallel_allreduce_s(cfg)
    k = cm.tensor_parallel_collectives_per_allreduce(cfg)
    ring = cm.context_parallel_s(cfg)
    fwd, bwd = cm.layers.layer_forward_s(b, t, c), cm.layers.layer_backward_s(b, t, c)
    plain = _MicrobatchTimes(forward=fwd + 2 * ar + ring, backward=bwd + 2 * ar + 2 * ring,
                             compute=fwd + bwd, recompute=0.0, tensor_parallel=4 * ar,
                             collectives=4 * k, context_parallel=3 * ring)
    return _LayerTimes(plain,
                       full_recompute_s=cm.layers.layer_recompute_backward_s(b, t, c) - bwd,
                       full_recompute_tp_s=2 * ar,
                       selective_recompute_s=cm.layers.attention_core_forward_s(b, t, c),
                       recompute_cp_s=ring, collectives_per_allreduce=k)


def _moe_layer_times(cm: CostModel, cfg: ParallelConfig) -> _LayerTimes:
    """One MoE layer at this tp, cp, ep and b: the dense layer's compute times the ratio
    of their forward FLOPs (`ModelShape.moe_layer_forward_flops`, the count
    `ModelShape.training_flops` sums; the core attention, which selective recomputation
    repeats, is the dense layer's), the attention's tensor-parallel all-reduce in each
    direction, and the MLP's replaced by the token dispatch and combine
    (`CostModel.expert_dispatch_s`) in forward, in backward and in a full recomputation;
    shared experts, a tensor-parallel MLP, add their own all-reduce in each direction."""
    b, t, c = cfg.micro_batch_size, cfg.tensor_parallel, cfg.context_parallel
    ratio = cm.model.moe_layer_forward_flops(b, cm.experts) / cm.model.layer_forward_flops(b)
    n_ar = 2 if cm.experts.shared_size else 1
    ar = n_ar * cm.tensor_parallel_allreduce_s(cfg)
    k = cm.tensor_parallel_collectives_per_allreduce(cfg)
    ring = cm.context_parallel_s(cfg)
    dispatch = cm.expert_dispatch_s(cfg)
    dense_bwd = cm.layers.layer_backward_s(b, t, c)
    fwd, bwd = cm.layers.layer_forward_s(b, t, c) * ratio, dense_bwd * ratio
    plain = _MicrobatchTimes(forward=fwd + ar + ring + dispatch,
                             backward=bwd + ar + 2 * ring + dispatch,
                             compute=fwd + bwd, recompute=0.0, tensor_parallel=2 * ar,
                             collectives=2 * n_ar * k, context_parallel=3 * ring,
                             expert_parallel=2 * dispatch)
    return _LayerTimes(plain,
                       full_recompute_s=(cm.layers.layer_recompute_backward_s(b, t, c)
                                         - dense_bwd) * ratio,
                       full_recompute_tp_s=ar,
                       selective_recompute_s=cm.layers.attention_core_forward_s(b, t, c),
                       recompute_cp_s=ring, collectives_per_allreduce=k,
                       recompute_allreduces=n_ar, full_recompute_ep_s=dispatch)


def _mixed(dense, moe, k: int, n: int):
    """Per-layer values of n layers of which k are MoE layers: the average, so that n
    times it is their sum (`_LayerTimes` or `_LayerBytes`, field by field); a stage of
    one kind gets that kind's values exactly."""
    if k == 0:
        return dense
    if k == n:
        return moe

    def avg(a, b):
        if isinstance(a, _MicrobatchTimes):
            return _MicrobatchTimes(*(avg(x, y) for x, y in zip(_fields(a), _fields(b))))
        return (a * (n - k) + b * k) / n

    kind = type(dense)
    return kind(**{f: avg(getattr(dense, f), getattr(moe, f))
                   for f in kind.__dataclass_fields__})


def _stage_layer_times(layer: _LayerTimes, rc: Recompute, n: int) -> _MicrobatchTimes:
    """n layers of one stage under `rc`: full recomputation adds one forward (and its 2
    all-reduces) per recomputed layer, selective the core attention of every layer; both
    run context parallelism's forward ring again for each layer they recompute."""
    full = rc.full_layers(n)
    selective = n if rc.granularity == "selective" else 0
    rc_s = full * layer.full_recompute_s + selective * layer.selective_recompute_s
    rc_tp = full * layer.full_recompute_tp_s
    rc_cp = (full + selective) * layer.recompute_cp_s
    rc_ep = full * layer.full_recompute_ep_s
    p = layer.plain
    return _MicrobatchTimes(forward=n * p.forward,
                            backward=n * p.backward + rc_s + rc_tp + rc_cp + rc_ep,
                            compute=n * p.compute, recompute=rc_s,
                            tensor_parallel=n * p.tensor_parallel + rc_tp,
                            collectives=n * p.collectives
                            + layer.recompute_allreduces * full * layer.collectives_per_allreduce,
                            context_parallel=n * p.context_parallel + rc_cp,
                            expert_parallel=n * p.expert_parallel + rc_ep)


def _chunked_layer_times(layer: _LayerTimes, rc: Recompute, n: int, v: int) -> _MicrobatchTimes:
    """A stage's n layers as v model chunks of n / v, each its own megatron-core block
    (recomputation options apply per chunk: block N recomputes each chunk's first N)."""
    return _stage_layer_times(layer, rc, n // v) * v


def _ends_times(cm: CostModel, cfg: ParallelConfig, first: bool, last: bool) -> _MicrobatchTimes:
    """Embedding (first stage) and output layer (last stage): per-microbatch seconds.

    With tp > 1 the vocab-parallel embedding all-reduces its output in forward and the
    output layer all-reduces its input gradient in backward (one [s, b, h] each), and the
    vocab-parallel loss does `LOSS_ALLREDUCES` small all-reduces in forward. With sequence
    parallelism each of the two is a pair split over forward and backward: the
    embedding reduce-scatters its output (forward) and all-gathers its gradient
    (backward), the output layer all-gathers its input (forward) and reduce-scatters its
    input gradient (backward).
    """
    b, t, c = cfg.micro_batch_size, cfg.tensor_parallel, cfg.context_parallel
    ar = cm.tensor_parallel_allreduce_s(cfg)
    k = cm.tensor_parallel_collectives_per_allreduce(cfg)
    half = ar / 2 if cfg.sequence_parallel else 0.0  # one collective of the pair
    loss = LOSS_ALLREDUCES * cm.loss_allreduce_s(cfg) if t > 1 else 0.0
    fwd = bwd = tp_fwd = tp_bwd = 0.0
    count = 0
    if first:
        ef, eb = cm.layers.embedding_s(b, c)
        fwd, bwd = fwd + ef, bwd + eb
        tp_fwd, tp_bwd, count = tp_fwd + ar - half, tp_bwd + half, count + k
    if last:
        of, ob = cm.layers.output_s(b, t, c)
        fwd, bwd = fwd + of, bwd + ob
        tp_fwd, tp_bwd = tp_fwd + half + loss, tp_bwd + ar - half
        count += k + (LOSS_ALLREDUCES if t > 1 else 0)
    compute = fwd + bwd
    return _MicrobatchTimes(forward=fwd + tp_fwd, backward=bwd + tp_bwd,
                            compute=compute, recompute=0.0, tensor_parallel=tp_fwd + tp_bwd,
                            collectives=count)


def _stage_params(model: ModelShape, cfg: ParallelConfig, stage: int, layers: int,
                  experts: Experts | None = None, moe_layers: int = 0) -> int:
    t, d = cfg.tensor_parallel, cfg.pipeline_depth
    params = layers * _layer_params_per_rank(model, t)
    if stage == 0:
        params += model.embedding_params(t)
    if stage == d - 1:
        params += model.output_params(t, d) + _mtp_params_per_rank(model, cfg, experts)
    if moe_layers:
        params += moe_layers * (_moe_layer_params_per_rank(model, experts, t,
                                                           cfg.expert_parallel)
                                - _layer_params_per_rank(model, t))
    return params


def _mtp_params_per_rank(model: ModelShape, cfg: ParallelConfig,
                         experts: Experts | None) -> int:
    """The MTP block on a rank of the last stage (megatron-core 0.16.1 puts it there):
    per MTP layer the decoder's last layer as this rank holds it (dense or MoE), eh_proj
    column-parallel (2h x h / t) and its three norms whole (`ModelShape.mtp_layer_params`)."""
    depth, t, h = model.mtp_depth, cfg.tensor_parallel, model.hidden_size
    if not depth:
        return 0
    if experts is not None and experts.is_moe_layer(model.num_layers - 1):
        layer = _moe_layer_params_per_rank(model, experts, t, cfg.expert_parallel)
    else:
        layer = _layer_params_per_rank(model, t)
    proj = 2 * h * h
    return depth * (layer + proj // t + model.mtp_layer_params() - proj)


def _mtp_times(cm: CostModel, cfg: ParallelConfig, layer: _LayerTimes,
               moe: _LayerTimes | None) -> _MicrobatchTimes:
    """The last stage's MTP block per microbatch: D layers like the decoder's last (under
    the run's recomputation, as megatron-core recomputes them) and D more logits passes
    (eh_proj's 2h x h GEMM is left to the layer's overhead)."""
    depth = cm.model.mtp_depth
    last = moe if moe is not None and cm.mtp_moe_layers() else layer
    b, t, c = cfg.micro_batch_size, cfg.tensor_parallel, cfg.context_parallel
    of, ob = cm.layers.output_s(b, t, c)
    logits = _MicrobatchTimes(forward=of, backward=ob, compute=of + ob, recompute=0.0,
                              tensor_parallel=0.0)
    return _stage_layer_times(last, cfg.recompute, depth) + logits * depth


def _moe_layer_params_per_rank(model: ModelShape, experts: Experts, t: int, ep: int) -> int:
    """An MoE layer on one rank: the dense layer's attention and norms as
    `_layer_params_per_rank` splits them, the router whole (megatron-core replicates it
    over TP), E / EP experts split over ETP = TP (each one's fc2 bias whole), and the
    shared experts split over TP (no biases; every EP rank holds them whole)."""
    h = model.hidden_size
    attention = model.layer_params() - experts.mlp_params(model, model.ffn_size)
    replicated = 4 * h + h  # 2 LayerNorms, the projection's bias
    return ((attention - replicated) // t + replicated + experts.router_params(model)
            + experts.shared_params(model) // t
            + _expert_params_per_rank(model, experts, t, ep))


def _expert_params_per_rank(model: ModelShape, experts: Experts, t: int, ep: int) -> int:
    """One MoE layer's routed experts on one rank: E / EP of them, each split over t."""
    h = model.hidden_size
    return experts.num_experts // ep * ((experts.expert_params(model) - h) // t + h)


def _layer_params_per_rank(model: ModelShape, t: int) -> int:
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
    """The [s, b, h] input a fully recomputed chunk keeps (2sbh at 16 bit; / c, and / t
    with sequence parallelism)."""


def _layer_bytes(cm: CostModel, cfg: ParallelConfig) -> _LayerBytes:
    b, t = cfg.micro_batch_size, cfg.tensor_parallel
    sp, c = cfg.sequence_parallel, cfg.context_parallel
    return _LayerBytes(full=cm.layers.layer_activation_bytes(b, t, sp=sp, cp=c),
                       selective=cm.layers.layer_selective_activation_bytes(b, t, sp=sp, cp=c),
                       layer_input=cm.model.boundary_bytes(b, cm.precision.activation_bytes,
                                                           tp=t, sp=sp, cp=c))


def _moe_layer_bytes(cm: CostModel, cfg: ParallelConfig, dense: _LayerBytes) -> _LayerBytes:
    """An MoE layer's: the dense layer's bytes (measured or by formula) times the ratio
    of the formulas (`Experts.layer_activation_bytes` over `ModelShape`'s)."""
    b, t = cfg.micro_batch_size, cfg.tensor_parallel
    sp, c = cfg.sequence_parallel, cfg.context_parallel
    m, e = cm.model, cm.experts
    full = (e.layer_activation_bytes(m, b, t, sp=sp, cp=c)
            / m.layer_activation_bytes(b, t, sp=sp, cp=c))
    selective = (e.layer_selective_activation_bytes(m, b, t, sp=sp, cp=c)
                 / m.layer_selective_activation_bytes(b, t, sp=sp, cp=c))
    return _LayerBytes(full=dense.full * full, selective=dense.selective * selective,
                       layer_input=dense.layer_input)


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
                      declared: "_Declared") -> float:
    """Stashed microbatches x bytes each, + what backward rebuilds when recomputing.

    Without recomputation a stashed microbatch keeps every layer's activations; with
    full recomputation it keeps only each recomputed chunk's input, and backward
    rebuilds one chunk at a time (paper Section 3; Korthikanti et al. 2022 Sections 4-5).
    With v model chunks the stash counts (microbatch, chunk) units of n / v layers each;
    the embedding's bytes belong to chunk 0 of the first stage and the output layer's to
    the last chunk of the last stage, so the peak is taken over the schedule's own
    stash points (`_chunk_peaks`), not the unit count times the largest unit. The MTP
    block's D layers and D logits count with the output layer's bytes.
    """
    b, t, d, v = cfg.micro_batch_size, cfg.tensor_parallel, cfg.pipeline_depth, cfg.virtual_stages
    sp, c = cfg.sequence_parallel, cfg.context_parallel
    per = _layer_bytes(cm, cfg)
    n = layers // v
    unit = _kept_bytes(per, cfg.recompute, n)
    first = (cm.model.embedding_activation_bytes(b, tp=t, sp=sp, cp=c) if stage == 0
             else 0.0)
    last = cm.model.output_activation_bytes(b, t, sp=sp, cp=c) if stage == d - 1 else 0.0
    rebuilt = _rebuilt_bytes(per, cfg.recompute, n)
    moe = _moe_layer_bytes(cm, cfg, per) if cm.experts is not None else None
    if stage == d - 1 and cm.model.mtp_depth:  # D layers like the last, D more logits
        mtp = moe if cm.mtp_moe_layers() else per
        last += cm.model.mtp_depth * (_kept_bytes(mtp, cfg.recompute, 1) + last)
    if moe is not None:  # each chunk its own mix of MoE and dense layers
        chunks = cm.stage_chunks(cfg, stage)
        unit = max(_kept_bytes(_mixed(per, moe, k, size), cfg.recompute, size)
                   for size, k in chunks)
        if any(k for _, k in chunks):  # the largest layer is rebuilt
            rebuilt = max(rebuilt, _rebuilt_bytes(moe, cfg.recompute, n))
    if v == 1:
        stashed = declared.stash_limit[stage] * (unit + first + last)
    else:
        stashed = max(total * unit + c_first * first + c_last * last
                      for total, c_first, c_last in declared.chunk_peaks[stage])
    return stashed + rebuilt


def _state_bytes(cm: CostModel, cfg: ParallelConfig, stage: int, params: int,
                 declared: "_Declared", shard: Shard | None,
                 activations: float) -> StateBytes:
    """Weights x declared versions, gradient buffers, optimizer state, for one stage.

    Without sharding: params x (2 B x versions + 4 B x buffers + 12 B (+ compensation)).
    With `--use-distributed-optimizer` (`shard`) the masters, moments and compensation
    are the largest rank's C elements' (`DistributedUpdater.state_bytes`), while the
    weight versions stay whole and every gradient buffer stays whole too, padded to w C
    (it is reduce-scattered in place), plus `_sharding_buffers`: all of them under a
    schedule that steps while microbatches are stashed (2BW), only what exceeds the
    `activations` under one that flushes (Flush, GPipe: the reduction and the step run
    after the last backward, when the stash is empty).
    """
    prec = cm.precision
    optimizer = prec.optimizer_bytes + (prec.compensation_bytes if cfg.spec.delayed else 0)
    weights = float(params * prec.param_bytes)
    versions = weights * (declared.weight_versions - 1)
    if shard is None:
        return StateBytes(weights, versions, float(params * prec.grad_bytes
                                                   * declared.grad_buffers),
                          float(params * optimizer))
    buffers = _sharding_buffers(cm, cfg, stage, shard)
    if cfg.spec.flushes:
        buffers = max(0.0, buffers - activations)
    return StateBytes(weights, versions,
                      float(shard.padded * prec.grad_bytes * declared.grad_buffers),
                      float(shard.chunk * optimizer), buffers)


def _sharding_buffers(cm: CostModel, cfg: ParallelConfig, stage: int, shard: Shard) -> float:
    """What the runtime's distributed optimizer allocates besides the state:

    - in the step: the all-gather's buffer, w C in the parameter dtype, and a copy of the
      rank's own chunk (C) (`DistributedUpdater._gather_no_grad`, comm.sharding.all_gather;
      with experts sharded apart, the larger part's over more than one rank);
    - from the reduction's start to its wait, which under 2BW spans the next minibatch's
      compute: on the tied stages (pp > 1) an fp32 copy of the word-embedding gradient
      for its whole all-reduce, and with whole matrices the gradient packed into chunk
      order (w C fp32) (`ShardedGradReducer`); the step's buffers come after the wait, so
      the larger of the two sets counts;
    - with whole matrices, the updater's own fp32 shard of the gradient (C), always.
    """
    prec = cm.precision
    if isinstance(shard, SplitShard):  # one part at a time; a part on one rank has none
        gather = max((p.padded + p.chunk for p in shard.parts if p.ranks > 1),
                     default=0) * prec.param_bytes
    else:
        gather = (shard.padded + shard.chunk) * prec.param_bytes
    reducing = 0
    if cfg.pipeline_depth > 1 and stage in (0, cfg.pipeline_depth - 1):
        reducing += cm.tied_embedding_params(cfg) * prec.grad_bytes
    if not shard.contiguous:
        reducing += shard.padded * prec.grad_bytes
    own = 0 if shard.contiguous else shard.chunk * prec.grad_bytes
    return float(max(gather, reducing) + own)


def _stage_costs(cm: CostModel, cfg: ParallelConfig) -> tuple[tuple[StageCost, ...], float]:
    d, m, v = cfg.pipeline_depth, cfg.num_microbatches, cfg.virtual_stages
    if v > 1:
        cfg.chunk_layers(cm.model.num_layers)  # ValueError unless the stages split evenly
    layer = _layer_times(cm, cfg)
    moe = _moe_layer_times(cm, cfg) if cm.experts is not None else None
    declared = _declared(cfg.schedule, d, m, v)  # what the runtime allocates, per stage
    out = []
    for s, n in enumerate(cfg.stage_layers(cm.model.num_layers)):
        moe_layers, expert_params = 0, 0
        if moe is None:
            body = _chunked_layer_times(layer, cfg.recompute, n, v)
        else:
            chunks = cm.stage_chunks(cfg, s)
            body = _MicrobatchTimes(0.0, 0.0, 0.0, 0.0, 0.0)
            for size, k in chunks:
                body = body + _stage_layer_times(_mixed(layer, moe, k, size), cfg.recompute,
                                                 size)
            moe_layers = sum(k for _, k in chunks)
            expert_params = moe_layers * _expert_params_per_rank(
                cm.model, cm.experts, cfg.tensor_parallel, cfg.expert_parallel)
        ends = _ends_times(cm, cfg, s == 0, s == d - 1)
        if s == d - 1 and cm.model.mtp_depth:
            ends = ends + _mtp_times(cm, cfg, layer, moe)
            if cm.mtp_moe_layers():
                expert_params += cm.mtp_moe_layers() * _expert_params_per_rank(
                    cm.model, cm.experts, cfg.tensor_parallel, cfg.expert_parallel)
        params = _stage_params(cm.model, cfg, s, n, cm.experts, moe_layers)
        shard = cm.shard(cfg, s, params, n)
        activations = _activation_bytes(cm, cfg, s, n, declared)
        state = _state_bytes(cm, cfg, s, params, declared, shard, activations)
        total = body + ends
        out.append(StageCost(
            stage=s, layers=n, params=params,
            forward_s=total.forward, backward_s=total.backward, compute_s=total.compute,
            recompute_s=total.recompute, tensor_parallel_s=total.tensor_parallel,
            tensor_parallel_collectives=round(total.collectives),
            context_parallel_s=total.context_parallel,
            allreduce_s=cm.allreduce_s(cfg, s, params, shard, expert_params),
            step_s=cm.step_s(cfg, s, params, shard),
            weight_bytes=state.total,
            activation_bytes=activations,
            stash=declared.stash_limit[s], state=state,
            expert_parallel_s=total.expert_parallel, expert_params=expert_params))
    return tuple(out), cm.p2p_s(cfg)


def pipeline_lower_bound_s(schedule: str, m: int, costs: Costs, v: int = 1) -> float:
    """Lower bound on `pipeline_timing(schedule, d, m, costs, v).iteration_s`.

    Not a prediction (the simulator makes those), only a pruning bound; tests check it
    against the simulator on random costs. Three facts, each read from the schedule's
    registry entry:
    - a stage runs its m forwards and m backwards one after another;
    - a schedule that flushes (Flush, GPipe): stage s cannot start before the first
      forward has crossed the stages before it (with v chunks: the first chunk's, 1 / v
      of each stage's forward); the microbatch of its last backward then crosses the
      stages before it backwards (their first chunk's backward each), and the minibatch
      ends with the first stage's all-reduce and the step;
    - a 1F1B steady state (Flush, 2BW, not interleaved): the last stage's forward of
      microbatch i + 1 waits for stage d - 2 to finish the backward of i - 1 and the
      forward of i + 1, two transfers in between, so every two microbatches cost at
      least 2 p2p + both stages' F + B.
    """
    d = len(costs.forward) if not isinstance(costs.forward, (int, float)) else 1
    work = [costs.of("forward", s) + costs.of("backward", s) for s in range(d)]
    bound = m * max(work)
    spec = schedule_spec(schedule)
    if spec.flushes:
        fill = drain = 0.0
        for s in range(d):
            bound = max(bound, fill + m * work[s] + costs.of("allreduce", s) + costs.of("step", s),
                        fill + m * work[s] + drain + costs.of("allreduce", 0) + costs.of("step", 0))
            fill += costs.of("forward", s) / v + costs.p2p
            drain += costs.of("backward", s) / v + costs.p2p
    if spec.one_f_one_b and d >= 2 and v == 1:
        bound = max(bound, (m - 1) // 2 * (2 * costs.p2p + work[d - 2] + work[d - 1]))
    return bound


@dataclass(frozen=True)
class _Declared:
    """What a schedule declares about its memory: stashes per stage, weight versions and
    gradient buffers; with v model chunks also each stage's stash points."""

    stash_limit: tuple[int, ...]
    weight_versions: int
    grad_buffers: int
    chunk_peaks: tuple[tuple[tuple[int, int, int], ...], ...] = ()
    """Per stage (v > 1): the maximal (stashed units, of them in chunk 0, of them in the
    last chunk) over the stage's action order (`_chunk_peaks`)."""


@lru_cache(maxsize=4096)
def _declared(name: str, d: int, m: int, v: int = 1) -> _Declared:
    """The declarations only, cached on their own: every configuration of a search asks,
    and `_schedule` keeps only a few action lists. Flush and 2BW stash at most d - s
    microbatches on stage s, so they declare the same for every m >= d and are built
    with min(m, d) microbatches (a test checks this against full builds); GPipe stashes
    all m and is built whole (`ScheduleSpec.planner_microbatches`). Interleaved flush
    stashes at most its warm-up + 1 units, 2 (d - s - 1) + (v - 1) d + 1 < 2 v d, and
    repeats itself every d microbatches, so it is built with min(m, 3d) (m is a multiple
    of d; a test checks against full builds)."""
    built = schedule_spec(name).planner_microbatches(d, m, v)
    sched = build_schedule(name, d, built, 1, tied_embedding=d > 1, check=False, num_chunks=v)
    peaks = tuple(_chunk_peaks(sched[s], v) for s in range(d)) if v > 1 else ()
    return _Declared(tuple(sched.stash_limit), sched.weight_versions, sched.grad_buffers, peaks)


def _chunk_peaks(actions, v: int) -> tuple[tuple[int, int, int], ...]:
    """The maximal (stashed units, units of chunk 0, units of chunk v - 1) a stage reaches
    (after each forward), with dominated points dropped: the peak of any per-unit bytes
    with extra bytes on the first or last chunk is the max over these points."""
    live = [0] * v
    points = set()
    for a in actions:
        if a.kind == FORWARD:
            live[a.chunk] += 1
            points.add((sum(live), live[0], live[v - 1]))
        elif a.kind == BACKWARD:
            live[a.chunk] -= 1
    return tuple(sorted(p for p in points
                        if not any(q != p and all(x >= y for x, y in zip(q, p)) for q in points)))


@lru_cache(maxsize=32)
def _schedule(name: str, d: int, m: int, n: int, v: int = 1) -> Schedule:
    """The schedule the runtime would run (tied embeddings, the default step placement),
    built once per shape: many configurations share (schedule, d, m, v). Validation is the
    schedules package's job (its tests); the simulator still raises on a deadlock."""
    return build_schedule(name, d, m, n, tied_embedding=d > 1, check=False, num_chunks=v)


@lru_cache(maxsize=65536)
def pipeline_timing(schedule: str, d: int, m: int, costs: Costs, v: int = 1) -> PipelineTiming:
    """Steady-state time of one minibatch of `schedule` (v model chunks per stage), from
    the simulator. The peak stashes count (microbatch, chunk) units when v > 1.

    A schedule that never drains (2BW) pays its pipeline fill once per run, so its
    iteration is the steady state between two minibatches, makespan(3 minibatches) -
    makespan(2); one that flushes (Flush, GPipe) is timed over one minibatch
    (`ScheduleSpec.steady_state_minibatches`)."""
    before, after = schedule_spec(schedule).steady_state_minibatches
    end = simulate(_schedule(schedule, d, m, after, v), costs)
    if before == 0:
        return PipelineTiming(end.makespan, tuple(end.busy[s] for s in range(d)),
                              tuple(end.peak_stashes[s] for s in range(d)))
    start = simulate(_schedule(schedule, d, m, before, v), costs)
    return PipelineTiming(end.makespan - start.makespan,
                          tuple(end.busy[s] - start.busy[s] for s in range(d)),
                          tuple(end.peak_stashes[s] for s in range(d)))
