"""Tile configs and the limits every plan shares. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

MAX_CHUNKS = 64  # counters per context; plans never exceed it
# Below this many FLOP the planner picks the plain path by itself: the host must stay ahead of
# the GPU. Measured on 2x H200 (BENCHMARKS.md, 2026-11-22): an overlapped call issued in full
# costs 0.37-0.57 ms of host time (4-8 chunks), 0.25 ms with 2; decode shapes (M = 16, 128;
# N = 8192, K = 4096) took 0.18-0.29 ms overlapped against 0.03-0.07 ms sequential. 2e11 FLOP
# is about 0.27 ms of bf16 GEMM on an H200; the smallest bench shape (4096x8192x4096) has
# 2.7e11. Repeated copy-engine calls (recorded graphs) now cost less host time than the plain
# call: for them the threshold should come from two-GPU GPU times (NOTES.md, "Open ideas").
MIN_OVERLAP_FLOPS = 2e11

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
