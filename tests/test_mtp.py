"""Multi-token prediction (--mtp-num-layers; models/mtp.py): the flags reach megatron-core,
what it does not combine with is refused in one line, and a pipelined run resumed from
a one-stage checkpoint trains as the one-stage run does."""
from __future__ import annotations

import pytest

from megatron_2bw.training.arguments import config_from_args, parse_args
from megatron_2bw.training.errors import UserError
from tests.entry_harness import TINY, complete_records, launch, max_rel

MTP = ["--num-layers", "2", "--position-embedding-type", "rope", "--mtp-num-layers", "1",
       "--untie-embeddings-and-output-weights"]
ITERS = ["--train-iters", "4", "--global-batch-size", "4"]


def _run(extra: list[str], model: str = "gpt", world: int = 1):
    return config_from_args(parse_args(model, TINY + ITERS + extra), model, world, 127)


@pytest.mark.parametrize("extra,model,named", [
    (["--position-embedding-type", "learned_absolute"], "gpt", "--position-embedding-type"),
    (["--apply-layernorm-1p"], "gpt", "--apply-layernorm-1p"),
    (["--context-parallel-size", "2"], "gpt", "--context-parallel-size"),
    ([], "bert", "--mtp-num-layers"),
    (["--mtp-standalone"], "gpt", "--mtp-standalone"),
])
def test_what_mtp_does_not_combine_with_is_one_line(extra, model, named) -> None:
    with pytest.raises(UserError) as info:
        _run((MTP if model == "gpt" else ["--mtp-num-layers", "1"]) + extra, model, world=2)
    assert named in info.value.where and "\n" not in str(info.value)


def test_flags_reach_megatron_core() -> None:
    """Megatron-LM's meanings: 0 layers is none, the factor goes to TransformerConfig."""
    from megatron_2bw.models.stages import transformer_config

    run = _run(MTP + ["--mtp-loss-scaling-factor", "0.3"])
    assert (run.model.mtp_num_layers, run.model.mtp_loss_scaling_factor) == (1, 0.3)
    config = transformer_config(run.model, 1, 1)
    assert (config.mtp_num_layers, config.mtp_loss_scaling_factor) == (1, 0.3)
    assert _run(["--mtp-num-layers", "0"]).model.mtp_num_layers is None


def test_pp2_resumed_from_a_pp1_torch_dist_checkpoint_equals_pp1(tmp_path) -> None:
    """PP 1 (one microbatch of 4) saves at iteration 2; Flush PP 2 (four microbatches of
    1, the MTP layer and an embedding copy on stage 1) resumes there and logs the same
    lm and mtp_1 losses: the MTP weights, the embedding copy and the MTP loss's scale
    over the microbatches all match. The checkpoint holds megatron-core's MTP names."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = str(tmp_path / "ckpt")
    ref = launch("gpt", 1, ITERS + MTP + ["--micro-batch-size", "4", "--save", saved,
                                          "--save-interval", "2", "--ckpt-format",
                                          "torch_dist"], str(tmp_path / "ref.jsonl"))
    keys = FileSystemReader(f"{saved}/iter_0000002").read_metadata().state_dict_metadata
    assert "mtp.layers.0.eh_proj.weight" in keys
    launch("gpt", 2, ITERS + MTP + ["--micro-batch-size", "1", "--pipeline-model-parallel-size",
                                    "2", "--load", saved, "--ckpt-step", "2"],
           str(tmp_path / "pp2.jsonl"))
    got = complete_records(str(tmp_path / "pp2.jsonl"))
    assert [r["iteration"] for r in got] == [3, 4]
    for key in ("loss", "mtp_1 loss"):
        err = max_rel([r[key] for r in got], [r[key] for r in ref[2:]])
        assert err < 1e-5, (key, err)


def _oracle_with_mtp(rank: int, world: int, argv: list[str]) -> list[float]:
    """The delayed 2BW oracle, the MTP loss's gradient scaled over its 4 microbatches as
    the oracle scales the main loss (and the tracker made on the CPU)."""
    import torch
    from megatron.core.transformer.multi_token_prediction import (MTPLossAutoScaler,
                                                                  MTPLossLoggingHelper)

    from tests.test_2bw_oracle import delayed_oracle

    MTPLossAutoScaler.set_loss_scale(torch.tensor(1 / 4))
    MTPLossLoggingHelper.tracker["values"] = torch.zeros(1)
    return delayed_oracle(argv)


@pytest.mark.matrix
def test_2bw_pp2_equals_the_delayed_oracle(tmp_path) -> None:
    """2BW keeps two weight versions in flight; each backward's MTP scale is its own."""
    from tests.dist_harness import run_distributed
    from tests.entry_harness import losses

    flags = ITERS + MTP + ["--micro-batch-size", "1"]
    oracle = run_distributed(_oracle_with_mtp, 1, TINY + flags)[0]
    got = losses(launch("gpt", 2, flags + ["--pipeline-model-parallel-size", "2",
                                           "--pipeline-schedule", "2bw"],
                        str(tmp_path / "m.jsonl")))
    assert max_rel(got, oracle) < 1e-5
