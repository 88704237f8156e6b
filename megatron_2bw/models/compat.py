"""Where this project patches megatron-core 0.16.1, and why: `PATCHES` lists every patch.

megatron-core builds and trains GPT/BERT on CPU over gloo once a handful of spots that
hard-code CUDA are replaced. Each shim below names the megatron-core function it
replaces and why; `apply_cpu_shims()` installs them all, only when no CUDA device is in
use, and is idempotent. `apply_group_shims()` makes megatron-core's tensor-parallel
all-reduce ask the comm layer whether a group runs. Two patches live elsewhere, beside
what they serve, and are listed in `PATCHES` too: the torch_dist writer's CPU context
(`cpu_dist_checkpointing`, here) and its result queue on CUDA
(training/watchdog.py). tests/test_compat.py finds every assignment to a megatron-core
attribute in the package and checks it is in `PATCHES`.

What is deliberately *not* shimmed: megatron-core's pipeline schedules and
`p2p_communication` (this project has its own executor), gradient-accumulation
fusion, Transformer Engine and apex paths. Sequence parallelism runs megatron-core's own
mappings; on CPU their first-dimension gather / reduce-scatter get CPU buffers below.

Mixture of experts (models/moe.py) runs megatron-core's MoE layer: on CPU its router,
alltoall dispatcher and uneven all-to-all get the shims below. One fix applies on every
device, at import of this module: megatron-core's router refers to `te_general_gemm`,
which its moe_utils defines only when Transformer Engine is installed
(`_define_missing_te_general_gemm`). models/moe.py lets GroupedMLP be built without the
grouped_gemm package (listed here too).

Multi-latent attention (models/mla.py) builds its rotary embedding on the current CUDA
device: on CPU `_wrap_mla_rotary` makes that device read "cpu". Its module believes
Transformer Engine present whenever megatron-core's TE extension imports, which it does
without it: `_mla_without_transformer_engine`, at import of this module, on every device.
Selective recomputation of norms and MLA's up projections goes through megatron-core's
`CheckpointWithoutOutput`, which reads Transformer Engine's FP8 state even when asked for
no FP8: `_checkpoint_without_output_without_te`, likewise.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
from dataclasses import dataclass
import logging
import operator
from typing import Callable, Iterator, Optional

import torch

from megatron.core import tensor_parallel
from megatron.core import utils as mcore_utils
from megatron.core.fusions import fused_softmax
from megatron.core.models.common.embeddings import rotary_pos_embedding
from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding
from megatron.core.models.common.language_module import language_module
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer import utils as transformer_utils
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe import router as moe_router
from megatron.core.transformer.moe import token_dispatcher

from .. import comm
from .context_parallel import cp_slice

logger = logging.getLogger(__name__)

_APPLIED = False


@dataclass(frozen=True)
class Patch:
    """One attribute of megatron-core this project replaces: `target` (module path and
    attribute), who installs it, when, and why."""

    target: str
    installed_by: str
    when: str
    why: str


_CPU = "no CUDA device in use"
PATCHES: tuple[Patch, ...] = (
    Patch("megatron.core.utils.GlobalMemoryBuffer.get_tensor", "apply_cpu_shims", _CPU,
          "allocates its scratch buffers on CUDA"),
    Patch("megatron.core.tensor_parallel.random.initialize_rng_tracker", "apply_cpu_shims",
          _CPU, "builds a CUDA RNG tracker (attention dropout forks it)"),
    Patch("megatron.core.tensor_parallel.random._CUDA_RNG_STATE_TRACKER", "apply_cpu_shims",
          _CPU, "the tracker itself, with CPU generator states"),
    Patch("megatron.core.tensor_parallel.random._CUDA_RNG_STATE_TRACKER_INITIALIZED",
          "apply_cpu_shims", _CPU, "marks that tracker as made"),
    Patch("megatron.core.tensor_parallel.random._get_all_rng_states", "apply_cpu_shims", _CPU,
          "recomputation snapshots the CUDA generator"),
    Patch("megatron.core.tensor_parallel.random._set_all_rng_states", "apply_cpu_shims", _CPU,
          "recomputation restores the CUDA generator"),
    Patch("megatron.core.transformer.utils.get_default_causal_mask", "apply_cpu_shims", _CPU,
          "builds the causal mask on CUDA"),
    Patch("megatron.core.fusions.fused_softmax.get_default_causal_mask", "apply_cpu_shims",
          _CPU, "the same function, imported by name"),
    Patch("megatron.core.transformer.utils.get_sliding_window_causal_mask", "apply_cpu_shims",
          _CPU, "builds the sliding-window mask (--window-size) on CUDA"),
    Patch("megatron.core.fusions.fused_softmax.get_sliding_window_causal_mask",
          "apply_cpu_shims", _CPU, "the same function, imported by name"),
    Patch("megatron.core.models.common.language_module.language_module.LanguageModule."
          "setup_embeddings_and_output_layer", "apply_cpu_shims", _CPU,
          "moves the tied embedding to CUDA before its all-reduce"),
    Patch("megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding."
          "get_emb", "apply_cpu_shims", _CPU, "moves the rotary frequencies to CUDA"),
    Patch("megatron.core.transformer.multi_latent_attention.MultiLatentAttention.__init__",
          "apply_cpu_shims", _CPU, "builds its rotary embedding on the current CUDA device"),
    Patch("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding."
          "YarnRotaryEmbedding.get_emb", "apply_cpu_shims", _CPU,
          "moves the YaRN frequencies to CUDA"),
    Patch("megatron.core.models.common.embeddings.rotary_pos_embedding."
          "get_pos_emb_on_this_cp_rank", "apply_cpu_shims", _CPU,
          "builds its chunk index in pinned memory and moves it to CUDA"),
    Patch("megatron.core.tensor_parallel.mappings._gather_along_last_dim", "apply_cpu_shims",
          _CPU, "allocates the gathered buffer on CUDA"),
    Patch("megatron.core.tensor_parallel.mappings._reduce_scatter_along_last_dim",
          "apply_cpu_shims", _CPU, "reduce-scatters into a CUDA buffer"),
    Patch("megatron.core.tensor_parallel.mappings._gather_along_first_dim", "apply_cpu_shims",
          _CPU, "sequence parallelism's gather allocates on CUDA"),
    Patch("megatron.core.tensor_parallel.mappings._reduce_scatter_along_first_dim",
          "apply_cpu_shims", _CPU, "sequence parallelism's reduce-scatter allocates on CUDA"),
    Patch("megatron.core.tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication"
          ".backward", "apply_cpu_shims", _CPU,
          "under sequence parallelism allocates its reduce-scatter output on CUDA"),
    Patch("megatron.core.transformer.moe.router.Router.gating", "apply_cpu_shims", _CPU,
          "moves the router's weight to CUDA on every call"),
    Patch("megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher."
          "cuda_dtoh_stream", "apply_cpu_shims", _CPU,
          "the alltoall dispatcher creates a CUDA stream for its device-to-host copies"),
    Patch("megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher."
          "_maybe_dtoh_and_synchronize", "apply_cpu_shims", _CPU,
          "copies the split sizes to the host on that stream and waits on a CUDA event"),
    Patch("megatron.core.tensor_parallel.mappings._AllToAll.forward", "apply_cpu_shims", _CPU,
          "allocates the uneven all-to-all's output (MoE token dispatch) on CUDA"),
    Patch("megatron.core.transformer.moe.moe_utils.te_general_gemm",
          "import of megatron_2bw.models.compat", "Transformer Engine is not installed",
          "the router's gating GEMM tests `te_general_gemm is not None`, a name moe_utils "
          "defines only when Transformer Engine imports: a NameError on CPU and CUDA alike"),
    Patch("megatron.core.transformer.multi_latent_attention.HAVE_TE",
          "import of megatron_2bw.models.compat", "Transformer Engine is not installed",
          "True whenever megatron-core's TE extension imports, which binds TELinear to a "
          "stand-in that is not a class: MLA's isinstance check on it raises, on CPU and "
          "CUDA alike"),
    Patch("megatron.core.tensor_parallel.random.CheckpointWithoutOutput.__init__",
          "import of megatron_2bw.models.compat", "Transformer Engine is not installed",
          "sets `fp8 = fp8 is not None`, True even for fp8=False, so every selective "
          "recomputation through it (layernorm, mla_up_proj, moe_act) reads Transformer "
          "Engine's FP8 state: a NameError without it, on CPU and CUDA alike"),
    Patch("megatron.core.transformer.moe.grouped_gemm_util.grouped_gemm",
          "models.moe.TorchGroupedMLP.__init__",
          "while one is built without the grouped_gemm package",
          "GroupedMLP.__init__ asserts the package, which TorchGroupedMLP's forward never "
          "calls; restored right after"),
    Patch("megatron.core.tensor_parallel.mappings._reduce", "apply_group_shims", "always",
          "short-cuts groups of one itself; the comm layer decides (`comm.runs`)"),
    Patch("megatron.core.dist_checkpointing.strategies.filesystem_async._results_queue",
          "cpu_dist_checkpointing", "torch_dist saves and loads on CPU",
          "a spawned Manager queue: an in-process queue on CPU"),
    Patch("megatron.core.dist_checkpointing.strategies.filesystem_async."
          "_get_write_results_queue", "training.watchdog.writer_queue_dies_with_rank",
          "CUDA runs", "its spawned queue server outlives a killed rank"),
)


def cpu_shims_applied() -> bool:
    """Whether `apply_cpu_shims` has patched megatron-core in this process."""
    return _APPLIED


def apply_cpu_shims(device: Optional[str] = None) -> bool:
    """Patch megatron-core so GPT/BERT forward, backward and recomputation run on CPU.

    Applied when `device == "cpu"`, or when `device` is None and CUDA is unavailable;
    a CUDA run keeps megatron-core untouched. Safe to call repeatedly and before or
    after `parallel_state.initialize_model_parallel`. Returns whether shims are active.
    """
    global _APPLIED
    wants_cpu = device == "cpu" or (device is None and not torch.cuda.is_available())
    if not wants_cpu or _APPLIED:
        return _APPLIED
    mcore_utils.GlobalMemoryBuffer.get_tensor = _cpu_get_tensor
    _install_cpu_rng_tracker()
    mcore_random._get_all_rng_states = _cpu_get_all_rng_states
    mcore_random._set_all_rng_states = _cpu_set_all_rng_states
    transformer_utils.get_default_causal_mask = _cpu_default_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask
    transformer_utils.get_sliding_window_causal_mask = _cpu_sliding_window_causal_mask
    fused_softmax.get_sliding_window_causal_mask = _cpu_sliding_window_causal_mask
    _wrap_setup_embeddings()
    rotary_pos_embedding.RotaryEmbedding.get_emb = _cpu_rotary_get_emb
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _cpu_pos_emb_on_this_cp_rank
    _wrap_mla_rotary()
    mappings._gather_along_last_dim = _cpu_gather_along_last_dim
    mappings._reduce_scatter_along_last_dim = _cpu_reduce_scatter_along_last_dim
    mappings._gather_along_first_dim = _cpu_gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _cpu_reduce_scatter_along_first_dim
    _wrap_linear_backward()
    _apply_moe_cpu_shims()
    _APPLIED = True
    logger.info("megatron-core CPU shims applied")
    return True


def apply_group_shims() -> None:
    """Make megatron-core's tensor-parallel all-reduce ask the comm layer whether its
    group runs, on CPU or CUDA (idempotent).

    Why: `mappings._reduce` (the row-parallel layers' forward, the column-parallel
    layers' input-gradient backward) decides by itself to skip a group of one; every
    other collective of this project asks `comm.runs`, which the comm layer may answer
    "yes" for a group of one too (the sum over one member changes nothing), so that a
    one-GPU check hands NCCL what TP > 1 reduces. Otherwise the same call as upstream.
    """
    if not getattr(mappings._reduce, "_group_shim", False):
        mappings._reduce = _reduce_if_group_runs


def _reduce_if_group_runs(input_: torch.Tensor, group) -> torch.Tensor:
    """`mappings._reduce`, skipping exactly the groups `comm.runs` skips.

    Returns the tensor it reduced: upstream all-reduces `input_.contiguous()` and returns
    `input_`, so a non-contiguous input (a gradient arriving as a view) comes back
    unreduced, in silence."""
    if not comm.runs(group):
        return input_
    reduced = input_.contiguous()
    comm.all_reduce(reduced, group)
    return reduced


_reduce_if_group_runs._group_shim = True


def _define_missing_te_general_gemm() -> None:
    """Give megatron-core's moe_utils the `te_general_gemm = None` it lacks without
    Transformer Engine.

    Why: `RouterGatingLinearFunction` (every MoE router's gating GEMM) branches on
    `te_general_gemm is not None`, but moe_utils binds that name only inside its
    `import transformer_engine` block; without Transformer Engine the router raises a
    NameError, on CPU and CUDA alike. None selects upstream's own torch.mm path.
    """
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


_define_missing_te_general_gemm()


def _mla_without_transformer_engine() -> None:
    """Tell megatron-core's multi_latent_attention that Transformer Engine is absent.

    Why: its `HAVE_TE` is True whenever megatron-core's TE extension module imports, which
    it does without Transformer Engine too (binding `TELinear` to a stand-in that is not
    a class); `MultiLatentAttention.__init__` then calls `isinstance(..., TELinear)`, a
    TypeError on CPU and CUDA alike. False skips that fp8 branch, as without TE it should.
    """
    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


_mla_without_transformer_engine()


def _checkpoint_without_output_without_te() -> None:
    """Make megatron-core's `CheckpointWithoutOutput` honour fp8=False without Transformer
    Engine.

    Why: its constructor stores `fp8 is not None`, True for the default False, and its
    forward and recompute then call Transformer Engine's FP8 state and autocast, names
    that exist only when Transformer Engine imports. Without it no FP8 can run, so False
    is the only value that means anything; selective recomputation of the norms
    (`--recompute-modules layernorm`), of MLA's up projections (`mla_up_proj`) and of the
    grouped experts' activation (`moe_act`) goes through this class.
    """
    if importlib.util.find_spec("transformer_engine") is not None:
        return
    original = mcore_random.CheckpointWithoutOutput.__init__
    if getattr(original, "_m2bw_no_fp8", False):
        return

    @functools.wraps(original)
    def __init__(self, fp8=False) -> None:
        original(self, fp8)
        self.fp8 = False

    __init__._m2bw_no_fp8 = True  # type: ignore[attr-defined]
    mcore_random.CheckpointWithoutOutput.__init__ = __init__


_checkpoint_without_output_without_te()


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default generator and megatron-core's RNG tracker, on CPU or CUDA.

    Equivalent of Megatron-LM's `torch.manual_seed(seed)` followed by
    `model_parallel_cuda_manual_seed(seed)`; with the shims the tracker states are CPU
    generator states (the tensor-parallel stream is offset by the TP rank, as upstream).
    """
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


# --- GlobalMemoryBuffer -------------------------------------------------------------


def _cpu_get_tensor(
    self: mcore_utils.GlobalMemoryBuffer,
    tensor_shape: tuple,
    dtype: torch.dtype,
    name: str,
    mem_alloc_context: Optional[Callable] = None,
) -> torch.Tensor:
    """`GlobalMemoryBuffer.get_tensor`, allocating on CPU.

    Why: `DotProductAttention` takes its `baddbmm` scratch buffer from this global
    buffer, which upstream allocates on `torch.cuda.current_device()`.
    """
    del mem_alloc_context  # only meaningful for CUDA memory pools
    required_len = functools.reduce(operator.mul, tensor_shape, 1)
    buffer = self.buffer.get((name, dtype))
    if buffer is None or buffer.numel() < required_len:
        buffer = torch.empty(required_len, dtype=dtype, device="cpu", requires_grad=False)
        self.buffer[(name, dtype)] = buffer
    return buffer[0:required_len].view(*tensor_shape)


# --- RNG tracker --------------------------------------------------------------------


class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """megatron-core's RNG-states tracker with CPU generator states.

    Why: attention dropout runs inside `get_cuda_rng_tracker().fork()` so that TP ranks
    draw different masks; upstream `add` seeds and `fork` swaps the *CUDA* generator,
    which fails without a GPU ("cuda rng state model-parallel-rng is not added", then
    CUDA calls). On CPU, dropout draws from the default CPU generator, so `fork`
    swaps that generator's state in and out.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=False)

    def add(self, name: str, seed: int) -> None:
        """Track a CPU generator state seeded with `seed`, without touching the default one."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"cpu rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator(device="cpu").manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block with the default CPU generator set to the tracked state `name`."""
        if name not in self.states_:
            raise Exception(f"cpu rng state {name} is not added")
        outer_state = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            # A fresh tensor, so snapshots taken by get_states() stay unchanged.
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer_state)


def _install_cpu_rng_tracker() -> None:
    """Make megatron-core's tracker factory build `CpuRNGStatesTracker`s.

    Why: `get_cuda_rng_tracker()` and `model_parallel_cuda_manual_seed()` create the
    tracker through `initialize_rng_tracker`, which would build a CUDA one.
    """

    def initialize_cpu_rng_tracker(*args, force_reset: bool = False, **kwargs) -> None:
        current = mcore_random._CUDA_RNG_STATE_TRACKER
        if force_reset or not isinstance(current, CpuRNGStatesTracker):
            mcore_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    mcore_random.initialize_rng_tracker = initialize_cpu_rng_tracker
    initialize_cpu_rng_tracker()


def _cpu_get_all_rng_states() -> tuple:
    """`random._get_all_rng_states` without the CUDA generator.

    Why: full activation recomputation (`tensor_parallel.checkpoint`) snapshots the
    CPU, CUDA and tracker RNG states in forward and restores them before recomputing,
    so dropout masks repeat; upstream reads the CUDA state, which fails on CPU.
    """
    tracker = mcore_random.get_cuda_rng_tracker()
    return torch.get_rng_state(), None, tracker.get_states()


def _cpu_set_all_rng_states(
    cpu_state: torch.Tensor, cuda_state: None, tracker_states: dict
) -> None:
    """`random._set_all_rng_states` without the CUDA generator (see `_cpu_get_all_rng_states`)."""
    del cuda_state
    torch.set_rng_state(cpu_state)
    mcore_random.get_cuda_rng_tracker().set_states(tracker_states)


# --- causal mask --------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """`transformer.utils.get_default_causal_mask` on CPU (True = masked out).

    Why: the local softmax builds the causal mask itself when GPT passes
    `attention_mask=None`, and upstream creates it with `device="cuda"`.
    """
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool, device="cpu"), diagonal=1)


@functools.lru_cache(maxsize=8)
def _cpu_sliding_window_causal_mask(sq: int, skv: int,
                                    window_size: tuple[int, int]) -> torch.Tensor:
    """`transformer.utils.get_sliding_window_causal_mask` on CPU (True = masked out): key
    j is kept for query i when i - left <= j - (skv - sq) <= i + right.

    Why: the local softmax of a sliding-window layer builds this mask itself, and
    upstream creates it with `device="cuda"`.
    """
    keep = torch.ones(sq, skv, dtype=torch.bool, device="cpu")
    keep = torch.triu(keep, diagonal=skv - sq - window_size[0])
    return ~torch.tril(keep, diagonal=skv - sq + window_size[1])


# --- rotary embeddings --------------------------------------------------------------


def _cpu_rotary_get_emb(self: rotary_pos_embedding.RotaryEmbedding, max_seq_len: int,
                        offset: int = 0) -> torch.Tensor:
    """`RotaryEmbedding.get_emb` without moving the frequencies to CUDA.

    Why: upstream moves `inv_freq` to `torch.cuda.current_device()` on the first call
    whenever it sits on CPU (where `use_cpu_initialization` puts it), which fails without
    a GPU. The angles are the same: one per (position, frequency), repeated for the two
    rotated halves of a head, or for each (even, odd) pair when interleaved.
    """
    angles = self.get_freqs_non_repeated(max_seq_len, offset)  # [seq, dim / 2]
    if self.rotary_interleaved:
        emb = angles.repeat_interleave(2, dim=-1)
    else:
        emb = torch.cat((angles, angles), dim=-1)
    return emb[:, None, None, :]  # [seq, 1, 1, dim]


def _wrap_mla_rotary() -> None:
    """Build and run multi-latent attention's rotary embedding on CPU.

    Why: `MultiLatentAttention.__init__` builds its RotaryEmbedding / YarnRotaryEmbedding
    without `use_cpu_initialization`, i.e. on `torch.cuda.current_device()`, and
    `YarnRotaryEmbedding.get_emb` moves its frequencies there on the first call. For those
    two calls only the current device reads "cpu" (the same frequencies, on CPU).
    """
    mla = multi_latent_attention.MultiLatentAttention
    yarn = yarn_rotary_pos_embedding.YarnRotaryEmbedding
    init, get_emb = mla.__init__, yarn.get_emb
    if getattr(init, "_cpu_shim", False):
        return

    @functools.wraps(init)
    def cpu_init(self, *args, **kwargs) -> None:
        with _current_device_is_cpu():
            init(self, *args, **kwargs)

    @functools.wraps(get_emb)
    def cpu_get_emb(self, *args, **kwargs):
        with _current_device_is_cpu():
            return get_emb(self, *args, **kwargs)

    cpu_init._cpu_shim = True
    multi_latent_attention.MultiLatentAttention.__init__ = cpu_init
    yarn_rotary_pos_embedding.YarnRotaryEmbedding.get_emb = cpu_get_emb


def _cpu_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int,
                                 cp_group) -> torch.Tensor:
    """`rope_utils.get_pos_emb_on_this_cp_rank` on CPU: the rotary angles of this
    context-parallel rank's two load-balanced chunks (the data's `cp_slice` layout).

    Why: upstream builds its chunk index in pinned memory and moves it to CUDA.
    """
    return cp_slice(pos_emb, seq_dim, cp_group.rank(), cp_group.size())


# --- tensor-parallel gather / reduce-scatter along the last dimension ----------------


def _cpu_gather_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """`mappings._gather_along_last_dim` on CPU: every rank's tensor, side by side.

    Why: with fewer query groups than tensor-parallel ranks, attention all-gathers the
    fused QKV output (`get_query_key_value_tensors`); upstream allocates the gathered
    buffer on `torch.cuda.current_device()`.
    """
    if group.size() == 1:
        return input_
    return comm.gather_concat(input_, -1, group).contiguous()


def _cpu_reduce_scatter_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """`mappings._reduce_scatter_along_last_dim` on CPU: the sum, this rank's slice.

    Why: the backward of the gather above; upstream reduce-scatters into a CUDA buffer,
    and gloo has no reduce-scatter, so this sums everything and keeps this rank's part.
    """
    world = group.size()
    if world == 1:
        return input_
    total = input_.contiguous().clone()
    comm.all_reduce(total, group)
    return total.chunk(world, dim=-1)[comm.rank(group)].contiguous()


# --- sequence parallelism: gather / reduce-scatter along the first dimension ---------


def _cpu_gather_along_first_dim(input_: torch.Tensor, group, output_split_sizes=None,
                                use_global_buffer: bool = False) -> torch.Tensor:
    """`mappings._gather_along_first_dim` on CPU: every rank's [s/t, ...] end to end.

    Why: under --sequence-parallel the column-parallel layers (and the output layer)
    all-gather their [s/t, b, h] input along the sequence, and upstream allocates the
    gathered buffer on `torch.cuda.current_device()` (or its CUDA global buffer). The
    alltoall MoE dispatcher gathers uneven parts over the expert-TP group
    (`output_split_sizes`).
    """
    del use_global_buffer  # a CUDA memory-pool detail
    if group.size() == 1:
        return input_
    if output_split_sizes is not None and len(set(output_split_sizes)) > 1:
        return _gather_uneven_first_dim(input_, group, [int(n) for n in output_split_sizes])
    shape = list(input_.shape)
    shape[0] *= group.size()
    output = torch.empty(shape, dtype=input_.dtype, device=input_.device)
    comm.all_gather_into_tensor(output, input_.contiguous(), group)
    return output


def _cpu_reduce_scatter_along_first_dim(input_: torch.Tensor, group, input_split_sizes=None,
                                        use_global_buffer: bool = False) -> torch.Tensor:
    """`mappings._reduce_scatter_along_first_dim` on CPU: the sum, this rank's [s/t, ...].

    Why: under --sequence-parallel the row-parallel layers reduce-scatter their output
    along the sequence (and the gather above has it as its backward); upstream allocates
    the result on `torch.cuda.current_device()`.
    """
    del use_global_buffer
    world = group.size()
    if world == 1:
        return input_
    if input_split_sizes is not None and len(set(input_split_sizes)) > 1:
        sizes = [int(n) for n in input_split_sizes]
        total = input_.contiguous().clone()
        comm.all_reduce(total, group)  # gloo has no uneven reduce-scatter: sum, then slice
        start = sum(sizes[:comm.rank(group)])
        return total[start:start + sizes[comm.rank(group)]].contiguous()
    if input_.shape[0] % world:
        raise ValueError(f"the first dimension {input_.shape[0]} does not split over "
                         f"{world} tensor-parallel ranks")
    shape = list(input_.shape)
    shape[0] //= world
    output = torch.empty(shape, dtype=input_.dtype, device=input_.device)
    comm.reduce_scatter_tensor(output, input_.contiguous(), group)
    return output


def _gather_uneven_first_dim(input_: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Every rank's [sizes[r], ...] end to end: each part padded to the longest, gathered,
    and cut back (gloo's all-gather takes equal parts only)."""
    longest = max(sizes)
    padded = torch.zeros((longest, *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
    padded[:input_.shape[0]] = input_
    gathered = torch.empty((longest * len(sizes), *input_.shape[1:]), dtype=input_.dtype,
                           device=input_.device)
    comm.all_gather_into_tensor(gathered, padded, group)
    return torch.cat([gathered[r * longest:r * longest + n] for r, n in enumerate(sizes)])


def _wrap_linear_backward() -> None:
    """Let megatron-core's tensor-parallel linear backward allocate on CPU under SP.

    Why: `LinearWithGradAccumulationAndAsyncCommunication.backward` reduce-scatters the
    input gradient of a sequence-parallel column-parallel layer into a buffer it
    allocates on `torch.cuda.current_device()`. For that call only (this process has no
    CUDA device, or the shims would not be applied) the current device reads "cpu".
    """
    cls = tp_layers.LinearWithGradAccumulationAndAsyncCommunication
    original = cls.backward
    if getattr(original, "_cpu_shim", False):
        return

    def backward(ctx, grad_output):
        if not ctx.sequence_parallel:
            return original(ctx, grad_output)
        with _current_device_is_cpu():
            return original(ctx, grad_output)

    backward._cpu_shim = True
    tp_layers.LinearWithGradAccumulationAndAsyncCommunication.backward = staticmethod(backward)


def cuda_device_reads_cpu() -> contextlib.AbstractContextManager:
    """Inside: `torch.cuda.current_device()` returns "cpu" where the CPU shims are applied
    (nothing changes elsewhere). For megatron-core constructors that put a tensor there
    (DotProductAttention's softmax offset, models/gpt_oss.py)."""
    return _current_device_is_cpu() if _APPLIED else contextlib.nullcontext()


@contextlib.contextmanager
def _current_device_is_cpu() -> Iterator[None]:
    """`torch.cuda.current_device()` returns "cpu" inside the block (CPU processes only)."""
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved


# --- mixture of experts -------------------------------------------------------------


def _apply_moe_cpu_shims() -> None:
    """The CPU shims of megatron-core's MoE layer (see each function's why)."""
    moe_router.Router.gating = _cpu_router_gating
    if token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NO_STREAM
    token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = (
        _cpu_dtoh_and_synchronize)
    _wrap_all_to_all()


# Stands for the alltoall dispatcher's device-to-host CUDA stream, which CPU runs never use:
# upstream creates the stream in __init__ unless this class attribute is already set.
_NO_STREAM = object()


def _cpu_router_gating(self: moe_router.Router, input: torch.Tensor) -> torch.Tensor:
    """`Router.gating` without moving the router's weight to CUDA.

    Why: upstream moves a router weight that sits on CPU (where `use_cpu_initialization`
    builds it) to `torch.cuda.current_device()` on every call. The logits are the same:
    the gating GEMM in the router dtype (fp32 / fp64 when asked, else the input's).
    """
    dtypes = {"fp32": torch.float32, "fp64": torch.float64}
    router_dtype = dtypes.get(self.config.moe_router_dtype, input.dtype)
    return moe_router.router_gating_linear(input, self.weight, self.bias, router_dtype)


def _cpu_dtoh_and_synchronize(self: token_dispatcher.MoEAlltoAllTokenDispatcher, point: str,
                              tokens_per_expert: Optional[torch.Tensor] = None
                              ) -> Optional[torch.Tensor]:
    """`MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize` on CPU.

    Why: upstream copies the all-to-all split sizes and token counts to the host on a
    side CUDA stream at its `cuda_dtoh_point` and waits on a CUDA event at its sync point.
    On CPU they are host tensors already: at the same point the split sizes become the
    numpy arrays upstream's copy makes of them, and nothing needs waiting for.
    """
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def _wrap_all_to_all() -> None:
    """Let megatron-core's `_AllToAll` allocate its uneven output on CPU.

    Why: the alltoall token dispatcher exchanges a different number of tokens with each
    expert-parallel rank; for that case `_AllToAll.forward` allocates the output on
    `torch.cuda.current_device()`. For that call only (a CPU process) the current
    device reads "cpu"; its backward is the same forward with the splits swapped.
    """
    original = mappings._AllToAll.forward
    if getattr(original, "_cpu_shim", False):
        return

    def forward(ctx, group, input_, output_split_sizes, input_split_sizes):
        with _current_device_is_cpu():
            return original(ctx, group, input_, output_split_sizes, input_split_sizes)

    forward._cpu_shim = True
    mappings._AllToAll.forward = staticmethod(forward)


# --- tied embeddings ----------------------------------------------------------------


def _wrap_setup_embeddings() -> None:
    """Make `LanguageModule.setup_embeddings_and_output_layer` work on CPU.

    Why: with tied embeddings and PP > 1 the last stage zeroes its copy of the word
    embedding and all-reduces it over the embedding group so both copies start equal;
    upstream first moves the weight with `weight.data.cuda()`. The wrapper hides the
    embedding group from the original method (skipping that all-reduce) and then runs
    the same all-reduce on the CPU tensor.
    """
    original = language_module.LanguageModule.setup_embeddings_and_output_layer
    if getattr(original, "_cpu_shim", False):
        return

    def setup_embeddings_and_output_layer(self: language_module.LanguageModule) -> None:
        group = self.embd_group
        self.embd_group = None
        try:
            original(self)
        finally:
            self.embd_group = group
        if _needs_embedding_sync(self) and self._is_in_embd_group():
            weight = self.shared_embedding_or_output_weight()
            comm.all_reduce(weight.data, group)

    setup_embeddings_and_output_layer._cpu_shim = True
    language_module.LanguageModule.setup_embeddings_and_output_layer = (
        setup_embeddings_and_output_layer)


def _needs_embedding_sync(module: language_module.LanguageModule) -> bool:
    """The condition under which upstream all-reduces the tied embedding at build time."""
    tied = module.share_embeddings_and_output_weights or getattr(module.config, "mtp_num_layers", 0)
    return bool(
        tied
        and module.config.pipeline_model_parallel_size > 1
        and torch.distributed.is_initialized()
    )


# --- dist_checkpointing (--ckpt-format torch_dist) ----------------------------------


@contextlib.contextmanager
def cpu_dist_checkpointing() -> Iterator[None]:
    """Run megatron-core's `dist_checkpointing.save` / `load` on CPU, inside this block.

    Three spots of megatron-core 0.16.1's torch_dist writer assume CUDA, and are replaced
    only for the duration of the call and only when no CUDA device is in use:
    - `FileSystemWriterAsync.preload_tensors` ends with `torch.cuda.synchronize()` (for
      its non-blocking device-to-host copies; CPU tensors need no wait): a no-op here;
    - `save_state_dict_async_finalize` broadcasts its failure flag from a tensor on
      `torch.cuda.current_device()`: that device is "cpu" here (gloo broadcasts it);
    - the writer's result queue is a `spawn`-context Manager queue, which starts a
      helper process re-importing the entry point: a plain in-process queue here (the
      synchronous save collects its forked writers' results in this process).
    """
    if torch.cuda.is_available():
        yield
        return
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    saved = (torch.cuda.synchronize, torch.cuda.current_device, filesystem_async._results_queue)
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device, filesystem_async._results_queue = saved
