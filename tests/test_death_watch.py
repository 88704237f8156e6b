"""A rank that dies on another machine is named by the survivors here (training/watchdog.py
DeathWatch, remote_verdict): /proc cannot see it, so its own machine's DeathWatch publishes
it in the job's store. One process plays both machines: the peers' machine identities are
written into watchdog._PEERS as know_peers would gather them (MEGATRON_2BW_MACHINE_FOR_TESTS
gives a whole job's ranks other machines: tools/fault_matrix.py class 18)."""
from __future__ import annotations

import os
import socket
import subprocess
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_2bw.comm import peers
from megatron_2bw.training import watchdog as wd


@pytest.fixture
def two_machines(monkeypatch):
    """This process is rank 0 on machine a; ranks 1 and 2 (a `sleep`) run on machine b."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.delenv(peers.MACHINE_FOR_TESTS, raising=False)
    victim = subprocess.Popen(["sleep", "60"])
    here, there = peers.machine_id(), peers.machine_id() + "/test-machine:b"
    wd._PEERS.update({0: (here, os.getpid(), peers.start_time(os.getpid())),
                      1: (there, 1, None),
                      2: (there, victim.pid, peers.start_time(victim.pid))})
    client = lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False,  # noqa: E731
                                   timeout=timedelta(seconds=5), wait_for_workers=False)
    watches = [wd.DeathWatch(client(), {2: (victim.pid, wd._PEERS[2][2])}),  # rank 1's, on b
               wd.DeathWatch(client(), {})]  # rank 0's, alone on a
    wd._WATCH["watch"] = watches[1]
    yield victim
    victim.kill()
    victim.wait()
    for watch in watches:
        watch.close()
    wd._WATCH.clear()
    wd._PEERS.clear()


def test_a_rank_killed_on_another_machine_is_named(two_machines) -> None:
    assert wd.peers_verdict(0, wait_s=0) is None  # all run: no one is named
    two_machines.kill()
    two_machines.wait()
    said = wd.peers_verdict(0, wait_s=5.0)
    assert said is not None and said.startswith(f"rank 2 (pid {two_machines.pid} on host "), said
    assert "has ended" in said and "rank 1" not in said, said


def test_the_store_host_gone_on_another_machine_is_named(monkeypatch) -> None:
    port = socket.socket()
    port.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port.getsockname()[1]))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    wd._PEERS.update({0: (peers.machine_id() + "/test-machine:a", 4242, "1"),
                      1: (peers.machine_id(), os.getpid(), peers.start_time(os.getpid()))})
    wd._WATCH["watch"] = wd.DeathWatch(None, {})  # asks its store nothing: no rank ends here
    try:
        assert wd.store_host_gone()  # it refuses connections: no store request is made
        said = wd.peers_verdict(1, wait_s=0)
        assert said is not None and said.startswith("rank 0 (pid 4242), the host of the job's "
                                                    "store"), said
    finally:
        wd._WATCH.pop("watch").close()
        wd._PEERS.clear()
        wd._STORE_GONE.clear()
        port.close()
