"""Tiled GEMM that stores each tile into its chunk's slot and then signals the chunk.

The main loop is the plain Triton tutorial loop. Two things differ from a plain GEMM:

- Row gather (reduce-scatter, all-to-all): program rows are slot rows; the rows of ``x`` they
  read come from ``Plan.x_row``, computed in the kernel once per tile before the main loop.
- Epilogue: the tile goes to its chunk's slot (``Plan.chunk_slot``), then, after a barrier
  (every thread's stores issued), one ``atomic_add(counter[chunk], 1)`` with release semantics
  at GPU scope. A chunk is final when its counter reached its target (see ``overlap.signal``).

This file imports no ``torch.distributed``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import Plan


@triton.jit
def _chunked_matmul_kernel(
    x_ptr,
    w_ptr,
    p_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wk,
    stride_wn,
    CHUNK_ROWS,
    CHUNK_COLS,
    N_COL_BANDS,
    WORLD_SIZE,
    scale,
    PERMUTE_ROWS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    # This tile's chunk (a tile never straddles two bands: the plan aligns them to blocks).
    band_a = (pid_m * BLOCK_M) // CHUNK_ROWS
    band_b = (pid_n * BLOCK_N) // CHUNK_COLS
    row0 = band_a * CHUNK_ROWS
    col0 = band_b * CHUNK_COLS
    band_rows = tl.minimum(CHUNK_ROWS, M - row0)
    band_cols = tl.minimum(CHUNK_COLS, N - col0)

    offs_p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # slot rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if PERMUTE_ROWS:
        rank_block = M // WORLD_SIZE
        h_a = band_rows // WORLD_SIZE
        q = offs_p - row0
        x_rows = (q // h_a) * rank_block + band_a * (CHUNK_ROWS // WORLD_SIZE) + q % h_a
    else:
        x_rows = offs_p
    # Out-of-range rows/columns read row/column 0 and are never stored (the tutorial's trick:
    # no masks on M and N inside the main loop).
    x_rows = tl.where(offs_p < M, x_rows, 0).to(tl.int64)
    offs_wn = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (x_rows[:, None] * stride_xm + offs_k[None, :] * stride_xk)
    w_ptrs = w_ptr + (offs_k[:, None] * stride_wk + offs_wn[None, :] * stride_wn)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if HAS_SCALE:
        acc = acc * scale
    y = acc.to(p_ptr.dtype.element_ty)
    # Slot of chunk (a, b): band_rows x band_cols row-major at row0 * N + col0 * band_rows.
    slot = row0.to(tl.int64) * N + col0 * band_rows
    offs = slot + (offs_p - row0)[:, None].to(tl.int64) * band_cols + (offs_n - col0)[None, :]
    mask = (offs_p[:, None] < M) & (offs_n[None, :] < N)
    tl.store(p_ptr + offs, y, mask=mask)
    tl.debug_barrier()
    tl.atomic_add(counter_ptr + band_a * N_COL_BANDS + band_b, 1, sem="release", scope="gpu")


def chunked_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    p_flat: torch.Tensor,
    counters: torch.Tensor,
    plan: Plan,
    scale: float | None = None,
) -> None:
    """Launch the GEMM of ``plan`` on the current stream.

    Args:
        x: ``[M, K]``, any strides.
        w: ``[K, N]``, any strides (``linear.weight.t()`` works without a copy).
        p_flat: ``[M * N]`` contiguous, the chunk-slot buffer the product is written to.
        counters: ``[>= plan.n_chunks]`` int32; ``counters[c]`` grows by ``tiles_per_chunk[c]``.
        plan: an overlap plan for these shapes.
        scale: multiply the product by this before rounding (``op="avg"``: ``1 / R``).
    """
    t = plan.tiles
    M, K = x.shape
    N = w.shape[1]
    # fp32 follows torch.matmul's TF32 switch: off (torch's default) means fp32 accuracy, which
    # "tf32x3" (three TF32 products) gives on tensor cores; "ieee" would be an FMA loop that
    # also needed 3x the shared memory of the tile config (seen on H200: 288 KB, over the limit).
    # 16-bit inputs ignore the setting.
    fp32_exact = x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    precision = "tf32x3" if fp32_exact else "tf32"
    grid = (triton.cdiv(M, t.block_m) * triton.cdiv(N, t.block_n),)
    _chunked_matmul_kernel[grid](
        x,
        w,
        p_flat,
        counters,
        M,
        N,
        K,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        plan.chunk_rows,
        plan.chunk_cols,
        plan.n_col_bands,
        plan.world_size,
        1.0 if scale is None else scale,
        PERMUTE_ROWS=plan.permute_rows,
        HAS_SCALE=scale is not None,
        PRECISION=precision,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        GROUP_M=plan.group_m,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )
