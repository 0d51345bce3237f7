"""The kernel's plan (``Plan``): which tiles of the product form each chunk, and where each
chunk lives.

Pure Python (no torch, no Triton), so it is the same on every rank and testable anywhere.

Coordinates
-----------
The GEMM computes ``P``, ``[M, N]`` in *slot space*: row ``p`` of ``P`` is row ``x_row(p)`` of
``x``. The kernel stores ``P`` into one flat buffer of ``M * N`` elements in which every chunk is
one contiguous range ("slot").

Chunks form a grid of ``n_row_bands x n_col_bands``; chunk ``c = a * n_col_bands + b``.

- A row band holds ``runs`` runs of consecutive rows of ``x``: ``runs = R`` for reduce-scatter
  and all-to-all (one run from each rank's block of ``M / R`` rows), ``runs = 1`` for
  all-reduce. Run ``r`` of band ``a`` is rows ``[r * M / runs + a * run_rows, ... + run_rows(a))``
  of ``x``; ``run_rows`` is a multiple of ``block_m`` (all bands but the last), so a tile never
  straddles two runs or two bands and always reads consecutive rows of ``x``.
- Column band ``b`` is columns ``[b * chunk_cols, b * chunk_cols + cols(b))``; ``chunk_cols`` is
  a multiple of ``block_n``.
- Slot of chunk (a, b): ``rows(a) x cols(b)`` row-major (``rows(a) = runs * run_rows(a)``),
  starting at element ``a * chunk_rows * N + b * chunk_cols * rows(a)``.

So with one column band the flat buffer of all-reduce is plain row-major ``x @ w``, and in each
chunk of reduce-scatter and all-to-all rank ``r``'s share is the contiguous range
``[r * run_rows(a) * cols(b), (r + 1) * run_rows(a) * cols(b))``: exactly how NCCL's
reduce-scatter and all-to-all split a buffer. Column bands exist for small M (decode), where
the rows cannot be split.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from ..collectives import collective as _spec
from .gather import GatherPlan, make_gather_plan
from .tiles import _GPU_TILES_16BIT, MAX_CHUNKS, Tiles, host_bands, plain_reason, tiles_for


@dataclass(frozen=True)
class Plan:
    """How one call runs. ``path`` is "overlap" or "fallback"; ``reason`` says why;
    ``transport`` names what moves the chunks (``overlap.comm``; on the plain path "", or the
    latency all-reduce's "one-shot" / "two-shot").

    Identical on every rank for identical arguments (it depends on nothing else).
    """

    path: str
    reason: str
    collective: str
    M: int
    N: int
    K: int
    world_size: int
    tiles: Tiles | None = None
    run_rows: int = 0  # rows of x per run in all row bands but the last
    chunk_cols: int = 0  # columns per column band (multiple of block_n)
    group_m: int = 1  # tile-row grouping of the launch order (divides tile rows per band)
    tiles_per_chunk: tuple[int, ...] = field(default=())
    blocked: bool = False  # rank-block layout of the copy-engine transports (make_plan)
    transport: str = ""
    splits = None  # (an uneven exchange's plan is a SplitPlan)
    # Derived sizes are cached properties: every launch reads them (host time per call).

    @functools.cached_property
    def spec(self):  # -> overlap.collectives.Collective
        """The collective's entry in ``overlap.collectives``."""
        return _spec(self.collective)

    @functools.cached_property
    def runs(self) -> int:
        """Runs per row band: R where each rank gets its own rows (reduce-scatter,
        all-to-all), 1 for all-reduce and for blocked plans."""
        return self.world_size if self.spec.splits_rows and not self.blocked else 1

    @functools.cached_property
    def bands_per_block(self) -> int:
        """Blocked plans: row bands in each rank's block of ``M / R`` rows."""
        return self.n_row_bands // self.world_size

    @functools.cached_property
    def rank_block_rows(self) -> int:
        """Rows of x that one run index walks through: ``M / runs``."""
        return self.M // self.runs

    @functools.cached_property
    def chunk_rows(self) -> int:
        """Slot rows of a full row band."""
        return self.runs * self.run_rows

    @functools.cached_property
    def n_row_bands(self) -> int:
        return math.ceil(self.rank_block_rows / self.run_rows) if self.run_rows else 0

    @functools.cached_property
    def n_col_bands(self) -> int:
        return math.ceil(self.N / self.chunk_cols) if self.chunk_cols else 0

    @property
    def n_chunks(self) -> int:
        return len(self.tiles_per_chunk)

    @functools.cached_property
    def run_rows_last(self) -> int:
        return self.rank_block_rows - (self.n_row_bands - 1) * self.run_rows

    def band_run_rows(self, a: int) -> int:
        """Rows per run in row band ``a``."""
        return self.run_rows_last if a == self.n_row_bands - 1 else self.run_rows

    def band_rows(self, a: int) -> int:
        """Slot rows of row band ``a``."""
        return self.runs * self.band_run_rows(a)

    def band_cols(self, b: int) -> int:
        """Columns of column band ``b``."""
        return min(self.chunk_cols, self.N - b * self.chunk_cols)

    def band_tile_rows(self, a: int) -> int:
        """Tile rows (programs along M) of row band ``a``."""
        return self.runs * math.ceil(self.band_run_rows(a) / self.tiles.block_m)

    @functools.cached_property
    def num_tile_rows(self) -> int:
        return sum(self.band_tile_rows(a) for a in range(self.n_row_bands))

    def chunk_slot(self, c: int) -> tuple[int, int, int, int, int]:
        """``(offset, rows, cols, row0, col0)`` of chunk ``c``: its slot starts at element
        ``offset`` of the flat buffer and holds ``rows x cols`` row-major; it covers slot rows
        ``[row0, row0 + rows)`` and columns ``[col0, col0 + cols)``."""
        return self._slots[c]

    @functools.cached_property
    def _slots(self) -> tuple[tuple[int, int, int, int, int], ...]:
        # computed once per plan: calls reuse plans (make_plan is cached), and the host time
        # of a call is what small products pay for
        slots = []
        for c in range(self.n_chunks):
            a, b = divmod(c, self.n_col_bands)
            row0, col0 = a * self.chunk_rows, b * self.chunk_cols
            rows, cols = self.band_rows(a), self.band_cols(b)
            slots.append((row0 * self.N + col0 * rows, rows, cols, row0, col0))
        return tuple(slots)

    def x_row(self, p: int) -> int:
        """Row of ``x`` (and of the standard product) that slot row ``p`` holds."""
        a, q = divmod(p, self.chunk_rows)
        r, i = divmod(q, self.band_run_rows(a))
        return r * self.rank_block_rows + a * self.run_rows + i

    def layout(self) -> str:
        """How the ranks' messages are cut, which every rank must share (validation's
        fingerprint): "plain" (with the latency all-reduce's kind: "plain one-shot"), or the
        transport, the row layout ("blocked": the copy engines' rank blocks; "slots") and the
        rows and columns of a band."""
        if self.path != "overlap":
            return f"plain {self.transport}" if self.transport else "plain"
        rows = "blocked" if self.blocked else "slots"
        return f"{self.transport} {rows} rows={self.run_rows} cols={self.chunk_cols}"

    def describe(self) -> str:
        """One line: the path, the transport, the chunks and tiles, and why."""
        if self.path != "overlap":
            return f"{self.collective} {self.M}x{self.N}x{self.K}: fallback ({self.reason})"
        t = self.tiles
        return (
            f"{self.collective} {self.M}x{self.N}x{self.K} on {self.world_size} ranks through "
            f"{self.transport or '?'}: {self.n_chunks} chunks ({self.n_row_bands} row bands of "
            f"{self.chunk_rows} rows x {self.n_col_bands} column bands of {self.chunk_cols}), "
            f"tiles {t.block_m}x{t.block_n}x{t.block_k}; {self.reason}"
        )


def _fallback(reason: str, collective: str, M: int, N: int, K: int, R: int) -> Plan:
    return Plan("fallback", reason, collective, M, N, K, R)


@functools.lru_cache(maxsize=1024)
def make_plan(
    M: int,
    N: int,
    K: int,
    *,
    world_size: int,
    collective: str,
    dtype_bits: int,
    interpreter: bool = False,
    num_sms: int = 132,
    chunks: int | None = None,
    tiles: Tiles | None = None,
    blocked: bool = False,
    transport: str = "",
    link: str = "",
) -> Plan | GatherPlan:
    """Choose the chunk plan for ``[M, K] @ [K, N]`` followed by ``collective`` over
    ``world_size`` ranks, for the transport named ``transport`` (``Plan.transport``) over
    ``link`` (``comm.road``'s answer, "network" between hosts; "": NVLink): both decide,
    with the sizes, whether the plain path is taken by default (``tiles.plain_reason``).
    ``"all_gather"`` (before the matmul) gets ``make_gather_plan``'s ``GatherPlan``, which
    uses neither ``N`` nor ``tiles``.

    ``chunks`` asks for about that many chunks (rounded to what the tiles allow); by default the
    plan aims at about two GEMM waves (``num_sms`` tiles each) per chunk, between 2 and 8 chunks:
    1024- and 2048-row chunks measured best on 2x H200 and 512 rows worse. ``tiles`` replaces
    the tile config of ``tiles_for`` (tests).

    Row bands are runs of whole tile rows (every band but the last). Where there are too few
    rows for two bands (decode shapes), the product is split along N in column bands.

    ``blocked`` (the copy-engine transports, ``overlap/contract.py``): the standard row layout
    (one run per band, as for all-reduce) cut into ``R * b`` equal row bands, ``b`` in each
    rank's block of ``M / R`` rows (``b`` about the row bands the standard layout would have,
    divided by ``R``), so that every band belongs to one rank's block. Needs ``M`` divisible by
    ``R``; falls back otherwise.

    Raises:
        ValueError: unknown ``collective``, ``chunks`` outside [2, MAX_CHUNKS], or ``M`` not
            divisible by ``world_size`` for a collective that splits rows by rank.
    """
    spec = _spec(collective)
    if spec.before:  # the all-gather's plan (never N's: the ranks' N may differ)
        return make_gather_plan(M, K, world_size=world_size, dtype_bits=dtype_bits,
                                interpreter=interpreter, num_sms=num_sms, chunks=chunks,
                                blocked=blocked, transport=transport, link=link)  # fmt: skip
    if chunks is not None and not 2 <= chunks <= MAX_CHUNKS:
        raise ValueError(f"chunks must be in [2, {MAX_CHUNKS}], got {chunks}")
    R = world_size
    if spec.splits_rows and M % R:
        raise ValueError(f"{collective} needs M ({M}) divisible by the world size ({R})")
    if R == 1:
        return _fallback("world size 1: nothing to communicate", collective, M, N, K, R)
    if M == 0 or N == 0:
        return _fallback("empty product", collective, M, N, K, R)
    moved = M * N * dtype_bits // 8 * (R - 1) / R * (2 if spec.replicated else 1)
    small = plain_reason(2 * M * N * K, moved, R, link, transport)
    if chunks is None and not interpreter and small:
        return _fallback(small, collective, M, N, K, R)
    t = tiles or tiles_for(M, dtype_bits, interpreter)
    tm, tn = math.ceil(M / t.block_m), math.ceil(N / t.block_n)
    # the host road: blocks in bands of about ``tiles.HOST_BAND_BYTES``, unless chunks are asked
    host = blocked and link == "host" and chunks is None
    least = host_bands(M // R, N * dtype_bits // 8) if host else 1
    if chunks is None:
        # All-to-all: 4 chunks measured 1.01-1.24x over sequential on the bench shapes (2x H200);
        # more chunks were not measured, so they are not chosen by default.
        most = 8 if spec.reduces else 4
        chunks = max(2, min(most, round(tm * tn / (2 * num_sms))))
    # Row bands: runs of whole tiles, so every band but the last is a whole number of tile rows.
    runs = R if spec.splits_rows else 1
    units = math.ceil(M // runs / t.block_m)  # tile rows per run if there were one band
    run_rows = math.ceil(units / min(chunks, units)) * t.block_m
    row_bands = math.ceil(M // runs / run_rows)
    if blocked:
        return _blocked_plan(M, N, K, R, spec, t, row_bands, transport, least)
    chunk_cols = tn * t.block_n
    if row_bands < 2:
        # Too few rows to split: one row band of all M rows, split along N (decode shapes).
        if tn < 2:
            return _fallback(
                "product has one tile column and too few rows to split", collective, M, N, K, R
            )
        run_rows = M // runs
        chunk_cols = math.ceil(tn / min(chunks, tn)) * t.block_n
    # Launch order: GROUP_M tile rows at a time; it must divide a band's tile rows so that
    # chunks finish in order.
    plan = Plan("overlap", "", collective, M, N, K, R, t, run_rows, chunk_cols)
    group_m = math.gcd(8, plan.band_tile_rows(0))
    tiles = tuple(
        plan.band_tile_rows(a) * math.ceil(plan.band_cols(b) / t.block_n)
        for a in range(plan.n_row_bands)
        for b in range(plan.n_col_bands)
    )
    how = "row bands" if plan.n_col_bands == 1 else "column bands (small M)"
    return dataclasses.replace(
        plan,
        reason=f"{len(tiles)} chunks along {how}",
        group_m=group_m,
        tiles_per_chunk=tiles,
        transport=transport,
    )


def splits_rows(M: int, collective: str, world_size: int, tiles: Tiles) -> bool:
    """Whether the standard layout of ``make_plan`` cuts this product into row bands (else
    column bands: decode-sized M). Cheap: the transport choice asks it before planning."""
    runs = world_size if _spec(collective).splits_rows else 1
    return math.ceil(M // runs / tiles.block_m) >= 2


def _blocked_plan(
    M: int, N: int, K: int, R: int, spec, t: Tiles, chunks: int, transport: str, least: int
) -> Plan:
    """``make_plan(blocked=True)``: ``b`` equal bands per rank block (``b`` divides ``M / R``
    so that all bands have the same rows and tile rows; a band's last tile may be partial),
    at least ``least``."""
    name = spec.name
    if M % R:
        return _fallback(f"M ({M}) not divisible by the world size ({R})", name, M, N, K, R)
    block = M // R
    b = max(1, min(max(least, round(chunks / R)), math.ceil(block / t.block_m), MAX_CHUNKS // R))
    while block % b:
        b -= 1
    if spec.replicated:
        # All-reduce's last band still travels after the GEMM: halve the bands while a band
        # keeps 4 tile rows (GROUP_M 4: fewer cost GEMM speed), b stays within chunks and
        # the chunks within the counters.
        while (
            2 * b <= chunks
            and 2 * R * b <= MAX_CHUNKS
            and block % (2 * b) == 0
            and block // (2 * b) >= 4 * t.block_m
        ):
            b *= 2
    if t == Tiles(*_GPU_TILES_16BIT):
        # The copy engines' kernel runs persistent programs (overlap/gemm/matmul.py): with
        # 128x256x64 tiles, 8 warps, 4 stages 0.980x the time of 256x128 ones, faster on 48 of
        # 56 model products >= 2e11 FLOP (one H200, gemm_suite_s13_final_h200.json). The bands
        # (b, above) stay as the 256-row tiles cut them.
        t = Tiles(128, 256, 64, 8, 4)
    plan = Plan("overlap", "", name, M, N, K, R, t, block // b, N, blocked=True)
    tiles = (plan.band_tile_rows(0) * math.ceil(N / t.block_n),) * (R * b)
    return dataclasses.replace(
        plan,
        reason=f"{R * b} chunks, {b} row bands in each rank's block",
        group_m=math.gcd(8, plan.band_tile_rows(0)),
        tiles_per_chunk=tiles,
        transport=transport,
    )
