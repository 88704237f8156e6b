"""The messages between two stages, and when a sender knows one has arrived.

Point-to-point transfers carry no tag: the messages from one stage to another are
matched first in, first out, whatever they carry (`messages` lists them in program
order; the validator checks that sends and receives agree).

`send_completions` answers a question the executor cannot ask the backend: when may a
stage let go of a tensor it sent? gloo's send handle reports completion only after it
has been waited for, so polling it never frees anything, and a stage that waits only
at the end of a run keeps every tensor it sent during that run (up to a thousand
minibatches in training). Waiting on a send early could block, since a send completes
only once the peer has posted its receive. The schedule knows better: once a stage
receives a message that its peer sent *after* receiving ours, ours has arrived, and
waiting on it then returns at once. Causality, not timing, so it holds on every backend.

A forward-only schedule (validation) has no such later message: nothing comes back on
its links, so `send_completions` frees nothing there and a stage would hold every
activation it sent in the pass (all m of them). `send_waits` bounds those links instead:
a stage waits for each send before it sends the message `SEND_WINDOW` places later on
the link. That wait may block until the peer has received the message, so the simulator
models it and the validator proves, per schedule, that it cannot deadlock.
`send_releases` is both together: where the executor waits for each send and frees it.
"""
from __future__ import annotations

from typing import Sequence

from .actions import (COMPUTE_KINDS, RECV_BACKWARD, RECV_FORWARD, RECV_KINDS, SEND_BACKWARD,
                      SEND_FORWARD, SEND_KINDS, Action, Schedule)

# sends a stage holds at once on a link nothing comes back on (`send_waits`): as many as
# training holds on its last link. Only a stage that runs ahead of its peer waits, which
# costs a pipeline nothing: it runs at its slowest stage's pace anyway.
SEND_WINDOW = 2

_SEND_OF_RECV = {RECV_FORWARD: SEND_FORWARD, RECV_BACKWARD: SEND_BACKWARD}
Message = tuple[str, int, int, int]  # (send kind, microbatch, receiving chunk, action index)
Link = tuple[int, int]               # (source stage, destination stage)


def messages(schedule: Schedule) -> tuple[dict[Link, list[Message]], dict[Link, list[Message]]]:
    """Per (source stage, destination stage): the messages sent and those received, each
    in program order."""
    sent: dict[Link, list[Message]] = {}
    received: dict[Link, list[Message]] = {}
    for stage, actions in schedule.items():
        for idx, a in enumerate(actions):
            other = a.peer(schedule.num_stages)
            if other is None:
                continue
            peer_stage, peer_chunk = other
            if a.kind in _SEND_OF_RECV:
                received.setdefault((peer_stage, stage), []).append(
                    (_SEND_OF_RECV[a.kind], a.microbatch, a.chunk, idx))
            else:
                sent.setdefault((stage, peer_stage), []).append(
                    (a.kind, a.microbatch, peer_chunk, idx))
    return sent, received


def _next_send_to(actions: list[Action], dst: int, num_stages: int) -> list[int]:
    """For each index i: the index of the first send to stage `dst` after i (or -1)."""
    out, upcoming = [-1] * len(actions), -1
    for idx in range(len(actions) - 1, -1, -1):
        out[idx] = upcoming
        a = actions[idx]
        if a.kind in SEND_KINDS and a.peer(num_stages)[0] == dst:
            upcoming = idx
    return out


def send_completions(schedule: Schedule, stage: int) -> dict[int, list[int]]:
    """{index of a receive on `stage`: indices of `stage`'s sends known to have arrived
    once that receive returns}.

    A send to stage q is known to have arrived at the first receive from q of a message
    q sent after its matching receive (q waits for each message at its receive action,
    in program order). Sends with no such later message (the tail of a run) are left
    out: the executor waits for those at the end of the run, as before.
    """
    sent, received = messages(schedule)
    done: dict[int, list[int]] = {}
    for (src, dst), ours in sent.items():
        if src != stage or dst not in schedule:
            continue
        theirs = received.get((src, dst), [])
        after = _next_send_to(schedule[dst], stage, schedule.num_stages)
        back_sends = {m[3]: n for n, m in enumerate(sent.get((dst, stage), []))}
        back_recvs = received.get((dst, stage), [])
        for n, message in enumerate(ours[:len(theirs)]):
            reply = after[theirs[n][3]]
            if reply >= 0 and back_sends[reply] < len(back_recvs):
                done.setdefault(back_recvs[back_sends[reply]][3], []).append(message[3])
    return done


def send_waits(schedule: Schedule) -> dict[int, dict[int, list[int]]]:
    """{stage: {index of an action: indices of the stage's sends to wait for right after
    it}}, on the links that carry nothing back.

    On such a link, message n is waited for right before message n + `SEND_WINDOW` is
    sent (after the action before that send), so the stage holds at most `SEND_WINDOW`
    of the link's tensors. The wait returns once the peer has received message n (at the
    latest when its receive returns); the simulator models it, so the validator's
    deadlock check covers it. Without chunks it cannot deadlock: the peer's receive of
    message n needs from this stage only messages up to n, all sent before the wait, and
    the peer's own waits, which by the same argument end at the last stage, which sends
    nothing. Training schedules have replies on every link, so this is empty for them.
    """
    window = SEND_WINDOW
    sends: dict[Link, list[int]] = {}
    for stage, actions in schedule.items():
        for idx, a in enumerate(actions):
            if a.kind in SEND_KINDS:
                sends.setdefault((stage, a.peer(schedule.num_stages)[0]), []).append(idx)
    waits: dict[int, dict[int, list[int]]] = {}
    for (src, dst), ours in sends.items():
        if (dst, src) in sends:
            continue
        for n in range(len(ours) - window):
            waits.setdefault(src, {}).setdefault(ours[n + window] - 1, []).append(ours[n])
    return waits


def send_releases(schedule: Schedule, stage: int) -> dict[int, list[int]]:
    """{index of an action on `stage`: indices of its sends to wait for and free right
    after it}: `send_completions` (returns at once) and `send_waits` (bounds the links
    nothing comes back on). The rest, a run's last few sends per link, wait at its end."""
    releases = {idx: list(sends) for idx, sends in send_completions(schedule, stage).items()}
    for idx, sends in send_waits(schedule).get(stage, {}).items():
        releases.setdefault(idx, []).extend(sends)
    return releases


def peak_held_sends(schedule: Schedule, stage: int) -> int:
    """Most sent tensors `stage` holds at once when the executor frees them at
    `send_releases` (each send counts from its action on), read off the actions alone."""
    releases = send_releases(schedule, stage)
    held = peak = 0
    for idx, a in enumerate(schedule[stage]):
        if a.kind in SEND_KINDS:
            held += 1
            peak = max(peak, held)
        held -= len(releases.get(idx, ()))
    return peak


def receives_ahead(actions: Sequence[Action], lookahead: int = 1) -> dict[int, list[Action]]:
    """{index of a forward or backward: the receive actions the executor posts before
    running it}. Each receive is posted `lookahead` compute actions before the one that
    needs it (1: just before the compute that precedes its action; receives before the
    first compute action wait at their own action).

    Posting early matters on gloo: a message moves only once its receive is posted, and
    when it waits for one, its transfer costs gloo's I/O threads more wake-ups, on the
    cores the compute uses. Posts keep list order, hence every link's order, which is
    what untagged messages match by."""
    return {i: [actions[j] for j in recvs]
            for i, recvs in receive_posts(actions, lookahead).items()}


def receive_posts(actions: Sequence[Action], lookahead: int = 1) -> dict[int, list[int]]:
    """`receives_ahead` by index: {index of a compute action: indices of the receives
    posted right before it}."""
    posts: dict[int, list[int]] = {}
    computes: list[int] = []
    for i, action in enumerate(actions):
        if action.kind in COMPUTE_KINDS:
            computes.append(i)
        elif action.kind in RECV_KINDS and computes:
            posts.setdefault(computes[max(0, len(computes) - lookahead)], []).append(i)
    return posts
