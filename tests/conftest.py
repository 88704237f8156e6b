"""Puts tools/ and tools/studies/ on sys.path, as running a script there does, so the
tests import the tool packages `benchmarks` and `planner_validation` and the studies'
modules; and the session's small real corpus.
tests/devices.py, imported first, keeps every test process on the CPU unless the test
asks for CUDA (so the suite runs alike on a GPU machine)."""
import os
import signal
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


@pytest.fixture(autouse=True)
def _sigterm_as_it_was():
    """A test that trains in-process leaves SIGTERM ignored, as the trainer does after a
    run (a late SLURM signal must not end a rank that saved); put back what the next test
    in this worker expects."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    if signal.getsignal(signal.SIGTERM) != before:
        signal.signal(signal.SIGTERM, before)


@pytest.fixture(autouse=True)
def _progress_as_new():
    """The trainer's stop-line state (`signals.PROGRESS`: this rank, its save, its last
    iteration) is per process; a test that ran the trainer in-process as rank 1 must not
    make the next test in this worker speak for rank 1."""
    yield
    from megatron_2bw.training.signals import PROGRESS

    PROGRESS.__init__()


# the longest files first: with `--dist loadfile` each worker takes whole files in this
# order, so these start at once rather than end the run alone on one worker
FIRST = ("test_slurm.py", "test_benchmarks.py", "test_validate_planner.py",
         "test_reliability_stop.py", "test_moe_training.py", "test_examples.py",
         "test_sharded_checkpoint.py", "test_hf_export.py", "test_moe_checkpoints.py",
         "test_delay_compensation.py", "test_megatron_numerics.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(FIRST)))
