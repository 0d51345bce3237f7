"""Tile configs and the limits every plan shares. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

MAX_CHUNKS = 64  # counters per context; plans never exceed it

# The plain-path decision (``plain_reason``). An overlapped call hides at most the shorter of
# its GEMM and its transfer, and costs more host time than the plain call: ~0.1 ms for the
# copy engines' recorded calls, 0.3-0.45 ms for NCCL per chunk issued in full (NOTES.md). It
# is worth it where the GEMM outlasts that host time (the host stays ahead of the GPU) and
# the transfer it can hide is not negligible. Rates (H100 and H200, bf16): cuBLAS 660-800
# TFLOP/s (600 here); per rank one way, NVLink ~150-200 GB/s (a 4096x8192 reduce-scatter in
# 0.166 ms on 2 H200s), pinned host memory ~25 (NCCL's host road: 1.34 ms), between hosts 10.
# At 8B dims and 8192 tokens on 2 H100s the o projection (8192x2048x4096, 1.4e11 FLOP)
# took the plain path under the FLOP line of 2e11 that this replaced.
GEMM_FLOP_PER_MS = 6e11
LINK_BYTES_PER_MS = {"peer": 1.5e8, "host": 2.5e7, "network": 1e7}  # by ``comm.road``
EXTRA_HOST_MS = {"ce": 0.1, "nccl": 0.4}  # by transport: the copy engines', else NCCL's
MIN_HIDDEN_MS = 0.05


def plain_reason(flop: float, moved: float, link: str, transport: str) -> str | None:
    """Why a product of ``flop`` FLOP whose collective moves ``moved`` bytes per rank over
    ``link`` (a road of ``LINK_BYTES_PER_MS``; "" is NVLink's) takes the plain path by
    default, or None: its GEMM is shorter than the overlapped call's extra host time
    (``transport`` "ce": the copy engines'), or it could hide under ``MIN_HIDDEN_MS``."""
    gemm = flop / GEMM_FLOP_PER_MS
    comm = moved / LINK_BYTES_PER_MS.get(link or "peer", LINK_BYTES_PER_MS["network"])
    host = EXTRA_HOST_MS["ce" if transport == "ce" else "nccl"]
    if gemm < host:
        return (f"small product ({flop:.2g} FLOP, ~{gemm:.3f} ms of GEMM): an overlapped "
                f"call costs ~{host} ms more host time; pass chunks= to force it")  # fmt: skip
    if min(gemm, comm) < MIN_HIDDEN_MS:
        return (f"small product ({flop:.2g} FLOP): at most ~{min(gemm, comm):.3f} ms of "
                f"transfer to hide ({link or 'peer'}); pass chunks= to force it")  # fmt: skip
    return None


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
