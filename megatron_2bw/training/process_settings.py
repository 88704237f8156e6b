"""Megatron-LM's flags that set something for the whole process, not for the model.

- `--logging-level N`: Megatron-LM sets Python's root logging level to N (or to the
  environment's MEGATRON_LOGGING_LEVEL, the flag winning). What that level governs there
  is the libraries' `logging` output (megatron-core's own above all); Megatron-LM's log
  lines (iterations, validation, checkpoints) are prints, untouched by it. Here the
  trainer's lines go through `logging`, so the root level stays the trainer's (INFO on
  the logging rank, distributed.setup_logging) and N becomes the level of the library
  loggers setup_logging otherwise holds at WARNING (`megatron`, `torch`), on every rank.
- `--disable-bf16-reduced-precision-matmul`: with --bf16, cuBLAS may not reduce bf16
  matrix products in reduced precision (what megatron-core's TransformerConfig sets).
- `--enable-experimental`: megatron-core's switch for its experimental code paths.
"""
from __future__ import annotations

import argparse
import logging
import os
from typing import Optional

import torch

from .errors import UserError

LOGGING_ENV = "MEGATRON_LOGGING_LEVEL"
LIBRARY_LOGGERS = ("megatron", "torch")


def add_process_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("process settings (Megatron-LM's)")
    g.add_argument("--logging-level", type=int,
                   help=f"Python logging level of megatron-core's and torch's loggers on "
                        f"every rank (10 DEBUG ... 50 CRITICAL; default: WARNING, or "
                        f"{LOGGING_ENV}); the trainer's own lines are always printed, as "
                        "Megatron-LM's are")
    g.add_argument("--disable-bf16-reduced-precision-matmul", action="store_true",
                   help="with --bf16: no reduced-precision reductions in cuBLAS's bf16 "
                        "matrix products (torch.backends.cuda.matmul."
                        "allow_bf16_reduced_precision_reduction = False)")
    g.add_argument("--enable-experimental", action="store_true",
                   help="turn on megatron-core's experimental code paths "
                        "(megatron.core.config.set_experimental_flag)")


def logging_level(args: argparse.Namespace) -> Optional[int]:
    """--logging-level, else MEGATRON_LOGGING_LEVEL, else None (Megatron-LM's order); a
    variable that is not an integer is named in one line."""
    if args.logging_level is not None:
        return args.logging_level
    value = os.environ.get(LOGGING_ENV)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{LOGGING_ENV}={value!r} is not a logging level", LOGGING_ENV,
                        "give an integer such as 20 (INFO) or 40 (ERROR), or unset it") from None


def apply_process_settings(args: argparse.Namespace) -> None:
    """Set what the three flags ask for in this process (after setup_logging)."""
    level = logging_level(args)
    if level is not None:
        for name in LIBRARY_LOGGERS:
            logging.getLogger(name).setLevel(level)
    if args.bf16 and args.disable_bf16_reduced_precision_matmul:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    if args.enable_experimental:
        from megatron.core.config import set_experimental_flag
        set_experimental_flag(True)
