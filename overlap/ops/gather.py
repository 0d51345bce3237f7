"""``all_gather_matmul``: the all-gather before the matmul, overlapped chunk by chunk
(``engine.run_before``), with its custom op; its backward is the matmul + reduce-scatter's
(``dense._backward_op``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from ._autograd import call, custom_op, differentiable, fake
from ._checks import Call, check_operands, group_of, needs_grad, via_op, world
from ._columns import joined, side_by_side
from .dense import _backward_op
from .engine import run_before

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
    as soon as it has arrived (a stream wait per chunk, then one batched matmul for the
    shards before this rank's and one for those after; where this rank's own product outlasts
    the others' transfer, one product after the last chunk). The chunks travel through NCCL
    (one all-gather per chunk: any GPUs, across hosts, CUDA graphs) or the copy engines
    (``backend``; GPU to GPU, or through pinned host memory without P2P).

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
    if not isinstance(return_gathered, bool):
        raise TypeError(f"return_gathered must be a bool, got {type(return_gathered).__name__}")
    if isinstance(w, (list, tuple)):
        call = Call("all_gather", group, "sum", backend, chunks)
        sizes = _check_columns(x, w, out, call)
        # (under torch.compile the op joins them where it runs: ``_columns``)
        w, others = (w[0], list(w[1:])) if torch.compiler.is_compiling() else (side_by_side(w), [])
        y, full = _gathered(x, w, others, call, return_gathered, None)
        ys = list(y.split(sizes, dim=1))
        return (ys, full) if return_gathered else ys
    call = Call("all_gather", group, "sum", backend, chunks)
    check_operands(x, w, call)
    y, full = _gathered(x, w, [], call, return_gathered, out)
    return (y, full) if return_gathered else y


def _gathered(x, w, others, call: Call, return_gathered, out):
    """``(x_full @ [w, *others] side by side, x_full or None)``, checked arguments: through
    the custom op where autograd or ``torch.compile`` needs it, else directly."""
    gname = via_op(x, w, out, call.group)
    if gname is not None:
        keep = return_gathered or needs_grad(x, w, *others)  # the backward needs x_full
        return _differentiable(x, w, others, Gather(gname, call.backend, call.chunks, keep))
    return run_before(x, w, call, out, return_gathered)


class Gather(NamedTuple):
    """An all-gather + matmul call as its custom op takes it, besides its tensors."""

    group: str  # the group's name, "" for None (``name_of``)
    backend: str
    chunks: int | None
    keep: bool  # x_full returned (else empty)


@custom_op("overlap::all_gather_matmul", Gather)
def _all_gather_matmul_op(
    x: torch.Tensor, w: torch.Tensor, others: list[torch.Tensor], call: Gather
) -> tuple[torch.Tensor, torch.Tensor]:
    """``all_gather_matmul`` as a custom op: ``(result, x_full)`` (``x_full`` empty unless
    ``call.keep``); ``others``: further weights, side by side with ``w`` (``_columns``; empty
    outside ``torch.compile``)."""
    gather = Call("all_gather", group_of(call.group), "sum", call.backend, call.chunks)
    return run_before(x, joined([w, *others]), gather, None, call.keep)


@fake(_all_gather_matmul_op)
def _(x, w, others, call: Gather):
    M = math.prod(x.shape[:-1]) * world(group_of(call.group))
    N = w.shape[1] + sum(o.shape[1] for o in others)
    return x.new_empty(M, N), x.new_empty((M, x.shape[-1]) if call.keep else 0)


def _gather_setup(ctx, tensors, call: Gather, output) -> None:
    x, w, others = tensors
    ctx.group = call.group
    ctx.shape = x.shape
    ctx.save_for_backward(output[1], w, *others)
    ctx.set_materialize_grads(False)  # an unused x_full gets no gradient (None)


def _gather_backward(ctx, need, g, g_full):
    full, w, *others = ctx.saved_tensors
    need_dx, need_dw, need_others = need
    need_dw = need_dw or any(need_others or ())  # (the op's: one bool per other)
    widths = [w.shape[1], *(o.shape[1] for o in others)]
    if g is None:
        g = full.new_zeros(full.shape[0], sum(widths))
    if g_full is not None and g_full.numel() == 0:
        g_full = None
    extra = () if g_full is None else (g_full,)  # (inductor drops a None passed for it)
    dx, dw_t = call(ctx, _backward_op, g, full, w, "all_gather", ctx.group, "sum", need_dx,
                    need_dw, others, *extra)  # fmt: skip
    dws = [part.t() for part in dw_t.split(widths)] if need_dw else [None] * len(widths)
    return dx.reshape(ctx.shape) if need_dx else None, dws[0], dws[1:]


_differentiable = differentiable(_all_gather_matmul_op, _gather_setup, _gather_backward)


def _check_columns(x, ws, out, call: Call) -> list[int]:
    """Raises on invalid arguments of ``all_gather_matmul`` with a list of weights ``ws``;
    returns their widths ``N_i``."""
    if not ws:
        raise ValueError("w: an empty list of weights")
    if out is not None:
        raise ValueError("out= takes one weight's result; w is a list (its results are views)")
    for i, wi in enumerate(ws):
        try:
            check_operands(x, wi, call)
        except (TypeError, ValueError) as e:
            raise type(e)(f"w[{i}]: {e}") from None
    return [wi.shape[1] for wi in ws]
