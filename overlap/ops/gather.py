"""``all_gather_matmul``: the all-gather before the matmul, overlapped chunk by chunk
(``_engine.run_before``), with its custom op; its backward is the matmul + reduce-scatter's
(``dense._backward_op``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ._autograd import call, custom_op, differentiable
from ._checks import check_operands, group_of, needs_grad, via_op, world
from ._engine import run_before
from .dense import _backward_op

Product = torch.Tensor | list[torch.Tensor]  # one weight's product, or a list's products


def all_gather_matmul(
    x: torch.Tensor,
    w: torch.Tensor | Sequence[torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    return_gathered: bool = False,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    chunks: int | None = None,
) -> Product | tuple[Product, torch.Tensor]:
    """``dist.all_gather_into_tensor(x_full, x); x_full @ w``, overlapped chunk by chunk.

    This rank's own shard is multiplied first; every chunk of the other shards is multiplied
    as soon as it has arrived (a stream wait per chunk, then one matmul per shard's rows of
    it). The chunks travel through NCCL (one all-gather per chunk: any GPUs, across hosts,
    CUDA graphs) or the copy engines (``backend``; GPU to GPU, or through pinned host memory
    without P2P).

    Args:
        x: this rank's shard ``[..., K]`` (leading dims flattened into ``m`` rows; every rank
            the same ``m``), fp16, bf16 or fp32.
        w: ``[K, N]``, same dtype and device, any strides (``linear.weight.t()`` is fine); or
            a list of them, ``[K, N_i]``: ``x`` is gathered once and multiplied by all of them
            side by side (``[K, sum N_i]``: a view where they are adjacent columns of one
            tensor, as ``overlap.nn.share_input`` lays sibling weights out, else a copy).
        group, backend, chunks: as in ``matmul_collective``.
        return_gathered: also return ``x_full`` (the weight gradient needs it).
        out: optional contiguous ``[R m, N]`` result, sharing no memory with ``x`` or ``w``
            (one ``w`` only).

    Returns:
        ``[R m, N]``, rows ``[r m, (r + 1) m)`` from rank ``r``'s shard (for a list of
        weights, a list of ``[R m, N_i]`` column views of one product); with
        ``return_gathered``, ``(result, x_full [R m, K])``. Differentiable with tensor
        parallelism's conventions (``x``'s gradient is the reduce-scatter of
        ``g @ w^T``, overlapped: ``matmul_reduce_scatter``; for a list, one reduce-scatter of
        the summed ``g_i @ w_i^T``); usable under ``torch.compile`` (the custom op
        ``overlap::all_gather_matmul``).

    Raises:
        TypeError, ValueError: as ``matmul_collective``'s; an empty list of weights, or
            ``out`` with a list.
        overlap.RankMismatchError: (validation mode) the ranks' calls differ, shards of
            different sizes included.
        TimeoutError: (validation mode) as ``matmul_collective``'s.
    """
    if isinstance(w, (list, tuple)):
        sizes = _check_columns(x, w, out, backend, group, chunks)
        res = all_gather_matmul(x, side_by_side(w), group=group, backend=backend, chunks=chunks,
                                return_gathered=return_gathered)  # fmt: skip
        y, full = res if return_gathered else (res, None)
        ys = list(y.split(sizes, dim=1))
        return (ys, full) if return_gathered else ys
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
    dx, dw_t = call(ctx, _backward_op, g, full, w, "all_gather", ctx.group, "sum", need_dx,
                    need_dw, *extra)  # fmt: skip
    return (dx.reshape(ctx.shape) if need_dx else None, dw_t.t() if need_dw else None,
            None, None, None, None)  # fmt: skip


_differentiable = differentiable(_all_gather_matmul_op, _gather_setup, _gather_backward)


def _check_columns(x, ws, out, backend, group, chunks) -> list[int]:
    """Raises on invalid arguments of ``all_gather_matmul`` with a list of weights ``ws``;
    returns their widths ``N_i``."""
    if not ws:
        raise ValueError("w: an empty list of weights")
    if out is not None:
        raise ValueError("out= takes one weight's result; w is a list (its results are views)")
    for i, wi in enumerate(ws):
        try:
            check_operands(x, wi, "all_gather", "sum", backend, group, chunks)
        except (TypeError, ValueError) as e:
            raise type(e)(f"w[{i}]: {e}") from None
    return [wi.shape[1] for wi in ws]


def side_by_side(ws: Sequence[torch.Tensor]) -> torch.Tensor:
    """``ws [K, N_i]`` (checked, same dtype and device) as one ``[K, sum N_i]`` in
    ``weight.t()``'s layout, differentiable: a view of their memory where they are adjacent
    (``ws[i].t()`` consecutive row blocks of one contiguous tensor: ``overlap.nn.share_input``
    lays sibling weights out so), else a copy (``torch.cat``; always under ``torch.compile``,
    whose fake tensors have no addresses). The gradient goes back as column views."""
    if len(ws) == 1:
        return ws[0]
    if torch.is_grad_enabled() and any(wi.requires_grad for wi in ws):
        return _SideBySide.apply(*ws)
    return _joined(ws)


def _joined(ws: Sequence[torch.Tensor]) -> torch.Tensor:
    first, K = ws[0], ws[0].shape[0]
    if not torch.compiler.is_compiling() and _adjacent(ws):
        return first.as_strided((K, sum(wi.shape[1] for wi in ws)), (1, K))
    return torch.cat([wi.t() for wi in ws]).t()


def _adjacent(ws: Sequence[torch.Tensor]) -> bool:
    """``ws[i]`` is ``[K, N_i]`` with strides ``(1, K)``, each starting where the previous
    ends, in one storage."""
    K, step, at = ws[0].shape[0], ws[0].element_size(), ws[0].data_ptr()
    storage = ws[0].untyped_storage().data_ptr()
    for wi in ws:
        if wi.stride() != (1, K) or wi.data_ptr() != at:
            return False
        if wi.untyped_storage().data_ptr() != storage:
            return False
        at += wi.shape[1] * K * step
    return True


class _SideBySide(torch.autograd.Function):
    """``side_by_side`` under autograd: the gradient ``[K, sum N_i]`` back as column views."""

    @staticmethod
    def forward(ctx, *ws):  # noqa: D102
        ctx.sizes = [wi.shape[1] for wi in ws]
        return _joined(ws)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        return g.split(ctx.sizes, dim=1)
