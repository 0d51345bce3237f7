"""Tile configs and the limits every plan shares. Pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_CHUNKS = 64  # counters per context; plans never exceed it

# The plain-path decision (``plain_reason``). An overlapped call hides at most the shorter of
# its GEMM and its transfer, and costs more than the plain call: host time (~0.1 ms for the
# copy engines' recorded calls, 0.36-0.45 ms for NCCL per chunk issued in full, 2 H200s) and
# a GPU cost that grows with the peers (flags, a copy per peer and band). So the GEMM must
# outlast the host's extra time (the host stays ahead of the GPU) and ``GEMM_MS_PER_RANK``
# per rank, and the transfer it can hide must not be negligible. At 8B dims and 8192 tokens
# (2 and 4 H100s, NVLink, 2026-11-27): the o projection's 0.19 ms GEMM saved 0.135 ms at TP 2,
# but at TP 4 every op with a GEMM of 0.10-0.15 ms saved at most 0.07 ms and the all-reduces
# and all-gathers among them lost up to 0.09 ms; ops of 0.31 ms or more saved 0.07-0.18 ms.
# Rates (H100 and H200, bf16): cuBLAS 660-800 TFLOP/s (600 here); per rank one way, NVLink
# ~150-200 GB/s (a 4096x8192 reduce-scatter in 0.166 ms on 2 H200s), pinned host memory ~25
# (NCCL's host road: 1.34 ms), between hosts 10. This is a model, not a measurement: every rank must
# decide alike (a rank that overlaps while its peer runs plain hangs both), so it reads no timing,
# only shapes; but its FLOP count takes this rank's own K, which ranks with uneven K shards may not
# share (validation mode's fingerprint catches that: the layout differs). A table measured per group
# would need an agreement (the road's collective). Not checked against measurements without P2P, at
# TP 4 or on other GPUs; at R = 4, NCCL per chunk beat the copy engines for an all-reduce of 16384
# rows (2.006 against 2.284 ms), which no rule here chooses.
GEMM_FLOP_PER_MS = 6e11
LINK_BYTES_PER_MS = {"peer": 1.5e8, "host": 2.5e7, "network": 1e7}  # by ``comm.road``
EXTRA_HOST_MS = {"ce": 0.1, "nccl": 0.4}  # by transport: the copy engines', else NCCL's
GEMM_MS_PER_RANK = 0.05
MIN_HIDDEN_MS = 0.05

# The copy engines' host road (``comm/host.py``) moves each band twice in a row, to pinned host
# memory and from there to the receiver, so a call ends at least one band's second copy after
# the last band's first: its bands hold about ``HOST_BAND_BYTES`` and at least
# ``HOST_BAND_ROWS`` rows (4 tile rows of the copy engines' kernel: fewer cost GEMM speed).
# At 8B dims, 8192 tokens, TP 2 (H100s without P2P, 2026-11-28) the NVLink road's 2 bands of
# 16 MB per rank block left 0.21-0.52 ms above each sequence-parallel op's bound, these
# mostly under 0.12 (BENCHMARKS.md, "Levers tried": the host road's bands).
HOST_BAND_BYTES = 4 << 20
HOST_BAND_ROWS = 512


def host_bands(rows: int, row_bytes: int) -> int:
    """Bands of a rank block of ``rows`` rows of ``row_bytes`` bytes on the host road: a
    power of two (blocks of model shapes divide into them)."""
    bands = 1 << max(0, math.ceil(math.log2(max(1, rows * row_bytes) / HOST_BAND_BYTES)))
    return max(1, min(bands, rows // HOST_BAND_ROWS))


def plain_reason(flop: float, moved: float, R: int, link: str, transport: str) -> str | None:
    """Why a product of ``flop`` FLOP whose collective over ``R`` ranks moves ``moved`` bytes
    per rank over ``link`` (a road of ``LINK_BYTES_PER_MS``; "" is NVLink's) takes the plain
    path by default, or None: its GEMM is shorter than the overlapped call's extra host time
    (``transport`` "ce": the copy engines') or than ``GEMM_MS_PER_RANK`` per rank, or it
    could hide under ``MIN_HIDDEN_MS``."""
    gemm, comm = flop / GEMM_FLOP_PER_MS, moved / _link_rate(link)
    floor = max(EXTRA_HOST_MS["ce" if transport == "ce" else "nccl"], GEMM_MS_PER_RANK * R)
    if gemm < floor:
        return (f"small product ({flop:.2g} FLOP, ~{gemm:.3f} ms of GEMM): an overlapped "
                f"call costs more than it hides under ~{floor:.2f} ms; pass chunks= to force "
                "it")  # fmt: skip
    if min(gemm, comm) < MIN_HIDDEN_MS:
        return (f"small product ({flop:.2g} FLOP): at most ~{min(gemm, comm):.3f} ms of "
                f"transfer to hide ({link or 'peer'}); pass chunks= to force it")  # fmt: skip
    return None


def gemm_outlasts(flop: float, moved: float, link: str) -> bool:
    """Whether a GEMM of ``flop`` FLOP takes at least as long as ``moved`` bytes over ``link``
    (as ``plain_reason``'s), at these rates."""
    return flop / GEMM_FLOP_PER_MS >= moved / _link_rate(link)


def _link_rate(link: str) -> float:
    """Bytes per ms over ``link``: a road of ``LINK_BYTES_PER_MS``, "" NVLink's."""
    return LINK_BYTES_PER_MS.get(link or "peer", LINK_BYTES_PER_MS["network"])


# Tile configs (block_m, block_n, block_k, num_warps, num_stages); the interpreter gets small
# tiles so CPU tests stay fast. Measured on H200 (tools/gemm_sweep.py, BENCHMARKS.md), bf16,
# w = weight.t(), TMA loads, sum over the four bench shapes: 256x128x64/8 warps/4 stages
# 5.29 ms, 3 stages 5.34, 128x128x64/8/4 with warp specialization 5.66, 128x256x64/8/4 6.14;
# cuBLAS 5.02. fp32 (as tf32x3) 2048x4096x4096: 128x64x32/4/4 0.79 ms, 128x128x32/8/3 0.88;
# cuBLAS fp32 1.36.
_GPU_TILES_16BIT = (256, 128, 64, 8, 4)
_GPU_TILES_FP32 = (128, 64, 32, 4, 4)
_INTERPRETER_TILES = (32, 32, 32, 4, 1)
# Decode shapes (M <= 128): narrow tiles so that N alone yields enough programs to fill the GPU
# (N = 8192 gives 128 tiles of 64 columns; 256-wide tiles would give 32 for 132 SMs).
_SMALL_M_BLOCK_N, _SMALL_M_BLOCK_K = 64, 128


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tiles_for(M: int, dtype_bits: int, interpreter: bool) -> Tiles:
    """Tile config for ``M`` rows of an element size in bits, on the GPU or in the Triton
    interpreter."""
    if interpreter:
        return Tiles(*_INTERPRETER_TILES)
    if M <= 128:
        block_m = 32 if M <= 32 else 64 if M <= 64 else 128
        block_k = _SMALL_M_BLOCK_K if dtype_bits == 16 else 32
        return Tiles(block_m, _SMALL_M_BLOCK_N, block_k, 4, 4)
    return Tiles(*(_GPU_TILES_FP32 if dtype_bits == 32 else _GPU_TILES_16BIT))
