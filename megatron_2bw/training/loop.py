"""The training loop: build the stage, the updater and the executor, run segments.

A segment is one schedule of consecutive minibatches. Flush and GPipe drain after
every minibatch anyway; 2BW runs one uninterrupted schedule per segment and drains
only where the pipeline must be empty: at checkpoints, validation and the end.
"""
from __future__ import annotations

import functools
import logging
import time
import itertools
from typing import Optional

import torch
from megatron.core import parallel_state as ps

from .. import comm
from ..data.datasets import microbatches
from ..models import build_stage, model_parallel_manual_seed
from .context_batch import context_parallel_batch
from ..optim.muon import (MuonParamSpec, TensorParallel, is_megatron_muon_param,
                          is_megatron_qkv_param, qkv_split_rows)
from ..comm.sharding import ExpertShards, ShardLayout
from ..optim.distributed import DistributedUpdater
from ..optim.updater import MegatronUpdater, ParamInfo, StepGroups
from ..runtime import PipelineExecutor, RunResult
from ..runtime.grad_sync import (GradReduceConfig, GradReducer, SequenceParallelSum,
                                 ShardedGradReducer, TiedGradSync)
from ..runtime.p2p import PeerTimeout, is_timeout
from ..runtime.topology import context_parallel, data_parallel_group, stage_links
from ..schedules import Schedule, build_eval_schedule, build_schedule, schedule_spec
from ..checkpointing.contents import megatron_args
from ..checkpointing.save_load import (SaveOptions, prepare_resume, read_checkpoint, restore,
                            save_checkpoint)
from .config import RunConfig
from .data_sources import DataSources
from . import experts, mtp
from .distributed import DistEnv
from .errors import describe
from .args_dump import log_arguments, parameter_count_lines
from .housekeeping import Housekeeping
from .log_writers import perplexity
from .metrics import MetricsSink, transformer_flops
from .rank_reports import RankReports, ReportSetup, weighted_squares
from .theoretical_memory import MemoryInputs, theoretical_memory_lines
from .signals import PROGRESS, GracefulStop, stop_check_interval
from .progress import evaluation_progress
from .skip_guard import SkipGuard, Verdict, check_weights_finite, stopped
from .watchdog import Heartbeat, save_guard

logger = logging.getLogger("megatron_2bw.train")

# Longest schedule built at once (minibatches). 2BW drains the pipeline at each segment
# end; one drain per thousand minibatches costs nothing measurable and keeps the action
# lists (and their validation) small.
MAX_SEGMENT = 1000



def _muon_spec(name: str, p, run: RunConfig) -> MuonParamSpec | None:
    """Megatron-LM's rule: Muon steps the 2D weights but the word embedding and output layer."""
    if run.optimizer.optimizer != "muon" or not is_megatron_muon_param(p):
        return None
    m = run.model  # the fused QKV's rows per query group: [q heads of the group, k, v]
    qkv = (qkv_split_rows(m.num_attention_heads, m.query_groups, m.head_dim)
           if is_megatron_qkv_param(name, p) else None)
    split = getattr(p, "tensor_model_parallel", False) and not (
        experts.expert_mask([name])[0] and ps.get_expert_tensor_parallel_world_size() == 1)
    dim = getattr(p, "partition_dim", None) if split else None  # an expert at ETP 1: whole
    return MuonParamSpec(tuple(p.shape), partition_dim=dim, qkv_split=qkv)


def _param_infos(module, tp_rank: int, run: RunConfig) -> list[ParamInfo]:
    """One entry per trained parameter, in the order the weight buffers hold them."""
    tied = module.shared_embedding_weight()
    last_copy = tied is not None and module.is_last and not module.is_first
    infos = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        is_tied = tied is not None and p is tied
        expert = experts.expert_mask([name])[0]
        counted = experts.counts_in_norm(p, expert, tp_rank)
        infos.append(ParamInfo(name=name, decay=p.dim() > 1 and not name.endswith(".bias"),
                               counts_in_norm=counted and not (is_tied and last_copy),
                               tied=is_tied, muon=_muon_spec(name, p, run),
                               embedding_or_output=getattr(
                                   p, "is_embedding_or_output_parameter", False),
                               expert=expert))
    return infos


def _grad_reduce(run: RunConfig) -> GradReduceConfig:
    """Megatron-LM's gradient precision: fp32 unless --grad-reduce-in-bf16."""
    return GradReduceConfig(torch.bfloat16 if run.parallel.grad_reduce_in_bf16
                            else torch.float32)


def _offsets(params: list) -> list[int]:
    """Where each parameter starts in the stage's flat gradient (and the end)."""
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())
    return offsets


def _sequence_parallel_sum(params: list, infos: list[ParamInfo],
                           run: RunConfig) -> Optional[SequenceParallelSum]:
    """The TP sum of the gradients sequence parallelism leaves partial (megatron-core's
    `sequence_parallel` parameters: norms, row-parallel biases, the router; not a routed
    expert's, whose tokens the dispatcher brought whole), or None without SP."""
    offsets = _offsets(params)
    ranges = tuple((offsets[i], p.numel()) for i, (p, info) in enumerate(zip(params, infos))
                   if getattr(p, "sequence_parallel", False) and not info.expert)
    if not ranges:
        return None
    return SequenceParallelSum(ps.get_tensor_model_parallel_group(), ranges,
                               _grad_reduce(run).dtype)


def _sharding(params: list, infos: list[ParamInfo], run: RunConfig, schedule: Schedule,
              sp_sum: Optional[SequenceParallelSum]
              ) -> tuple[ShardLayout, Optional[ExpertShards], ShardedGradReducer]:
    """--use-distributed-optimizer: the stage's shard layout over data parallelism (Muon's
    matrices whole), with a mixture of experts in their own groups the experts' over the
    expert-data-parallel group beside it, and the reducer that reduce-scatters into
    them; on the stages that sum the tied embedding gradient, that gradient is
    all-reduced whole besides."""
    group = data_parallel_group()
    numels, whole = [p.numel() for p in params], [i.muon is not None for i in infos]
    mask = [i.expert for i in infos]
    shards = experts.expert_shards(numels, whole, mask)
    layout = ShardLayout(numels, whole, comm.size(group) if group is not None else 1,
                         members=None if shards is None else [not e for e in mask])
    offsets = _offsets(params)
    full = tuple((offsets[i], params[i].numel()) for i, info in enumerate(infos)
                 if info.tied and ps.get_pipeline_model_parallel_rank() in schedule.tied_stages)
    return layout, shards, ShardedGradReducer(group, layout, _grad_reduce(run), full, sp_sum,
                                              shards)


def _tied_sync(schedule: Schedule, stage: int, infos: list[ParamInfo],
               run: RunConfig) -> TiedGradSync | None:
    """The tied-embedding gradient sum, on the stages the schedule declares for it."""
    if stage not in schedule.tied_stages:
        return None
    index = next(i for i, info in enumerate(infos) if info.tied)
    return TiedGradSync(ps.get_embedding_group(), index,
                        counts_in_norm=stage == min(schedule.tied_stages),
                        dtype=_grad_reduce(run).dtype)


def stop_iteration(start: int, train_iters: int, exit_interval: Optional[int]) -> int:
    """Where a run that starts after iteration `start` stops: --train-iters, or with
    --exit-interval N the first multiple of N after `start`, as Megatron-LM exits at every
    iteration % N == 0 (a requeued job then moves on by N each time, rather than stopping
    at once because one fixed iteration is behind it)."""
    if not exit_interval:
        return train_iters
    return min(train_iters, (start // exit_interval + 1) * exit_interval)


class Trainer:
    """One process's part of a run."""

    def __init__(self, run: RunConfig, env: DistEnv, sources: DataSources):
        self.run, self.env, self.sources = run, env, sources
        par = run.parallel
        ps.initialize_model_parallel(tensor_model_parallel_size=par.tensor_parallel,
                                     pipeline_model_parallel_size=par.pipeline_parallel,
                                     context_parallel_size=par.context_parallel,
                                     expert_model_parallel_size=par.expert_parallel,
                                     expert_tensor_parallel_size=par.expert_tensor_parallel,
                                     distributed_timeout_minutes=env.timeout.total_seconds() / 60)
        model_parallel_manual_seed(run.train.seed + 100 * ps.get_pipeline_model_parallel_rank())
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        t = run.train
        loaded = (read_checkpoint(t.load, overwrite=t.overwrite_checkpoints,
                                  step=t.ckpt_step, required=t.exit_on_missing_checkpoint)
                  if t.load else None)
        self.iteration = prepare_resume(loaded, run)  # refuses before any work
        self.executor, self.updater = self._build(self._schedule(1))
        if loaded:
            loaded.load_tensors(t.load, self.executor, self.updater, t)
            restore(loaded, self.executor, self.updater, run)
            logger.info(f"resumed from {t.load} at iteration {self.iteration}")
        is_logger = env.rank == env.world_size - 1
        label = (par.schedule if par.virtual_stages == 1 else
                 f"{par.schedule} interleaved, {par.virtual_stages} chunks per rank")
        self.sink = MetricsSink(is_logger, t, schedule=label,
                                world_size=env.world_size, start_iteration=self.iteration,
                                flags=run.flags, delayed=schedule_spec(par.schedule).delayed,
                                device=env.device)
        self._report_parameters()
        self._report_optimizer_memory()
        self.reports = self._rank_reports(is_logger)
        self.history: dict[int, dict] = {}
        self._activations_reported = False
        self.stop_at = stop_iteration(self.iteration, t.train_iters, t.exit_interval)
        self.housekeeping = Housekeeping(t.housekeeping, env.rank, env.device)
        self.skip_guard = SkipGuard(t.skip_guard, self.iteration)
        self._verdict: Optional[Verdict] = None  # why the run stops mid-segment, once known
        if t.skip_guard.check_ignored:
            logger.info("--check-for-nan-in-loss-and-grad is off under fp16's dynamic loss "
                        "scaling, where an inf is the loss scaler's signal (as Megatron-LM); "
                        "--max-consecutive-skipped-iterations bounds the skips instead")

    def _build_stage(self):
        """This rank's model part: one stage, or its model chunks (virtual stages)."""
        par = self.run.parallel
        return build_stage(self.run.model, self.stage, par.pipeline_parallel,
                           num_chunks=par.virtual_stages).to(self.env.device)

    def _build(self, schedule: Schedule) -> tuple[PipelineExecutor, MegatronUpdater]:
        """The stage, its updater and an executor allocated from `schedule`'s declarations."""
        run = self.run
        module = self._build_stage()
        infos = _param_infos(module, ps.get_tensor_model_parallel_rank(), run)
        params = [p for p in module.parameters() if p.requires_grad]
        self._param_infos, self._num_parameters = infos, sum(p.numel()
                                                             for p in module.parameters())
        tp_group = ps.get_tensor_model_parallel_group()
        # Muon's gather of a tensor-parallel matrix (none needed for a group of one)
        gather = functools.partial(comm.gather_concat, group=tp_group) if comm.runs(tp_group) else None
        tp = TensorParallel(ps.get_tensor_model_parallel_rank(),
                            ps.get_tensor_model_parallel_world_size(), gather)
        mask = [i.expert for i in infos]
        groups = StepGroups(model_parallel=ps.get_model_parallel_group(),
                            expert_model_parallel=experts.expert_norm_group() if any(mask)
                            else None)
        sp_sum = _sequence_parallel_sum(params, infos, run)
        reducer = GradReducer(data_parallel_group(), _grad_reduce(run), sp_sum,
                              experts.expert_gradients(mask, _offsets(params)))
        layout = None
        # one data-parallel rank has nothing to shard (data_parallel_group() is None
        # where the comm layer says the group does not run)
        if run.parallel.distributed_optimizer and data_parallel_group() is not None:
            layout, shards, reducer = _sharding(params, infos, run, schedule, sp_sum)
            updater = DistributedUpdater(params, infos, run.optimizer, layout,
                                         data_parallel_group(), groups, tp, shards)
        else:
            updater = MegatronUpdater(params, infos, run.optimizer, groups, tp)
        links = stage_links(module.boundary_shape(run.train.micro_batch_size),
                            module.boundary_dtype, self.env.device,
                            wrap=schedule.num_chunks > 1)
        executor = PipelineExecutor(
            module, links, updater, weight_versions=schedule.weight_versions,
            grad_buffers=schedule.grad_buffers, dp_group=data_parallel_group(),
            first_version=self.iteration, tied=_tied_sync(schedule, self.stage, infos, run),
            grads=_grad_reduce(run),
            count_tokens=module.num_tokens if run.model.per_token_loss else None,
            make_copy=self._build_stage, num_chunks=schedule.num_chunks, reducer=reducer,
            grad_numel=layout.padded if layout is not None else 0,
            aux_losses=mtp.aux_losses(run.model, experts.aux_losses(
                run.model, run.model.per_token_loss, self.env.device), self.env.device))
        bias = experts.expert_bias(run.model, executor.weights, executor.minibatch_of)
        if bias is not None:  # counts per F / B; each step makes its version's bias
            executor.wrap_handlers(bias.wrap)
        return executor, updater

    def _report_parameters(self) -> None:
        """Megatron-LM's ` > number of parameters on (tensor, pipeline) model parallel rank`
        lines, one per model-parallel rank (gathered once: only the last rank prints)."""
        mine = (ps.get_tensor_model_parallel_rank(), self.stage, self._num_parameters,
                ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0)
        for line in parameter_count_lines(comm.all_gather_object(mine) if comm.world_runs()
                                          else [mine]):
            logger.info(line)

    def _rank_reports(self, is_logger: bool) -> RankReports:
        """The per-rank values of the log line (params norm, timers, memory report), with
        the timers around the executor's actions."""
        run, t, par = self.run, self.run.train, self.run.parallel
        setup = ReportSetup(
            first=self.iteration + 1, log_interval=t.log_interval, train_iters=t.train_iters,
            params_norm=t.log_params_norm, timing_log_level=t.timing_log_level,
            timing_log_option=t.timing_log_option, device=self.env.device, is_logger=is_logger,
            prints_memory=self.dp_rank == 0 and ps.get_context_parallel_rank() == 0,
            timeout=self.env.timeout)
        inputs = MemoryInputs(par, t.micro_batch_size, run.num_microbatches)
        reports = RankReports(setup, self._params_squares,
                              lambda: theoretical_memory_lines(run.model, inputs))
        # the executor's dispatch table: each action's handler, timed (timers.py)
        self.executor.wrap_handlers(reports.timers.instrument)
        return reports

    def _params_squares(self) -> float:
        """This rank's share of the squared parameter norm (rank_reports.py), on the
        weights the optimizer trained (not a weight prediction, where the updater can say
        so without a collective)."""
        store, infos = self.executor.weights, self._param_infos
        newest = store.params[store.buffer_of(store.newest)]
        if not getattr(self.updater, "collective_state", False):
            newest = self.updater.trained_weights(newest) or newest
        par = self.run.parallel
        return weighted_squares(newest, [i.counts_in_norm for i in infos],
                                [i.expert for i in infos],
                                1.0 / (par.data_parallel * par.context_parallel),
                                1.0 / par.expert_data_parallel)

    def _report_optimizer_memory(self) -> None:
        """Every rank's optimizer state bytes (masters, moments, compensation buffers;
        measured on the tensors held), one line and one "memory" row of the metrics file:
        with --use-distributed-optimizer each holds about 1/DP of it."""
        held = comm.all_gather_object(self.updater.state_bytes()) if comm.world_runs() \
            else [self.updater.state_bytes()]
        par = self.run.parallel
        sharded = par.distributed_optimizer and par.data_parallel > 1
        by_group = self.run.model.is_moe and experts.separate_groups()
        logger.info(f"optimizer state per rank: {max(held) / 2**20:.2f} MiB at most, "
                    f"{min(held) / 2**20:.2f} MiB at least"
                    + (f" (sharded over {par.data_parallel} data-parallel ranks"
                       + (f", the experts' over {par.expert_data_parallel} "
                          f"expert-data-parallel rank"
                          f"{'s' if par.expert_data_parallel > 1 else ''}" if by_group
                          else "") + ")"
                       if sharded else ""))
        self.sink.note({"split": "memory", "iteration": self.iteration,
                        "optimizer_state_bytes": held, "data_parallel": par.data_parallel,
                        "distributed_optimizer": par.distributed_optimizer})

    def _report_activation_memory(self, iteration: int) -> None:
        """Every rank's bytes saved for backward by one microbatch's forward (measured on
        its first, `runtime.activations`), one line and a "memory" row: what sequence
        parallelism divides by TP and context parallelism by CP. Collective, at the
        first step every rank takes."""
        self._activations_reported = True
        mine = self.executor.activations.bytes or 0
        held = comm.all_gather_object(mine) if comm.world_runs() else [mine]
        par = self.run.parallel
        logger.info(f"activation memory per microbatch: {max(held) / 2**20:.2f} MiB at most "
                    f"per rank (saved for backward; TP {par.tensor_parallel}"
                    f"{' with sequence parallelism' if self.run.model.sequence_parallel else ''}"
                    f", CP {par.context_parallel}, PP {par.pipeline_parallel})")
        self.sink.note({"split": "memory", "iteration": iteration,
                        "activation_bytes_per_microbatch": held,
                        "tensor_parallel": par.tensor_parallel,
                        "sequence_parallel": self.run.model.sequence_parallel,
                        "context_parallel": par.context_parallel,
                        "pipeline_parallel": par.pipeline_parallel})

    def _schedule(self, count: int) -> Schedule:
        """`count` minibatches from the current iteration, all of this phase's batch size."""
        par = self.run.parallel
        m = self.run.batch_sizes.size(self.iteration) // self.run.samples_per_microbatch
        return build_schedule(par.schedule, par.pipeline_parallel, m,
                              count, first_minibatch=self.iteration,
                              tied_embedding=self._sums_tied_embedding(),
                              num_chunks=par.virtual_stages)

    def _sums_tied_embedding(self) -> bool:
        """Whether the tied embedding's gradient is summed over the embedding group: a
        tied model with more than one stage (first and last stage sum; the middle ones
        are in no embedding group), or with one stage whose group of one the comm layer
        says runs. Multi-token prediction's copy of the embedding on the last stage is
        summed the same way, tied or not."""
        if not (self.run.model.tie_embeddings or self.run.model.mtp_num_layers):
            return False
        if self.run.parallel.pipeline_parallel > 1:
            return True
        return comm.runs(ps.get_embedding_group())

    def _segment_end(self, stop: Optional[GracefulStop] = None) -> int:
        """Where the next segment ends: the first save, exit, validation or stop check."""
        t, par = self.run.train, self.run.parallel
        ends = [t.train_iters, self.iteration + MAX_SEGMENT]
        change = self.run.batch_sizes.next_change(self.iteration)
        if change is not None:  # a new batch size is a new m: a new schedule
            ends.append(change)
        if stop is not None and stop.active:  # stops are agreed at segment ends only
            ends.append(self.iteration + stop_check_interval(
                par.schedule, par.pipeline_parallel, self.run.num_microbatches))
        evals = t.eval_interval if self.sources.valid is not None and t.eval_iters else None
        for interval in (t.save_interval if t.save else None, t.exit_interval, evals):
            if interval:
                ends.append((self.iteration // interval + 1) * interval)
        return min(ends)

    def train(self) -> dict[int, dict]:
        """Segments up to --train-iters or --exit-interval, or until a graceful stop. A
        wait that runs out of time ends the run with the heartbeat's verdict on which
        ranks are frozen."""
        t = self.run.train
        stop = GracefulStop(t.exit_signal_handler, t.exit_duration_in_mins)
        heartbeat = Heartbeat.start(self.env.rank, self.env.world_size, self.stage,
                                    self.env.timeout)
        self.housekeeping.start()
        try:
            if t.skip_train:
                self._skip_train()
            else:
                self._train_segments(stop)
                if self.iteration >= t.train_iters:  # not after an exit or a stop
                    self.evaluate_test()
        except RuntimeError as err:
            if heartbeat is None or not (is_timeout(err) or isinstance(err, PeerTimeout)):
                raise
            raise heartbeat.explain(err, self.stage) from err
        finally:
            stop.close()
            self.housekeeping.close()
            if heartbeat is not None:
                heartbeat.close()
        self.sink.close()
        return self.history

    def _save_due(self, end: int) -> bool:
        t = self.run.train
        return bool(t.save) and (end % (t.save_interval or t.train_iters) == 0
                                 or end == t.train_iters or end == self.stop_at)

    def _save(self, end: int) -> None:
        t = self.run.train
        validates = self.sources.valid is not None and bool(t.eval_iters)
        weights = self.executor.weights
        check_weights_finite(weights.params[weights.buffer_of(weights.newest)], end,
                             self.run.precision)
        with save_guard(end):  # a stop signal waits for it; a killed writer ends the rank
            save_checkpoint(t.save, end, self.executor, self.updater,
                            megatron_args(self.run, end, validates),
                            self.run.parallel.schedule, overwrite=t.overwrite_checkpoints,
                            options=SaveOptions(t.ckpt_format, not t.no_save_optim,
                                                not t.no_save_rng))

    def save_now(self) -> None:
        """Save the state as loaded (the checkpoint converter) and release the groups."""
        try:
            self._save(self.iteration)
        finally:
            ps.destroy_model_parallel()

    def _stops(self, stop: GracefulStop, end: int) -> bool:
        """At a segment end before the last: whether all ranks agree to stop; then save
        (unless this iteration was just saved) so the run resumes from here."""
        t = self.run.train
        if end >= self.stop_at:
            return False  # the run ends here anyway
        reason = stop.reason()
        if reason is None:
            return False
        if t.save and not self._save_due(end):
            self._save(end)
        where = f"checkpoint saved in {t.save}" if t.save else "nothing saved (no --save)"
        logger.info(f"exiting at iteration {end} after {reason}; {where}")
        return True

    def _train_segments(self, stop: GracefulStop) -> None:
        t = self.run.train
        while self.iteration < self.stop_at:
            end = self._segment_end(stop)
            schedule = self._schedule(end - self.iteration)
            first_sample = self.run.batch_sizes.consumed(self.iteration)
            data = self.reports.timers.batches(self._microbatches(self.sources.train,
                                                                  first_sample))
            self._set_batch_size(self.run.batch_sizes.size(self.iteration))
            self._last_time = time.monotonic()
            result = self.executor.run(schedule, data, on_step=self._on_step)
            self.reports.drain()  # every rank has started its exchanges of the segment
            if result.stopped_after is not None:
                self._stop_learning(result.stopped_after + 1)
            self.iteration = end
            if self._save_due(end):
                self._save(end)
            if self.sources.valid is not None and t.eval_iters and (
                    end % t.eval_interval == 0 or end == t.train_iters):
                self.evaluate(end)
            if self._stops(stop, end):
                return

    def _stop_learning(self, iteration: int) -> None:
        """Every rank stopped after the same step (`skip_guard`): save that state with
        --save (the skipped steps changed nothing since the last step taken), then end
        the run with the verdict's one line."""
        t = self.run.train
        self.iteration, failed = iteration, None
        if t.save:
            try:
                self._save(iteration)
            except (ValueError, OSError) as err:  # agreed by every rank (save_checkpoint)
                failed = describe(err)
        self.sink.close()
        raise stopped(self._verdict, iteration, self.skip_guard.last_step, t.save, failed)

    def _set_batch_size(self, size: int) -> None:
        """The steps of the next segment count `size` samples; say when the ramp moves."""
        if size != self.updater.batch_size or self.iteration == 0:
            verb = "setting" if self.iteration == 0 else "ramping up"
            if self.run.train.rampup_batch_size:
                logger.info(f"{verb} batch size to {size} at iteration {self.iteration + 1}"
                            f" ({size // self.run.samples_per_microbatch} microbatches)")
        self.updater.set_batch_size(size)

    def evaluate(self, iteration: int) -> None:
        """Validation loss on the newest trained weights: --eval-iters global batches, as
        Megatron."""
        t = self.run.train
        first = (iteration // t.eval_interval) * t.eval_iters * t.global_batch_size
        # Megatron-LM's label for its validation after the training loop
        final = iteration % t.eval_interval != 0
        self._evaluate_split("valid", first, iteration,
                             f"iteration {iteration} on validation set" if final else None)

    def evaluate_test(self, tensorboard: bool = True) -> None:
        """Megatron-LM's test-set evaluation after training (`do_test`: --eval-iters > 0
        and a test split): --eval-iters global batches from the start of the test split,
        printed as `validation loss at iteration N on test set`."""
        if self.sources.test is None or not self.run.train.eval_iters:
            return
        self._evaluate_split("test", 0, self.iteration,
                             f"iteration {self.iteration} on test set", tensorboard)

    def _skip_train(self) -> None:
        """--skip-train, as Megatron-LM: no step; the model as loaded (iteration N of
        --load, or 0) is validated on the first --eval-iters global batches of the
        validation split, then tested, each printed as after training; nothing is saved
        or written to TensorBoard."""
        logger.info(f"--skip-train: no training; validating the model of iteration "
                    f"{self.iteration}")
        if self.sources.valid is not None and self.run.train.eval_iters:
            self._evaluate_split("valid", 0, self.iteration,
                                 f"iteration {self.iteration} on validation set",
                                 tensorboard=False)
        self.evaluate_test(tensorboard=False)

    def _evaluate_split(self, split: str, first: int, iteration: int, label: Optional[str],
                        tensorboard: bool = True) -> None:
        """--eval-iters global batches of `split` ("valid" or "test") from sample `first`,
        kept in the history and written as Megatron-LM's validation line `label`."""
        source = self.sources.valid if split == "valid" else self.sources.test
        rec = self.measure(source, first, self.run.train.eval_iters, iteration)
        if rec is None:
            return
        if split == "test":
            rec["split"] = "test"
        self.history.setdefault(split, {})[iteration] = rec
        self.sink.validation(rec, label, tensorboard)

    def measure(self, dataset, first: int, iters: int, iteration: int) -> Optional[dict]:
        """The loss (and its parts or metrics) of `iters` global batches of `dataset` from
        sample `first`, forward only on the newest weights as the optimizer trained them
        (with weight prediction not the prediction its buffer holds: the loss of the
        model the checkpoint saves), averaged over data-parallel replicas; None off the
        last stage."""
        m = self.run.num_microbatches
        data = self._microbatches(dataset, first)
        par = self.run.parallel
        store = self.executor.weights
        schedule = build_eval_schedule(par.pipeline_parallel, m * iters, store.newest,
                                       par.virtual_stages)
        trained = self.updater.trained_weights(store.params[store.buffer_of(store.newest)])
        self.housekeeping.around_eval()
        self.reports.timers.paused = True  # the training timers leave validation out
        try:
            with store.holding(store.newest, trained):
                loss = self.executor.evaluate(schedule, evaluation_progress(
                    itertools.islice(data, m * iters), m, iters, self.run.train.global_batch_size))
        finally:
            self.reports.timers.paused = False
        self.housekeeping.around_eval()
        if loss is None:
            return None
        parts = self.executor.evaluation_metrics()  # BERT: lm_loss, sop_loss
        loss, *values = self._dp_mean([loss, *parts.values()],
                                      self.executor.evaluation_tokens)
        return {"split": "valid", "iteration": iteration, "val_loss": loss,
                "val_ppl": perplexity(loss),
                **{f"val_{name}": value for name, value in zip(parts, values)},
                "consumed_samples": self.run.batch_sizes.consumed(iteration)}

    def _microbatches(self, dataset, first_sample: int):
        """This data-parallel rank's microbatches from `first_sample` on, in Megatron's
        order, on this rank's device (the dataset collates on CPU; on CUDA every tensor of
        the batch, the token count of a per-token loss too, must live on the GPU)."""
        device = self.env.device
        cp_rank, cp = context_parallel()
        for batch in microbatches(dataset, self.run.train.micro_batch_size, first_sample,
                                  self.dp_rank, self.run.parallel.data_parallel):
            if cp > 1:
                batch = context_parallel_batch(batch, cp_rank, cp)
            yield {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                   for k, v in batch.items()}

    def _dp_mean(self, values: list[float], tokens: Optional[float] = None) -> list[float]:
        """The mean over data-parallel replicas; with a per-token loss (`tokens`: this
        replica's count) weighted by tokens, so the result is the global batch's
        per-token mean, as Megatron-LM reports it."""
        group = data_parallel_group()
        if tokens is None:
            stats = comm.tensor(values, torch.float64)
            if comm.runs(group):
                comm.all_reduce(stats, group)
                stats /= comm.size(group)
            return stats.tolist()
        stats = comm.tensor([v * tokens for v in values] + [tokens], torch.float64)
        if comm.runs(group):
            comm.all_reduce(stats, group)
        return (stats[:-1] / max(stats[-1].item(), 1.0)).tolist()

    def _on_step(self, k: int, result: RunResult) -> bool:
        """After minibatch k's step on this stage: average its loss over DP and record;
        True when the run must end here (`skip_guard`, decided alike on every rank)."""
        self.housekeeping.after_step(k + 1)
        PROGRESS.iteration = k + 1  # for a line that stops the run by hand
        if not self._activations_reported:
            self._report_activation_memory(k + 1)
        stop = self._stop_learning_after(k + 1, result.steps[k])
        self.reports.after_step(k + 1)  # every rank: what the line needs from it
        if not self.executor.links.is_last:
            return stop
        stats = self._dp_mean([result.losses[k]] + list(result.metrics.get(k, {}).values()),
                              result.tokens.get(k))
        now = time.monotonic()
        elapsed, self._last_time = now - self._last_time, now
        rec = self._record(k, stats, list(result.metrics.get(k, {})),
                           result.steps[k], elapsed)
        rec.update(self._router_losses(k, result))
        extras = self.reports.read(k + 1) if self.sink.enabled else None
        if extras is not None:
            rec.update(extras.record)
        self.history[k + 1] = rec
        self.sink.record(rec, extras)
        return stop

    def _router_losses(self, k: int, result: RunResult) -> dict[str, float]:
        """A mixture of experts' router losses of minibatch k under Megatron-LM's names,
        averaged over the data-parallel replicas (none for a dense model)."""
        per_layer = result.aux_losses.pop(k, None)
        if not per_layer:
            return {}
        run = self.run
        m = run.batch_sizes.size(k) // (run.train.micro_batch_size * run.parallel.data_parallel)
        per_layer, values = mtp.split_values(per_layer, m)
        if per_layer:
            values.update(experts.log_values(per_layer, run.model, m))
        if per_layer and run.train.moe_per_layer_logging:
            values.update(experts.per_layer_log_values(per_layer, run.model, m))
        return dict(zip(values, self._dp_mean(list(values.values()))))

    def _stop_learning_after(self, iteration: int, step: dict) -> bool:
        """The skip guard's verdict on `iteration`'s step, kept from the first that ends the
        run (it still learns of later steps the executor's cut runs: the last one taken)."""
        verdict = self.skip_guard.observe(iteration, step)
        self._verdict = self._verdict or verdict
        return self._verdict is not None

    def _record(self, k: int, stats: list[float], names: list[str], step: dict,
                elapsed: float) -> dict:
        m, sizes = self.run.model, self.run.batch_sizes
        gbs = sizes.size(k)  # --rampup-batch-size: this step's size
        rec = {"split": "train", "iteration": k + 1, "loss": stats[0], **dict(zip(names, stats[1:])),
               "lr": step["lr"], "grad_norm": step["grad_norm"], "loss_scale": step["loss_scale"],
               "skipped": int(step["skipped"]), "iteration_time_s": elapsed,
               "samples_per_s": gbs / elapsed, "tokens_per_s": gbs * m.seq_length / elapsed,
               "consumed_samples": sizes.consumed(k + 1), "global_batch_size": gbs,
               # the version minibatch k's step published (k + 1 under every schedule)
               "weight_version": self.executor.weights.newest}
        if "num_zeros" in step:  # --log-num-zeros-in-grad
            rec["num_zeros"] = step["num_zeros"]
        rec["tflops"] = transformer_flops(gbs, m) / elapsed / self.env.world_size / 1e12
        return rec


def pretrain(run: RunConfig, env: DistEnv, sources: DataSources) -> dict:
    """Train as the flags say; returns {iteration: record} on the logging rank."""
    log_arguments(run.flags, env.world_size, run.parallel.data_parallel)  # as Megatron-LM
    trainer = Trainer(run, env, sources)
    try:
        return trainer.train()
    finally:
        ps.destroy_model_parallel()
