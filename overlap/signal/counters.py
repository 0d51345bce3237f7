"""Chunk counters with epochs instead of resets.

The GEMM adds 1 to ``counter[c]`` for every finished tile of chunk ``c``; counters are never
reset. The host keeps, per counter, the value it will have once every call issued so far has
finished (``expected``); a call waits for ``expected + tiles(c)``. Values live mod 2**32:
``cuStreamWaitValue32(GEQ)`` and ``reached`` compare cyclically, ``(int32)(value - target) >= 0``,
so wrap-around is harmless while fewer than 2**31 tiles are in flight on one counter.

Hazard: one ``ChunkCounters`` serves one stream of calls at a time (the caller stream waits for
the communication stream before the next call can launch its GEMM). ``overlap.context`` keeps
one per (group, device, caller stream) so that streams never share them.
"""

from __future__ import annotations

import torch

from ..plan import MAX_CHUNKS

MASK = 0xFFFFFFFF


def signed32(value: int) -> int:
    """``value`` mod 2**32 as the int32 with the same bits (what a kernel or fill_ takes)."""
    value &= MASK
    return value - (1 << 32) if value >= 1 << 31 else value


def reached(value: int, target: int) -> bool:
    """Cyclic ``value >= target`` on 32-bit counters (the rule of CU_STREAM_WAIT_VALUE_GEQ)."""
    diff = (value - target) & MASK
    return diff < 0x80000000


class ChunkCounters:
    """``MAX_CHUNKS`` int32 counters on ``device`` and the host's view of their targets."""

    def __init__(self, device: torch.device, start: int = 0) -> None:
        # `start` lets tests begin near the wrap-around point.
        self.tensor = torch.full((MAX_CHUNKS,), signed32(start), dtype=torch.int32, device=device)
        self.views = list(self.tensor.split(1))  # one-element view per counter, made once
        self.expected = [start & MASK] * MAX_CHUNKS

    def targets(self, tiles_per_chunk: tuple[int, ...]) -> list[int]:
        """Values the counters reach once the next call's tiles are all stored."""
        return [
            (e + t) & MASK
            for e, t in zip(self.expected[: len(tiles_per_chunk)], tiles_per_chunk, strict=True)
        ]

    def commit(self, targets: list[int]) -> None:
        """Record that a call with these targets was launched (only after its GEMM launched,
        so a failed launch cannot leave the host ahead of the GPU)."""
        self.expected[: len(targets)] = targets
