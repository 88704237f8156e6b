"""Megatron-LM's own training objects on CPU, for the tools that write or read checkpoints
with its code (megatron_fixtures.py, megatron_roundtrip.py).

They run against a checkout of Megatron-LM at core_v0.16.1, whose `megatron/` shadows the
wheel's (the core is the same release), and a folder with the packages its imports need
(`pip install --target DIR six triton pydantic`). Megatron-LM's training code builds
its optimizer on CUDA; on a CPU build of torch three things of Megatron-LM's are
replaced, inside `CpuAsCuda` only: tensors asked for on "cuda" are made on the CPU, a
CPU tensor answers `type()` with its CUDA name (megatron-core picks the optimizer of a
parameter by that name), and `.cuda()` returns the tensor; the GPU architecture
Megatron-LM's argument checks ask for is one without the CUDA_DEVICE_MAX_CONNECTIONS
rule. The torch_dist reader and
writer run under megatron_2bw's `cpu_dist_checkpointing`, and Megatron-LM's CUDA RNG
state is the CPU's. The model is megatron-core's GPTModel, built by megatron_2bw (with
its CPU shims); everything around it (DDP, the optimizer, the scheduler, save_checkpoint
and load_checkpoint) is Megatron-LM's.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add_paths(megatron: str, deps: str) -> None:
    """Megatron-LM's checkout before the wheel, its extra packages after everything,
    this repository for megatron_2bw."""
    sys.path.insert(0, os.path.abspath(megatron))
    sys.path.append(os.path.abspath(deps))
    sys.path.insert(1, ROOT)


def cpu_as_cuda():
    """The TorchFunctionMode described in the module docstring."""
    import torch
    from torch.overrides import TorchFunctionMode

    def on_cuda(device) -> bool:
        return (device == "cuda" or isinstance(device, int)
                or (isinstance(device, torch.device) and device.type == "cuda"))

    class CpuAsCuda(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                return func(*args).replace("torch.", "torch.cuda.", 1)
            if func is torch.Tensor.cuda:
                return args[0]
            if on_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return func(*args, **kwargs)

    return CpuAsCuda()


def init_process(rank: int, world: int, port: int, tp: int = 1, pp: int = 1,
                 ep: int = 1, vp: int = 1) -> None:
    """gloo, megatron-core's parallel state, and Megatron-LM's CUDA calls on the CPU."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep,
                                 virtual_pipeline_model_parallel_size=vp if vp > 1 else None)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda *a, **k: None


def close_process() -> None:
    """Undo `init_process` (the next fixture may run in this process)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def megatron_args(flags: Sequence[str]):
    """Megatron-LM's parsed, validated and installed global args for `flags`."""
    from megatron.training import arguments
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables, unset_global_variables
    # it asks the GPU's architecture at TP > 1 (the CUDA_DEVICE_MAX_CONNECTIONS rule):
    # answered as a GPU without that rule
    arguments.get_device_arch_version = lambda: 10
    unset_global_variables()
    sys.argv = ["megatron", *flags]
    args = parse_args()
    validate_args(args)
    set_global_variables(args, build_tokenizer=False)
    return args


def build_model(config, stage: int, stages: int):
    """megatron-core's GPTModel for pipeline stage `stage`, built by megatron_2bw."""
    return build_chunks(config, stage, stages, 1)[0]


def build_chunks(config, stage: int, stages: int, chunks: int) -> list:
    """The `chunks` model chunks (virtual pipeline stages) of pipeline rank `stage`."""
    from megatron_2bw.models import apply_cpu_shims, build_stage, model_parallel_manual_seed
    apply_cpu_shims("cpu")
    model_parallel_manual_seed(config.seed)
    built = build_stage(config, stage, stages, num_chunks=chunks)
    return [c.model for c in built.chunks] if chunks > 1 else [built.model]


def wrap(model, args):
    """Megatron-LM's DDP around `model` (or each of a list of model chunks, bucketing the
    first only), its optimizer and its scheduler, made from its args as its `get_model`
    and `setup_model_and_optimizer` make them."""
    import dataclasses
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.training.training import (get_megatron_optimizer_config,
                                            get_optimizer_param_scheduler)
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(
        DistributedDataParallelConfig) if hasattr(args, f.name)}
    kwargs.update(grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
                  bucket_size=args.ddp_bucket_size, check_for_nan_in_grad=False,
                  pad_buckets_for_high_nccl_busbw=args.ddp_pad_buckets_for_high_nccl_busbw)
    chunks = model if isinstance(model, list) else [model]
    with cpu_as_cuda():
        ddps = [DistributedDataParallel(m.config, DistributedDataParallelConfig(**kwargs), m,
                                        disable_bucketing=i > 0)
                for i, m in enumerate(chunks)]
        config, overrides = get_megatron_optimizer_config(args)
        optimizer = get_megatron_optimizer(config, ddps, config_overrides=overrides)
        scheduler = get_optimizer_param_scheduler(optimizer)
    return (ddps if isinstance(model, list) else ddps[0]), optimizer, scheduler


def allocate_state(optimizer) -> None:
    """Make a fresh distributed optimizer loadable as on a GPU with Transformer Engine or
    Apex. Without them megatron-core's DistributedOptimizer runs torch's Adam, which keeps
    Adam's step per parameter: its `state_dict` asserts one step, so a fresh optimizer
    cannot load, and its loaders overwrite (dp_reshardable) or miss (fully_reshardable)
    that per-parameter step. So one step of zero gradients allocates the state
    (megatron-core's own `_init_optimizer_states_with_dummy_values`; the load overwrites
    it), and the loaders leave each parameter's step as the load set it from the param
    groups, which is where the fused Adams keep it."""
    from megatron.core.optimizer import distrib_optimizer
    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    cls = distrib_optimizer.DistributedOptimizer
    if not getattr(cls._set_main_param_and_optimizer_states, "_keeps_step", False):
        original = cls._set_main_param_and_optimizer_states

        def keeping_step(self, model_param, tensors):
            current = self._get_main_param_and_optimizer_states(model_param)
            if "step" in current:
                tensors = {**tensors, "step": current["step"]}
            original(self, model_param, tensors)

        keeping_step._keeps_step = True
        cls._set_main_param_and_optimizer_states = keeping_step
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(inner, cls):
            with cpu_as_cuda():
                inner._init_optimizer_states_with_dummy_values()


def spawn(fn: Callable, world: int, *args) -> None:
    """`fn(rank, world, *args)` on `world` CPU processes (in this one for a world of 1)."""
    if world == 1:
        fn(0, 1, *args)
        return
    import torch.multiprocessing as mp
    mp.spawn(fn, args=(world, *args), nprocs=world)
