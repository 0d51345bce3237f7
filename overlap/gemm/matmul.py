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
  one ``atomic_add(counter[chunk], 1)`` with release semantics at GPU scope. With ``Fuse`` (the
  copy-engine transport), this rank's own tiles first add the peers' partials, loaded through
  TMA where the rows are 16-byte aligned (pointer loads held 254 registers and took ~4 us
  more per call at 4096x8192x4096 on H200: BENCHMARKS step 26).

This file imports no ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.compiler import CompiledKernel
from triton.tools.tensor_descriptor import TensorDescriptor

from ..plan import Plan
from ..signal.counters import signed32

W_POINTER, W_NK, W_KN = 0, 1, 2  # how the kernel reads w: pointers, TMA on [N, K], on [K, N]


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
    if W_MODE == 1:
        b = w_ref.load([n0, k * BLOCK_K]).T
    elif W_MODE == 2:
        b = w_ref.load([k * BLOCK_K, n0])
    else:
        b = tl.load(w_ptrs + k0 * stride_wk, mask=offs_k[:, None] < K - k * BLOCK_K, other=0.0)
    return a, b


@triton.jit
def _after_cta_barrier(value, ASM: tl.constexpr):
    """``value``, returned after a barrier of all the program's threads. On the GPU the
    barrier is PTX ``bar.sync 0`` in inline assembly: ``tl.debug_barrier()`` in the tile loop
    stops Triton 3.6 from software-pipelining the flattened loop (seen in its TTGIR: one load
    buffer, 3.3x slower), the assembly does not. The interpreter runs ``debug_barrier``."""
    if ASM:
        value = tl.inline_asm_elementwise(
            "bar.sync 0;\n mov.b32 $0, $1;", "=r,r", [value], dtype=tl.int32, is_pure=False,
            pack=1,
        )  # fmt: skip
    else:
        tl.debug_barrier()
    return value


@triton.jit(do_not_specialize=["epoch"])
def _chunked_matmul_kernel(
    x_ref, w_ref, p_ptr, counter_ptr, trace_ptr, bad_rows_ptr, bad_cols_ptr,
    out_ptr, recv_ref, flags_ptr, epoch, rank, world, shift, bands_per_block, out_row0,
    M, N, K,
    stride_xm, stride_xk, stride_wk, stride_wn,
    NUM_PID_M, TILES_FULL, CHUNK_ROWS, RUN_ROWS, RUN_ROWS_LAST, N_BANDS, RANK_ROWS,
    CHUNK_COLS,
    N_COL_BANDS, N_TILES, scale,
    RUNS: tl.constexpr, X_DESC: tl.constexpr, W_MODE: tl.constexpr,
    HAS_SCALE: tl.constexpr, PRECISION: tl.constexpr, TRACE: tl.constexpr, FUSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr, ASM_BARRIER: tl.constexpr, P_DESC: tl.constexpr,
):  # fmt: skip
    # One program per tile (grid = tiles), or fewer programs that each take every
    # `num_programs`-th tile in launch order (persistent: grid = SMs). Tile ids are launch
    # order either way, so chunks finish in the same order.
    for pid in tl.range(tl.program_id(axis=0), N_TILES, tl.num_programs(axis=0), flatten=FLATTEN):
        if TRACE:  # tools/timeline.py: when each tile starts and ends, its SM and chunk
            tl.store(trace_ptr + 4 * pid, tl.extra.cuda.globaltimer())
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = min(NUM_PID_M - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m

        # Tile row pid_m -> row band a, run r (rank block) within it, tile t within the run.
        # TILES_FULL: tile rows of a full band; the last band has as many or fewer.
        launch_a = tl.minimum(pid_m // TILES_FULL, N_BANDS - 1)  # bands finish in launch order
        band_a = launch_a
        if FUSE > 0:  # blocked plan (equal bands): start at band `shift`, this rank's block last
            band_a = (launch_a + shift) % N_BANDS
        run_rows = tl.where(band_a == N_BANDS - 1, RUN_ROWS_LAST, RUN_ROWS)
        tiles_per_run = tl.cdiv(run_rows, BLOCK_M)
        local = pid_m - launch_a * TILES_FULL
        run = local // tiles_per_run
        t = local - run * tiles_per_run
        x_row0 = run * RANK_ROWS + band_a * RUN_ROWS + t * BLOCK_M
        valid_rows = tl.minimum(BLOCK_M, run_rows - t * BLOCK_M)
        band_b = (pid_n * BLOCK_N) // CHUNK_COLS
        row0 = band_a * CHUNK_ROWS  # first slot row of the band
        col0 = band_b * CHUNK_COLS
        band_rows = run_rows * RUNS
        band_cols = tl.minimum(CHUNK_COLS, N - col0)
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
        if W_MODE == 0:
            w_ptrs += offs_k[:, None] * stride_wk + offs_wn.to(tl.int64)[None, :] * stride_wn

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a, b = _load_ab(
                x_ref, w_ref, x_ptrs, w_ptrs, k, K, x_row0, n0, offs_k, stride_xk, stride_wk,
                X_DESC, W_MODE, BLOCK_K,
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
                        x_ref, w_ref, x_ptrs, w_ptrs, k, K, x_row0, n0, offs_k, stride_xk,
                        stride_wk, X_DESC, W_MODE, BLOCK_K,
                    )  # fmt: skip
                    ieee = tl.dot(a, b, ieee, input_precision="tf32")
                acc = tl.where((bad_r[:, None] + bad_c[None, :]) > 0, ieee, acc)

        if HAS_SCALE:
            acc = acc * scale
        offs_i = tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask = (offs_i[:, None] < valid_rows) & (offs_n[None, :] < N)
        own = False
        if FUSE > 0:
            own = band_a // bands_per_block == rank
        if own:
            # This rank's block (computed last): add the peers' partials of this tile, pushed
            # into `recv` ([world, M / world, N], slot s from rank s) by their copy engines, once
            # each peer's flag for this band holds this call's epoch; store into `out` directly.
            block_rows = M // world
            brow = tl.cast(x_row0 - rank * block_rows + offs_i, tl.int64)  # rows in the block
            if FUSE == 1:
                k = band_a % bands_per_block
                block_elems = tl.cast(block_rows, tl.int64) * N
                for s in range(0, world):
                    if s != rank:
                        flag = flags_ptr + s * bands_per_block + k
                        while tl.atomic_add(flag, 0, sem="acquire", scope="sys") - epoch < 0:
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
            offs = slot + rows[:, None] * band_cols + (offs_n - col0)[None, :]
            tl.store(p_ptr + offs, acc.to(p_ptr.dtype.element_ty), mask=mask)
        # Every thread's stores are issued before the one release atomic that counts the tile.
        chunk = _after_cta_barrier(launch_a * N_COL_BANDS + band_b, ASM_BARRIER)
        tl.atomic_add(counter_ptr + chunk, 1, sem="release", scope="gpu")
        if TRACE:
            tl.store(trace_ptr + 4 * pid + 1, tl.extra.cuda.globaltimer())
            tl.store(trace_ptr + 4 * pid + 2, tl.extra.cuda.smid().to(tl.int64))
            tl.store(trace_ptr + 4 * pid + 3, chunk.to(tl.int64))


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


@dataclass
class Fuse:
    """The copy-engine transport's epilogue (``overlap/comm/peer.py``), for a blocked plan:
    tiles of this rank's block add the peers' partials and go straight to ``out``.

    ``out``: the result (``[M / R, N]`` reduce-scatter, ``[M, N]`` otherwise); ``recv``:
    ``[R, M / R, N]`` this rank's receive slots; ``flags``: int32, ``flags[s * b + k]`` holds
    the epoch of the call whose band ``k`` rank ``s`` pushed last; ``add``: False for
    all-to-all (own tiles are stored, nothing is added)."""

    out: torch.Tensor
    recv: torch.Tensor
    flags: torch.Tensor
    epoch: int
    rank: int
    add: bool


def chunked_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    p_flat: torch.Tensor,
    counters: torch.Tensor,
    plan: Plan,
    scale: float | None = None,
    use_tma: bool = True,
    trace: torch.Tensor | None = None,
    fuse: Fuse | None = None,
    programs: int | None = None,
    flatten: bool | None = None,
) -> CompiledKernel | None:
    """Launch the GEMM of ``plan`` on the current stream.

    Args:
        x: ``[M, K]``, any strides.
        w: ``[K, N]``, any strides (``linear.weight.t()`` works without a copy).
        p_flat: ``[M * N]`` contiguous, the chunk-slot buffer the product is written to.
        counters: ``[>= plan.n_chunks]`` int32; ``counters[c]`` grows by ``tiles_per_chunk[c]``.
        plan: an overlap plan for these shapes.
        scale: multiply the product by this before rounding (``op="avg"``: ``1 / R``).
        use_tma: load through TMA descriptors where the strides allow (Hopper and newer).
        trace: ``[4 * tiles]`` int64 (GPU only): per tile (launch order) its start and end
            in ns of the GPU's global timer, its SM and its chunk (``tools/timeline.py``).
        fuse: for blocked plans (``plan.blocked``): launch the bands from the first band of
            rank ``fuse.rank + 1``'s block, so this rank's block comes last, and finish its
            tiles in ``fuse.out`` (``Fuse``). Chunk ``c`` is the ``c``-th band launched.
        programs: launch this many programs, each taking every ``programs``-th tile in launch
            order (persistent; the tile loop is flattened so the next tile's loads overlap
            this tile's epilogue); None: one program per tile, what the library launches.
            Persistent programs never give their SMs back, so NCCL's kernels wait for the
            GEMM (BENCHMARKS step 12); with ``fuse`` they cannot deadlock, since every
            program reaches its own-block tiles (the only ones that wait) after all its
            other tiles. Measured on H200 in BENCHMARKS step 23.
        flatten: flatten the tile loop (None: when persistent; tuning runs).

    Returns:
        Triton's compiled kernel (``n_regs``, ``n_spills``, ``asm``: for tools); None in
        Triton's interpreter.
    """
    t = plan.tiles
    M, K = x.shape
    N = w.shape[1]
    # fp32 follows torch.matmul's TF32 switch: off (torch's default) means fp32 accuracy, which
    # "tf32x3" (three TF32 products) gives on tensor cores; "ieee" would be an FMA loop that
    # also needed 3x the shared memory of the tile config (seen on H200: 288 KB, over the limit).
    # tf32x3 needs to know the rows of x and columns of w that hold an Inf or NaN (kernel).
    tf32x3 = x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    bad_rows = bad_cols = counters  # unused
    if tf32x3:
        bad_rows = (~torch.isfinite(x).all(dim=1)).to(torch.int8)
        bad_cols = (~torch.isfinite(w).all(dim=0)).to(torch.int8)
    x_ref, w_ref, w_mode = x, w, W_POINTER
    if use_tma and _tma_ok(x):
        x_ref = _descriptor(x, [t.block_m, t.block_k])
    if use_tma and _tma_ok(w.t()):
        w_ref, w_mode = _descriptor(w.t(), [t.block_n, t.block_k]), W_NK
    elif use_tma and _tma_ok(w):
        w_ref, w_mode = _descriptor(w, [t.block_k, t.block_n]), W_KN
    if programs is not None and programs < 1:
        raise ValueError(f"programs must be at least 1 (or None), got {programs}")
    n_tiles = plan.num_tile_rows * -(-N // t.block_n)  # triton.cdiv costs ~5 us on the host
    grid = (n_tiles if programs is None else min(programs, n_tiles),)
    R = plan.world_size
    if fuse is not None:
        if not plan.blocked:
            raise ValueError("fuse needs a blocked plan (make_plan(blocked=True))")
        b = plan.bands_per_block
        recv = fuse.recv.view(-1, N)  # [R * M / R, N]
        p_desc = use_tma and fuse.add and _tma_ok(recv)
        if p_desc:  # the peers' partials through TMA
            recv = _descriptor(recv, [t.block_m, t.block_n])
        f_args = (fuse.out, recv, fuse.flags, signed32(fuse.epoch),
                  fuse.rank, R, (fuse.rank + 1) % R * b, b,
                  fuse.rank * (M // R) if plan.collective == "reduce_scatter" else 0)  # fmt: skip
    else:
        f_args, p_desc = (counters, counters, counters, 0, 0, R, 0, 1, 0), False
    args = (
        x_ref, w_ref, p_flat, counters, trace if trace is not None else counters,
        bad_rows, bad_cols, *f_args,
        M, N, K,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1),
        plan.num_tile_rows, plan.band_tile_rows(0), plan.chunk_rows, plan.run_rows,
        plan.run_rows_last,
        plan.n_row_bands, plan.rank_block_rows, plan.chunk_cols, plan.n_col_bands, n_tiles,
        1.0 if scale is None else scale,
    )  # fmt: skip
    consts = dict(
        RUNS=plan.runs, X_DESC=x_ref is not x, W_MODE=w_mode,
        HAS_SCALE=scale is not None, PRECISION="tf32x3" if tf32x3 else "tf32",
        TRACE=trace is not None, FUSE=0 if fuse is None else 1 if fuse.add else 2,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=plan.group_m,
        FLATTEN=grid[0] < n_tiles if flatten is None else flatten,
        ASM_BARRIER=x.is_cuda, P_DESC=p_desc,
    )  # fmt: skip
    return _launch(grid[0], args, consts, t.num_warps, t.num_stages)


_EPOCH_ARG = _chunked_matmul_kernel.arg_names.index("epoch")
_CONSTS = tuple(_chunked_matmul_kernel.arg_names[_chunked_matmul_kernel.arg_names.index("RUNS") :])
_compiled: dict[tuple, CompiledKernel] = {}  # _launch_key -> the kernel Triton compiled for it


def _launch_key(args: tuple, consts: dict, num_warps: int, num_stages: int) -> tuple:
    """What Triton's specialization of these arguments can depend on, and more: every integer
    but the epoch by value (Triton specializes integers on == 1, divisibility by 16 and
    width), tensors by dtype and 16-byte alignment, descriptors by everything but their
    base's address (its alignment is kept), other arguments by type. Equal keys therefore
    mean the same compiled kernel; unequal keys at worst go through Triton's JIT once more."""
    key = []
    for a in args:
        t = type(a)
        if t is int:
            key.append(a)
        elif t is TensorDescriptor:
            b = a.base
            key.append((b.dtype, b.data_ptr() % 16 == 0, *a.shape, *a.strides, *a.block_shape,
                        a.padding))  # fmt: skip
        elif isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        else:
            key.append(t)
    key[_EPOCH_ARG] = None  # do_not_specialize; signed32 keeps it an int32
    return (*key, *consts.values(), num_warps, num_stages)


def _launch(grid: int, args: tuple, consts: dict, num_warps: int, num_stages: int):
    """Launch the kernel on ``grid`` programs on the current stream. The first launch of a
    specialization goes through Triton's JIT (which compiles, caches and launches); later
    ones call the compiled kernel's launcher directly, skipping the JIT's binding, cache
    lookup and launch-hook bookkeeping (BENCHMARKS step 29). Launch hooks (profilers) and the
    interpreter always take Triton's path."""
    hooks = knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls
    key = None if knobs.runtime.interpret or hooks else _launch_key(args, consts, num_warps,
                                                                    num_stages)  # fmt: skip
    k = _compiled.get(key) if key is not None else None
    if k is None:
        k = _chunked_matmul_kernel[(grid,)](*args, **consts, num_warps=num_warps,
                                            num_stages=num_stages)  # fmt: skip
        if key is not None:
            if len(_compiled) >= 1024:  # keys hold exact sizes: new M values keep adding some
                _compiled.clear()
            _compiled[key] = k
        return k
    d = triton.runtime.driver.active
    stream = d.get_current_stream(d.get_current_device())
    k.run(grid, 1, 1, stream, k.function, k.packed_metadata, None, None, None, *args,
          *(consts[n] for n in _CONSTS))  # fmt: skip
    return k
