"""What `pretrain_gpt.py` and `pretrain_bert.py` run: flags -> configs -> pretrain.

All of it runs inside `errors.guarded`: a user error anywhere (flags, output paths, data,
a checkpoint that does not fit the run) ends every rank with one `error:` line and exit
status 2, also when only one rank found it; a stop signal (Ctrl-C, SIGTERM without
--exit-signal-handler, SIGHUP) with one `stopped:` line per rank; anything else keeps its
traceback. Around it: the stop signals' handlers, the watch on torchrun (a rank leaves when
its launcher is gone), the rule that a rank's forked processes die with it, and rank 0's
lock on --save (one job writes a directory at a time).
"""
from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

from .. import comm
from .agreement import check_ranks_agree
from .arguments import config_from_args, parse_args
from ..checkpointing.contents import apply_checkpoint_args
from ..checkpointing.files import SaveLock
from .data_sources import continue_data, data_sources, tokenizer_from_args
from .distributed import init_distributed, rendezvous_pending, setup_logging
from .errors import end_process, guarded, watch_peers
from .signals import HAND_STOP, PROGRESS
from .watchdog import (LauncherWatch, beat_period, children_die_with_rank,
                       writer_queue_dies_with_rank)
from .megatron_flags import check_megatron_flags, inert_notes, mapped_notes
from .model_flags import kernel_note
from .validation import check_output_paths, check_ranges, validate_flags

logger = logging.getLogger("megatron_2bw.train")


def main(model: str, argv: Optional[Sequence[str]] = None) -> int:
    """Train as the flags say; 0 when done, 2 on a user error (printed once), 1 for a
    fault, 128 + the signal's number when one stopped it."""
    PROGRESS.__init__(rank=_env_rank())
    HAND_STOP.reset()
    HAND_STOP.install(graceful_sigterm=False)
    launcher = LauncherWatch.start()
    children_die_with_rank()
    try:
        status = guarded(lambda: _pretrain(model, argv))
        if rendezvous_pending():  # stopped while the rendezvous waited in C++
            end_process(status)
        return status
    finally:
        children_die_with_rank(False)
        if launcher is not None:
            launcher.close()
        HAND_STOP.uninstall()


def _env_rank() -> int:
    """This process's rank before the process group exists (for a line that stops it)."""
    value = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    return int(value) if value.isdigit() else 0


def _pretrain(model: str, argv: Optional[Sequence[str]]) -> int:
    args = parse_args(model, argv)
    if args.sequence_parallel:
        # what Megatron-LM's scripts export for SP: one CUDA work queue, so that each
        # all-gather is launched before the computation meant to overlap it (before any
        # CUDA context exists; megatron-core warns without it)
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if args.exit_signal_handler:  # SIGTERM is GracefulStop's: noted from here on
        HAND_STOP.install(graceful_sigterm=True)
    PROGRESS.save = os.path.abspath(args.save) if args.save else None
    taken = apply_checkpoint_args(args) if args.use_checkpoint_args else []
    check_ranges(args)  # before a process group starts
    env = init_distributed(timeout_minutes=args.distributed_timeout_minutes)
    PROGRESS.rank = env.rank
    watch_peers()
    setup_logging(env.rank, env.world_size)
    check_ranks_agree(args, env.world_size)  # one software, one command line
    check_megatron_flags(args, env.world_size)   # removed and refused Megatron-LM flags
    validate_flags(args, model, env.world_size)  # cross-flag rules, before reading any file
    if taken:
        logger.info(f"--use-checkpoint-args: from {args.load}: {', '.join(taken)}")
    logger.info(kernel_note(args, env.device.type == "cuda"))
    for note in mapped_notes(args, env.device.type == "cuda"):
        logger.info(note)
    if env.rank == env.world_size - 1:  # the logging rank: one line per job, not per rank
        for note in inert_notes(args):
            logger.warning(f"WARNING: {note}")
    check_output_paths(args)                      # before the first iteration
    lock = (SaveLock.acquire(args.save, min(10.0, beat_period(env.timeout)))
            if args.save and env.rank == 0 else None)
    try:
        return _train(args, model, env)
    finally:
        if lock is not None:
            lock.release()


def _train(args, model: str, env) -> int:
    tokenizer = tokenizer_from_args(args, model)
    run = continue_data(config_from_args(args, model, env.world_size, tokenizer.vocab_size))
    sources = data_sources(run, tokenizer)
    from ..models import apply_cpu_shims, apply_group_shims
    from .loop import pretrain
    apply_cpu_shims(env.device.type)
    apply_group_shims()
    if env.device.type == "cuda":
        writer_queue_dies_with_rank()  # torch_dist's spawned queue server ends with the rank
    recorder = comm.recorder_from_env()  # MEGATRON_2BW_RECORD_COLLECTIVES=PREFIX only
    try:
        pretrain(run, env, sources)
    finally:
        if recorder is not None:
            recorder.write(comm.record_path(env.rank))
    return 0
