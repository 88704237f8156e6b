"""--use-distributed-optimizer: the optimizer state sharded over data parallelism.

The numbers must not change: with the flag, flush and 2BW (Adam, Muon, both delay
compensations, bf16, a per-token loss) at DP = 2 x PP = 2 take the steps they take
without it; the gradient really is reduce-scattered and the weights all-gathered (a
recorder around torch.distributed counts the elements); each rank holds its share of the
state; checkpoints reshard between DP sizes and to and from the non-distributed optimizer.
"""
from __future__ import annotations

import json

import pytest
import torch

from megatron_2bw.comm.sharding import ShardLayout
from tests.entry_harness import launch, losses, max_rel

ITERS = ["--train-iters", "5", "--global-batch-size", "8"]
PP2 = ["--pipeline-model-parallel-size", "2"]  # on 4 processes: DP = 2
SHARD = ["--use-distributed-optimizer"]


# ------------------------------------------------------------------ the layout


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_layout_covers_every_element_once(ranks: int) -> None:
    """Adam's parameters cut anywhere, Muon's (whole) on one rank each; every element of
    every parameter is in exactly one rank's pieces, and no chunk overflows."""
    numels = [300, 7, 1024, 5, 640, 640, 33]
    whole = [False, False, True, False, True, True, False]
    layout = ShardLayout(numels, whole, ranks)
    seen = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for rank in range(ranks):
        pieces = layout.owned(rank)
        assert sum(p.numel for p in pieces) <= layout.chunk
        for p in pieces:
            seen[p.param][p.start:p.stop] += 1
            assert not whole[p.param] or (p.start, p.stop) == (0, numels[p.param])
    assert all(bool((s == 1).all()) for s in seen)
    flat = torch.arange(sum(numels), dtype=torch.float32)
    packed = torch.zeros(layout.padded)
    layout.pack(flat, packed)
    params = [torch.zeros(n) for n in numels]
    layout.unpack(packed, params)
    assert torch.equal(torch.cat(params), flat)


def test_adam_layout_is_contiguous_and_even() -> None:
    """Without whole parameters rank r owns elements [r C, (r + 1) C) of the flat
    gradient: the collectives run on the flat buffer itself, C = ceil(N / w)."""
    layout = ShardLayout([10, 7, 6], [False] * 3, 4)
    assert layout.contiguous and layout.chunk == 6 and layout.padded == 24
    assert [(p.param, p.start, p.stop, p.flat) for p in layout.owned(1)] == [(0, 6, 10, 6),
                                                                             (1, 0, 2, 10)]


# ------------------------------------------------------------------ through the entry point


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    """flush at DP = 2 x PP = 2 without the flag (equal to PP = 1: test_training.py)."""
    path = tmp_path_factory.mktemp("replicated") / "m.jsonl"
    return launch("gpt", 4, ITERS + PP2 + ["--pipeline-schedule", "flush"], str(path))


@pytest.mark.slow
def test_flush_steps_as_without_it_and_reduce_scatters(tmp_path, replicated) -> None:
    """The same losses and gradient norms (fp32, 1e-5), and per step on each
    data-parallel rank one reduce-scatter of the whole (padded) gradient and one
    all-gather of the new weights, where the replicated optimizer all-reduces; the only
    data-parallel all-reduce of tensors is the tied embedding's."""
    prefix = tmp_path / "collectives"
    sharded = launch("gpt", 4, ITERS + PP2 + ["--pipeline-schedule", "flush"] + SHARD,
                     str(tmp_path / "m.jsonl"),
                     env={"MEGATRON_2BW_RECORD_COLLECTIVES": str(prefix)})
    assert max_rel(losses(sharded), losses(replicated)) < 1e-5
    assert max_rel([r["grad_norm"] for r in sharded],
                   [r["grad_norm"] for r in replicated]) < 1e-5
    entries = json.loads((tmp_path / "collectives.rank0.json").read_text())["collectives"]
    dp = [e for e in entries if e["group"] == "data-parallel"]
    scatter = [e for e in dp if e["op"] in ("reduce_scatter_tensor", "reduce_scatter_single")]
    gather = [e for e in dp if e["op"] in ("all_gather_into_tensor", "all_gather_single")]
    assert sum(e["calls"] for e in scatter) == sum(e["calls"] for e in gather) == 5
    per_step = sum(e["elements"] for e in scatter) // 5
    assert per_step == sum(e["elements"] for e in gather) // 5
    tied = 128 * 32  # the word embedding (padded vocabulary x hidden) on stage 0
    positions = 16 * 32  # the learned position table (sequence 16)
    params = tied + positions + 2 * (4 * 32 * 32 + 4 * 32 + 8 * 32 * 32 + 5 * 32 + 4 * 32)
    assert params <= per_step < params + 2  # padded to a multiple of DP = 2
    reduced = [e for e in dp if e["op"] == "all_reduce" and "grad_sync" in e["caller"]]
    assert max(e["elements"] // e["calls"] for e in reduced) == tied


@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    ["--optimizer", "muon", "--delay-compensation", "error-feedback"],
    pytest.param(["--bf16", "--delay-compensation", "weight-prediction",
                  "--calculate-per-token-loss"], marks=pytest.mark.matrix),
], ids=["muon-error-feedback", "bf16-weight-prediction-per-token"])
def test_2bw_steps_as_without_it(tmp_path, flags) -> None:
    """2BW: the all-gather writes the version the step publishes while the shadow
    version serves in-flight microbatches; Muon's matrices whole on one rank each."""
    run = ITERS + PP2 + ["--pipeline-schedule", "2bw"] + flags
    plain = losses(launch("gpt", 4, run, str(tmp_path / "a.jsonl")))
    sharded = losses(launch("gpt", 4, run + SHARD, str(tmp_path / "b.jsonl")))
    assert max_rel(sharded, plain) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("fmt, sharded_first", [
    ("torch_dist", True),
    pytest.param("torch_dist", False, marks=pytest.mark.matrix),
    pytest.param("torch", True, marks=pytest.mark.matrix),
    pytest.param("torch", False, marks=pytest.mark.matrix),
])
def test_checkpoint_reshards_to_another_dp_size_and_back(tmp_path, replicated, fmt,
                                                         sharded_first) -> None:
    """Saved sharded at DP = 2 (iteration 3), resumed not sharded at DP = 1 (PP = 2 on 2
    processes); or saved not sharded at DP = 2, resumed sharded at DP = 2: both continue
    the uninterrupted run's losses."""
    first = ITERS + PP2 + ["--pipeline-schedule", "flush", "--ckpt-format", fmt]
    saved = str(tmp_path / "saved")
    launch("gpt", 4, first + (SHARD if sharded_first else []) + ["--save", saved,
                                                                 "--exit-interval", "3"],
           str(tmp_path / "a.jsonl"))
    resumed = launch("gpt", 2 if sharded_first else 4,
                     first + ([] if sharded_first else SHARD) + ["--load", saved],
                     str(tmp_path / "b.jsonl"))
    assert [r["iteration"] for r in resumed] == [4, 5]
    assert max_rel(losses(resumed), losses(replicated)[3:]) < 1e-5
