"""megatron_2bw.models: pipeline stages of megatron-core GPT/BERT match the unsplit model.

The multi-process tests share one spawn of two gloo processes (tests/_models_worker.py)
that runs every scenario and saves losses, initial weights and gradients by global
parameter name; the tests below compare those against the PP=1, TP=1 reference.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import _models_worker  # noqa: E402

from megatron_2bw.models.config import ModelConfig, pad_vocab_size  # noqa: E402

MODELS = ("gpt", "bert")
WORD_EMBEDDING = "embedding.word_embeddings.weight"


def _tiny_config(**overrides) -> ModelConfig:
    fields = dict(model="gpt", num_layers=2, hidden_size=64, num_attention_heads=4)
    fields.update(seq_length=8, vocab_size=128)
    return ModelConfig(**{**fields, **overrides})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """{scenario name: [rank 0 result, rank 1 result]} from one two-process spawn."""
    import torch.multiprocessing as mp

    out_dir = tmp_path_factory.mktemp("models")
    mp.spawn(_models_worker.worker, args=(2, _free_port(), str(out_dir)), nprocs=2, join=True)
    return {
        run.name: [_load(out_dir / f"{run.name}.rank{rank}.pt") for rank in (0, 1)]
        for run in _models_worker.scenarios()
    }


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def merged(parts: list[dict]) -> dict:
    """One view of a split run: the loss, and weights / grads over all stages.

    One tensor-parallel rank per stage is kept (shards are already gathered and data
    parallel replicas are identical); a tied weight present on two stages gets its
    gradients summed, as the embedding-group all-reduce would.
    """
    per_stage = {}
    for part in parts:
        if part["tp_rank"] == 0:
            per_stage.setdefault(part["stage"], part)
    losses = [p["loss"] for p in per_stage.values() if p["loss"] is not None]
    assert len(losses) == 1, "exactly one stage returns the loss"
    grads: dict[str, torch.Tensor] = {}
    weights: dict[str, torch.Tensor] = {}
    for part in per_stage.values():
        for name, grad in part["grads"].items():
            grads[name] = grads[name] + grad if name in grads else grad
        weights.update(part["weights"])
    last = per_stage[max(per_stage)]
    return dict(loss=losses[0], metrics=last["metrics"], grads=grads, weights=weights)


def assert_grads_close(actual: dict, expected: dict, rtol: float = 1e-5) -> None:
    """Same names, and every gradient close relative to its own scale."""
    assert set(actual) == set(expected)
    for name, ref in expected.items():
        assert ref.abs().max() > 0, f"{name}: reference gradient is all zeros"
        atol = rtol * ref.abs().max().item()
        torch.testing.assert_close(
            actual[name], ref, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
        )


def assert_same_model_and_step(ref: dict, split: dict) -> None:
    """Same initial weights bit for bit, same loss, same gradients, by global name."""
    for name, weight in ref["weights"].items():
        assert torch.equal(split["weights"][name], weight), name
    torch.testing.assert_close(split["loss"], ref["loss"], rtol=1e-5, atol=0)
    assert_grads_close(split["grads"], ref["grads"])


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_pipeline_split_matches_unsplit(runs, model):
    assert_same_model_and_step(merged(runs[f"{model}_ref"]), merged(runs[f"{model}_pp2"]))


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_tensor_parallel_matches_tp1(runs, model):
    assert_same_model_and_step(merged(runs[f"{model}_ref"]), merged(runs[f"{model}_tp2"]))


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_full_recompute_matches_no_recompute_with_dropout(runs, model):
    plain, recomputed = merged(runs[f"{model}_dropout"]), merged(runs[f"{model}_dropout_recompute"])
    assert runs[f"{model}_dropout_recompute"][0]["checkpoints"] == 4, "one checkpoint per layer"
    assert runs[f"{model}_dropout"][0]["checkpoints"] == 0
    # Dropout is really on, so equal results need the recomputation to replay its RNG.
    assert not torch.equal(plain["loss"], merged(runs[f"{model}_ref"])["loss"])
    torch.testing.assert_close(recomputed["loss"], plain["loss"], rtol=1e-6, atol=0)
    assert_grads_close(recomputed["grads"], plain["grads"], rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_tied_embeddings_start_equal_on_first_and_last_stage(runs, model):
    first, last = sorted(runs[f"{model}_pp2"], key=lambda part: part["stage"])
    assert (first["stage"], last["stage"]) == (0, 1)
    assert first["shared"] is not None and last["shared"] is not None
    assert torch.equal(first["shared"], last["shared"])
    assert torch.equal(first["weights"][WORD_EMBEDDING], last["weights"][WORD_EMBEDDING])
    assert first["embedding_group"] == last["embedding_group"] == [0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_initialization_depends_on_seed(runs, model):
    ref, other = merged(runs[f"{model}_ref"]), merged(runs[f"{model}_seed2"])
    assert not torch.equal(ref["weights"][WORD_EMBEDDING], other["weights"][WORD_EMBEDDING])
    assert ref["loss"] != other["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_bf16_pipeline_stays_close_to_fp32(runs, model):
    ref, bf16 = merged(runs[f"{model}_ref"]), merged(runs[f"{model}_bf16_pp2"])
    assert bf16["weights"][WORD_EMBEDDING].dtype == torch.bfloat16
    torch.testing.assert_close(bf16["loss"], ref["loss"], rtol=2e-2, atol=0)


@pytest.mark.slow
def test_metrics_recorded_on_last_stage(runs):
    assert set(merged(runs["gpt_pp2"])["metrics"]) == {"lm_loss"}
    bert = merged(runs["bert_pp2"])
    assert set(bert["metrics"]) == {"lm_loss", "sop_loss"}
    total = bert["metrics"]["lm_loss"] + bert["metrics"]["sop_loss"]
    torch.testing.assert_close(total, bert["loss"])


@pytest.mark.slow
def test_stage_index_must_match_parallel_state(runs):
    error = runs["gpt_pp2"][0]["mismatch_error"]
    assert "pipeline rank" in error and "num_stages=2" in error


def test_uneven_layer_split_is_rejected():
    from megatron_2bw.models import build_stage

    config = _tiny_config(model="gpt", num_layers=3)
    with pytest.raises(ValueError, match="num_layers=3 is not divisible by num_stages=2"):
        build_stage(config, 0, 2)


@pytest.mark.parametrize(
    "orig, divisible_by, tp, expected",
    [
        (50257, 128, 1, 50304),
        (50257, 128, 2, 50432),
        (1024, 128, 1, 1024),
        (1000, 128, 4, 1024),
        (30522, 128, 8, 30720),
    ],
)
def test_pad_vocab_size(orig, divisible_by, tp, expected):
    assert pad_vocab_size(orig, divisible_by, tp) == expected


def test_model_config_validation_names_the_bad_values():
    with pytest.raises(ValueError, match="hidden_size=65 is not divisible by num_attention_heads"):
        _tiny_config(hidden_size=65)
    with pytest.raises(ValueError, match="model='t5'"):
        _tiny_config(model="t5")
    config = _tiny_config(model="bert")
    assert (config.ffn_size, config.max_positions, config.tie_embeddings) == (256, 8, True)


# ------------------------------------------------------------------ architectures (ARCH)

@pytest.mark.slow
@pytest.mark.parametrize("name", ["arch_tp2", "arch_mqa_tp2"])
def test_architecture_tensor_parallel_matches_tp1(runs, name):
    """SwiGLU's strided fc1, grouped (and single) key/value heads, tensor-parallel-shared
    query/key norms and 1p norms: TP=2 starts from the TP=1 weights and takes its step."""
    ref = "arch_mqa_ref" if "mqa" in name else "arch_ref"
    assert_same_model_and_step(merged(runs[ref]), merged(runs[name]))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_tp2_sp", "arch_tp2_sp"])
def test_sequence_parallel_matches_tp1(runs, name):
    """--sequence-parallel at TP=2 (norms and dropouts on s/2 rows, gathers and
    reduce-scatters along the sequence) takes TP=1's step once the runtime sums the
    norms' and row-parallel biases' gradients over TP (SequenceParallelSum)."""
    ref = "gpt_ref" if name.startswith("gpt") else "arch_ref"
    assert_same_model_and_step(merged(runs[ref]), merged(runs[name]))


@pytest.mark.slow
def test_leaving_out_the_sequence_parallel_sum_is_caught(runs):
    """Without the TP sum every norm and row-parallel bias gradient is one rank's part of
    the whole: the comparison with TP=1 fails, on exactly the marked parameters."""
    split = merged(runs["gpt_tp2_sp"])
    marked = runs["gpt_tp2_sp"][0]["sequence_parallel"]
    assert any(n.endswith("layernorm.weight") for n in marked)
    assert any(n.endswith("linear_proj.bias") or n.endswith("linear_fc2.bias")
               for n in marked)
    partial = {**split["grads"], **{n: g for part in runs["gpt_tp2_sp"]
                                    if part["tp_rank"] == 0
                                    for n, g in part["partial_grads"].items()}}
    reference = merged(runs["gpt_ref"])["grads"]
    wrong = []
    for name in marked:
        try:
            assert_grads_close({name: partial[name]}, {name: reference[name]})
        except AssertionError:
            wrong.append(name)
    assert wrong == marked


@pytest.mark.slow
def test_architecture_uneven_pipeline_matches_unsplit(runs):
    first, last = sorted(runs["arch_pp2_uneven"], key=lambda part: part["stage"])
    layers = {stage["stage"]: {n.split(".")[2] for n in stage["weights"] if ".layers." in n}
              for stage in (first, last)}
    assert layers == {0: {"0"}, 1: {"1", "2", "3"}}, "Megatron's rule: first stage 1, rest 3"
    assert_same_model_and_step(merged(runs["arch_ref"]), merged(runs["arch_pp2_uneven"]))


@pytest.mark.slow
def test_architecture_norm_weights_start_at_gamma_one(runs):
    """1p norms store gamma - 1: zeros; untied output layer is its own parameter."""
    weights = merged(runs["arch_ref"])["weights"]
    norms = [n for n in weights if "layernorm" in n]
    assert {n.rsplit(".", 2)[-2] for n in norms} >= {"input_layernorm", "q_layernorm",
                                                       "k_layernorm", "final_layernorm"}
    assert all(torch.count_nonzero(weights[n]) == 0 for n in norms)
    assert "output_layer.weight" in weights and WORD_EMBEDDING in weights


@pytest.mark.slow
def test_selective_recompute_matches_no_recompute_with_dropout(runs):
    """Core attention recomputed in backward replays its dropout mask: same loss, grads."""
    plain, selective = merged(runs["gpt_dropout"]), merged(runs["gpt_dropout_selective"])
    assert runs["gpt_dropout_selective"][0]["checkpoints"] == 4, "one per layer's attention"
    torch.testing.assert_close(selective["loss"], plain["loss"], rtol=1e-6, atol=0)
    assert_grads_close(selective["grads"], plain["grads"], rtol=1e-6)


@pytest.mark.parametrize("overrides, match", [
    (dict(model="bert", position_embedding_type="rope"), "BERT has learned absolute"),
    (dict(model="bert", qk_layernorm=True), "qk_layernorm"),
    (dict(recompute_granularity="full"), "needs recompute_method"),
    (dict(recompute_granularity="selective", recompute_method="uniform"), "only apply to full"),
    (dict(recompute_modules=("core_attn",)), "only apply to selective"),
    (dict(recompute_granularity="selective", recompute_modules=("moe_act",)),
     "moe_act needs moe_grouped_gemm"),
    (dict(num_query_groups=3), "not divisible by num_query_groups=3"),
    (dict(position_embedding_type="rope", rotary_percent=0.2), "positive even number"),
    (dict(swiglu=True, hidden_size=16), "give ffn_hidden_size"),
    (dict(window_size=(7, 1), window_attn_skip_freq=0), "causal attention"),
])
def test_model_config_refuses_what_megatron_core_cannot_build(overrides, match):
    with pytest.raises(ValueError, match=match):
        _tiny_config(**overrides)


def test_uneven_split_follows_megatron_core():
    config = _tiny_config(num_layers=5, num_layers_in_first_pipeline_stage=1)
    assert config.layers_per_stage(2) == (1, 4)
    config = _tiny_config(num_layers=6, num_layers_in_first_pipeline_stage=2,
                          num_layers_in_last_pipeline_stage=2)
    assert config.layers_per_stage(4) == (2, 1, 1, 2)
    assert config.layers_per_stage(3) == (2, 2, 2)
    with pytest.raises(ValueError, match="do not split evenly over 3 middle stages"):
        config.layers_per_stage(5)
    with pytest.raises(ValueError, match="2 layers are left for 0 middle stages"):
        config.layers_per_stage(2)
    with pytest.raises(ValueError, match="more than one pipeline stage"):
        config.layers_per_stage(1)


def test_tp_shard_keeps_megatron_cores_strided_layout():
    """SwiGLU fc1 (stride 2): rank r holds [gate_r; up_r] of the TP=1 [gate; up]."""
    from megatron_2bw.models.init import tp_shard

    full = torch.arange(8.0).view(8, 1)  # gate = 0..3, up = 4..7
    assert tp_shard(full, 0, 2, 0, 2).flatten().tolist() == [0, 1, 4, 5]
    assert tp_shard(full, 0, 2, 1, 2).flatten().tolist() == [2, 3, 6, 7]
    assert tp_shard(full, 0, 1, 1, 2).flatten().tolist() == [4, 5, 6, 7]


# ------------------------------------------------------------------ the shared shape

def test_model_config_is_the_planners_shape_with_its_vocab_padded():
    """One shape: a ModelConfig counts like the planner's ModelShape of the same sizes;
    the vocabulary is the one difference, explicit (the planner pads it per plan)."""
    from megatron_2bw.shape import ModelShape

    shape = ModelShape("gpt", 2, 64, 4, 8, 1000)
    config = _tiny_config(vocab_size=pad_vocab_size(1000, 128, 2))
    assert isinstance(config, ModelShape) and not shape.vocab_is_padded
    assert (shape.padded_vocab(1), shape.padded_vocab(2), shape.padded_vocab(16)) == (
        1024, 1024, 2048)
    assert config.padded_vocab(1) == config.padded_vocab(16) == 1024  # taken as it is
    assert _tiny_config(vocab_size=1000).padded_vocab(2) == 1000  # never padded again
    for method, args in (("layer_params", ()), ("embedding_params", (2,)),
                         ("output_params", (2, 2)), ("layer_forward_flops", (3,)),
                         ("output_forward_flops", (3, 2)), ("layer_activation_bytes", (3, 2))):
        assert getattr(config, method)(*args) == getattr(shape, method)(*args), method
    with pytest.raises(ValueError, match=r"num_layers=0 must be a positive integer \(--num-layers"):
        ModelShape("gpt", 0, 64, 4, 8, 1000)


_BUILT_LAYER = """
import json, sys
from megatron_2bw.models import build_stage
from megatron_2bw.models.compat import apply_cpu_shims
from megatron_2bw.models.config import ModelConfig
from megatron_2bw.planner.profile import _single_process_megatron
apply_cpu_shims()
out = []
with _single_process_megatron():
    for fields in json.loads(sys.argv[1]):
        config = ModelConfig(**fields)
        model = build_stage(config, 0, 1).model
        layer = model.decoder.layers[0]
        out.append([sum(p.numel() for p in layer.parameters()), config.layer_params()])
        if config.mtp_num_layers:  # the MTP block (models/mtp.py), built on this stage
            out.append([sum(p.numel() for p in model.mtp.parameters()), config.mtp_params()])
print(json.dumps(out))
"""


def test_shape_counts_a_built_layers_parameters():
    """`layer_params` (grouped-query attention, kv-channels, SwiGLU, multi-latent
    attention) against the numel of a megatron-core layer built from the same config, and
    `mtp_params` against a built MTP block's (what the planner adds to the last stage), in
    a child process (the CPU shims and the process group stay out of this one)."""
    base = dict(model="gpt", num_layers=1, hidden_size=64, num_attention_heads=4,
                seq_length=8, vocab_size=128)
    mla = dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8,
               qk_pos_emb_head_dim=8, v_head_dim=12, qk_layernorm=True)
    variants = [base, {**base, "num_query_groups": 2, "swiglu": True, "ffn_hidden_size": 96},
                {**base, "kv_channels": 8, "num_query_groups": 1}, {**base, **mla},
                {**base, "num_query_groups": 2, "swiglu": True, "ffn_hidden_size": 96,
                 "position_embedding_type": "rope", "mtp_num_layers": 2}]
    done = subprocess.run([sys.executable, "-c", _BUILT_LAYER, json.dumps(variants)],
                          capture_output=True, text=True, timeout=300, check=True)
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(counts) == len(variants) + 1  # the MTP block's pair too
    for built, counted in counts:
        assert built == counted


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_sdpa_attention_matches_megatron_core_attention(runs, model):
    """The default backend (auto: PyTorch's SDPA) against megatron-core's unfused
    DotProductAttention: the same weights, loss and gradients; BERT through its padding
    mask (a padded tail on one sample), GPT causal."""
    assert runs[f"{model}_ref"][0]["core_attention"] == ["SdpaAttention"]
    assert runs[f"{model}_unfused"][0]["core_attention"] == ["DotProductAttention"]
    assert_same_model_and_step(merged(runs[f"{model}_unfused"]), merged(runs[f"{model}_ref"]))


@pytest.mark.slow
def test_sdpa_attention_matches_unfused_with_gqa_rope_and_qk_norm(runs):
    """Grouped key/value heads shared without copies (SDPA's enable_gqa), rotary
    embeddings applied before the core attention, query/key norms."""
    assert_same_model_and_step(merged(runs["arch_unfused"]), merged(runs["arch_ref"]))


@pytest.mark.slow
def test_flash_backend_pipelined_matches_unsplit(runs):
    """--attention-backend flash (SDPA restricted to its flash kernel) at PP=2 against
    the default at PP=1."""
    assert_same_model_and_step(merged(runs["gpt_ref"]), merged(runs["gpt_flash_pp2"]))


@pytest.mark.slow
def test_gpt_oss_attention_and_mlp_split_exactly(runs):
    """GPT-OSS's learnable attention sinks (split over TP with the heads), a sliding
    window on layers 1 and 3 (--window-attn-skip-freq 2, by global layer number on every
    stage) and quick-GeGLU with offset and clamp: PP=2 and TP=2 start from the PP=1
    weights and take the same step, and every layer's sinks get a gradient."""
    ref = merged(runs["gpt_oss_ref"])
    sinks = [n for n in ref["grads"] if n.endswith("core_attention.softmax_offset")]
    assert len(sinks) == 4 and all(ref["grads"][n].abs().min() > 0 for n in sinks)
    for name in ("gpt_oss_pp2", "gpt_oss_tp2"):
        assert_same_model_and_step(ref, merged(runs[name]))
        windows = {k: v for part in runs[name] for k, v in part["windows"].items()}
        assert windows == {1: (7, 0), 2: None, 3: (7, 0), 4: None}, name
    assert runs["gpt_oss_ref"][0]["core_attention"] == ["SinkAttention"]


@pytest.mark.slow
def test_multi_latent_attention_splits_exactly(runs):
    """Multi-latent attention (query latent, latent norms, YaRN): PP=2, and TP=2 with and
    without sequence parallelism, start from the PP=1 weights and take the same step: at
    TP=2 the rotary key, shared by the heads of both ranks, gets both ranks' gradient
    (models/mla.py); the latent norms are marked for the sequence-parallel sum."""
    ref = merged(runs["mla_ref"])
    assert {n.rsplit(".", 2)[-2] for n in ref["grads"] if "self_attention" in n} == {
        "linear_q_down_proj", "linear_q_up_proj", "q_layernorm", "linear_kv_down_proj",
        "linear_kv_up_proj", "kv_layernorm", "linear_proj"}
    for name in ("mla_pp2", "mla_tp2", "mla_tp2_sp"):
        assert_same_model_and_step(ref, merged(runs[name]))
    marked = runs["mla_tp2_sp"][0]["sequence_parallel"]
    assert {n.rsplit(".", 2)[-2] for n in marked if "self_attention" in n} == {
        "q_layernorm", "kv_layernorm"}


@pytest.mark.slow
def test_tanh_gelu_is_its_own_formula_and_splits_exactly(runs):
    """--bias-gelu-fusion's tanh GELU: PP=2 equals PP=1, and it is not exact GELU (the
    gradients differ, slightly: at initialization the activations are small, where the
    two agree closely)."""
    tanh, exact = merged(runs["gpt_tanh_gelu"]), merged(runs["gpt_ref"])
    assert_same_model_and_step(tanh, merged(runs["gpt_tanh_gelu_pp2"]))
    fc1 = [n for n in exact["grads"] if n.endswith("linear_fc1.weight")]
    assert fc1 and not all(torch.equal(tanh["grads"][n], exact["grads"][n]) for n in fc1)
    assert_grads_close(tanh["grads"], exact["grads"], rtol=1e-3)


def test_gelu_tanh_is_the_fused_kernels_formula():
    """kernels.gelu_tanh (CPU) computes megatron-core's fused bias-GELU formula, forward
    and backward, to fp32 rounding (its constants are rounded to 8 digits)."""
    from megatron.core.fusions.fused_bias_gelu import bias_gelu, bias_gelu_back

    from megatron_2bw.models.kernels import gelu_tanh

    x = torch.linspace(-6, 6, 1001, dtype=torch.float64, requires_grad=True)
    zero = torch.zeros(())
    written_out = x * 0.5 * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))
    torch.testing.assert_close(gelu_tanh(x), written_out, rtol=1e-12, atol=1e-12)
    (grad,) = torch.autograd.grad(gelu_tanh(x).sum(), x)
    y = x.detach().float()
    torch.testing.assert_close(gelu_tanh(y), bias_gelu.__wrapped__(zero, y)
                               if hasattr(bias_gelu, "__wrapped__") else bias_gelu(zero, y),
                               rtol=1e-6, atol=1e-6)
    back = getattr(bias_gelu_back, "__wrapped__", bias_gelu_back)
    torch.testing.assert_close(grad.float(), back(torch.ones_like(y), zero, y),
                               rtol=1e-6, atol=1e-6)
