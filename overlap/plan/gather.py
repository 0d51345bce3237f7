"""The all-gather's plan (``GatherPlan``): the consumer's gather bands. Pure Python."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from ..collectives import collective as _spec
from .tiles import MAX_CHUNKS, host_bands, plain_reason, tiles_for


@dataclass(frozen=True)
class GatherPlan:
    """The all-gather's plan (``all_gather_matmul``): the consumer's gather bands. Every
    rank's shard ``[M / R, K]`` travels in row bands of ``run_rows`` rows (all but the last);
    the consumer multiplies each band of the other shards once it has arrived
    (``shard_bands``). ``blocked`` (the copy engines): ``bands`` equal bands per shard, chunk
    ``s * bands + k`` is band ``k`` of rank ``s``'s shard, landing in the standard layout
    ``[R, M / R, K]``; else (NCCL) chunk ``k`` is band ``k`` of every shard, one all-gather
    into the slot ``[R, h, K]`` (``chunk_slot``).

    Made from ``M`` (the gathered rows), ``K``, ``R``, the dtype and the transport's layout
    only, never ``N``: every rank gathers the same rows, whatever its weight's width.
    """

    path: str
    reason: str
    M: int  # gathered rows: R shards of M / R
    K: int
    world_size: int
    run_rows: int = 0  # rows of every shard per band (all bands but the last)
    blocked: bool = False
    transport: str = ""
    collective = "all_gather"

    @functools.cached_property
    def spec(self):  # -> overlap.collectives.Collective
        return _spec(self.collective)

    @functools.cached_property
    def bands(self) -> int:
        """Row bands of every shard."""
        return math.ceil(self.M // self.world_size / self.run_rows) if self.run_rows else 0

    @property
    def bands_per_block(self) -> int:
        """The copy engines' name of ``bands`` (row bands in each rank's block)."""
        return self.bands

    @property
    def n_chunks(self) -> int:
        return self.world_size * self.bands if self.blocked else self.bands

    def band_run_rows(self, k: int) -> int:
        """Rows of every shard in band ``k``."""
        return min(self.run_rows, self.M // self.world_size - k * self.run_rows)

    def chunk_slot(self, c: int) -> tuple[int, int, int, int, int]:
        """NCCL's chunk ``c`` (band ``c`` of every shard): ``(offset, rows, K, row0, 0)``, its
        slot is rows ``[row0, row0 + rows)`` of the gathered buffer ``[M, K]`` (``offset``:
        its first element), ``[R, rows / R, K]`` in rank order."""
        R = self.world_size
        row0, rows = R * c * self.run_rows, R * self.band_run_rows(c)
        return row0 * self.K, rows, self.K, row0, 0

    @functools.cached_property
    def shard_bands(self) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
        """``(q, h, chunks)`` per band, in the order the consumer multiplies them: rows
        ``[q, q + h)`` of every rank's shard (rows ``[s M / R + q, ... + h)`` of the gathered
        input and of the result for rank ``s``) have arrived once ``chunks`` have. In the
        gathered buffer they are ``buffer[R q : R (q + h)]`` viewed ``[R, h, K]`` (NCCL's
        slots), or for blocked plans ``buffer`` viewed ``[R, M / R, K]``, rows ``[q, q + h)``."""
        b, h, R = self.bands, self.run_rows, self.world_size
        if self.blocked:
            return tuple((k * h, h, tuple(s * b + k for s in range(R))) for k in range(b))
        return tuple((k * h, self.band_run_rows(k), (k,)) for k in range(b))

    def layout(self) -> str:
        """As ``Plan.layout``: "plain", or the transport, the row layout and band rows."""
        if self.path != "overlap":
            return "plain"
        return f"{self.transport} {'blocked' if self.blocked else 'slots'} rows={self.run_rows}"

    def describe(self) -> str:
        """One line: the path, the transport, the bands, and why."""
        if self.path != "overlap":
            return f"all_gather {self.M}x{self.K}: fallback ({self.reason})"
        return (f"all_gather {self.M}x{self.K} on {self.world_size} ranks through "
                f"{self.transport or '?'}: {self.n_chunks} chunks ({self.bands} bands of "
                f"{self.run_rows} rows of every shard); {self.reason}")  # fmt: skip


@functools.lru_cache(maxsize=1024)
def make_gather_plan(
    M: int,
    K: int,
    *,
    world_size: int,
    dtype_bits: int,
    interpreter: bool = False,
    num_sms: int = 132,
    chunks: int | None = None,
    blocked: bool = False,
    transport: str = "",
    link: str = "",
) -> GatherPlan:
    """The plan of an all-gather of ``R`` shards ``[M / R, K]`` before a matmul
    (``GatherPlan``): about ``chunks`` chunks (by default what ``make_plan`` would choose for
    a square ``[M, K] @ [K, K]``, 2 to 4: ``N`` is each rank's own and must not decide),
    bands of whole tile rows; ``blocked``: equal bands per shard, ``R * bands`` chunks;
    ``transport``, ``link``: as ``make_plan``'s (the plain path judged with ``N = K``).

    Raises:
        ValueError: ``chunks`` outside [2, MAX_CHUNKS], or ``M`` not divisible by
            ``world_size``.
    """
    if chunks is not None and not 2 <= chunks <= MAX_CHUNKS:
        raise ValueError(f"chunks must be in [2, {MAX_CHUNKS}], got {chunks}")
    R = world_size
    if M % R:
        raise ValueError(f"all_gather needs M ({M}) divisible by the world size ({R})")
    why = None
    if R == 1:
        why = "world size 1: nothing to communicate"
    elif M == 0 or K == 0:
        why = "empty shards: nothing to gather"
    elif chunks is None and not interpreter:  # (N is each rank's own: judged as N = K)
        moved = M * K * dtype_bits // 8 * (R - 1) / R
        why = plain_reason(2 * M * K * K, moved, R, link, transport)
    if why is not None:
        return GatherPlan("fallback", why, M, K, R)
    t = tiles_for(M, dtype_bits, interpreter)
    if chunks is None:
        tiles = math.ceil(M / t.block_m) * math.ceil(K / t.block_n)
        chunks = max(2, min(4, round(tiles / (2 * num_sms))))
        if blocked and link == "host":  # (``tiles.HOST_BAND_BYTES``)
            chunks = max(chunks, min(MAX_CHUNKS // R, host_bands(M // R, K * dtype_bits // 8)))
    m = M // R
    units = math.ceil(m / t.block_m)  # tile rows per shard
    run_rows = math.ceil(units / min(chunks, units)) * t.block_m
    bands = math.ceil(m / run_rows)
    if blocked:  # equal bands: b divides the shard's rows
        bands = max(1, min(bands, units, MAX_CHUNKS // R))
        while m % bands:
            bands -= 1
        run_rows = m // bands
    elif bands < 2:
        run_rows = m  # one band: the shards travel while this rank's own is multiplied
    p = GatherPlan("overlap", "", M, K, R, run_rows, blocked, transport)
    how = f"{p.bands} row bands of every shard" + (", one chunk per rank" if blocked else "")
    return dataclasses.replace(p, reason=f"{p.n_chunks} chunks: {how}")
