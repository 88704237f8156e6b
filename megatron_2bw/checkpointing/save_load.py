"""Saving and resuming a run: the names the rest of the package imports, in one place.

Each concern has its module:

- `saving.py`: `save_checkpoint` in either format; every rank agrees on a failed save;
- `reading.py`: `read_checkpoint`, the verified iteration, and `LoadedCheckpoint`, whose
  `load_tensors` checks every tensor's shape and reads torch_dist's, resharded;
- `resume.py`: what a resume refuses before any work (LR schedule, --train-iters, model
  shapes, vocabulary, --save over checkpoints) and what it notes (data order, another
  pipeline schedule);
- `restoring.py`: `restore`, the weight versions, optimizer and RNG state put back;
- `ranks.py`: this rank's file name, agreement on a failure, warnings given once.

All of them reach the runtime and the optimizer only through their checkpoint contracts
(runtime/checkpoint.py, optim/checkpoint.py).
"""
from __future__ import annotations

from .files import TRACKER, CheckpointError
from .ranks import FILE_NAME, checkpoint_file, rank_file
from .reading import LoadedCheckpoint, read_checkpoint
from .restoring import restore
from .resume import (check_shapes, check_vocabulary, continuation_line, group_mismatches,
                     note_data_order, prepare_resume, schedule_mismatches,
                     scheduler_source)
from .saving import SaveOptions, save_checkpoint

__all__ = ["FILE_NAME", "TRACKER", "CheckpointError", "LoadedCheckpoint", "SaveOptions",
           "check_shapes", "check_vocabulary", "checkpoint_file", "continuation_line",
           "group_mismatches", "note_data_order", "prepare_resume", "rank_file",
           "read_checkpoint", "restore", "save_checkpoint", "schedule_mismatches",
           "scheduler_source"]
