"""No silent minutes: a validation that takes long says how far it is.

Megatron-LM's final evaluation prints `Evaluating on N samples` and then `Evaluating iter
i/N` before each of its --eval-iters batches. Here every validation is one forward-only
schedule over all its microbatches, so nothing is printed until its loss; with a large
--micro-batch-size or --eval-iters the validation after training sat silent for minutes
(82 s on this machine for 100 batches of 256 x 256 tokens), which reads as a hang. The
evaluation's data passes through `evaluation_progress`, which prints Megatron-LM's lines,
on the logging rank, once the validation has been quiet for QUIET_S: a short validation
logs nothing more than before.
"""
from __future__ import annotations

import logging
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")
logger = logging.getLogger("megatron_2bw.train")
QUIET_S = 5.0  # seconds without a line before a validation reports its progress


def evaluation_progress(batches: Iterable[T], per_iteration: int, iterations: int,
                        samples_per_iteration: int, quiet_s: float = QUIET_S) -> Iterator[T]:
    """`batches` unchanged; `Evaluating iter i/N` (i the evaluation batch the microbatch
    starts) at most every `quiet_s` seconds once the first `quiet_s` have passed."""
    last = time.monotonic()
    announced = False
    for index, batch in enumerate(batches):
        if index and index % per_iteration == 0 and time.monotonic() - last >= quiet_s:
            if not announced:
                logger.info(f"Evaluating on {iterations * samples_per_iteration} samples")
                announced = True
            logger.info(f"Evaluating iter {index // per_iteration + 1}/{iterations}")
            last = time.monotonic()
        yield batch
