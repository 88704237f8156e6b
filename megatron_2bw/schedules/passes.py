"""Passes that lower a compute plan into an executable one.

compute plan --add_communication--> + sends/receives --add_grad_sync--> + reduce/norm/step
             --add_tied_grad_sync--> + the tied-embedding gradient sum (first and last stage)

Keeping these as passes (not a second hand-written loop per schedule) means every
schedule gets the same communication discipline and the validator checks one thing.
"""
from __future__ import annotations

from .actions import (BACKWARD, FORWARD, OPTIMIZER_STEP, RECV_BACKWARD, RECV_FORWARD,
                      SEND_BACKWARD, START_GRAD_ALLREDUCE, START_GRAD_NORM,
                      START_TIED_ALLREDUCE, Action, receive_for, send_for)

Plan = dict[int, list[Action]]


def add_communication(plan: Plan, num_stages: int, num_chunks: int = 1) -> Plan:
    """Wrap each compute action with the receive it needs and the send it owes.

    Sends are asynchronous in the executor and receives block, so a receive placed just
    before its consumer is deadlock-free whenever the compute order is (the validator
    proves it per schedule). Batched isend/irecv is avoided: it hangs on gloo. With
    chunks the wiring includes the wrap-around between the last stage and stage 0
    (`actions.receive_for`); the communication actions carry the local chunk.
    """
    out: Plan = {}
    for stage, actions in plan.items():
        lowered: list[Action] = []
        for a in actions:
            recv = receive_for(a, num_stages, num_chunks)
            if recv is not None:
                lowered.append(Action(stage, recv, a.microbatch, chunk=a.chunk))
            lowered.append(a)
            send = send_for(a, num_stages, num_chunks)
            if send is not None:
                lowered.append(Action(stage, send, a.microbatch, chunk=a.chunk))
        out[stage] = lowered
    return out


def _last_backward_positions(actions: list[Action], m: int) -> dict[int, int]:
    """minibatch -> index just past its last backward (and the gradient send after it)."""
    ends: dict[int, int] = {}
    for idx, a in enumerate(actions):
        if a.kind == BACKWARD:
            end = idx + 1
            if end < len(actions) and actions[end].kind == SEND_BACKWARD:
                end += 1
            ends[a.microbatch // m] = end
    return ends


def _first_use_positions(actions: list[Action]) -> dict[int, int]:
    """version -> index of the first action (its receive included) that needs it."""
    firsts: dict[int, int] = {}
    for idx, a in enumerate(actions):
        if a.kind == FORWARD and a.version not in firsts:
            firsts[a.version] = _with_receive(actions, idx, RECV_FORWARD)
    return firsts


def _backward_positions(actions: list[Action]) -> dict[int, int]:
    """microbatch -> index of its backward (its gradient receive included)."""
    return {a.microbatch: _with_receive(actions, idx, RECV_BACKWARD)
            for idx, a in enumerate(actions) if a.kind == BACKWARD}


def _with_receive(actions: list[Action], idx: int, recv_kind: str) -> int:
    return idx - 1 if idx > 0 and actions[idx - 1].kind == recv_kind else idx


def add_grad_sync(plan: Plan, num_microbatches: int, num_stages: int, defer_step: bool) -> Plan:
    """Insert R(k), G(k) and S(k) (which makes version k + 1) for every minibatch k.

    R(k) follows minibatch k's last backward (of any chunk: R, G and S cover all of a
    stage's chunks). Without deferral G(k) and S(k) follow at
    once (a flush for flush/gpipe). With deferral (2BW) S(k) waits until version k + 1 is
    first needed, so the data-parallel all-reduce overlaps minibatch k + 1, and G(k) sits
    before the backward of microbatch (k + 2)m - d: late enough to overlap the
    all-reduce, early enough that every stage has started the model-wide sums before
    any stage needs them (stage 0 runs that backward before its first forward of
    minibatch k + 2, which every other stage's S(k) waits for), so S(k) never stalls.
    """
    m, d = num_microbatches, num_stages
    out: Plan = {}
    for stage, actions in plan.items():
        inserts: dict[int, list[Action]] = {}
        firsts, backwards = _first_use_positions(actions), _backward_positions(actions)
        for k, end in _last_backward_positions(actions, m).items():
            reduce = Action(stage, START_GRAD_ALLREDUCE, minibatch=k)
            sums = Action(stage, START_GRAD_NORM, minibatch=k)
            step = Action(stage, OPTIMIZER_STEP, version=k + 1, minibatch=k)
            if not defer_step:
                inserts.setdefault(end, []).extend([reduce, sums, step])
                continue
            step_at = firsts.get(k + 1, len(actions))
            sums_at = min(backwards.get((k + 2) * m - d, step_at), step_at)
            inserts.setdefault(end, []).append(reduce)
            inserts.setdefault(sums_at, []).append(sums)
            inserts.setdefault(step_at, []).append(step)
        out[stage] = _apply_inserts(actions, inserts)
    return out


def add_tied_grad_sync(plan: Plan, tied_stages: tuple[int, ...]) -> Plan:
    """Insert T(k) just before G(k) on each stage that holds a tied word embedding.

    T(k) waits for the stage's own data-parallel all-reduce and starts the sum of the
    tied gradient with the other end (as DeepSpeed's ReduceTiedGrads). Placed right
    before G(k): the first stage's G(k) waits for that sum (its gradient norm counts
    the tied weight once), while the last stage only needs it at S(k), so it never
    waits for the first stage in the middle of its 1F1B (the simulator proves no stall).
    """
    out: Plan = {}
    for stage, actions in plan.items():
        if stage not in tied_stages:
            out[stage] = list(actions)
            continue
        out[stage] = [b for a in actions for b in (
            (Action(stage, START_TIED_ALLREDUCE, minibatch=a.minibatch), a)
            if a.kind == START_GRAD_NORM else (a,))]
    return out


def _apply_inserts(actions: list[Action], inserts: dict[int, list[Action]]) -> list[Action]:
    lowered: list[Action] = []
    for idx in range(len(actions) + 1):
        lowered.extend(inserts.get(idx, ()))
        if idx < len(actions):
            lowered.append(actions[idx])
    return lowered
