"""Megatron-LM's mixture-of-experts command line: flags -> ModelConfig / ParallelConfig.

Fast, no process is started (flags are parsed into configs):
- every MoE flag of Megatron-LM core_v0.16.1 (the megatron-core TransformerConfig fields
  its arguments.py makes flags of, and its own "moe" group) is parsed here, honored,
  mapped or refused, and the honored ones default as Megatron-LM;
- each honored flag reaches ModelConfig, and from there megatron-core's TransformerConfig
  under the field name Megatron-LM's `core_transformer_config_from_args` copies it to;
  the expert-parallel sizes reach ParallelConfig, with megatron-core's expert grid;
- --moe-layer-freq's list form: every N-th layer is taken as N, any other 0 / 1 pattern
  as it is;
- Megatron-LM's Mixtral 8x7B example runs at its layout, and with one unsupported flag of
  each kind hears of all of them in one error; a DeepSeek-V3 recipe's MoE flags that are
  not implemented are all named in one error, one line per reason.
The rules between the MoE flags are cases of tests/test_reliability_inputs.py.
"""
from __future__ import annotations

import dataclasses

import pytest

from megatron_2bw.training import megatron_flags as M
from megatron_2bw.training.arguments import build_parser, config_from_args, parse_args
from megatron_2bw.training.config import ParallelConfig
from megatron_2bw.training.errors import UserError
from megatron_2bw.training.model_flags import pattern_frequency

VOCAB = 127
BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3",
        "--mock-data"]
MOE = ["--num-experts", "4"]
# the honored MoE flags' dests; Megatron-LM's num_experts is TransformerConfig's num_moe_experts
HONORED = ("num_experts", "moe_ffn_hidden_size", "moe_router_topk",
           "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
           "moe_token_dispatcher_type", "moe_grouped_gemm", "moe_layer_freq", "moe_router_dtype",
           "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity",
           "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
           "moe_router_score_function", "moe_router_pre_softmax",
           "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
           "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
           "moe_router_force_load_balancing", "moe_per_layer_logging",
           "expert_model_parallel_size", "expert_tensor_parallel_size",
           "mtp_num_layers", "mtp_loss_scaling_factor")
# Megatron-LM's arguments.py leaves these TransformerConfig fields without a flag
NO_FLAG = {"num_moe_experts", "moe_token_dropping", "moe_router_topk_limited_devices"}
# its "moe" group's own flags (not TransformerConfig fields)
MOE_GROUP = ("--num-experts", "--moe-use-upcycling", "--moe-upcycling-granularity",
             "--moe-pad-experts-for-cuda-graph-inference")


def _run(extra: list[str], world: int = 1, model: str = "gpt", base=BASE):
    return config_from_args(parse_args(model, base + extra), model, world, VOCAB)


def _refused(extra: list[str], world: int = 1, base=BASE) -> UserError:
    with pytest.raises(UserError) as info:
        _run(extra, world, base=base)
    return info.value


def _megatron_moe_flags() -> dict[str, dataclasses.Field]:
    """Megatron-LM's MoE flags made from megatron-core's TransformerConfig fields (its
    ArgumentGroupFactory: --field-name), by flag."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return {"--" + f.name.replace("_", "-"): f for f in dataclasses.fields(TransformerConfig)
            if f.init and f.name not in NO_FLAG
            and ("moe" in f.name or "expert" in f.name or f.name.startswith("mtp_"))}


def _parser_actions() -> dict[str, object]:
    return {s: a for a in build_parser("gpt")._actions for s in a.option_strings}


# ------------------------------------------------------------------ flags and defaults

def test_every_megatron_moe_flag_is_parsed_and_classified() -> None:
    """No MoE flag of a Megatron-LM script is an unknown flag here: each is honored (a
    model or parallel flag), mapped, honored as a no-op, or refused with its reason."""
    actions = _parser_actions()
    flags = set(_megatron_moe_flags()) | set(MOE_GROUP)
    assert len(flags) == 49  # 45 TransformerConfig fields + the "moe" group's 4
    assert flags <= set(actions), sorted(flags - set(actions))
    special = ({f.name for f in M.MAPPED} | {f.name for f, _ in M.HONORED_NOOP}
               | {f.name for f, _, _ in M.REFUSED})
    honored = {"--" + d.replace("_", "-") for d in HONORED}
    assert flags == honored | (flags & special) and not honored & special


def test_defaults_are_megatron_lms() -> None:
    """The honored flags default as Megatron-LM (megatron-core's field defaults; its
    --num-experts is None), and a command line without them builds a dense model on the
    plain grid: EP = 1, ETP = TP (Megatron-LM's default), EDP = DP."""
    actions, fields = _parser_actions(), _megatron_moe_flags()
    for dest in HONORED[1:]:
        flag = "--" + dest.replace("_", "-")
        assert actions[flag].default == fields[flag].default, flag
    assert actions["--num-experts"].default is None
    run = _run(["--tensor-model-parallel-size", "2"], world=4)
    assert run.model.num_experts is None and not run.model.is_moe
    assert (run.parallel.expert_parallel, run.parallel.expert_tensor_parallel) == (1, 2)
    assert run.parallel.expert_data_parallel == run.parallel.data_parallel == 2
    plain = ParallelConfig(8, 2, 2)
    assert (plain.expert_parallel, plain.expert_tensor_parallel,
            plain.expert_data_parallel) == (1, 2, 2)


FULL = MOE + ["--moe-ffn-hidden-size", "24", "--moe-router-topk", "3",
              "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-2",
              "--moe-z-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall",
              "--moe-grouped-gemm", "--moe-layer-freq", "2", "--moe-router-dtype", "fp64",
              "--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity",
              "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate",
              "--disable-bias-linear", "--tensor-model-parallel-size", "2",
              "--sequence-parallel", "--pipeline-model-parallel-size", "2",
              "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
              "--global-batch-size", "4"]


def test_each_flag_reaches_the_configs_and_megatron_core() -> None:
    """Every honored MoE flag lands in ModelConfig, and megatron-core's TransformerConfig
    (models/stages.py) holds under each flag's dest what Megatron-LM's
    core_transformer_config_from_args copies there; the grid is megatron-core's."""
    from megatron_2bw.models.stages import transformer_config

    run = _run(FULL, world=8)
    m, par = run.model, run.parallel
    assert (m.num_experts, m.moe_ffn_hidden_size, m.moe_router_topk) == (4, 24, 3)
    assert (m.moe_router_load_balancing_type, m.moe_aux_loss_coeff, m.moe_z_loss_coeff) == (
        "seq_aux_loss", 1e-2, 1e-3)
    assert (m.moe_token_dispatcher_type, m.moe_grouped_gemm, m.moe_layer_freq) == (
        "alltoall", True, 2)
    assert (m.moe_router_dtype, m.moe_expert_capacity_factor) == ("fp64", 1.5)
    assert m.moe_pad_expert_input_to_capacity and [m.is_moe_layer(i) for i in range(4)] == [
        True, False, True, False]
    assert (par.tensor_parallel, par.pipeline_parallel, par.data_parallel) == (2, 2, 2)
    assert (par.expert_parallel, par.expert_tensor_parallel, par.expert_data_parallel) == (
        2, 1, 2)  # 8 / (ETP 1 x EP 2 x PP 2)
    config = transformer_config(m, par.tensor_parallel, par.pipeline_parallel,
                                ep=par.expert_parallel, etp=par.expert_tensor_parallel)
    args = parse_args("gpt", BASE + FULL)
    assert config.num_moe_experts == args.num_experts
    for dest in HONORED[1:]:
        assert getattr(config, dest) == getattr(args, dest, None) or dest in (
            "moe_router_load_balancing_type", "moe_aux_loss_coeff"), dest
    assert [config.moe_router_load_balancing_type] == args.moe_router_load_balancing_type
    assert [config.moe_aux_loss_coeff] == args.moe_aux_loss_coeff


def test_megatron_lm_checkpoint_args_of_a_dense_model_pass() -> None:
    """A dense Megatron-LM checkpoint's args hold every MoE flag at its default and the
    expert-tensor-parallel size resolved (= its TP); read back onto this parser (as the
    converter does) at another TP they change nothing and are accepted."""
    args = parse_args("gpt", BASE + ["--tensor-model-parallel-size", "2"])
    saved = dict(expert_model_parallel_size=1, expert_tensor_parallel_size=1, num_experts=None,
                 moe_router_score_function="softmax", moe_router_bias_update_rate=0.001,
                 mtp_loss_scaling_factor=0.1, moe_token_drop_policy="probs",
                 moe_upcycling_granularity=1, moe_flex_dispatcher_backend="deepep",
                 moe_deepep_num_sms=20, moe_hybridep_num_sms=16,
                 moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0,
                 moe_layer_freq=1, moe_router_topk=2, moe_token_dispatcher_type="allgather")
    for key, value in saved.items():
        setattr(args, key, value)
    run = config_from_args(args, "gpt", 2, VOCAB)
    assert run.model.num_experts is None and run.parallel.expert_tensor_parallel == 1


def test_megatron_lms_derived_values_and_sizes() -> None:
    """--num-experts 0 is dense (Megatron-LM: None); one load-balancing type and one
    coefficient are single values in the checkpoint's args, as Megatron-LM saves them; the
    expert MLP width defaults to the dense one; ETP defaults to TP."""
    run = _run(["--num-experts", "0"])
    assert run.model.num_experts is None and run.flags["num_experts"] is None
    run = _run(MOE + ["--moe-router-load-balancing-type", "sinkhorn", "--swiglu"])
    assert run.flags["moe_router_load_balancing_type"] == "sinkhorn"
    assert run.flags["moe_aux_loss_coeff"] == 0.0
    assert run.model.moe_ffn_size == run.model.ffn_size == 64  # --swiglu's 2/3 x 4h rounded
    run = _run(MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                      "--disable-bias-linear"], world=2)
    assert run.parallel.expert_tensor_parallel == 2 and run.parallel.expert_data_parallel == 1


# ------------------------------------------------------------------ the expert grid

@pytest.mark.parametrize("world,tp,pp,cp,ep,etp,ok", [
    (8, 2, 2, 1, 2, 1, True),     # stage of 4 ranks = ETP 1 x EP 2 x EDP 2
    (8, 2, 1, 2, 4, 2, True),     # context parallelism folds into expert data parallelism
    (8, 1, 1, 1, 8, 1, True),
    (8, 2, 2, 1, 4, None, False),  # ETP = TP 2 x EP 4 = 8 > a stage's 4 ranks
    (6, 1, 1, 1, 4, 1, False),
    (12, 1, 2, 1, 4, 1, False),   # 12 / PP 2 = 6 ranks per stage, not a multiple of 4
])
def test_the_expert_grid_is_megatron_cores(world, tp, pp, cp, ep, etp, ok) -> None:
    """megatron-core's initialize_model_parallel: world % (ETP x EP x PP) == 0, so that the
    expert grid tiles each stage's TP x CP x DP ranks; the flags say so in one line, and
    ParallelConfig refuses it too."""
    flags = ["--num-experts", "8", "--disable-bias-linear",
                       "--tensor-model-parallel-size", str(tp),
                       "--pipeline-model-parallel-size", str(pp),
                       "--context-parallel-size", str(cp), "--expert-model-parallel-size",
                       str(ep), "--attention-dropout", "0", "--global-batch-size", "16"]
    flags += ["--sequence-parallel"] if tp > 1 else []
    flags += ["--expert-tensor-parallel-size", str(etp)] if etp else []
    if ok:
        par = _run(flags, world).parallel
        stage = par.expert_data_parallel * par.expert_parallel * par.expert_tensor_parallel
        assert stage == world // pp == tp * cp * par.data_parallel
        return
    err = _refused(flags, world)
    assert err.where == ("--expert-tensor-parallel-size, --expert-model-parallel-size, "
                         "--pipeline-model-parallel-size") and "ETP x EP x PP" in err.what
    assert "\n" not in str(err)
    with pytest.raises(ValueError, match="--expert-model-parallel-size"):
        ParallelConfig(world, tp, pp, context_parallel=cp, expert_parallel=ep,
                       expert_tensor_parallel=etp)


# ------------------------------------------------------------------ --moe-layer-freq

@pytest.mark.parametrize("text,freq", [
    ("2", 2), ("[1]*4", 1), ("([1]+[0])*2", 2), ("'[1,0,0,0]'", 4), ("[1] + [0] * 3", 4),
    ("([1]+[0]*1)*2", 2)])
def test_layer_freq_patterns_of_every_nth_layer_are_taken(text, freq) -> None:
    assert _run(MOE + ["--moe-layer-freq", text]).model.moe_layer_freq == freq


def test_pattern_frequency_is_megatron_cores_int_pattern() -> None:
    """An int N means megatron-core's [1 if i % N == 0 else 0 for each layer]; a pattern is
    taken as N exactly when it is that list."""
    for layers in (1, 4, 7, 24):
        for n in range(1, layers + 2):
            pattern = [int(i % n == 0) for i in range(layers)]
            k = pattern_frequency(pattern)
            assert [int(i % k == 0) for i in range(layers)] == pattern
            assert k == n or n >= layers  # past the last layer every N is the same pattern
    for pattern in ([0, 1, 1, 1], [1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 1, 1]):
        assert pattern_frequency(pattern) is None


@pytest.mark.parametrize("text", ["[1]*x", "[1]*10000000", "[[1]]*4", "(1,0)", "2.5", "[1]-[0]"])
def test_a_malformed_layer_freq_is_a_parse_error(text) -> None:
    with pytest.raises(UserError, match="--moe-layer-freq") as info:
        parse_args("gpt", BASE + MOE + ["--moe-layer-freq", text])
    assert info.value.where == "command line"


def test_other_layer_patterns_reach_the_model_layer_by_layer() -> None:
    """DeepSeek-V3's dense first layers ([0]*3+[1]*58): the pattern itself, per layer."""
    model = _run(MOE + ["--moe-layer-freq", "[0]*1+[1]*2+[0]"]).model
    assert model.moe_layer_freq == (0, 1, 1, 0)
    assert [model.is_moe_layer(i) for i in range(4)] == [False, True, True, False]


# ------------------------------------------------------------------ Megatron-LM's scripts

# examples/mixtral/train_mixtral_8x7b_distributed.sh at core_v0.16.1, sizes shrunk; its
# layout (TP 1, PP 4, EP 8) needs 32 ranks: 8 % (EP 8 x PP 4) != 0 on one node
MIXTRAL = ["--use-mcore-models", "--disable-bias-linear", "--seq-length", "16",
           "--max-position-embeddings", "64", "--num-layers", "8", "--hidden-size", "64",
           "--ffn-hidden-size", "96", "--num-attention-heads", "4", "--init-method-std", "0.01",
           "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization", "RMSNorm",
           "--position-embedding-type", "rope", "--swiglu",
           "--untie-embeddings-and-output-weights", "--group-query-attention",
           "--num-query-groups", "2", "--no-masked-softmax-fusion", "--no-position-embedding",
           "--rotary-base", "1000000",
           "--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type",
           "aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm",
           "--moe-token-dispatcher-type", "alltoall", "--overlap-param-gather",
           "--overlap-grad-reduce",
           "--mock-data", "--split", "99990,8,2", "--micro-batch-size", "1",
           "--global-batch-size", "256", "--lr", "1e-4", "--train-iters", "500000",
           "--lr-decay-iters", "320000", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5",
           "--weight-decay", "0.1", "--lr-warmup-iters", "500", "--clip-grad", "1.0", "--bf16",
           "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
           "--expert-model-parallel-size", "8", "--use-distributed-optimizer",
           "--sequence-parallel"]


def test_megatron_lms_mixtral_example_runs_at_its_layout() -> None:
    """Its flags as they are, the distributed optimizer included (the dense part sharded
    over the data-parallel ranks, the experts over the expert-data-parallel ones)."""
    run = config_from_args(parse_args("gpt", MIXTRAL), "gpt", 32, VOCAB)
    m, par = run.model, run.parallel
    assert (m.num_experts, m.moe_router_topk, m.moe_aux_loss_coeff) == (8, 2, 1e-2)
    assert m.moe_grouped_gemm and m.moe_token_dispatcher_type == "alltoall"
    assert (par.data_parallel, par.expert_parallel, par.expert_data_parallel) == (8, 8, 1)
    assert par.distributed_optimizer
    notes = M.mapped_notes(parse_args("gpt", MIXTRAL), on_gpu=True)
    assert [n.split(":")[0] for n in notes] == ["--overlap-grad-reduce", "--overlap-param-gather"]
    with pytest.raises(UserError) as info:  # on one node of 8, as megatron-core refuses it
        config_from_args(parse_args("gpt", MIXTRAL), "gpt", 8, VOCAB)
    assert "ETP x EP x PP = 1 x 8 x 4 = 32" in info.value.what


# a Megatron-LM user's copy of the Mixtral example for a GPU cluster: what this project
# does not take, of each kind (the flag, and the part of the error that names it)
MIXTRAL_UNSUPPORTED = {
    "--fp8-format": ["--fp8-format", "hybrid"],                      # refused
    "--moe-input-jitter-eps": ["--moe-input-jitter-eps", "0.01"],  # refused
    "--moe-token-dispatcher-type flex": ["--moe-token-dispatcher-type", "flex"],  # its value
    "--tokenizer-type TikTokenizer": ["--tokenizer-type", "TikTokenizer"],   # its value
    "--checkpoint-activations": ["--checkpoint-activations"],            # removed
    "--mamba-state-dim": ["--mamba-state-dim", "8"],         # Megatron-LM's, not here
    "--num-expert": ["--num-expert", "8"],                    # a typo: --num-experts
    "--recompute-modules": ["--recompute-modules", "moe_layer"],  # not Megatron-LM's either
}


def test_the_mixtral_example_hears_of_every_unsupported_flag_at_once(monkeypatch, capsys,
                                                                       tmp_path) -> None:
    """The Mixtral flag set with one unsupported flag of each kind: one error before the
    process group, one `error:` line per problem (each flag named in exactly one), no
    traceback, the mapped overlaps not among them, the same lines in torchrun's error file
    for its summary; rank 1 prints nothing (under torchrun every rank has the same command
    line, rank 0 speaks)."""
    import json

    from megatron_2bw.training import entry

    monkeypatch.setattr(entry, "init_distributed", lambda **_: pytest.fail("group started"))
    argv = MIXTRAL + [a for extra in MIXTRAL_UNSUPPORTED.values() for a in extra]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    assert entry.main("gpt", argv) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines and all(line.startswith("error: ") for line in lines), err
    for named in MIXTRAL_UNSUPPORTED:
        assert sum(named in line for line in lines) == 1, (named, err)
    assert "did you mean --num-expert -> --num-experts" in err
    assert "--mamba-state-dim: Megatron-LM's, not implemented here" in err
    assert "--overlap-grad-reduce" not in err and "Traceback" not in err
    report = json.loads((tmp_path / "error.json").read_text())
    assert report["message"]["extraInfo"]["py_callstack"].splitlines() == lines
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error1.json"))
    assert entry.main("gpt", argv) == 2
    assert capsys.readouterr().err == "" and not (tmp_path / "error1.json").exists()


# the MoE flags of Megatron-LM's DeepSeek-V3 / R1 recipe
# (examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-R1.sh), sizes shrunk, plus
# its flex dispatcher and the multi-token prediction of its functional-test proxies
DEEPSEEK = ["--num-experts", "8", "--moe-layer-freq", "[0]*1+[1]*3", "--moe-ffn-hidden-size",
            "16", "--moe-router-dtype", "fp32", "--moe-router-score-function", "sigmoid",
            "--moe-router-bias-update-rate", "1e-3", "--moe-router-enable-expert-bias",
            "--moe-router-topk", "4", "--moe-router-num-groups", "4", "--moe-router-group-topk",
            "2", "--moe-router-pre-softmax", "--moe-router-topk-scaling-factor", "2.5",
            "--moe-shared-expert-overlap", "--moe-shared-expert-intermediate-size", "16",
            "--moe-aux-loss-coeff", "1e-4", "--moe-router-load-balancing-type", "seq_aux_loss",
            "--moe-token-dispatcher-type", "flex", "--moe-enable-deepep",
            "--moe-token-drop-policy", "probs", "--moe-layer-recompute", "--mtp-num-layers", "1",
            "--mtp-loss-scaling-factor", "0.1", "--moe-permute-fusion", "--disable-bias-linear"]
DEEPSEEK_REFUSED = {  # reason -> the flags named under it, in the tables' order
    M.FLEX_WHY: ["--moe-enable-deepep", "--moe-token-dispatcher-type flex"],
    "recomputing the MoE layers alone": ["--moe-layer-recompute"],
}


def test_a_deepseek_recipe_hears_of_every_refused_moe_flag_at_once() -> None:
    """One error names them all, one line per reason; the flags that change nothing here
    (--moe-token-drop-policy probs, its default) or only select kernels pass unnamed."""
    err = _refused(DEEPSEEK)
    assert isinstance(err, M.FlagErrors) and len(err.problems) == len(DEEPSEEK_REFUSED)
    for problem, (why, flags) in zip(err.problems, DEEPSEEK_REFUSED.items()):
        assert problem.where == ", ".join(flags) and why in problem.fix
        assert "\n" not in str(problem)
    assert len(str(err).splitlines()) == len(DEEPSEEK_REFUSED)


@pytest.mark.parametrize("extra", [
    ["--moe-router-score-function", "softmax"],         # GPT-OSS's recipe gives the default
    ["--moe-token-drop-policy", "probs"],
    ["--moe-router-bias-update-rate", "1e-2"],          # without the expert bias
    ["--mtp-num-layers", "0", "--mtp-loss-scaling-factor", "0.3", "--mtp-standalone"],
    ["--moe-shared-expert-gate"],                       # without shared experts
    ["--moe-upcycling-granularity", "1"],
    ["--moe-extended-tp", "--moe-pad-experts-for-cuda-graph-inference"],
    ["--no-position-embedding", "--position-embedding-type", "rope"],
])
def test_refused_moe_flags_pass_where_they_change_nothing(extra) -> None:
    assert _run(MOE + extra).model.num_experts == 4


@pytest.mark.parametrize("extra,named", [
    (["--moe-router-load-balancing-type", "global_aux_loss"],
     "--moe-router-load-balancing-type global_aux_loss"),
    (["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff",
      "1e-2", "1e-3"], "--moe-router-load-balancing-type aux_loss seq_aux_loss, "
                       "--moe-aux-loss-coeff 0.01 0.001"),
    (["--moe-router-padding-for-fp8"], "--moe-router-padding-for-fp8"),
    (["--moe-input-jitter-eps", "1e-2"], "--moe-input-jitter-eps"),
    (["--no-position-embedding"], "--no-position-embedding"),
])
def test_other_refused_moe_values_name_themselves(extra, named) -> None:
    err = _refused(MOE + extra)
    assert err.where == named and err.fix.endswith(f"({M.DOC})")


@pytest.mark.parametrize("extra,named", [
    (["--moe-shared-expert-intermediate-size", "16"],
     "--moe-shared-expert-intermediate-size, --disable-bias-linear"),
    (["--moe-shared-expert-intermediate-size", "15", "--disable-bias-linear",
      "--tensor-model-parallel-size", "2", "--sequence-parallel"],
     "--moe-shared-expert-intermediate-size, --tensor-model-parallel-size"),
    (["--moe-shared-expert-intermediate-size", "16", "--disable-bias-linear",
      "--moe-shared-expert-overlap"],
     "--moe-shared-expert-overlap, --moe-token-dispatcher-type"),
], ids=["bias", "tp-split", "overlap-allgather"])
def test_shared_experts_refuse_what_megatron_refuses(extra, named) -> None:
    """megatron-core's SharedExpertMLP has no biases and splits over TP; Megatron-LM
    overlaps it only with the alltoall dispatcher (where the overlap flag is a no-op)."""
    err = _refused(MOE + extra, world=2)
    assert err.where == named and "\n" not in str(err), err
    run = _run(MOE + extra[:2] + ["--disable-bias-linear", "--moe-shared-expert-overlap",
                                  "--moe-token-dispatcher-type", "alltoall"])
    assert run.model.moe_shared_expert_intermediate_size == int(extra[1])
    assert not run.model.moe_shared_expert_gate  # only with --moe-shared-expert-gate


def test_mapped_moe_flags_say_what_runs() -> None:
    args = parse_args("gpt", BASE + MOE + ["--moe-permute-fusion", "--moe-router-fusion",
                                           "--moe-use-legacy-grouped-gemm",
                                           "--overlap-moe-expert-parallel-comm"])
    notes = M.mapped_notes(args, on_gpu=True)
    assert [n.split(" ")[0].rstrip(":") for n in notes] == [
        "--moe-permute-fusion", "--moe-router-fusion", "--moe-use-legacy-grouped-gemm",
        "--overlap-moe-expert-parallel-comm"]
    assert "numbers do not depend on it" in notes[0] and "GroupedMLP" in notes[2]
    assert "not overlapped" in notes[3]


@pytest.mark.parametrize("extra,named", [
    (["--optimizer", "muon", "--moe-grouped-gemm", "--disable-bias-linear"],
     "--optimizer, --moe-grouped-gemm"),
], ids=["muon-grouped"])
def test_combinations_not_yet_trained_are_refused(extra, named) -> None:
    """Not implemented yet: Muon over a grouped-GEMM matrix of several experts. Said in
    one line, naming the flags."""
    err = _refused(["--num-experts", "4"] + extra, world=2)
    assert named in str(err), err


@pytest.mark.parametrize("extra", [[], ["--expert-model-parallel-size", "2"]],
                         ids=["ep1", "ep2"])
def test_the_distributed_optimizer_trains_experts(extra) -> None:
    """With expert parallelism or without (Megatron-LM's Mixtral example: EP 8)."""
    run = _run(["--num-experts", "4", "--use-distributed-optimizer"] + extra, world=4)
    assert run.parallel.distributed_optimizer
