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

import json
import logging
import os
import time
from typing import Optional, Sequence

from .. import comm
from .agreement import check_ranks_agree
from .arguments import config_from_args, launcher_world_size, parse_args
from ..checkpointing.contents import apply_checkpoint_args
from ..checkpointing.save_lock import SaveLock
from .data_sources import continue_data, data_sources, tokenizer_from_args
from .distributed import init_distributed, rendezvous_pending, setup_logging
from .errors import (USER_ERRORS, describe, end_process, guarded, read_faults_with,
                     watch_peers)
from .signals import HAND_STOP, PROGRESS
from .faults import classify, with_checkpoint
from .memory_check import check_memory, check_open_files
from .watchdog import (LauncherWatch, beat_period, children_die_with_rank, forget_peers,
                       know_peers, local_ranks, store_host_gone, writer_queue_dies_with_rank)
from .megatron_flags import check_megatron_flags, inert_notes, mapped_notes
from .model_flags import kernel_note
from .process_settings import apply_process_settings
from .validation import (check_attention_kernel, check_output_paths, check_ranges,
                         validate_flags)

logger = logging.getLogger("megatron_2bw.train")


def main(model: str, argv: Optional[Sequence[str]] = None) -> int:
    """Train as the flags say; 0 when done, 2 on a user error (printed once), 1 for a
    fault, 128 + the signal's number when one stopped it."""
    PROGRESS.__init__(rank=_env_rank())
    read_faults_with(classify, with_checkpoint, store_host_gone)  # peers, resources
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
    try:
        args, taken = _read_flags(model, argv)
    except USER_ERRORS as err:
        _tell_torchrun(err)
        raise
    check_open_files(launcher_world_size())  # gloo's groups need files: before they exist
    env = init_distributed(timeout_minutes=args.distributed_timeout_minutes)
    PROGRESS.rank = env.rank
    watch_peers()
    know_peers(env.world_size)  # each rank's pid: a survivor names the rank that died
    setup_logging(env.rank, env.world_size)
    apply_process_settings(args)  # --logging-level, bf16 matmul, --enable-experimental
    check_ranks_agree(args, env.world_size)  # one software, one command line
    validate_flags(args, model, env.world_size)  # cross-flag rules, before reading any file
    check_attention_kernel(args, model, env.device)  # --attention-backend on this device
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
        status = _train(args, model, env)
        forget_peers()  # the job ends well: ranks that end from now on are not dead
        return status
    finally:
        if lock is not None:
            lock.release()


def _read_flags(model: str, argv: Optional[Sequence[str]]):
    """The flags and what --use-checkpoint-args took; every unknown, refused or removed
    flag of the command line named in one error before any process group starts (on
    rank 0: the others have the same command line and stay quiet)."""
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
    check_megatron_flags(args, launcher_world_size())  # refused and removed flags, all of them
    check_ranges(args)
    return args, taken


def _tell_torchrun(err: BaseException) -> None:
    """Under torchrun, rank 0 leaves its error lines in the file torchrun reads (in the
    layout torchrun's own error handler writes), so the summary torchrun prints after the
    job names the problem as its root cause instead of a link to its docs (the other
    ranks, which printed nothing, are listed there without a message)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or _env_rank() != 0:
        return
    lines = f"error: {describe(err)}"
    report = {"message": {"message": lines.splitlines()[0], "extraInfo": {
        "py_callstack": lines, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(report, f)
    except OSError:
        pass  # torchrun's summary only; the error lines themselves are printed anyway


def _train(args, model: str, env) -> int:
    tokenizer = tokenizer_from_args(args, model)
    run = continue_data(config_from_args(args, model, env.world_size, tokenizer.vocab_size))
    check_memory(run, env.device, local_ranks(), logs=env.rank == env.world_size - 1)
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
