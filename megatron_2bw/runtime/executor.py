"""Run one stage's action list in one process.

The executor knows nothing about which schedule it runs: it looks each action's kind up
in a dispatch table and calls a short handler. A new schedule is a new builder in
`megatron_2bw.schedules`, never a branch here.

A stage is an `nn.Module` called as `module(input_tensor, batch)`: `input_tensor` is
None on the first stage, the previous stage's output otherwise; the last stage
returns the microbatch's scalar loss, the others their boundary activation.

With model chunks (Megatron-LM's virtual pipeline stages, `num_chunks` v > 1) the
stage's module holds them as `module.chunks`, each called as above; F and B run chunk
`action.chunk`, and every per-microbatch buffer (stash, inboxes, outboxes) is keyed by
(microbatch, chunk). Only virtual stage 0 (stage 0's chunk 0) starts from the batch and
only the last (the last stage's chunk v - 1) returns the loss. Each microbatch's batch is
read once, at its chunk-0 forward, and kept for the stage's other chunks. Weight
versions, the gradient buffer, the reductions and the optimizer step span all chunks.

A checkpoint reads and restores the weight versions through `checkpoint_state` and
`restore_checkpoint` only (runtime/checkpoint.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..schedules.actions import ActionKind as K
from ..schedules.actions import SEND_KINDS, Action, Schedule
from ..schedules.channels import receives_ahead, send_releases
from ..schedules.stop import last_step, stop_cut
from ..schedules.validate import require_valid
from .activations import ActivationMeter
from .checkpoint import WeightsCheckpoint, restore_loss_scales, weights_checkpoint
from .aux_losses import AuxLosses
from .grad_sync import GradReduceConfig, GradReducer, TiedGradSync
from .p2p import P2P, StageLinks, Transport
from .versions import WeightStore, WeightVersionError

logger = logging.getLogger(__name__)


class Updater(Protocol):
    """The numerics of an optimizer step (see megatron_2bw.optim), in three parts."""

    loss_scale: float

    def unscale(self, flat_grad: torch.Tensor, grad_scale: float) -> None:
        """Undo the loss scale `grad_scale` the minibatch's backward passes used (it
        travels with the weight version they used, so every stage agrees on it)."""

    def start_step(self, minibatch: int, flat_grad: torch.Tensor,
                   grads: list[torch.Tensor]) -> None:
        """Start the model-wide sums for `minibatch` (must not wait for other stages)."""

    def finish_step(self, minibatch: int, flat_grad: torch.Tensor, grads: list[torch.Tensor],
                    newest: list[torch.Tensor], target: list[torch.Tensor]) -> dict[str, float]:
        """Wait for those sums and write the next weights into `target`."""


@dataclass
class RunResult:
    """What one `run` produced on this stage."""

    losses: dict[int, float] = field(default_factory=dict)  # minibatch -> mean loss (last stage)
    tokens: dict[int, float] = field(default_factory=dict)  # minibatch -> tokens (per-token loss)
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)  # per minibatch
    steps: dict[int, dict[str, float]] = field(default_factory=dict)  # minibatch -> step info
    # minibatch -> auxiliary losses per layer, summed over the model-parallel group
    aux_losses: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    peak_stashes: int = 0
    peak_sends: int = 0  # most sent tensors held at once (not yet known to have arrived)
    stopped_after: Optional[int] = None  # the last minibatch stepped, when a step callback
    #                                      ended the run early (else None: all of it ran)


# called after each optimizer step with (minibatch, result so far); a true return ends the
# run after that step on every stage (every rank's callback must decide alike: `stop_cut`)
StepCallback = Callable[[int, RunResult], Optional[bool]]
Handler = Callable[[Action], Optional[int]]  # an action kind's handler (a ticket or None)
Key = tuple[int, int]  # (microbatch, model chunk)


TokenCount = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]


class PipelineExecutor:
    """Executes schedules for one pipeline stage; weights persist across `run` calls.

    Build it from a schedule's declarations (`weight_versions`, `grad_buffers`,
    `num_chunks`, and a `TiedGradSync` when the stage is in `tied_stages`); every
    schedule it runs must declare the same. A run holds at most the schedule's
    `stash_limit` stashed (microbatch, chunk) activations, checked as it goes.

    `count_tokens` switches to a per-token loss (Megatron-LM's --calculate-per-token-loss):
    the last stage's module then returns a microbatch's loss *sum*, which is not divided
    by m; every stage counts the minibatch's tokens with `count_tokens(batch)`, and the
    gradient reducer divides the data-parallel gradient sum by the global count.

    `transport` and `reducer` replace the point-to-point transfers (`P2P` over
    torch.distributed) and the data-parallel reduction (`GradReducer`): the seam through
    which tools/schedule_mutations.py runs every stage of a pipeline in one process, and
    through which the distributed optimizer reduce-scatters (`ShardedGradReducer`, with
    `grad_numel` its padded buffer size).
    """

    def __init__(self, module: nn.Module, links: StageLinks, updater: Updater, *,
                 weight_versions: int, grad_buffers: int,
                 dp_group: Optional[dist.ProcessGroup] = None, first_version: int = 0,
                 make_copy: Optional[Callable[[], nn.Module]] = None,
                 tied: Optional[TiedGradSync] = None,
                 grads: GradReduceConfig = GradReduceConfig(),
                 count_tokens: Optional[TokenCount] = None, num_chunks: int = 1,
                 transport: Optional[Transport] = None, reducer: Optional[GradReducer] = None,
                 grad_numel: int = 0, aux_losses: Optional[AuxLosses] = None):
        if num_chunks > 1 and len(getattr(module, "chunks", ())) != num_chunks:
            raise ValueError(f"num_chunks={num_chunks} needs a module with that many "
                             "`chunks`")
        self.links = links
        self.num_chunks = num_chunks
        # how many compute actions ahead receives are posted: one without chunks; with
        # v chunks 2v - 1, enough to post before the peer sends (measured, see
        # docs/performance.md "Posting receives ahead")
        self.receive_lookahead = 2 * num_chunks - 1
        self.weights = WeightStore(module, weight_versions, grad_buffers, first_version,
                                   make_copy, grad_dtype=grads.dtype, grad_numel=grad_numel)
        self.weights.loss_scale_of[first_version] = updater.loss_scale
        self.p2p: Transport = transport if transport is not None else P2P(links)
        self.reducer = reducer if reducer is not None else GradReducer(dp_group, grads)
        self.tied = tied
        self.updater = updater
        self.aux_losses = aux_losses  # a mixture of experts' router losses, if any
        self.activations = ActivationMeter()  # the first training forward's saved bytes
        self._count_tokens = count_tokens
        self._train = True
        self._handlers: dict[K, Handler] = {
            K.FORWARD: self._forward, K.BACKWARD: self._backward,
            K.RECV_FORWARD: self._recv_forward, K.SEND_FORWARD: self._send_forward,
            K.RECV_BACKWARD: self._recv_backward, K.SEND_BACKWARD: self._send_backward,
            K.START_GRAD_ALLREDUCE: self._start_grad_allreduce,
            K.START_TIED_ALLREDUCE: self._start_tied_allreduce,
            K.START_GRAD_NORM: self._start_grad_norm, K.OPTIMIZER_STEP: self._optimizer_step,
        }

    def wrap_handlers(self, wrap: Callable[[K, Handler], Handler]) -> None:
        """Replace each action kind's handler by `wrap(kind, handler)`: how an observer
        (the training loop's timers) sees every action without the executor knowing it."""
        self._handlers = {kind: wrap(kind, h) for kind, h in self._handlers.items()}

    def minibatch_of(self, microbatch: int) -> int:
        """The running schedule's minibatch of `microbatch` (for handler wrappers)."""
        return microbatch // self._m

    # --- driver ---------------------------------------------------------------------
    def run(self, schedule: Schedule, data: Iterator[dict], on_step: StepCallback | None = None
            ) -> RunResult:
        """Run this stage's actions of `schedule`, pulling one batch per chunk-0 forward.

        The schedule must pass the validator (`schedules.validate`): that is what this
        executor assumes of it, and a schedule that fails it would crash, hang or compute
        something else here. `build_schedule` validates what it builds, so this costs one
        comparison of the action lists; a schedule nobody validated is validated now."""
        self._check_declarations(schedule)
        require_valid(schedule)
        return self._execute(schedule, data, on_step)

    def _execute(self, schedule: Schedule, data: Iterator[dict],
                 on_step: StepCallback | None = None) -> RunResult:
        """`run` without its precondition: only for the mutation tool, which shows what
        happens to schedules the validator rejects."""
        self._reset(schedule, data)
        self._on_step = on_step
        self._run_actions(schedule)
        self.p2p.wait_all()
        return self._result

    def _run_actions(self, schedule: Schedule) -> None:
        """Dispatch each action; before a forward or backward, post the receives due a few
        compute actions later (`receives_ahead`), so their transfers overlap compute;
        after an action, wait for and free the sends the schedule says are done there
        (`send_releases`: after a receive that proves them arrived, or, where nothing
        comes back, before sending `SEND_WINDOW` more). So a run holds a bounded number of
        sent tensors, however many minibatches or validation microbatches it spans.

        When the step callback asks to stop, the stage posts nothing more ahead and runs
        on to its end of `stop_cut`, where every transfer it started has its partner."""
        actions = schedule[self.links.stage]
        ahead = receives_ahead(actions, self.receive_lookahead)
        arrived = send_releases(schedule, self.links.stage)
        tickets: dict[int, int] = {}  # index of a send action -> its P2P ticket
        end = len(actions)
        for i, action in enumerate(actions):
            if i >= end:
                break
            if self._stop_after is None:
                for recv in ahead.get(i, ()):
                    self.p2p.post(self._peer(recv))
            ticket = self._handlers[action.kind](action)
            if action.kind in SEND_KINDS:
                tickets[i] = ticket
                self._result.peak_sends = max(self._result.peak_sends, self.p2p.pending_sends)
            for sent in arrived.get(i, ()):
                self.p2p.release(tickets.pop(sent))
            if self._stop_after is not None and self._result.stopped_after is None:
                cut = stop_cut(schedule, self._stop_after, self.receive_lookahead)
                end = cut[self.links.stage]
                self._result.stopped_after = last_step(schedule, cut)

    def _check_declarations(self, schedule: Schedule) -> None:
        held = (self.weights.num_buffers, self.weights.num_grad_buffers,
                self.tied is not None, self.num_chunks)
        needed = (schedule.weight_versions, schedule.grad_buffers,
                  self.links.stage in schedule.tied_stages, schedule.num_chunks)
        if held != needed:
            raise ValueError(f"schedule {schedule.name} declares (weight versions, gradient "
                             f"buffers, tied sum, model chunks) = {needed}; this executor "
                             f"was built for {held}")

    def evaluate(self, schedule: Schedule, data: Iterator[dict]) -> Optional[float]:
        """Run a forward-only schedule without autograd, in eval mode (dropout off, so the
        training RNG stream is untouched); the mean loss on the last stage."""
        if schedule.num_chunks != self.num_chunks:
            raise ValueError(f"evaluation schedule has {schedule.num_chunks} model chunks per "
                             f"stage; this executor holds {self.num_chunks}")
        require_valid(schedule)
        self._reset(schedule, data)
        self._train = False
        for module in self.weights.modules:  # no dropout: a clean loss, no RNG draws
            module.eval()
        try:
            with torch.no_grad():
                self._run_actions(schedule)
        finally:
            self._train = True
            for module in self.weights.modules:
                module.train()
        self.p2p.wait_all()
        losses = [loss for per_mb in self._micro_losses.values() for loss in per_mb]
        return self._average(losses, self.evaluation_tokens) if losses else None

    @property
    def peak_sends(self) -> int:
        """Most sent tensors this stage held at once during the last `run` or `evaluate`."""
        return self._result.peak_sends

    @property
    def evaluation_tokens(self) -> Optional[float]:
        """The tokens the last `evaluate` averaged over (per-token loss), else None."""
        if self._count_tokens is None:
            return None
        return float(sum(t.item() for t in self._tokens.values()))

    def _average(self, values: list[torch.Tensor], tokens: Optional[float]) -> float:
        """The mean of per-microbatch means, or with a per-token loss the sum of the
        microbatches' sums over the tokens they cover."""
        if tokens is None:
            return torch.stack(values).mean().item()
        return torch.stack(values).double().sum().item() / max(tokens, 1.0)

    def evaluation_metrics(self) -> dict[str, float]:
        """The mean of each named part of the loss (BERT: lm_loss, sop_loss) over the last
        `evaluate`'s microbatches, so validation can report each as Megatron-LM does;
        empty off the last stage."""
        metrics = [m for per_mb in self._micro_metrics.values() for m in per_mb]
        tokens = self.evaluation_tokens  # once, not per metric
        return {name: self._average([m[name] for m in metrics], tokens)
                for name in (metrics[0] if metrics else {})}

    # --- checkpoints: the contract of runtime/checkpoint.py ----------------------------
    def checkpoint_state(self) -> WeightsCheckpoint:
        """The held weight versions, as a checkpoint saves and restores them."""
        return weights_checkpoint(self.weights)

    def restore_checkpoint(self, loss_scales: Mapping[int, float]) -> None:
        """After a restore loaded its versions' weights: their loss scales."""
        restore_loss_scales(self.weights, loss_scales)

    def _reset(self, schedule: Schedule, data: Iterator[dict]) -> None:
        """Fresh per-run state (weights and optimizer state persist across runs)."""
        self._m, self._data = schedule.num_microbatches, data
        self._stash_limit = schedule.stash_limit[self.links.stage]
        # per (microbatch, chunk): what backward needs, and the boundary tensors in flight
        self._stash: dict[Key, tuple[Optional[torch.Tensor], torch.Tensor, int]] = {}
        self._act_inbox: dict[Key, torch.Tensor] = {}    # input activation
        self._act_outbox: dict[Key, torch.Tensor] = {}   # output activation
        self._grad_inbox: dict[Key, torch.Tensor] = {}   # grad of the chunk's output
        self._grad_outbox: dict[Key, torch.Tensor] = {}  # grad of the chunk's input
        self._batches: dict[int, dict] = {}  # microbatch -> batch, until its last chunk
        self._micro_losses: dict[int, list[torch.Tensor]] = {}
        self._micro_metrics: dict[int, list[dict]] = {}
        self._tokens: dict[int, torch.Tensor] = {}  # minibatch -> tokens (per-token loss)
        self._grad_version: dict[int, int] = {}
        self._reduced: set[int] = set()
        self._result = RunResult()
        self._stop_after: Optional[int] = None  # a step callback asked to end after it

    # --- compute --------------------------------------------------------------------
    def _module(self, a: Action) -> nn.Module:
        """The module F and B of `a` run: its weight version's chunk `a.chunk`."""
        module = self.weights.module_for(a.version)
        return module.chunks[a.chunk] if self.num_chunks > 1 else module

    def _is_last(self, a: Action) -> bool:
        """Whether `a` runs the model's last virtual stage (the loss)."""
        return self.links.is_last and a.chunk == self.num_chunks - 1

    def _batch(self, a: Action) -> dict:
        """Microbatch `a.microbatch`'s batch: read at its chunk-0 forward (every stage
        runs those in microbatch order), kept until the forward of its last chunk."""
        batch = self._batches.pop(a.microbatch, None)
        if batch is None:
            if a.chunk != 0:
                raise RuntimeError(f"{a}: a chunk's forward before the microbatch's chunk 0")
            batch = next(self._data)
            self._count(a.microbatch // self._m, batch)
        if a.chunk < self.num_chunks - 1:
            self._batches[a.microbatch] = batch
        return batch

    def _forward(self, a: Action) -> None:
        key = (a.microbatch, a.chunk)
        inp = self._act_inbox.pop(key, None)
        batch, module, last = self._batch(a), self._module(a), self._is_last(a)
        if not self._train:
            out = module(inp, batch)
            if last:
                self._record_loss(a, module, out)
            else:
                self._act_outbox[key] = out
            return
        if inp is not None:
            inp.requires_grad_()
        self.weights.acquire(a.version)
        with self.activations.measure(module):
            out = module(inp, batch)
        if self.aux_losses is not None:
            self.aux_losses.collect(a.microbatch // self._m)
        if last:
            self._record_loss(a, module, out)
            out = out * (self.weights.loss_scale_of[a.version] / self._loss_divisor)
        else:
            self._act_outbox[key] = out
        self._stash[key] = (inp, out, a.version)
        self._note_stash(a)

    @property
    def _loss_divisor(self) -> int:
        """What a microbatch's loss is divided by: m, or 1 for a per-token loss (a sum)."""
        return 1 if self._count_tokens is not None else self._m

    def _note_stash(self, a: Action) -> None:
        """Track the peak stash; more than the schedule declared is a bug in one of them."""
        held = len(self._stash)
        if held > self._stash_limit:
            raise RuntimeError(f"{a}: stage {self.links.stage} holds {held} stashed "
                               f"activations, above its schedule's stash_limit "
                               f"{self._stash_limit}")
        self._result.peak_stashes = max(self._result.peak_stashes, held)

    def _count(self, k: int, batch: Mapping[str, torch.Tensor]) -> None:
        """Add the microbatch's tokens to minibatch k's count (per-token loss only)."""
        if self._count_tokens is not None:
            n = self._count_tokens(batch)
            self._tokens[k] = self._tokens[k] + n if k in self._tokens else n

    def _record_loss(self, a: Action, module: nn.Module, loss: torch.Tensor) -> None:
        k = a.microbatch // self._m
        self._micro_losses.setdefault(k, []).append(loss.detach())
        extra = getattr(module, "last_metrics", None)
        if extra:
            self._micro_metrics.setdefault(k, []).append(dict(extra))

    def _backward(self, a: Action) -> None:
        key = (a.microbatch, a.chunk)
        inp, out, version = self._stash.pop(key)
        if version != a.version:  # the graph was built on the forward's weights
            raise WeightVersionError(f"{a}: its forward ran on weight version {version}")
        grad = None if self._is_last(a) else self._grad_inbox.pop(key)
        self.weights.bind_grads(version, a.microbatch // self._m)
        self._grad_version[a.microbatch // self._m] = version
        if self.aux_losses is not None:  # scaled as this version's main loss
            self.aux_losses.set_scale(self.weights.loss_scale_of[version] / self._loss_divisor)
        torch.autograd.backward(out, grad_tensors=grad)
        if self.aux_losses is not None:  # a recomputed forward tracks its losses here
            self.aux_losses.collect(a.microbatch // self._m)
        self.weights.release(version)
        if inp is not None:
            self._grad_outbox[key] = inp.grad

    # --- point-to-point: the peer is the action's other end (`Action.peer`) -----------
    def _peer(self, a: Action) -> int:
        return a.peer(self.links.num_stages)[0]

    def _recv_forward(self, a: Action) -> None:
        self._act_inbox[(a.microbatch, a.chunk)] = self.p2p.recv(self._peer(a), "an activation")

    def _send_forward(self, a: Action) -> int:
        return self.p2p.send(self._act_outbox.pop((a.microbatch, a.chunk)), self._peer(a))

    def _recv_backward(self, a: Action) -> None:
        self._grad_inbox[(a.microbatch, a.chunk)] = self.p2p.recv(self._peer(a), "a gradient")

    def _send_backward(self, a: Action) -> int:
        return self.p2p.send(self._grad_outbox.pop((a.microbatch, a.chunk)), self._peer(a))

    # --- gradient reduction and the new weight version ------------------------------
    def _start_grad_allreduce(self, a: Action) -> None:
        flat, _ = self.weights.grads(a.minibatch)
        self.reducer.start(a.minibatch, flat, tokens=self._tokens.get(a.minibatch))

    def _reduced_grads(self, k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Minibatch k's gradient, averaged over data parallelism and unscaled (once)."""
        flat, views = self.weights.grads(k)
        if k not in self._reduced:
            self.reducer.wait(k)
            self.updater.unscale(flat, self.weights.loss_scale_of[self._grad_version.pop(k)])
            self._reduced.add(k)
        return flat, views

    def _start_tied_allreduce(self, a: Action) -> None:
        _, views = self._reduced_grads(a.minibatch)
        self.tied.start(a.minibatch, views)

    def _start_grad_norm(self, a: Action) -> None:
        flat, views = self._reduced_grads(a.minibatch)
        if self.tied is not None and self.tied.counts_in_norm:
            self.tied.finish(a.minibatch)
        self.updater.start_step(a.minibatch, flat, views)
        if self.aux_losses is not None:
            self.aux_losses.start(a.minibatch)

    def _optimizer_step(self, a: Action) -> None:
        k = a.minibatch
        flat, views = self._reduced_grads(k)
        if self.tied is not None:
            self.tied.finish(k)
        newest, target = self.weights.publish(a.version)
        info = self.updater.finish_step(k, flat, views, newest, target)
        if self.aux_losses is not None:
            self._result.aux_losses[k] = self.aux_losses.finish(k)
        self.weights.loss_scale_of[a.version] = self.updater.loss_scale
        self.weights.loss_scale_of.pop(a.version - self.weights.num_buffers - 1, None)
        self.weights.clear_grads(k)
        self._reduced.discard(k)
        self._result.steps[k] = info
        self._finish_losses(k)
        if self._on_step is not None and self._on_step(k, self._result) \
                and self._stop_after is None:
            self._stop_after = k

    def _finish_losses(self, k: int) -> None:
        """Minibatch k's mean loss and metrics (last stage), read once its step is done:
        the step synchronises anyway, so `.item()` costs no extra device sync."""
        tokens = self._tokens.pop(k, None)
        count = None if tokens is None else tokens.item()
        if count is not None:
            self._result.tokens[k] = count
        losses = self._micro_losses.pop(k, None)
        if losses:
            self._result.losses[k] = self._average(losses, count)
        metrics = self._micro_metrics.pop(k, None)
        if metrics:
            self._result.metrics[k] = {name: self._average([m[name] for m in metrics], count)
                                       for name in metrics[0]}
