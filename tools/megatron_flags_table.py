"""Which of Megatron-LM's flags pretrain_gpt.py / pretrain_bert.py honor, map or refuse.

    python tools/megatron_flags_table.py [--markdown docs/megatron-flags.md]

The checked flags are every flag of Megatron-LM's example scripts at core_v0.16.1
(examples/gpt3/train_gpt3_175b_distributed.sh, examples/bert/train_bert_340m_distributed.sh,
examples/llama/train_llama3_8b_h100_fp8.sh) plus commonly used ones (their own sources below).
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
# Megatron-LM's kernel switches (its defaults: the fusions on, cross-entropy fusion off)
KERNELS = """--no-bias-gelu-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion
--no-masked-softmax-fusion --cross-entropy-loss-fusion"""
# GPT data flags that go with --calculate-per-token-loss in Megatron-LM's users' scripts
DATA = """--eod-mask-loss --reset-position-ids --reset-attention-mask"""
# flags about a run that stopped learning (the NaN/inf check, resuming a chosen checkpoint)
NAN = """--no-check-for-nan-in-loss-and-grad --ckpt-step --exit-on-missing-checkpoint"""
SOURCES = {"GPT-3 175B": GPT3, "BERT 340M": BERT, "Llama-3 8B fp8": LLAMA, "common": ISSUE,
           "GPT data": DATA, "kernels": KERNELS, "run health": NAN}
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


# honored flags whose row quotes the parser's help (beside the kernel flags)
NOTED = ("--use-distributed-optimizer",)


def _kernel_help(flag: str) -> str:
    """The parser's help of a kernel flag (what runs on CUDA and on CPU) or of a NOTED
    one, else ""."""
    for group in build_parser("gpt")._action_groups:
        if flag in NOTED or (group.title and group.title.startswith("kernels")):
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
        return "honored", _kernel_help(flag) or NOTES.get(flag, "")
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
    return "\n".join(lines) + "\n"


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
