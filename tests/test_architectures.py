"""Megatron-LM's architecture and recomputation flags (issue 12).

Fast: the flags reach megatron-core's TransformerConfig as Megatron-LM's
`core_transformer_config_from_args` would put them (defaults included), and every
combination Megatron-LM or megatron-core would refuse, or would silently ignore, is one
line naming the flag. Slow (through pretrain_gpt.py): a Llama-like model (rotary
positions, RMSNorm, SwiGLU, 2 query groups of 4 heads, no linear biases, untied output,
head width apart from hidden / heads) plus query/key norms trains at TP=2 x PP=2 exactly
as at PP=1 (flush, with selective recomputation) and as the independent delayed-update
oracle (2bw); an uneven split with block recomputation equals PP=1 too.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from megatron_2bw.models.stages import transformer_config
from megatron_2bw.training.arguments import config_from_args, parse_args
from megatron_2bw.training.errors import UserError
from megatron_2bw.training.model_flags import model_config
from tests.entry_harness import ROOT, TINY, launch, losses, max_rel

VOCAB = 127
BASE = ["--num-layers", "4", "--hidden-size", "96", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "5", "--lr", "1e-2",
        "--mock-data"]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--kv-channels", "16"]
ITERS = ["--train-iters", "5", "--global-batch-size", "8"]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


from megatron_2bw.models.kernels import gelu_tanh  # noqa: E402


def _model(extra: list[str], model: str = "gpt", world: int = 1, base=BASE):
    args = parse_args(model, base + extra)
    return config_from_args(args, model, world, VOCAB).model


def _arch_model(extra: list[str], model: str = "gpt"):
    """The architecture rules and ModelConfig alone (the other flag rules are tested in
    tests/test_reliability_inputs.py)."""
    return model_config(parse_args(model, BASE + extra), model, torch.float32, VOCAB)


def _mcore(extra: list[str], tp: int = 1, pp: int = 1):
    return transformer_config(_model(extra, world=tp * pp), tp, pp)


# ------------------------------------------------------------------ flags -> TransformerConfig

def test_defaults_are_megatron_lms() -> None:
    model, config = _model([]), _mcore([])
    assert (config.normalization, config.layernorm_epsilon) == ("LayerNorm", 1e-5)
    assert config.add_bias_linear and not config.gated_linear_unit
    # --bias-gelu-fusion, on by default: the tanh GELU (on CUDA megatron-core's fused
    # kernel, F.gelu named with bias_activation_fusion; on CPU this function)
    assert config.activation_func is gelu_tanh and not config.bias_activation_fusion
    assert config.ffn_hidden_size == 4 * 96
    fused = transformer_config(model, 1, 1, fused=True)
    assert fused.activation_func is F.gelu and fused.bias_activation_fusion
    assert fused.bias_dropout_fusion and not config.bias_dropout_fusion
    assert _mcore(["--no-bias-gelu-fusion"]).activation_func is F.gelu
    assert (config.num_query_groups, config.kv_channels) == (4, 24)
    assert not (config.qk_layernorm or config.layernorm_zero_centered_gamma)
    assert config.recompute_granularity is None and config.recompute_method is None
    assert config.num_layers_in_first_pipeline_stage is None
    assert (model.position_embedding_type, model.rotary_base, model.rotary_percent) == (
        "learned_absolute", 10000, 1.0)


def test_llama_flags_map_like_megatron_lm() -> None:
    model = _model(LLAMA + ["--norm-epsilon", "1e-6", "--rotary-base", "500000",
                            "--qk-layernorm", "--apply-layernorm-1p"])
    config = transformer_config(model, 1, 1)
    assert (config.normalization, config.layernorm_epsilon) == ("RMSNorm", 1e-6)
    assert config.gated_linear_unit and config.activation_func is F.silu
    assert config.ffn_hidden_size == 256, "Megatron: int(4h x 2/3 / 64) x 64 with --swiglu"
    assert (config.num_query_groups, config.kv_channels) == (2, 16)
    assert not config.add_bias_linear and config.qk_layernorm
    assert config.layernorm_zero_centered_gamma
    assert (model.position_embedding_type, model.rotary_base) == ("rope", 500000)
    assert model.untie_embeddings_and_output_weights
    assert _model(["--use-rotary-position-embeddings"]).position_embedding_type == "rope"
    assert _model(["--group-query-attention"]).query_groups == 1, "Megatron's default: 1"


def test_uneven_stages_follow_megatron_cores_split() -> None:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    flags = ["--num-layers", "5", "--decoder-first-pipeline-num-layers", "1"]
    model = _model(flags + ["--pipeline-model-parallel-size", "2"], world=2)
    config = transformer_config(model, 1, 2)
    built = [get_num_layers_to_build(config, pp_rank=r) for r in range(2)]
    offsets = [get_transformer_layer_offset(config, pp_rank=r) for r in range(2)]
    assert built == list(model.layers_per_stage(2)) == [1, 4] and offsets == [0, 1]
    model = _model(["--num-layers", "7", "--pipeline-model-parallel-size", "4",
                    "--decoder-last-pipeline-num-layers", "1"], world=4)
    config = transformer_config(model, 1, 4)
    built = [get_num_layers_to_build(config, pp_rank=r) for r in range(4)]
    assert built == list(model.layers_per_stage(4)) == [2, 2, 2, 1]


def test_recompute_flags_mean_what_megatron_lm_means() -> None:
    selective = _mcore(["--recompute-activations"])
    assert selective.recompute_granularity == "selective"
    assert selective.recompute_modules == ["core_attn"] and selective.recompute_method is None
    assert _mcore(["--recompute-granularity", "selective", "--recompute-modules", "core_attn",
                   "mlp"]).recompute_modules == ["core_attn", "mlp"]
    paper = _mcore(["--recompute-granularity", "full", "--recompute-method", "uniform",
                    "--recompute-num-layers", "1"])
    assert (paper.recompute_granularity, paper.recompute_method,
            paper.recompute_num_layers) == ("full", "uniform", 1)
    block = _mcore(["--recompute-granularity", "full", "--recompute-method", "block",
                    "--recompute-num-layers", "3"])
    assert (block.recompute_method, block.recompute_num_layers) == ("block", 3)


def test_muon_splits_the_fused_qkv_per_query_group() -> None:
    """Rows per group are [q heads of the group, k, v], each head --kv-channels wide."""
    from megatron_2bw.training.loop import _muon_spec

    run = config_from_args(parse_args("gpt", BASE + LLAMA + ["--optimizer", "muon"]), "gpt",
                           1, VOCAB)
    qkv = torch.nn.Parameter(torch.zeros(2 * (2 * 16 + 16 + 16), 96))
    spec = _muon_spec("decoder.layers.0.self_attention.linear_qkv.weight", qkv, run)
    assert spec.qkv_split == (32, 16, 16)


GPT_OSS = ["--position-embedding-type", "rope", "--rope-type", "rope", "--quick-geglu",
           "--glu-linear-offset", "1.0", "--softmax-type", "learnable", "--window-size", "7,0",
           "--window-attn-skip-freq", "2", "--activation-func-clamp-value", "7.0",
           "--enable-gpt-oss", "--export-force-local-attention"]


def test_gpt_oss_flags_map_like_megatron_lm() -> None:
    """The recipe's flags reach TransformerConfig as megatron-core's fields; quick-GeGLU
    keeps Megatron-LM's 4h default width (its 2/3 rule is --swiglu's); a window pattern
    goes in as the list megatron-core tells from an int."""
    from megatron.core.transformer.utils import is_layer_window_attention

    from megatron_2bw.models.gpt_oss import quick_gelu

    config = _mcore(GPT_OSS)
    assert (config.softmax_type, config.window_size, config.window_attn_skip_freq) == (
        "learnable", (7, 0), 2)
    assert config.gated_linear_unit and config.activation_func is quick_gelu
    assert (config.glu_linear_offset, config.activation_func_clamp_value) == (1.0, 7.0)
    assert config.ffn_hidden_size == 4 * 96 and not config.bias_activation_fusion
    window = GPT_OSS[:GPT_OSS.index("--window-attn-skip-freq")]
    pattern = _mcore(window + ["--window-attn-skip-freq", "[1,1,0,1]"])
    assert pattern.window_attn_skip_freq == [1, 1, 0, 1]
    assert [is_layer_window_attention(pattern.window_size, pattern.window_attn_skip_freq, n)
            for n in (1, 2, 3, 4)] == [True, True, False, True]
    assert _mcore([]).softmax_type == "vanilla" and _mcore([]).window_size is None


def test_the_sliding_window_mask_on_cpu_is_the_band() -> None:
    """compat's CPU stand-in for megatron-core's sliding-window mask: query i keeps keys
    i - left .. i (True = masked out)."""
    from megatron_2bw.models.compat import _cpu_sliding_window_causal_mask

    i, j = torch.arange(6).view(-1, 1), torch.arange(6).view(1, -1)
    assert torch.equal(_cpu_sliding_window_causal_mask(6, 6, (2, 0)), (j > i) | (j < i - 2))


# ------------------------------------------------------------------ refusals

REFUSED = [  # (extra flags, model, flag named, part of the message)
    (["--recompute-granularity", "full"], "gpt", "--recompute-method", "no default"),
    (["--recompute-granularity", "full", "--recompute-method", "block"], "gpt",
     "--recompute-num-layers", "needs"),
    (["--recompute-activations", "--recompute-granularity", "full"], "gpt",
     "--recompute-activations", "selective"),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform"], "gpt",
     "--recompute-method", "only with --recompute-granularity full"),
    (["--recompute-num-layers", "1"], "gpt", "--recompute-num-layers", "only with"),
    (["--recompute-modules", "mlp"], "gpt", "--recompute-modules", "selective"),
    (["--recompute-activations", "--recompute-modules", "moe_act"], "gpt",
     "--moe-grouped-gemm", "moe_act needs"),
    (["--recompute-activations", "--recompute-modules", "mla_up_proj"], "gpt",
     "--multi-latent-attention", "mla_up_proj needs"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "3"], "gpt", "--recompute-num-layers", "whole chunks"),
    (["--position-embedding-type", "rope"], "bert", "--position-embedding-type", "BERT"),
    (["--qk-layernorm"], "bert", "--qk-layernorm", "BERT"),
    (["--apply-layernorm-1p"], "bert", "--apply-layernorm-1p", "BERT"),
    (["--rotary-base", "500000"], "gpt", "--rotary-base", "ignored"),
    (["--rope-scaling-factor", "4"], "gpt", "--rope-scaling-factor", "ignored"),
    (["--position-embedding-type", "rope", "--rotary-percent", "1.5"], "gpt",
     "--rotary-percent", "above 1"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0.3"], "gpt",
     "--rotary-percent", "even"),
    (["--num-query-groups", "2"], "gpt", "--num-query-groups", "--group-query-attention"),
    (["--group-query-attention", "--num-query-groups", "3"], "gpt", "--num-query-groups",
     "do not split"),
    (["--group-query-attention", "--num-query-groups", "3", "--num-attention-heads", "6",
      "--tensor-model-parallel-size", "2"], "gpt", "--tensor-model-parallel-size",
     "neither a multiple nor a divisor"),
    (["--group-query-attention", "--tensor-model-parallel-size", "2", "--optimizer", "muon"],
     "gpt", "--optimizer", "--muon-no-split-qkv"),
    (["--swiglu", "--hidden-size", "16"], "gpt", "--ffn-hidden-size", "is 0"),
    (["--swiglu", "--num-attention-heads", "6", "--tensor-model-parallel-size", "3"], "gpt",
     "--tensor-model-parallel-size", "does not split"),
    (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "4"],
     "gpt", "--decoder-first-pipeline-num-layers", "0 layers are left for 1 middle stages"),
    (["--decoder-last-pipeline-num-layers", "2"], "gpt",
     "--decoder-last-pipeline-num-layers", "needs more than one pipeline stage"),
    (["--position-embedding-type", "rope", "--rope-type", "yarn"], "gpt", "--rope-type",
     "rope only"),
    (["--window-size", "7,2"], "gpt", "--window-size", "causal"),
    (["--window-attn-skip-freq", "2"], "gpt", "--window-attn-skip-freq", "ignored"),
    (["--softmax-type", "learnable", "--attention-backend", "flash"], "gpt",
     "--attention-backend", "neither attention sinks"),
    (["--activation-func-clamp-value", "7"], "gpt", "--activation-func-clamp-value", "ignored"),
    (["--quick-geglu", "--swiglu"], "gpt", "--quick-geglu", "both"),
    (["--q-lora-rank", "16"], "gpt", "--q-lora-rank", "without --multi-latent-attention"),
    (["--multi-latent-attention", "--group-query-attention"], "gpt",
     "--group-query-attention", "mutually exclusive"),
    (["--multi-latent-attention", "--rotary-percent", "0.5"], "gpt", "--rotary-percent",
     "ignored"),
    (["--multi-latent-attention", "--attention-backend", "unfused"], "gpt",
     "--attention-backend", "key width"),
    (["--multi-latent-attention", "--tensor-model-parallel-size", "2", "--kv-lora-rank",
      "15", "--qk-pos-emb-head-dim", "8"], "gpt", "--kv-lora-rank", "not divisible"),
    (["--softmax-type", "learnable"], "bert", "--softmax-type", "GPT's here"),
]


@pytest.mark.parametrize("extra,model,flag,match", REFUSED,
                         ids=[" ".join(case[0]) + f" ({case[1]})" for case in REFUSED])
def test_refusals_are_one_line_naming_the_flag(extra, model, flag, match) -> None:
    with pytest.raises(UserError) as info:
        _arch_model(extra, model)
    err = info.value
    assert isinstance(err, ValueError) and "\n" not in str(err)
    assert flag in err.where and match in str(err), str(err)
    assert err.fix, "says what would work"


@pytest.mark.slow
def test_the_entry_point_prints_the_refusal_as_one_error_line() -> None:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *BASE,
                           "--vocab-size", str(VOCAB), "--recompute-granularity", "full"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("error: ") and "(--recompute-method)" in errors[0]
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------ through pretrain_gpt.py

ARCH = LLAMA + ["--qk-layernorm"]


@pytest.fixture(scope="module")
def arch_reference(tmp_path_factory):
    return losses(launch("gpt", 1, ITERS + ARCH, str(tmp_path_factory.mktemp("ref") / "m.jsonl")))


@pytest.mark.slow
@pytest.mark.parametrize("chunks", [[], ["--num-layers-per-virtual-pipeline-stage", "1"]],
                         ids=["plain", "interleaved"])
def test_arch_flush_tp2_pp2_with_selective_recompute_equals_pp1(tmp_path, arch_reference,
                                                                chunks):
    """Also interleaved (v = 2, one layer per chunk): the chunks of a TP = 2 rank hold
    tensor-parallel halves of their layers."""
    got = losses(launch("gpt", 4, ITERS + ARCH + TP2_PP2 + ["--recompute-activations"] + chunks,
                        str(tmp_path / "m.jsonl")))
    err = max_rel(got, arch_reference)
    print(f"flush TP2 x PP2 {chunks}, selective recompute: max relative loss error {err:.2e}")
    assert err < 1e-5


@pytest.mark.slow
def test_arch_uneven_stages_with_block_recompute_equal_pp1(tmp_path, arch_reference):
    """4 layers over 2 stages as 1 + 3; the first layer of each stage recomputed."""
    flags = ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers",
             "1", "--recompute-granularity", "full", "--recompute-method", "block",
             "--recompute-num-layers", "1"]
    got = losses(launch("gpt", 2, ITERS + ARCH + flags, str(tmp_path / "m.jsonl")))
    err = max_rel(got, arch_reference)
    print(f"uneven 1 + 3, block recompute: max relative loss error {err:.2e}")
    assert err < 1e-5


@pytest.mark.slow
def test_arch_2bw_tp2_pp2_equals_delayed_oracle(tmp_path):
    from tests.dist_harness import run_distributed
    from tests.test_2bw_oracle import _oracle

    oracle = run_distributed(_oracle, 1, TINY + ITERS + ARCH)[0]
    got = losses(launch("gpt", 4, ITERS + ARCH + TP2_PP2 + ["--pipeline-schedule", "2bw"],
                        str(tmp_path / "m.jsonl")))
    err = max_rel(got, oracle)
    print(f"2bw TP2 x PP2: max relative loss error vs oracle {err:.2e}")
    assert err < 1e-5
