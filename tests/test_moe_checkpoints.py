"""Checkpoints of a mixture of experts under expert parallelism hold every expert once.

Expert-parallel ranks are data-parallel replicas of the dense part that hold different
experts. A `--ckpt-format torch` checkpoint has one file per (tensor, pipeline, expert)
rank, named and written as Megatron-LM does (`mp_rank_TT[_PPP][_EEE]`, by expert-data-
parallel rank 0 of each), each with that rank's local experts under megatron-core's local
module names; it loads at its own layout. A torch_dist one names each expert by its
global index, so it reshards to another expert-parallel (and pipeline) size. One case
per claim:

- torch format, same layout: EP 2 saved at iteration 3 continues bit-exactly;
- torch format files: one per expert-parallel rank, every expert exactly once;
- torch format at another expert-parallel size: refused at start-up, naming the flag;
- torch format where one file's ranks hold different expert-TP slices: refused;
- torch_dist: EP 2 x PP 2 -> EP 1 on one rank, and EP 1 -> EP 2, equal the
  uninterrupted run to 1e-5 (fp32; that EP 2 = EP 1 to 1e-5 is test_moe_training's);
- the saved args and --use-checkpoint-args carry Megatron-LM's MoE keys, the converter
  sets the expert-parallel sizes, and the resume checks compare them (one process).
"""
from __future__ import annotations

import argparse
import glob
import os
import re

import pytest
import torch

from tests.entry_harness import TINY, launch, losses, max_rel

ITERS = ["--train-iters", "5", "--global-batch-size", "8"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
       "--moe-router-load-balancing-type", "aux_loss"]
EP2 = ["--expert-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
STOP = ["--exit-interval", "3"]  # the save run stops after its iteration-3 checkpoint
_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[list[dict], str]:
    """The uninterrupted EP 2 run (2 ranks), saving --ckpt-format torch at iteration 3
    (and 5): its records, and the checkpoint directory."""
    out = tmp_path_factory.mktemp("ep2")
    saved = str(out / "ckpt")
    records = launch("gpt", 2, ITERS + MOE + EP2 + ["--save", saved, "--save-interval", "3",
                                                    "--ckpt-format", "torch"],
                     str(out / "whole.jsonl"))
    return records, saved


@pytest.mark.slow
def test_torch_checkpoint_resumes_bit_exactly_at_its_layout(tmp_path, uninterrupted) -> None:
    whole, saved = uninterrupted
    resumed = launch("gpt", 2, ITERS + MOE + EP2 + ["--load", saved, "--ckpt-step", "3"],
                     str(tmp_path / "b.jsonl"))
    assert [r["iteration"] for r in resumed] == [4, 5]
    assert losses(resumed) == losses(whole)[3:]


@pytest.mark.slow
def test_torch_files_hold_every_expert_once(uninterrupted) -> None:
    """Megatron-LM's names (TP rank 00, no pipeline suffix, EP rank 000 / 001); each file
    holds the dense part (equal in both: replicas) and its EP rank's experts under their
    local index j (global index 2 x EP rank + j); together every (layer, expert) once,
    and the two files' experts of one local index are different experts."""
    base = os.path.join(uninterrupted[1], "iter_0000003")
    files = sorted(glob.glob(os.path.join(base, "mp_rank_*", "model_optim_rng.pt")))
    assert [os.path.relpath(f, base) for f in files] == [
        "mp_rank_00_000/model_optim_rng.pt", "mp_rank_00_001/model_optim_rng.pt"]
    states = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    seen: dict[tuple[int, int], int] = {}
    for ep_rank, state in enumerate(states):
        assert state["args"].expert_model_parallel_size == 2
        local = {(int(m.group(1)), int(m.group(2)))
                 for m in map(_EXPERT.match, state["model"]) if m}
        assert {j for _, j in local} == {0, 1}  # megatron-core's local module indices
        for layer, j in local:
            seen[(layer, 2 * ep_rank + j)] = seen.get((layer, 2 * ep_rank + j), 0) + 1
    assert seen == {(layer, e): 1 for layer in range(4) for e in range(4)}
    first, second = (s["model"] for s in states)
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        if torch.is_tensor(tensor) and not name.endswith("_extra_state"):
            assert torch.equal(tensor, second[name]) != bool(_EXPERT.match(name)), name


@pytest.mark.slow
def test_torch_checkpoint_at_another_expert_parallel_size_is_refused(tmp_path,
                                                                      uninterrupted) -> None:
    """Its files hold other ranks' experts under local names: a one-line refusal at
    start-up names the flag and the way to reshard (torch_dist), instead of a resume
    that loads EP rank 0's experts everywhere."""
    with pytest.raises(AssertionError) as err:
        launch("gpt", 1, ITERS + MOE + ["--load", uninterrupted[1], "--ckpt-step", "3"],
               str(tmp_path / "b.jsonl"))
    assert ("error: the checkpoint was saved with --expert-model-parallel-size 2, this run "
            "has 1") in str(err.value)
    assert "convert it to torch_dist" in str(err.value)


def _resharded(tmp_path, save: tuple[int, list[str]], resume: tuple[int, list[str]]
               ) -> list[dict]:
    """Iterations 4-5 resumed at `resume` (processes, flags) from the torch_dist
    checkpoint of iteration 3 that a run at `save` wrote."""
    saved = str(tmp_path / "ckpt")
    launch("gpt", save[0], ITERS + MOE + save[1] + STOP + ["--save", saved,
                                                           "--ckpt-format", "torch_dist"],
           str(tmp_path / "a.jsonl"))
    resumed = launch("gpt", resume[0], ITERS + MOE + resume[1] + ["--load", saved],
                     str(tmp_path / "b.jsonl"))
    assert [r["iteration"] for r in resumed] == [4, 5]
    return resumed


@pytest.mark.slow
def test_torch_dist_reshards_ep2_pp2_to_one_rank(tmp_path, uninterrupted) -> None:
    resumed = _resharded(tmp_path, (4, EP2 + PP2), (1, []))
    err = max_rel(losses(resumed), losses(uninterrupted[0])[3:])
    print(f"torch_dist EP2 x PP2 -> EP1: max relative loss error {err:.2e}")
    assert err < 1e-5


@pytest.mark.slow
def test_torch_dist_reshards_ep1_to_ep2(tmp_path, uninterrupted) -> None:
    resumed = _resharded(tmp_path, (1, []), (2, EP2))
    err = max_rel(losses(resumed), losses(uninterrupted[0])[3:])
    print(f"torch_dist EP1 -> EP2: max relative loss error {err:.2e}")
    assert err < 1e-5


# ---------------------------------------------------------------------------- one process


def _run(flags: list[str], world: int = 2):
    from megatron_2bw.training.arguments import config_from_args, parse_args

    return config_from_args(parse_args("gpt", TINY + ITERS + flags), "gpt", world, 127)


def _saved_args(flags: list[str], world: int = 2) -> argparse.Namespace:
    """The args a checkpoint of a run with `flags` records."""
    from megatron_2bw.checkpointing.contents import megatron_args

    return megatron_args(_run(flags, world))


def test_args_carry_megatrons_moe_keys(tmp_path) -> None:
    """The saved args hold the MoE flags as Megatron-LM's validate_args leaves them (the
    expert width and the expert-TP size resolved); --use-checkpoint-args takes the model's
    MoE flags (not the dispatcher this run sets, nor the layout); the converter sets the
    expert-parallel sizes (default: the checkpoint's)."""
    from megatron_2bw.checkpointing.contents import apply_checkpoint_args
    from megatron_2bw.training.arguments import parse_args
    from megatron_2bw.training.convert import _training_args, build_parser

    args = _saved_args(MOE + EP2 + ["--moe-token-dispatcher-type", "alltoall",
                                    "--moe-layer-freq", "2"])
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size,
            args.moe_layer_freq, args.moe_token_dispatcher_type, args.moe_grouped_gemm,
            args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (
        4, 2, 4 * 32, 2, "alltoall", False, 2, 1)
    dense = _saved_args([], world=1)
    assert dense.num_experts is None and dense.moe_ffn_hidden_size is None

    root = tmp_path / "ckpt"
    os.makedirs(root / "iter_0000003" / "mp_rank_00_000")
    torch.save({"args": args}, root / "iter_0000003" / "mp_rank_00_000" / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    mine = parse_args("gpt", TINY + ["--load", str(root), "--use-checkpoint-args"])
    changed = apply_checkpoint_args(mine)
    assert (mine.num_experts, mine.moe_router_topk, mine.moe_ffn_hidden_size,
            mine.moe_layer_freq) == (4, 2, 128, 2)
    assert "--num-experts 4" in changed
    assert mine.moe_token_dispatcher_type == "allgather"  # Megatron-LM: not forced
    assert mine.expert_model_parallel_size == 1  # the layout stays this run's

    def converted(*layout: str) -> argparse.Namespace:
        conv = build_parser().parse_args(["--load", str(root), "--save", str(tmp_path / "x"),
                                          "--ckpt-format", "torch_dist", *layout])
        return _training_args(conv, vars(args))
    assert converted().expert_model_parallel_size == 2
    one = converted("--expert-model-parallel-size", "1", "--tensor-model-parallel-size", "2")
    assert (one.expert_model_parallel_size, one.expert_tensor_parallel_size) == (1, None)


def test_resume_compares_the_expert_layout() -> None:
    """The same flags pass (the saved args resolved, this run's not: SwiGLU's expert width,
    the expert-TP size); another expert-parallel size is refused for the torch format
    (its files hold other experts), resharded by torch_dist; another expert count is
    refused by both."""
    from megatron_2bw.checkpointing.contents import megatron_args
    from megatron_2bw.checkpointing.files import CheckpointError
    from megatron_2bw.checkpointing.resume import check_shapes

    run = _run(MOE + EP2 + ["--swiglu", "--disable-bias-linear"])
    saved = vars(megatron_args(run))
    assert saved["moe_ffn_hidden_size"] == run.model.ffn_size != 4 * 32
    check_shapes(saved, run.flags, "ckpt")
    here = dict(run.flags, expert_model_parallel_size=1)
    with pytest.raises(CheckpointError, match="saved with --expert-model-parallel-size 2, "
                                              "this run has 1 .*convert it to torch_dist"):
        check_shapes(saved, here, "ckpt")
    check_shapes(saved, here, "ckpt", reshardable=True)
    with pytest.raises(CheckpointError, match="saved with --num-experts 4, this run has 8"):
        check_shapes(saved, dict(here, num_experts=8), "ckpt", reshardable=True)


def test_torch_format_refuses_an_expert_split_its_file_names_cannot_hold(tmp_path) -> None:
    """At expert-TP 2 over TP 1 the two ranks of file `mp_rank_00` hold different halves
    of their experts: --ckpt-format torch is refused before the first iteration (it would
    keep one half); torch_dist, which names every slice, is not."""
    from megatron_2bw.checkpointing.files import CheckpointError
    from megatron_2bw.checkpointing.resume import prepare_resume

    split = MOE + ["--expert-tensor-parallel-size", "2", "--disable-bias-linear"]
    with pytest.raises(CheckpointError, match="--expert-tensor-parallel-size 2 with "
                                              "--tensor-model-parallel-size 1"):
        prepare_resume(None, _run(split + ["--save", str(tmp_path / "a"),
                                           "--ckpt-format", "torch"]))
    assert prepare_resume(None, _run(split + ["--save", str(tmp_path / "b")])) == 0


SHARED = ["--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate",
          "--disable-bias-linear"]


@pytest.mark.matrix
def test_torch_dist_shared_experts_under_megatron_core_keys_reshard_to_tp2(tmp_path) -> None:
    """Shared experts are saved under megatron-core's keys (SharedExpertMLP's linear_fc1 /
    linear_fc2 / gate_weight) and a one-rank torch_dist checkpoint resumes at TP 2 as
    the uninterrupted run continues (they are TP-split like the dense MLP)."""
    from torch.distributed.checkpoint import FileSystemReader

    whole = launch("gpt", 1, ITERS + MOE + SHARED, str(tmp_path / "w.jsonl"))
    saved = str(tmp_path / "ckpt")
    launch("gpt", 1, ITERS + MOE + SHARED + STOP + ["--save", saved, "--ckpt-format",
                                                    "torch_dist"], str(tmp_path / "a.jsonl"))
    keys = FileSystemReader(glob.glob(f"{saved}/iter_0000003")[0]).read_metadata()
    prefix = "decoder.layers.mlp.shared_experts."  # megatron-core stacks the layers
    assert {prefix + k for k in ("linear_fc1.weight", "linear_fc2.weight", "gate_weight")
            } <= set(keys.state_dict_metadata)
    resumed = launch("gpt", 2, ITERS + MOE + SHARED + ["--load", saved,
                                                       "--tensor-model-parallel-size", "2",
                                                       "--sequence-parallel"],
                     str(tmp_path / "b.jsonl"))
    assert [r["iteration"] for r in resumed] == [4, 5]
    err = max_rel(losses(resumed), losses(whole)[3:])
    print(f"torch_dist shared experts TP1 -> TP2: max relative loss error {err:.2e}")
    assert err < 1e-5
