"""Loose JSON -> Megatron .bin/.idx with Megatron-LM's flags (logic: megatron_2bw.data.preprocess).

    python tools/preprocess_data.py --input openwebtext.jsonl --output-prefix data/owt \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt --append-eod --workers 8

writes data/owt_text_document.bin/.idx (``--data-path data/owt_text_document``). Exit status 1
with a one-line message on stderr for bad flags, a missing/empty input, a vocabulary too large
for the output dtype, or a malformed line (which includes a token id outside the tokenizer's
vocabulary or the output dtype: ``FILE:LINE: malformed line, key 'text': token id ...``), a
line with bytes that are not UTF-8 (``FILE:LINE: 2 bytes that are not UTF-8 ...``; or
``--invalid-utf8 replace|skip``, this project's flag), and
for output that cannot be written (a read-only or full filesystem): nothing is left behind,
and an earlier output at the prefix stays as it was.
"""
from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
from typing import List, Optional

from megatron_2bw.data.preprocess import (INVALID_UTF8_CHOICES, ON_ERROR_CHOICES,
                                          PreprocessConfig, PreprocessError, check_input,
                                          preprocess)
from megatron_2bw.data.sentences import SPLITTERS
from megatron_2bw.data.tokenizers import TOKENIZER_TYPES, TokenizerError, TokenizerSpec


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="loose JSON file, one object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to extract from each object, one output per key")
    group.add_argument("--split-sentences", action="store_true",
                       help="one sequence per sentence (for BERT)")
    group.add_argument("--keep-newlines", action="store_true",
                       help="keep newlines between sentences when splitting")
    group.add_argument("--sentence-splitter", choices=SPLITTERS,
                       help="nltk: punkt, English (Megatron-LM's sentences); auto (default): "
                       "punkt, else rule-based with a warning; simple: rule-based")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", help="GPT-2 vocab.json or BERT vocab.txt")
    group.add_argument("--merge-file", help="GPT-2 merges.txt")
    group.add_argument("--tokenizer-model", help="SentencePiece .model or HF tokenizer.json/dir")
    group.add_argument("--vocab-size", type=int, help="NullTokenizer vocabulary size")
    group.add_argument("--vocab-extra-ids", type=int, default=0,
                       help="accepted and not used: Megatron-LM's tool sets it to 0")
    group.add_argument("--legacy-tokenizer", action="store_true",
                       help="Megatron-LM's legacy tokenizer classes: SentencePieceTokenizer "
                       "with <CLS>/<SEP>/<EOD>/<MASK> (EOD <EOD>), Llama2Tokenizer with a BOS "
                       "before every text, HuggingFaceTokenizer with its template's tokens; "
                       "off by default, as there")
    group.add_argument("--tokenizer-hf-include-special-tokens", action="store_true",
                       help="HuggingFaceTokenizer: add the template's special tokens (e.g. BOS) "
                       "to every text, as Megatron-LM with this flag; off by default, as there")
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document token to every document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="path prefix; _{key}_document.bin/.idx is appended")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="documents between progress lines")
    group.add_argument("--on-error", choices=ON_ERROR_CHOICES, default="fail",
                       help="malformed line: fail (default) or skip and report it")
    group.add_argument("--invalid-utf8", choices=INVALID_UTF8_CHOICES, default="error",
                       help="a line with bytes that are not UTF-8: error (default: stop, "
                       "naming FILE:LINE), replace (U+FFFD for each such byte) or skip (leave "
                       "the line out); the lines are reported. This project's flag: "
                       "Megatron-LM's tool has none and stops with a UnicodeDecodeError")
    return parser.parse_args(argv)


def to_config(args: argparse.Namespace) -> PreprocessConfig:
    if args.vocab_extra_ids:
        # Megatron-LM's tool overrides the flag with 0: <extra_id_N> in a text stays text
        logging.getLogger(__name__).warning(
            "--vocab-extra-ids %d is not used for preprocessing (Megatron-LM's "
            "tools/preprocess_data.py sets it to 0); give it to training", args.vocab_extra_ids)
    tokenizer = TokenizerSpec(args.tokenizer_type, args.vocab_file, args.merge_file,
                              args.tokenizer_model, args.vocab_size, 0,
                              args.tokenizer_hf_include_special_tokens, args.legacy_tokenizer)
    return PreprocessConfig(
        input=args.input, output_prefix=args.output_prefix, tokenizer=tokenizer,
        json_keys=tuple(args.json_keys), append_eod=args.append_eod,
        split_sentences=args.split_sentences, keep_newlines=args.keep_newlines,
        sentence_splitter=args.sentence_splitter or "auto", workers=args.workers,
        log_interval=args.log_interval, on_error=args.on_error,
        invalid_utf8=args.invalid_utf8)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl-C so that the partial output is removed."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum: int, frame) -> None:
    raise Stopped(signum)


def main(argv: Optional[List[str]] = None) -> int:
    """The tool; SIGTERM and SIGHUP stop it like Ctrl-C while it runs, and the caller's
    handlers come back after (a test or a script may call main in its own process)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(argv)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    for sig, handler in previous.items():
        if handler == signal.SIG_DFL:
            signal.signal(sig, _stop)
    try:
        return _run(args)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(args) -> int:
    try:
        config = to_config(args)
        for note in unused_flags(args):
            logging.getLogger(__name__).warning(note)
        check_input(config.input)  # before megatron-core is imported: fast, clear failure
        result = preprocess(config)
    except (PreprocessError, TokenizerError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM / SIGHUP (Stopped)
        signum = getattr(err, "signum", signal.SIGINT)
        name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"stopped: {name} while preprocessing {args.input}; nothing was written (the "
              "partial output is removed; an earlier output at --output-prefix is unchanged)",
              file=sys.stderr)
        return 128 + signum
    except OSError as err:
        if err.filename and os.path.abspath(err.filename) == os.path.abspath(args.input):
            print(f"error: {err.strerror} ({err.filename}) (--input)", file=sys.stderr)
        else:
            print(f"error: {output_error(err, args.output_prefix)}", file=sys.stderr)
        return 1
    for key, prefix in result.prefixes.items():
        print(f"{key}: {prefix}.bin/.idx  {result.documents} documents, "
              f"{result.tokens[key]} tokens, {result.sequences[key]} sequences")
    if result.bad_lines:
        print(f"skipped {len(result.bad_lines)} malformed lines", file=sys.stderr)
    if result.not_utf8:
        lines = f"{len(result.not_utf8)} line{'s' if len(result.not_utf8) > 1 else ''}"
        done = (f"replaced the bytes that are not UTF-8 with U+FFFD on {lines}"
                if args.invalid_utf8 == "replace" else f"skipped {lines} that are not UTF-8")
        print(f"{done} (--invalid-utf8 {args.invalid_utf8})", file=sys.stderr)
    return 0


def unused_flags(args: argparse.Namespace) -> List[str]:
    """A line for each flag given where it does nothing (accepted, so that Megatron-LM's
    command lines run, but not dropped without a word)."""
    if args.split_sentences:
        return []
    given = [flag for flag, on in (("--keep-newlines", args.keep_newlines),
                                   (f"--sentence-splitter {args.sentence_splitter}",
                                    args.sentence_splitter)) if on]
    return [f"{flag} has no effect without --split-sentences: each document is tokenized "
            "whole, its newlines included" for flag in given]


def output_error(err: OSError, prefix: str) -> str:
    """One line for output that cannot be written: what, which file, what would work."""
    path = (err.filename or prefix).removesuffix(".tmp")  # the file it was writing
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        what, fix = "the disk is full", "free space or choose another --output-prefix"
    elif err.errno == errno.EFBIG:
        what, fix = ("the file size limit (ulimit -f) is reached",
                     "raise the limit or choose another --output-prefix")
    else:
        what, fix = err.strerror or str(err), "choose a writable --output-prefix"
    return (f"cannot write the output: {what} ({path}) (--output-prefix); {fix} (nothing "
            "was written; an earlier output at this prefix is unchanged)")


if __name__ == "__main__":
    sys.exit(main())
