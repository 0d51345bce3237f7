"""The matmul + collective family: ``x @ w`` followed by an all-reduce, reduce-scatter or
all-to-all, overlapped chunk by chunk (``engine.run_after``), with its custom op, fake and
backward.

Shapes (R = world size of ``group``; ``x`` is ``[..., K]`` and ``M`` is the product of its leading
dims; ``w`` is ``[K, N]``, any strides):

================  =======================  ====================================================
collective        result                   equals
================  =======================  ====================================================
all_reduce        ``[..., N]``             ``dist.all_reduce(x @ w)``
reduce_scatter    ``[M / R, N]``           ``dist.reduce_scatter_tensor(out, (x @ w).view(M, N))``
all_to_all        ``[..., N]``             ``dist.all_to_all_single(out, x @ w)``: row block
                                           ``j`` of ``M / R`` rows goes to rank ``j``
================  =======================  ====================================================

The backward (``_backward_op``) serves ``all_gather_matmul`` too: the two are each other's
input gradient (tensor parallelism's mirror pairs, ``Collective.dual``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..collectives import collective
from . import exchange
from ._autograd import call, custom_op, differentiable, fake
from ._checks import Call, check_operands, check_splits, group_of, name_of, via_op, world
from ._columns import joined, stacked
from .engine import plain_again, run_after, run_before


def matmul_collective(
    x: torch.Tensor,
    w: torch.Tensor,
    collective: str = "all_reduce",
    *,
    group: dist.ProcessGroup | None = None,
    op: str = "sum",
    out: torch.Tensor | None = None,
    backend: str = "auto",
    chunks: int | None = None,
    input_split_sizes: list[int] | None = None,
    output_split_sizes: list[int] | None = None,
) -> torch.Tensor:
    """``x @ w`` followed by ``collective`` over ``group``, overlapped chunk by chunk.

    Args:
        x: ``[..., K]`` fp16, bf16 or fp32; leading dims are flattened into ``M``.
        w: ``[K, N]``, same dtype and device, any strides (``linear.weight.t()`` is fine).
        collective: "all_reduce", "reduce_scatter" or "all_to_all" (module docstring: shapes).
        group: process group; ``None`` is the default group (or world size 1 if
            ``torch.distributed`` is not initialized: ``RuntimeError`` where a launcher set
            ``WORLD_SIZE`` > 1).
        op: "sum" or "avg" (reductions only; "avg" divides the product by R before the sum).
        out: optional contiguous result tensor of the result's shape, dtype and device,
            sharing no memory with ``x`` or ``w``.
        backend: "auto" (default: "ce" where it runs, and without P2P only for 2 ranks;
            else "torch"), "torch" (the group's own NCCL/gloo, one collective per chunk),
            "cupy" (a direct NCCL communicator created once from the group) or "ce"
            (copy-engine pushes, GPU to GPU where the GPUs map each other's memory, else
            through pinned host memory: ``overlap/comm/peer.py``, ``host.py``; NCCL where a
            plan or a CUDA-graph capture does not allow it, ``comm.select``). With "auto",
            a bf16 or fp32 all-reduce of at most 16 MB on GPUs that map each other's memory
            runs torch's symmetric-memory one-/two-shot all-reduce (``comm/shot.py``).
        chunks: about how many chunks to use, an int in [2, 64] (default: the planner's).
        input_split_sizes, output_split_sizes: (all-to-all; both or neither) rows of the
            product this rank sends to each rank (consecutive, in rank order; they add up to
            ``M``) and rows it receives from each, as ``all_to_all_single`` takes them
            (``exchange.py``: NCCL per chunk, always overlapped in ``chunks``, default 4,
            chunks; equal splits are faster given as None).

    Returns:
        The result in the plain torch call's layout: ``[..., N]``, or ``[M / R, N]`` for
        reduce-scatter, ``[sum(output_split_sizes), N]`` for an all-to-all with splits.
        Differentiable when ``x`` or ``w`` requires grad (the registered backward,
        ``_backward_op``; the reduce-scatter's input gradient is ``all_gather_matmul``'s);
        usable under ``torch.compile`` (``fullgraph=True`` too: the call is the custom op
        ``overlap::matmul_collective``).

    Raises:
        TypeError: wrong type of ``x``, ``w``, ``out``, ``group`` or ``chunks``, or wrong dtype.
        ValueError: shape or device mismatch, unknown collective/op/backend, ``chunks`` out
            of range, ``M`` not divisible by R for reduce-scatter and all-to-all, ``out``
            with autograd or sharing memory with an input.
        RuntimeError: no process group where a launcher set ``WORLD_SIZE`` > 1.
        overlap.RankMismatchError: (validation mode) the ranks' calls differ.
        TimeoutError: (validation mode) a rank did not arrive, or the call's collectives did
            not finish, within ``overlap.configure``'s timeout.
    """
    return _call(x, w, collective, group, op, backend, chunks, "matmul_collective", out,
                 input_split_sizes, output_split_sizes)  # fmt: skip


def _call(x, w, collective, group, op, backend, chunks, label: str, out, sends, receives):
    """``matmul_collective`` for the public op named ``label`` (what ``overlap.stats``
    counts the call as): a ``Call``'s values in its order (``engine.plain_again``'s), then
    ``out`` and an uneven all-to-all's splits."""
    sig = None
    if out is None and sends is None and receives is None:
        y, sig = plain_again(x, w, collective, group, op, backend, chunks, label)
        if y is not None:
            return y
    call = Call(collective, group, op, backend, chunks)  # (one per call of the full way)
    if check_operands(x, w, call).before:
        raise ValueError(f"collective={collective!r} gathers x before the matmul: call "
                         "overlap.all_gather_matmul")  # fmt: skip
    split = sends is not None or receives is not None
    if split:
        splits = check_splits(x, collective, sends, receives, group)
    # (a signature from plain_again: it found neither autograd nor compile)
    gname = None if sig is not None else via_op(x, w, out, group)
    if gname is not None:
        extra = (list(splits[0]), list(splits[1])) if split else ()
        described = Dense(collective, gname, op, backend, chunks, label, *extra)
        return _differentiable(x, w, [], described)
    if split:
        return exchange.split_forward(x, w, call, splits, out, None, label)
    return run_after(x, w, call, label, out, sig)


def matmul_allreduce(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    collective: str = "all_reduce",
    op: str = "sum",
    out: torch.Tensor | None = None,
    backend: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """``dist.all_reduce(x @ w)`` overlapped: ``x [..., K]``, ``w [K, N]`` -> ``[..., N]``.

    ``collective="reduce_scatter"`` makes it a reduce-scatter (``[M / R, N]``); the other
    arguments are those of ``matmul_collective``, as for the two below.
    """
    return _call(x, w, collective, group, op, backend, chunks, "matmul_allreduce", out, None, None)


def matmul_reduce_scatter(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    op: str = "sum",
    out: torch.Tensor | None = None,
    backend: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """``reduce_scatter_tensor`` of ``x @ w`` overlapped: ``x [..., K]``, ``w [K, N]`` ->
    ``[M / R, N]``, rank r holding rows ``[r * M / R, (r + 1) * M / R)`` of the sum."""
    return _call(
        x, w, "reduce_scatter", group, op, backend, chunks, "matmul_reduce_scatter", out, None, None
    )


def matmul_all_to_all(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    input_split_sizes: list[int] | None = None,
    output_split_sizes: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """``all_to_all_single`` of ``x @ w`` overlapped: ``x [..., K]``, ``w [K, N]`` ->
    ``[..., N]``; row block ``j`` (``M / R`` rows) of the product goes to rank ``j``, and block
    ``s`` of the result came from rank ``s``. With ``input_split_sizes`` and
    ``output_split_sizes`` (as ``all_to_all_single``'s: the rows of ``x``, ordered by
    destination, sent to each rank, and the rows received from each), the blocks are uneven
    and the result is ``[sum(output_split_sizes), N]`` (MoE dispatch and combine)."""
    return _call(x, w, "all_to_all", group, "sum", backend, chunks, "matmul_all_to_all", out,
                 input_split_sizes, output_split_sizes)  # fmt: skip


def matmul_allreduce_stacked(
    x: torch.Tensor, ws: list[torch.Tensor], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``dist.all_reduce(x @ w)`` overlapped, ``w`` the row blocks ``ws [K_i, N]`` stacked
    (``x [..., sum K_i]`` -> ``[..., N]``): the input gradient of column layers that share
    their input (``overlap.nn``; called in their backward, so no autograd here). Eagerly the
    blocks are stacked first (a view where adjacent, as ``share_input`` lays them out); under
    ``torch.compile`` the custom op takes them (``others``) and stacks them where it runs: a
    stack traced into the graph would be a copy at every call, at an address the allocator
    picks, and the weight's address keys the call's decision and record (``_columns``)."""
    if not torch.compiler.is_compiling():
        return matmul_allreduce(x, stacked(ws), group=group)
    call = Dense("all_reduce", name_of(group), "sum", "auto", None, "matmul_allreduce")
    return _matmul_collective_op(x, ws[0], list(ws[1:]), *call)


class Dense(NamedTuple):
    """A matmul + collective call as its custom op takes it, besides its tensors."""

    collective: str
    group: str  # the group's name, "" for None (``name_of``)
    op: str
    backend: str
    chunks: int | None
    label: str  # the public op called (``overlap.stats``)
    sends: list[int] | None = None  # an uneven all-to-all's split sizes (None: equal splits)
    receives: list[int] | None = None


# The op as a torch custom op: torch.compile(fullgraph=True) keeps it whole (Dynamo cannot
# trace the library's Python: locks, driver calls), and autograd runs the registered backward.
# A group travels as its name ("" for None); the ops resolve it in Python, outside tracing.
@custom_op("overlap::matmul_collective", Dense)
def _matmul_collective_op(
    x: torch.Tensor, w: torch.Tensor, others: list[torch.Tensor], call: Dense
) -> torch.Tensor:
    """``matmul_collective`` as a custom op; ``others``: further row blocks of ``w``
    (``[K_i, N]``), stacked below it here (``matmul_allreduce_stacked``; empty otherwise)."""
    pg = group_of(call.group)
    w = stacked([w, *others]) if others else w
    full = Call(call.collective, pg, call.op, call.backend, call.chunks)
    if call.sends is not None:
        splits = check_splits(x, call.collective, call.sends, call.receives, pg)
        return exchange.split_forward(x, w, full, splits, None, None, call.label)
    return run_after(x, w, full, call.label)


@fake(_matmul_collective_op)
def _(x, w, others, call: Dense):
    if call.sends is not None:
        return x.new_empty(sum(call.receives), w.shape[1])
    R = world(group_of(call.group))
    shape = collective(call.collective).result_shape(tuple(x.shape), w.shape[1], R)
    return x.new_empty(shape)


@custom_op("overlap::matmul_collective_backward")
def _backward_op(
    g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, collective_name: str, group: str, op: str,
    need_dx: bool, need_dw: bool, others: list[torch.Tensor], g_x: torch.Tensor | None = None,
    sends: list[int] | None = None, receives: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(dx [.., K], dw^T [N, K])`` of ``matmul_collective`` or ``all_gather_matmul`` (empty
    where not needed; ``w``'s gradient transposed: ``g^T x``, contiguous, so that
    ``w = weight.t()`` gets ``weight.grad`` with no transposing copy and plain torch's cuBLAS
    kernel; one layout whatever ``w``'s strides, which under ``torch.compile`` may differ
    between tracing and a call), with tensor parallelism's conventions (Megatron's), from the
    result's gradient ``g``. ``x``: the forward's input (the all-gather's: ``x_full``, and
    ``dx`` is then this rank's ``[m, K]``); ``g_x``: the gradient of ``x_full`` where the
    caller used it, else None; ``sends``, ``receives``: an uneven all-to-all's splits (its
    backward is the all-to-all back, ``Collective.backward``); ``others``: the all-gather's
    further weights, side by side with ``w`` (``_columns``: joined here, where the call runs;
    ``dw^T`` is then ``[sum N_i, K]``).

    Where the collective has a ``dual`` (``overlap/collectives.py``), ``dx`` is the dual's
    overlapped matmul of ``g`` and ``w^T``: reduce-scatter's is ``all_gather_matmul(g, w^T)``,
    whose gathered ``g`` gives ``dw = x^T g_full``; the all-gather's is
    ``matmul_reduce_scatter(g, w^T)`` (plus the reduce-scatter of ``g_x``). Where both are
    needed, ``dx``'s call computes ``dw`` too, at the point where it would otherwise wait for
    its transfers (its ``cover``: ``engine.produce``, ``consume``): without P2P the transfer
    of a ``dx`` op outlasts its GEMM by up to ~0.8 ms at 8B dims, TP 2. Otherwise the
    product's gradient is ``Collective.backward(g)`` (plain), then ``dx = g_P w^T``,
    ``dw = x^T g_P``. ``op="avg"`` scales ``g`` by ``1 / R`` first."""
    pg = group_of(group)
    R = world(pg)
    spec = collective(collective_name)
    w = joined([w, *others]) if others else w
    # (math.prod, not -1: K or N may be 0)
    g2 = g.reshape(math.prod(g.shape[:-1]), w.shape[1]).contiguous()
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    if op == "avg" and R > 1:
        g2 = g2 / R
    dx = x.new_empty(0)
    # with a dual, dx's call computes dw too, where it would wait for the transfers ("cover")
    inside = need_dw and need_dx and R > 1 and spec.dual is not None
    dw_t = g2.new_empty(w.shape[1], w.shape[0]) if inside else None
    if R == 1:
        gp = g2
    elif spec.before:  # x is x_full: dx is this rank's rows of the reduce-scattered sum
        gp = g2
        if need_dx:
            # (the all-gather's dual: counted as the public op that runs it)
            cover = (g2.t(), x2, dw_t) if dw_t is not None else ()
            dx = run_after(g2, w.t(), Call(spec.dual, pg), "matmul_reduce_scatter",
                           cover=cover)  # fmt: skip
            if g_x is not None:  # x_full was used: its gradient, reduce-scattered (plain)
                part = torch.empty_like(dx)
                collective(spec.dual).plain(g_x.contiguous(), part, pg)
                dx += part
        need_dx = False
    elif spec.dual is not None:  # reduce-scatter: dx = all_gather_matmul(g, w^T)
        if need_dx:
            cover = (x2, dw_t) if dw_t is not None else ()
            dx, gp = run_before(g2, w.t(), Call("all_gather", pg), None, False, cover)
            dx = dx.reshape(x.shape)
        else:
            gp = g2.new_empty(g2.shape[0] * R, g2.shape[1])
            collective(spec.dual).plain(g2, gp, pg)
        need_dx = False
    else:
        gp = spec.backward(g2, pg, None if sends is None else (sends, receives))
    if need_dx:
        dx = (gp @ w.t()).reshape(x.shape)
    if dw_t is None:
        dw_t = gp.t() @ x2 if need_dw else w.new_empty(0)
    return dx, dw_t


@_backward_op.register_fake
def _(g, x, w, collective_name, group, op, need_dx, need_dw, others, g_x=None, sends=None,
      receives=None):  # fmt: skip
    dx_shape = x.shape
    if collective(collective_name).before:
        dx_shape = (x.shape[0] // world(group_of(group)), x.shape[1])
    N = w.shape[1] + sum(o.shape[1] for o in others)
    dw_t = w.new_empty((N, w.shape[0]) if need_dw else 0)
    return x.new_empty(dx_shape if need_dx else 0), dw_t


def _setup(ctx, tensors, call: Dense, output) -> None:
    x, w, others = tensors
    ctx.call = call
    ctx.save_for_backward(x, w, *others)


def _backward(ctx, need, g):
    x, *ws = ctx.saved_tensors
    need_dx, need_dw, need_others = need
    need_dw = need_dw or any(need_others or ())  # (the op's: one bool per other)
    c = ctx.call
    splits = {} if c.sends is None else {"sends": c.sends, "receives": c.receives}
    w = stacked(ws) if len(ws) > 1 else ws[0]  # (further row blocks: internal calls only)
    dx, dw_t = call(ctx, _backward_op, g, x, w, c.collective, c.group, c.op, need_dx, need_dw,
                    [], **splits)  # fmt: skip
    rows = [wi.shape[0] for wi in ws]
    dws = [part.t() for part in dw_t.split(rows, dim=1)] if need_dw else [None] * len(ws)
    return dx if need_dx else None, dws[0], dws[1:]


_differentiable = differentiable(_matmul_collective_op, _setup, _backward)
