"""Hugging Face export and import of a Mixtral-shaped mixture of experts (MixtralForCausalLM).

A tiny Mixtral-shaped GPT (2 layers, hidden 32, 4 experts of width 24 routed top-2, SwiGLU,
RMSNorm, rope, 4 query heads in 2 groups, no biases, untied output) gets random weights
(every tensor perturbed, norms and router included, the router's wide enough that no
token sits near a routing tie) and is saved twice, as SequentialMLP experts and as
--moe-grouped-gemm's GroupedMLP `weight1` / `weight2`. Then, in one spawned process:

- transformers' MixtralForCausalLM on the export gives megatron-core's fp32 logits to
  1e-5 on three sequences;
- the grouped-GEMM checkpoint computes the sequential one's logits and exports the very
  same tensors (its experts unpacked per expert);
- import -> the checkpoint holds the original weights bit for bit, under the original
  layout and with --num-experts / --moe-router-topk / --moe-ffn-hidden-size derived, and
  computes the HF model's logits; exporting it again gives the first export's tensors;
  the grouped run's export (and any, with --moe-grouped-gemm) imports as GroupedMLP's.

The fast tests: megatron-core's TopKRouter weights equal Mixtral's router's (top-k of
the logits then a softmax over k = a softmax over all, top-k, renormalised), and what
Mixtral does not compute is refused in one line naming the flag.
"""
from __future__ import annotations

import os

import pytest

from tests.entry_harness import TINY

transformers = pytest.importorskip("transformers")

MIXTRAL = ["--num-layers", "2", "--position-embedding-type", "rope", "--normalization",
           "RMSNorm", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
           "--disable-bias-linear", "--untie-embeddings-and-output-weights",
           "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24",
           "--moe-aux-loss-coeff", "1e-2", "--train-iters", "1"]
GROUPED = ["--moe-grouped-gemm"]
LOGITS_TOL = 1e-5


# ----------------------------------------------------------------- in the worker process


def _random_weights() -> dict:
    """A Mixtral-shaped model's tensors (SequentialMLP layout), every one random."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_2bw.training.reference import single_process_model

    built = single_process_model("gpt", TINY + MIXTRAL)
    state = {k: v.detach().clone() for k, v in built.model.model.state_dict().items()
             if torch.is_tensor(v)}
    ps.destroy_model_parallel()
    gen = torch.Generator().manual_seed(1)
    for key, t in state.items():
        scale = 0.5 if key.endswith("router.weight") else 0.1
        state[key] = t + scale * torch.randn(t.shape, generator=gen)
    return state


def _grouped(state: dict, experts: int, hidden: int) -> dict:
    """The same weights in GroupedMLP's layout: weight1.view(N, hidden, -1)[e] is expert
    e's fc1 transposed, weight2.view(N, -1, hidden)[e] its fc2 transposed (models/moe.py)."""
    import re

    import torch

    out = {k: v for k, v in state.items() if ".local_experts." not in k}
    layers = {int(re.match(r"decoder\.layers\.(\d+)\.", k)[1]) for k in state
              if ".local_experts." in k}
    for i in layers:
        a = f"decoder.layers.{i}.mlp.experts."
        fc1 = [state[a + f"local_experts.{e}.linear_fc1.weight"].t() for e in range(experts)]
        fc2 = [state[a + f"local_experts.{e}.linear_fc2.weight"].t() for e in range(experts)]
        out[a + "weight1"] = torch.stack(fc1).reshape(hidden, -1)
        out[a + "weight2"] = torch.stack(fc2).reshape(-1, hidden)
    return out


def _save(state: dict, save: str, flags: list) -> None:
    from megatron_2bw.hf.megatron_io import build_run, save_weights

    run = build_run("gpt", TINY + MIXTRAL + flags + ["--save", save, "--ckpt-format", "torch"],
                    127)
    save_weights(run, state)


def _ids(vocab: int, seq: int):
    import torch

    return torch.randint(0, vocab, (3, seq), generator=torch.Generator().manual_seed(0))


def _our_logits(loaded, ids):
    import torch

    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return loaded.stage.model(input_ids=ids, position_ids=positions,
                                  attention_mask=None).float()


def _hf_logits(path: str, ids):
    import torch

    model, info = transformers.MixtralForCausalLM.from_pretrained(
        path, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    with torch.no_grad():
        return model.eval()(ids).logits.float(), type(model).__name__


def _tensors(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def _worker(rank: int, world: int, tmp: str) -> dict:
    import logging
    import time
    import warnings
    warnings.filterwarnings("ignore")
    logging.getLogger("megatron_2bw").setLevel(logging.WARNING)
    import json

    from megatron_2bw.hf.export import export_hf
    from megatron_2bw.hf.import_ import import_hf
    from megatron_2bw.hf.megatron_io import loaded_checkpoint

    start, out = time.monotonic(), {}
    state = _random_weights()
    hidden = state["decoder.final_layernorm.weight"].shape[0]
    paths = {name: os.path.join(tmp, name) for name in
             ("seq", "grouped", "seq-hf", "grouped-hf", "imported", "imported-hf",
              "imported-grouped", "imported-forced")}
    _save(state, paths["seq"], [])
    _save(_grouped(state, 4, hidden), paths["grouped"], GROUPED)
    out["class"] = export_hf(paths["seq"], paths["seq-hf"])
    export_hf(paths["grouped"], paths["grouped-hf"])
    with loaded_checkpoint(paths["seq"]) as loaded:
        ids = _ids(loaded.config.vocab_size, loaded.config.seq_length)
        ours = _our_logits(loaded, ids)
        out["loaded_equals_saved"] = _same(
            {k: v for k, v in loaded.state_dict().items() if k in state}, state)
    theirs, out["hf_class"] = _hf_logits(paths["seq-hf"], ids)
    out["logits_max_abs"] = (ours - theirs).abs().max().item()
    out["logits_max_rel"] = out["logits_max_abs"] / ours.abs().max().item()
    with loaded_checkpoint(paths["grouped"]) as loaded:
        out["grouped_is_grouped"] = "decoder.layers.0.mlp.experts.weight1" in loaded.state_dict()
        out["grouped_logits_max_abs"] = (_our_logits(loaded, ids) - ours).abs().max().item()
    out["grouped_export_equal"] = _same(_tensors(paths["grouped-hf"]), _tensors(paths["seq-hf"]))
    result = import_hf(paths["seq-hf"], paths["imported"], ckpt_format="torch")
    out["import_flags"] = result.flags
    with loaded_checkpoint(paths["imported"]) as loaded:
        out["import_weights_equal"] = _same(loaded.state_dict(), state)
        out["import_logits_max_abs"] = (_our_logits(loaded, ids) - theirs).abs().max().item()
    export_hf(paths["imported"], paths["imported-hf"])
    out["round_trip_equal"] = _same(_tensors(paths["imported-hf"]), _tensors(paths["seq-hf"]))
    grouped = _grouped(state, 4, hidden)
    import_hf(paths["grouped-hf"], paths["imported-grouped"])  # torch_dist, the default
    import_hf(paths["seq-hf"], paths["imported-forced"], ckpt_format="torch", grouped_gemm=True)
    out["grouped_imports_equal"] = []
    for name in ("imported-grouped", "imported-forced"):
        with loaded_checkpoint(paths[name]) as loaded:
            out["grouped_imports_equal"].append(_same(loaded.state_dict(), grouped))
    with open(os.path.join(paths["seq-hf"], "config.json")) as f:
        out["config"] = json.load(f)
    out["seconds"] = time.monotonic() - start
    return out


# --------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    from tests.dist_harness import run_distributed

    result = run_distributed(_worker, 1, str(tmp_path_factory.mktemp("mixtral")))[0]
    print(f"Mixtral export: logits max |ours - HF| {result['logits_max_abs']:.2e} "
          f"(relative {result['logits_max_rel']:.2e}); grouped vs sequential "
          f"{result['grouped_logits_max_abs']:.2e}; imported vs HF "
          f"{result['import_logits_max_abs']:.2e}; worker {result['seconds']:.1f} s")
    return result


@pytest.mark.slow
def test_exported_mixtral_logits_equal_ours(measured) -> None:
    assert measured["class"] == measured["hf_class"] == "MixtralForCausalLM"
    assert measured["loaded_equals_saved"]
    assert measured["logits_max_abs"] < LOGITS_TOL
    c = measured["config"]
    assert (c["num_local_experts"], c["num_experts_per_tok"], c["intermediate_size"]) == (4, 2, 24)
    assert c["router_aux_loss_coef"] == pytest.approx(1e-2) and c["sliding_window"] is None


@pytest.mark.slow
def test_grouped_gemm_exports_the_same(measured) -> None:
    assert measured["grouped_is_grouped"]
    assert measured["grouped_logits_max_abs"] < LOGITS_TOL
    assert measured["grouped_export_equal"]


@pytest.mark.slow
def test_import_round_trips(measured) -> None:
    flags = " ".join(measured["import_flags"])
    for want in ("--num-experts 4", "--moe-router-topk 2", "--moe-ffn-hidden-size 24",
                 "--disable-bias-linear", "--moe-aux-loss-coeff 0.01"):
        assert want in flags
    assert "--moe-grouped-gemm" not in flags
    assert measured["import_weights_equal"]
    assert measured["import_logits_max_abs"] < LOGITS_TOL
    assert measured["round_trip_equal"]


@pytest.mark.slow
def test_import_keeps_or_takes_the_grouped_layout(measured) -> None:
    """The grouped run's export imports as GroupedMLP weights (its config says so), and
    so does any export with import_hf.py --moe-grouped-gemm: the original tensors packed."""
    assert measured["grouped_imports_equal"] == [True, True]


def test_mcore_topk_routing_is_mixtrals() -> None:
    """megatron-core (no pre-softmax): top-k of the logits, softmax over those k; Mixtral:
    softmax over all experts, top-k, divided by their sum. Same experts, same weights."""
    import torch
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    config = transformers.MixtralConfig(hidden_size=16, num_local_experts=8,
                                        num_experts_per_tok=2)
    router = MixtralTopKRouter(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=gen))
        hidden = torch.randn(512, 16, generator=gen)
        logits, weights, experts = router(hidden)
    probs, routing_map = topk_routing_with_score_function(logits, 2, use_pre_softmax=False)
    theirs = torch.zeros_like(probs).scatter(1, experts, weights.to(probs.dtype))
    assert torch.equal(routing_map, theirs > 0)
    torch.testing.assert_close(probs, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("flags,named", [
    (MIXTRAL + ["--moe-layer-freq", "2"], "--moe-layer-freq"),
    (MIXTRAL + ["--moe-expert-capacity-factor", "1.0"], "--moe-expert-capacity-factor"),
    ([f for f in MIXTRAL if f not in ("--moe-aux-loss-coeff", "1e-2")]
     + ["--moe-router-load-balancing-type", "sinkhorn"],
     "--moe-router-load-balancing-type sinkhorn"),
    ([f for f in MIXTRAL if f != "--disable-bias-linear"], "--disable-bias-linear"),
    (["--num-experts", "4", "--train-iters", "1"], "--num-experts"),
    (MIXTRAL + ["--moe-router-pre-softmax"], "--moe-router-pre-softmax"),
    (MIXTRAL + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"],
     "--moe-router-score-function"),
], ids=["layer-freq-2", "capacity-factor", "sinkhorn", "biases", "learned-positions",
        "pre-softmax", "sigmoid-bias"])
def test_what_mixtral_does_not_compute_is_refused(flags, named) -> None:
    """One line naming the flag, before anything is built."""
    import torch

    from megatron_2bw.hf.architecture import hf_family
    from megatron_2bw.training.arguments import parse_args
    from megatron_2bw.training.errors import UserError
    from megatron_2bw.training.model_flags import model_config

    args = parse_args("gpt", TINY + flags)
    with pytest.raises(UserError) as err:
        hf_family(model_config(args, "gpt", torch.float32, 128))
    assert err.value.where == named
    assert "Hugging Face transformers has no model class for" in str(err.value)
    assert "\n" not in str(err.value)
