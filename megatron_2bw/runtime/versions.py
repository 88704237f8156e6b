"""Weight versions and gradient accumulators of one stage.

2BW keeps exactly two weight buffers per stage (the newest version for new forwards,
one shadow version for in-flight backwards); flush and GPipe keep one. Version v lives
in buffer v % num_buffers, so publishing version v + 1 overwrites version v - 1, which
the schedule guarantees is no longer needed (the validator proves it, and this class
counts live versions at run time to prove it again).

Gradients accumulate in flat fp32 buffers (one all-reduce per minibatch, and fp32
accumulation for bf16/fp16 models, as Megatron's main_grad). Minibatch k accumulates
into buffer k % num_grad_buffers: two when the optimizer step is deferred past the
next minibatch's backward passes, else one. With `grad_dtype` bf16
(--grad-reduce-in-bf16) each accumulation is rounded to bf16, so the buffer holds what
Megatron-LM's bf16 main_grad would (its values are bf16 numbers stored in fp32).
"""
from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import nn


class WeightVersionError(RuntimeError):
    """A stage was asked for a weight version it does not hold."""


class WeightStore:
    """The stage's weight buffers, gradient buffers and version bookkeeping."""

    def __init__(self, module: nn.Module, num_buffers: int, num_grad_buffers: int,
                 first_version: int = 0, make_copy: Optional[Callable[[], nn.Module]] = None,
                 grad_dtype: torch.dtype = torch.float32, grad_numel: int = 0):
        if num_buffers not in (1, 2):
            raise ValueError(f"num_buffers must be 1 or 2, got {num_buffers}")
        make_copy = make_copy or (lambda: copy.deepcopy(module))
        self.modules: list[nn.Module] = [module] + [make_copy() for _ in range(num_buffers - 1)]
        for extra in self.modules[1:]:
            extra.load_state_dict(module.state_dict())
        self.params = [[p for p in m.parameters() if p.requires_grad] for m in self.modules]
        self.grad_dtype = grad_dtype
        if grad_dtype != torch.float32 and any(p.dtype == torch.float32 for p in self.params[0]):
            raise ValueError(f"{grad_dtype} gradients need low-precision parameters (--bf16); "
                             "this stage has fp32 ones")
        # grad_numel: room for the distributed optimizer's padding (w x C elements, so
        # the reduce-scatter runs on the buffer itself); the views cover the parameters
        numel = max(sum(p.numel() for p in self.params[0]), grad_numel)
        device = self.params[0][0].device if self.params[0] else torch.device("cpu")
        self.grad_buffers = [torch.zeros(numel, dtype=torch.float32, device=device)
                             for _ in range(num_grad_buffers)]
        self._grad_views = [self._views(g) for g in self.grad_buffers]
        self._bound: tuple[int, int] | None = None
        self._hooks = self._install_fp32_accumulation()
        self.newest = first_version
        self.valid = {first_version}     # versions whose weights are in a buffer
        if num_buffers == 2 and first_version > 0:  # resumed 2BW: the shadow is held too
            self.valid.add(first_version - 1)
        self.in_use: dict[int, int] = {}  # version -> microbatches holding it
        self.peak_live = 1
        self.loss_scale_of: dict[int, float] = {}

    # --- layout ---------------------------------------------------------------------
    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        views, offset = [], 0
        for p in self.params[0]:
            views.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return views

    def _install_fp32_accumulation(self) -> list:
        """Non-fp32 parameters add their grad into the fp32 view, then drop it."""
        hooks = []
        for buf, params in enumerate(self.params):
            for idx, p in enumerate(params):
                if p.dtype != torch.float32:
                    hooks.append(p.register_post_accumulate_grad_hook(
                        _Fp32Accumulate(self, buf, idx)))
        return hooks

    def accumulate(self, buf: int, idx: int, grad: torch.Tensor) -> None:
        """Add parameter `idx` of weight buffer `buf`'s gradient into the bound fp32
        accumulator (low-precision parameters; fp32 ones accumulate there directly)."""
        if self._bound is None or self._bound[0] != buf:
            raise WeightVersionError("gradient arrived for an unbound weight buffer")
        view = self._grad_views[self._bound[1]][idx]
        view.add_(grad)
        if self.grad_dtype != torch.float32:  # a bf16 main_grad: the sum is rounded
            view.copy_(view.to(self.grad_dtype))

    @property
    def num_buffers(self) -> int:
        return len(self.modules)

    @property
    def num_grad_buffers(self) -> int:
        return len(self.grad_buffers)

    def buffer_of(self, version: int) -> int:
        return version % self.num_buffers

    # --- versions -------------------------------------------------------------------
    def module_for(self, version: int) -> nn.Module:
        if version not in self.valid:
            raise WeightVersionError(f"weight version {version} is not held "
                                     f"(held: {sorted(self.valid)})")
        return self.modules[self.buffer_of(version)]

    def acquire(self, version: int) -> None:
        """A microbatch starts using `version` (its forward)."""
        self.in_use[version] = self.in_use.get(version, 0) + 1
        self.peak_live = max(self.peak_live, len(set(self.in_use) | {self.newest}))

    def release(self, version: int) -> None:
        """A microbatch is done with `version` (its backward)."""
        self.in_use[version] -= 1
        if not self.in_use[version]:
            del self.in_use[version]

    def publish(self, version: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Make room for `version` (= newest + 1); return (newest params, target params).

        The caller (the updater) writes the new weights into the target buffer.
        """
        if version != self.newest + 1:
            raise WeightVersionError(f"version {version} published after {self.newest}")
        evicted = version - self.num_buffers
        if evicted in self.in_use:
            raise WeightVersionError(f"publishing version {version} would overwrite version "
                                     f"{evicted}, still used by {self.in_use[evicted]} "
                                     "microbatches")
        newest = self.params[self.buffer_of(self.newest)]
        target = self.params[self.buffer_of(version)]
        self.valid.discard(evicted)
        self.valid.add(version)
        self.newest = version
        self.peak_live = max(self.peak_live, len(set(self.in_use) | {version}))
        return newest, target

    @contextmanager
    def holding(self, version: int, weights: Optional[Sequence[torch.Tensor]]) -> Iterator[None]:
        """`version`'s buffer runs on `weights` (one tensor per parameter, same shapes and
        dtypes) for the duration; its own tensors come back after, untouched (their
        storage is swapped, not copied). None: nothing changes. Validation runs the
        optimizer's weights this way where weight prediction keeps a prediction there."""
        if weights is None:
            yield
            return
        params = self.params[self.buffer_of(version)]
        own = [p.data for p in params]
        try:
            for p, w in zip(params, weights, strict=True):
                p.data = w
            yield
        finally:
            for p, data in zip(params, own):
                p.data = data

    # --- gradients ------------------------------------------------------------------
    def grad_index(self, minibatch: int) -> int:
        return minibatch % len(self.grad_buffers)

    def bind_grads(self, version: int, minibatch: int) -> None:
        """Point the grads of `version`'s buffer at minibatch's accumulator."""
        key = (self.buffer_of(version), self.grad_index(minibatch))
        if self._bound == key:
            return
        buf, gidx = key
        for p, view in zip(self.params[buf], self._grad_views[gidx]):
            p.grad = view if p.dtype == torch.float32 else None
        self._bound = key

    def grads(self, minibatch: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(flat fp32 gradient, per-parameter views) of `minibatch`."""
        gidx = self.grad_index(minibatch)
        return self.grad_buffers[gidx], self._grad_views[gidx]

    def clear_grads(self, minibatch: int) -> None:
        self.grad_buffers[self.grad_index(minibatch)].zero_()

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for ps in self.params for p in ps)


class _Fp32Accumulate:
    """Post-accumulate hook: move a low-precision grad into the fp32 accumulator."""

    def __init__(self, store: WeightStore, buf: int, idx: int):
        self.store, self.buf, self.idx = store, buf, idx

    def __call__(self, param: torch.Tensor) -> None:
        self.store.accumulate(self.buf, self.idx, param.grad)
        param.grad = None

