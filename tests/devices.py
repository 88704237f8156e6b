"""Which device each test's processes get, so the suite runs alike on a GPU machine.

Imported first by conftest.py: it notes whether CUDA is there, then hides it from every
process the tests start (CUDA_VISIBLE_DEVICES=""). Why:
- the suite's equality tests compare CPU runs over gloo; a rank that found a GPU would
  take NCCL and CUDA arithmetic, and on a one-GPU machine a second rank would find no
  device of its own;
- the test zygote forks its ranks; CUDA cannot be used in a child forked after the
  parent initialised it, and a zygote that never sees CUDA never initialises it.
A test that wants the GPU says so (`entry_harness.launch(..., device="cuda")`): its ranks
start fresh under torchrun with the original CUDA_VISIBLE_DEVICES (`cuda_env()`).
"""
from __future__ import annotations

import os

import pytest
import torch

_HIDE = "CUDA_VISIBLE_DEVICES"
_ORIGINAL = os.environ.get(_HIDE)
CUDA = torch.cuda.is_available()  # before hiding: the runtime counts devices once
CUDA_DEVICES = torch.cuda.device_count() if CUDA else 0
os.environ[_HIDE] = ""

needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def cuda_env() -> dict:
    """The environment a CUDA test's processes get: the machine's devices visible."""
    env = dict(os.environ)
    if _ORIGINAL is None:
        env.pop(_HIDE, None)
    else:
        env[_HIDE] = _ORIGINAL
    return env
