"""The log line, validation block and TensorBoard tags of Megatron-LM (issue 12).

Megatron-LM's `training_log` and `evaluate_and_print_results` at core_v0.16.1 are the
reference: field names, order and number formats of the line, the dashed validation
block, and the TensorBoard tags with the flags that gate them. Most tests drive
MetricsSink with hand-made records; one tiny BERT run checks the whole path.
"""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from typing import Optional

import pytest
import torch

from megatron_2bw.training.arguments import config_from_args, parse_args
from megatron_2bw.training.config import TrainConfig
from megatron_2bw.training.errors import UserError
from megatron_2bw.training.metrics import MetricsSink
from tests.entry_harness import ROOT, TINY

STAMP = r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\]"
FIELDS = ["consumed samples", "elapsed time per iteration (ms)", "learning rate",
          "global batch size", "lm loss", "loss scale", "grad norm",
          "number of skipped iterations", "number of nan iterations", "samples/s",
          "TFLOP/s/GPU", "ETA", "pipeline schedule"]
KEYS = {"split", "iteration", "loss", "lm_loss", "lr", "grad_norm", "loss_scale", "skipped",
        "iteration_time_s", "samples_per_s", "tokens_per_s", "consumed_samples", "tflops"}


def record(it: int, loss: float = 4.0, skipped: int = 0, seconds: float = 0.1,
           gbs: int = 8, sop: Optional[float] = None) -> dict:
    """A training record as loop.py's `_record` makes it."""
    rec = {"split": "train", "iteration": it, "loss": loss + (sop or 0.0), "lm_loss": loss,
           "lr": 1e-3, "grad_norm": float("nan") if skipped else 1.25, "loss_scale": 1.0,
           "skipped": skipped, "iteration_time_s": seconds, "samples_per_s": gbs / seconds,
           "tokens_per_s": 16 * gbs / seconds, "consumed_samples": it * gbs,
           "global_batch_size": gbs, "weight_version": it, "tflops": 2.0}
    if sop is not None:
        rec["sop_loss"] = sop
    return rec


def sink(tmp_path, schedule: str = "flush", start: int = 0, **train) -> MetricsSink:
    cfg = dict(micro_batch_size=1, global_batch_size=8, train_iters=5, log_interval=2,
               metrics_file=str(tmp_path / "m.jsonl"))
    return MetricsSink(True, TrainConfig(**{**cfg, **train}), schedule=schedule,
                       world_size=2, start_iteration=start)


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "megatron_2bw.train"]


def fields(line: str) -> dict[str, str]:
    """`name: value` pairs of a log line, in order."""
    return dict(part.strip().rsplit(": ", 1) for part in line.split("|")[1:-1])


@pytest.fixture(autouse=True)
def _info(caplog):
    caplog.set_level(logging.INFO, logger="megatron_2bw.train")


def test_line_has_megatron_fields_in_order(tmp_path, caplog) -> None:
    s = sink(tmp_path, train_iters=5, log_interval=2)
    for it in range(1, 6):
        s.record(record(it))
    s.close()
    printed = [ln for ln in lines(caplog) if "iteration" in ln]
    assert [int(re.search(r"iteration +(\d+)/", ln).group(1)) for ln in printed] == [1, 2, 4, 5]
    assert re.match(STAMP + r" iteration        1/       5 \| consumed samples:            8 \|"
                    r" elapsed time per iteration \(ms\): 100\.0 \| learning rate: 1\.000000E-03 \|"
                    r" global batch size:     8 \| lm loss: 4\.000000E\+00 \| loss scale: 1\.0 \|"
                    r" grad norm: 1\.250 \| number of skipped iterations:   0 \|"
                    r" number of nan iterations:   0 \| samples/s: 80\.0 \| TFLOP/s/GPU: 2\.000 \|"
                    r" ETA: \d+:\d\d:\d\d \| pipeline schedule: flush \|$", printed[0]), printed[0]
    assert list(fields(printed[-1])) == FIELDS
    rows = [json.loads(x) for x in open(tmp_path / "m.jsonl")]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]  # one row per iteration
    assert KEYS <= set(rows[0]) and rows[0]["global_batch_size"] == 8


def test_line_averages_the_interval(tmp_path, caplog) -> None:
    """Losses over the advanced iterations, time over all; a skipped step counts, its nan
    loss is a nan iteration, and the line of a skipped step has no grad norm."""
    s = sink(tmp_path, train_iters=8, log_interval=4)
    steps = [(1, 6.0, 0, 0.4), (2, 4.0, 0, 0.2), (3, float("nan"), 1, 0.1), (4, 2.0, 0, 0.1),
             (5, 1.0, 0, 0.1), (6, 1.0, 0, 0.1), (7, 1.0, 0, 0.1), (8, float("inf"), 1, 0.1)]
    for it, loss, skipped, seconds in steps:
        s.record(record(it, loss, skipped, seconds))
    first, fourth, eighth = [fields(ln) for ln in lines(caplog) if "iteration" in ln]
    ms = "elapsed time per iteration (ms)"
    # iteration 1 is a first look: it stays in the interval of iterations 1-4
    assert fourth["lm loss"] == "4.000000E+00" and fourth[ms] == "200.0"
    assert fourth["number of skipped iterations"] == "  1"
    assert fourth["number of nan iterations"] == "  1"
    assert fourth["samples/s"] == "40.0" and fourth["grad norm"] == "1.250"
    assert eighth["lm loss"] == "1.000000E+00" and eighth[ms] == "100.0"
    assert "grad norm" not in eighth and eighth["number of nan iterations"] == "  1"


def test_log_interval_one_does_not_count_iteration_one_twice(tmp_path, caplog) -> None:
    s = sink(tmp_path, train_iters=2, log_interval=1)
    s.record(record(1, 6.0, seconds=0.3))
    s.record(record(2, 2.0, seconds=0.1))
    second = fields([ln for ln in lines(caplog) if "iteration" in ln][1])
    assert second["lm loss"] == "2.000000E+00"
    assert second["elapsed time per iteration (ms)"] == "100.0"


def test_bert_losses_and_validation_block(tmp_path, caplog) -> None:
    """`lm loss` is the LM loss alone and `sop loss` the sentence-order loss, in the line
    and in the validation block (each with its PPL) between dashes as long as the text."""
    s = sink(tmp_path, train_iters=2, log_interval=2)
    s.record(record(1, 3.0, sop=0.5))
    s.validation({"split": "valid", "iteration": 1, "val_loss": 3.5, "val_ppl": 33.1,
                  "val_lm_loss": 3.0, "val_sop_loss": 0.5, "consumed_samples": 8})
    s.record(record(2, 3.0, sop=0.5))
    s.validation({"split": "valid", "iteration": 2, "val_loss": 3.5, "val_ppl": 33.1,
                  "val_lm_loss": 3.0, "val_sop_loss": 0.5, "consumed_samples": 16},
                 "iteration 2 on validation set")
    out = lines(caplog)
    line = fields(out[0])
    assert line["lm loss"] == "3.000000E+00" and line["sop loss"] == "5.000000E-01"
    assert list(line).index("sop loss") == list(line).index("lm loss") + 1
    text = (" validation loss at iteration 1 | lm loss value: 3.000000E+00 | lm loss PPL: "
            "2.008554E+01 | sop loss value: 5.000000E-01 | sop loss PPL: 1.648721E+00 | ")
    assert out[1:4] == ["-" * (len(text) + 1), text, "-" * (len(text) + 1)]
    assert out[-2].startswith(" validation loss at iteration 2 on validation set | ")


def test_log_throughput_moves_tflops_to_megatron_field(tmp_path, caplog) -> None:
    s = sink(tmp_path, train_iters=1, log_throughput=True)
    s.record(record(1))
    names = list(fields(lines(caplog)[0]))
    assert names[2] == "throughput per GPU (TFLOP/s/GPU)" and "TFLOP/s/GPU" not in names
    assert "| throughput per GPU (TFLOP/s/GPU): 2.0 |" in lines(caplog)[0]


def test_2bw_line_names_the_weight_version(tmp_path, caplog) -> None:
    s = sink(tmp_path, schedule="2bw", train_iters=3)
    s.record(record(3))
    assert lines(caplog)[0].endswith("| pipeline schedule: 2bw | weight version: 3 |")


def _scalars(folder: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(folder)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_tags_and_flags(tmp_path) -> None:
    tb = str(tmp_path / "tb")
    s = sink(tmp_path, train_iters=4, log_interval=2, tensorboard_dir=tb,
             log_timers_to_tensorboard=True, log_throughput=True,
             log_loss_scale_to_tensorboard=False, log_validation_ppl_to_tensorboard=True,
             log_world_size_to_tensorboard=True, tensorboard_log_interval=2)
    for it in range(1, 5):
        s.record(record(it, skipped=int(it == 4)))
    s.validation({"split": "valid", "iteration": 4, "val_loss": 2.0, "val_ppl": 7.39,
                  "consumed_samples": 32})
    s.close()
    got = _scalars(tb)
    pairs = ["learning-rate", "batch-size", "lm loss", "grad-norm", "world-size",
             "lm loss validation", "lm loss validation ppl"]
    assert set(got) == ({*pairs, *(t + " vs samples" for t in pairs)}
                        | {"iteration-time", "throughput"})
    assert got["lm loss"] == [(2, 4.0), (4, 4.0)] and got["lm loss vs samples"][0] == (16, 4.0)
    assert got["grad-norm"] == [(2, 1.25)]  # none for the skipped step 4
    assert got["iteration-time"] == [(2, pytest.approx(0.1)), (4, pytest.approx(0.1))]
    assert [step for step, _ in got["throughput"]] == [1, 2, 4]
    assert got["lm loss validation vs samples"] == [(32, 2.0)]


def test_resume_drops_tensorboard_events_past_the_checkpoint(tmp_path) -> None:
    """A run that crashed at iteration 4 after saving at 2: iteration scalars past 2 and
    sample scalars past 16 go; the resumed run's are the only ones left."""
    tb = str(tmp_path / "tb")
    crashed = sink(tmp_path, train_iters=4, tensorboard_dir=tb)
    for it in range(1, 5):
        crashed.record(record(it, loss=9.0))
    crashed.close()
    resumed = sink(tmp_path, start=2, train_iters=4, tensorboard_dir=tb)
    for it in range(3, 5):
        resumed.record(record(it, loss=1.0))
    resumed.close()
    got = _scalars(tb)
    assert got["lm loss"] == [(1, 9.0), (2, 9.0), (3, 1.0), (4, 1.0)]
    assert got["lm loss vs samples"] == [(8, 9.0), (16, 9.0), (24, 1.0), (32, 1.0)]


def test_fresh_run_keeps_an_earlier_runs_tensorboard_events(tmp_path) -> None:
    """A run from iteration 0 into a folder with another run's events adds its own beside
    them (as the metrics file appends); only a resume drops what it writes again."""
    tb = str(tmp_path / "tb")
    earlier = sink(tmp_path, train_iters=2, tensorboard_dir=tb)
    for it in (1, 2):
        earlier.record(record(it, loss=9.0))
    earlier.close()
    fresh = sink(tmp_path, train_iters=2, tensorboard_dir=tb)
    fresh.record(record(1, loss=1.0))
    fresh.close()
    assert sorted(_scalars(tb)["lm loss"]) == [(1, 1.0), (1, 9.0), (2, 9.0)]


def test_missing_tensorboard_is_a_warning(tmp_path, caplog, monkeypatch) -> None:
    """As in Megatron-LM: no tensorboard package, no TensorBoard logs, the run goes on."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` fails
    for name in [n for n in sys.modules if n.startswith("torch.utils.tensorboard")]:
        monkeypatch.delitem(sys.modules, name)
    s = sink(tmp_path, train_iters=1, tensorboard_dir=str(tmp_path / "tb"))
    s.record(record(1))
    s.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no TensorBoard logs will be written" in warnings[0]
    assert any("iteration        1/" in ln for ln in lines(caplog))


class _FakeWandb:
    def __init__(self):
        self.logged: list[tuple[dict, int]] = []
        self.init_kwargs: dict = {}

    def init(self, **kwargs) -> None:
        self.init_kwargs = kwargs

    def log(self, values: dict, step: int) -> None:
        self.logged.append((values, step))

    def finish(self) -> None:
        self.logged.append(({"finished": True}, -1))


def test_wandb_gets_the_scalars(tmp_path, monkeypatch) -> None:
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    s = sink(tmp_path, train_iters=1, wandb_project="p", wandb_exp_name="e",
             save=str(tmp_path / "ckpt"))
    s.record(record(1))
    s.close()
    assert fake.init_kwargs["project"] == "p" and fake.init_kwargs["name"] == "e"
    assert fake.init_kwargs["dir"] == str(tmp_path / "ckpt" / "wandb")
    tags = {tag for values, _ in fake.logged for tag in values}
    assert {"samples vs steps", "learning-rate", "batch-size", "lm loss", "loss-scale",
            "grad-norm", "finished"} == tags


def test_wandb_missing_is_refused(tmp_path, monkeypatch) -> None:
    """Megatron-LM fails on `import wandb` too; here it is one line naming the flag."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(UserError) as err:
        sink(tmp_path, wandb_project="p", save=str(tmp_path))
    assert err.value.where == "--wandb-project" and "pip install wandb" in err.value.fix


def test_logging_flags_reach_train_config() -> None:
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2",
            "--lr", "1e-2", "--mock-data"]
    t = config_from_args(parse_args("gpt", base + [
        "--log-throughput", "--timing-log-level", "2", "--log-timers-to-tensorboard",
        "--no-log-loss-scale-to-tensorboard", "--log-validation-ppl-to-tensorboard",
        "--tensorboard-log-interval", "5", "--wandb-project", "p", "--log-params-norm",
        "--log-num-zeros-in-grad", "--log-memory-to-tensorboard", "--timing-log-option",
        "all"]), "gpt", 1, 127)
    o, t = t.optimizer, t.train
    assert (t.log_throughput, t.log_timers_to_tensorboard, t.log_loss_scale_to_tensorboard,
            t.log_validation_ppl_to_tensorboard, t.tensorboard_log_interval,
            t.wandb_project) == (True, True, False, True, 5, "p")
    assert (t.log_params_norm, t.log_num_zeros_in_grad, o.log_num_zeros_in_grad,
            t.log_memory_to_tensorboard, t.timing_log_level, t.timing_log_option) == (
        True, True, True, True, 2, "all")
    with pytest.raises(UserError, match="--timing-log-level"):
        parse_args("gpt", base + ["--timing-log-level", "3"])


def test_tiny_bert_run_prints_megatron_lines(tmp_path) -> None:
    """A real run (one process): the arguments block and parameter count at start, the
    line (with num zeros and params norm), the memory report after the first two lines,
    the timers after each, the validation block with each BERT loss, the test set after
    training, the TensorBoard tags read back, and the metrics file's keys."""
    tb, metrics = tmp_path / "tb", tmp_path / "m.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_bert.py"), *TINY, "--num-layers", "2",
           "--train-iters", "3", "--log-interval", "2", "--eval-interval", "2",
           "--tensorboard-dir", str(tb), "--metrics-file", str(metrics),
           "--log-params-norm", "--log-num-zeros-in-grad", "--timing-log-level", "1",
           "--log-timers-to-tensorboard", "--log-memory-to-tensorboard"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stderr.splitlines()
    start = out.index("------------------------ arguments ------------------------")
    end = out.index("-------------------- end of arguments ---------------------")
    names = [ln.split()[0] for ln in out[start + 1:end]]
    assert names == sorted(names, key=str.lower) and "world_size" in names
    assert f"  log_params_norm {'.' * 33} True" in out[start:end]
    assert any(re.fullmatch(r" > number of parameters on \(tensor, pipeline\) model parallel "
                            r"rank \(0, 0\): \d+", ln) for ln in out)
    printed = [ln for ln in out if re.match(STAMP + " iteration", ln)]
    assert [int(re.search(r"iteration +(\d+)/", ln).group(1)) for ln in printed] == [1, 2, 3]
    assert list(fields(printed[0])) == (FIELDS[:5] + ["sop loss"] + FIELDS[5:7]
                                        + ["num zeros", "params norm"] + FIELDS[7:])
    assert [ln.split(" | ")[0] for ln in out if ln.startswith("[Rank ")] == [
        "[Rank 0] (after 1 iterations) memory (MB)", "[Rank 0] (after 2 iterations) memory (MB)"]
    assert sum(ln.startswith("Theoretical memory footprints: ") for ln in out) == 2
    assert sum(ln == "(min, max) time across ranks (ms):" for ln in out) == 3
    assert any(re.fullmatch(r"    forward-backward \.+: \(\d+\.\d\d, \d+\.\d\d\)", ln)
               for ln in out)
    valid = [i for i, ln in enumerate(out) if ln.startswith(" validation loss at iteration")]
    assert len(valid) == 3 and "on validation set" in out[valid[1]]
    assert out[valid[2]].startswith(" validation loss at iteration 3 on test set | lm loss value")
    assert re.match(r" validation loss at iteration 2 \| lm loss value: \S+ \| lm loss PPL: \S+ \|"
                    r" sop loss value: \S+ \| sop loss PPL: \S+ \| $", out[valid[0]])
    assert out[valid[0] - 1] == out[valid[0] + 1] == "-" * (len(out[valid[0]]) + 1)
    tags = set(_scalars(str(tb)))
    for tag in ("learning-rate", "batch-size", "lm loss", "sop loss", "loss-scale", "grad-norm",
                "num-zeros", "params-norm", "lm loss validation", "sop loss validation"):
        assert {tag, tag + " vs samples"} <= tags, tag
    assert {"mem-rss-bytes", "mem-max-rss-bytes", "forward-backward-time", "optimizer-time",
            "all-grads-sync-time", "iteration-time"} <= tags
    rows = [json.loads(x) for x in open(metrics)]
    memory = [r for r in rows if r["split"] == "memory"]
    assert len(memory) == 2 and len(memory[0]["optimizer_state_bytes"]) == 1
    assert memory[1]["iteration"] == 1 and memory[1]["activation_bytes_per_microbatch"][0] > 0
    rows = [r for r in rows if r["split"] != "memory"]
    assert KEYS | {"sop_loss", "global_batch_size", "weight_version", "num_zeros",
                   "params_norm"} <= set(rows[0])
    assert [r["iteration"] for r in rows if r["split"] == "train"] == [1, 2, 3]
    assert [r["iteration"] for r in rows if r["split"] == "test"] == [3]


def _megatron_num_floating_point_operations(a: dict, batch_size: int) -> float:
    """Megatron-LM's num_floating_point_operations (training.py at core_v0.16.1, the
    standard-transformer branch with its MLA part, shared experts and MTP, without
    linear attention), transcribed here from its text over Megatron-LM's argument names,
    independently of the package's count."""
    h, s, layers = a["hidden_size"], a["seq_length"], a["num_layers"]
    heads = a["num_attention_heads"]
    groups = a["num_query_groups"] if a["group_query_attention"] else heads
    if a["num_experts"] is None:
        dense, moe, routed_to = layers, 0, 0
    else:
        freq = a["moe_layer_freq"]  # an int N (every N-th layer) or one 0 / 1 per layer
        pattern = ([1 if i % freq == 0 else 0 for i in range(layers)]
                   if isinstance(freq, int) else freq)
        moe, routed_to = sum(pattern), a["moe_router_topk"]
        dense = layers - moe
    mtp = a["mtp_num_layers"] or 0
    last_is_moe = 0 if a["num_experts"] is None else pattern[-1]
    moe, dense = moe + last_is_moe * mtp, dense + (1 - last_is_moe) * mtp
    layers += mtp
    moe_ffn = a["moe_ffn_hidden_size"] if a["moe_ffn_hidden_size"] is not None \
        else a["ffn_hidden_size"]
    shared_ffn = a["moe_shared_expert_intermediate_size"] or 0
    ffn_expansion = 3 if a["swiglu"] else 2
    query, key, value = (a["kv_channels"] * heads, a["kv_channels"] * groups,
                         a["kv_channels"] * groups)
    self_attn = 3 * 2 * (h * (query + key + value) + query * s / 2 * 2 + query * h)
    if a["multi_latent_attention"]:
        qk, pe, v = a["qk_head_dim"], a["qk_pos_emb_head_dim"], a["v_head_dim"]
        q_term = (h * heads * (qk + pe) if a["q_lora_rank"] is None
                  else a["q_lora_rank"] * (h + heads * (qk + pe) + 1))
        self_attn = 3 * 2 * (q_term + a["kv_lora_rank"] * (h + heads * (qk + v) + 1)
                             + h * pe + heads * v * h + s * heads * (qk + pe) / 2
                             + s * heads * v / 2)
    return batch_size * s * (
        3 * 2 * h * (a["ffn_hidden_size"] * ffn_expansion * dense
                     + moe_ffn * routed_to * ffn_expansion * moe
                     + shared_ffn * ffn_expansion * moe)
        + self_attn * layers + 3 * 2 * mtp * (3 * h + 2 * h * h)
        + 3 * 2 * h * a["padded_vocab_size"] * (mtp + 1))


def _megatron_args(args, vocab: int) -> dict:
    """The values Megatron-LM's validate_args derives (kv-channels, the MLP width,
    the padded vocabulary), from the parsed flags."""
    a = dict(vars(args))
    h = a["hidden_size"]
    a["kv_channels"] = a["kv_channels"] or h // a["num_attention_heads"]
    if a["ffn_hidden_size"] is None:
        a["ffn_hidden_size"] = int((4 * h * 2 / 3) / 64) * 64 if a["swiglu"] else 4 * h
    multiple = a["make_vocab_size_divisible_by"] * a["tensor_model_parallel_size"]
    a["padded_vocab_size"] = -(-vocab // multiple) * multiple
    return a


FLOP_SHAPES = {  # name: (model, flags, tokenizer vocabulary)
    "gpt 345m": ("gpt", "--num-layers 24 --hidden-size 1024 --num-attention-heads 16 "
                 "--seq-length 1024 --max-position-embeddings 1024", 50257),
    "gpt, full recomputation": (
        "gpt", "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --recompute-granularity full --recompute-method "
        "uniform --recompute-num-layers 1", 127),
    "llama-3-8b, seq 8192": (
        "gpt", "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 "
        "--group-query-attention --num-query-groups 8 --ffn-hidden-size 14336 --swiglu "
        "--normalization RMSNorm --position-embedding-type rope "
        "--untie-embeddings-and-output-weights --disable-bias-linear --seq-length 8192 "
        "--max-position-embeddings 8192", 128256),
    "bert large": ("bert", "--num-layers 24 --hidden-size 1024 --num-attention-heads 16 "
                   "--seq-length 512 --max-position-embeddings 512", 30522),
    "mixtral 8x7b": (
        "gpt", "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 "
        "--group-query-attention --num-query-groups 8 --ffn-hidden-size 14336 --swiglu "
        "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
        "--untie-embeddings-and-output-weights --num-experts 8 --moe-router-topk 2 "
        "--seq-length 4096 --max-position-embeddings 4096", 32000),
    "moe every 2nd layer, kv-channels, own expert width": (
        "gpt", "--num-layers 4 --hidden-size 256 --num-attention-heads 4 --kv-channels 32 "
        "--seq-length 128 --max-position-embeddings 128 --num-experts 4 --moe-router-topk 2 "
        "--moe-ffn-hidden-size 96 --moe-layer-freq 2", 1000),
    "deepseek-v3-like: multi-latent attention, moe": (
        "gpt", "--num-layers 4 --hidden-size 7168 --num-attention-heads 128 "
        "--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 "
        "--qk-pos-emb-head-dim 64 --v-head-dim 128 --ffn-hidden-size 18432 --swiglu "
        "--normalization RMSNorm --disable-bias-linear --num-experts 8 --moe-router-topk 2 "
        "--moe-ffn-hidden-size 2048 --moe-layer-freq 2 --moe-shared-expert-intermediate-size "
        "2048 --seq-length 4096 --max-position-embeddings 4096", 129280),
    "moe per-layer pattern, dense first and last layers": (
        "gpt", "--num-layers 5 --hidden-size 256 --num-attention-heads 4 --seq-length 128 "
        "--max-position-embeddings 128 --num-experts 4 --moe-router-topk 2 "
        "--moe-ffn-hidden-size 96 --moe-layer-freq ([0]*1+[1]*3+[0]*1)", 1000),
    "multi-token prediction, moe last layer": (
        "gpt", "--num-layers 3 --hidden-size 256 --num-attention-heads 4 --seq-length 128 "
        "--max-position-embeddings 128 --position-embedding-type rope --num-experts 4 "
        "--moe-router-topk 2 --moe-layer-freq ([0]*1+[1]*2) --mtp-num-layers 2", 1000),
    "mla without a query latent": (
        "gpt", "--num-layers 2 --hidden-size 256 --num-attention-heads 4 "
        "--multi-latent-attention --kv-lora-rank 64 --qk-head-dim 32 --qk-pos-emb-head-dim 16 "
        "--v-head-dim 48 --seq-length 128 --max-position-embeddings 128", 1000),
}


@pytest.mark.parametrize("name", list(FLOP_SHAPES))
def test_flops_equal_megatrons_formula(name: str) -> None:
    """The logged FLOPs per iteration are Megatron-LM's num_floating_point_operations (to
    1e-6) for GPT, Llama-3-8B-like (GQA, SwiGLU, seq 8192), BERT, MoE and multi-latent
    attention shapes; full recomputation changes nothing, as there."""
    from megatron_2bw.training.metrics import transformer_flops

    model, flags, vocab = FLOP_SHAPES[name]
    args = parse_args(model, flags.split() + ["--micro-batch-size", "2", "--global-batch-size",
                                              "8", "--train-iters", "1", "--lr", "1e-4",
                                              "--mock-data"])
    run = config_from_args(args, model, 1, vocab)
    expected = _megatron_num_floating_point_operations(_megatron_args(args, vocab), 8)
    assert transformer_flops(8, run.model) == pytest.approx(expected, rel=1e-6)


def test_num_zeros_and_params_norm_fields(tmp_path, caplog) -> None:
    """Megatron-LM's `num zeros` (its float) and `params norm` come after `grad norm`; a
    skipped step has neither grad norm nor num zeros."""
    s = sink(tmp_path, train_iters=2, log_interval=1)
    s.record({**record(1), "num_zeros": 19.0, "params_norm": 17.5466})
    s.record({**record(2, skipped=1), "num_zeros": None, "params_norm": 17.5466})
    first, second = [fields(ln) for ln in lines(caplog) if "iteration" in ln]
    names = list(first)
    assert names[names.index("grad norm") + 1:names.index("grad norm") + 3] == [
        "num zeros", "params norm"]
    assert first["num zeros"] == "19.0" and first["params norm"] == "17.547"
    assert "num zeros" not in second and second["params norm"] == "17.547"


def test_updater_counts_zero_gradients_once() -> None:
    """--log-num-zeros-in-grad: zero entries of the gradients that count in the norm (not
    a tensor-parallel duplicate), none for a skipped step."""
    from megatron_2bw.optim.updater import MegatronUpdater, OptimizerConfig, ParamInfo

    params = [torch.nn.Parameter(torch.ones(6)), torch.nn.Parameter(torch.ones(4))]
    infos = [ParamInfo("a", True, True, False), ParamInfo("b", True, False, False)]
    updater = MegatronUpdater(params, infos, OptimizerConfig(log_num_zeros_in_grad=True))
    flat = torch.tensor([0.0, 1.0, 0.0, 2.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0])
    views = [flat[:6], flat[6:]]
    updater.start_step(0, flat, views)
    assert updater.finish_step(0, flat, views, params, params)["num_zeros"] == 3.0
    flat[1] = float("inf")
    updater.start_step(1, flat, views)
    assert updater.finish_step(1, flat, views, params, params)["num_zeros"] is None
    plain = MegatronUpdater(params, infos, OptimizerConfig())
    plain.start_step(0, flat.nan_to_num(posinf=1.0), views)
    assert "num_zeros" not in plain.finish_step(0, flat, views, params, params)


def test_params_norm_counts_each_parameter_once() -> None:
    """Each rank's share: replicas by 1 / (DP x CP), experts by 1 / EDP, duplicates not."""
    from megatron_2bw.training.rank_reports import weighted_squares

    dense, dup, expert = torch.full((4,), 2.0), torch.full((9,), 5.0), torch.full((2,), 3.0)
    got = weighted_squares([dense, dup, expert], [True, False, True], [False, False, True],
                           1 / 4, 1 / 2)
    assert got == pytest.approx(16 / 4 + 18 / 2)


def test_timers_block_formats(caplog) -> None:
    """Megatron-LM's block: ms per iteration, ranks that did not run a phase left out."""
    from megatron_2bw.training.timers import timers_block

    names = ("forward-backward", "optimizer")
    seconds = torch.tensor([[0.2, 0.0], [0.4, 0.02]])  # two ranks, 2 iterations
    assert timers_block(names, seconds, 2, "minmax").splitlines() == [
        "(min, max) time across ranks (ms):",
        "    forward-backward ...............................: (100.00, 200.00)",
        "    optimizer ......................................: (10.00, 10.00)"]
    assert timers_block(names, seconds, 2, "max").splitlines()[1:] == [
        "    forward-backward ...............................: 200.00",
        "    optimizer ......................................: 10.00"]
    assert timers_block(names, seconds, 2, "all").splitlines() == [
        "times across ranks (ms):", "  forward-backward:", "     rank  0: 100.00",
        "     rank  1: 200.00", "  optimizer:", "     rank  1: 10.00"]
    assert timers_block(names, torch.zeros(2, 2), 1, "minmax") is None


def test_timers_time_actions_and_the_step_under_way() -> None:
    """Each action's time goes to its phases; the step callback, which runs inside the
    optimizer step, counts that step up to the callback in the interval it ends."""
    from megatron_2bw.schedules.actions import ActionKind as K
    from megatron_2bw.training.timers import Timers

    timers = Timers(2, torch.device("cpu"))
    seen = []

    def step(action):
        time.sleep(0.02)
        seen.append(timers.take())
    handlers = {K.FORWARD: lambda a: time.sleep(0.01), K.OPTIMIZER_STEP: step}
    handlers = {kind: timers.instrument(kind, h) for kind, h in handlers.items()}
    handlers[K.FORWARD](None)
    handlers[K.OPTIMIZER_STEP](None)
    taken = dict(zip(timers.names, seen[0]))
    assert taken["forward-compute"] >= 0.01 and taken["forward-backward"] >= 0.01
    assert taken["optimizer"] >= 0.02 and taken["backward-compute"] == 0.0
    assert dict(zip(timers.names, timers.take()))["optimizer"] < 0.02  # the step's tail


def test_theoretical_memory_is_megatrons_estimate() -> None:
    """For a plain GPT, Megatron-LM's closed form: (12h² + 4h) per layer + 2h, hV for the
    embedding, 18 bytes per parameter of the most loaded shard, and the activations of
    compute_activation_memory_without_sp."""
    from megatron_2bw.models.config import ModelConfig
    from megatron_2bw.training.config import ParallelConfig
    from megatron_2bw.training.theoretical_memory import MemoryInputs, theoretical_memory_lines

    l, h, s, v, b = 24, 1024, 1024, 50304, 4
    m = ModelConfig(model="gpt", num_layers=l, hidden_size=h, num_attention_heads=16,
                    seq_length=s, vocab_size=v)
    got = theoretical_memory_lines(m, MemoryInputs(ParallelConfig(world_size=2,
                                                                  pipeline_parallel=2), b, 8))
    block = l * (12 * h * h + 4 * h) + 2 * h
    assert got[0] == f"Number of parameters in transformer block in billions: {block / 1e9: .2f}"
    assert got[2] == f"Total number of parameters in billions: {(block + h * v) / 1e9:.2f}"
    weights = (block / 2 + h * v) * 18 / 2**20
    activations = (s * b * h * 34 * l + 8 * s * b * 2 + s * b * h * 2) * 1.05 / 2**20
    assert got[-2] == (f"Theoretical memory footprints: weight and optimizer={weights:.2f} MB, "
                       f"activation={activations:.2f} MB, total={weights + activations:.2f} MB")
    # --mtp-num-layers 2: Megatron-LM's "mtp block" line, on the most loaded (last) shard
    mtp = ModelConfig(model="gpt", num_layers=l, hidden_size=h, num_attention_heads=16,
                      seq_length=s, vocab_size=v, position_embedding_type="rope",
                      mtp_num_layers=2)
    got = theoretical_memory_lines(mtp, MemoryInputs(ParallelConfig(world_size=2,
                                                                    pipeline_parallel=2), b, 8))
    block_mtp = 2 * (12 * h * h + 4 * h)
    assert got[1] == f"Number of parameters in mtp block in billions: {block_mtp / 1e9: .2f}"
    assert got[4] == ("Number of parameters in most loaded shard in billions: "
                      f"{(block / 2 + block_mtp + h * v) / 1e9:.4f}")


def test_arguments_block_is_megatrons() -> None:
    from megatron_2bw.training.args_dump import arguments_block

    assert arguments_block({"seq_length": 16, "Bf16": False}) == [
        "------------------------ arguments ------------------------",
        f"  Bf16 {'.' * 44} False", f"  seq_length {'.' * 38} 16",
        "-------------------- end of arguments ---------------------"]
