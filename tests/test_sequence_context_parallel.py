"""Sequence and context parallelism through pretrain_gpt.py: the same training as one rank.

Flush and GPipe with --sequence-parallel (TP 2) or --context-parallel-size 2 take the
non-parallel run's steps (fp32: every iteration's loss to 1e-5, the gradient norm to
2e-5: the norm sums every gradient element in another order per layout, and five steps
at lr 1e-2 grow that difference to 1.1e-5 at TP 2 with or without SP); 2BW equals the
single-process delayed oracle (tests/test_2bw_oracle.py); a checkpoint written at
TP 2 + SP x CP 2 resumes at one rank. The model-level proofs (SP's gradients and the
missing TP sum) are in tests/test_models.py, the attention's in
tests/test_context_parallel.py.
"""
from __future__ import annotations

import pytest

from tests.dist_harness import run_distributed
from tests.entry_harness import TINY, launch, losses, max_rel
from tests.test_2bw_oracle import _oracle

pytestmark = pytest.mark.slow

ITERS = ["--train-iters", "5", "--global-batch-size", "8"]
# Llama's attention: rotary positions (sliced per CP rank) and 2 key/value groups
LLAMA = ["--position-embedding-type", "rope", "--group-query-attention",
         "--num-query-groups", "2", "--normalization", "RMSNorm", "--swiglu"]
SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
CP = ["--context-parallel-size", "2"]


def _norms(records: list[dict]) -> list[float]:
    return [r["grad_norm"] for r in records]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, list[dict]]:
    """The one-rank runs: the default GPT and the Llama-like one."""
    out = tmp_path_factory.mktemp("ref")
    return {"gpt": launch("gpt", 1, ITERS, str(out / "gpt.jsonl")),
            "llama": launch("gpt", 1, ITERS + LLAMA, str(out / "llama.jsonl"))}


@pytest.mark.parametrize("model,nproc,flags", [
    ("gpt", 4, SP + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "flush"]),
    ("gpt", 4, SP + ["--use-distributed-optimizer"]),  # DP 2 shards the optimizer state
    ("llama", 2, CP),  # the ring (p2p, the default)
    pytest.param("llama", 2, CP + ["--cp-comm-type", "all_gather"], marks=pytest.mark.matrix),
    pytest.param("gpt", 4, CP + ["--pipeline-model-parallel-size", "2", "--gpipe"],
                 marks=pytest.mark.matrix),
    pytest.param("llama", 4, SP + CP, marks=pytest.mark.matrix),
], ids=["tp2-sp-pp2-flush", "tp2-sp-dp2-distopt", "cp2-llama", "cp2-all-gather",
        "cp2-pp2-gpipe", "tp2-sp-cp2"])
def test_equals_one_rank(tmp_path, references, model, nproc, flags) -> None:
    ref = references[model]
    got = launch("gpt", nproc, ITERS + (LLAMA if model == "llama" else []) + flags,
                 str(tmp_path / "m.jsonl"))
    loss_err, norm_err = max_rel(losses(got), losses(ref)), max_rel(_norms(got), _norms(ref))
    print(f"{' '.join(flags)}: loss {loss_err:.2e}, grad norm {norm_err:.2e}")
    assert loss_err < 1e-5 and norm_err < 2e-5


@pytest.mark.parametrize("nproc,flags", [
    (4, SP + ["--pipeline-model-parallel-size", "2"]),
    (4, CP + ["--pipeline-model-parallel-size", "2"]),
], ids=["tp2-sp-pp2", "cp2-pp2"])
def test_2bw_equals_delayed_oracle(tmp_path, nproc, flags) -> None:
    """2BW with SP or CP against the single-process delayed update (Llama-like model)."""
    oracle = run_distributed(_oracle, 1, TINY + ITERS + LLAMA)[0]
    got = losses(launch("gpt", nproc, ITERS + LLAMA + flags + ["--pipeline-schedule", "2bw"],
                        str(tmp_path / "m.jsonl")))
    err = max_rel(got, oracle)
    print(f"2bw {' '.join(flags)}: max relative loss error vs oracle {err:.2e}")
    assert err < 1e-5


@pytest.mark.parametrize("fmt,nproc,resume", [
    ("torch_dist", 1, []),
    # Megatron-LM's file per (TP, PP) rank: another CP, the same TP
    pytest.param("torch", 2, SP, marks=pytest.mark.matrix),
], ids=["torch_dist-one-rank", "torch-cp1"])
def test_checkpoint_of_sp_and_cp_resumes_elsewhere(tmp_path, references, fmt, nproc,
                                                   resume) -> None:
    """Saved at TP 2 + SP x CP 2 (iteration 3: the context-parallel ranks hold one copy
    of the weights, written once), resumed without CP (torch_dist: on one rank):
    iterations 4-5 are the uninterrupted run's."""
    saved = str(tmp_path / "ckpt")
    launch("gpt", 4, ITERS + LLAMA + SP + CP + ["--save", saved, "--exit-interval", "3",
                                                "--ckpt-format", fmt],
           str(tmp_path / "a.jsonl"))
    resumed = launch("gpt", nproc, ITERS + LLAMA + resume + ["--load", saved],
                     str(tmp_path / "b.jsonl"))
    assert [r["iteration"] for r in resumed] == [4, 5]
    assert max_rel(losses(resumed), losses(references["llama"])[3:]) < 1e-5
