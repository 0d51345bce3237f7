"""The uneven exchanges' plan (``SplitPlan``) and their bands (``band_rows``). Pure Python."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .tiles import MAX_CHUNKS

DEFAULT_SPLIT_CHUNKS = 4


@dataclass(frozen=True)
class SplitPlan:
    """The plan of an uneven exchange (an all-to-all with split sizes: the MoE ops, the
    embedding bags): this rank sends ``splits[0][j]`` rows (consecutive, in rank order) of
    ``[M, K] @ [K, N]`` to rank ``j`` and receives ``splits[1][s]`` from rank ``s``; chunk
    ``c`` is band ``c`` of every rank's block (``band_rows``). Always overlapped off world
    size 1 (the ranks' ``M`` differ, so the path cannot depend on the product's size)."""

    collective: str
    M: int  # this rank's rows: the ranks' M differ
    N: int
    K: int
    world_size: int
    n_chunks: int
    splits: tuple[tuple[int, ...], tuple[int, ...]]
    transport: str
    path: str = "overlap"
    blocked: bool = False
    tiles = None

    @property
    def reason(self) -> str:
        if self.path != "overlap":
            return "world size 1: nothing to communicate"
        return f"uneven splits: {self.n_chunks} chunks, band c of every rank's block in chunk c"

    @property
    def tiles_per_chunk(self) -> tuple[int, ...]:
        return (0,) * self.n_chunks  # (no kernel: cuBLAS per band)

    def layout(self) -> str:
        """As ``Plan.layout``: the transport and the chunks (each chunk's rows per rank come
        from the splits, which ``guard.agree`` checks)."""
        return f"{self.transport} chunks={self.n_chunks}"

    def describe(self) -> str:
        """One line: the exchange, the transport, the splits."""
        return (f"{self.collective} {self.M}x{self.N}x{self.K} on {self.world_size} ranks "
                f"through {self.transport}, sending {list(self.splits[0])} and receiving "
                f"{list(self.splits[1])} rows; {self.reason}")  # fmt: skip


def make_split_plan(
    in_splits: tuple[int, ...],
    out_splits: tuple[int, ...],
    N: int,
    K: int,
    *,
    chunks: int | None,
    transport: str,
) -> SplitPlan:
    """The plan of an all-to-all with uneven splits after ``[M, K] @ [K, N]`` (``SplitPlan``).
    The ranks' ``M`` differ, so nothing may depend on it: ``chunks`` (default
    ``DEFAULT_SPLIT_CHUNKS``) chunks (``M`` is this rank's)."""
    if chunks is not None and not 2 <= chunks <= MAX_CHUNKS:
        raise ValueError(f"chunks must be in [2, {MAX_CHUNKS}], got {chunks}")
    R = len(in_splits)
    return SplitPlan("all_to_all", sum(in_splits), N, K, R, chunks or DEFAULT_SPLIT_CHUNKS,
                     (tuple(in_splits), tuple(out_splits)), transport,
                     "overlap" if R > 1 else "fallback")  # fmt: skip


@functools.lru_cache(maxsize=256)
def band_rows(splits: tuple[int, ...], chunks: int) -> tuple[tuple[tuple[slice, slice], ...], ...]:
    """An uneven all-to-all's rows: ``[c][j]`` is ``(standard, slot)``, band ``c`` of block
    ``j`` in the standard layout (consecutive blocks of ``splits`` rows) and in the
    chunk-major slot layout (chunk ``c`` holds band ``c`` of every block, in block order, so
    that it is one contiguous ``all_to_all_single`` buffer). Band ``c`` of a block of ``n``
    rows is its rows ``[c n // chunks, (c + 1) n // chunks)``: a sender and its receiver
    compute the same bands from the same count."""
    starts = [sum(splits[:j]) for j in range(len(splits))]
    out, at = [], 0
    for c in range(chunks):
        row = []
        for s0, n in zip(starts, splits, strict=True):
            a, b = c * n // chunks, (c + 1) * n // chunks
            row.append((slice(s0 + a, s0 + b), slice(at, at + b - a)))
            at += b - a
        out.append(tuple(row))
    return tuple(out)
