"""Launching a Triton kernel with little host time: the first launch of a specialization goes
through Triton's JIT (which compiles, caches and launches); later ones call the compiled
kernel's launcher directly, skipping the JIT's binding, cache lookup and launch-hook
bookkeeping (about 20 us of host time per launch on an H200 host's CPU). Launch hooks
(profilers) and the interpreter always take Triton's path.

A kernel launched here takes its constexpr parameters last (``launch`` passes them after the
others, in the signature's order).

This file imports no ``torch.distributed``.
"""

from __future__ import annotations

import torch
import triton
from triton import knobs
from triton.compiler import CompiledKernel
from triton.tools.tensor_descriptor import TensorDescriptor

MAX_KEYS = 1024  # compiled kernels kept per kernel (keys hold exact sizes: new M values add)


def launch_key(args: tuple, consts: dict, num_warps: int, num_stages: int) -> tuple:
    """What Triton's specialization of these arguments can depend on, and more: every integer
    by value (Triton specializes integers on == 1, divisibility by 16 and width), tensors by
    dtype and 16-byte alignment, descriptors by everything but their base's address (its
    alignment is kept), other arguments by type. Equal keys therefore mean the same compiled
    kernel; unequal keys at worst go through Triton's JIT once more."""
    key = []
    for a in args:
        t = type(a)
        if t is int:
            key.append(a)
        elif t is TensorDescriptor:
            b = a.base
            key.append((b.dtype, b.data_ptr() % 16 == 0, *a.shape, *a.strides, *a.block_shape,
                        a.padding))  # fmt: skip
        elif isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        else:
            key.append(t)
    return (*key, *consts.values(), num_warps, num_stages)


class Launcher:
    """``kernel``'s launches on the current stream, its compiled specializations kept."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.compiled: dict[tuple, CompiledKernel] = {}

    def __call__(self, grid: int, args: tuple, consts: dict, num_warps: int,
                 num_stages: int = 3) -> CompiledKernel:  # fmt: skip
        """Launch on ``grid`` programs: ``args`` the kernel's leading (non-constexpr)
        parameters in order, ``consts`` its constexprs by name, in the signature's order."""
        hooks = knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls
        key = None if knobs.runtime.interpret or hooks else launch_key(args, consts, num_warps,
                                                                       num_stages)  # fmt: skip
        k = self.compiled.get(key) if key is not None else None
        if k is None:
            k = self.kernel[(grid,)](*args, **consts, num_warps=num_warps, num_stages=num_stages)
            if key is not None:
                if len(self.compiled) >= MAX_KEYS:
                    self.compiled.clear()
                self.compiled[key] = k
            return k
        d = triton.runtime.driver.active
        stream = d.get_current_stream(d.get_current_device())
        k.run(grid, 1, 1, stream, k.function, k.packed_metadata, None, None, None, *args,
              *consts.values())  # fmt: skip
        return k
