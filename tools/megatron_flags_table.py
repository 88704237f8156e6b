"""Which of Megatron-LM's flags pretrain_gpt.py / pretrain_bert.py honor, map or refuse.

    python tools/megatron_flags_table.py [--markdown docs/megatron-flags.md]

The checked flags are every flag of Megatron-LM's example scripts at core_v0.16.1
(examples/gpt3/train_gpt3_175b_distributed.sh, examples/bert/train_bert_340m_distributed.sh,
examples/llama/train_llama3_8b_h100_fp8.sh, examples/mixtral/train_mixtral_8x7b_distributed.sh)
plus commonly used ones (their own sources below), and every mixture-of-experts flag of
Megatron-LM's arguments.py: those its MoE recipes carry (DeepSeek-V3 / R1, Qwen3-MoE and
GPT-OSS in examples/post_training/modelopt/conf, the Mixtral and DeepSeek-V3 proxy cases of
its functional tests), then the rest.
Each is classified from the real parsers and megatron_2bw/training/megatron_flags.py,
not from a hand-kept list, so the table cannot drift from the code:

- honored: parsed and used with Megatron-LM's meaning;
- honored (no-op): Megatron-LM's meaning is what happens here anyway;
- mapped: selects a kernel or an overlap; megatron-core's local implementation runs;
- refused where it changes something: accepted where it changes nothing (as Megatron-LM
  itself does), else one `error:` line with the reason;
- removed: Megatron-LM's own removed spelling, answered with its replacement;
- unknown: not a flag here; the parser names it and points to this table.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from megatron_2bw.training import megatron_flags as M
from megatron_2bw.training.arguments import build_parser

GPT3 = """--num-layers --hidden-size --num-attention-heads --seq-length --max-position-embeddings
--attention-backend --micro-batch-size --global-batch-size --rampup-batch-size --train-iters
--weight-decay --adam-beta1 --adam-beta2 --init-method-std --clip-grad --fp16 --lr
--lr-decay-style --min-lr --lr-warmup-fraction --lr-decay-iters --tensor-model-parallel-size
--pipeline-model-parallel-size --data-path --vocab-file --merge-file --split --log-interval
--save-interval --eval-interval --save --load --eval-iters --tensorboard-dir"""
BERT = """--num-layers --hidden-size --num-attention-heads --seq-length --max-position-embeddings
--attention-backend --micro-batch-size --global-batch-size --train-iters --weight-decay
--clip-grad --fp16 --lr --lr-decay-iters --lr-decay-style --min-lr --lr-warmup-fraction
--tensor-model-parallel-size --pipeline-model-parallel-size --data-path --vocab-file --split
--log-interval --save-interval --eval-interval --save --load --eval-iters --tensorboard-dir"""
LLAMA = """--use-mcore-models --num-layers --hidden-size --ffn-hidden-size --num-attention-heads
--group-query-attention --num-query-groups --kv-channels --seq-length --max-position-embeddings
--position-embedding-type --rotary-base --rotary-percent --attention-dropout --hidden-dropout
--swiglu --init-method-std --attention-backend --apply-layernorm-1p
--untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size
--global-batch-size --train-samples --lr-decay-samples --lr-warmup-samples --lr --min-lr
--decoupled-lr --decoupled-min-lr --lr-decay-style --clip-grad --weight-decay --adam-beta1
--adam-beta2 --bf16 --grad-reduce-in-bf16 --cross-entropy-loss-fusion
--calculate-per-token-loss --manual-gc --empty-unused-memory-level --exit-duration-in-mins
--fp8-format --fp8-amax-history-len --fp8-amax-compute-algo --fp8-param-gather
--tensor-model-parallel-size --context-parallel-size --sequence-parallel
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --mock-data
--tokenizer-type --vocab-size --data-cache-path --tiktoken-pattern --split
--no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers --data-path
--tokenizer-model --log-interval --eval-iters --eval-interval --save-interval
--log-throughput --profile --profile-step-start --profile-step-end --ckpt-format
--distributed-timeout-minutes --save --load --tensorboard-dir"""
ISSUE = """--use-flash-attn --no-masked-softmax-fusion --recompute-activations
--recompute-granularity --recompute-method --recompute-num-layers --normalization --cp-comm-type
--lr-warmup-iters --timing-log-level --wandb-project --checkpoint-activations
--transformer-impl --qk-layernorm --decoder-first-pipeline-num-layers
--decoder-last-pipeline-num-layers --seed --adam-eps --loss-scale --initial-loss-scale
--min-loss-scale --loss-scale-window --hysteresis --make-vocab-size-divisible-by
--exit-interval --exit-signal-handler --optimizer --num-layers-per-virtual-pipeline-stage
--override-opt_param-scheduler --use-checkpoint-opt_param-scheduler --ffn-hidden-size"""
MIXTRAL = """--use-mcore-models --disable-bias-linear --seq-length --max-position-embeddings
--num-layers --hidden-size --ffn-hidden-size --num-attention-heads --init-method-std
--attention-dropout --hidden-dropout --normalization --position-embedding-type --swiglu
--untie-embeddings-and-output-weights --group-query-attention --num-query-groups
--no-masked-softmax-fusion --no-position-embedding --rotary-base --num-experts
--moe-router-topk --moe-router-load-balancing-type --moe-aux-loss-coeff --moe-grouped-gemm
--moe-token-dispatcher-type --overlap-param-gather --overlap-grad-reduce --tokenizer-type
--tokenizer-model --data-path --split --micro-batch-size --global-batch-size --lr
--train-iters --lr-decay-iters --lr-decay-style --min-lr --weight-decay --lr-warmup-iters
--clip-grad --bf16 --tensor-model-parallel-size --pipeline-model-parallel-size
--expert-model-parallel-size --use-distributed-optimizer --sequence-parallel --log-interval
--save-interval --eval-interval --eval-iters --save --load --tensorboard-dir --no-load-optim
--no-load-rng --wandb-project --wandb-exp-name"""
MOE_RECIPES = """--expert-tensor-parallel-size --moe-ffn-hidden-size --moe-router-dtype
--moe-layer-freq --moe-z-loss-coeff --moe-router-score-function --moe-router-enable-expert-bias
--moe-router-bias-update-rate --moe-router-num-groups --moe-router-group-topk
--moe-router-pre-softmax --moe-router-topk-scaling-factor --moe-shared-expert-intermediate-size
--moe-shared-expert-overlap --moe-shared-expert-gate --moe-token-drop-policy
--moe-layer-recompute --mtp-num-layers --mtp-loss-scaling-factor --moe-permute-fusion
--moe-router-fusion --overlap-moe-expert-parallel-comm --moe-apply-probs-on-input
--moe-enable-deepep --moe-flex-dispatcher-backend --moe-pad-experts-for-cuda-graph-inference"""
MOE_OTHER = """--moe-expert-capacity-factor --moe-pad-expert-input-to-capacity
--moe-use-legacy-grouped-gemm --moe-extended-tp --moe-input-jitter-eps --moe-per-layer-logging
--moe-router-force-load-balancing --moe-router-padding-for-quantization
--moe-router-padding-for-fp8 --moe-latent-size --moe-use-upcycling --moe-upcycling-granularity
--moe-enable-routing-replay --moe-deepep-num-sms --moe-hybridep-num-sms --mtp-standalone"""
# Megatron-LM's kernel switches (its defaults: the fusions on, cross-entropy fusion off)
KERNELS = """--no-bias-gelu-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion
--no-masked-softmax-fusion --cross-entropy-loss-fusion"""
# GPT data flags that go with --calculate-per-token-loss in Megatron-LM's users' scripts
DATA = """--eod-mask-loss --reset-position-ids --reset-attention-mask"""
# flags about a run that stopped learning (the NaN/inf check, resuming a chosen checkpoint)
NAN = """--no-check-for-nan-in-loss-and-grad --ckpt-step --exit-on-missing-checkpoint"""
SOURCES = {"GPT-3 175B": GPT3, "BERT 340M": BERT, "Llama-3 8B fp8": LLAMA, "common": ISSUE,
           "GPT data": DATA, "kernels": KERNELS, "run health": NAN, "Mixtral 8x7B": MIXTRAL,
           "MoE recipes": MOE_RECIPES, "MoE": MOE_OTHER}
# what an honored flag's row adds (where this project's meaning has a part of its own)
NOTES = {"--no-check-for-nan-in-loss-and-grad":
         "the check is on by default and ends the run at the first NaN/inf (one error line, "
         "a checkpoint with --save); off under fp16's dynamic loss scaling, as Megatron-LM; "
         "this project's --max-consecutive-skipped-iterations (default 10) bounds skipped "
         "iterations then (docs/training.md)"}


def checked_flags() -> dict[str, list[str]]:
    """{flag: the sources that use it}, in first-seen order."""
    found: dict[str, list[str]] = {}
    for source, text in SOURCES.items():
        for flag in text.split():
            found.setdefault(flag, []).append(source)
    return found


def _parsed(model: str) -> set[str]:
    return {s for a in build_parser(model)._actions for s in a.option_strings}


# honored flags whose row quotes the parser's help (beside the kernel and MoE flags)
NOTED = ("--use-distributed-optimizer", "--expert-model-parallel-size",
         "--expert-tensor-parallel-size")
QUOTED_GROUPS = ("kernels", "mixture of experts")


def _kernel_help(flag: str) -> str:
    """The parser's help of a kernel or MoE flag (what runs on CUDA and on CPU) or of a
    NOTED one, else ""."""
    for group in build_parser("gpt")._action_groups:
        if flag in NOTED or (group.title and group.title.startswith(QUOTED_GROUPS)):
            for action in group._group_actions:
                if flag in action.option_strings:
                    off = flag.startswith("--no-") and action.default
                    return ("turns off (on by default): " if off else "") + (action.help or "")
    return ""


def classify(flag: str) -> tuple[str, str]:
    """(status, note) of one Megatron-LM flag here."""
    if flag in M.REMOVED:
        return "removed", M.REMOVED[flag]
    for f, _, why in M.REFUSED:
        if f.name == flag:
            return "refused where it changes something", why
    if flag in M.INSTEAD:
        return "mapped", M.INSTEAD[flag]
    if any(f.name == flag for f in M.MAPPED):
        return "mapped", "selects a kernel or an overlap; megatron-core's local code runs"
    for f, why in M.HONORED_NOOP:
        if f.name == flag:
            return "honored (no-op)", why
    if flag in ("--timing-log-level", "--timing-log-option"):
        return "mapped", "per-phase timers are not measured; above level 0 one line says so"
    if flag in _parsed("gpt") | _parsed("bert"):
        note = _kernel_help(flag) or NOTES.get(flag, "")
        refused = [f"Refused {v.label}: {v.why}" for v in M.REFUSED_VALUES if v.name == flag]
        if refused:  # the values of an honored flag that ask for what is not implemented
            note = " ".join(n.rstrip(".") + "." for n in [note] + refused if n)
        return "honored", note
    return "unknown", "not implemented; the parser names it"


def table() -> tuple[list[tuple], dict[str, int]]:
    rows, counts = [], {}
    for flag, sources in checked_flags().items():
        status, note = classify(flag)
        counts[status] = counts.get(status, 0) + 1
        rows.append((flag, status, ", ".join(sources), note))
    return rows, counts


def markdown(rows: list[tuple], counts: dict[str, int]) -> str:
    total = sum(counts.values())
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    lines = ["# Megatron-LM flags in megatron-2bw", "",
             "Generated by `python tools/megatron_flags_table.py --markdown "
             "docs/megatron-flags.md` from the parsers themselves (see the tool's docstring "
             "for what each status means).", "",
             f"{total} flags checked: {summary}.", "",
             "| flag | status | used by | note |", "|---|---|---|---|"]
    lines += [f"| `{f}` | {s} | {src} | {note} |" for f, s, src, note in rows]
    return "\n".join(lines + [""] + MOE_NOTE) + "\n"


MOE_NOTE = [
    "## Mixture of experts",
    "",
    "`pretrain_gpt.py --num-experts N` builds Megatron-LM's mixture-of-experts GPT: every "
    "`--moe-layer-freq`-th layer (by default every layer) has megatron-core's MoE layer in "
    "place of its MLP, with a top-k router (`--moe-router-topk`, softmax after the top-k "
    "choice), N experts of inner width `--moe-ffn-hidden-size` and the allgather or alltoall "
    "token dispatcher. The flags take Megatron-LM's names, meanings and defaults: load "
    "balancing by `aux_loss`, `seq_aux_loss`, `sinkhorn` or `none` weighted by "
    "`--moe-aux-loss-coeff`, the router z-loss, `--moe-router-dtype`, token dropping with "
    "`--moe-expert-capacity-factor` (and padding to capacity), grouped experts "
    "(`--moe-grouped-gemm`: megatron-core's GroupedMLP weights, computed in torch, without "
    "biases), expert parallelism (`--expert-model-parallel-size`) and expert tensor "
    "parallelism (`--expert-tensor-parallel-size`, by default the tensor-parallel size). "
    "A `--moe-layer-freq` list pattern is taken when it is every N-th layer from the first. "
    "MoE is GPT only.",
    "",
    "The expert layers split the ranks as megatron-core does: within a pipeline stage, the "
    "TP x CP x DP ranks are expert-tensor-parallel x expert-parallel x expert-data-parallel "
    "ranks, so the world size must be divisible by ETP x EP x PP, and `--num-experts` by "
    "EP. As in megatron-core, a MoE model at tensor-parallel size above 1 needs "
    "`--sequence-parallel`, and experts with linear biases (the default) need "
    "expert-tensor-parallel size 1 (else `--disable-bias-linear`).",
    "",
    "Not implemented, and refused in one line that names every such flag of a command line: "
    "the DeepSeek-V3 router (sigmoid scores, the per-expert bias of aux-loss-free balancing, "
    "group-limited routing, score scaling, pre-softmax routing), shared experts, "
    "multi-token prediction, the flex dispatcher (DeepEP / HybridEP), the global-batch aux "
    "loss and several load-balancing losses at once, a layer pattern other than every N-th "
    "layer (such as dense first layers), recomputing the MoE layers alone, dropping tokens "
    "by position, router input jitter, upcycling, routing replay and per-layer MoE logging. "
    "The fusion and overlap switches (`--moe-permute-fusion`, `--moe-router-fusion`, "
    "`--overlap-moe-expert-parallel-comm`, `--moe-use-legacy-grouped-gemm`, ...) are mapped: "
    "the numbers do not depend on them.",
]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--markdown", help="write the table here (else print it)")
    args = ap.parse_args(argv)
    text = markdown(*table())
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
