"""Adam's state crosses between this engine and Megatron-LM (core_v0.16.1) both ways, in
Megatron-LM's three optimizer layouts of a torch_dist checkpoint.

- the gradient-bucket layout the dp_reshardable layout is written in is megatron-core's:
  our arrangement against its `_ParamAndGradBuffer` and its distributed optimizer's
  per-rank ranges, at several data-parallel sizes and bucket sizes;
- Megatron-LM's side: megatron-core's own optimizer (the installed package's
  DistributedOptimizer: `sharded_state_dict` + `dist_checkpointing.load` +
  `load_state_dict`, as Megatron-LM's `load_checkpoint` calls them) loads our
  dp_reshardable checkpoint with every shard of Adam's moments and fp32 main weights equal
  to our state (there read through our bucket index); it saves it again in its own
  layout, and our run resumed from that continues with the uninterrupted run's losses;
- our side: the checkpoints Megatron-LM's `save_checkpoint` wrote
  (tests/fixtures/megatron_lm/torch_dist_adam*, tools/checkpoint/megatron_fixtures.py)
  load with Adam's moments, step and fp32 main weights equal to what Megatron-LM's
  optimizer held (adam_reference/), resharded to another DP or TP; a dp_reshardable one
  at another TP is refused in one line; its --ckpt-format torch file (torch_adam: the
  non-distributed optimizer's index-keyed Adam state) resumes likewise;
- our dp_reshardable saves, which hold Adam's state in the buckets only: their index
  reads it back at another tensor-parallel size exactly; one written with a per-parameter
  copy too (tests/fixtures/megatron_2bw/) still resumes.
"""
from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

from megatron_2bw.checkpointing import megatron_optim as mlo
from megatron_2bw.checkpointing.megatron_optim.index import bucket_entries, merged
from tests.dist_harness import run_distributed
from tests.entry_harness import ROOT, launch, losses, max_rel

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "megatron_lm")
# the optimizer fixtures' model (megatron_fixtures.py ADAM_MODEL)
ADAM_MODEL = dict(model="gpt", num_layers=1, hidden_size=8, num_attention_heads=2,
                  seq_length=8, vocab_size=64, seed=77)


def _tool(name: str):
    """A module of tools/checkpoint (not a package)."""
    path = os.path.join(ROOT, "tools", "checkpoint", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_tools_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ the bucket layout


class _Group:
    """A stand-in process group: megatron-core's buffer code asks only its size and rank."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


SHAPES = [(64, 8), (24,), (24, 8), (8,), (8, 8), (32, 8), (32,), (8, 32), (100, 3)]


def _megatron_core_layout(dp: int, bucket_size, shared: int) -> tuple:
    """megatron-core's buckets ((numel, unpadded), [(param, start in bucket)] in its
    order) and each rank's ranges, for SHAPES with parameter `shared` the shared word
    embedding."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    harness = _tool("megatron_harness")
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    params[shared].shared_embedding = True
    config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    pg = SimpleNamespace(tp=_Group(1), dp_cp=_Group(dp))
    with harness.cpu_as_cuda():
        torch.cuda.current_device = lambda: "cpu"
        buffer = _ParamAndGradBuffer(config, torch.float32, torch.float32, params, _Group(dp),
                                     bucket_size, {p: str(i) for i, p in enumerate(params)},
                                     1.0, list(range(len(params))), False, pg)
    index = {id(p): i for i, p in enumerate(params)}
    buckets = []
    for b, bucket in enumerate(buffer.buckets):
        slots = [(index[id(p)], start - bucket.offset)
                 for p, (start, _, bid) in buffer.param_index_map.items() if bid == b]
        ranks = []
        for r in range(dp):
            buffer.data_parallel_group = _Group(dp, r)
            ranges = DistributedOptimizer._build_model_gbuf_range(buffer, b)["param_map"]
            ranks.append([(index[id(p)], m["gbuf_local"].start, m["gbuf_local"].end)
                          for p, m in ranges.items()])
        buckets.append(((bucket.grad_data.numel(), bucket.numel_unpadded), slots, ranks))
    return buckets


def _our_layout(dp: int, bucket_size, shared: int) -> list:
    specs = [mlo.ParamSpec(i, str(i), s, torch.float32, i == shared, False, len(s) == 1,
                           False) for i, s in enumerate(SHAPES)]
    fmt = mlo.OptimizerFormat(mlo.DP_RESHARDABLE, "fp32", True,
                              overlap_grad_reduce=bucket_size is not None, bucket_size=bucket_size)
    (buffer,) = mlo.grad_buffers([specs], fmt, expert=False, dp=dp, pp_rank=0)
    assert buffer.dtype_key == "(torch.float32, torch.float32)"
    out = []
    for bucket in buffer.buckets:
        size = bucket.numel // dp
        ranks = [[(p.slot.index, p.start - r * size, p.stop - r * size)
                  for p in mlo.owned(bucket, dp, r)]
                 for r in range(dp)]
        out.append(((bucket.numel, bucket.unpadded),
                    [(s.index, s.start) for s in bucket.slots], ranks))
    return out


def _compare_layouts(rank: int, world: int) -> int:
    cases = 0
    for dp in (1, 2, 3, 8):
        for bucket_size in (None, 300):
            for shared in (0, 4, len(SHAPES) - 1):
                assert _our_layout(dp, bucket_size, shared) == \
                    _megatron_core_layout(dp, bucket_size, shared), (dp, bucket_size, shared)
                cases += 1
    return cases


def test_bucket_layout_is_megatron_cores() -> None:
    """Buckets, each parameter's place in its bucket and each data-parallel rank's
    ranges equal megatron-core's own, with the shared embedding first, inside and last,
    one bucket or several, at DP 1, 2, 3 and 8."""
    assert run_distributed(_compare_layouts, 1) == [24]


# ------------------------------------------------------------------ Megatron-LM's side


def _megatron_core_optimizer(model, distributed: bool):
    """megatron-core's DDP and (distributed) bf16 optimizer (the installed package)
    around `model`, with Megatron-LM's default param groups."""
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    harness = _tool("megatron_harness")
    with harness.cpu_as_cuda():
        torch.cuda.current_device = lambda: "cpu"
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            use_distributed_optimizer=distributed, grad_reduce_in_fp32=True), model)
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=1e-2, min_lr=0.0, weight_decay=0.01, bf16=True,
            use_distributed_optimizer=distributed, clip_grad=1.0), [ddp])
    harness.allocate_state(optimizer)
    return ddp, optimizer


def _roundtrip(rank: int, world: int, saved: str, out: str, main_key: str) -> dict:
    """Load our iteration-3 checkpoint with megatron-core's optimizer as Megatron-LM's
    load_checkpoint does, compare it with our per-parameter tensors, save it again as
    Megatron-LM's save_checkpoint does (its layout only)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron_2bw.checkpointing.sharded import read_common
    from megatron_2bw.models.compat import cpu_dist_checkpointing
    from megatron_2bw.models.config import ModelConfig
    harness, fixtures = _tool("megatron_harness"), _tool("megatron_fixtures")
    roundtrip = _tool("megatron_roundtrip")
    ps.initialize_model_parallel(1, 1)
    path = os.path.join(saved, "iter_0000003")
    common = read_common(saved, 3)
    model = harness.build_model(ModelConfig(
        model="gpt", num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
        vocab_size=128, seed=1234, params_dtype=torch.bfloat16), 0, 1)
    ddp, optimizer = _megatron_core_optimizer(model, common["args"].use_distributed_optimizer)
    meta = dist_checkpointing.load_content_metadata(path)
    meta["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    with harness.cpu_as_cuda(), cpu_dist_checkpointing():
        model_sd = model.sharded_state_dict(metadata=meta)
        loaded = dist_checkpointing.load(
            {"model": model_sd, "optimizer": optimizer.sharded_state_dict(
                model_sd, is_loading=True, metadata=meta)}, path)
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        theirs = fixtures.optimizer_reference(ddp, optimizer)["state"]
    ours = roundtrip._ours(ddp, path, main_key)
    equal = {state: sum(torch.equal(theirs[p][state], t[state]) for p, t in ours.items())
             for state, _ in roundtrip.STATES}
    steps = [roundtrip._group_step(optimizer)]
    with harness.cpu_as_cuda(), cpu_dist_checkpointing():
        model_sd = model.sharded_state_dict(metadata=meta)
        state = {"args": common["args"], "checkpoint_version": 3.0, "iteration": 3,
                 "model": model_sd, "optimizer": optimizer.sharded_state_dict(
                     model_sd, metadata=meta),
                 "opt_param_scheduler": common["opt_param_scheduler"],
                 "num_floating_point_operations_so_far": 0}
        os.makedirs(os.path.join(out, "iter_0000003"), exist_ok=True)
        dist_checkpointing.save(state, os.path.join(out, "iter_0000003"),
                                content_metadata=mlo.save_format(common["args"])
                                .content_metadata())
    if rank == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("3")
    return {"equal": equal, "compared": len(ours), "steps": set(steps)}


@pytest.mark.slow
@pytest.mark.parametrize("layout,main_key", [
    (["--use-distributed-optimizer"], "optimizer.state.fp32_param"),
    pytest.param(["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"],
                 "optimizer.state.param", marks=pytest.mark.matrix),
    pytest.param([], "optimizer.state.fp32_param", marks=pytest.mark.matrix),
], ids=["dp_reshardable", "fully_reshardable", "not-distributed"])
def test_megatron_core_loads_ours_and_we_resume_its_save(tmp_path, layout, main_key) -> None:
    """A bf16 run at DP = 2 saves at iteration 3 (with --use-distributed-optimizer in the
    dp_reshardable layout); megatron-core's optimizer loads it with every shard of Adam's
    moments and fp32 main weights equal to ours and Adam's step 3; saved again by
    megatron-core in its own layout (none of our per-parameter tensors left in the
    dp_reshardable one), it resumes here with the uninterrupted run's losses for
    iterations 4-6, bit for bit."""
    run = ["--global-batch-size", "8", "--train-iters", "6", "--ckpt-format", "torch_dist",
           "--bf16", *layout]
    saved, out = str(tmp_path / "saved"), str(tmp_path / "megatron")
    whole = losses(launch("gpt", 2, run + ["--save", saved, "--save-interval", "3"],
                          str(tmp_path / "whole.jsonl")))
    results = run_distributed(_roundtrip, 2, saved, out, main_key)
    for r in results:
        assert r["equal"] == {s: r["compared"] for s in r["equal"]} and r["compared"] > 0, r
        assert r["steps"] == {3}, r
    resumed = launch("gpt", 2, run + ["--load", out, "--no-load-rng"],
                     str(tmp_path / "resumed.jsonl"))
    assert [r["iteration"] for r in resumed] == [4, 5, 6]
    assert max_rel(losses(resumed), whole[3:]) == 0.0


# ------------------------------------------------------------------ our side


class _Weights:
    """The executor's checkpoint contract over one built stage (no weight versions)."""

    def __init__(self, stage, iteration: int):
        from megatron_2bw.runtime.checkpoint import WeightsCheckpoint
        params = tuple(p for p in stage.parameters() if p.requires_grad)
        self.record = WeightsCheckpoint(iteration, (iteration,), (stage,), (params,),
                                        {iteration: 1.0})

    def checkpoint_state(self):
        return self.record

    def restore_checkpoint(self, loss_scales) -> None:
        pass


def _resume_fixture(rank: int, world: int, name: str, tp: int, bf16: bool) -> dict:
    """Load Megatron-LM's fixture `name` at TP = tp into a stage and an Adam updater of
    this engine; {state: parameter tensors equal to Megatron-LM's, of how many} and the
    step, compared with adam_reference."""
    from megatron.core import parallel_state as ps
    from megatron_2bw.checkpointing.sharded import load_sharded, read_common
    from megatron_2bw.models import apply_cpu_shims, build_stage, model_parallel_manual_seed
    from megatron_2bw.models.config import ModelConfig
    from megatron_2bw.optim.updater import MegatronUpdater, OptimizerConfig, ParamInfo
    ps.initialize_model_parallel(tp, 1)
    apply_cpu_shims("cpu")
    model_parallel_manual_seed(77)
    stage = build_stage(ModelConfig(**ADAM_MODEL, params_dtype=torch.bfloat16 if bf16
                                    else torch.float32), 0, 1)
    named = [(n, p) for n, p in stage.named_parameters() if p.requires_grad]
    updater = MegatronUpdater([p for _, p in named], [
        ParamInfo(n, p.dim() > 1, True, False) for n, p in named], OptimizerConfig(lr=1e-2))
    root = os.path.join(FIXTURES, name)
    loaded = load_sharded(root, 3, read_common(root, 3), _Weights(stage, 3), updater)
    state = loaded["optimizer"]
    reference = torch.load(os.path.join(FIXTURES, "adam_reference", f"{name}.pt"))
    places = {id(st.data): st for st in stage.sharded_state_dict().values()
              if isinstance(getattr(st, "data", None), torch.nn.Parameter)}
    mine = {"exp_avg": state["adam"]["exp_avg"], "exp_avg_sq": state["adam"]["exp_avg_sq"],
            "param": state["masters"] or [loaded["model"][n] for n, _ in named]}
    equal = {k: sum(torch.equal(t.float(), _reference_piece(reference, places[id(p)], k))
                    for t, (_, p) in zip(tensors, named)) for k, tensors in mine.items()}
    return {"equal": equal, "params": len(named), "step": state["adam"]["step"],
            "reference_step": reference["step"]}


def _reference_piece(reference: dict, st, kind: str) -> torch.Tensor:
    """This rank's piece of the whole (TP 1) tensor Megatron-LM's optimizer held."""
    p = st.prepend_axis_num
    whole = reference["state"][(st.key, tuple(st.global_offset[:p]) + (0,) * (
        len(st.global_offset) - p))][kind]
    index = tuple(slice(o, o + n) for o, n in zip(st.global_offset[p:], st.local_shape))
    return whole[index]


@pytest.mark.slow
@pytest.mark.parametrize("name,world,bf16", [
    ("torch_dist_adam", 1, False),      # the non-distributed layout, fp32
    ("torch_dist_adam_dp", 1, True),    # dp_reshardable saved at DP 2, read at DP 1
    ("torch_dist_adam_full", 2, True),  # fully_reshardable saved at TP 1, read at TP 2
])
def test_megatron_lm_checkpoint_resumes_with_its_adam_state(name, world, bf16) -> None:
    for r in run_distributed(_resume_fixture, world, name, world, bf16):
        assert r["equal"] == {k: r["params"] for k in r["equal"]}, r
        assert r["step"] == r["reference_step"] == 3, r


def _refused_at_tp2(rank: int, world: int) -> str:
    from megatron_2bw.checkpointing.files import CheckpointError
    try:
        _resume_fixture(rank, world, "torch_dist_adam_dp", 2, True)
    except CheckpointError as err:
        return str(err)
    return "loaded"


@pytest.mark.slow
def test_dp_reshardable_at_another_tp_is_refused_in_one_line() -> None:
    path = os.path.join(FIXTURES, "torch_dist_adam_dp", "iter_0000003")
    for line in run_distributed(_refused_at_tp2, 2):
        assert line == (f"the checkpoint ({path}): its optimizer state is in Megatron-LM's "
                        "dp_reshardable layout, which loads only at the parallel layout it "
                        "was saved at: resume with --tensor-model-parallel-size 1 (any "
                        "data-parallel size), or pass --no-load-optim, or save it in "
                        "Megatron-LM with --dist-ckpt-optim-fully-reshardable"), line


def _resume_torch_fixture(rank: int, world: int) -> dict:
    """Resume Megatron-LM's --ckpt-format torch fixture (bf16, non-distributed optimizer)
    into a stage and an Adam updater as restore does; compare what the updater then holds
    with adam_reference."""
    from megatron.core import parallel_state as ps
    from megatron_2bw.checkpointing.reading import read_checkpoint
    from megatron_2bw.checkpointing.restoring import read_megatron_torch_optimizer
    from megatron_2bw.models import apply_cpu_shims, build_stage, model_parallel_manual_seed
    from megatron_2bw.models.config import ModelConfig
    from megatron_2bw.optim.updater import MegatronUpdater, OptimizerConfig, ParamInfo
    ps.initialize_model_parallel(1, 1)
    apply_cpu_shims("cpu")
    model_parallel_manual_seed(77)
    stage = build_stage(ModelConfig(**ADAM_MODEL, params_dtype=torch.bfloat16), 0, 1)
    named = [(n, p) for n, p in stage.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    updater = MegatronUpdater(params, [ParamInfo(n, p.dim() > 1, True, False)
                                       for n, p in named], OptimizerConfig(lr=1e-2))
    loaded = read_checkpoint(os.path.join(FIXTURES, "torch_adam"))
    read_megatron_torch_optimizer(loaded, _Weights(stage, 3).checkpoint_state(), updater)
    saved = loaded.state["optimizer"]
    updater.restore_checkpoint(saved, params, "checkpoint", saved["masters"])
    state = updater.state_dict()
    reference = torch.load(os.path.join(FIXTURES, "adam_reference", "torch_adam.pt"))
    places = {id(st.data): st for st in stage.sharded_state_dict().values()
              if isinstance(getattr(st, "data", None), torch.nn.Parameter)}
    mine = {"exp_avg": state["adam"]["exp_avg"], "exp_avg_sq": state["adam"]["exp_avg_sq"],
            "param": state["masters"]}
    equal = {k: sum(torch.equal(t.float(), _reference_piece(reference, places[id(p)], k))
                    for t, p in zip(tensors, params)) for k, tensors in mine.items()}
    return {"equal": equal, "params": len(named), "step": state["adam"]["step"],
            "reference_step": reference["step"]}


@pytest.mark.slow
def test_megatron_lm_torch_format_resumes_with_its_adam_state() -> None:
    """The torch fixture's Adam moments, fp32 main weights and step, every parameter
    matched to its saved index; the distributed optimizer's file is refused in one line."""
    r = run_distributed(_resume_torch_fixture, 1)[0]
    assert r["equal"] == {k: r["params"] for k in r["equal"]}, r
    assert r["step"] == r["reference_step"] == 3, r
    with pytest.raises(mlo.LayoutError, match="distrib_optim.pt .* --no-load-optim"):
        mlo.torch_optimizer_state({"optimizer": {}}, [],
                                  SimpleNamespace(use_distributed_optimizer=True))


# ------------------------------------------------------------------ our bucket index

# (key, global shape, how it is split): a vocabulary-parallel embedding, weights saved
# transposed by a factory (as megatron-core's grouped experts: made contiguous; or
# cloned, which leaves no view to read the placement from), and per layer (layer axis
# prepended) SwiGLU's fc1 (megatron-core's factory: the two halves split apart), a
# row-parallel weight and a norm weight replicated over tensor parallelism
INDEXED = [("embedding.weight", (16, 4), "rows"), ("experts.weight", (8, 4), "transposed"),
           ("experts.cloned", (8, 4), "transposed"),
           ("layers.fc1.weight", (2, 16, 4), "swiglu"),
           ("layers.proj.weight", (2, 4, 8), "columns"), ("layers.norm.weight", (2, 4), None)]


def _local(whole: torch.Tensor, split, tp: int, r: int) -> torch.Tensor:
    """Rank r's piece of one layer's (or a layer-less) tensor at tensor-parallel size tp."""
    if split == "rows":
        return whole.chunk(tp)[r]
    if split == "transposed":
        return whole.chunk(tp)[r].t().contiguous()
    if split == "columns":
        return whole.chunk(tp, dim=1)[r]
    if split == "swiglu":
        w, v = whole.chunk(2)
        return torch.cat([w.chunk(tp)[r], v.chunk(tp)[r]])
    return whole


def _indexed_params(wholes: dict, tp: int, r: int) -> list:
    """(model shard, {state: local tensor}) of rank r's parameters, megatron-core's way."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    def transposed(key, t, replica_id, flattened_range):
        data = t.t().clone() if key == "experts.cloned" else t.t().contiguous()
        return ShardedTensor.from_rank_offsets(key, data, (0, r, tp), replica_id=replica_id)
    out = []
    for key, shape, split in INDEXED:
        if split == "transposed":
            local = {s: _local(t, split, tp, r) for s, t in wholes[key].items()}
            out.append((ShardedTensorFactory(key, local["param"], transposed, lambda x: x,
                                             (0, 0, 0)), local))
            continue
        for layer in range(shape[0]) if len(shape) == 3 or split is None else [None]:
            pre = () if layer is None else ((0, layer, shape[0]),)
            local = {s: _local(t if layer is None else t[layer], split, tp, r)
                     for s, t in wholes[key].items()}
            axis = {"rows": 0, "swiglu": 0, "columns": 1}.get(split)
            cut = () if axis is None else ((axis + len(pre), r, tp),)
            st = ShardedTensor.from_rank_offsets(
                key, local["param"], *pre, *cut, prepend_axis_num=len(pre),
                replica_id=(0, r if split is None else 0, 0))
            out.append((apply_swiglu_sharded_factory(st, pre) if split == "swiglu" else st,
                        local))
    return out


def _index_at(wholes: dict, tp: int) -> tuple[dict, dict]:
    """The bucket index a TP = tp save writes, and its buckets' flat state tensors."""
    index_parts, store = [], {}
    fmt = mlo.OptimizerFormat(mlo.DP_RESHARDABLE, "fp32", True)
    for r in range(tp):
        params = _indexed_params(wholes, tp, r)
        specs = [mlo.ParamSpec(i, st.key, tuple(local["param"].shape), torch.float32, False,
                               False, False, False) for i, (st, local) in enumerate(params)]
        (buffer,) = mlo.grad_buffers([specs], fmt, expert=False, dp=1, pp_rank=0)
        for b, bucket in enumerate(buffer.buckets):
            key = f"optimizer.distributed.dp_group_idx_{r}.bucket_idx_{b}"
            for state in ("param", "exp_avg", "exp_avg_sq"):
                flat = store.setdefault(f"{key}.{state}", torch.zeros(bucket.unpadded))
                for slot in bucket.slots:
                    flat[slot.start:slot.start + slot.numel] = \
                        params[slot.index][1][state].reshape(-1)
            index_parts.append(bucket_entries(key, bucket, lambda i: params[i][0]))
    return merged(index_parts), store


@pytest.mark.parametrize("saved_tp,read_tp", [(2, 1), (1, 2)])
def test_bucket_index_reads_the_state_back_at_another_tensor_parallel_size(
        saved_tp, read_tp) -> None:
    """The buckets of a save at one tensor-parallel size, read through its index at
    another, give every rank's parameters exactly the pieces of the whole state that
    megatron-core's sharding (SwiGLU's split halves, row- and column-parallel weights,
    replicated norms, layers stacked on an axis) assigns them."""
    gen = torch.Generator().manual_seed(3)
    wholes = {key: {s: torch.randn(shape, generator=gen) for s in ("param", "exp_avg",
                                                                  "exp_avg_sq")}
              for key, shape, _ in INDEXED}
    index, store = _index_at(wholes, saved_tp)
    kinds = {"fp32_param": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
    for r in range(read_tp):
        params = _indexed_params(wholes, read_tp, r)
        read = mlo.index_read(index, {i: st for i, (st, _) in enumerate(params)}, set(kinds))
        loaded = {name: {s: store[st.key][st.global_offset[0]:][:st.local_shape[0]]
                         for s, st in states.items()} for name, states in read.template.items()}
        found = read.found(loaded)
        for kind, state in kinds.items():
            assert all(torch.equal(found[kind][i], local[state])
                       for i, (_, local) in enumerate(params)), (kind, r)


def test_vocabulary_padding_rows_the_save_lacks_start_fresh() -> None:
    """An embedding saved with 16 padded rows at TP 1, read at TP 2 padded to 32 rows:
    the saved rows come back, the rows past them keep the parameter's own values (a
    fresh model's padding) with zero moments; a tensor that is not the vocabulary's
    still needs the index to cover it."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    key, gen = "embedding.word_embeddings.weight", torch.Generator().manual_seed(5)
    saved = {s: torch.randn(16, 4, generator=gen) for s in ("param", "exp_avg", "exp_avg_sq")}
    fmt = mlo.OptimizerFormat(mlo.DP_RESHARDABLE, "fp32", True)
    st = ShardedTensor.from_rank_offsets(key, saved["param"], (0, 0, 1), replica_id=(0, 0, 0))
    spec = mlo.ParamSpec(0, key, (16, 4), torch.float32, False, False, False, False)
    (bucket,) = mlo.grad_buffers([[spec]], fmt, expert=False, dp=1, pp_rank=0)[0].buckets
    bucket_key = "optimizer.distributed.dp_group_idx_0.bucket_idx_0"
    index = merged([bucket_entries(bucket_key, bucket, lambda i: st)])
    store = {s: t.reshape(-1) for s, t in saved.items()}
    kinds = {"fp32_param": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
    fresh = torch.randn(32, 4, generator=gen)
    for r in range(2):
        shard = ShardedTensor.from_rank_offsets(key, fresh.chunk(2)[r].clone(), (0, r, 2),
                                                replica_id=(0, 0, 0))
        read = mlo.index_read(index, {0: shard}, set(kinds))
        loaded = {name: {s: store[s][t.global_offset[0]:][:t.local_shape[0]]
                         for s, t in states.items()} for name, states in read.template.items()}
        found = read.found(loaded)
        for kind, state in kinds.items():
            want = (saved[state] if r == 0 else fresh[16:] if kind == "fp32_param"
                    else torch.zeros(16, 4))
            assert torch.equal(found[kind][0], want), (kind, r)
    other = ShardedTensor.from_rank_offsets("decoder.weight", fresh, replica_id=(0, 0, 0))
    with pytest.raises(mlo.LayoutError, match="covers 0 of the 128 elements of decoder"):
        mlo.index_read(index, {0: other}, set(kinds))


FIXTURES_OURS = os.path.join(ROOT, "tests", "fixtures", "megatron_2bw")


def _resume_both_copies(rank: int, world: int) -> dict:
    """Load dp_reshardable_per_parameter at DP = 1: this engine's per-parameter tensors as
    the resume read them, and the buckets read through Megatron-LM's layout. The fixture
    is iteration 2 of `pretrain_gpt.py` with ADAM_MODEL's flags (`--num-layers 1
    --hidden-size 8 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8
    --vocab-size 63 --make-vocab-size-divisible-by 64`) and `--mock-data --seed 77
    --micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --train-iters 2 --bf16
    --use-distributed-optimizer --ckpt-format torch_dist --no-save-rng` on 2 ranks, saved
    by a megatron-2bw that wrote Adam's state per parameter as well as in the buckets."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron_2bw.checkpointing.sharded import load_sharded, read_common
    from megatron_2bw.models import apply_cpu_shims, build_stage
    from megatron_2bw.models.compat import cpu_dist_checkpointing
    from megatron_2bw.models.config import ModelConfig
    from megatron_2bw.optim.updater import MegatronUpdater, OptimizerConfig, ParamInfo
    ps.initialize_model_parallel(1, 1)
    apply_cpu_shims("cpu")
    root = os.path.join(FIXTURES_OURS, "dp_reshardable_per_parameter")
    common = read_common(root, 2)
    args = common["args"]  # ADAM_MODEL's flags, saved with --bf16
    stage = build_stage(ModelConfig(**ADAM_MODEL, params_dtype=torch.bfloat16), 0, 1)
    named = [(n, p) for n, p in stage.named_parameters() if p.requires_grad]
    updater = MegatronUpdater([p for _, p in named], [
        ParamInfo(n, p.dim() > 1, True, False) for n, p in named], OptimizerConfig(lr=1e-2))
    state = load_sharded(root, 2, common, _Weights(stage, 2), updater)["optimizer"]
    specs = mlo.param_specs(stage, [p for _, p in named])
    fmt = mlo.saved_format(common)
    read = mlo.bucket_template(mlo.retyped(specs, fmt), fmt, args)
    with cpu_dist_checkpointing():
        buckets = read.found(dist_checkpointing.load(
            read.template, os.path.join(root, "iter_0000002")))
    mine = {"exp_avg": state["adam"]["exp_avg"], "exp_avg_sq": state["adam"]["exp_avg_sq"],
            "fp32_param": state["masters"]}
    return {"equal": {k: sum(torch.equal(t, buckets[k][i]) for i, t in enumerate(ts))
                      for k, ts in mine.items()},
            "params": len(named), "step": state["adam"]["step"],
            "keys": sorted(common["pipedream_2bw"])}


@pytest.mark.slow
def test_a_save_that_wrote_the_state_twice_still_resumes() -> None:
    """A dp_reshardable checkpoint from before the state was written once (per parameter
    too, no bucket index) resumes from its per-parameter tensors, which equal its
    buckets, with Adam's step."""
    (r,) = run_distributed(_resume_both_copies, 1)
    assert "optimizer_buckets" not in r["keys"]
    assert r["equal"] == {k: r["params"] for k in r["equal"]} and r["step"] == 2, r
