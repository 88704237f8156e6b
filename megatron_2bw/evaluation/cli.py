"""tools/evaluate.py: held-out perplexity (GPT) or masked-LM loss and accuracy (BERT).

    python tools/evaluate.py --load CKPT --data-path PREFIX [--seq-length N --stride S]
    python tools/evaluate.py --hf-dir HF_DIR --input test.jsonl [--json result.json]

One plain process. Every flag is checked, and the data read, before the weights load, so
a mistake costs seconds; each one is one line naming the flag (`guarded`, exit status 2).
The result is one line on stdout; `--json PATH` writes it as a dict too.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Optional, Sequence

from ..data.tokenizers import TOKENIZER_TYPES
from ..training.errors import UserError

logger = logging.getLogger(__name__)
result_logger = logging.getLogger("megatron_2bw.evaluation.result")  # stdout, see main()
DEFAULT_MASK_PROB, DEFAULT_SEED, DEFAULT_MICRO_BATCH = 0.15, 1234, 4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tools/evaluate.py", allow_abbrev=False,
        description="Held-out perplexity of a GPT model, or masked-LM loss and accuracy of a "
        "BERT model, from a checkpoint (any layout) or a Hugging Face directory. One process.")
    g = p.add_argument_group("model (exactly one)")
    g.add_argument("--load", help="checkpoint directory (torch_dist at any TP x PP, or torch "
                   "at TP = PP = 1)")
    g.add_argument("--hf-dir", help="Hugging Face model directory (e.g. export_hf.py's output)")
    g.add_argument("--weight-version", choices=("newest", "shadow"), default=None,
                   help="--load only: newest (default) or 2BW's shadow version")
    g.add_argument("--model", choices=("gpt", "bert"), default=None,
                   help="the model kind (default: detected); checked against the model")
    d = p.add_argument_group("data (exactly one)")
    d.add_argument("--data-path", help="prefix of a .bin/.idx pair (tools/preprocess_data.py)")
    d.add_argument("--input", help="loose JSON: one JSON object a line")
    d.add_argument("--json-keys", nargs="+", default=["text"],
                   help="--input's keys holding the text (default: text)")
    w = p.add_argument_group("windows")
    w.add_argument("--seq-length", type=int, default=None,
                   help="tokens per window (default: the run's / the HF config's)")
    w.add_argument("--stride", type=int, default=None, help="GPT: a window every this many "
                   "tokens, scored on its new tokens only (default: --seq-length, i.e. "
                   "non-overlapping)")
    w.add_argument("--micro-batch-size", type=int, default=DEFAULT_MICRO_BATCH,
                   help=f"windows per forward pass (default {DEFAULT_MICRO_BATCH})")
    w.add_argument("--max-tokens", type=int, default=None,
                   help="evaluate the first N tokens only (GPT: N tokens scored)")
    w.add_argument("--max-windows", type=int, default=None, help="at most N windows")
    b = p.add_argument_group("BERT")
    b.add_argument("--mask-prob", type=float, default=None,
                   help=f"share of tokens predicted (default {DEFAULT_MASK_PROB})")
    b.add_argument("--seed", type=int, default=None,
                   help=f"masking seed (default {DEFAULT_SEED})")
    t = p.add_argument_group("tokenizer (default: the model's own)")
    t.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    t.add_argument("--vocab-file", default=None)
    t.add_argument("--merge-file", default=None)
    t.add_argument("--tokenizer-model", default=None)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the result here")
    return p


def _one_of(args: argparse.Namespace, a: str, b: str, fix: str) -> None:
    given = [f"--{n.replace('_', '-')}" for n in (a, b) if getattr(args, n) is not None]
    if len(given) != 1:
        what = "both" if given else "neither"
        raise UserError(f"{what} of --{a.replace('_', '-')} and --{b.replace('_', '-')} given",
                        " ".join(given) or f"--{a.replace('_', '-')}", fix)


def check_flags(args: argparse.Namespace) -> None:
    """The checks that need nothing loaded."""
    _one_of(args, "load", "hf_dir", "give one model: --load CKPT or --hf-dir HF_DIR")
    _one_of(args, "data_path", "input", "give one data set: --data-path PREFIX (.bin/.idx) "
            "or --input FILE (loose JSON)")
    if args.hf_dir and args.weight_version:
        raise UserError("a Hugging Face directory holds one weight version",
                        "--weight-version", "drop it, or export the shadow version with "
                        "export_hf.py --weight-version shadow")
    for name in ("micro_batch_size", "seq_length", "stride", "max_tokens", "max_windows"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise UserError(f"{value} is not a positive count", f"--{name.replace('_', '-')}",
                            "give a whole number of at least 1")
    if args.mask_prob is not None and not 0 < args.mask_prob <= 1:
        raise UserError(f"{args.mask_prob} is not a probability above 0", "--mask-prob",
                        "give a value in (0, 1], e.g. 0.15")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise UserError(f"no directory for {args.json}", "--json", "create it first")


def check_model(args: argparse.Namespace, info) -> None:
    """The flags against the model kind: --model, BERT's flags on GPT, --stride on BERT."""
    where = f"{'--load' if info.kind == 'ckpt' else '--hf-dir'} {info.path}"
    if args.model and args.model != info.model:
        raise UserError(f"--model {args.model}, but {where} holds a {info.model.upper()} "
                        "model", "--model", f"drop --model (it is detected) or give a "
                        f"{args.model.upper()} model")
    bert_only = [f for f, v in (("--mask-prob", args.mask_prob), ("--seed", args.seed))
                 if v is not None]
    if info.model == "gpt" and bert_only:
        raise UserError(f"{bert_only[0]} is a BERT flag, and {where} holds a GPT model",
                        bert_only[0], "drop it: GPT is scored on every token (perplexity)")
    if info.model == "bert" and args.stride is not None:
        raise UserError(f"{where} holds a BERT model, which reads non-overlapping windows",
                        "--stride", "drop it (--stride is for GPT perplexity)")


def window_sizes(args: argparse.Namespace, info) -> tuple[int, int]:
    """(seq_length, stride), checked against the model's positions."""
    seq = args.seq_length or info.seq_length
    if seq > info.max_positions:
        raise UserError(f"--seq-length {seq} is above the model's {info.max_positions} "
                        "positions", "--seq-length", f"give at most {info.max_positions}")
    if info.model == "bert" and seq < 3:
        raise UserError(f"--seq-length {seq} leaves no room besides [CLS] and [SEP]",
                        "--seq-length", "give at least 3")
    stride = args.stride or seq
    if stride > seq:
        raise UserError(f"--stride {stride} is above --seq-length {seq}: tokens between "
                        "windows would never be scored", "--stride",
                        f"give 1 .. {seq} (smaller: more context per token, slower)")
    return seq, stride


def _tokenizer(args: argparse.Namespace, info):
    """The model's tokenizer with the command line's flags on top; None where GPT reads a
    preprocessed --data-path (no text to tokenize, no special token needed)."""
    from .inputs import build_eval_tokenizer, require_tokenizer

    if args.input is None and info.model == "gpt":
        return None
    given = {k: getattr(args, k) for k in ("tokenizer_type", "vocab_file", "merge_file",
                                          "tokenizer_model")}
    why = "--input" if args.input is not None else "BERT's [CLS], [SEP] and [MASK]"
    return require_tokenizer(build_eval_tokenizer(info.model, info.tokenizer, given), why,
                             f"{'--load' if info.kind == 'ckpt' else '--hf-dir'} {info.path}")


def bert_special_ids(tokenizer, info):
    """BERT's special ids; its random replacements must be rows of the model."""
    from .mlm import SpecialIds

    special = SpecialIds.of(tokenizer)
    if special.vocab_size > info.vocab_rows:
        raise UserError(f"the tokenizer has {special.vocab_size} ids, the model "
                        f"{info.vocab_rows} vocabulary rows", "--vocab-file",
                        "use the model's own tokenizer")
    return special


def read_tokens(args: argparse.Namespace, info, tokenizer):
    """The token stream (int64 tensor) of --data-path or --input, limited by --max-tokens."""
    import torch

    from .inputs import eod_of, read_indexed, read_loose_json

    # GPT: N scored tokens need N + 1 (the first is context only)
    limit = args.max_tokens + (1 if info.model == "gpt" else 0) if args.max_tokens else None
    if args.input is not None:
        eod = eod_of(tokenizer) if info.model == "gpt" else None
        ids = read_loose_json(args.input, args.json_keys, tokenizer, eod, limit)
    else:
        ids = read_indexed(args.data_path, limit)
    return torch.from_numpy(ids)


def check_stream(stream, args: argparse.Namespace, info, seq: int) -> None:
    what = ("--input", args.input) if args.input else ("--data-path", args.data_path)
    need = 2 if info.model == "gpt" else 1
    if len(stream) < need:
        raise UserError(f"{what[1]} holds {len(stream)} tokens: nothing to score", what[0],
                        f"give text of at least {need} tokens (a window is {seq})")
    top = int(stream.max())
    if top >= info.vocab_rows:
        raise UserError(f"token id {top} is outside the model's {info.vocab_rows} vocabulary "
                        f"rows", what[0], "tokenize the data with the model's tokenizer")
    if len(stream) < seq + need - 1:
        logger.warning(f"{what[1]} holds {len(stream)} tokens, less than one window of {seq}")


def _score(args: argparse.Namespace, info, stream, special, seq: int, stride: int):
    """The result of the chosen model's metric, and the scorer's label and source."""
    from .mlm import masked_lm
    from .perplexity import perplexity
    from .sources import open_scorer

    with open_scorer(info, args.weight_version or "newest") as scorer:
        if info.model == "gpt":
            result = perplexity(scorer, stream, seq, stride, args.micro_batch_size,
                                args.max_windows)
        else:
            result = masked_lm(scorer, stream, seq, special,
                               args.mask_prob or DEFAULT_MASK_PROB,
                               DEFAULT_SEED if args.seed is None else args.seed,
                               args.micro_batch_size, args.max_windows)
        return result, scorer.label, scorer.source


def result_line(r: dict) -> str:
    """The one-line result, e.g. `validation perplexity 123.45 (loss 4.8159) over 20480
    tokens in 40 windows of 512, stride 512 [ckpt DIR iteration 300, weight version 300]`."""
    if r["model"] == "gpt":
        head = (f"validation perplexity {r['ppl']:.2f} (loss {r['loss']:.4f}) over "
                f"{r['tokens']} tokens in {r['windows']} windows of {r['seq_length']}, "
                f"stride {r['stride']}")
    else:
        head = (f"validation masked-LM accuracy {r['accuracy']:.4f} (loss {r['loss']:.4f}) "
                f"over {r['masked_tokens']} masked of {r['tokens']} tokens in {r['windows']} "
                f"windows of {r['seq_length']}, mask prob {r['mask_prob']:g}, seed {r['seed']}")
    return f"{head} [{r['label']}]"


def evaluate(args: argparse.Namespace) -> dict:
    """Check the flags, read the data, load the model, score: the result as a dict."""
    from dataclasses import asdict

    from .inputs import check_data_files
    from .sources import describe_checkpoint, describe_hf

    check_flags(args)
    check_data_files(args.data_path, args.input)
    info = describe_checkpoint(args.load) if args.load else describe_hf(args.hf_dir)
    check_model(args, info)
    seq, stride = window_sizes(args, info)
    tokenizer = _tokenizer(args, info)
    special = bert_special_ids(tokenizer, info) if info.model == "bert" else None
    stream = read_tokens(args, info, tokenizer)
    check_stream(stream, args, info, seq)
    start = time.monotonic()
    result, label, source = _score(args, info, stream, special, seq, stride)
    out = {"model": info.model, "metric": "perplexity" if info.model == "gpt" else "masked_lm",
           **asdict(result), "label": label, "source": source,
           "data": {"data_path": args.data_path, "input": args.input},
           "seconds": round(time.monotonic() - start, 3)}
    out["line"] = result_line(out)
    return out


def _result_to_stdout() -> None:
    """The result line goes to stdout (the logs go to stderr), once per process."""
    if not result_logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        result_logger.addHandler(handler)
        result_logger.setLevel(logging.INFO)
        result_logger.propagate = False


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The tool: one process, user errors as one line (the engine's `guarded`)."""
    from ..training.distributed import setup_logging
    from ..training.errors import guarded

    args = build_parser().parse_args(argv)
    setup_logging(0, 1)
    _result_to_stdout()

    def body() -> int:
        out = evaluate(args)
        result_logger.info(out["line"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
        return 0
    return guarded(body)
