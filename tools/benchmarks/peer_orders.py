"""torch.distributed.pipelining's schedules as orders: each rank's compute actions, from torch.

With 4 processes on 2 cores an idle rank frees a core and hides the bubble, so the
peers' d = 4 numbers are predicted (simulated.py): `torch_order` gives torch's own
per-rank order as an `Order`, which the library's simulator times
(`megatron_2bw.schedules.simulate.simulate_order`, its timing model), fed with the
per-action times our flush measured at d = 2, as it times our own schedules. No process
group is created.

Where each order comes from (torch 2.13, `torch/distributed/pipelining/schedules.py`):

- multi-stage schedules (`ScheduleInterleaved1F1B`, `ScheduleInterleavedZeroBubble`,
  `ScheduleZBVZeroBubble`, `ScheduleDualPipeV`): the class itself, built on stand-in
  stage objects (num_stages, group_size, group_rank only). Its constructor runs
  `_calculate_single_rank_operations(rank)` for every rank into `pipeline_order`
  (plus `_add_bubbles_to_actions` for the interleaved zero-bubble one), lowers it with
  `_prepare_schedule_with_comms` (which fails on a malformed order) and sets
  `stage_index_to_group_rank` (loop placement, or the V for ZBV and DualPipeV), which is
  taken as the placement. `OVERLAP_F_B` runs its sub-actions one after the other, as
  `_PipelineScheduleRuntime._step_microbatches` does without a custom function.
- `ScheduleGPipe`: its `_get_pipeline_order` (all forwards, then all backwards), which
  is also what its `_step_microbatches` runs.
- `Schedule1F1B`: derived from `_step_microbatches` (min(m, d - r) forwards, then
  backward and forward alternating, then the remaining backwards), because its
  `_get_pipeline_order` is not the order it runs: on the last rank it starts at
  forward 1 and skips forward 0. The derived order is our flush's (tested).

I and W split a backward as `Costs.input_fraction` : 1 - `input_fraction` (not measured:
an assumption).
"""
from __future__ import annotations

import types
from typing import Callable

from megatron_2bw.schedules.simulate import INPUT_GRAD, Order, OrderAction

from .config import PEERS, peer_chunks

Orders = dict[int, list[OrderAction]]


def _flatten(raw: list) -> list[OrderAction]:
    """Torch `_Action`s to compute actions: idle slots (None) and REDUCE_GRAD dropped,
    OVERLAP_F_B expanded into its sub-actions in order."""
    out: list[OrderAction] = []
    for a in raw:
        if a is None:
            continue
        for p in a.sub_actions if a.sub_actions is not None else (a,):
            kind = str(p.computation_type.value)
            if kind in ("F", "B", INPUT_GRAD, "W"):
                out.append(OrderAction(kind, p.stage_index, p.microbatch_index))
    return out


def _gpipe(cls_name: str, d: int, m: int, v: int) -> tuple[Orders, dict[int, int], str]:
    """ScheduleGPipe's `_get_pipeline_order` (static: needs only the sizes)."""
    import torch.distributed.pipelining.schedules as sched

    raw = getattr(sched, cls_name)._get_pipeline_order(
        types.SimpleNamespace(_num_stages=d, _n_microbatches=m))
    return ({r: _flatten(raw[r]) for r in range(d)}, {s: s for s in range(d)},
            f"{cls_name}._get_pipeline_order")


def _one_f_one_b(cls_name: str, d: int, m: int, v: int) -> tuple[Orders, dict[int, int], str]:
    """The order `Schedule1F1B._step_microbatches` runs on every rank."""
    if m < d:  # Schedule1F1B.__init__ refuses it
        raise ValueError(f"{cls_name} needs m >= d ({m} < {d})")
    out = {}
    for r in range(d):
        warm = min(m, d - r)
        acts = [OrderAction("F", r, i) for i in range(warm)]
        for b in range(m):
            acts.append(OrderAction("B", r, b))
            if warm + b < m:
                acts.append(OrderAction("F", r, warm + b))
        out[r] = acts
    return out, {s: s for s in range(d)}, f"{cls_name}._step_microbatches (derived)"


def _multi_stage(cls_name: str, d: int, m: int, v: int) -> tuple[Orders, dict[int, int], str]:
    """Build torch's class on stand-in stages: its `pipeline_order` and placement."""
    import torch.distributed.pipelining as pipelining

    stages = [types.SimpleNamespace(num_stages=v * d, group_size=d, group_rank=0,
                                    submod=None, stage_index=c * d) for c in range(v)]
    built = getattr(pipelining, cls_name)(stages, m)
    return ({r: _flatten(built.pipeline_order[r]) for r in range(d)},
            dict(built.stage_index_to_group_rank),
            f"{cls_name}._calculate_single_rank_operations")


# peer -> where its order comes from (see the module docstring); the rest: _multi_stage
ORDER_SOURCES: dict[str, Callable[..., tuple[Orders, dict[int, int], str]]] = {
    "gpipe": _gpipe, "1f1b": _one_f_one_b}


def torch_order(schedule: str, d: int, m: int, chunks: int = 2) -> Order:
    """Torch's per-rank compute order of `schedule` (see the module docstring for the
    function behind each); ValueError where torch refuses the sizes or the order is
    incomplete (`Order.problems`)."""
    peer = PEERS.get(schedule)
    if peer is None:
        raise ValueError(f"unknown peer schedule {schedule!r}; known: {', '.join(PEERS)}")
    v = peer_chunks(peer, chunks)
    actions, placement, source = ORDER_SOURCES.get(schedule, _multi_stage)(
        peer.torch_class, d, m, v)
    order = Order(schedule, d, m, v, placement, actions, source)
    problems = order.problems()
    if problems:
        raise ValueError(f"torch's {schedule} order at d={d} m={m} is incomplete: "
                         + "; ".join(problems[:5]))
    return order
