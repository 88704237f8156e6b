"""Name the ranks that stopped answering: a heartbeat in the job's rendezvous store.

A gloo timeout only says that a wait ran out. A pipeline receive knows whom it waited
for (runtime/p2p.py names that stage), but a rank blocked in a collective (the
data-parallel all-reduce, the step's model-wide gradient norm) cannot tell which member
is missing. So each rank's daemon thread adds 1 to its counter in the store every
`period`; when a wait fails, the rank reads every counter twice, 1.5 periods apart, and
the ranks whose counters stood still are frozen (SIGSTOP, a hung or swapping host) or
gone. A rank whose main thread hangs while its process runs keeps beating; the verdict
then says that no rank is frozen. Cost: one store round trip per rank and period.

When no torchrun agent hosts the store, rank 0 does; a request to a frozen host never
returns (the client's timeout does not cover it), so the verdict reads the store from a
helper thread and gives up on it after a bound: then the verdict names the store's host.
"""
from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ..runtime.p2p import PeerTimeout, describe_timeout
from .errors import within

_KEY = "megatron_2bw/heartbeat"


def beat_period(timeout: timedelta) -> float:
    """A tenth of the distributed timeout, within 0.5 s .. 30 s."""
    return min(30.0, max(0.5, timeout.total_seconds() / 10))


class Heartbeat:
    """This rank's heartbeat, and the verdict on the others when a wait fails."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, stage: int,
                 period: float):
        self.store, self.rank, self.world, self.period = store, rank, world_size, period
        self._lock = threading.Lock()
        self._done = threading.Event()
        store.set(f"{_KEY}/stage/{rank}", str(stage))
        self._thread = threading.Thread(target=self._beat, daemon=True,
                                        name="megatron_2bw-heartbeat")
        self._thread.start()

    @classmethod
    def start(cls, rank: int, world_size: int, stage: int,
              timeout: timedelta) -> Optional["Heartbeat"]:
        """A heartbeat through a new client of the job's store (None in a world of one,
        or where the store cannot be reached: training goes on without verdicts)."""
        if world_size == 1:
            return None
        period = beat_period(timeout)
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False,
                                  timeout=timedelta(seconds=max(5.0, 2 * period)),
                                  wait_for_workers=False)
            return cls(store, rank, world_size, stage, period)
        except (KeyError, ValueError, RuntimeError):
            return None

    def _add(self, rank: int, value: int) -> int:
        with self._lock:
            return int(self.store.add(f"{_KEY}/count/{rank}", value))

    def _beat(self) -> None:
        while not self._done.wait(self.period):
            try:
                self._add(self.rank, 1)
            except RuntimeError:  # the store's host does not answer: keep trying
                continue

    def close(self) -> None:
        """Stop beating and wait (bounded) for the beat in flight: a daemon thread still
        inside the store client at interpreter exit aborts the process (errors.py)."""
        self._done.set()
        self._thread.join(max(5.0, 2 * self.period))

    def frozen(self) -> list[int]:
        """Other ranks whose heartbeat stood still for 1.5 periods."""
        before = [self._add(r, 0) for r in range(self.world)]
        time.sleep(1.5 * self.period)
        after = [self._add(r, 0) for r in range(self.world)]
        return [r for r in range(self.world) if r != self.rank and after[r] == before[r]]

    def _stage_of(self, rank: int) -> str:
        with self._lock:
            key = f"{_KEY}/stage/{rank}"
            return self.store.get(key).decode() if self.store.check([key]) else "?"

    def _frozen_names(self) -> list[str]:
        return [f"stage {self._stage_of(r)} (rank {r})" for r in self.frozen()]

    def _store_down(self) -> str:
        return (f"the job's store at {os.environ.get('MASTER_ADDR')}:"
                f"{os.environ.get('MASTER_PORT')} does not answer either: its host (rank 0 "
                f"when no torchrun agent hosts it) is frozen, gone or unreachable")

    def verdict(self) -> str:
        """One sentence: which ranks are frozen or gone, with their stages. Bounded in
        time: a store client's request to a frozen store host never returns."""
        names = within(1.5 * self.period + 5.0 + 0.01 * self.world, self._frozen_names)
        if names is None:
            return self._store_down()
        if names:
            return f"frozen or gone (no heartbeat): {', '.join(names)}"
        return ("every other rank's heartbeat still beats: the rank that did not answer "
                "runs but is stuck (a hung kernel or a deadlock)")

    def store_check(self) -> Optional[str]:
        """For a broken connection (a peer exited): None while the store answers, else the
        sentence that names its host. Quick, unlike the verdict, so that a killed rank
        still ends its peers within seconds."""
        answered = within(2.0, lambda: self._add(self.rank, 0))
        return None if answered is not None else self._store_down()

    def explain(self, err: RuntimeError, stage: int) -> PeerTimeout:
        """`err` (a timed-out wait or a broken connection) with what the store tells about
        the other ranks; gloo's own words made readable."""
        if not isinstance(err, PeerTimeout):
            err = PeerTimeout(f"a wait of stage {stage} (rank {self.rank}) got no answer "
                              f"within {describe_timeout()} ({str(err).splitlines()[0][:160]})")
        if not err.timed_out:
            down = self.store_check()
            return err if down is None else PeerTimeout(f"{err}; {down}", timed_out=False)
        return PeerTimeout(f"{err}; {self.verdict()}")
