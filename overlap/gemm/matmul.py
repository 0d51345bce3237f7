"""Tiled GEMM that stores each tile into its chunk's slot and then signals the chunk.

The main loop is a plain Triton tiled loop. What differs from a plain GEMM:

- Tile grid: program rows walk the slot rows of ``plan`` (``overlap.plan``). A row band holds
  ``G`` runs of consecutive rows of ``x`` (``G = R`` for reduce-scatter and all-to-all, one
  per rank's block; ``G = 1`` for all-reduce) and a tile never straddles two runs, so every
  tile reads ``BLOCK_M`` consecutive rows of ``x``: TMA can load it. Rows a tile reads past its
  run are never stored.
- Loads: TMA tensor descriptors where the strides allow (16-byte aligned rows), for ``w`` in
  either layout (``[K, N]`` rows or ``linear.weight.t()``); pointer loads otherwise. Measured
  on H200, bf16 4096x8192x4096, ``w = weight.t()``: pointer loads 0.50-0.52 ms, cuBLAS 0.345.
- Epilogue: the tile goes to its slot, then, after a barrier (every thread's stores issued),
  one ``atomic_add(counter[chunk], 1)`` with release semantics at GPU scope. With an
  ``Epilogue`` (a copy-engine transport, ``overlap/contract.py``), this rank's own tiles
  first add the peers' partials, loaded through TMA where the rows are 16-byte aligned
  (pointer loads held 254 registers and took ~4 us more per call at 4096x8192x4096 on H200).
- Launch: with NCCL per chunk one program per tile: persistent programs starved NCCL's kernels
  there (0.80-0.99x of sequential on 2x H200). On the copy engines' road (an ``Epilogue``; no
  SM does communication) one program per SM: the peers' tiles in a flattened loop (the next
  tile's loads overlap this one's store, which goes in two halves so that 4 load stages fit
  in shared memory), then this rank's own tiles, whose fused epilogue (flag waits, partials)
  stays out of the flattened loop (in it the fused kernel ran ~1.5x slower). One H200, bf16,
  ``weight.t()``, 56 model products >= 2e11 FLOP, against one program per 256x128 tile:
  with 128x256x64 tiles, 8 warps, 4 stages 0.980x the time (median of two runs' medians;
  faster on 48-51 of 56, worst 1.020-1.023x), with the plans' 256x128x64 tiles 0.999-1.000x
  (``gemm_ce_s13_persistent.json``, ``gemm_suite_s13_final_h200.json``).
- Arguments: the kernel's signature is the one list of its parameters. A launch names each
  of them (``chunked_matmul``'s dict; what the plan alone sets is made once per plan,
  ``_fix``), ``gemm/launch.py``'s ``Launcher`` puts them in the signature's order and raises
  on a missing or unknown name, and ``_tile`` and ``_load_ab`` take theirs by keyword: no
  copy of the list can be reordered silently.
- Host cost: after the first launch of a specialization the launcher is called directly
  (``_launch``, ``gemm/launch.py``): 38-45 us per launch instead of 57-72 through Triton's JIT
  (H200 host).

This file imports no ``torch.distributed``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.compiler import CompiledKernel
from triton.tools.tensor_descriptor import TensorDescriptor

from ..contract import Epilogue, first_band
from ..plan import Plan
from .launch import Launcher

# How the kernel reads w (pointer loads, TMA on w.t() [N, K], TMA on w [K, N]), and what the
# epilogue does (every tile to its slot; own tiles add the peers' partials, or are stored as
# they are, into `out`). Kernel constants: the host passes their `.value`.
W_POINTER, W_NK, W_KN = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
EPI_SLOTS, EPI_ADD, EPI_STORE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _load_ab(
    x_ref, w_ref, x_ptrs, w_ptrs, k, K, x_row0, n0, offs_k, stride_xk, stride_wk,
    X_DESC: tl.constexpr, W_MODE: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The ``k``-th ``[BLOCK_M, BLOCK_K]`` block of x and ``[BLOCK_K, BLOCK_N]`` block of w."""
    k0 = tl.cast(k, tl.int64) * BLOCK_K  # pointer offsets past 2**31 elements stay exact
    if X_DESC:
        a = x_ref.load([x_row0, k * BLOCK_K])  # TMA zero-fills past the edges
    else:
        a = tl.load(x_ptrs + k0 * stride_xk, mask=offs_k[None, :] < K - k * BLOCK_K, other=0.0)
    if W_MODE == W_NK:
        b = w_ref.load([n0, k * BLOCK_K]).T
    elif W_MODE == W_KN:
        b = w_ref.load([k * BLOCK_K, n0])
    else:
        b = tl.load(w_ptrs + k0 * stride_wk, mask=offs_k[:, None] < K - k * BLOCK_K, other=0.0)
    return a, b


@triton.jit
def _tile(
    pid, x_ref, w_ref, slots_ptr, counter_ptr, trace_ptr, bad_rows_ptr, bad_cols_ptr,
    out_ptr, recv_ref, flags_ptr, rank, world, first_band, bands_per_block, out_row0,
    M, N, K, stride_xm, stride_xk, stride_wk, stride_wn,
    num_pid_m, tiles_per_band, run_rows_full, run_rows_last, n_bands, chunk_cols, scale,
    RUNS: tl.constexpr, X_DESC: tl.constexpr, W_MODE: tl.constexpr, P_DESC: tl.constexpr,
    ROTATE: tl.constexpr, EPILOGUE: tl.constexpr, HAS_SCALE: tl.constexpr,
    PRECISION: tl.constexpr, TRACE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HALVES: tl.constexpr, ASM_BARRIER: tl.constexpr,
):  # fmt: skip
    """Tile ``pid`` (launch order): its product to its slot, or for this rank's own block
    with an epilogue (``EPILOGUE`` not ``EPI_SLOTS``) into ``out``; then its chunk's count.
    ``ROTATE``: the blocked plan's launch order (own block last)."""
    if TRACE:  # tools/timeline.py: when each tile starts and ends, its SM and chunk
        tl.store(trace_ptr + 4 * pid, tl.extra.cuda.globaltimer())
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    # Tile row pid_m -> row band a, run r (rank block) within it, tile t within the run.
    # tiles_per_band: tile rows of a full band; the last band has as many or fewer.
    launch_a = tl.minimum(pid_m // tiles_per_band, n_bands - 1)  # bands finish in launch order
    band_a = launch_a
    if ROTATE:  # blocked plan (overlap/contract.py): rotated, own block last
        band_a = (launch_a + first_band) % n_bands
    run_rows = tl.where(band_a == n_bands - 1, run_rows_last, run_rows_full)
    tiles_per_run = tl.cdiv(run_rows, BLOCK_M)
    local = pid_m - launch_a * tiles_per_band
    run = local // tiles_per_run
    t = local - run * tiles_per_run
    x_row0 = run * (M // RUNS) + band_a * run_rows_full + t * BLOCK_M
    valid_rows = tl.minimum(BLOCK_M, run_rows - t * BLOCK_M)
    band_b = (pid_n * BLOCK_N) // chunk_cols
    row0 = band_a * RUNS * run_rows_full  # first slot row of the band
    col0 = band_b * chunk_cols
    band_rows = run_rows * RUNS
    band_cols = tl.minimum(chunk_cols, N - col0)
    slot_row0 = row0 + run * run_rows + t * BLOCK_M

    n0 = pid_n * BLOCK_N
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past M read row M - 1 (never stored): no M mask inside the loop.
    offs_xm = tl.minimum(x_row0 + tl.arange(0, BLOCK_M), M - 1)
    x_ptrs = x_ref  # unused with a descriptor
    if not X_DESC:
        x_ptrs += offs_xm.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ref
    offs_wn = (n0 + tl.arange(0, BLOCK_N)) % N  # % keeps contiguity info (tl.where loses it)
    if W_MODE == W_POINTER:
        w_ptrs += offs_k[:, None] * stride_wk + offs_wn.to(tl.int64)[None, :] * stride_wn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a, b = _load_ab(
            x_ref=x_ref, w_ref=w_ref, x_ptrs=x_ptrs, w_ptrs=w_ptrs, k=k, K=K, x_row0=x_row0,
            n0=n0, offs_k=offs_k, stride_xk=stride_xk, stride_wk=stride_wk, X_DESC=X_DESC,
            W_MODE=W_MODE, BLOCK_K=BLOCK_K,
        )  # fmt: skip
        acc = tl.dot(a, b, acc, input_precision=PRECISION)  # 16-bit inputs ignore it

    if PRECISION == "tf32x3":
        # Three TF32 products give fp32 accuracy but turn every Inf into NaN (inf - inf in
        # the split). A product element is Inf or NaN iff its x row or its w column holds
        # one; tiles that have such rows or columns redo them with one TF32 product, which
        # keeps IEEE's Inf and NaN (the finite parts there do not matter).
        bad_r = tl.load(bad_rows_ptr + offs_xm)
        bad_c = tl.load(bad_cols_ptr + offs_wn)
        if tl.max(bad_r, axis=0) + tl.max(bad_c, axis=0) > 0:
            ieee = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, tl.cdiv(K, BLOCK_K)):
                a, b = _load_ab(
                    x_ref=x_ref, w_ref=w_ref, x_ptrs=x_ptrs, w_ptrs=w_ptrs, k=k, K=K,
                    x_row0=x_row0, n0=n0, offs_k=offs_k, stride_xk=stride_xk,
                    stride_wk=stride_wk, X_DESC=X_DESC, W_MODE=W_MODE, BLOCK_K=BLOCK_K,
                )  # fmt: skip
                ieee = tl.dot(a, b, ieee, input_precision="tf32")
            acc = tl.where((bad_r[:, None] + bad_c[None, :]) > 0, ieee, acc)

    if HAS_SCALE:
        acc = acc * scale
    offs_i = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask = (offs_i[:, None] < valid_rows) & (offs_n[None, :] < N)
    own = False
    if EPILOGUE != EPI_SLOTS:
        own = band_a // bands_per_block == rank
    if own:
        # This rank's block (computed last): add the peers' partials of this tile, pushed
        # into `recv` ([world, M / world, N], slot s from rank s) by their copy engines, once
        # each peer's flag for this band is set (1; the transport zeroes it before the next
        # call); store into `out` directly.
        block_rows = M // world
        brow = tl.cast(x_row0 - rank * block_rows + offs_i, tl.int64)  # rows in the block
        if EPILOGUE == EPI_ADD:
            k = band_a % bands_per_block
            block_elems = tl.cast(block_rows, tl.int64) * N
            for s in range(0, world):
                if s != rank:
                    flag = flags_ptr + s * bands_per_block + k  # FlagLayout.kernel_index
                    while tl.atomic_add(flag, 0, sem="acquire", scope="sys") == 0:
                        pass
                    if P_DESC:  # TMA: rows past the block are read, never stored
                        part = recv_ref.load([s * block_rows + x_row0 - rank * block_rows, n0])
                    else:
                        ptrs = recv_ref + s * block_elems + brow[:, None] * N + offs_n[None, :]
                        part = tl.load(ptrs, mask=mask, other=0.0)
                    acc += part.to(tl.float32)
        orow = (x_row0 - out_row0 + offs_i).to(tl.int64)
        out_offs = orow[:, None] * N + offs_n[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Slot of chunk (a, b): band_rows x band_cols row-major at row0 * N + col0 * band_rows.
        slot = row0.to(tl.int64) * N + col0 * band_rows
        rows = (slot_row0 - row0 + offs_i).to(tl.int64)
        if HALVES:  # stored in two halves: half the shared memory that stages the store
            h0, h1 = tl.split(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)).permute(0, 2, 1))
            offs_h = n0 + tl.arange(0, BLOCK_N // 2)
            mask_h = (offs_i[:, None] < valid_rows) & (offs_h[None, :] < N)
            offs = slot + rows[:, None] * band_cols + (offs_h - col0)[None, :]
            tl.store(slots_ptr + offs, h0.to(slots_ptr.dtype.element_ty), mask=mask_h)
            offs_h += BLOCK_N // 2
            mask_h = (offs_i[:, None] < valid_rows) & (offs_h[None, :] < N)
            offs = slot + rows[:, None] * band_cols + (offs_h - col0)[None, :]
            tl.store(slots_ptr + offs, h1.to(slots_ptr.dtype.element_ty), mask=mask_h)
        else:
            offs = slot + rows[:, None] * band_cols + (offs_n - col0)[None, :]
            tl.store(slots_ptr + offs, acc.to(slots_ptr.dtype.element_ty), mask=mask)
    # Every thread's stores are issued before the one release atomic that counts the tile.
    chunk = launch_a * tl.cdiv(N, chunk_cols) + band_b
    if ASM_BARRIER:
        # PTX bar.sync: tl.debug_barrier() inside a flattened tile loop stops Triton 3.6
        # from pipelining it (one load buffer, 3.3x slower; gemm_s6_barrier.json).
        chunk = tl.inline_asm_elementwise(
            "bar.sync 0;\n mov.b32 $0, $1;", "=r,r", [chunk], dtype=tl.int32, is_pure=False,
            pack=1,
        )  # fmt: skip
    else:
        tl.debug_barrier()
    tl.atomic_add(counter_ptr + chunk, 1, sem="release", scope="gpu")
    if TRACE:
        tl.store(trace_ptr + 4 * pid + 1, tl.extra.cuda.globaltimer())
        tl.store(trace_ptr + 4 * pid + 2, tl.extra.cuda.smid().to(tl.int64))
        tl.store(trace_ptr + 4 * pid + 3, chunk.to(tl.int64))


@triton.jit
def _chunked_matmul_kernel(
    x_ref, w_ref, slots_ptr, counter_ptr, trace_ptr, bad_rows_ptr, bad_cols_ptr,
    out_ptr, recv_ref, flags_ptr, rank, world, first_band, bands_per_block, out_row0,
    M, N, K, stride_xm, stride_xk, stride_wk, stride_wn,
    num_pid_m, tiles_per_band, run_rows_full, run_rows_last, n_bands, chunk_cols, scale,
    lo, own_start, hi,
    RUNS: tl.constexpr, X_DESC: tl.constexpr, W_MODE: tl.constexpr, P_DESC: tl.constexpr,
    EPILOGUE: tl.constexpr, HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr,
    TRACE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr, ASM_BARRIER: tl.constexpr,
):  # fmt: skip
    # This signature is the one list of the kernel's parameters: the host fills them by name
    # (`_launch`), and `_tile` takes them by name. Tile ids are the launch order, so chunks
    # finish in order; a launch takes ids [lo, hi). One program per tile, or (PERSISTENT, the
    # copy engines' road: no SM is needed by the communication) one program per SM taking
    # every num_programs-th tile: the peers' tiles (ids below own_start) in a flattened loop,
    # whose next tile's loads overlap this one's epilogue, then this rank's own block, whose
    # fused epilogue (flag waits, partials) stays out of the flattened loop.
    if PERSISTENT:
        p0, step = tl.program_id(axis=0), tl.num_programs(axis=0)
        for pid in tl.range(lo + p0, own_start, step, flatten=True):
            _tile(
                pid=pid, x_ref=x_ref, w_ref=w_ref, slots_ptr=slots_ptr, counter_ptr=counter_ptr,
                trace_ptr=trace_ptr, bad_rows_ptr=bad_rows_ptr, bad_cols_ptr=bad_cols_ptr,
                out_ptr=out_ptr, recv_ref=recv_ref, flags_ptr=flags_ptr, rank=rank, world=world,
                first_band=first_band, bands_per_block=bands_per_block, out_row0=out_row0,
                M=M, N=N, K=K, stride_xm=stride_xm, stride_xk=stride_xk, stride_wk=stride_wk,
                stride_wn=stride_wn, num_pid_m=num_pid_m, tiles_per_band=tiles_per_band,
                run_rows_full=run_rows_full, run_rows_last=run_rows_last, n_bands=n_bands,
                chunk_cols=chunk_cols, scale=scale, RUNS=RUNS, X_DESC=X_DESC, W_MODE=W_MODE,
                P_DESC=P_DESC, ROTATE=True, EPILOGUE=EPI_SLOTS, HAS_SCALE=HAS_SCALE,
                PRECISION=PRECISION, TRACE=TRACE, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, HALVES=True, ASM_BARRIER=ASM_BARRIER,
            )  # fmt: skip
        # the same round robin goes on past own_start
        first = lo + p0 + tl.cdiv(tl.maximum(own_start - lo - p0, 0), step) * step
        for pid in tl.range(first, hi, step):
            _tile(
                pid=pid, x_ref=x_ref, w_ref=w_ref, slots_ptr=slots_ptr, counter_ptr=counter_ptr,
                trace_ptr=trace_ptr, bad_rows_ptr=bad_rows_ptr, bad_cols_ptr=bad_cols_ptr,
                out_ptr=out_ptr, recv_ref=recv_ref, flags_ptr=flags_ptr, rank=rank, world=world,
                first_band=first_band, bands_per_block=bands_per_block, out_row0=out_row0,
                M=M, N=N, K=K, stride_xm=stride_xm, stride_xk=stride_xk, stride_wk=stride_wk,
                stride_wn=stride_wn, num_pid_m=num_pid_m, tiles_per_band=tiles_per_band,
                run_rows_full=run_rows_full, run_rows_last=run_rows_last, n_bands=n_bands,
                chunk_cols=chunk_cols, scale=scale, RUNS=RUNS, X_DESC=X_DESC, W_MODE=W_MODE,
                P_DESC=P_DESC, ROTATE=True, EPILOGUE=EPILOGUE, HAS_SCALE=HAS_SCALE,
                PRECISION=PRECISION, TRACE=TRACE, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, HALVES=True, ASM_BARRIER=ASM_BARRIER,
            )  # fmt: skip
    else:
        _tile(
            pid=lo + tl.program_id(axis=0), x_ref=x_ref, w_ref=w_ref, slots_ptr=slots_ptr,
            counter_ptr=counter_ptr, trace_ptr=trace_ptr, bad_rows_ptr=bad_rows_ptr,
            bad_cols_ptr=bad_cols_ptr, out_ptr=out_ptr, recv_ref=recv_ref, flags_ptr=flags_ptr,
            rank=rank, world=world, first_band=first_band, bands_per_block=bands_per_block,
            out_row0=out_row0, M=M, N=N, K=K, stride_xm=stride_xm, stride_xk=stride_xk,
            stride_wk=stride_wk, stride_wn=stride_wn, num_pid_m=num_pid_m,
            tiles_per_band=tiles_per_band, run_rows_full=run_rows_full,
            run_rows_last=run_rows_last, n_bands=n_bands, chunk_cols=chunk_cols, scale=scale,
            RUNS=RUNS, X_DESC=X_DESC, W_MODE=W_MODE, P_DESC=P_DESC,
            ROTATE=EPILOGUE != EPI_SLOTS, EPILOGUE=EPILOGUE, HAS_SCALE=HAS_SCALE,
            PRECISION=PRECISION, TRACE=TRACE, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            GROUP_M=GROUP_M, HALVES=False, ASM_BARRIER=ASM_BARRIER,
        )  # fmt: skip


def _tma_ok(t: torch.Tensor) -> bool:
    """A 2-D tensor whose last dim is contiguous and whose rows are 16-byte aligned."""
    es = t.element_size()
    return (
        t.stride(1) == 1
        and t.data_ptr() % 16 == 0
        and (t.stride(0) * es) % 16 == 0
        and (t.shape[1] * es) >= 16
    )


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """``TensorDescriptor.from_tensor(t, block)`` without its checks, which ``_tma_ok`` has
    made (they cost ~5 us of host time per descriptor)."""
    d = object.__new__(TensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape, d.padding = t, t.shape, t.stride(), block, "zero"
    return d


def chunked_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    slots: torch.Tensor,
    counters: torch.Tensor,
    plan: Plan,
    scale: float | None = None,
    *,
    epilogue: Epilogue | None = None,
    trace: torch.Tensor | None = None,
    part: str = "all",
) -> CompiledKernel | None:
    """Launch the GEMM of ``plan`` on the current stream, one program per tile.

    Args:
        x: ``[M, K]``, any strides (TMA loads where rows are 16-byte aligned).
        w: ``[K, N]``, any strides (``linear.weight.t()`` works without a copy).
        slots: ``[M * N]`` contiguous, the chunk-slot buffer the product is written to.
        counters: ``[>= plan.n_chunks]`` int32; ``counters[c]`` grows by ``tiles_per_chunk[c]``.
        plan: an overlap plan for these shapes.
        scale: multiply the product by this before rounding (``op="avg"``: ``1 / R``).
        epilogue: for blocked plans (``plan.blocked``), what a copy-engine transport asks
            (``overlap.contract``): the bands launch from ``contract.first_band``, so this
            rank's block comes last, and its tiles finish in ``epilogue.out``. Chunk ``c`` is
            the ``c``-th band launched.
        trace: ``[4 * tiles]`` int64 (GPU only): per tile (launch order) its start and end
            in ns of the GPU's global timer, its SM and its chunk (``tools/timeline.py``).
        part: "all" the tiles, or (with an epilogue) the "peers'" blocks' or this rank's
            "own" block's alone: launched in that order with other work between, the own
            tiles' waits for the peers' partials start after it (``engine.produce``).

    Returns:
        Triton's compiled kernel (``n_regs``, ``n_spills``, ``asm``: for tools); None in
        Triton's interpreter.
    """
    t = plan.tiles
    M, K = x.shape
    N = w.shape[1]
    fixed = _fixed.get(id(plan))
    if fixed is None or fixed[0] is not plan:
        fixed = _fix(plan)
    # fp32 follows torch.matmul's TF32 switch: off (torch's default) means fp32 accuracy, which
    # "tf32x3" (three TF32 products) gives on tensor cores; "ieee" would be an FMA loop that
    # also needed 3x the shared memory of the tile config (seen on H200: 288 KB, over the limit).
    # tf32x3 needs to know the rows of x and columns of w that hold an Inf or NaN (kernel).
    tf32x3 = x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    bad_rows = bad_cols = counters  # unused
    if tf32x3:
        bad_rows = (~torch.isfinite(x).all(dim=1)).to(torch.int8)
        bad_cols = (~torch.isfinite(w).all(dim=0)).to(torch.int8)
    x_ref, w_ref, w_mode = x, w, W_POINTER.value
    if _tma_ok(x):
        x_ref = _descriptor(x, [t.block_m, t.block_k])
    wt = w.t()
    if _tma_ok(wt):
        w_ref, w_mode = _descriptor(wt, [t.block_n, t.block_k]), W_NK.value
    elif _tma_ok(w):
        w_ref, w_mode = _descriptor(w, [t.block_k, t.block_n]), W_KN.value
    n_tiles = plan.num_tile_rows * -(-N // t.block_n)  # triton.cdiv costs ~5 us on the host
    R = plan.world_size
    # Persistent programs on the copy engines' road only (module docstring). The tf32x3
    # tiles' second K loop stays out of the flattened loop.
    persistent = epilogue is not None and not tf32x3
    own_start = n_tiles - n_tiles // R if epilogue is not None else n_tiles  # (own block last)
    ranges = {"all": (0, n_tiles), "peers": (0, own_start), "own": (own_start, n_tiles)}
    if part not in ranges or (part != "all" and epilogue is None):
        raise ValueError(f"part={part!r}: 'all', or with an epilogue 'peers' or 'own'")
    lo, hi = ranges[part]
    # without an epilogue its arguments are unused (`counters` stands for its tensors)
    out, recv, flags, rank, first, b, out_row0 = counters, counters, counters, 0, 0, 1, 0
    mode, p_desc = EPI_SLOTS.value, False
    if epilogue is not None:
        if not plan.blocked:
            raise ValueError("an epilogue needs a blocked plan (make_plan(blocked=True))")
        b = plan.bands_per_block
        mode = EPI_ADD.value if plan.spec.reduces else EPI_STORE.value
        out, flags, rank = epilogue.out, epilogue.flags, epilogue.rank
        recv = epilogue.recv.view(-1, N)  # [R * M / R, N]
        p_desc = mode == EPI_ADD.value and _tma_ok(recv)
        if p_desc:  # the peers' partials through TMA
            recv = _descriptor(recv, [t.block_m, t.block_n])
        out_row0 = rank * (M // R) if plan.spec.scatters else 0
        first = first_band(rank, R, b)
    a = {
        **fixed[1],  # what the plan alone sets (`_fix`)
        "x_ref": x_ref, "w_ref": w_ref, "slots_ptr": slots, "counter_ptr": counters,
        "trace_ptr": counters if trace is None else trace, "bad_rows_ptr": bad_rows,
        "bad_cols_ptr": bad_cols, "out_ptr": out, "recv_ref": recv, "flags_ptr": flags,
        "rank": rank, "first_band": first, "bands_per_block": b, "out_row0": out_row0,
        "M": M, "N": N, "K": K, "stride_xm": x.stride(0), "stride_xk": x.stride(1),
        "stride_wk": w.stride(0), "stride_wn": w.stride(1),
        "scale": 1.0 if scale is None else scale, "lo": lo, "own_start": own_start, "hi": hi,
        "X_DESC": x_ref is not x, "W_MODE": w_mode, "P_DESC": p_desc, "EPILOGUE": mode,
        "HAS_SCALE": scale is not None, "PRECISION": "tf32x3" if tf32x3 else "tf32",
        "TRACE": trace is not None, "PERSISTENT": persistent,
        "ASM_BARRIER": persistent and not knobs.runtime.interpret,
    }  # fmt: skip
    if not persistent:
        return _launch(hi - lo, a, t.num_warps, t.num_stages)
    # The flattened loop keeps a buffer for the store beside the load stages: half a tile
    # (HALVES), so 256x128x64 or 128x256x64 bf16 with 4 stages takes 224 KB of the 227.
    es = x.element_size()
    stages = min(t.num_stages, (_SMEM - t.block_m * t.block_n * es // 2)
                 // ((t.block_m + t.block_n) * t.block_k * es))  # fmt: skip
    return _launch(min(hi - lo, _programs(x.device)), a, t.num_warps, stages)


_SMEM = 227 * 1024  # shared memory per program on sm_90 (Triton's limit there)


_sms: dict[int, int] = {}  # device index -> multiprocessors


def _programs(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM; 3 in the interpreter (CPU tests then see
    programs that take several tiles, and a round robin that crosses ``own_start``)."""
    if knobs.runtime.interpret:
        return 3
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _sms:
        _sms[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _sms[i]


# The kernel's signature is the one list of its parameters: every launch names each of them
# (`chunked_matmul`'s dict; ``launch.Launcher``).
_launch = Launcher(_chunked_matmul_kernel)
_fixed: dict[int, tuple[Plan, dict]] = {}  # id(plan) -> (plan, what it alone sets)


def _fix(plan: Plan) -> tuple[Plan, dict]:
    """The kernel's arguments that ``plan`` alone sets, made once per plan (calls reuse
    plans: ``make_plan`` is cached), not at every launch."""
    t = plan.tiles
    fixed = {
        "world": plan.world_size, "num_pid_m": plan.num_tile_rows,
        "tiles_per_band": plan.band_tile_rows(0), "run_rows_full": plan.run_rows,
        "run_rows_last": plan.run_rows_last, "n_bands": plan.n_row_bands,
        "chunk_cols": plan.chunk_cols, "RUNS": plan.runs, "BLOCK_M": t.block_m,
        "BLOCK_N": t.block_n, "BLOCK_K": t.block_k, "GROUP_M": plan.group_m,
    }  # fmt: skip
    if len(_fixed) >= 1024:  # (the plans keep their ids alive: bounded like the launcher's)
        _fixed.clear()
    _fixed[id(plan)] = (plan, fixed)
    return _fixed[id(plan)]
