"""``embedding_bag_all_to_all``: model-parallel embedding tables and the all-to-all over
batch slices, overlapped band by band (an uneven exchange, run by ``engine.run_exchange``),
with its custom op and backward."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import guard
from ..context import check_group
from ..plan import DEFAULT_SPLIT_CHUNKS
from ._autograd import custom_op, fake, register
from ._checks import DTYPES, Call, check_backend, check_chunks, group_of, name_of, world
from .engine import Streams, decide_exchange, run_exchange

_BAG_MODES = ("sum", "mean", "max")


def embedding_bag_all_to_all(
    tables: list[torch.Tensor],
    indices: list[torch.Tensor],
    offsets: list[torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    mode: str = "sum",
    rank_dims: list[int] | None = None,
    backend: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """Model-parallel embedding tables (table-wise sharding) and the all-to-all over batch
    slices, overlapped: the pooled vectors of every destination's bags travel band by band.

    Rank ``r`` holds ``tables`` and pools them over the global batch of ``B`` bags; the result
    on every rank is its batch slice ``[B / R, D_all]``, column block ``s`` holding rank
    ``s``'s tables' pooled vectors in its table order. Equals ``embedding_bag`` per table,
    concatenated along columns, then ``all_to_all_single`` over batch slices.

    Args:
        tables: this rank's tables ``[rows_t, D_t]``, one dtype and device.
        indices, offsets: one pair per table, ``embedding_bag``'s 1-D format; every
            ``offsets`` has ``B`` entries (the same ``B`` on every rank, divisible by ``R``).
            ``offsets`` is read on the host at the bands' edges once per call.
        group, backend, chunks: as in ``matmul_collective`` (NCCL per chunk only; default 4
            chunks).
        mode: ``"sum"``, ``"mean"`` or ``"max"`` (``embedding_bag``'s).
        rank_dims: every rank's ``sum(D_t)``; None asks the ranks (a host collective every
            call: pass it where it is known), which also checks that they agree on ``B``,
            ``mode`` and the dtype (validation mode or not).

    Returns:
        ``[B / R, D_all]``. Differentiable in the tables (the gradient is sent back, then
        ``embedding_bag``'s own backward); a custom op under ``torch.compile``.

    Raises:
        TypeError, ValueError: naming the argument (types, shapes, modes, devices, ``B``
            not divisible by ``R``, ``rank_dims`` that disagree with the tables, and what
            ``embedding_bag`` rejects: ``offsets[0] != 0``, decreasing offsets,
            ``offsets[-1] > len(indices)``, indices outside the table).
        overlap.RankMismatchError: ``rank_dims=None`` and the ranks' ``B``, ``mode`` or
            dtype differ (validation mode: also with ``rank_dims``).
    """
    check_group(group)
    check_chunks(chunks)
    R, rank = world(group), (dist.get_rank(group) if world(group) > 1 else 0)
    B = _check_bags(tables, indices, offsets, mode, backend, group, R)
    D = sum(t.shape[1] for t in tables)
    if rank_dims is None:
        rank_dims = [D]
        if R > 1:
            if guard.validating():  # before the host collective: a silent peer is a TimeoutError
                fp = guard.fingerprint("embedding_bag_all_to_all", tables[0].dtype, {"bags": B},
                                       "rank_dims=None")  # fmt: skip
                guard.agree(group, fp, "embedding_bag_all_to_all: every rank's width")
            # what every rank must share travels with the widths, at no cost: checked here
            shared = (B, mode, str(tables[0].dtype).removeprefix("torch."))
            seen = [None] * R
            dist.all_gather_object(seen, (D, shared), group=group)
            if any(s != shared for _, s in seen):
                table = "\n".join(f"  rank {r}: bags={b} mode={m} {t}"
                                  for r, (_, (b, m, t)) in enumerate(seen))  # fmt: skip
                raise guard.RankMismatchError("embedding_bag_all_to_all: ranks disagree on the "
                                              f"batch, mode or dtype; nothing was exchanged.\n"
                                              f"{table}")  # fmt: skip
            rank_dims = [d for d, _ in seen]
    if not isinstance(rank_dims, (list, tuple)) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in rank_dims
    ):  # fmt: skip
        raise TypeError(f"rank_dims must be a list of ints (one per rank), got {rank_dims!r}")
    if len(rank_dims) != R or rank_dims[rank] != D or min(rank_dims) < 0:
        raise ValueError(f"rank_dims must hold every rank's sum of table widths ({R} ints, "
                         f"this rank's {D}), got {rank_dims!r}")  # fmt: skip
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tables)
    if grad or torch.compiler.is_compiling():
        call = Bags(name_of(group), mode, list(rank_dims), backend, chunks)
        return _bags_op(list(tables), list(indices), list(offsets), *call)
    return _bags_forward(
        tables, indices, offsets, group, mode, tuple(rank_dims), backend, chunks, B
    )


def _check_bags(tables, indices, offsets, mode, backend, group, R) -> int:
    """The embedding-bag op's checks; returns ``B``."""
    if not isinstance(tables, (list, tuple)) or not tables:
        raise TypeError("tables must be a non-empty list of [rows, D] tensors")
    for name, seq in (("indices", indices), ("offsets", offsets)):
        if not isinstance(seq, (list, tuple)) or len(seq) != len(tables):
            raise ValueError(f"{name} must be a list with one tensor per table ({len(tables)})")
    if mode not in _BAG_MODES:
        raise ValueError(f"mode must be one of {_BAG_MODES}, got {mode!r}")
    check_backend(backend)
    t0 = tables[0]
    if isinstance(t0, torch.Tensor) and t0.is_meta:
        raise ValueError("tables are on meta: offsets and indices are read on the host")
    for t, i, o in zip(tables, indices, offsets, strict=True):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in DTYPES:
            raise TypeError(f"tables must be 2-D float tensors, got {getattr(t, 'shape', t)}")
        if t.dtype != t0.dtype or t.device != t0.device:
            raise ValueError("tables must share one dtype and device")
        for name, v in (("indices", i), ("offsets", o)):
            if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.is_floating_point() or (
                v.is_complex() or v.dtype == torch.bool
            ):  # fmt: skip
                raise ValueError(f"{name} must hold 1-D integer tensors")
            if v.device != t0.device:
                raise ValueError(f"{name} must be on the tables' device ({t0.device}), got "
                                 f"{v.device}")  # fmt: skip
    B = offsets[0].numel()
    if any(o.numel() != B for o in offsets):
        raise ValueError("offsets must have the same number of bags (B) for every table")
    if B % R:
        raise ValueError(f"the batch ({B} bags) must be divisible by the world size ({R})")
    return B


def _bags_forward(tables, indices, offsets, group, mode, rank_dims, backend, chunks, B):
    """``embedding_bag_all_to_all`` of checked arguments, without autograd: band ``c`` of
    every destination's batch slice pooled into chunk ``c``'s send slot ``[R, h, D]``, an
    event after each, one ``all_to_all_single`` per chunk (``run_splits`` on the flattened
    slots, ``N = 1``), the received blocks copied into their columns."""
    R, D = len(rank_dims), sum(t.shape[1] for t in tables)
    b, t0 = B // R, tables[0]
    n = chunks or DEFAULT_SPLIT_CHUNKS if R > 1 else 1
    bands = [(c * b // n, (c + 1) * b // n) for c in range(n)]
    # the first index of every band's bags, on the host (one small copy per table)
    edges = sorted({j * b + e for j in range(R) for lo, hi in bands for e in (lo, hi)})
    at_edge = [_read_edges(t, i, o, edges) for t, i, o in zip(tables, indices, offsets,
                                                                strict=True)]  # fmt: skip

    def pool(lo: int, hi: int) -> torch.Tensor:  # bags [lo, hi) of every table: [hi - lo, D]
        parts = []
        for t, i, o, e in zip(tables, indices, offsets, at_edge, strict=True):
            parts.append(F.embedding_bag(i[e[lo] : e[hi]], t, o[lo:hi] - e[lo], mode=mode))
        return torch.cat(parts, dim=1)

    # per chunk, elements (rows of width 1) received from and sent to every rank
    layout = [([(hi - lo) * d for d in rank_dims], [(hi - lo) * D] * R) for lo, hi in bands]
    sends, receives = tuple(b * D for _ in range(R)), tuple(b * d for d in rank_dims)
    call = Call("all_to_all", group, "sum", backend, chunks)
    p, cls = decide_exchange((sends, receives), 1, 0, call)  # (n chunks)
    starts = [sum(rank_dims[:s_]) for s_ in range(R)]

    def issue(on: Streams) -> torch.Tensor:
        s = on.comm
        out = t0.new_empty(b, sum(rank_dims))
        send, recv = t0.new_empty(B * D, 1), t0.new_empty(b * sum(rank_dims), 1)
        at = 0
        for c, (lo, hi) in enumerate(bands):
            h = hi - lo
            for j in range(R):  # band c of destination j's slice
                send[at : at + h * D].view(h, D).copy_(pool(j * b + lo, j * b + hi))
                at += h * D
            on.mark(c, on.caller)
        guard.arm()
        on.transport.run_splits(p, send, recv, on.waiter(s), lambda c: None, s, layout)
        with torch.cuda.stream(s) if s is not None else contextlib.nullcontext():
            at = 0
            for lo, hi in bands:
                for s_, d in enumerate(rank_dims):
                    piece = recv[at : at + (hi - lo) * d].view(hi - lo, d)
                    out[lo:hi, starts[s_] : starts[s_] + d] = piece
                    at += (hi - lo) * d
        return out

    agreed = {"bags": B, "mode": mode}  # (validation; with the splits B implies rank_dims)
    return run_exchange(t0, call, p, cls, "embedding_bag_all_to_all", agreed,
                        lambda: pool(0, B), issue)  # fmt: skip


def _read_edges(t, idx, off, edges: list[int]) -> dict[int, int]:
    """``{e: off[e]}`` for the band edges ``e`` (``off[B]``: ``len(idx)``), read on the host
    in the one copy the bands need, with what ``embedding_bag`` checks of ``off`` and ``idx``
    (a band sees only its own offsets, so the bands cannot check them; on CUDA an index out
    of range is a device-side assert). The checks add a few reductions over ``off`` and
    ``idx`` on the device, no synchronization."""
    L, B = idx.numel(), off.numel()
    ends = torch.cat([off.long(), off.new_tensor([L], dtype=torch.long)])
    facts = [ends[edges]]
    if B:  # offsets[0], the count of decreasing steps, offsets[-1]
        facts.append(torch.stack([ends[0], (off[1:] < off[:-1]).sum(), ends[B - 1]]))
    if L:
        facts.append(torch.stack([idx.min(), idx.max()]).long())
    got = torch.cat(facts).tolist()
    at, got = dict(zip(edges, got, strict=False)), got[len(edges) :]
    if B:
        first, falls, last = got[:3]
        got = got[3:]
        if first != 0:
            raise ValueError(f"offsets[0] must be 0 (embedding_bag's), got {first}")
        if falls:
            raise ValueError(f"offsets must be non-decreasing ({falls} decreasing steps)")
        if last > L:
            raise ValueError(f"offsets[-1] ({last}) must not exceed len(indices) ({L})")
    if L and not (0 <= got[0] and got[1] < t.shape[0]):
        raise ValueError(f"indices must lie in [0, {t.shape[0]}) (the table's rows), got "
                         f"values in [{got[0]}, {got[1]}]")  # fmt: skip
    return at


class Bags(NamedTuple):
    """An embedding-bag call as its custom op takes it, besides its tensors."""

    group: str  # the group's name, "" for None (``name_of``)
    mode: str
    rank_dims: list[int]
    backend: str
    chunks: int | None


@custom_op("overlap::embedding_bag_all_to_all", Bags)
def _bags_op(
    tables: list[torch.Tensor], indices: list[torch.Tensor], offsets: list[torch.Tensor],
    call: Bags,
) -> torch.Tensor:  # fmt: skip
    """``embedding_bag_all_to_all`` as a custom op."""
    B = offsets[0].numel()
    return _bags_forward(tables, indices, offsets, group_of(call.group), call.mode,
                         tuple(call.rank_dims), call.backend, call.chunks, B)  # fmt: skip


@fake(_bags_op)
def _(tables, indices, offsets, call: Bags):
    R = len(call.rank_dims)
    return tables[0].new_empty(offsets[0].shape[0] // R, sum(call.rank_dims))


@torch.library.custom_op("overlap::embedding_bag_all_to_all_backward", mutates_args=())
def _bags_backward_op(
    g: torch.Tensor, tables: list[torch.Tensor], indices: list[torch.Tensor],
    offsets: list[torch.Tensor], group: str, mode: str, rank_dims: list[int], need: list[bool],
) -> list[torch.Tensor]:  # fmt: skip
    """The tables' gradients: ``g [B / R, D_all]`` sent back (rank ``s`` gets its columns of
    every batch slice: ``[B, D_s]``), then ``embedding_bag``'s own backward per table where
    ``need`` says (else empty: a frozen table's dense gradient would be as big as it)."""
    pg, R = group_of(group), len(rank_dims)
    D = sum(t.shape[1] for t in tables)
    b = g.shape[0]
    full = g
    if R > 1:
        starts = [sum(rank_dims[:s]) for s in range(R)]
        send = torch.cat(
            [g[:, a : a + d].reshape(-1) for a, d in zip(starts, rank_dims, strict=True)]
        )
        recv = g.new_empty(R * b * D)
        dist.all_to_all_single(recv, send, [b * D] * R, [b * d for d in rank_dims], group=pg)
        full = recv.view(R * b, D)
    grads, at = [], 0
    for t, i, o, needed in zip(tables, indices, offsets, need, strict=True):
        part = full[:, at : at + t.shape[1]]
        grads.append(_bag_grad(t, i, o, part, mode) if needed else t.new_empty(0))
        at += t.shape[1]
    return grads


def _bag_grad(t, idx, off, g, mode: str) -> torch.Tensor:
    """``embedding_bag``'s gradient for its table ``t`` from the pooled gradient ``g [B, D]``
    (a custom op's body runs without autograd, so it is written out): each index gets its
    bag's gradient (``"mean"``: over the bag's size); ``"max"``: only the first row holding
    the bag's maximum, per column."""
    acc = torch.zeros(t.shape, dtype=torch.float32, device=t.device)
    L, (B, D) = idx.numel(), g.shape
    if L == 0:
        return acc.to(t.dtype)
    pos = torch.arange(L, device=t.device)
    bag = torch.searchsorted(off.to(t.device), pos, right=True) - 1
    g = g.float()
    if mode != "max":
        part = g[bag]
        if mode == "mean":
            part /= torch.bincount(bag, minlength=B).clamp_min(1)[bag, None]
        return acc.index_add_(0, idx, part).to(t.dtype)
    vals, where = t[idx].float(), bag[:, None].expand(-1, D)
    best = torch.full((B, D), float("-inf"), device=t.device).scatter_reduce(0, where, vals, "amax")
    candidates = torch.where(vals == best[bag], pos[:, None], L)
    first = torch.full((B, D), L, device=t.device).scatter_reduce(0, where, candidates, "amin")
    hit = first < L
    cols = torch.arange(D, device=t.device).expand(B, -1)
    acc.index_put_((idx[first[hit]], cols[hit]), g[hit], accumulate=True)
    return acc.to(t.dtype)


@_bags_backward_op.register_fake
def _(g, tables, indices, offsets, group, mode, rank_dims, need):
    return [torch.empty_like(t) if n else t.new_empty(0) for t, n in zip(tables, need, strict=True)]


def _bags_setup(ctx, tensors, call: Bags, output) -> None:
    tables, indices, offsets = tensors
    ctx.call = call
    ctx.n = len(tables)
    ctx.save_for_backward(*tables, *indices, *offsets)


def _bags_backward(ctx, need, g):
    saved, n, c = ctx.saved_tensors, ctx.n, ctx.call
    tables, indices, offsets = saved[:n], saved[n : 2 * n], saved[2 * n :]
    need_tables, _, _ = need
    need = list(need_tables)  # (one flag per table)
    grads = _bags_backward_op(g.contiguous(), list(tables), list(indices), list(offsets),
                              c.group, c.mode, c.rank_dims, need)  # fmt: skip
    nones = [None] * n
    grads = [d if needed else None for d, needed in zip(grads, need, strict=True)]
    return grads, nones, nones


register(_bags_op, _bags_setup, _bags_backward)
