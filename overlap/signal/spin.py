"""One-CTA Triton kernel that spins until a counter reaches a target (cyclic compare).

The fallback where stream memory operations are not available. It occupies one SM slot while
it waits, on the communication stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _spin_until_kernel(counter_ptr, target):
    value = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while (value - target) < 0:
        value = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")


def spin_until(counter: torch.Tensor, target: int) -> None:
    """On the current stream: wait until ``counter[0] - target >= 0`` as int32.

    Args:
        counter: a one-element int32 CUDA tensor view.
        target: the value as an unsigned 32-bit number.
    """
    signed = target - (1 << 32) if target >= 1 << 31 else target
    _spin_until_kernel[(1,)](counter, signed, num_warps=1)
