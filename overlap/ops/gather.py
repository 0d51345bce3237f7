"""``all_gather_matmul``: the all-gather before the matmul, overlapped chunk by chunk
(``_engine.run_before``), with its custom op; its backward is the matmul + reduce-scatter's
(``dense._backward_op``)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ._autograd import call, custom_op, differentiable
from ._checks import check_operands, group_of, needs_grad, via_op, world
from ._engine import run_before
from .dense import _backward_op


def all_gather_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    return_gathered: bool = False,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``dist.all_gather_into_tensor(x_full, x); x_full @ w``, overlapped chunk by chunk.

    This rank's own shard is multiplied first; every chunk of the other shards is multiplied
    as soon as it has arrived (a stream wait per chunk, then one matmul per shard's rows of
    it). The chunks travel through NCCL (one all-gather per chunk: any GPUs, across hosts,
    CUDA graphs) or the copy engines (``backend``; GPU to GPU, or through pinned host memory
    without P2P).

    Args:
        x: this rank's shard ``[..., K]`` (leading dims flattened into ``m`` rows; every rank
            the same ``m``), fp16, bf16 or fp32.
        w: ``[K, N]``, same dtype and device, any strides (``linear.weight.t()`` is fine).
        group, backend, chunks: as in ``matmul_collective``.
        return_gathered: also return ``x_full`` (the weight gradient needs it).
        out: optional contiguous ``[R m, N]`` result, sharing no memory with ``x`` or ``w``.

    Returns:
        ``[R m, N]``, rows ``[r m, (r + 1) m)`` from rank ``r``'s shard; with
        ``return_gathered``, ``(result, x_full [R m, K])``. Differentiable with tensor
        parallelism's conventions (``x``'s gradient is the reduce-scatter of
        ``g @ w^T``, overlapped: ``matmul_reduce_scatter``); usable under ``torch.compile``
        (the custom op ``overlap::all_gather_matmul``).

    Raises:
        TypeError, ValueError: as ``matmul_collective``'s.
        overlap.RankMismatchError: (validation mode) the ranks' calls differ, shards of
            different sizes included.
        TimeoutError: (validation mode) as ``matmul_collective``'s.
    """
    check_operands(x, w, "all_gather", "sum", backend, group, chunks)
    if not isinstance(return_gathered, bool):
        raise TypeError(f"return_gathered must be a bool, got {type(return_gathered).__name__}")
    gname = via_op(x, w, out, group)
    if gname is not None:
        keep = return_gathered or needs_grad(x, w)  # the backward needs x_full
        y, full = _differentiable(x, w, gname, backend, chunks, keep)
        return (y, full) if return_gathered else y
    y, full = run_before(x, w, group, out, backend, chunks, return_gathered)
    return (y, full) if return_gathered else y


@custom_op("overlap::all_gather_matmul")
def _all_gather_matmul_op(
    x: torch.Tensor, w: torch.Tensor, group: str, backend: str, chunks: int | None, keep: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``all_gather_matmul`` as a custom op: ``(result, x_full)`` (``x_full`` empty unless
    ``keep``); ``group``: the group's name, "" for None."""
    return run_before(x, w, group_of(group), None, backend, chunks, keep)


@_all_gather_matmul_op.register_fake
def _(x, w, group, backend, chunks, keep):
    M = math.prod(x.shape[:-1]) * world(group_of(group))
    return x.new_empty(M, w.shape[1]), x.new_empty((M, x.shape[-1]) if keep else 0)


def _gather_setup(ctx, inputs, output) -> None:
    x, w, ctx.group = inputs[:3]
    ctx.shape = x.shape
    ctx.save_for_backward(output[1], w)
    ctx.set_materialize_grads(False)  # an unused x_full gets no gradient (None)


def _gather_backward(ctx, g, g_full):
    full, w = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    if g is None:
        g = full.new_zeros(full.shape[0], w.shape[1])
    if g_full is not None and g_full.numel() == 0:
        g_full = None
    extra = () if g_full is None else (g_full,)  # (inductor drops a None passed for it)
    dx, dw = call(ctx, _backward_op, g, full, w, "all_gather", ctx.group, "sum", need_dx,
                  need_dw, *extra)  # fmt: skip
    return (dx.reshape(ctx.shape) if need_dx else None, dw if need_dw else None,
            None, None, None, None)  # fmt: skip


_differentiable = differentiable(_all_gather_matmul_op, _gather_setup, _gather_backward)
