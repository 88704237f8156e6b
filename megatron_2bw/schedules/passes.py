"""Passes that lower a compute plan into an executable one.

compute plan --add_communication--> + sends/receives --add_grad_sync--> + reduce/step

Keeping these as passes (not a second hand-written loop per schedule) means every
schedule gets the same communication discipline and the validator checks one thing.
"""
from __future__ import annotations

from .actions import (BACKWARD, FORWARD, OPTIMIZER_STEP, RECV_BACKWARD, RECV_FORWARD,
                      REDUCE_GRADS, SEND_BACKWARD, SEND_FORWARD, Action)

Plan = dict[int, list[Action]]


def add_communication(plan: Plan, num_stages: int) -> Plan:
    """Wrap each compute action with the receive it needs and the send it owes.

    Sends are asynchronous in the executor and receives block, so a receive placed just
    before its consumer is deadlock-free whenever the compute order is (the validator
    proves it per schedule). Batched isend/irecv is avoided: it hangs on gloo.
    """
    last = num_stages - 1
    out: Plan = {}
    for stage, actions in plan.items():
        lowered: list[Action] = []
        for a in actions:
            if a.kind == FORWARD and stage > 0:
                lowered.append(Action(stage, RECV_FORWARD, a.microbatch))
            if a.kind == BACKWARD and stage < last:
                lowered.append(Action(stage, RECV_BACKWARD, a.microbatch))
            lowered.append(a)
            if a.kind == FORWARD and stage < last:
                lowered.append(Action(stage, SEND_FORWARD, a.microbatch))
            if a.kind == BACKWARD and stage > 0:
                lowered.append(Action(stage, SEND_BACKWARD, a.microbatch))
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
            starts_with_recv = idx > 0 and actions[idx - 1].kind == RECV_FORWARD
            firsts[a.version] = idx - 1 if starts_with_recv else idx
    return firsts


def add_grad_sync(plan: Plan, num_microbatches: int, defer_step: bool) -> Plan:
    """Insert R(k) after minibatch k's last backward and S(k) making version k + 1.

    Without deferral S(k) follows R(k) at once (a flush for flush/gpipe; for 2BW a single
    gradient buffer suffices). With deferral S(k) waits until version k + 1 is first
    needed, so the data-parallel all-reduce of minibatch k overlaps minibatch k + 1.
    """
    out: Plan = {}
    for stage, actions in plan.items():
        inserts: dict[int, list[Action]] = {}
        firsts = _first_use_positions(actions)
        for k, end in _last_backward_positions(actions, num_microbatches).items():
            reduce = Action(stage, REDUCE_GRADS, version=None, minibatch=k)
            step = Action(stage, OPTIMIZER_STEP, version=k + 1, minibatch=k)
            if defer_step:
                inserts.setdefault(end, []).append(reduce)
                inserts.setdefault(firsts.get(k + 1, len(actions)), []).append(step)
            else:
                inserts.setdefault(end, []).extend([reduce, step])
        lowered: list[Action] = []
        for idx in range(len(actions) + 1):
            lowered.extend(inserts.get(idx, ()))
            if idx < len(actions):
                lowered.append(actions[idx])
        out[stage] = lowered
    return out
