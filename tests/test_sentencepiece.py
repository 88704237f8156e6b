"""SentencePiece tokenizers (SentencePieceTokenizer, Llama2Tokenizer): byte parity of
tools/preprocess_data.py with Megatron-LM's (core_v0.16.1), their ids, errors, and the
training path.

The reference re-does Megatron-LM's preprocessing from its algorithm with ``sentencepiece``
and megatron-core's ``IndexedDatasetBuilder``, importing nothing from megatron_2bw (the punkt
helpers come from tests/test_preprocess_parity.py, which documents them):

- by default Megatron-LM's tool builds megatron-core's tokenizer, whose SentencePiece wrapper
  (non-legacy) gives ``encode_as_ids(text)`` for all three SentencePiece types, EOD the model's
  ``eos_id``, the dtype from the model's piece count;
- ``--legacy-tokenizer`` builds ``megatron/training/tokenizer/tokenizer.py``'s classes:
  Llama2Tokenizer puts the model's BOS before every text (EOD: eos); SentencePieceTokenizer
  adds ``<CLS> <SEP> <EOD> <MASK>`` and the pad/bos/eos pieces (``<PAD>``/``<BOS>``/``<EOS>``
  when the model has none) after the pieces, matches them verbatim in the text (the earliest
  match first) and ends documents with ``<EOD>``; its dtype comes from that larger vocabulary.
  The tool sets ``--vocab-extra-ids`` to 0.

The model is trained here (byte-fallback BPE, as Llama's; a few hundred lines, milliseconds);
nothing is downloaded.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from megatron_2bw.data.preprocess import PreprocessConfig, PreprocessError, preprocess
from megatron_2bw.data.tokenizers import (TokenizerError, build_tokenizer, check_bert_tokens,
                                          padded_vocab_size)
from tests.test_preprocess_parity import (PARITY_DOCS, _bytes, _load_tool,  # noqa: F401
                                          megatron_nltk, megatron_split_line, megatron_splitter,
                                          nltk_data)

SP_DOCS = PARITY_DOCS + [
    "Typed specials stay text by default: <EOD> then <s> and </s>, <MASK><CLS> x<SEP>y <unk>.",
    "Outside the training text: Ω and 🙂 fall back to bytes.",
]
KEYS = ("text", "title")


# --------------------------------------------------------------------------- the reference


def legacy_sentencepiece_vocab(sp) -> Tuple[Dict[str, int], Dict[str, int]]:
    """Megatron-LM's legacy SentencePieceTokenizer vocabulary (--vocab-extra-ids 0): the
    pieces, then each special token not among them; and its special tokens in match order."""
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    names = ["<CLS>", "<SEP>", "<EOD>", "<MASK>"]
    for piece_id, fallback in ((sp.pad_id(), "<PAD>"), (sp.bos_id(), "<BOS>"),
                               (sp.eos_id(), "<EOS>")):
        names.append(sp.id_to_piece(piece_id) if 0 <= piece_id < sp.get_piece_size()
                     else fallback)
    specials = {}
    for name in names:
        specials[name] = vocab.setdefault(name, len(vocab))
    return vocab, specials


def legacy_sentencepiece_ids(sp, specials: Dict[str, int], text: str) -> List[int]:
    """Its tokenize: text up to the earliest special token (the first listed on a tie) is
    encoded by the model, the token becomes its id, and the scan goes on after it."""
    ids: List[int] = []
    pos = 0
    while True:
        found = [(text.find(t, pos), order, t) for order, t in enumerate(specials)
                 if text.find(t, pos) >= 0]
        if not found:
            return ids + sp.encode_as_ids(text[pos:])
        at, _, token = min(found)
        ids += sp.encode_as_ids(text[pos:at]) + [specials[token]]
        pos = at + len(token)


def megatron_sp_reference(input_path: Path, prefix: str, model: Path, tokenizer_type: str, *,
                          legacy: bool, append_eod: bool, split: bool = False,
                          keep_newlines: bool = False) -> str:
    """Megatron-LM's tools/preprocess_data.py for a SentencePiece type; returns the level."""
    import sentencepiece
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
    vocab, specials = legacy_sentencepiece_vocab(sp)
    legacy_sp = legacy and tokenizer_type == "SentencePieceTokenizer"
    if legacy_sp:
        tokenize, eod, size = (lambda t: legacy_sentencepiece_ids(sp, specials, t),
                               specials["<EOD>"], len(vocab))
    elif legacy and tokenizer_type == "Llama2Tokenizer":
        tokenize, eod, size = lambda t: [sp.bos_id()] + sp.encode(t), sp.eos_id(), len(sp)
    else:  # megatron-core's wrapper, or the legacy GPTSentencePieceTokenizer (the same)
        tokenize, eod, size = sp.encode_as_ids, sp.eos_id(), sp.get_piece_size()
    lines = input_path.read_text(encoding="utf-8").splitlines(keepends=True)
    if split:
        splitter = megatron_splitter(keep_newlines)
        lines = [megatron_split_line(line, splitter, list(KEYS)) + "\n" for line in lines]
    level = "sentence" if split else "document"
    builders = {k: IndexedDatasetBuilder(f"{prefix}_{k}_{level}.bin",
                                         dtype=DType.optimal_dtype(size)) for k in KEYS}
    for line in lines:
        data = json.loads(line)
        for key in KEYS:
            ids, lengths = [], []
            for sentence in data[key] if isinstance(data[key], list) else [data[key]]:
                sentence_ids = tokenize(sentence)
                if sentence_ids:
                    ids += sentence_ids
                    lengths.append(len(sentence_ids))
            if ids and append_eod:
                ids.append(eod)
                lengths[-1] += 1
            builders[key].add_document(ids, lengths)
    for key, builder in builders.items():
        builder.finalize(f"{prefix}_{key}_{level}.idx")
    return level


# --------------------------------------------------------------------------- fixtures


def train_model(folder: Path, name: str, **options) -> Path:
    """A byte-fallback BPE model (Llama's kind: unk 0, bos 1, eos 2, no pad) trained on 300
    generated lines and the parity corpus's lines."""
    import sentencepiece

    rng = random.Random(0)
    words = ("the stage sends its activation to the next one and waits for a gradient "
             "while another minibatch runs").split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))) for _ in range(300)]
    lines += [line for doc in PARITY_DOCS for line in doc.splitlines() if line.strip()]
    text = folder / f"{name}.txt"
    text.write_text("\n".join(lines), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(folder / name), vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, hard_vocab_limit=False, minloglevel=2,
        num_threads=1, **options)
    return folder / f"{name}.model"


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    return train_model(tmp_path_factory.mktemp("sp"), "llama_like")


@pytest.fixture(scope="module")
def sp_corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sp_corpus") / "corpus.jsonl"
    lines = [json.dumps({"text": d, "title": d[:20]}, ensure_ascii=False) for d in SP_DOCS]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _ours(corpus: Path, prefix: Path, model: Path, tokenizer_type: str, legacy: bool,
          keys=KEYS, **options) -> Dict[str, str]:
    from megatron_2bw.data.tokenizers import TokenizerSpec

    spec = TokenizerSpec(tokenizer_type, tokenizer_model=str(model), legacy_tokenizer=legacy)
    return preprocess(PreprocessConfig(input=str(corpus), output_prefix=str(prefix),
                                       tokenizer=spec, json_keys=keys, **options)).prefixes


def _documents(prefix: str) -> List[List[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = IndexedDataset(prefix)
    bounds = data.document_indices
    return [[t for i in range(bounds[d], bounds[d + 1]) for t in data[i].tolist()]
            for d in range(len(bounds) - 1)]


# --------------------------------------------------------------------------- parity


CASES = {  # tokenizer type, --legacy-tokenizer, --split-sentences
    "llama2": ("Llama2Tokenizer", False, False),
    "llama2-legacy-sentences": ("Llama2Tokenizer", True, True),
    "sentencepiece": ("SentencePieceTokenizer", False, False),
    "sentencepiece-legacy": ("SentencePieceTokenizer", True, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bytes_match_megatron(case, tmp_path, sp_corpus, sp_model, megatron_nltk):
    """--append-eod throughout; the legacy Llama2 case splits sentences (a BOS each)."""
    tokenizer_type, legacy, split = CASES[case]
    ours = _ours(sp_corpus, tmp_path / "ours", sp_model, tokenizer_type, legacy,
                 append_eod=True, split_sentences=split, sentence_splitter="nltk")
    level = megatron_sp_reference(sp_corpus, str(tmp_path / "ref"), sp_model, tokenizer_type,
                                  legacy=legacy, append_eod=True, split=split)
    for key in KEYS:
        assert _bytes(ours[key]) == _bytes(str(tmp_path / f"ref_{key}_{level}")), key


def test_cli_llama2_legacy_append_eod_matches_megatron(tmp_path, sp_corpus, sp_model):
    """The flags as typed, through tools/preprocess_data.py's main; every document is
    BOS ... EOS, an empty text BOS EOS, and the default (no flag) has no BOS."""
    import sentencepiece

    status = _load_tool().main([
        "--input", str(sp_corpus), "--output-prefix", str(tmp_path / "cli"), "--json-keys",
        *KEYS, "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", str(sp_model),
        "--legacy-tokenizer", "--append-eod"])
    assert status == 0
    megatron_sp_reference(sp_corpus, str(tmp_path / "ref"), sp_model, "Llama2Tokenizer",
                          legacy=True, append_eod=True)
    for key in KEYS:
        assert _bytes(str(tmp_path / f"cli_{key}_document")) == \
            _bytes(str(tmp_path / f"ref_{key}_document"))
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    docs = _documents(str(tmp_path / "cli_text_document"))
    assert all(d[0] == sp.bos_id() and d[-1] == sp.eos_id() for d in docs)
    assert docs[SP_DOCS.index("")] == [sp.bos_id(), sp.eos_id()]
    default = _ours(sp_corpus, tmp_path / "default", sp_model, "Llama2Tokenizer", False,
                    append_eod=True)
    bos_eos = [sp.bos_id(), sp.eos_id()]  # an empty text: nothing by default, no EOD
    assert [d[1:] if d != bos_eos else [] for d in docs] == _documents(default["text"])


def test_legacy_and_default_sentencepiece_differ(tmp_path, sp_corpus, sp_model):
    """The comparison can fail: legacy SentencePieceTokenizer turns the typed <EOD> into the
    EOD id and its dtype bound is the larger vocabulary, the default keeps it as text."""
    legacy = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(sp_model),
                             legacy_tokenizer=True)
    default = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(sp_model))
    typed = SP_DOCS[-2]
    assert legacy.tokenize(typed).count(legacy.eod) == 1
    assert legacy.eod not in default.tokenize(typed) and default.eod == 2
    assert [legacy.inv_vocab[i] for i in legacy.tokenize("<MASK><CLS>")] == ["<MASK>", "<CLS>"]
    assert legacy.detokenize(legacy.tokenize("a<SEP>b")) == "a <SEP> b"
    ours = _ours(sp_corpus, tmp_path / "legacy", sp_model, "SentencePieceTokenizer", True,
                 append_eod=True)
    megatron_sp_reference(sp_corpus, str(tmp_path / "ref"), sp_model, "SentencePieceTokenizer",
                          legacy=False, append_eod=True)
    assert _bytes(ours["text"]) != _bytes(str(tmp_path / "ref_text_document"))


# --------------------------------------------------------------------------- ids and sizes


def test_llama2_tokenizer_ids(sp_model):
    """Legacy: BOS first, no EOS added, EOD = eos, no pad (megatron-core then pads with -1);
    default: the model's ids; both: the vocabulary is the model's pieces."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    legacy = build_tokenizer("Llama2Tokenizer", tokenizer_model=str(sp_model),
                             legacy_tokenizer=True)
    default = build_tokenizer("Llama2Tokenizer", tokenizer_model=str(sp_model))
    text = "the stage waits, naïve Ω"
    assert legacy.tokenize(text) == [sp.bos_id()] + sp.encode(text)
    assert default.tokenize(text) == sp.encode(text)
    assert legacy.vocab_size == default.vocab_size == default.dtype_vocab_size == len(sp)
    assert legacy.eod == legacy.eos == default.eod == sp.eos_id() == 2
    assert legacy.bos == 1 and legacy.cls == legacy.sep == legacy.mask == -1
    with pytest.raises(NotImplementedError):
        legacy.pad
    assert default.pad == -1
    assert legacy.detokenize(legacy.tokenize(text)) == text  # byte fallback: lossless
    assert padded_vocab_size(legacy.vocab_size, 128, 2) == 512


def test_sentencepiece_sizes_and_extra_ids(sp_model):
    """Training pads from the legacy size (pieces + <CLS> <SEP> <EOD> <MASK> <PAD> + extra
    ids) with or without --legacy-tokenizer; the default's output dtype from the pieces;
    preprocessing drops --vocab-extra-ids, as Megatron-LM's tool."""
    pieces = 400
    default = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(sp_model),
                              vocab_extra_ids=3)
    legacy = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(sp_model),
                             vocab_extra_ids=3, legacy_tokenizer=True)
    assert default.vocab_size == legacy.vocab_size == pieces + 5 + 3
    assert default.dtype_vocab_size == pieces and legacy.dtype_vocab_size == pieces + 8
    assert legacy.additional_special_tokens_ids == [405, 406, 407]
    assert (legacy.cls, legacy.sep, legacy.eod, legacy.mask, legacy.pad) == (400, 401, 402,
                                                                           403, 404)
    assert (legacy.bos, legacy.eos) == (1, 2)  # the model's <s> and </s>
    tool = _load_tool()
    args = tool.parse_args(["--input", "x", "--output-prefix", "y", "--tokenizer-type",
                            "SentencePieceTokenizer", "--tokenizer-model", str(sp_model),
                            "--vocab-extra-ids", "3"])
    assert tool.to_config(args).tokenizer.vocab_extra_ids == 0


# --------------------------------------------------------------------------- errors


def test_tokenizer_model_errors_name_flag_and_file(tmp_path, sp_model, capsys):
    for kind in ("Llama2Tokenizer", "SentencePieceTokenizer"):
        with pytest.raises(TokenizerError, match=f"--tokenizer-model is required for "
                           f"--tokenizer-type {kind}"):
            build_tokenizer(kind)
    not_model = tmp_path / "tokenizer.json"
    not_model.write_text("{}")
    cases = {str(tmp_path / "none.model"): "no such file",
             str(tmp_path): "a folder; --tokenizer-type Llama2Tokenizer takes the file itself",
             str(not_model): "not a SentencePiece model, .*HuggingFaceTokenizer"}
    for path, why in cases.items():
        with pytest.raises(TokenizerError, match=f"^--tokenizer-model {path}: {why}"):
            build_tokenizer("Llama2Tokenizer", tokenizer_model=path)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "hi"}\n')
    status = _load_tool().main(["--input", str(corpus), "--output-prefix", str(tmp_path / "o"),
                                "--tokenizer-type", "SentencePieceTokenizer",
                                "--tokenizer-model", str(not_model)])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and err[-1].startswith(f"error: --tokenizer-model {not_model}: not a")
    assert not list(tmp_path.glob("o_*"))


def test_models_without_bos_or_eos_fail_in_one_line(tmp_path):
    """Legacy Llama2Tokenizer needs a BOS, --append-eod an EOS: one error before any line."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "the stage", "title": "t"}\n')
    no_bos = train_model(tmp_path, "no_bos", bos_id=-1)
    no_eos = train_model(tmp_path, "no_eos", eos_id=-1)
    with pytest.raises(TokenizerError, match=f"--tokenizer-model {no_bos}: Llama2Tokenizer "
                       "with --legacy-tokenizer .* has none"):
        _ours(corpus, tmp_path / "a", no_bos, "Llama2Tokenizer", True)
    with pytest.raises(PreprocessError, match="--append-eod: Llama2Tokenizer has no "
                       "end-of-document token"):
        _ours(corpus, tmp_path / "b", no_eos, "Llama2Tokenizer", False, append_eod=True)
    assert _ours(corpus, tmp_path / "c", no_bos, "Llama2Tokenizer", False)  # default: fine


# --------------------------------------------------------------------------- training


def _training_args(model: str, *extra: str):
    from megatron_2bw.training.arguments import parse_args

    return parse_args(model, [
        "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--train-iters", "2", "--eval-iters", "1", "--eval-interval", "2", "--lr", "1e-3",
        "--split", "90,10,0", *extra])


def test_training_path_reads_llama2_data(tmp_path, sp_model):
    """pretrain_gpt.py's path with Megatron-LM's Llama2 flags: the padded vocabulary is the
    pieces padded to 128, the data's EOD is the model's eos and --eod-mask-loss masks it."""
    from megatron_2bw.training.arguments import config_from_args
    from megatron_2bw.training.data_sources import data_sources, tokenizer_from_args

    corpus = tmp_path / "docs.jsonl"
    rng = random.Random(1)
    words = "the stage sends its activation to the next one".split()
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=8))}) + "\n"
                              for _ in range(60)))
    prefix = _load_tool().main(["--input", str(corpus), "--output-prefix", str(tmp_path / "d"),
                                "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
                                str(sp_model), "--legacy-tokenizer", "--append-eod"])
    assert prefix == 0
    args = _training_args("gpt", "--data-path", str(tmp_path / "d_text_document"),
                          "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
                          str(sp_model), "--legacy-tokenizer", "--eod-mask-loss")
    tokenizer = tokenizer_from_args(args, "gpt")
    run = config_from_args(args, "gpt", world_size=1, vocab_size=tokenizer.vocab_size)
    assert run.model.vocab_size == 512
    sample = data_sources(run, tokenizer).train[0]
    tokens, mask = sample["tokens"], sample["loss_mask"]
    assert (tokens == 1).any() and (tokens == 2).any()  # BOS, and EOD (= eos)
    assert (mask[tokens == 2] == 0).all() and (mask[tokens != 2] == 1).all()


def test_bert_needs_legacy_sentencepiece(sp_model):
    """Megatron-LM's default SentencePiece tokenizer has no CLS/SEP/MASK: BERT says so up
    front; --legacy-tokenizer gives them."""
    from megatron_2bw.training.data_sources import tokenizer_from_args

    flags = ("--data-path", "unused", "--tokenizer-type", "SentencePieceTokenizer",
             "--tokenizer-model", str(sp_model))
    with pytest.raises(TokenizerError, match="^pretrain_bert.py: SentencePieceTokenizer has "
                       "no cls token without --legacy-tokenizer"):
        tokenizer_from_args(_training_args("bert", *flags), "bert")
    tokenizer = tokenizer_from_args(_training_args("bert", *flags, "--legacy-tokenizer"), "bert")
    check_bert_tokens(tokenizer)
    assert tokenizer.cls == 400
