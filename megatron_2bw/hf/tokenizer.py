"""The run's tokenizer as Hugging Face tokenizer files, and HF tokenizer files as flags.

Export writes tokenizer files only where `transformers` reproduces the run's token ids:
GPT-2 BPE and BERT WordPiece (tokenizer.json, plus the run's vocab.json + merges.txt or
vocab.txt copied, so that an import gets Megatron's own tokenizer type back) and a
HuggingFaceTokenizer's tokenizer.json or folder. One difference stays: HF treats
"<|endoftext|>" written in the text as the special token, Megatron's GPT2BPETokenizer
splits it like any other text. SentencePiece runs (this project's ids
add Megatron's <EOD>-style tokens) and NullTokenizer / mock-data runs get none, with one
warning: the model directory still loads, the user brings the tokenizer.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Optional

from .architecture import BERT, SpecialTokens

logger = logging.getLogger(__name__)
GPT2_FILES = ("vocab.json", "merges.txt")
BERT_VOCAB = "vocab.txt"
EOD = "<|endoftext|>"


def _existing(path: Optional[str]) -> Optional[str]:
    return path if path and os.path.exists(path) else None


def _gpt2_bpe(args: dict, output: str):
    import transformers

    vocab, merges = _existing(args.get("vocab_file")), _existing(args.get("merge_file"))
    if not (vocab and merges):
        return None
    from tokenizers import models

    ids, pairs = models.BPE.read_file(vocab, merges)
    tok = transformers.GPT2Tokenizer(vocab=ids, merges=pairs, unk_token=EOD, bos_token=EOD,
                                     eos_token=EOD)
    tok.save_pretrained(output)
    for src, name in ((vocab, GPT2_FILES[0]), (merges, GPT2_FILES[1])):
        shutil.copyfile(src, os.path.join(output, name))
    return tok


def _bert_wordpiece(args: dict, output: str):
    import transformers

    vocab = _existing(args.get("vocab_file"))
    if vocab is None:
        return None
    from tokenizers import models

    lower = args.get("tokenizer_type") == "BertWordPieceLowerCase"
    tok = transformers.BertTokenizer(vocab=models.WordPiece.read_file(vocab),
                                     do_lower_case=lower)
    tok.save_pretrained(output)
    shutil.copyfile(vocab, os.path.join(output, BERT_VOCAB))
    return tok


def _huggingface(args: dict, output: str):
    import transformers

    path = _existing(args.get("tokenizer_model"))
    if path is None:
        return None
    tok = (transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
           if os.path.isdir(path) else transformers.PreTrainedTokenizerFast(tokenizer_file=path))
    tok.save_pretrained(output)
    return tok


_EXPORTERS = {"GPT2BPETokenizer": _gpt2_bpe, "BertWordPieceLowerCase": _bert_wordpiece,
              "BertWordPieceCase": _bert_wordpiece, "HuggingFaceTokenizer": _huggingface}


def _special(tok) -> SpecialTokens:
    eod = tok.convert_tokens_to_ids(EOD) if EOD in tok.get_vocab() else None
    return SpecialTokens(bos=tok.bos_token_id if tok.bos_token_id is not None else eod,
                         eos=tok.eos_token_id if tok.eos_token_id is not None else eod,
                         pad=tok.pad_token_id)


def export_tokenizer(args: dict, output: str) -> SpecialTokens:
    """Write the run's tokenizer into `output` where HF can reproduce its ids; the
    special token ids the model config names."""
    kind = args.get("tokenizer_type")
    exporter = _EXPORTERS.get(kind)
    tok = exporter(args, output) if exporter else None
    if tok is None:
        why = (f"its files ({args.get('vocab_file') or args.get('tokenizer_model')}) are not "
               "found from here" if exporter else "Hugging Face has no tokenizer with the "
               "same ids" if kind else "the run used mock data and no tokenizer")
        logger.warning(f"no tokenizer files written for --tokenizer-type {kind}: {why}; "
                       "the model loads without them")
        return SpecialTokens()
    logger.info(f"tokenizer written ({kind} as {type(tok).__name__})")
    return _special(tok)


def tokenizer_flags(hf_dir: str, family: str) -> Optional[list[str]]:
    """The pretrain tokenizer flags that give the ids of the tokenizer files in `hf_dir`,
    Megatron's own type where there is one; None when there are no tokenizer files."""
    def at(name: str) -> str:
        return os.path.join(os.path.abspath(hf_dir), name)

    if all(os.path.exists(at(n)) for n in GPT2_FILES) and family != BERT:
        return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", at(GPT2_FILES[0]),
                "--merge-file", at(GPT2_FILES[1])]
    if family == BERT and os.path.exists(at(BERT_VOCAB)):
        lower = True
        if os.path.exists(at("tokenizer_config.json")):
            with open(at("tokenizer_config.json")) as f:
                lower = json.load(f).get("do_lower_case", True)
        kind = "BertWordPieceLowerCase" if lower else "BertWordPieceCase"
        return ["--tokenizer-type", kind, "--vocab-file", at(BERT_VOCAB)]
    if os.path.exists(at("tokenizer.json")):
        return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                os.path.abspath(hf_dir)]
    return None
