"""One-CTA Triton kernel that spins until a counter reaches a target.

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
    while value < target:
        value = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")


def spin_until(counter: torch.Tensor, target: int) -> None:
    """On the current stream: wait until ``counter[0] >= target``.

    Args:
        counter: a one-element int32 CUDA tensor view.
        target: a tile count (below 2**31).
    """
    _spin_until_kernel[(1,)](counter, target, num_warps=1)
