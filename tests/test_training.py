"""Through the entry points: pipelined runs equal PP=1 (flush, gpipe) or the delayed
oracle (2bw); resume is exact; an fp16 overflow is skipped; tied embeddings stay equal."""
from __future__ import annotations

import glob
import os

import pytest
import torch

from tests.devices import needs_cuda
from tests.entry_harness import launch, losses, max_rel

ITERS = ["--train-iters", "5", "--global-batch-size", "8"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gpt_reference_records(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "m.jsonl"
    return launch("gpt", 1, ITERS + ["--log-params-norm"], str(path))


@pytest.fixture(scope="module")
def gpt_reference(gpt_reference_records):
    return losses(gpt_reference_records)


@pytest.mark.parametrize("nproc,flags", [
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "flush",
         "--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "1"]),  # the paper's per-layer recomputation
    # megatron-core's own attention against the reference's default (SDPA)
    (2, ["--pipeline-model-parallel-size", "2", "--gpipe", "--attention-backend", "unfused"]),
    (4, ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "flush",
         "--attention-backend", "flash"]),  # SDPA held to its flash kernel
    (4, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]),
    (4, ["--pipeline-model-parallel-size", "2"]),  # DP = 2
], ids=["pp2-flush-recompute", "pp2-gpipe-unfused", "pp4-flush-flash", "tp2-pp2", "dp2-pp2"])
def test_gpt_pipelined_equals_pp1(tmp_path, gpt_reference_records, nproc, flags) -> None:
    """Flush and GPipe are vanilla training: any TP x PP x DP gives PP=1's losses, and
    so does every attention backend (the reference runs the default, auto: SDPA). The
    logged params norm counts every parameter once at every layout (TP duplicates, the
    tied copy, data-parallel replicas)."""
    records = launch("gpt", nproc, ITERS + flags + ["--log-params-norm"],
                     str(tmp_path / "m.jsonl"))
    err = max_rel(losses(records), losses(gpt_reference_records))
    print(f"{' '.join(flags)}: max relative loss error {err:.2e}")
    assert err < 1e-5
    assert max_rel([r["params_norm"] for r in records],
                   [r["params_norm"] for r in gpt_reference_records]) < 1e-5


@pytest.fixture(scope="module")
def bert_reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert") / "m.jsonl"
    return [(r["loss"], r["lm_loss"], r["sop_loss"]) for r in launch("bert", 1, ITERS, str(path))]


@pytest.mark.parametrize("nproc,flags", [
    # megatron-core's attention with its [b, 1, s, s] padding mask against SDPA's
    (2, ["--pipeline-model-parallel-size", "2", "--gpipe", "--attention-backend", "unfused"]),
    (4, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]),
    (4, ["--pipeline-model-parallel-size", "2"]),  # DP = 2
], ids=["pp2-gpipe-unfused", "tp2-pp2", "dp2-pp2"])  # PP = 4: GPT's test and test_engine.py
def test_bert_pipelined_equals_pp1(tmp_path, bert_reference, nproc, flags) -> None:
    records = launch("bert", nproc, ITERS + flags, str(tmp_path / "m.jsonl"))
    got = [(r["loss"], r["lm_loss"], r["sop_loss"]) for r in records]
    for column in range(3):
        err = max_rel([g[column] for g in got], [b[column] for b in bert_reference])
        assert err < 1e-5, (column, err)
    print(f"BERT {' '.join(flags)}: max relative error {err:.2e}")


def test_checkpoint_of_one_attention_backend_resumes_under_another(tmp_path,
                                                                   gpt_reference) -> None:
    """A checkpoint saved under megatron-core's unfused attention at iteration 3 loads
    under the default (SDPA) with the same keys and weights: iterations 4-5 continue the
    uninterrupted run's losses."""
    saved = str(tmp_path / "ckpt")
    first = launch("gpt", 1, ["--train-iters", "3", "--global-batch-size", "8",
                              "--attention-backend", "unfused", "--save", saved,
                              "--lr-decay-iters", "5"], str(tmp_path / "a.jsonl"))
    resumed = launch("gpt", 1, ITERS + ["--load", saved], str(tmp_path / "b.jsonl"))
    assert [r["iteration"] for r in resumed] == [4, 5]
    assert max_rel(losses(first) + losses(resumed), gpt_reference) < 1e-5


# Resuming is proven exact elsewhere: 2BW at PP2 x DP2 resumed at PP4
# (test_sharded_checkpoint.py, both checkpoint formats), SIGTERM stops
# (test_reliability_stop.py), compensation state (test_delay_compensation.py).


def _tied_pair(path: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    first = torch.load(glob.glob(f"{path}/iter_*/mp_rank_00_000/model_optim_rng.pt")[0],
                       weights_only=False)
    last = torch.load(glob.glob(f"{path}/iter_*/mp_rank_00_001/model_optim_rng.pt")[0],
                      weights_only=False)
    pairs = []
    for v, sd in first["weight_versions"].items():
        emb = next(t for k, t in sd.items() if k.endswith("word_embeddings.weight"))
        out = next(t for k, t in last["weight_versions"][v].items()
                   if k.endswith("output_layer.weight"))
        pairs.append((emb, out))
    return pairs


@pytest.mark.parametrize("schedule,precision", [("flush", []), ("2bw", ["--bf16"])])
def test_tied_embeddings_stay_equal(tmp_path, schedule, precision) -> None:
    ckpt = str(tmp_path / "ckpt")
    # the log's per-rank values (params norm, timers) ride along: the last stage waits for
    # every stage's after its step, which must not stall 2BW's pipeline (exchange.py)
    records = launch("gpt", 2, ITERS + precision + ["--pipeline-model-parallel-size", "2",
                                                    "--pipeline-schedule", schedule, "--save",
                                                    ckpt, "--ckpt-format", "torch",
                                                    "--log-params-norm", "--timing-log-level",
                                                    "2"],
                     str(tmp_path / "m.jsonl"))
    assert all(r["skipped"] == 0 and r["loss"] < 10 for r in records)
    assert all(10 < r["params_norm"] < 30 for r in records)
    pairs = _tied_pair(ckpt)
    assert len(pairs) == (2 if schedule == "2bw" else 1)
    for emb, out in pairs:
        assert torch.equal(emb, out)


@pytest.mark.parametrize("schedule", ["flush", "2bw"])
def test_fp16_overflow_is_skipped_and_scale_backs_off(tmp_path, schedule) -> None:
    """Overflowing steps leave the weights alone (the new version is a copy of the newest),
    halve the loss scale, and training resumes once the scale fits."""
    flags = ["--train-iters", "8", "--global-batch-size", "8", "--pipeline-model-parallel-size",
             "2", "--pipeline-schedule", schedule, "--fp16", "--initial-loss-scale",
             str(2.0 ** 22), "--hysteresis", "1",
             "--lr", "1e-3"]  # on megatron-core's mock data lr 1e-2 grows the gradients into a
    #                           second overflow within 8 steps
    records = launch("gpt", 2, flags, str(tmp_path / "m.jsonl"))
    frozen = launch("gpt", 2, flags + ["--lr", "0"], str(tmp_path / "frozen.jsonl"))
    skipped = [r["skipped"] for r in records]
    scales = [r["loss_scale"] for r in records]
    first_step = skipped.index(0)  # minibatch index of the first applied update
    assert first_step >= 1 and all(skipped[:first_step]) and not any(skipped[first_step:])
    assert scales[:first_step + 1] == [2.0 ** 21 / 2 ** i for i in range(first_step)] + \
        [scales[first_step - 1]]
    # the first update shows in the loss of the next minibatch (flush) or the one after (2bw)
    shows = first_step + (1 if schedule == "flush" else 2)
    assert losses(records)[:shows] == losses(frozen)[:shows]
    assert losses(records)[shows] != losses(frozen)[shows]


def test_compiled_transformer_layers_train_as_eager(tmp_path, gpt_reference) -> None:
    """--compile-transformer-layers at PP=2 under 2BW's two weight versions (which swap
    the parameters' storage under the compiled layers) against the eager flush run:
    compiled with torch.compile's aot_eager backend (the same tracing and autograd graph,
    without generating code, which would take minutes here), iteration 1 equal (2BW's
    first update is the plain one) and the delayed run close to its own eager twin."""
    flags = ITERS + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"]
    eager = losses(launch("gpt", 2, flags, str(tmp_path / "eager.jsonl")))
    compiled = losses(launch("gpt", 2, flags + ["--compile-transformer-layers"],
                             str(tmp_path / "compiled.jsonl"),
                             env={"MEGATRON_2BW_COMPILE_BACKEND": "aot_eager"}))
    assert max_rel(compiled, eager) < 1e-5
    assert max_rel(compiled[:1], gpt_reference[:1]) < 1e-5
    logs = "".join(open(p).read() for p in glob.glob(str(tmp_path / "job-*.rank*.log")))
    assert "compiling 2 transformer layers with torch.compile (backend aot_eager)" in logs


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("flags, on_cuda", [
    # SDPA (auto), fused bias-GELU (tanh), bias-dropout-add, cross entropy
    (["--cross-entropy-loss-fusion"], []),
    # fused bias-SwiGLU; SDPA held to cuDNN / memory-efficient (CPU: auto)
    (["--swiglu"], ["--attention-backend", "fused"]),
], ids=["gelu-ce", "swiglu-fused-attention"])
def test_cuda_fused_kernels_compute_the_cpu_mathematics(tmp_path, flags, on_cuda) -> None:
    """On a GPU megatron-core's fused (compiled) kernels run; on the CPU their unfused
    forms: the same fp32 losses (TF32 is off; SDPA's kernels and the fused kernels
    accumulate in their own order, hence 1e-4)."""
    run = ITERS + ["--pipeline-schedule", "2bw"] + flags
    cpu = losses(launch("gpt", 1, run, str(tmp_path / "cpu.jsonl")))
    cuda = losses(launch("gpt", 1, run + on_cuda, str(tmp_path / "cuda.jsonl"),
                         device="cuda"))
    assert max_rel(cuda, cpu) < 1e-4
