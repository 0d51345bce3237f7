"""Launching a Triton kernel with its arguments by name and little host time.

A kernel's signature is the one list of its parameters: every launch names each of them (a
dict), ``Launcher.values`` puts them in the signature's order, and a missing or unknown name
raises. The first launch of a specialization goes through Triton's JIT (which compiles,
caches and launches); later ones call the compiled kernel's launcher directly, skipping the
JIT's binding, cache lookup and launch-hook bookkeeping (about 20 us of host time per launch
on an H200 host). Launch hooks (profilers) and the interpreter always take Triton's path.

A kernel launched here takes its constexpr parameters last (Triton's launcher takes them after
the rest).

This file imports no ``torch.distributed``.
"""

from __future__ import annotations

import inspect
import operator

import torch
import triton
from triton import knobs
from triton.compiler import CompiledKernel
from triton.tools.tensor_descriptor import TensorDescriptor

MAX_KEYS = 1024  # compiled kernels kept per kernel (keys hold exact sizes: new M values add)


def names(kernel) -> tuple[tuple[str, ...], int]:
    """``kernel``'s parameter names in its signature's order, and how many come before its
    constexprs (which must come last)."""
    params = inspect.signature(kernel.fn).parameters.values()
    const = ["constexpr" in str(p.annotation) for p in params]
    n = const.index(True) if True in const else len(const)
    if not all(const[n:]):
        raise TypeError(f"{kernel.fn.__name__}: constexpr parameters must come last")
    return tuple(p.name for p in params), n


class Launcher:
    """``kernel``'s launches on the current stream, its compiled specializations kept
    (``compiled``, by ``key``)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.names, self.n_args = names(kernel)
        self._in_order = operator.itemgetter(*self.names)
        self.compiled: dict[tuple, CompiledKernel] = {}

    def values(self, a: dict) -> tuple:
        """The kernel's arguments ``a`` (by name) in the order of its signature."""
        if len(a) == len(self.names):
            try:
                return self._in_order(a)
            except KeyError:
                pass
        missing, unknown = set(self.names) - a.keys(), a.keys() - set(self.names)
        raise TypeError(f"{self.kernel.fn.__name__}: arguments missing {sorted(missing)}, "
                        f"unknown {sorted(unknown)}")  # fmt: skip

    def key(self, device: int, values: tuple, num_warps: int, num_stages: int) -> tuple:
        """What Triton's specialization of ``values`` (in the kernel's order) on ``device``
        (Triton loads a kernel per device) can depend on, and more: every integer by value
        (Triton specializes integers on == 1, divisibility by 16 and width), tensors by dtype
        and 16-byte alignment, descriptors by everything but their base's address (its
        alignment is kept), other arguments by type, constexprs by value. Equal keys
        therefore mean the same compiled kernel; unequal keys at worst go through Triton's
        JIT once more."""
        key = []
        for a in values[: self.n_args]:
            t = type(a)
            if t is int:
                key.append(a)
            elif t is TensorDescriptor:
                b = a.base
                key.append((b.dtype, b.data_ptr() % 16 == 0, *a.shape, *a.strides,
                            *a.block_shape, a.padding))  # fmt: skip
            elif isinstance(a, torch.Tensor):
                key.append((a.dtype, a.data_ptr() % 16 == 0))
            else:
                key.append(t)
        return (device, *key, *values[self.n_args :], num_warps, num_stages)

    @staticmethod
    def hooked() -> bool:
        """Whether launch hooks (a profiler's) are set: launches then take Triton's JIT."""
        return bool(knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls)

    @staticmethod
    def stream():
        """Triton's driver's ``device index -> its current stream (a handle)``."""
        return triton.runtime.driver.active.get_current_stream

    def __call__(self, grid: int, a: dict, num_warps: int, num_stages: int = 3) -> CompiledKernel:
        """Launch on ``grid`` programs with the arguments ``a`` (every parameter by name);
        returns the compiled kernel launched."""
        values = self.values(a)
        key, d, device = None, None, None
        if not (knobs.runtime.interpret or self.hooked()):  # (a kernel is loaded per device)
            d = triton.runtime.driver.active
            device = d.get_current_device()
            key = self.key(device, values, num_warps, num_stages)
        k = self.compiled.get(key) if key is not None else None
        if k is None:
            k = self.kernel[(grid,)](**a, num_warps=num_warps, num_stages=num_stages)
            if key is not None:
                if len(self.compiled) >= MAX_KEYS:
                    self.compiled.clear()
                self.compiled[key] = k
            return k
        stream = d.get_current_stream(device)
        k.run(grid, 1, 1, stream, k.function, k.packed_metadata, None, None, None, *values)
        return k
