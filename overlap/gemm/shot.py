"""The latency all-reduce kernel: one-shot and two-shot over buffers every rank addresses.

Each rank's partial ``[n]`` is in its own buffer (the matmul stored it there: ``out=``); the
kernel gets the addresses of every rank's buffer and flags (``buffers``, ``flags``: int64
tensors of ``world`` device addresses, as ``comm/shot.py`` makes them).

- one-shot: every rank reads the ``world`` partials of every element and stores their sum
  (in rank order, in fp32: the same bits on every rank) into ``out``. Reads ``(R - 1) n`` per
  rank over the links; the fastest for small ``n``.
- two-shot: rank ``r`` sums shard ``r`` of the elements (the ``R`` partials, in rank order)
  and stores the sum into every rank's buffer, then copies the whole sum from its own buffer
  into ``out``. Reads and writes ``2 (R - 1) n / R`` per rank; faster for larger ``n``.

Synchronization is per program, with epochs, never resets: program ``p`` of call ``e`` (its
own count, ``epochs[p]``, kept in device memory so that a CUDA graph's replays count on) sets
flag ``[p][rank]`` of every rank to ``2e - 1`` once this rank's partial is in its buffer
(barrier in) and to ``2e`` once it is done with the peers' buffers (barrier out), and waits
until each rank's flag ``[p][q]`` here reaches the same value. Every rank runs the same grid
for the same ``n`` (``programs``), so program ``p``'s flags see the same calls everywhere.
After barrier out no peer reads or writes this rank's buffer any more: the next call's matmul
may overwrite it (it runs after this kernel on the stream). A wait also ends when
``abort[0]`` is not 0 (the transport's ``abort``: a host stream write, no SM needed): the
result is then garbage and the caller raises. Flags are int32: 2**30 calls per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..contract import SHOT_PROGRAMS as MAX_PROGRAMS  # flags per rank: MAX_PROGRAMS * world

BLOCK = 1024  # elements per program and step: 4 warps of 16-byte loads for 16-bit types


@triton.jit
def _signal(flags, slot, value, WORLD: tl.constexpr):
    """Flag ``slot`` of every rank set to ``value`` (release: this program's stores first)."""
    for q in tl.static_range(WORLD):
        peer = tl.load(flags + q).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(peer + slot, value, sem="release", scope="sys")


@triton.jit
def _wait(own, first, value, abort, WORLD: tl.constexpr):
    """Until flags ``first .. first + WORLD`` here reach ``value`` (acquire), or an abort."""
    for q in tl.static_range(WORLD):
        while (tl.atomic_add(own + first + q, 0, sem="acquire", scope="sys") < value) & (
            tl.load(abort, volatile=True) == 0
        ):
            pass


@triton.jit
def _shot_kernel(
    out_ptr, buffers, flags, epochs, abort, n, rank,
    WORLD: tl.constexpr, TWO_SHOT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    epoch = tl.load(epochs + pid) + 1
    own = tl.load(flags + rank).to(tl.pointer_type(tl.int32))
    dtype = out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    _signal(flags, pid * WORLD + rank, 2 * epoch - 1, WORLD)  # barrier in
    _wait(own, pid * WORLD, 2 * epoch - 1, abort, WORLD)
    tl.debug_barrier()
    if TWO_SHOT:
        shard = tl.cdiv(tl.cdiv(n, WORLD), BLOCK) * BLOCK
        lo = rank * shard
        hi = tl.minimum(lo + shard, n)
        for start in range(lo + pid * BLOCK, hi, programs * BLOCK):
            idx = start + offs
            mask = idx < hi
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            for q in tl.static_range(WORLD):
                src = tl.load(buffers + q).to(tl.pointer_type(dtype))
                acc += tl.load(src + idx, mask=mask).to(tl.float32)
            total = acc.to(dtype)
            for q in tl.static_range(WORLD):
                dst = tl.load(buffers + q).to(tl.pointer_type(dtype))
                tl.store(dst + idx, total, mask=mask)
        tl.debug_barrier()
        _signal(flags, pid * WORLD + rank, 2 * epoch, WORLD)  # barrier out
        _wait(own, pid * WORLD, 2 * epoch, abort, WORLD)
        tl.debug_barrier()
        mine = tl.load(buffers + rank).to(tl.pointer_type(dtype))
        for s in range(0, WORLD):
            lo = s * shard
            hi = tl.minimum(lo + shard, n)
            for start in range(lo + pid * BLOCK, hi, programs * BLOCK):
                idx = start + offs
                mask = idx < hi
                tl.store(out_ptr + idx, tl.load(mine + idx, mask=mask), mask=mask)
    else:
        for start in range(pid * BLOCK, n, programs * BLOCK):
            idx = start + offs
            mask = idx < n
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            for q in tl.static_range(WORLD):
                src = tl.load(buffers + q).to(tl.pointer_type(dtype))
                acc += tl.load(src + idx, mask=mask).to(tl.float32)
            tl.store(out_ptr + idx, acc.to(dtype), mask=mask)
        tl.debug_barrier()
        _signal(flags, pid * WORLD + rank, 2 * epoch, WORLD)  # barrier out
        _wait(own, pid * WORLD, 2 * epoch, abort, WORLD)
    tl.store(epochs + pid, epoch)


def programs(n: int, world: int, two_shot: bool) -> int:
    """Programs of a call of ``n`` elements: the same on every rank for the same ``n``."""
    per_rank = -(-n // world) if two_shot else n
    return max(1, min(MAX_PROGRAMS, -(-per_rank // BLOCK)))


def shot_all_reduce(
    out: torch.Tensor,
    buffers: torch.Tensor,
    flags: torch.Tensor,
    epochs: torch.Tensor,
    abort: torch.Tensor,
    n: int,
    rank: int,
    world: int,
    two_shot: bool,
) -> None:
    """On the current stream: ``out[:n]`` = the sum over ranks of ``buffer_q[:n]``.

    Args:
        out: contiguous, at least ``n`` elements, of the buffers' dtype (fp16, bf16, fp32).
        buffers, flags: int64 ``[world]``, the device addresses of every rank's buffer
            (``n`` elements) and flags (``MAX_PROGRAMS * world`` int32, zero before the first
            call of every rank).
        epochs: int32 ``[MAX_PROGRAMS]``, this rank's call count per program (zero at first).
        abort: int32 ``[1]``; not 0 ends every wait.
        n, rank, world: elements, this rank, ranks.
        two_shot: reduce-scatter + all-gather instead of every rank reading everything.
    """
    grid = (programs(n, world, two_shot),)
    _shot_kernel[grid](out, buffers, flags, epochs, abort, n, rank, WORLD=world,
                       TWO_SHOT=two_shot, BLOCK=BLOCK, num_warps=4)  # fmt: skip
