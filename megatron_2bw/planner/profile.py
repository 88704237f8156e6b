"""`python -m megatron_2bw.planner profile`: measure the real megatron-core pieces.

Builds a one-layer megatron-core GPT/BERT (the project's own `build_stage`, local layer
spec) on the current device (CUDA when present, else CPU with the compat shims) and
times, at each microbatch size, forward and backward of

- one `TransformerLayer` (without and with full recomputation through megatron-core's
  `tensor_parallel.checkpoint`, the function its `TransformerBlock` uses),
- the embedding, and
- the output side (final LayerNorm, BERT's LM head, logit layer, vocab-parallel loss),

and counts the bytes each saves for backward with `torch.autograd.graph.
saved_tensors_hooks` (parameters excluded, shared storage counted once). It writes the
profile JSON that `compute.load_profile` reads.

`--tensor-parallel-sizes 1,2` also measures the layer and the output side split over k
processes by megatron-core's tensor parallelism (gloo on CPU, NCCL with one GPU per
process), with the all-reduce of one [s, b, h] activation and of one [s, b] fp32 loss
term timed beside them in the same processes, so that the planner can take the
communication out and learn how much of a layer tensor parallelism does not split
(LayerNorms, residuals, dropout, launches; `compute.amdahl_time`).

`--concurrent-processes N` measures the one-process pieces in N processes at once, each
timing its own copy: on a CPU the processes that train together share memory bandwidth
and caches, which a lone process on an idle machine does not see.

This is the one planner module that imports torch and megatron-core, lazily, from
`main`; it starts a one-process group only because megatron-core's layers read
`parallel_state`. Planning itself never imports it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from .compute import PartTiming, Profile, ProfileEntry, profile_from_dict
from .subcommand import SubcommandParser

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = SubcommandParser(prog="python -m megatron_2bw.planner profile", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("gpt", "bert"), default="gpt")
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--ffn-hidden-size", type=int)
    p.add_argument("--num-attention-heads", type=int, required=True)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--vocab-size", type=int, help="default 50257 (gpt) or 30522 (bert)")
    p.add_argument("--num-layers", type=int, help="accepted for symmetry with the planner; "
                   "one layer is measured")
    p.add_argument("--micro-batch-sizes", default="1,2,4,8", help="comma-separated")
    p.add_argument("--tensor-parallel-sizes", default="1",
                   help="comma-separated; each k > 1 runs k processes (k GPUs on CUDA)")
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"),
                   help="default fp16 on CUDA, fp32 on CPU")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs per measurement in each round (median)")
    p.add_argument("--rounds", type=int, default=3,
                   help="passes over the microbatch sizes, one after the other; each time is "
                   "the median over the passes, so a slow spell of the machine lands on "
                   "every size once instead of on whichever size it was measuring")
    p.add_argument("--concurrent-processes", type=int, default=1, metavar="N",
                   help="measure the one-process pieces in N processes at once, each "
                   "timing its own copy, as the N devices of one node compute at once in "
                   "training; on a CPU machine set it to the processes that train on it "
                   "(their cores share memory bandwidth and caches); N GPUs on CUDA")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    p.add_argument("--output", required=True, help="profile JSON to write")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sizes = sorted({int(x) for x in args.micro_batch_sizes.split(",") if x})
    except ValueError:
        build_parser().error(f"--micro-batch-sizes: expected integers, got {args.micro_batch_sizes!r}")
    if not sizes or min(sizes) < 1:
        build_parser().error("--micro-batch-sizes: need positive integers")
    tp_sizes = _tensor_parallel_sizes(args.tensor_parallel_sizes, args.num_attention_heads)
    for flag in ("hidden_size", "num_attention_heads", "seq_length", "repeats", "rounds",
                 "concurrent_processes"):
        if getattr(args, flag) < 1:
            build_parser().error(f"--{flag.replace('_', '-')} must be positive")
    _check_gpus("--concurrent-processes", args.concurrent_processes)
    if args.hidden_size % args.num_attention_heads:
        build_parser().error(f"--hidden-size {args.hidden_size} must be divisible by "
                             f"--num-attention-heads {args.num_attention_heads}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", module=r"megatron\.")  # apex / TE fallbacks
    from megatron_2bw.models.compat import apply_cpu_shims
    apply_cpu_shims()
    profile = run_profile(model=args.model, hidden_size=args.hidden_size,
                          ffn_hidden_size=args.ffn_hidden_size,
                          num_attention_heads=args.num_attention_heads,
                          seq_length=args.seq_length,
                          vocab_size=args.vocab_size or (50257 if args.model == "gpt" else 30522),
                          micro_batch_sizes=sizes, dtype=args.dtype, repeats=args.repeats,
                          warmup=args.warmup, tensor_parallel_sizes=tp_sizes,
                          rounds=args.rounds, concurrent=args.concurrent_processes)
    Path(args.output).write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    for e in profile.entries:
        sys.stdout.write(f"b={e.micro_batch_size}: layer F {e.layer.forward_s * 1e3:.2f} ms, "
                         f"B {e.layer.backward_s * 1e3:.2f} ms, B with recompute "
                         f"{e.layer.recompute_backward_s * 1e3:.2f} ms, saved "
                         f"{(e.layer.activation_bytes_float + e.layer.activation_bytes_other) / 1e6:.1f} MB\n")
    for k, entries in sorted(profile.tensor_parallel.items()):
        for e in entries:
            sys.stdout.write(f"tp={k} b={e.micro_batch_size}: layer F {e.layer.forward_s * 1e3:.2f} "
                             f"ms, B {e.layer.backward_s * 1e3:.2f} ms (all-reduces included: "
                             f"{e.allreduce_s * 1e3:.2f} ms each)\n")
    sys.stdout.write(f"profile of {profile.device} written to {args.output}\n")
    return 0


def _tensor_parallel_sizes(text: str, heads: int) -> list[int]:
    """The sizes of --tensor-parallel-sizes, or a one-line error naming the flag."""
    try:
        sizes = sorted({int(x) for x in text.split(",") if x})
    except ValueError:
        build_parser().error(f"--tensor-parallel-sizes: expected integers, got {text!r}")
    if not sizes or min(sizes) < 1 or any(heads % k for k in sizes):
        build_parser().error(f"--tensor-parallel-sizes {text}: need positive sizes that "
                             f"divide --num-attention-heads {heads}")
    _check_gpus(f"--tensor-parallel-sizes {text}", max(sizes))
    return sizes


def _check_gpus(flag: str, processes: int) -> None:
    """On CUDA each process needs its own GPU: a one-line error naming the flag if not."""
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and processes > gpus:
        build_parser().error(f"{flag}: {processes} processes need {processes} GPUs, this "
                             f"machine has {gpus}")


@contextmanager
def _single_process_megatron() -> Iterator[None]:
    """A one-rank process group and megatron-core parallel_state (tp = pp = 1)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    owned = not dist.is_initialized()
    if owned:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        store = dist.FileStore(tempfile.mktemp(prefix="m2bw-profile-"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if owned:
            dist.destroy_process_group()


def run_profile(*, model: str, hidden_size: int, ffn_hidden_size: int | None,
                num_attention_heads: int, seq_length: int, vocab_size: int,
                micro_batch_sizes: list[int], dtype: str | None = None, repeats: int = 3,
                warmup: int = 2, tensor_parallel_sizes: tuple[int, ...] = (1,),
                rounds: int = 1, concurrent: int = 1) -> Profile:
    """Measure and return a `Profile` (see the module docstring); `concurrent` > 1
    measures the one-process pieces in that many processes at once."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[
        dtype or ("fp16" if device.type == "cuda" else "fp32")]
    spec = {"model": model, "hidden_size": hidden_size,
            "ffn_hidden_size": ffn_hidden_size or 4 * hidden_size,
            "num_attention_heads": num_attention_heads, "seq_length": seq_length,
            "vocab_size": vocab_size}
    shape = dict(spec, micro_batch_sizes=list(micro_batch_sizes), dtype=str(torch_dtype),
                 repeats=repeats, warmup=warmup, rounds=rounds)
    if concurrent > 1:
        entries, params = _profile_concurrently(concurrent, shape)
    else:
        with _single_process_megatron():
            parts = one_layer_parts(shape, torch_dtype, device)
            entries = in_rounds(parts.entry, micro_batch_sizes, rounds, parts)
            params = parts.param_counts()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    split = {k: _profile_tensor_parallel(k, shape) for k in tensor_parallel_sizes if k > 1}
    return Profile(device=name, dtype_bytes=torch.finfo(torch_dtype).bits // 8, model=spec,
                   entries=entries, params=params, tensor_parallel=split)


def one_layer_parts(shape: dict, dtype, device, tensor_parallel: int = 1) -> "_Parts":
    """The timed pieces of a one-layer stage of `shape` (the profile's model fields, plus
    `repeats` and `warmup`) at `tensor_parallel`, in train mode; megatron-core's
    parallel_state must already be set up for that size."""
    from megatron_2bw.models.compat import model_parallel_manual_seed
    from megatron_2bw.models.config import ModelConfig, pad_vocab_size
    from megatron_2bw.models.stages import build_stage

    model_parallel_manual_seed(1234)
    config = ModelConfig(model=shape["model"], num_layers=1, hidden_size=shape["hidden_size"],
                         ffn_hidden_size=shape.get("ffn_hidden_size"),
                         num_attention_heads=shape["num_attention_heads"],
                         seq_length=shape["seq_length"],
                         vocab_size=pad_vocab_size(shape["vocab_size"], 128, tensor_parallel),
                         params_dtype=dtype, bert_binary_head=False)
    stage = build_stage(config, 0, 1, device=device)
    stage.train()
    return _Parts(stage, config, device, shape.get("repeats", 3), shape.get("warmup", 2))


def in_rounds(measure: Callable, sizes: list[int], rounds: int, parts: "_Parts") -> tuple:
    """`measure(b)` for every size, `rounds` passes over the sizes in turn, combined by
    `median_of`; after the first pass one warm-up run per measurement is enough
    (`parts.warmup` is lowered for the later passes and restored)."""
    passes, warmup = [], parts.warmup
    try:
        for r in range(rounds):
            parts.warmup = warmup if r == 0 else min(warmup, 1)
            passes.append([measure(b) for b in sizes])
    finally:
        parts.warmup = warmup
    return tuple(median_of(list(per_size)) for per_size in zip(*passes))


def median_of(items: list):
    """Field by field median of equal dataclasses (nested ones too); ints (the
    microbatch size) are taken from the first."""
    first = items[0]
    if isinstance(first, float):
        return statistics.median(items)
    if not dataclasses.is_dataclass(first):
        return first
    return type(first)(**{f.name: median_of([getattr(x, f.name) for x in items])
                          for f in dataclasses.fields(first)})


def median_profile(profiles: Sequence[Profile]) -> Profile:
    """Field by field median of profiles of one model taken at different times (each time
    per microbatch size and tensor-parallel size), so that a profile spread over a long
    job sees the machine as the job did; ValueError when they measured other sizes."""
    first = profiles[0]
    for other in profiles[1:]:
        if (other.model != first.model or _sizes(other.entries) != _sizes(first.entries)
                or {k: _sizes(e) for k, e in other.tensor_parallel.items()}
                != {k: _sizes(e) for k, e in first.tensor_parallel.items()}):
            raise ValueError("profiles to combine must measure the same model at the same "
                             "microbatch and tensor-parallel sizes")
    entries = tuple(median_of(list(es)) for es in zip(*(p.entries for p in profiles)))
    split = {k: tuple(median_of(list(es))
                      for es in zip(*(p.tensor_parallel[k] for p in profiles)))
             for k in first.tensor_parallel}
    return dataclasses.replace(first, entries=entries, tensor_parallel=split)


def _sizes(entries) -> list[int]:
    return [e.micro_batch_size for e in entries]


def _profile_tensor_parallel(k: int, shape: dict) -> tuple:
    """The layer and output side at tensor-parallel size k, in k spawned processes; rank
    0's measurements (the ranks run in lockstep through their all-reduces)."""
    from .compute import tensor_parallel_entries
    return tensor_parallel_entries(_in_processes(k, k, shape))[k]


def _profile_concurrently(n: int, shape: dict) -> tuple[tuple, dict]:
    """The one-process pieces measured in n spawned processes at once, each timing its
    own copy (a barrier before each size), as n devices of one node compute at once in
    training: on a CPU their cores share memory bandwidth and caches (and a virtual
    machine's cores may share physical ones), so a lone process measures faster than
    any of n busy ones (tools/studies/validate_planner.py's `layer_diagnostics` show by how much).
    Rank 0's entries and the parameter counts."""
    profile = profile_from_dict(_in_processes(n, 1, shape))
    return profile.entries, profile.params


def _in_processes(n: int, k: int, shape: dict) -> dict:
    """Spawn n processes measuring at tensor-parallel size k (n = k, or k = 1); rank 0's
    measurements as a profile JSON dict."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="m2bw-profile-tp") as tmp:
        mp.start_processes(_profile_worker, args=(n, k, tmp, shape), nprocs=n,
                           join=True, start_method="spawn")
        return json.loads((Path(tmp) / "rank0.json").read_text())


def _profile_worker(rank: int, n: int, k: int, tmp: str, shape: dict) -> None:
    """One of n processes: megatron-core at tp = k; at k = 1 the one-process pieces, at
    k > 1 the split pieces and the all-reduces of the sizes they communicate; rank 0
    writes a profile holding only them."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron_2bw import comm
    from megatron_2bw.models.compat import apply_cpu_shims

    warnings.filterwarnings("ignore", module=r"megatron\.")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    apply_cpu_shims()
    store = dist.FileStore(str(Path(tmp) / "store"), n)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=n)
    parallel_state.initialize_model_parallel(k, 1)
    dtype = getattr(torch, shape["dtype"].split(".")[-1])
    parts = one_layer_parts(shape, dtype, device, k)
    if k == 1:
        def entry(b: int) -> ProfileEntry:
            comm.barrier()
            return parts.entry(b)
        entries = in_rounds(entry, shape["micro_batch_sizes"], shape.get("rounds", 1), parts)
        out = Profile("", 0, {}, entries, parts.param_counts()).to_dict()
    else:
        entries = in_rounds(_split_measure(parts, shape, dtype, device),
                            shape["micro_batch_sizes"], shape.get("rounds", 1), parts)
        out = Profile("", 0, {}, (), {}, {k: entries}).to_dict()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if rank == 0:
        Path(tmp, "rank0.json").write_text(json.dumps(out))


def _split_measure(parts: "_Parts", shape: dict, dtype, device) -> Callable:
    """measure(b) at tensor-parallel size > 1: the pieces, and one [s, b, h] and one
    [s, b] fp32 all-reduce timed beside them."""
    import torch
    from .compute import TensorParallelEntry
    from .netprofile import time_allreduce

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def measure(b: int) -> TensorParallelEntry:
        e = parts.entry(b)
        act = torch.ones(shape["seq_length"] * b * shape["hidden_size"], dtype=dtype, device=device)
        loss = torch.ones(shape["seq_length"] * b, dtype=torch.float32, device=device)
        reps = max(3, shape["repeats"])
        return TensorParallelEntry(b, e.layer, e.output, time_allreduce(act, reps, sync),
                                   time_allreduce(loss, reps, sync))
    return measure


class _Parts:
    """The three measured pieces of a one-layer stage and how to time them."""

    def __init__(self, stage, config, device, repeats: int, warmup: int):
        import torch
        self.torch, self.stage, self.config, self.device = torch, stage, config, device
        self.model = stage.model
        self.layer = self.model.decoder.layers[0]
        self.repeats, self.warmup = repeats, warmup

    # ---- inputs ----
    def _tokens(self, b: int):
        t = self.torch
        return t.randint(0, self.config.vocab_size, (b, self.config.seq_length), device=self.device)

    def _hidden(self, b: int):
        t = self.torch
        return t.randn(self.config.seq_length, b, self.config.hidden_size, device=self.device,
                       dtype=self.config.params_dtype, requires_grad=True)

    # ---- the three forwards ----
    def _embedding(self, b: int) -> Callable:
        tokens = self._tokens(b)
        positions = self.torch.arange(self.config.seq_length, device=self.device).expand_as(tokens)
        types = self.torch.zeros_like(tokens) if self.config.model == "bert" else None

        def run():
            kwargs = {"tokentype_ids": types} if types is not None else {}
            return self.model.embedding(input_ids=tokens, position_ids=positions, **kwargs)
        return run

    def _layer(self, b: int, recompute: bool) -> Callable:
        from megatron.core import tensor_parallel
        x = self._hidden(b)

        def forward(hidden):
            return self.layer(hidden_states=hidden, attention_mask=None)[0]

        def run():
            if recompute:
                return tensor_parallel.checkpoint(forward, False, x)
            return forward(x)
        return run

    def _output(self, b: int) -> Callable:
        x, labels = self._hidden(b), self._tokens(b)

        def run():
            hidden = self.model.decoder.final_layernorm(x)
            if self.config.model == "bert":
                hidden = self.model.lm_head(hidden_states=hidden)
            weight = self.model.shared_embedding_or_output_weight()
            logits, _ = self.model.output_layer(hidden, weight=weight)
            return self.model.compute_language_model_loss(labels, logits).float().mean()
        return run

    # ---- measuring ----
    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _time(self, make_forward: Callable) -> tuple[float, float, float, float]:
        """Median forward and backward seconds, and saved float / other bytes."""
        forwards, backwards, saved = [], [], (0.0, 0.0)
        for i in range(self.warmup + self.repeats):
            run = make_forward()
            self._sync()
            start = time.perf_counter()
            with _saved_bytes(self.torch, self.model) as counter:
                out = run()
            self._sync()
            middle = time.perf_counter()
            grad = self.torch.ones_like(out) if out.dim() else None
            out.backward(grad)
            self._sync()
            end = time.perf_counter()
            self.model.zero_grad(set_to_none=True)
            if i >= self.warmup:
                forwards.append(middle - start)
                backwards.append(end - middle)
                saved = counter.totals()
        return statistics.median(forwards), statistics.median(backwards), saved[0], saved[1]

    def entry(self, b: int) -> ProfileEntry:
        lf, lb, la_f, la_o = self._time(lambda: self._layer(b, recompute=False))
        rf, rb, _, _ = self._time(lambda: self._layer(b, recompute=True))
        ef, eb, ea_f, ea_o = self._time(lambda: self._embedding(b))
        of, ob, oa_f, oa_o = self._time(lambda: self._output(b))
        elem = self.torch.finfo(self.config.params_dtype).bits // 8
        boundary = float(self.config.seq_length * b * self.config.hidden_size * elem)
        logger.info("b=%d: layer %.4f / %.4f s, recompute backward %.4f s", b, lf, lb, rb)
        return ProfileEntry(
            micro_batch_size=b,
            layer=PartTiming(lf, lb, rb, la_f, la_o, boundary),
            embedding=PartTiming(ef, eb, 0.0, ea_f, ea_o, 0.0),
            output=PartTiming(of, ob, 0.0, oa_f, oa_o, boundary))

    def param_counts(self) -> dict:
        def count(module) -> int:
            return sum(p.numel() for p in module.parameters())
        output = count(self.model.decoder.final_layernorm)
        if self.config.model == "bert":
            output += count(self.model.lm_head)
        return {"layer": count(self.layer), "embedding": count(self.model.embedding),
                "output": output}


class _SavedBytes:
    """Bytes of the tensors autograd saves, parameters excluded, each storage once."""

    def __init__(self, torch_module, model):
        self.torch = torch_module
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, tuple[int, bool]] = {}

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            self.seen[ptr] = (storage.nbytes(), tensor.is_floating_point())
        return tensor

    def totals(self) -> tuple[float, float]:
        floats = sum(n for n, is_float in self.seen.values() if is_float)
        others = sum(n for n, is_float in self.seen.values() if not is_float)
        return float(floats), float(others)


@contextmanager
def _saved_bytes(torch_module, model) -> Iterator[_SavedBytes]:
    counter = _SavedBytes(torch_module, model)
    with torch_module.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        yield counter


if __name__ == "__main__":
    sys.exit(main())
