"""Puts tools/ and tools/studies/ on sys.path, as running a script there does, so the
tests import the tool packages `benchmarks` and `planner_validation` and the studies'
modules; and the session's small real corpus.
tests/devices.py, imported first, keeps every test process on the CPU unless the test
asks for CUDA (so the suite runs alike on a GPU machine)."""
import os
import sys

import pytest

import tests.devices  # noqa: F401  (before any test starts a process)

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
for folder in (TOOLS, os.path.join(TOOLS, "studies")):
    if folder not in sys.path:
        sys.path.insert(0, folder)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """The embedded corpus, small (300k characters, 512-token vocabularies), built once per
    session through the preprocessing tools: real documents, so real end-of-document
    tokens and real BERT masking."""
    from megatron_2bw.data.default_data import CorpusSpec, ensure_default_data
    spec = CorpusSpec(max_chars=300_000, gpt_vocab_size=512, bert_vocab_size=512)
    return ensure_default_data(str(tmp_path_factory.mktemp("data")), spec, workers=1)
