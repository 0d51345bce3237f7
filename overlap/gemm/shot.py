"""The latency all-reduce through host memory: a one-shot all-reduce for ranks whose GPUs
cannot map each other's memory (no P2P: PCIe consumer cards, ``NCCL_P2P_DISABLE=1``), over
the pinned host buffer every rank of the group maps (``comm/shot.py``'s ``HostShotTransport``
makes it as ``comm/host.py`` makes the copy engines').

Rank ``r``'s region of that buffer holds its flags (one int32 per program), its abort word
and two slots of up to ``n`` elements. Every call runs ``PROGRAMS`` programs on every rank,
whatever ``n``; program ``p`` of a call, ``e`` its count of calls (``epochs[p] + 1``, kept in
device memory so that a CUDA graph's replays count on; equal for every program, since every
program takes part in every call):

1. stores its share of this rank's partial (device memory) into slot ``e % 2`` of this rank's
   region, through PCIe;
2. publishes it: every thread's stores fenced at system scope, then flag ``p`` of this rank's
   region set to ``e`` (a release store);
3. waits until flag ``p`` of every peer's region reaches ``e`` (acquire loads through PCIe),
   or until this rank's abort word is not 0 (the transport's ``abort``, a plain host store:
   the result is then garbage and the caller raises);
4. sums the ``R`` partials of its share in rank order, in fp32 (its own from device memory,
   the peers' from their slots ``e % 2``, read past the caches): the same bits on every rank,
   stored into ``out``.

One barrier per call, because the slots alternate: rank ``r`` writes slot ``e % 2`` again at
call ``e + 2``, which its stream starts only after its call ``e + 1`` saw every peer's flags
reach ``e + 1``; a peer sets those in its call ``e + 1``, which its stream started after its
call ``e`` ended, the last reads of that slot. Flags are int32: 2**31 calls.

Under Triton's interpreter (the CPU tests) the release / acquire are atomics; on GPUs they
are ``st.release.sys`` / ``ld.acquire.sys`` (no PCIe atomics needed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements per program and step: 4 warps of 16-byte accesses for 16-bit types
PROGRAMS = 32  # per call, whatever its size (the flags' parity needs every program each call)
FLAGS = 4096  # bytes at the start of a rank's region: the programs' flags, then the abort word
ABORT = 2048  # the abort word's offset in the region


@triton.jit
def _publish(flag, value, ASM: tl.constexpr):
    """This program's stores made visible to the system, then ``flag`` set to ``value``."""
    if ASM:
        tl.inline_asm_elementwise(
            "fence.acq_rel.sys; mov.u32 $0, 0;", "=r,r", [value], dtype=tl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip
        tl.debug_barrier()
        tl.inline_asm_elementwise(
            "st.global.release.sys.b32 [$1], $2; mov.u32 $0, 0;", "=r,l,r", [flag, value],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    else:
        tl.debug_barrier()
        tl.atomic_xchg(flag, value, sem="release", scope="sys")


@triton.jit
def _seen(flag, ASM: tl.constexpr):
    """``flag``'s value (acquire, system scope)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "ld.global.acquire.sys.b32 $0, [$1];", "=r,l", [flag], dtype=tl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip
    else:
        return tl.atomic_add(flag, 0, sem="acquire", scope="sys")


@triton.jit
def _host_shot_kernel(
    part_ptr, out_ptr, regions, epochs, n, slot_elems, rank,
    WORLD: tl.constexpr, BLOCK: tl.constexpr, FLAGS: tl.constexpr, ABORT: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    epoch = tl.load(epochs + pid) + 1
    dtype = out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    parity = (epoch % 2).to(tl.int64) * slot_elems
    own = tl.load(regions + rank)
    mine = (own + FLAGS).to(tl.pointer_type(dtype)) + parity
    for start in range(pid * BLOCK, n, programs * BLOCK):
        idx = start + offs
        mask = idx < n
        tl.store(mine + idx, tl.load(part_ptr + idx, mask=mask), mask=mask, cache_modifier=".wt")
    _publish(own.to(tl.pointer_type(tl.int32)) + pid, epoch, ASM)
    abort = (own + ABORT).to(tl.pointer_type(tl.int32))
    for q in tl.static_range(WORLD):
        if q != rank:
            flag = tl.load(regions + q).to(tl.pointer_type(tl.int32)) + pid
            while (_seen(flag, ASM) < epoch) & (tl.load(abort, volatile=True) == 0):
                pass
    tl.debug_barrier()
    for start in range(pid * BLOCK, n, programs * BLOCK):
        idx = start + offs
        mask = idx < n
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for q in tl.static_range(WORLD):
            if q == rank:
                acc += tl.load(part_ptr + idx, mask=mask).to(tl.float32)
            else:
                src = (tl.load(regions + q) + FLAGS).to(tl.pointer_type(dtype)) + parity
                acc += tl.load(src + idx, mask=mask, cache_modifier=".cv").to(tl.float32)
        tl.store(out_ptr + idx, acc.to(dtype), mask=mask)
    tl.store(epochs + pid, epoch)


def region_bytes(slot_bytes: int) -> int:
    """Bytes of one rank's region for slots of ``slot_bytes``: flags, then two slots."""
    return FLAGS + 2 * slot_bytes


def host_shot_all_reduce(
    part: torch.Tensor,
    out: torch.Tensor,
    regions: torch.Tensor,
    epochs: torch.Tensor,
    slot_bytes: int,
    rank: int,
) -> None:
    """On the current stream: ``out`` = the sum over the ranks of their ``part``.

    Args:
        part: this rank's partial, contiguous, ``n`` elements (fp16, bf16 or fp32), in device
            memory (or CPU memory under the interpreter).
        out: contiguous, ``n`` elements of ``part``'s dtype.
        regions: int64 ``[world]``, the address (as the device sees it) of every rank's
            region (``region_bytes(slot_bytes)`` each, zero before the first call).
        epochs: int32 ``[PROGRAMS]``, this rank's count of calls per program (zero at first).
        slot_bytes: bytes of a slot (at least ``part``'s).
        rank: this rank's index in ``regions``.
    """
    n = part.numel()
    assert n * part.element_size() <= slot_bytes and out.numel() == n, (n, slot_bytes)
    _host_shot_kernel[(PROGRAMS,)](
        part, out, regions, epochs, n, slot_bytes // part.element_size(), rank,
        WORLD=regions.numel(), BLOCK=BLOCK, FLAGS=FLAGS, ABORT=ABORT, ASM=part.is_cuda,
        num_warps=4,
    )  # fmt: skip
