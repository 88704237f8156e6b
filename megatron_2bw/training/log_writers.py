"""TensorBoard and wandb scalars under Megatron-LM's tag names, from the logging rank.

What is written, when, and which flag turns it on follow `training_log` and
`evaluate_and_print_results` (megatron/training/training.py at core_v0.16.1), so
dashboards built on a Megatron-LM run read ours: every `--tensorboard-log-interval`
iterations `learning-rate`, `batch-size`, each loss (`lm loss`, BERT's `sop loss`; a
mixture of experts' `load_balancing_loss` / `z_loss` against the iteration only),
`loss-scale`, `grad-norm` (not on a skipped step, which has none), `num-zeros`,
`params-norm`, `world-size` (flags), each also against consumed samples
(`<tag> vs samples`), and the `mem-*` scalars against the iteration only (flag, memory.py;
not to wandb); at each log line `iteration-time`, `throughput` and each timer's
`<name>-time` (flags); after validation `<loss> validation` (and its `ppl`, flag), which
the test-set evaluation after training also writes, as Megatron-LM does.
wandb gets the same scalars against the iteration, as Megatron-LM logs them there.

A TensorBoard folder that cannot take more (a full disk) ends the run with one line naming
--tensorboard-dir (`OutputFull`); TensorBoard's writer thread, which meets the error
first, keeps quiet about it (its traceback would precede the line).
"""
from __future__ import annotations

import errno
import glob
import logging
import math
import os
import threading
from typing import Any, Callable, Optional

from . import memory
from .config import TrainConfig
from .errors import UserError

logger = logging.getLogger("megatron_2bw.train")

# a mixture of experts' router losses, under Megatron-LM's names (track_moe_metrics):
# in the log line after the model's losses, and in TensorBoard against the iteration only
ROUTER_LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")

VS_SAMPLES = " vs samples"


class ScalarWriters:
    """The TensorBoard writer and the wandb run of one job (either may be absent)."""

    def __init__(self, train: TrainConfig, world_size: int, tb: Any = None, wandb: Any = None,
                 stale_event_files: tuple[str, ...] = (), start_iteration: int = 0,
                 device: Optional[Any] = None):
        self.t, self.world_size, self.tb, self.wandb = train, world_size, tb, wandb
        self._stale, self._start = stale_event_files, start_iteration
        self.device = device  # whose memory --log-memory-to-tensorboard writes

    @classmethod
    def open(cls, train: TrainConfig, world_size: int, start_iteration: int = 0,
             flags: Optional[dict] = None, device: Optional[Any] = None) -> "ScalarWriters":
        """Writers for what the flags ask; a missing tensorboard package is a warning (as in
        Megatron-LM), wandb asked for but unusable a UserError (Megatron-LM fails too)."""
        stale = _event_files(train.tensorboard_dir) if train.tensorboard_dir else ()
        if stale and start_iteration == 0:  # a fresh run adds its own files, drops nothing
            logger.warning(f"{train.tensorboard_dir} holds {len(stale)} TensorBoard event "
                           "files of earlier runs; this run adds its own beside them")
            stale = ()
        return cls(train, world_size, _open_tensorboard(train), _open_wandb(train, flags or {}),
                   stale, start_iteration, device)

    # ---------------------------------------------------------------- what is written
    def train(self, rec: dict, losses: dict[str, float]) -> None:
        """One iteration's scalars, every --tensorboard-log-interval iterations."""
        it, samples = rec["iteration"], rec["consumed_samples"]
        if self._stale:  # the first record says how many samples the resumed run had seen
            self._drop_stale(samples - rec["global_batch_size"])
        if it % self.t.tensorboard_log_interval:
            return
        self._wandb_log("samples vs steps", samples, it)
        self._pair("learning-rate", rec["lr"], it, samples)
        self._pair("batch-size", rec["global_batch_size"], it, samples)
        for tag, value in losses.items():
            if tag in ROUTER_LOSSES or tag.startswith("mtp_"):
                self._scalar(tag, value, it)
            else:
                self._pair(tag, value, it, samples)
        for tag, value in rec.items():  # --moe-per-layer-logging (experts.py)
            if tag.startswith("moe/"):
                self._scalar(tag, value, it)
        if self.t.log_loss_scale_to_tensorboard:
            self._pair("loss-scale", rec["loss_scale"], it, samples)
        if self.t.log_world_size_to_tensorboard:
            self._pair("world-size", self.world_size, it, samples)
        norm = step_grad_norm(rec)
        if norm is not None:
            self._pair("grad-norm", norm, it, samples)
        for tag, key in (("num-zeros", "num_zeros"), ("params-norm", "params_norm")):
            if rec.get(key) is not None:
                self._pair(tag, rec[key], it, samples)
        if self.t.log_memory_to_tensorboard and self.device is not None and self.tb is not None:
            for tag, value in memory.tensorboard_scalars(self.device).items():
                self._scalar(tag, value, it, wandb=False)

    def log_line(self, it: int, seconds_per_iteration: float, tflops: float,
                 first: bool, timer_ms: Optional[dict[str, float]] = None) -> None:
        """At a printed line: the interval's time per iteration (not after the run's first
        iteration, which Megatron-LM prints only as a first look), TFLOP/s/GPU and each
        timer's ms per iteration, the maximum over the ranks (`<name>-time`)."""
        if not self.t.log_timers_to_tensorboard:
            return
        if not first:
            self._scalar("iteration-time", seconds_per_iteration, it)
        if self.t.log_throughput:
            self._scalar("throughput", tflops, it)
        for name, ms in (timer_ms or {}).items():
            self._scalar(name + "-time", ms, it)

    def validation(self, it: int, samples: int, losses: dict[str, float]) -> None:
        for key, value in losses.items():
            self._pair(f"{key} validation", value, it, samples)
            if self.t.log_validation_ppl_to_tensorboard:
                self._pair(f"{key} validation ppl", perplexity(value), it, samples,
                           wandb=False)

    def close(self) -> None:
        if self.tb is not None:
            _written(self.t.tensorboard_dir, "--tensorboard-dir", self.tb.close)
        if self.wandb is not None:
            self.wandb.finish()

    # ---------------------------------------------------------------- plumbing
    def _pair(self, tag: str, value: float, it: int, samples: int, wandb: bool = True) -> None:
        """`tag` against the iteration and, in TensorBoard, against consumed samples."""
        self._scalar(tag, value, it, wandb)
        if self.tb is not None:
            _written(self.t.tensorboard_dir, "--tensorboard-dir",
                     lambda: self.tb.add_scalar(tag + VS_SAMPLES, value, samples))

    def _scalar(self, tag: str, value: float, it: int, wandb: bool = True) -> None:
        if self.tb is not None:
            _written(self.t.tensorboard_dir, "--tensorboard-dir",
                     lambda: self.tb.add_scalar(tag, value, it))
        if wandb:
            self._wandb_log(tag, value, it)

    def _wandb_log(self, tag: str, value: float, it: int) -> None:
        if self.wandb is not None:
            self.wandb.log({tag: value}, it)

    def _drop_stale(self, samples: int) -> None:
        """Drop what earlier runs wrote past where this one starts (see drop_events_after)."""
        dropped = drop_events_after(self._stale, self._start, samples)
        if dropped:
            logger.info(f"{self.t.tensorboard_dir}: dropped {dropped} TensorBoard events "
                        f"after iteration {self._start}, which this run writes again")
        self._stale = ()


def step_grad_norm(rec: dict) -> Optional[float]:
    """The step's gradient norm; None for a skipped step (Megatron-LM's optimizer reports
    none then), so neither the line nor TensorBoard shows one."""
    norm = rec.get("grad_norm")
    return None if norm is None or rec.get("skipped") else norm


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(20) as Megatron-LM's validation does; NaN for a NaN loss
    and inf for an infinite one (Megatron-LM's min(20, loss) turns both into exp(20),
    a finite perplexity for a loss that is none)."""
    if not math.isfinite(loss):
        return loss if math.isnan(loss) or loss > 0 else 0.0
    return math.exp(min(20.0, loss))


def output_error(path: str, flag: str, err: OSError) -> UserError:
    """The one line for a log output that cannot be written (a full disk, mostly)."""
    from .signals import checkpoint_note

    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        what = ("the file size limit (ulimit -f) is reached" if err.errno == errno.EFBIG
                else "the disk is full")
    else:
        what = err.strerror or str(err)
    return UserError(f"cannot write {path}: {what}", flag,
                     f"free space or point {flag} elsewhere; {checkpoint_note()}")


def _written(path: str, flag: str, write: Callable[[], Any]) -> Any:
    """`write()`, its OSError made the one-line error naming `flag`."""
    try:
        return write()
    except OSError as err:
        raise output_error(path, flag, err) from err


def _quiet_writer_thread(previous: Callable) -> Callable:
    """threading.excepthook, but TensorBoard's writer thread keeps its OSError to itself: the
    main thread gets it at the next write (`_written`) and says it in one line."""
    def hook(args) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and \
                isinstance(args.exc_value, OSError):
            return
        previous(args)
    hook.quiet_tensorboard = True
    return hook


def _open_tensorboard(t: TrainConfig) -> Any:
    if not t.tensorboard_dir:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        logger.warning(f"WARNING: --tensorboard-dir is set but TensorBoard is not available "
                       f"({err}); no TensorBoard logs will be written (pip install tensorboard)")
        return None
    if not getattr(threading.excepthook, "quiet_tensorboard", False):
        threading.excepthook = _quiet_writer_thread(threading.excepthook)
    return _written(t.tensorboard_dir, "--tensorboard-dir", lambda: SummaryWriter(
        log_dir=t.tensorboard_dir, max_queue=t.tensorboard_queue_size))


def _open_wandb(t: TrainConfig, flags: dict) -> Any:
    """wandb's module after `wandb.init`, as Megatron-LM sets it up (the run's flags as its
    config, files under --wandb-save-dir or <--save>/wandb); None without --wandb-project."""
    if not t.wandb_project:
        return None
    try:
        import wandb
    except ImportError:
        raise UserError("the wandb package is not installed", "--wandb-project",
                        "pip install wandb, or leave --wandb-project out") from None
    save_dir = t.wandb_save_dir or (os.path.join(t.save, "wandb") if t.save else None)
    if save_dir is None:
        raise UserError("no folder for wandb's files", "--wandb-project",
                        "give --wandb-save-dir or --save")
    os.makedirs(save_dir, exist_ok=True)
    kwargs = {"dir": save_dir, "name": t.wandb_exp_name, "project": t.wandb_project,
              "config": dict(flags)}
    if t.wandb_entity:
        kwargs["entity"] = t.wandb_entity
    wandb.init(**kwargs)
    return wandb


def _event_files(folder: str) -> tuple[str, ...]:
    return tuple(sorted(glob.glob(os.path.join(folder, "events.out.tfevents.*"))))


def drop_events_after(paths: tuple[str, ...], iteration: int, samples: int) -> int:
    """Remove from TensorBoard event files the scalars past `iteration` (tags against
    iterations) or past `samples` (the `vs samples` tags), as drop_rows_after does for the
    metrics file: a run that crashed past its last checkpoint left them, and the resumed
    run writes them again. (TensorBoard's own purge_step cannot do this: it cuts every tag
    at one step, and the `vs samples` tags count samples.) Returns how many went; a file
    is rewritten to a temporary name that replaces it."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter
    dropped = 0
    for path in paths:
        records = list(RawEventFileLoader(path).Load())
        kept = [r for r in records if not _past(Event.FromString(r), iteration, samples)]
        if len(kept) == len(records):
            continue
        with open(path + ".tmp", "wb") as f:
            writer = RecordWriter(f)
            for record in kept:
                writer.write(record)
        os.replace(path + ".tmp", path)
        dropped += len(records) - len(kept)
    return dropped


def _past(event: Any, iteration: int, samples: int) -> bool:
    values = event.summary.value if event.HasField("summary") else ()
    if not values:
        return False  # the file header and anything not a scalar stay
    return event.step > (samples if values[0].tag.endswith(VS_SAMPLES) else iteration)
