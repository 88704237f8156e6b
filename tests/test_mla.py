"""Multi-latent attention (--multi-latent-attention, DeepSeek-V3's; models/mla.py).

Fast: the flags become megatron-core's MLATransformerConfig as Megatron-LM's
`core_transformer_config_from_args` makes it (YaRN by default); the HF export refuses
the model in one line. Slow (pretrain_gpt.py on the embedded corpus): an MLA + MoE model
without a query latent trains under flush at PP=2 exactly as at PP=1, and its torch_dist
checkpoint (megatron-core's key names) resumes at PP=2 where the PP=1 run left off. The
query latent, TP=2 (with and without sequence parallelism) and PP=2 at the model level are
tests/test_models.py's; the FLOP count is tests/test_log_line.py's; the refusals of the
flags are tests/test_architectures.py's. Also slow: selective recomputation of every
--recompute-modules choice that runs here keeps the numbers, with --moe-per-layer-logging.
"""
from __future__ import annotations

import pytest

from tests.entry_harness import launch, losses, max_rel

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "5", "--lr", "3e-3", "--lr-decay-style", "constant",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
         "--eval-iters", "1", "--eval-interval", "5", "--split", "90,10,0"]
# DeepSeek-V3's layer, small: no query latent here (test_models.py has one), YaRN with a
# scaling factor, latent norms, RMSNorm, SwiGLU, routed experts, no linear biases
MLA = ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--rotary-scaling-factor", "4",
       "--mscale-all-dim", "1", "--position-embedding-type", "rope", "--qk-layernorm",
       "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--num-experts", "4",
       "--moe-router-topk", "2"]
PP2_FLUSH = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "flush"]


def _config(extra: list[str]):
    from megatron_2bw.training.arguments import config_from_args, parse_args

    args = parse_args("gpt", MODEL + ["--mock-data"] + MLA + extra)
    return config_from_args(args, "gpt", 1, 127).model


def test_flags_make_megatron_cores_mla_config() -> None:
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_2bw.models.stages import transformer_config

    config = transformer_config(_config(["--q-lora-rank", "32"]), 1, 1)
    assert isinstance(config, MLATransformerConfig) and config.multi_latent_attention
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim,
            config.qk_pos_emb_head_dim, config.v_head_dim) == (32, 16, 16, 8, 16)
    assert (config.rope_type, config.rotary_scaling_factor, config.mscale,
            config.mscale_all_dim) == ("yarn", 4.0, 1.0, 1.0), "Megatron-LM: yarn by default"
    # no flags at core_v0.16.1: megatron-core's defaults
    assert (config.original_max_position_embeddings, config.beta_fast,
            config.beta_slow) == (4096, 32, 1)
    assert transformer_config(_config(["--rope-type", "rope"]), 1, 1).rope_type == "rope"


def test_hf_export_refuses_multi_latent_attention() -> None:
    from megatron_2bw.hf.architecture import hf_family
    from megatron_2bw.training.errors import UserError

    with pytest.raises(UserError) as err:
        hf_family(_config([]))
    assert err.value.where == "--multi-latent-attention" and "\n" not in str(err.value)


@pytest.fixture(scope="module")
def pp1(tmp_path_factory, small_corpus) -> tuple[list[dict], str]:
    """The PP=1 run, saving torch_dist at iteration 3 (and 5): its records and folder."""
    out = tmp_path_factory.mktemp("mla")
    saved = str(out / "ckpt")
    records = launch("gpt", 1, small_corpus.gpt_flags() + MLA + [
        "--save", saved, "--save-interval", "3"], str(out / "pp1.jsonl"), base=MODEL)
    return records, saved


@pytest.mark.slow
def test_flush_pp2_equals_pp1(tmp_path, small_corpus, pp1) -> None:
    got = launch("gpt", 2, small_corpus.gpt_flags() + MLA + PP2_FLUSH,
                 str(tmp_path / "pp2.jsonl"), base=MODEL)
    err = max_rel(losses(got), losses(pp1[0]))
    print(f"MLA + MoE, flush PP2 vs PP1: max relative loss error {err:.2e}")
    assert err < 1e-5


@pytest.mark.slow
def test_torch_dist_checkpoint_resumes_at_pp2(tmp_path, small_corpus, pp1) -> None:
    from megatron.core.dist_checkpointing import load_tensors_metadata

    from megatron_2bw.models.compat import cpu_dist_checkpointing

    records, saved = pp1
    with cpu_dist_checkpointing():
        shapes = {k: tuple(v.global_shape) for k, v in
                  load_tensors_metadata(f"{saved}/iter_0000003").items()}
    layers = "decoder.layers.self_attention."
    assert shapes[layers + "linear_kv_down_proj.weight"] == (2, 16 + 8, 64)
    assert shapes[layers + "linear_kv_up_proj.weight"] == (2, 4 * (16 + 16), 16)
    assert shapes[layers + "linear_q_proj.weight"] == (2, 4 * (16 + 8), 64)
    resumed = launch("gpt", 2, small_corpus.gpt_flags() + MLA + PP2_FLUSH + [
        "--load", saved, "--ckpt-step", "3"], str(tmp_path / "resumed.jsonl"), base=MODEL)
    assert [r["iteration"] for r in resumed] == [4, 5]
    err = max_rel(losses(resumed), losses(records)[3:])
    print(f"MLA + MoE, PP1 checkpoint resumed at PP2: max relative loss error {err:.2e}")
    assert err < 1e-5


# every module megatron-core recomputes here, on a model that has each: MLA (its up
# projections), RMSNorm, one dense and one MoE layer with shared and grouped experts
# (moe_act), and dropout
RECOMPUTE_EVERY_MODULE = ["--recompute-granularity", "selective", "--recompute-modules",
                          "core_attn", "layernorm", "mla_up_proj", "mlp", "moe",
                          "shared_experts", "moe_act"]


@pytest.mark.slow
def test_selective_recompute_of_every_module_keeps_the_numbers(tmp_path) -> None:
    """Recomputing every --recompute-modules choice in backward gives the same losses,
    gradient norms and router losses as keeping the activations (dropout replays its
    masks); the per-layer router losses of --moe-per-layer-logging sum to the total."""
    flags = (["--num-layers", "2", "--train-iters", "3", "--global-batch-size", "4",
              "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--moe-layer-freq", "2",
              "--moe-shared-expert-intermediate-size", "32", "--moe-aux-loss-coeff", "1e-2",
              "--moe-grouped-gemm"] + MLA)
    plain = launch("gpt", 1, flags, str(tmp_path / "plain.jsonl"))
    tb = str(tmp_path / "tb")
    recomputed = launch("gpt", 1, flags + RECOMPUTE_EVERY_MODULE + ["--moe-per-layer-logging",
                                                                    "--tensorboard-dir", tb],
                        str(tmp_path / "recomputed.jsonl"))
    for name in ("loss", "grad_norm", "load_balancing_loss"):
        assert max_rel([r[name] for r in recomputed], [r[name] for r in plain]) < 1e-6, name
    for r in recomputed:  # layer 0 is the one MoE layer (--moe-layer-freq 2), layer 1 dense
        assert r["moe/load_balancing_loss_layer_0"] == pytest.approx(r["load_balancing_loss"])
        assert r["moe/load_balancing_loss_layer_1"] == 0.0
        assert r["load_balancing_loss"] > 0 and "moe/load_balancing_loss_layer_0" not in plain[0]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb)
    events.Reload()
    written = [e.value for e in events.Scalars("moe/load_balancing_loss_layer_0")]
    assert written == pytest.approx([r["load_balancing_loss"] for r in recomputed], rel=1e-6)
