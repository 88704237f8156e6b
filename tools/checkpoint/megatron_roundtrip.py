"""Load a megatron-2bw torch_dist checkpoint with Megatron-LM's own `load_checkpoint` and
say whether its optimizer holds what megatron-2bw saved.

    .venv/bin/python tools/checkpoint/megatron_roundtrip.py --megatron /tmp/mlm \
        --deps /tmp/mlmdeps --load CHECKPOINT_DIR [--data-parallel 2] \
        [--tensor-model-parallel-size T --pipeline-model-parallel-size P \
         --expert-model-parallel-size E]

It runs Megatron-LM's code from a core_v0.16.1 checkout (megatron_fixtures.py's
docstring says how to get one) on T x P x DP CPU processes: Megatron-LM's args from the
checkpoint's flags, its DDP, optimizer and scheduler (megatron_harness.py), then its
`load_checkpoint`, which reads the optimizer in the layout the checkpoint's
content_metadata names (the non-distributed one, dp_reshardable or fully_reshardable).
Then, parameter by parameter, it compares what Megatron-LM's optimizer holds (its shards
gathered over data parallelism: the fp32 main weights, exp_avg, exp_avg_sq) with
megatron-2bw's own reading of the checkpoint: its per-parameter tensors
(`optimizer.state.<kind>.<key>`; the fp32 main weights of an fp32 run are its weights),
or where a dp_reshardable save wrote the state only in the buckets, the buckets read
through the index saved beside them (megatron_optim/index.py), which is not how
Megatron-LM finds them; it prints one line per state, then whether every tensor is
equal. Exit status 0 when all are, 1 otherwise. The model is
the GPT the checkpoint's flags describe (megatron-core's GPTModel, built by megatron-2bw).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_harness as harness  # noqa: E402

STATES = (("param", "fp32 main weights"), ("exp_avg", "exp_avg"),
          ("exp_avg_sq", "exp_avg_sq"))


def _saved(load: str) -> tuple[int, argparse.Namespace, dict]:
    """The newest iteration, its args and content_metadata (read without a group)."""
    import torch
    with open(os.path.join(load, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read().strip())
    common = torch.load(os.path.join(load, f"iter_{iteration:07d}", "common.pt"),
                        map_location="cpu", weights_only=False)
    return iteration, common["args"], common.get("content_metadata") or {}


def megatron_flags(saved: argparse.Namespace, load: str, tp: int, pp: int,
                   ep: int) -> list[str]:
    """Megatron-LM's command line for resuming this checkpoint at TP x PP (x EP)."""
    a = vars(saved)
    flags = ["--num-layers", a["num_layers"], "--hidden-size", a["hidden_size"],
             "--num-attention-heads", a["num_attention_heads"], "--seq-length",
             a["seq_length"], "--max-position-embeddings", a["max_position_embeddings"],
             "--micro-batch-size", a["micro_batch_size"], "--global-batch-size",
             a["global_batch_size"], "--lr", a["lr"], "--min-lr", a["min_lr"],
             "--lr-decay-style", a["lr_decay_style"], "--weight-decay", a["weight_decay"],
             "--adam-beta1", a["adam_beta1"], "--adam-beta2", a["adam_beta2"],
             "--adam-eps", a["adam_eps"], "--train-iters", a["train_iters"] or 1000,
             "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
             a["padded_vocab_size"] - 1, "--make-vocab-size-divisible-by",
             a["make_vocab_size_divisible_by"], "--seed", a["seed"],
             "--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp,
             "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
             "--transformer-impl", "local", "--ckpt-format", "torch_dist", "--load", load,
             "--no-load-rng"]
    # the schedule's lengths as the run set them: Megatron-LM checks them on load
    for key in ("lr_warmup_iters", "lr_warmup_fraction", "lr_decay_iters",
                "lr_warmup_init"):
        if a.get(key):
            flags += [f"--{key.replace('_', '-')}", a[key]]
    if a.get("num_layers_per_virtual_pipeline_stage"):
        flags += ["--num-layers-per-virtual-pipeline-stage",
                  a["num_layers_per_virtual_pipeline_stage"]]
    for switch in ("bf16", "fp16", "use_distributed_optimizer", "overlap_grad_reduce",
                   "moe_grouped_gemm"):
        if a.get(switch):
            flags.append(f"--{switch.replace('_', '-')}")
    if a.get("num_experts"):
        flags += ["--num-experts", a["num_experts"], "--moe-router-topk",
                  a["moe_router_topk"], "--expert-model-parallel-size", ep,
                  "--moe-token-dispatcher-type", a.get("moe_token_dispatcher_type")
                  or "alltoall"]
    return [str(f) for f in flags]


def _model_config(saved: argparse.Namespace, tp: int, pp: int, ep: int, world: int):
    """megatron-2bw's ModelConfig of the checkpoint's flags at this layout."""
    from megatron_2bw.training.arguments import config_from_args
    from megatron_2bw.training.convert import args_from_saved
    args = args_from_saved(vars(saved), "gpt")  # flags newer than the checkpoint: defaults
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    args.expert_model_parallel_size = ep
    args.load = args.save = args.save_interval = None
    return config_from_args(args, "gpt", world, saved.padded_vocab_size).model


def _params(ddp) -> list:
    """The model shards of this rank's parameters (megatron-core's DDP modules)."""
    import torch
    modules = [d.module for d in (ddp if isinstance(ddp, list) else [ddp])]
    return [st for m in modules for st in m.sharded_state_dict().values()
            if isinstance(getattr(st, "data", None), torch.nn.Parameter)]


def _ours(ddp, path: str, main_key: str) -> dict:
    """megatron-2bw's state of this rank's parameters, whole, keyed like
    `optimizer_reference`: {(key, offset): {param, exp_avg, exp_avg_sq}}."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
    from megatron_2bw.models.compat import cpu_dist_checkpointing
    common = torch.load(os.path.join(path, "common.pt"), map_location="cpu",
                        weights_only=False)
    index = common.get("pipedream_2bw", {}).get("optimizer_buckets")
    if index is not None:
        return _ours_from_buckets(_params(ddp), path, index)
    keys = set(dist_checkpointing.load_tensors_metadata(path))
    template = {}
    for st in _params(ddp):
        entry = {}
        for state, prefix in (("param", main_key), ("exp_avg", "optimizer.state.exp_avg"),
                              ("exp_avg_sq", "optimizer.state.exp_avg_sq")):
            data = torch.empty(st.data.shape, dtype=torch.float32, device="cpu")
            if prefix is None or f"{prefix}.{st.key}" not in keys:  # the weights themselves
                entry[state] = _weights(st, data)
            else:
                entry[state] = make_sharded_optimizer_tensor(st, data, prefix)
        template[(st.key, tuple(st.global_offset))] = entry
    with cpu_dist_checkpointing():
        loaded = dist_checkpointing.load(_flat(template), path)
    return _unflat(loaded, template)


def _ours_from_buckets(params: list, path: str, index: dict) -> dict:
    """The state of `params` read from the dp_reshardable buckets through the index a
    save of megatron-2bw wrote beside them, keyed as `_ours`."""
    from megatron.core import dist_checkpointing
    from megatron_2bw.checkpointing.megatron_optim import index_read
    from megatron_2bw.models.compat import cpu_dist_checkpointing
    read = index_read(index, dict(enumerate(params)), {"fp32_param", "exp_avg", "exp_avg_sq"})
    with cpu_dist_checkpointing():
        found = read.found(dist_checkpointing.load(read.template, path))
    names = {"param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
    return {(st.key, tuple(st.global_offset)): {state: found[kind][i]
                                                for state, kind in names.items()}
            for i, st in enumerate(params)}


def _weights(st, data):
    from dataclasses import replace
    return replace(st, data=data, dtype=data.dtype)


def _flat(template: dict) -> dict:
    return {f"{i}.{state}": st for i, entry in enumerate(template.values())
            for state, st in entry.items()}


def _unflat(loaded: dict, template: dict) -> dict:
    return {place: {state: loaded[f"{i}.{state}"].float() for state in entry}
            for i, (place, entry) in enumerate(template.items())}


def _group_step(optimizer) -> int:
    """Adam's step where Megatron-LM's fused Adams keep it: the param groups (torch's
    Adam, used here without Transformer Engine, keeps a copy per parameter, which the
    dp_reshardable load overwrites with the step of the state it loads into)."""
    from megatron_fixtures import _step
    inner = getattr(optimizer, "chained_optimizers", [optimizer])[0]
    steps = [g["step"] for g in inner.optimizer.param_groups if "step" in g]
    return int(steps[0]) if steps else _step(inner)


def _saved_step(load: str, iteration: int) -> int:
    import torch
    common = torch.load(os.path.join(load, f"iter_{iteration:07d}", "common.pt"),
                        map_location="cpu", weights_only=False)
    return int(common["pipedream_2bw"]["adam_step"])


def _main_key(path: str) -> str:
    """Where megatron-2bw keeps the fp32 main weights in this checkpoint: its masters
    (fp32_param, or param in the fully_reshardable layout), or (an fp32 run) none."""
    from megatron.core import dist_checkpointing
    keys = dist_checkpointing.load_tensors_metadata(path)
    for prefix in ("optimizer.state.fp32_param.", "optimizer.state.param."):
        if any(k.startswith(prefix) for k in keys):
            return prefix[:-1]
    return None


def _run(rank: int, world: int, load: str, tp: int, pp: int, ep: int, port: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.training import checkpointing
    from megatron_2bw import comm
    from megatron_2bw.models.compat import cpu_dist_checkpointing
    from megatron_fixtures import optimizer_reference
    iteration, saved, meta = _saved(load)
    vp = vars(saved).get("virtual_pipeline_model_parallel_size") or 1
    harness.init_process(rank, world, port, tp, pp, ep, vp)
    args = harness.megatron_args(megatron_flags(saved, load, tp, pp, ep))
    chunks = harness.build_chunks(_model_config(saved, tp, pp, ep, world),
                                  ps.get_pipeline_model_parallel_rank(), pp, vp)
    ddp, optimizer, scheduler = harness.wrap(chunks, args)
    harness.allocate_state(optimizer)
    with harness.cpu_as_cuda(), cpu_dist_checkpointing():
        loaded_iteration, _ = checkpointing.load_checkpoint(ddp, optimizer, scheduler)
        theirs = optimizer_reference(ddp, optimizer)
    steps = (_group_step(optimizer), _saved_step(load, iteration))
    path = os.path.join(load, f"iter_{iteration:07d}")
    ours = _ours(ddp, path, _main_key(path))
    counts = _compare(theirs["state"], ours)
    gathered = comm.all_gather_object(counts)
    if rank == 0:
        _report(gathered, meta, load, (tp, pp, world // (tp * pp), ep, vp), loaded_iteration,
                steps)
    harness.close_process()


def _compare(theirs: dict, ours: dict) -> dict:
    """{(key, offset): {state: equal}} of this rank's parameters."""
    import torch
    return {place: {state: torch.equal(theirs[place][state], tensors[state])
                    for state, _ in STATES} for place, tensors in ours.items()}


def _report(gathered: list, meta: dict, load: str, layout: tuple, iteration: int,
            steps: tuple[int, int]) -> None:
    """One line per state over every parameter (data-parallel replicas counted once),
    then the verdict; exit status 1 where anything differs."""
    merged: dict = {}
    for part in gathered:
        for place, equal in part.items():
            merged.setdefault(place, {s: True for s, _ in STATES})
            for state, same in equal.items():
                merged[place][state] &= same
    layout_name = meta.get("distrib_optim_sharding_type", "non-distributed")
    print(f"Megatron-LM core_v0.16.1 load_checkpoint: {load} (optimizer layout "
          f"{layout_name}; loaded at TP {layout[0]} x PP {layout[1]} x DP {layout[2]}"
          f"{f' x EP {layout[3]}' if layout[3] > 1 else ''}"
          f"{f', {layout[4]} virtual stages' if layout[4] > 1 else ''})")
    print(f"  iteration {iteration}; Adam step {steps[0]} (Megatron-LM's param groups), "
          f"{steps[1]} (megatron-2bw's)")
    ok = steps[0] == steps[1]
    for state, label in STATES:
        equal = sum(m[state] for m in merged.values())
        differ = sorted(place[0] for place, m in merged.items() if not m[state])
        ok &= not differ
        print(f"  {label}: {equal} of {len(merged)} tensors equal to megatron-2bw's"
              + (f" (first differing: {differ[0]})" if differ else ""))
    print("every optimizer tensor equals megatron-2bw's: " + ("yes" if ok else "NO"))
    sys.stdout.flush()
    if not ok:
        os._exit(1)


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--megatron", required=True, help="Megatron-LM checkout at core_v0.16.1")
    cli.add_argument("--deps", required=True, help="folder with six, triton, pydantic")
    cli.add_argument("--load", required=True, help="a megatron-2bw torch_dist checkpoint")
    cli.add_argument("--tensor-model-parallel-size", type=int, default=1)
    cli.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    cli.add_argument("--expert-model-parallel-size", type=int, default=1)
    cli.add_argument("--data-parallel", type=int, default=1)
    opts = cli.parse_args()
    harness.add_paths(opts.megatron, opts.deps)
    tp, pp = opts.tensor_model_parallel_size, opts.pipeline_model_parallel_size
    harness.spawn(_run, tp * pp * opts.data_parallel, os.path.abspath(opts.load), tp, pp,
                  opts.expert_model_parallel_size, int(os.environ.get("PORT", "29633")))


if __name__ == "__main__":
    main()
