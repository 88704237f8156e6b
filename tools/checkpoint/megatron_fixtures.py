"""Write the small checkpoints in tests/fixtures/megatron_lm/ with Megatron-LM's own code.

Megatron-LM's training package is not in the megatron-core wheel, so this script runs
against a checkout of Megatron-LM at core_v0.16.1 (its `megatron/` shadows the wheel's;
the core is the same release) and a folder with the few packages its imports need:

    git clone --branch core_v0.16.1 https://github.com/NVIDIA/Megatron-LM /tmp/mlm
    .venv/bin/pip install --target /tmp/mlmdeps six triton pydantic
    .venv/bin/python tools/checkpoint/megatron_fixtures.py --megatron /tmp/mlm \
        --deps /tmp/mlmdeps --out tests/fixtures/megatron_lm

Megatron-LM's `save_checkpoint` writes:

- `torch`, `torch_dist`: a GPT of megatron-core (4 layers, hidden 32, vocabulary 128,
  weights scaled so they differ from any fresh initialization), no optimizer state;
- `torch_dist_adam` (fp32, one process: the non-distributed optimizer),
  `torch_dist_adam_dp` (--bf16 --use-distributed-optimizer on two data-parallel
  processes: the dp_reshardable layout) and `torch_dist_adam_full` (the same with
  --dist-ckpt-optim-fully-reshardable): a 1-layer GPT of hidden size 8 after 3 Adam steps
  of Megatron-LM's DDP, optimizer and scheduler on random tokens, saved at iteration 3;
  beside each, `adam_reference/<name>.pt` holds what Megatron-LM's optimizer held then,
  per parameter and whole ({(key, global offset): {param, exp_avg, exp_avg_sq}}, and
  `step`), gathered from its shards, for tests/test_megatron_optimizer.py;
- `torch_adam`: the same GPT and steps in --bf16 with the non-distributed optimizer
  (Float16OptimizerWithFloat16Params), saved with --ckpt-format torch (Adam's state in
  `model_optim_rng.pt`'s `optimizer` entry), for tests/test_megatron_optimizer.py.

On CPU Megatron-LM's CUDA calls are answered by the CPU (megatron_harness.py says which);
the model is built with megatron-2bw's CPU shims (megatron_2bw/models/compat.py).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_harness as harness  # noqa: E402

FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "1e-2", "--train-iters", "10", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
         "--make-vocab-size-divisible-by", "64", "--no-save-optim", "--seed", "77",
         "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
         "--transformer-impl", "local", "--save-interval", "5"]
ITERATION = 5
# the optimizer fixtures: a model small enough for a few hundred KB with Adam's state
ADAM_MODEL = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2",
              "--seq-length", "8", "--max-position-embeddings", "8",
              "--tokenizer-type", "NullTokenizer", "--vocab-size", "63",
              "--make-vocab-size-divisible-by", "64"]
ADAM_FLAGS = [*ADAM_MODEL, "--micro-batch-size", "2", "--global-batch-size", "4",
              "--lr", "1e-2", "--min-lr", "1e-3", "--lr-decay-style", "cosine",
              "--lr-warmup-iters", "1", "--train-iters", "10", "--weight-decay", "0.05",
              "--adam-beta2", "0.95", "--mock-data", "--seed", "77",
              "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
              "--transformer-impl", "local", "--ckpt-format", "torch_dist",
              "--save-interval", "3"]
ADAM_STEPS = 3
ADAM_FIXTURES = {  # name: (data-parallel processes, flags)
    "torch_dist_adam": (1, []),
    "torch_dist_adam_dp": (2, ["--bf16", "--use-distributed-optimizer"]),
    "torch_dist_adam_full": (2, ["--bf16", "--use-distributed-optimizer",
                                 "--dist-ckpt-optim-fully-reshardable"]),
    "torch_adam": (1, ["--bf16", "--ckpt-format", "torch"]),
}


def _megatron_args(fmt: str, save: str):
    return harness.megatron_args([*FLAGS, "--ckpt-format", fmt, "--save", save])


def _model():
    """megatron-core's GPTModel (PP = TP = 1), weights moved off any fresh init."""
    import torch
    from megatron_2bw.models.config import ModelConfig
    model = harness.build_model(ModelConfig(model="gpt", num_layers=4, hidden_size=32,
                                            num_attention_heads=4, seq_length=16,
                                            vocab_size=128, seed=77), 0, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5).add_(0.01)
    return model


def _model_fixtures(out: str, port: int) -> None:
    """`torch` and `torch_dist`: the model only (one process)."""
    from megatron_2bw.models.compat import cpu_dist_checkpointing
    harness.init_process(0, 1, port)
    model = _model()
    from megatron.training import checkpointing
    for fmt in ("torch", "torch_dist"):
        _megatron_args(fmt, os.path.join(out, fmt))
        with cpu_dist_checkpointing():
            checkpointing.save_checkpoint(ITERATION, [model], None, None, 0)
    harness.close_process()


def adam_model(args):
    """The optimizer fixtures' GPT in the precision of Megatron-LM's `args`."""
    import torch
    from megatron_2bw.models.config import ModelConfig
    return harness.build_model(ModelConfig(
        model="gpt", num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=8,
        vocab_size=64, seed=77, params_dtype=torch.bfloat16 if args.bf16 else torch.float32),
        0, 1)


def _train(ddp, optimizer, scheduler, args, rank: int) -> None:
    """Megatron-LM's step on random tokens (each data-parallel rank its own)."""
    import torch
    for step in range(ADAM_STEPS):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        torch.manual_seed(1000 * step + rank)
        tokens = torch.randint(0, 64, (args.micro_batch_size, args.seq_length), device="cpu")
        positions = torch.arange(args.seq_length, device="cpu").expand_as(tokens)
        loss = ddp(input_ids=tokens, position_ids=positions, attention_mask=None,
                   labels=tokens).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        optimizer.step()
        scheduler.step(increment=args.global_batch_size)
        args.consumed_train_samples += args.global_batch_size  # as its training loop


def _adam_fixture(rank: int, world: int, name: str, flags: list, out: str, port: int) -> None:
    import torch
    from megatron_2bw.models.compat import cpu_dist_checkpointing
    harness.init_process(rank, world, port)
    args = harness.megatron_args([*ADAM_FLAGS, *flags, "--save", os.path.join(out, name)])
    ddp, optimizer, scheduler = harness.wrap(adam_model(args), args)
    from megatron.training import checkpointing
    with harness.cpu_as_cuda():
        _train(ddp, optimizer, scheduler, args, rank)
        with cpu_dist_checkpointing():
            checkpointing.save_checkpoint(ADAM_STEPS, [ddp], optimizer, scheduler, 0)
        reference = optimizer_reference(ddp, optimizer)
    if rank == 0:
        os.makedirs(os.path.join(out, "adam_reference"), exist_ok=True)
        torch.save(reference, os.path.join(out, "adam_reference", f"{name}.pt"))
    harness.close_process()


def optimizer_reference(ddp, optimizer) -> dict:
    """What Megatron-LM's optimizer holds per parameter, whole (shards gathered over the
    data-parallel group), keyed by the parameter's (checkpoint key, global offset); and
    Adam's step. `ddp`: one DDP-wrapped model, or a list of model chunks."""
    import torch
    from megatron_2bw import comm
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    modules = [d.module for d in (ddp if isinstance(ddp, list) else [ddp])]
    places = {id(st.data): (st.key, tuple(st.global_offset)) for m in modules
              for st in m.sharded_state_dict().values() if hasattr(st, "global_offset")}
    mine = {}
    for p in (p for m in modules for p in m.parameters() if p.requires_grad):
        whole, lo, hi = _state_of(chained, p)
        if whole:
            mine[places[id(p)]] = (tuple(p.shape), lo, hi, {
                k: v.detach().float().cpu().clone() for k, v in whole.items()})
    parts = comm.all_gather_object(mine)
    out: dict = {}
    for part in parts:
        for place, (shape, lo, hi, tensors) in part.items():
            entry = out.setdefault(place, {k: torch.zeros(shape, device="cpu") for k in tensors})
            for k, v in tensors.items():
                entry[k].view(-1)[lo:hi] = v.view(-1)
    return {"state": out, "step": _step(chained[0])}


def _state_of(chained: list, p):
    """({param, exp_avg, exp_avg_sq}, lo, hi): the elements [lo, hi) of `p` that one of
    the chained optimizers holds on this rank (none: {})."""
    for inner in chained:
        if hasattr(inner, "_get_model_param_range_map"):  # distributed: this rank's shard
            if p not in inner.model_param_gbuf_map:
                continue
            rng = inner._get_model_param_range_map(p)["param"]
            state = inner._get_main_param_and_optimizer_states(p)
            return ({k: state[k] for k in ("param", "exp_avg", "exp_avg_sq")}, rng.start,
                    rng.end)
        main = _main_param(inner, p)
        if main in inner.optimizer.state:
            state = inner.optimizer.state[main]
            return ({"param": main, "exp_avg": state["exp_avg"],
                     "exp_avg_sq": state["exp_avg_sq"]}, 0, p.numel())
    return {}, 0, 0


def _main_param(inner, p):
    """The fp32 main parameter a non-distributed optimizer steps for `p` (itself in fp32)."""
    for model_group, main_group in zip(getattr(inner, "float16_groups", []),
                                       getattr(inner, "fp32_from_float16_groups", [])):
        for model_param, main_param in zip(model_group, main_group):
            if model_param is p:
                return main_param
    return p


def _step(inner) -> int:
    steps = [s["step"] for s in inner.optimizer.state.values() if "step" in s]
    return int(steps[0]) if steps else 0


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--megatron", required=True, help="Megatron-LM checkout at core_v0.16.1")
    cli.add_argument("--deps", required=True, help="folder with six, triton, pydantic")
    cli.add_argument("--out", default="tests/fixtures/megatron_lm")
    cli.add_argument("--only", choices=["model", "adam", *ADAM_FIXTURES],
                     help="write only these fixtures (or this one)")
    opts = cli.parse_args()
    harness.add_paths(opts.megatron, opts.deps)
    out, port = os.path.abspath(opts.out), int(os.environ.get("PORT", "29613"))
    if opts.only in (None, "model"):
        _model_fixtures(out, port)
    if opts.only != "model":  # every optimizer fixture, or the one named
        for i, (name, (world, flags)) in enumerate(ADAM_FIXTURES.items()):
            if opts.only not in (None, "adam", name):
                continue
            harness.spawn(_adam_fixture, world, name, flags, out, port + 1 + i)


if __name__ == "__main__":
    main()
