"""tools/finetune.py: task files, encoder rows, and pipelined finetuning (flush and 2BW)
against an independent single-process loop."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.dist_harness import free_port, run_distributed
from tests.entry_harness import ROOT, launch, max_rel

PRETRAIN = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "4", "--lr", "1e-3",
            "--train-iters", "4", "--eval-iters", "0", "--log-interval", "1", "--split", "1,0,0",
            "--tokenizer-type", "BertWordPieceLowerCase"]
# the finetuning flags both the tool and the oracle read
FINETUNE = ["--epochs", "1", "--seq-length", "32", "--micro-batch-size", "4",
            "--global-batch-size", "8", "--lr", "2e-3", "--lr-decay-style", "constant",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
            "--weight-decay", "0.01", "--clip-grad", "1.0"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, small_corpus) -> dict:
    """A tiny pretrained BERT (torch_dist, TP = PP = 1) and both local tasks."""
    from megatron_2bw.finetune.local_tasks import write_local_tasks

    out = tmp_path_factory.mktemp("finetune")
    ckpt = str(out / "bert")
    launch("bert", 1, ["--data-path", small_corpus.bert_data_prefix, "--vocab-file",
                       small_corpus.bert_tokenizer.vocab_file, "--save", ckpt], str(out / "pre.jsonl"), base=PRETRAIN)
    tasks = write_local_tasks(small_corpus.corpus, str(out / "tasks"), train=64, dev=21)
    return {"ckpt": ckpt, **tasks}


def _task_argv(task: str, pretrained: dict) -> list[str]:
    name = "pairs" if task == "PAIRS" else "choice"
    return ["--task", task, "--train-data", pretrained[f"{name}_train"],
            "--valid-data", pretrained[f"{name}_dev"],
            "--pretrained-checkpoint", pretrained["ckpt"], *FINETUNE]


def _finetune(nproc: int, argv: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """The tool under torchrun, or as one plain process (nproc 0)."""
    launcher = (["-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                 "--master-port", str(free_port())] if nproc else [])
    cmd = [sys.executable, *launcher, os.path.join(ROOT, "tools", "finetune.py"), *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


# ------------------------------------------------------------------ the independent loop


def _pretrained_weights(model, root: str) -> None:
    """The checkpoint's tensors, read with megatron-core's dist_checkpointing directly;
    the head (absent there) keeps the model's own initialization."""
    from megatron.core import dist_checkpointing

    from megatron_2bw.models.compat import cpu_dist_checkpointing

    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        path = os.path.join(root, f"iter_{int(f.read()):07d}")
    shards = {k: v for k, v in model.model.sharded_state_dict().items()
              if not k.startswith("task_head.")}
    with cpu_dist_checkpointing():
        saved = dist_checkpointing.load(shards, path)
    own = model.model.state_dict()
    assert set(own) - set(saved) == {"task_head.dense.weight", "task_head.dense.bias"}
    own.update({k: v for k, v in saved.items() if torch.is_tensor(v)})
    model.model.load_state_dict(own)


def _minibatch(model, view, k: int, gbs: int, mbs: int) -> float:
    """Minibatch k's gradient of the mean example loss into `model`; that loss."""
    from megatron_2bw.data.datasets import collate, training_sample

    model.zero_grad(set_to_none=True)
    total = 0.0
    for first in range(k * gbs, (k + 1) * gbs, mbs):
        batch = collate([training_sample(view[i]) for i in range(first, first + mbs)])
        loss = model(None, batch) / gbs   # the model sums its examples' losses
        loss.backward()
        total += loss.item()
    return total


def _accuracy(model, dataset) -> int:
    """Correct answers over the validation set, one example at a time (no padding)."""
    from megatron_2bw.data.datasets import collate, training_sample
    from megatron_2bw.models.heads import encoder_only, task_logits

    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(len(dataset)):
            batch = collate([training_sample({**dataset[i], "loss_mask": 1.0})])
            inputs = {k: batch[k].reshape(-1, batch[k].shape[-1])
                      for k in ("tokens", "padding_mask", "types")}
            with encoder_only(model.model):
                hidden = model.model(input_ids=inputs["tokens"],
                                     attention_mask=inputs["padding_mask"],
                                     tokentype_ids=inputs["types"])
            logits = task_logits(model.model, hidden, model.config, 1)
            correct += int(logits.argmax(-1).item() == batch["label"].item())
    return correct


def _oracle(rank: int, world: int, argv: list[str], delayed: bool) -> tuple[list[float], int]:
    """Synchronous (flush) or 2BW's delayed AdamW update in one process with torch's
    optimizer; the losses and the final validation accuracy count."""
    from megatron.core import parallel_state as ps

    from megatron_2bw.finetune import run as ft
    from megatron_2bw.finetune.samples import Encoder
    from megatron_2bw.models import apply_cpu_shims, build_stage, model_parallel_manual_seed

    task, rest = ft.task_parser().parse_known_args(argv)
    args = ft.pretrain_args(task, rest)
    data = ft.read_task(task)
    gbs = args.global_batch_size
    ft.size_run(args, data, task.epochs, gbs, rest)
    run, tokenizer = ft.task_run(args, data, type("Env", (), {"world_size": 1})())
    sources, sets = ft._datasets(args, data, task.epochs, gbs,
                                 Encoder(tokenizer, run.model.seq_length))
    ps.initialize_model_parallel(1, 1)
    apply_cpu_shims("cpu")
    model_parallel_manual_seed(args.seed)
    current = build_stage(run.model, 0, 1)
    _pretrained_weights(current, task.pretrained_checkpoint)
    previous = build_stage(run.model, 0, 1) if delayed else current
    previous.load_state_dict(current.state_dict())
    params = [(n, p) for n, p in current.named_parameters() if p.requires_grad]
    decays = [p.dim() > 1 and not n.endswith(".bias") for n, p in params]
    groups = [{"params": [p for (_, p), d in zip(params, decays) if d == decay],
               "weight_decay": args.weight_decay if decay else 0.0} for decay in (True, False)]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    losses = []
    for k in range(args.train_iters):
        losses.append(_minibatch(previous, sources.train, k, gbs, args.micro_batch_size))
        snapshot = {n: t.clone() for n, t in current.state_dict().items()
                    if torch.is_tensor(t)}
        if delayed:
            for p, q in zip(current.parameters(), previous.parameters()):
                p.grad = None if q.grad is None else q.grad.clone()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], args.clip_grad)
        opt.step()
        if delayed:
            previous.load_state_dict(snapshot, strict=False)
    correct = _accuracy(current, next(iter(sets.values())))
    ps.destroy_model_parallel()
    return losses, correct


@pytest.mark.parametrize("task,schedule,chunks", [("RACE", "flush", 2), ("PAIRS", "2bw", 1)],
                         ids=["race-flush-pp2-v2", "pairs-2bw-pp2"])
def test_finetune_equals_independent_loop(tmp_path, pretrained, task, schedule,
                                          chunks) -> None:
    """Pipelined finetuning (PP 2) from a pretrained checkpoint saved at PP 1: flush with
    two model chunks per stage (interleaved, one layer each) equals the synchronous loop
    and 2BW the delayed one, step by step, and the validation accuracy counts the same
    answers over the whole set (21 examples: 3 padding samples)."""
    argv = _task_argv(task, pretrained)
    oracle, correct = run_distributed(_oracle, 1, argv, schedule == "2bw")[0]
    metrics, results = str(tmp_path / "m.jsonl"), str(tmp_path / "r.json")
    interleave = ["--num-layers-per-virtual-pipeline-stage", "1"] if chunks > 1 else []
    proc = _finetune(2, argv + interleave + [
        "--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule,
        "--metrics-file", metrics, "--results-json", results])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(metrics) as f:
        got = [r["loss"] for r in map(json.loads, f) if r.get("split") == "train"]
    assert max_rel(got, oracle) < 1e-5
    with open(results) as f:
        result = next(iter(json.load(f)["results"].values()))
    assert (result["correct"], result["total"]) == (correct, 21)
    assert "task_head.dense.weight" in proc.stdout + proc.stderr  # the fresh head is said
    assert ("interleaved, 2 chunks per rank" in proc.stdout + proc.stderr) == (chunks > 1)


# ------------------------------------------------------------------------------ the parts


def test_pair_rows_truncate_the_longer_side_and_mark_types() -> None:
    from megatron_2bw.finetune.samples import pair_row

    tok = type("Tok", (), {"cls": 1, "sep": 2, "pad": 0})()
    row = pair_row(tok, [10] * 9, [20] * 3, 12)
    assert row["text"].tolist() == [1] + [10] * 6 + [2] + [20] * 3 + [2]
    assert row["types"].tolist() == [0] * 8 + [1] * 4
    short = pair_row(tok, [10], [20], 8)
    assert short["text"].tolist() == [1, 10, 2, 20, 2, 0, 0, 0]
    assert short["padding_mask"].tolist() == [1] * 5 + [0] * 3


def test_views_pad_and_shuffle() -> None:
    from megatron_2bw.finetune.samples import EpochView, PaddedView, TaskDataset

    data = TaskDataset(list(range(5)), lambda e: {"label": e})
    padded = PaddedView(data, 8, 2)
    assert len(padded) == 16
    assert [padded[i]["loss_mask"] for i in range(8)] == [1.0] * 5 + [0.0] * 3
    assert [padded[i + 8]["label"] for i in range(5)] == list(range(5))
    epochs = EpochView(data, 2, 4, seed=3)
    first, second = ([epochs[i]["label"] for i in range(e * 4, e * 4 + 4)] for e in (0, 1))
    assert len(set(first)) == 4 and len(set(second)) == 4 and first != second


def test_mnli_tsv_and_race_files(tmp_path) -> None:
    from megatron_2bw.finetune.tasks import TASKS, pair_examples, read_pair_rows, read_race

    tsv = tmp_path / "dev.tsv"
    tsv.write_text("index\tsentence1\tsentence2\tgold_label\n"
                   "0\tA man.\tA person.\tentailment\n1\tX.\tY.\t-\n2\tP.\tQ.\tneutral\n")
    rows = read_pair_rows(str(tsv))
    assert [r[2] for r in rows] == ["entailment", "neutral"]  # '-' has no gold label
    assert [e.label for e in pair_examples(rows, TASKS["MNLI"].labels, str(tsv))] == [1, 2]
    race = tmp_path / "race"
    (race / "high").mkdir(parents=True)
    (race / "high" / "1.txt").write_text(json.dumps({
        "article": "Text.", "questions": ["Q1 _ .", "Q2"], "answers": ["B", "D"],
        "options": [["a", "b", "c", "d"], ["e", "f", "g", "h"]]}))
    examples = read_race(str(race), 4)
    assert [e.label for e in examples] == [1, 3]
    assert examples[0].options == ("a", "b", "c", "d")


def test_bad_task_input_is_one_line(tmp_path, pretrained) -> None:
    """A missing file: one error line naming it, exit 2, no traceback; a label outside
    MNLI's names the file and the task's labels."""
    from megatron_2bw.finetune import run as ft
    from megatron_2bw.training.errors import UserError

    missing = _task_argv("PAIRS", pretrained)
    missing[missing.index("--train-data") + 1] = str(tmp_path / "nope.jsonl")
    proc = _finetune(0, missing, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "nope.jsonl" in errors[0], \
        proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    mnli = _task_argv("PAIRS", pretrained)
    mnli[1] = "MNLI"  # the local pairs' labels (next / random) are not MNLI's
    with pytest.raises(UserError, match="outside the task's"):
        ft.read_task(ft.task_parser().parse_known_args(mnli)[0])
