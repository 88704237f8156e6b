"""The planner and multi-latent attention: the shape's counts against the trainer's
(a built layer's parameters: tests/test_models.py::test_shape_counts_a_built_layers_parameters,
which reads the same `ModelShape.layer_params`), and an MLA plan's launch the trainer
accepts. Fast: pure arithmetic and the trainer's parser in this process."""
from __future__ import annotations

import shlex
from dataclasses import replace

from megatron_2bw.planner import PRESETS, CostModel, FlopsCompute, ModelShape
from megatron_2bw.planner.cli import main as cli_main
from megatron_2bw.planner.search import context_parallel_sizes, tensor_parallel_sizes

MLA = dict(multi_latent_attention=True, q_lora_rank=48, kv_lora_rank=36, qk_head_dim=16,
           qk_pos_emb_head_dim=8, v_head_dim=24)
FLAGS = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
         "--seq-length", "128", "--vocab-size", "1024", "--multi-latent-attention",
         "--q-lora-rank", "48", "--kv-lora-rank", "36", "--qk-head-dim", "16",
         "--qk-pos-emb-head-dim", "8", "--v-head-dim", "24"]


def test_mla_shape_counts_megatrons_projections_and_flops():
    """The planner's MLA shape: its parameters are the trainer's ModelConfig's (whose
    count tests/test_models.py checks against a built layer); its attention FLOPs are
    Megatron-LM's MLA count (training/flops.py) with the whole score matrix instead of
    its causal half and without the latent norms' r_q + r_kv, forward only."""
    from megatron_2bw.models.config import ModelConfig
    from megatron_2bw.training.flops import mla_flops_per_token
    h, n, s = 256, 8, 128
    shape = ModelShape("gpt", 4, h, n, s, 1024, **MLA)
    cfg = ModelConfig(model="gpt", num_layers=4, hidden_size=h, num_attention_heads=n,
                      seq_length=s, vocab_size=1024, **MLA)
    assert shape.layer_params() == cfg.layer_params()
    attention = (48 * (h + n * 24) + h * (36 + 8) + 36 * n * (16 + 24) + n * 24 * h)
    assert shape.layer_params() - shape.ffn_size * (2 * h + 1) - h - 4 * h == attention + h
    core_half = s * n * (24 + 24)  # causal halves of QK^T and of the product with V
    assert (3 * shape._attention_flops_per_token()
            == mla_flops_per_token(cfg) + 3 * core_half - 3 * 2 * (48 + 36))


def test_planner_plans_mla_and_the_trainer_accepts_the_launch(capsys):
    """MLA plans: TP divides the latents (36 + 8 at TP 8 does not), no context
    parallelism; the launch carries the MLA flags; an MLA flag alone is one line."""
    from megatron_2bw.training import arguments
    argv = FLAGS + ["--global-batch-size", "16", "--num-gpus", "8", "--hardware",
                    "p4d.24xlarge", "--emit", "command", "--mock-data", "--train-iters",
                    "10", "--lr", "1e-4", "--schedules", "flush", "--recompute", "none"]
    shape = ModelShape("gpt", 4, 256, 8, 128, 1024, **MLA)
    hw = PRESETS["p4d.24xlarge"]
    cm = CostModel(shape, FlopsCompute(shape, hw), hw)
    assert tensor_parallel_sizes(cm, 8) == [1, 2, 4]
    assert context_parallel_sizes(replace(shape, seq_length=1 << 16), 8) == [1]
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    words = shlex.split(text)
    words = words[words.index("pretrain_gpt.py") + 1:]
    args = arguments.parse_args("gpt", words)
    run = arguments.config_from_args(args, "gpt", world_size=8, vocab_size=args.vocab_size)
    assert (run.model.multi_latent_attention, run.model.q_lora_rank,
            run.model.kv_lora_rank, run.model.v_head_dim) == (True, 48, 36, 24)
    assert cli_main(FLAGS[:10] + ["--kv-lora-rank", "16", "--global-batch-size", "16",
                                  "--num-gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--kv-lora-rank" in err, err
