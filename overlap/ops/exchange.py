"""The uneven exchanges: the all-to-all with split sizes after a matmul
(``matmul_all_to_all``'s splits), the MoE combine (``grouped_matmul_all_to_all``) and dispatch
(``all_to_all_grouped_matmul``), with their custom ops and backward.

The producer is cuBLAS per band: band ``c`` of every destination's block is computed into the
chunk-major slot layout of ``plan.band_rows`` (chunk ``c``: band ``c`` of every block), an
event after each; a transport that declares ``uneven`` (``comm.select_uneven``: NCCL per
chunk) sends each chunk once its event has passed (``Transport.run_splits``). The dispatch is
the mirror: the exchange first, each received band multiplied once its event has passed.
Each op is decided (``engine.decide_exchange``: a ``plan.SplitPlan`` and its transport) and
run (``engine.run_exchange``: agreement, count, streams, watch and issue, as every call) by
the engine; its file holds only its producer, transport calls and consumer (``issue``).
"""

from __future__ import annotations

import bisect
import contextlib
import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import guard
from ..collectives import collective
from ..plan import band_rows
from ._autograd import call, custom_op, differentiable, fake
from ._checks import (
    Call,
    check_chunks,
    check_operands,
    check_out,
    check_splits,
    group_of,
    needs_grad,
    via_op,
    world,
)
from .engine import Streams, decide_exchange, run_exchange


def split_forward(x, w, call: Call, splits: tuple, out, runs, label: str):
    """``matmul_collective`` all-to-all ``call`` with uneven ``splits``, ``(sends, receives)``
    (checked): cuBLAS computes the
    product chunk by chunk into the slot layout of ``plan.band_rows`` (chunk ``c``: band ``c``
    of every destination's block), an event after each; NCCL per chunk sends each chunk
    once its event has passed (``NcclTransport.run_splits``); one gather puts the received
    rows in order. ``runs`` (``ExpertRuns``; None: one ``w``): ``w`` is ``[E, K, N]`` and
    each run of rows uses its expert's matrix (the MoE combine); ``label``: the public op
    called (``overlap.stats``)."""
    M, K, N = math.prod(x.shape[:-1]), x.shape[-1], w.shape[-1]
    x2 = x.reshape(M, K)
    sends, receives = splits
    out = _split_out(out, (sum(receives), N), x, w)
    p, cls = decide_exchange(splits, N, K, call)
    n = p.n_chunks

    def plain() -> torch.Tensor:
        _product(x2, w, out, slice(0, M), slice(0, M), runs)
        return out

    def issue(on: Streams) -> torch.Tensor:
        y, recv = x.new_empty(M, N), x.new_empty(sum(receives), N)
        for c, rows in enumerate(band_rows(sends, n)):
            for std, slot in rows:
                _product(x2, w, y, std, slot, runs)
            on.mark(c, on.caller)
        guard.arm()
        on.transport.run_splits(p, y, recv, on.waiter(on.comm), lambda c: None, on.comm)
        with torch.cuda.stream(on.comm) if on.comm is not None else contextlib.nullcontext():
            order = on.transport.order(receives, n, x.device, to_slots=False)
            torch.index_select(recv, 0, order, out=out)
        return out

    # (validation agrees on the exchanged rows' width: x @ w's)
    return run_exchange(x, call, p, cls, label, {"width": N}, plain, issue)


def dispatch_forward(x, w, call: Call, splits: tuple, out, runs, keep: bool):
    """``all_to_all_grouped_matmul`` ``call`` with ``splits = (sends, receives)`` (checked):
    ``x`` put into the slot layout of the sends,
    NCCL per chunk exchanges band ``c`` of every block, an event after each; the caller
    stream waits for each chunk and multiplies its received rows (``runs``: ids of the
    received rows) straight into ``out``. Returns ``(out, received x [sum(receives), K])``,
    the second empty unless ``keep``."""
    M, K, N = math.prod(x.shape[:-1]), x.shape[-1], w.shape[-1]
    x2 = x.reshape(M, K)
    sends, receives = splits
    rows = sum(receives)
    out = _split_out(out, (rows, N), x, w)
    p, cls = decide_exchange(splits, N, K, call)
    n = p.n_chunks

    def plain() -> tuple[torch.Tensor, torch.Tensor]:
        _product(x2, w, out, slice(0, M), slice(0, M), runs)
        return out, (x2.clone() if keep else x.new_empty(0))  # (x2 may be x: the op's input)

    def issue(on: Streams) -> tuple[torch.Tensor, torch.Tensor]:
        t, s = on.transport, on.comm
        recv = x.new_empty(rows, K)
        send = x2.index_select(0, t.order(sends, n, x.device, to_slots=True))
        if s is not None:
            s.wait_stream(on.caller)  # `send` is made on the caller stream
        guard.arm()
        t.run_splits(p, send, recv, lambda c: None, lambda c: on.mark(c, s), s)
        for c, bands in enumerate(band_rows(receives, n)):
            on.waiter(on.caller)(c)
            for std, slot in bands:
                _product(recv, w, out, slot, std, runs, ids_at_dst=True)
        full = recv.index_select(0, t.order(receives, n, x.device, to_slots=False)) if keep \
            else x.new_empty(0)  # fmt: skip
        return out, full

    # (validation agrees on the exchanged rows' width: the dispatch sends x)
    return run_exchange(x, call, p, cls, "all_to_all_grouped_matmul", {"width": K}, plain,
                        issue)  # fmt: skip


def _exchange(group, backend: str, chunks: int | None) -> Call:
    """The ``Call`` of a MoE exchange (an all-to-all; its splits travel beside it)."""
    return Call("all_to_all", group, "sum", backend, chunks)


def _split_out(out, shape, x, w) -> torch.Tensor:
    if out is None:
        return x.new_empty(shape)
    check_out(out, shape, x, w)
    return out


def _product(x2, w, y, src: slice, dst: slice, runs, ids_at_dst: bool = False) -> None:
    """``y[dst] = x2[src] @ w`` (equal lengths); with ``runs``, row by row ``@ w[expert]``:
    one matmul per run of equal expert ids, which index the source rows (or with
    ``ids_at_dst`` the destination rows)."""
    if dst.stop == dst.start:
        return
    if runs is None:
        torch.matmul(x2[src], w, out=y[dst])
        return
    at, other = (dst, src) if ids_at_dst else (src, dst)
    shift = other.start - at.start
    for a, b, e in runs.within(at.start, at.stop):
        ya, xa = (a, a + shift) if ids_at_dst else (a + shift, a)
        torch.matmul(x2[xa : xa + b - a], w[e], out=y[ya : ya + b - a])


class ExpertRuns:
    """Maximal runs of equal expert ids over the rows, read on the host once per call:
    ``(start, stop, expert)``; rows sorted by expert within each destination's block make
    one run per (block, expert)."""

    def __init__(self, expert_ids: torch.Tensor, experts: int) -> None:
        ids = expert_ids.reshape(-1).to("cpu", torch.int64)  # (a host sync, once per call)
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < experts):
            raise ValueError(f"expert_ids must lie in [0, {experts}) (w has {experts} experts), "
                             f"got values in [{int(ids.min())}, {int(ids.max())}]")  # fmt: skip
        cuts = [0, *((ids[1:] != ids[:-1]).nonzero().flatten() + 1).tolist(), ids.numel()]
        cuts = cuts if ids.numel() else [0]  # no rows: no runs
        self.starts = cuts[:-1]
        self.runs = [(a, b, int(ids[a])) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]

    def within(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """The runs clipped to rows ``[start, stop)``."""
        i = max(bisect.bisect_right(self.starts, start) - 1, 0)
        out = []
        for a, b, e in self.runs[i:]:
            if a >= stop:
                break
            if b > start:
                out.append((max(a, start), min(b, stop), e))
        return out


def grouped_matmul_all_to_all(
    x: torch.Tensor,
    w: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    input_split_sizes: list[int],
    output_split_sizes: list[int],
    group: dist.ProcessGroup | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """The MoE combine: every row through its expert, then an uneven all-to-all, overlapped
    band by band (as ``matmul_all_to_all`` with splits).

    Equals ``all_to_all_single(out, y, output_split_sizes, input_split_sizes)`` with
    ``y[i] = x[i] @ w[expert_ids[i]]``.

    Args:
        x: ``[M, K]`` (leading dims flattened), rows ordered by destination rank
            (``input_split_sizes[j]`` rows for rank ``j``); fp16, bf16 or fp32.
        w: ``[E, K, N]``, this rank's ``E`` experts, same dtype and device (any strides in
            the last two dims: ``weight.transpose(1, 2)`` of ``[E, N, K]`` is fine).
        expert_ids: ``[M]`` integer tensor, each row's expert in ``[0, E)``. It is read on the
            host once per call (a synchronization with its producer); rows sorted by expert
            within each destination's block make one matmul per (band, expert).
        input_split_sizes, output_split_sizes: rows sent to and received from each rank.
        group, out, backend, chunks: as in ``matmul_collective`` (NCCL per chunk only).

    Returns:
        ``[sum(output_split_sizes), N]``, block ``s`` from rank ``s``. Differentiable in
        ``x`` and ``w`` (the backward sends the gradient back, then per expert
        ``dx = g w_e^T``, ``dw_e = x_e^T g``; plain torch ops); a custom op under
        ``torch.compile``.

    Raises:
        TypeError, ValueError: wrong types, dtypes, devices or shapes (naming the argument),
            splits that do not fit (``matmul_collective``; the rows a rank sends itself,
            ``input_split_sizes[rank]``, equal those it receives from itself,
            ``output_split_sizes[rank]``), expert ids out of range.
    """
    check_chunks(chunks)
    sends, receives = _check_grouped(x, w, expert_ids, input_split_sizes, output_split_sizes,
                                     backend, group, received=False)  # fmt: skip
    gname = via_op(x, w, out, group)
    if gname is not None:
        return _grouped(x, w, expert_ids, Combine(gname, backend, chunks, list(sends),
                                                  list(receives)))  # fmt: skip
    runs = ExpertRuns(expert_ids, w.shape[0])
    return split_forward(x, w, _exchange(group, backend, chunks), (sends, receives), out, runs,
                         "grouped_matmul_all_to_all")  # fmt: skip


class Combine(NamedTuple):
    """A MoE combine as its custom op takes it, besides its tensors."""

    group: str  # the group's name, "" for None (``name_of``)
    backend: str
    chunks: int | None
    sends: list[int]
    receives: list[int]


@custom_op("overlap::grouped_matmul_all_to_all", Combine)
def _grouped_op(
    x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor, call: Combine
) -> torch.Tensor:
    """``grouped_matmul_all_to_all`` as a custom op."""
    runs = ExpertRuns(expert_ids, w.shape[0])
    return split_forward(x, w, _exchange(group_of(call.group), call.backend, call.chunks),
                         (tuple(call.sends), tuple(call.receives)), None, runs,
                         "grouped_matmul_all_to_all")  # fmt: skip


@fake(_grouped_op)
def _(x, w, expert_ids, call: Combine):
    return x.new_empty(sum(call.receives), w.shape[-1])


@custom_op("overlap::grouped_matmul_all_to_all_backward")
def _grouped_backward_op(
    g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor, group: str,
    sends: list[int], receives: list[int], need_dx: bool, need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(dx, dw)`` of ``grouped_matmul_all_to_all`` (empty where not needed): the result's
    gradient sent back (the inverse all-to-all), then per run of an expert's rows. Empty
    ``sends``: no exchange (``x`` are the dispatch's received rows, ``g`` theirs)."""
    pg = group_of(group)
    g2 = g.reshape(math.prod(g.shape[:-1]), w.shape[-1]).contiguous()  # (K or N may be 0)
    exchange = sends and world(pg) > 1  # (empty splits: the dispatch's rows, no exchange)
    gp = collective("all_to_all").backward(g2, pg, (sends, receives)) if exchange else g2
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    dx = torch.empty_like(x2) if need_dx else x.new_empty(0)
    dw = torch.zeros_like(w) if need_dw else w.new_empty(0)
    for a, b, e in ExpertRuns(expert_ids, w.shape[0]).runs:
        if need_dx:
            torch.matmul(gp[a:b], w[e].t(), out=dx[a:b])
        if need_dw:
            dw[e] += x2[a:b].t() @ gp[a:b]
    return dx.reshape(x.shape) if need_dx else dx, dw


@_grouped_backward_op.register_fake
def _(g, x, w, expert_ids, group, sends, receives, need_dx, need_dw):
    return x.new_empty(x.shape if need_dx else 0), w.new_empty(w.shape if need_dw else 0)


def _grouped_setup(ctx, tensors, call: Combine, output) -> None:
    ctx.call = call
    ctx.save_for_backward(*tensors)


def _grouped_backward(ctx, need, g):
    x, w, expert_ids = ctx.saved_tensors
    need_dx, need_dw, _ = need
    c = ctx.call
    dx, dw = call(ctx, _grouped_backward_op, g, x, w, expert_ids, c.group, c.sends, c.receives,
                  need_dx, need_dw)  # fmt: skip
    return dx if need_dx else None, dw if need_dw else None, None


_grouped = differentiable(_grouped_op, _grouped_setup, _grouped_backward)


def _check_grouped(x, w, expert_ids, sends, receives, backend, group, received: bool):
    """The checks of the two MoE ops; ``expert_ids`` has one id per row of ``x``, or with
    ``received`` per received row. Returns the splits as tuples."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor [E, K, N], got {type(w).__name__}")
    if w.dim() != 3 or w.shape[0] < 1:
        raise ValueError(f"w must be [E, K, N] with E >= 1, got {getattr(w, 'shape', w)}")
    check_operands(x, w[0], Call("all_to_all", group, "sum", backend))
    splits = check_splits(x, "all_to_all", sends, receives, group)
    rows = sum(splits[1]) if received else math.prod(x.shape[:-1])
    what = "received row" if received else "row of x"
    ids = expert_ids
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or (
        ids.dtype == torch.bool or ids.numel() != rows
    ):  # fmt: skip
        got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else repr(ids)
        raise ValueError(
            f"expert_ids must be an integer tensor with one id per {what} ({rows}), got {got}"
        )
    if ids.is_meta:
        raise ValueError("expert_ids is on meta: its values are read on the host")
    return splits


def all_to_all_grouped_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    input_split_sizes: list[int],
    output_split_sizes: list[int],
    group: dist.ProcessGroup | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """The MoE dispatch: an uneven all-to-all of the tokens, then every received row through
    its local expert, overlapped band by band (each band multiplied as soon as it has
    arrived; the mirror of ``grouped_matmul_all_to_all``).

    Equals ``y[i] = r[i] @ w[expert_ids[i]]`` with
    ``r = all_to_all_single(x, output_split_sizes, input_split_sizes)``.

    Args:
        x: ``[M, K]`` (leading dims flattened), rows ordered by destination rank.
        w: ``[E, K, N]``, this rank's experts (any strides in the last two dims).
        expert_ids: ``[sum(output_split_sizes)]`` integer tensor: the local expert of each
            *received* row, in the received order (block ``s`` from rank ``s``). Read on the
            host once per call; sorted by expert within each source's block is fastest.
        input_split_sizes, output_split_sizes, group, out, backend, chunks: as in
            ``grouped_matmul_all_to_all``.

    Returns:
        ``[sum(output_split_sizes), N]``. Differentiable in ``x`` and ``w`` (the backward
        multiplies per expert, then sends ``dx`` back; plain torch ops); a custom op under
        ``torch.compile``.

    Raises:
        TypeError, ValueError: as ``grouped_matmul_all_to_all``'s.
    """
    check_chunks(chunks)
    sends, receives = _check_grouped(x, w, expert_ids, input_split_sizes, output_split_sizes,
                                     backend, group, received=True)  # fmt: skip
    gname = via_op(x, w, out, group)
    if gname is not None:
        call = Dispatch(gname, backend, chunks, list(sends), list(receives), needs_grad(x, w))
        return _dispatch(x, w, expert_ids, call)[0]
    runs = ExpertRuns(expert_ids, w.shape[0])
    call = _exchange(group, backend, chunks)
    return dispatch_forward(x, w, call, (sends, receives), out, runs, False)[0]


class Dispatch(NamedTuple):
    """A MoE dispatch as its custom op takes it, besides its tensors."""

    group: str  # the group's name, "" for None (``name_of``)
    backend: str
    chunks: int | None
    sends: list[int]
    receives: list[int]
    keep: bool  # the received x returned (the weight gradient needs it), else empty


@custom_op("overlap::all_to_all_grouped_matmul", Dispatch)
def _dispatch_op(
    x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor, call: Dispatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """``all_to_all_grouped_matmul`` as a custom op: ``(result, received x)`` (the second
    empty unless ``call.keep``)."""
    runs = ExpertRuns(expert_ids, w.shape[0])
    return dispatch_forward(x, w, _exchange(group_of(call.group), call.backend, call.chunks),
                            (tuple(call.sends), tuple(call.receives)), None, runs,
                            call.keep)  # fmt: skip


@fake(_dispatch_op)
def _(x, w, expert_ids, call: Dispatch):
    rows = sum(call.receives)
    return x.new_empty(rows, w.shape[-1]), x.new_empty((rows, x.shape[-1]) if call.keep else 0)


def _dispatch_setup(ctx, tensors, call: Dispatch, output) -> None:
    x, w, expert_ids = tensors
    ctx.call = call
    ctx.x_shape = x.shape
    ctx.save_for_backward(output[1], w, expert_ids)
    ctx.set_materialize_grads(False)


def _dispatch_backward(ctx, need, g, _g_received):
    received, w, expert_ids = ctx.saved_tensors
    need_dx, need_dw, _ = need
    if g is None:
        return None, None, None
    c = ctx.call
    # the combine's backward of the received rows, exchanged the other way
    dz, dw = call(ctx, _grouped_backward_op, g, received, w, expert_ids, c.group, [], [],
                  need_dx, need_dw)  # fmt: skip
    dx = None
    if need_dx:
        dx = call(ctx, _all_to_all_back, dz, c.group, c.sends, c.receives)
        dx = dx.reshape(ctx.x_shape)
    return dx, dw if need_dw else None, None


@custom_op("overlap::all_to_all_back")
def _all_to_all_back(
    g: torch.Tensor, group: str, sends: list[int], receives: list[int]
) -> torch.Tensor:
    """The gradient of the uneven exchange: ``g`` (received rows) sent back to their
    senders, ``[sum(sends), K]``."""
    pg = group_of(group)
    if world(pg) == 1:  # (no process group to exchange with)
        return g.clone()
    return collective("all_to_all").backward(g.contiguous(), pg, (sends, receives))


@_all_to_all_back.register_fake
def _(g, group, sends, receives):
    return g.new_empty(sum(sends), g.shape[-1])


_dispatch = differentiable(_dispatch_op, _dispatch_setup, _dispatch_backward)
