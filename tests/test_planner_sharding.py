"""The planner and --use-distributed-optimizer: its memory model counts the sharded state
as the trainer's updater holds it, the search tries plans with and without it and the cost
model decides, and the chosen plan's flags carry it (the emitted launch: test_planner_emit.py).

Fast: pure planner arithmetic, plus the trainer's own ShardLayout and DistributedUpdater
built in-process on a few small tensors (no process group).
"""
from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from megatron_2bw.comm.sharding import ShardLayout
from megatron_2bw.planner import (PRESETS, CostModel, FlopsCompute, Hardware, ModelShape,
                                  ParallelConfig, SearchSpace, enumerate_configs, explain,
                                  search)
from megatron_2bw.planner.cli import main as cli_main
from megatron_2bw.planner.hardware import GB
from megatron_2bw.planner.report import plan_flags
from megatron_2bw.planner.shards import shard_chunk, stage_matrices
from megatron_2bw.planner.spec import FULL, Precision, optimizer_precision

P3 = PRESETS["p3.16xlarge"]
GPT_2_2B = ModelShape("gpt", 32, 2304, 32, 512, 50257)
SMALL = ModelShape("gpt", 8, 512, 8, 128, 1024)
TINY = ModelShape("gpt", 4, 64, 4, 32, 256)
THREE = ModelShape("gpt", 3, 512, 8, 128, 1024)  # 3 layers on 2 devices: no PP, so DP = 2
FP32 = Precision(param_bytes=4, grad_bytes=4, optimizer_bytes=8, activation_bytes=4)


def cost_model(model: ModelShape, hw: Hardware = P3,
               precision: Precision = Precision()) -> CostModel:
    return CostModel(model, FlopsCompute(model, hw), hw, precision)


# ---------------------------------------------------------------- the layout


def test_shard_chunk_is_the_trainers_layout():
    """The planner's C (torch-free) is ShardLayout's chunk for the same parameters, Adam's
    (all cut anywhere) and Muon's (matrices whole), and exceeds the even share by less
    than one matrix (the greedy balance's bound)."""
    rng = random.Random(3)
    for _ in range(60):
        numels = [rng.choice([rng.randint(1, 40), rng.randint(100, 5000)])
                  for _ in range(rng.randint(1, 12))]
        whole = [rng.random() < 0.5 for _ in numels]
        ranks = rng.randint(1, 6)
        sizes = tuple(n for n, w in zip(numels, whole) if w)
        got = shard_chunk(sum(numels), sizes, ranks)
        assert got == ShardLayout(numels, whole, ranks).chunk
        assert shard_chunk(sum(numels), (), ranks) == ShardLayout(numels, [False] * len(numels),
                                                                  ranks).chunk
        even = math.ceil(sum(numels) / ranks)
        assert even <= got <= even + math.ceil(max(sizes, default=0) * (ranks - 1) / ranks)


_BUILT_STAGE = """
import json, sys
from megatron_2bw.models import build_stage
from megatron_2bw.models.compat import apply_cpu_shims
from megatron_2bw.models.config import ModelConfig
from megatron_2bw.optim.muon import is_megatron_muon_param
from megatron_2bw.planner.profile import _single_process_megatron
apply_cpu_shims()
out = []
with _single_process_megatron():
    for fields in json.loads(sys.argv[1]):
        params = [p for p in build_stage(ModelConfig(**fields), 0, 1).parameters()
                  if p.requires_grad]
        out.append([sorted(p.numel() for p in params if is_megatron_muon_param(p)),
                    sum(p.numel() for p in params)])
print(json.dumps(out))
"""


def test_muon_matrices_are_the_built_stages():
    """The matrices the planner keeps whole for Muon, and the stage's parameter count, are
    those of the megatron-core stage the trainer builds (GPT, BERT with its heads, GQA +
    SwiGLU; one stage, so both ends), selected by the trainer's own Muon rule; built in a
    child process (the CPU shims and the process group stay out of this one)."""
    base = dict(model="gpt", num_layers=2, hidden_size=64, num_attention_heads=4,
                seq_length=8, vocab_size=128)
    variants = [base, {**base, "model": "bert"},
                {**base, "num_query_groups": 2, "swiglu": True, "ffn_hidden_size": 96}]
    done = subprocess.run([sys.executable, "-c", _BUILT_STAGE, json.dumps(variants)],
                          capture_output=True, text=True, timeout=300, check=True)
    single = ParallelConfig("flush", 1, 1, 1, 1, 1, FULL)
    for fields, (matrices, total) in zip(variants, json.loads(done.stdout.splitlines()[-1])):
        shape = ModelShape(**fields)
        assert sorted(stage_matrices(shape, 1, 0, 1, 2)) == matrices
        assert cost_model(shape).evaluate(single, simulate_time=False).stages[0].params == total


def _stage_tensors(model: ModelShape, cfg: ParallelConfig, stage: int, params: int,
                   dtype: torch.dtype) -> tuple[list[torch.Tensor], list[bool]]:
    """A stage's parameters as the planner counts them: Muon's matrices (`stage_matrices`,
    2D, h columns) with the rest (biases, LayerNorms, the word embedding) as two 1D
    tensors between them; and which are matrices."""
    h = model.hidden_size
    layers = cfg.stage_layers(model.num_layers)[stage]
    matrices = stage_matrices(model, cfg.tensor_parallel, stage, cfg.pipeline_depth, layers)
    rest = params - sum(matrices)
    assert rest > 0
    shapes = [(n // h, h) for n in matrices]
    shapes.insert(len(shapes) // 2, (rest // 2,))
    shapes.append((rest - rest // 2,))
    tensors = [torch.zeros(s, dtype=dtype) for s in shapes]
    return tensors, [len(s) == 2 for s in shapes]


def _state_bytes_per_rank(tensors: list[torch.Tensor], muon: list[bool], ranks: int,
                          optimizer: str, compensation: str, monkeypatch) -> list[int]:
    """What the trainer's DistributedUpdater holds on each rank (`state_bytes`): built on
    the layout the trainer makes (Muon's matrices whole), its data-parallel rank given
    by a stand-in for `comm.rank` (there is no process group here)."""
    from megatron_2bw import comm
    from megatron_2bw.optim.distributed import DistributedUpdater
    from megatron_2bw.optim.muon import MuonParamSpec
    from megatron_2bw.optim.updater import OptimizerConfig, ParamInfo

    params = [torch.nn.Parameter(t) for t in tensors]
    infos = [ParamInfo(f"p{i}", decay=t.dim() > 1, counts_in_norm=True, tied=False,
                       muon=MuonParamSpec(tuple(t.shape)) if use else None)
             for i, (t, use) in enumerate(zip(tensors, muon))]
    config = OptimizerConfig(optimizer=optimizer, delay_compensation=compensation)
    layout = ShardLayout([t.numel() for t in tensors], [i.muon is not None for i in infos],
                         ranks)
    monkeypatch.setattr(comm, "rank", lambda group: group)  # the "group" is the rank
    return [DistributedUpdater(params, infos, config, layout, data_parallel=rank).state_bytes()
            for rank in range(ranks)]


@pytest.mark.parametrize("optimizer, compensation, precision, dtype", [
    ("adam", "none", Precision(), torch.float16),
    ("adam", "none", FP32, torch.float32),  # no masters: the weights are the masters
    ("adam", "error-feedback", optimizer_precision("adam", "error-feedback"), torch.bfloat16),
    ("muon", "none", optimizer_precision("muon"), torch.bfloat16),
], ids=["adam-fp16", "adam-fp32", "adam-error-feedback", "muon-bf16"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_optimizer_bytes_per_rank_are_what_the_updater_holds(optimizer, compensation, precision,
                                                             dtype, ranks, monkeypatch):
    """The memory model's optimizer state per device (masters, moments, compensation of
    the largest shard) against the updater's own count on every rank, for the first
    stage (embedding, position table) of a PP = 2 plan: Adam exactly (rank 0 holds the
    most: C = ceil(N / w)); Muon, sharded by whole matrices, at most the under-count the
    planner already makes without sharding (the Adam-stepped elements at Muon's 8 B
    instead of 12 B). The gradient buffer is the trainer's padded w C."""
    cm = cost_model(TINY, precision=precision)
    cfg = ParallelConfig("2bw", 1, 2, ranks, 1, 4, FULL, distributed_optimizer=True)
    stage = cm.evaluate(cfg, simulate_time=False).stages[0]
    tensors, muon = _stage_tensors(TINY, cfg, 0, stage.params, dtype)
    held = _state_bytes_per_rank(tensors, muon if optimizer == "muon" else [False] * len(muon),
                                 ranks, optimizer, compensation, monkeypatch)
    planned = stage.state.optimizer_state
    if optimizer == "adam":
        assert planned == max(held) == held[0]
    else:
        adam_elements = sum(t.numel() for t, m in zip(tensors, muon) if not m)
        assert planned <= max(held) <= planned + 4 * adam_elements
        assert max(held) > min(held)  # whole matrices do not split evenly: not 1 / w
    layout = ShardLayout([t.numel() for t in tensors],
                         muon if optimizer == "muon" else [False] * len(muon), ranks)
    assert stage.state.gradients == layout.padded * precision.grad_bytes * 2  # 2BW: 2 buffers
    unsharded = cm.evaluate(replace(cfg, distributed_optimizer=False),
                            simulate_time=False).stages[0].state.optimizer_state
    assert unsharded / ranks <= planned < unsharded


# ---------------------------------------------------------------- what the search does


def _capacity_between(cm: CostModel, space: SearchSpace) -> float:
    """A device memory (GB) that the smallest sharded plan fits in and no other plan."""
    sized = [cm.evaluate(c, simulate_time=False) for c in enumerate_configs(cm, space)]
    plain = min(e.memory_bytes for e in sized if not e.config.distributed_optimizer)
    sharded = min(e.memory_bytes for e in sized if e.config.distributed_optimizer)
    assert sharded < plain
    return (plain + sharded) / 2 / GB


def test_a_plan_that_fits_only_sharded_is_chosen_with_the_flag():
    """THREE on 2 devices (no pipeline: 3 layers): every plan is DP = 2; between the
    sharded and unsharded optimizer's smallest footprint, only sharded plans fit, the
    search picks one, says why, and its flags carry --use-distributed-optimizer."""
    space = SearchSpace(2, 8, tensor_parallel_sizes=(1,))
    hw = replace(P3, memory_per_device_gb=_capacity_between(cost_model(THREE), space))
    cm = cost_model(THREE, hw)
    result = search(cm, space)
    best = result.best
    assert best.config.distributed_optimizer and best.config.data_parallel_width == 2
    assert all(e.config.distributed_optimizer for e in result.ranked)
    assert "--use-distributed-optimizer" in plan_flags(best.config)
    assert best.config.label().endswith(" dopt")
    assert "Distributed optimizer: on" in explain(cm, result)
    off = search(cm, replace(space, distributed_optimizer=(False,)))
    assert off.best is None


def test_at_dp_1_it_is_never_planned_and_shards_nothing(capsys):
    """With one replica there is nothing to shard: no DP = 1 plan gets the flag, even
    when asked for it on every plan, and costing it anyway changes neither the optimizer
    state nor the gradient traffic (only the trainer's gather buffer is added)."""
    cm = cost_model(SMALL)
    always = SearchSpace(8, 32, distributed_optimizer=(True,))
    configs = list(enumerate_configs(cm, always))
    assert all(c.distributed_optimizer == (c.data_parallel_width > 1) for c in configs)
    single = ParallelConfig("2bw", 1, 8, 1, 1, 32, FULL)
    plain, flagged = (cm.evaluate(replace(single, distributed_optimizer=f)) for f in (0, 1))
    for a, b in zip(plain.stages, flagged.stages):
        assert (a.state.optimizer_state, a.state.gradients, a.allreduce_s) == (
            b.state.optimizer_state, b.state.gradients, b.allreduce_s)
    code = cli_main(["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads",
                     "8", "--seq-length", "128", "--vocab-size", "1024", "--global-batch-size",
                     "8", "--num-gpus", "1", "--distributed-optimizer", "on"])
    out = capsys.readouterr().out
    assert code == 0 and "torchrun" in out and "--use-distributed-optimizer" not in out


def test_traffic_is_a_reduce_scatter_and_an_all_gather():
    """Without latencies: where the all-reduce moved 2 (w - 1) / w x 4 B per parameter, the
    sharded optimizer reduce-scatters the padded fp32 gradient ((w - 1) / w x 4 B: half
    the time) and all-gathers the new fp16 weights in the step ((w - 1) / w x 2 B); a
    middle stage, which ties no embedding."""
    hw = replace(P3, intra_node_latency_us=0.0, inter_node_latency_us=0.0)
    cm = cost_model(SMALL, hw)
    cfg = ParallelConfig("flush", 1, 4, 2, 2, 4, FULL, distributed_optimizer=True)
    sharded = cm.evaluate(cfg, simulate_time=False).stages[1]
    plain = cm.evaluate(replace(cfg, distributed_optimizer=False),
                        simulate_time=False).stages[1]
    shard = cm.shard(cfg, 1, sharded.params, sharded.layers)
    assert shard.padded == 2 * math.ceil(sharded.params / 2)
    assert sharded.allreduce_s == pytest.approx(plain.allreduce_s / 2 * shard.padded
                                                / sharded.params)
    stepping = shard.chunk * cm.precision.step_bytes_touched / hw.hbm_bytes_per_s
    assert sharded.step_s - stepping == pytest.approx(sharded.allreduce_s / 2)  # 2 B vs 4 B
    assert plain.step_s == pytest.approx(plain.params * cm.precision.step_bytes_touched
                                         / hw.hbm_bytes_per_s)


def test_the_cost_model_decides_between_them():
    """Where both fit, time decides. Flush leaves its all-reduce exposed: the reduce-scatter
    + all-gather move 6 B per parameter where it moved 8 B, and the step touches 1 / w of
    the state, so sharding is faster. 2BW hides its all-reduce behind the next minibatch,
    but the step's all-gather of the new weights blocks: across servers, slower. The
    search keeps the faster of the two."""
    cm = cost_model(GPT_2_2B, replace(P3, memory_per_device_gb=1000.0))

    def times(cfg: ParallelConfig) -> tuple[float, float]:
        return tuple(cm.evaluate(replace(cfg, distributed_optimizer=f)).iteration_time_s
                     for f in (False, True))

    hidden = ParallelConfig("2bw", 2, 4, 8, 2, 32, FULL)
    assert cm.exposed_allreduce_s(cm.evaluate(hidden)) < 1e-3
    plain, sharded = times(hidden)
    assert plain < sharded
    plain, sharded = times(ParallelConfig("flush", 1, 4, 16, 2, 16, FULL))
    assert sharded < plain
    space = SearchSpace(64, 512, schedules=("2bw",), micro_batch_sizes=(2,),
                        tensor_parallel_sizes=(2,), recompute=(FULL,), uneven_stages=False)
    ranked = search(cm, space).ranked
    place = {e.config: i for i, e in enumerate(ranked)}
    pairs = [(e, ranked[place[replace(e.config, distributed_optimizer=False)]])
             for e in ranked if e.config.distributed_optimizer
             and replace(e.config, distributed_optimizer=False) in place]
    assert pairs and any(s.iteration_time_s < p.iteration_time_s for s, p in pairs) \
        and any(p.iteration_time_s < s.iteration_time_s for s, p in pairs)
    for sharded, plain in pairs:
        assert (place[sharded.config] < place[plain.config]) == (
            sharded.iteration_time_s < plain.iteration_time_s)


def test_pruning_keeps_the_best_plan_with_the_sharded_twins():
    """The pruned search picks what the exhaustive one does with both settings searched,
    memory ample or tight (where some plans fit only sharded)."""
    for memory in (16.0, 1.3, 1.2):
        cm = cost_model(SMALL, replace(P3, memory_per_device_gb=memory))
        pruned, full = (search(cm, SearchSpace(8, 32), exhaustive=e) for e in (False, True))
        assert pruned.best.config == full.best.config
