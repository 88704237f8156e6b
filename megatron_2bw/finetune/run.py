"""tools/finetune.py: Megatron-LM's finetuning flags on top of pretrain_bert.py's.

    torchrun --nproc-per-node 2 tools/finetune.py --task MNLI \\
        --train-data train.tsv --valid-data dev_matched.tsv dev_mismatched.tsv \\
        --pretrained-checkpoint bert-ckpt --epochs 3 --seq-length 128 \\
        --micro-batch-size 8 --global-batch-size 32 --lr 2e-5 \\
        --pipeline-model-parallel-size 2 --pipeline-schedule 2bw --save mnli-ckpt

As Megatron-LM's `tasks/main.py`: `--task`, `--train-data`, `--valid-data` (each set is
reported on its own), `--epochs`, `--pretrained-checkpoint` (loaded as `--finetune`:
weights only, iteration 0; a `--load` that holds a checkpoint resumes the finetuning run
instead). The model's flags come from the checkpoint (as `--use-checkpoint-args`), so
they need not be repeated; `--seq-length` is the task's. Every other pretrain_bert.py
flag works: parallel sizes, `--pipeline-schedule`, optimizer, precision, saving.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron.core import parallel_state as ps

from ..training.arguments import config_from_args, parse_args
from ..checkpointing.contents import CHECKPOINT_ARGS, saved_args
from ..checkpointing.files import read_tracker
from ..training.data_sources import DataSources, tokenizer_from_args
from ..training.distributed import DistEnv, init_distributed, setup_logging
from ..training.errors import UserError, guarded, watch_peers
from ..training.validation import check_output_paths
from .samples import Encoder, EpochView, PaddedView, TaskDataset
from .tasks import TASKS, label_names, pair_examples, read_pair_rows, read_race

logger = logging.getLogger("megatron_2bw.finetune")
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
TOKENIZER_ARGS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")


def task_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/finetune.py", allow_abbrev=False, add_help=False)
    p.add_argument("--task", required=True, choices=sorted(TASKS),
                   help="MNLI (sentence pairs, 3 labels), PAIRS (sentence pairs, the "
                        "training data's labels), RACE (multiple choice, 4 options)")
    p.add_argument("--train-data", nargs="+", required=True, help="training files")
    p.add_argument("--valid-data", nargs="+", required=True,
                   help="validation files, each reported on its own; the first is also "
                        "validated during training (--eval-interval, default each epoch)")
    p.add_argument("--epochs", type=int, default=3, help="passes over the training data")
    p.add_argument("--pretrained-checkpoint", default=None,
                   help="the pretrained BERT checkpoint to start from (weights only)")
    p.add_argument("--results-json", default=None,
                   help="write each validation set's accuracy, loss and count as JSON")
    return p


@dataclass
class TaskData:
    """The task's examples read once: training data, and each validation file's."""

    kind: str
    labels: tuple[str, ...]
    num_choices: int
    train: list
    valid: dict[str, list]


def read_task(task: argparse.Namespace) -> TaskData:
    spec = TASKS[task.task]
    if spec.kind == "multiple_choice":
        read = lambda path: read_race(path, spec.num_choices)  # noqa: E731
        return TaskData(spec.kind, tuple("ABCDEFGH"[:spec.num_choices]), spec.num_choices,
                        [e for f in task.train_data for e in read(f)],
                        {f: read(f) for f in task.valid_data})
    train_rows = [(f, r) for f in task.train_data for r in read_pair_rows(f)]
    labels = label_names(spec, [r for _, r in train_rows])
    train = [e for f in task.train_data
             for e in pair_examples(read_pair_rows(f), labels, f)]
    valid = {f: pair_examples(read_pair_rows(f), labels, f) for f in task.valid_data}
    return TaskData(spec.kind, labels, 0, train, valid)


def _model_source(task: argparse.Namespace, load: Optional[str]) -> Optional[str]:
    """Where the model's flags come from: a resumable --load, else the pretrained one."""
    if load and read_tracker(load) is not None:
        return load
    return task.pretrained_checkpoint


def _given(rest: Sequence[str], key: str) -> bool:
    flag = "--" + key.replace("_", "-")
    return any(a == flag or a.startswith(flag + "=") for a in rest)


def pretrain_args(task: argparse.Namespace, rest: list[str]) -> argparse.Namespace:
    """pretrain_bert.py's flags, the model's taken from the checkpoint."""
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--load", default=None)
    source = _model_source(task, probe.parse_known_args(rest)[0].load)
    saved = saved_args(source) if source else None
    if source and saved is None:
        raise UserError(f"no checkpoint in {source}", "--pretrained-checkpoint",
                        "give a directory with latest_checkpointed_iteration.txt")
    saved = saved or {}
    head = [f"--{k.replace('_', '-')}={saved[k]}" for k in REQUIRED
            if k in saved and not _given(rest, k)]
    args = parse_args("bert", head + rest + ["--mock-data"])
    for key in CHECKPOINT_ARGS:
        keep = key == "seq_length" or (key in TOKENIZER_ARGS and _given(rest, key))
        if key in saved and not keep:
            setattr(args, key, saved[key])
    for key in TOKENIZER_ARGS:
        if not _given(rest, key) and saved.get(key) is not None:
            setattr(args, key, saved[key])
    if not (args.load and read_tracker(args.load) is not None) and task.pretrained_checkpoint:
        args.load, args.finetune = task.pretrained_checkpoint, True
    return args


def _global_batch(args: argparse.Namespace, world_size: int) -> int:
    dp = world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    return args.global_batch_size or args.micro_batch_size * max(dp, 1)


def size_run(args: argparse.Namespace, data: TaskData, epochs: int, gbs: int,
             rest: Sequence[str]) -> None:
    """--train-iters from the epochs, --eval-iters covering the first validation set."""
    per_epoch = len(data.train) // gbs
    if per_epoch == 0:
        raise UserError(f"{len(data.train)} training examples do not fill one global batch "
                        f"of {gbs}", "--global-batch-size", "use a smaller batch")
    args.train_iters = epochs * per_epoch
    if not _given(rest, "eval_interval"):
        args.eval_interval = per_epoch
    args.eval_iters = math.ceil(len(next(iter(data.valid.values()))) / gbs)


def task_run(args: argparse.Namespace, data: TaskData, env: DistEnv):
    """(run, tokenizer): the BERT run with the task's head, its loss summed over the
    examples and divided by their count (padding samples count nothing)."""
    tokenizer = tokenizer_from_args(args, "bert")
    run = config_from_args(args, "bert", env.world_size, tokenizer.vocab_size)
    model = dataclasses.replace(run.model, task=data.kind, num_classes=max(len(data.labels), 2),
                                num_choices=max(data.num_choices, 1), per_token_loss=True)
    flags = {**run.flags, "task_kind": data.kind, "task_labels": list(data.labels)}
    return dataclasses.replace(run, model=model, flags=flags), tokenizer


def _measure(trainer, dataset: TaskDataset, gbs: int) -> Optional[dict]:
    """One validation set, every example once; None off the last stage."""
    iters = math.ceil(len(dataset) / gbs)
    rec = trainer.measure(PaddedView(dataset, iters * gbs, 1), 0, iters, trainer.iteration)
    if rec is None:
        return None
    correct = round(rec["val_accuracy"] * len(dataset))
    return {"accuracy": rec["val_accuracy"], "correct": correct, "total": len(dataset),
            "loss": rec["val_loss"], "iteration": trainer.iteration}


def _report(task: argparse.Namespace, results: dict[str, dict], env: DistEnv) -> None:
    for path, r in results.items():
        logger.info(f"{task.task} {path}: accuracy {100 * r['accuracy']:.2f} % "
                    f"(correct / total = {r['correct']} / {r['total']}), loss {r['loss']:.4f} "
                    f"at iteration {r['iteration']}")
    if task.results_json and env.rank == env.world_size - 1:
        with open(task.results_json, "w") as f:
            json.dump({"task": task.task, "results": results}, f, indent=1)


def _datasets(args, data: TaskData, epochs: int, gbs: int, encode: Encoder):
    """The training view, the first validation set's view for the loop, every set."""
    sets = {path: TaskDataset(examples, encode) for path, examples in data.valid.items()}
    first = next(iter(sets.values()))
    train = EpochView(TaskDataset(data.train, encode), epochs,
                      (len(data.train) // gbs) * gbs, args.seed)
    valid = PaddedView(first, args.eval_iters * gbs,
                       args.train_iters // args.eval_interval + 2)
    return DataSources(train, valid), sets


def _help() -> int:
    parser = task_parser()
    parser.description = ("Finetune a pretrained BERT on a downstream task. Takes these "
                          "flags and every flag of pretrain_bert.py (pretrain_bert.py --help); "
                          "the model's flags come from the checkpoint.")
    parser.print_help()
    return 0


def _finetune(argv: Optional[Sequence[str]]) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        return _help()
    task, rest = task_parser().parse_known_args(argv)
    args = pretrain_args(task, rest)
    data = read_task(task)  # a bad file is one line before any process group starts
    env = init_distributed(timeout_minutes=args.distributed_timeout_minutes)
    watch_peers()
    setup_logging(env.rank, env.world_size)
    gbs = _global_batch(args, env.world_size)
    size_run(args, data, task.epochs, gbs, rest)
    check_output_paths(args)
    run, tokenizer = task_run(args, data, env)
    logger.info(f"finetuning {task.task}: {len(data.train)} training examples, "
                f"{task.epochs} epochs = {run.train.train_iters} iterations of {gbs}; "
                f"labels {', '.join(data.labels)}")
    sources, sets = _datasets(args, data, task.epochs, gbs,
                              Encoder(tokenizer, run.model.seq_length))
    from ..models import apply_cpu_shims
    from ..training.loop import Trainer
    apply_cpu_shims(env.device.type)
    trainer = Trainer(run, env, sources)
    try:
        trainer.train()
        results = {path: _measure(trainer, ds, gbs) for path, ds in sets.items()}
    finally:
        ps.destroy_model_parallel()
    if all(r is not None for r in results.values()):
        _report(task, results, env)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Finetune as the flags say; 0 when done, 2 on a user error (one line)."""
    return guarded(lambda: _finetune(argv))
