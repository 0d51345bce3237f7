"""The latency all-reduce through host memory: a one-shot all-reduce for ranks whose GPUs
cannot map each other's memory (no P2P: PCIe consumer cards, ``NCCL_P2P_DISABLE=1``), over
the pinned host buffer every rank of the group maps (``comm/shot.py``'s ``HostShotTransport``
makes it as ``comm/host.py`` makes the copy engines').

Rank ``r``'s region of that buffer holds its flag, its abort word and two slots; its
``state`` (int32, device memory) counts its calls (``[0]``: the calls done, so that a CUDA
graph's replays count on), the programs of the current call that stored their share
(``[1]``), the last call whose peers' partials are all in host memory (``[2]``) and the
programs done (``[3]``). A call ``e`` (``state[0] + 1``) of ``G`` programs (``programs(n)``,
up to ``PROGRAMS``):

1. every program stores its share of this rank's partial (device memory) into slot ``e % 2``
   of this rank's region, through PCIe, fences its stores at system scope and counts itself
   in ``state[1]``;
2. program 0 alone talks to the peers (polling host memory from every program floods PCIe
   with reads: 32 programs took 260 us for 8 KB where NCCL takes 14): once all ``G`` counted,
   it sets this rank's flag to ``e`` (a release store), waits until every peer's flag reaches
   ``e`` (acquire loads through PCIe) or this rank's abort word is not 0 (the transport's
   ``abort``, a host store: the result is then garbage and the caller raises), and sets
   ``state[2]`` to ``e``;
3. every program, once ``state[2]`` reaches ``e`` (polled in device memory), sums the ``R``
   partials of its share in rank order, in fp32 (its own from device memory, the peers' from
   their slots ``e % 2``, read past the caches): the same bits on every rank, into ``out``;
   the last program done resets ``state[1]`` and ``state[3]`` and sets ``state[0]`` to ``e``.

One barrier per call, because the slots alternate: rank ``r`` writes slot ``e % 2`` again at
call ``e + 2``, which its stream starts only after its call ``e + 1`` saw every peer's flag
reach ``e + 1``; a peer sets that in its call ``e + 1``, which its stream started after its
call ``e`` ended, the last reads of that slot. Counts wrap at 2**31 (compared by their
difference, the slot by the count's lowest bit). A rank whose abort word is set stores and
publishes nothing more: a peer that was only late then waits for it, and its own watch raises,
instead of summing slots the aborted rank's later calls overwrote. The ``G`` programs of a
call wait for each other: they must all be resident at once (``PROGRAMS`` is small; a kernel
of another stream holding every SM meanwhile would stall the call until it ends).

Every word tagged with its call instead (no fence, no flag: the reader polls the data) lost:
2-5x NCCL's time on 2 H200s (8-64 KB: 24-78 us against 15-17), the levers table.

Under Triton's interpreter (the CPU tests) the system-scope release / acquire are atomics; on
GPUs they are ``st.release.sys`` / ``ld.acquire.sys`` (no PCIe atomics needed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..contract import SHOT_ABORT as ABORT
from ..contract import SHOT_FLAGS_BYTES as FLAGS
from ..contract import SHOT_PROGRAMS as PROGRAMS
from .launch import CompiledKernel, Launcher

BLOCK = 2048  # elements per program and step: 4 warps, two 16-byte accesses each (16-bit)


@triton.jit
def _fence(dummy, ASM: tl.constexpr):
    """This thread's stores so far made visible to the system (the host, the peers)."""
    if ASM:
        tl.inline_asm_elementwise(
            "fence.acq_rel.sys; mov.u32 $0, 0;", "=r,r", [dummy], dtype=tl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def _publish(flag, value, ASM: tl.constexpr):
    """``flag`` (host memory) set to ``value`` after this program's stores (release)."""
    if ASM:
        tl.inline_asm_elementwise(
            "st.global.release.sys.b32 [$1], $2; mov.u32 $0, 0;", "=r,l,r", [flag, value],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    else:
        tl.atomic_xchg(flag, value, sem="release", scope="sys")


@triton.jit
def _seen(flag, ASM: tl.constexpr):
    """``flag``'s value (host memory; acquire, system scope)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "ld.global.acquire.sys.b32 $0, [$1];", "=r,l", [flag], dtype=tl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip
    else:
        return tl.atomic_add(flag, 0, sem="acquire", scope="sys")


@triton.jit
def _host_shot_kernel(
    part_ptr, out_ptr, regions, state, n, slot_elems, rank,
    WORLD: tl.constexpr, BLOCK: tl.constexpr, FLAGS: tl.constexpr, ABORT: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    epoch = tl.load(state) + 1
    dtype = out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    parity = (epoch & 1).to(tl.int64) * slot_elems
    own = tl.load(regions + rank)
    mine = (own + FLAGS).to(tl.pointer_type(dtype)) + parity
    abort = (own + ABORT).to(tl.pointer_type(tl.int32))
    live = tl.load(abort, volatile=True) == 0  # (aborted: nothing stored, nothing published)
    end = tl.where(live, n, 0)
    for start in range(pid * BLOCK, end, programs * BLOCK):
        idx = start + offs
        mask = idx < end
        tl.store(mine + idx, tl.load(part_ptr + idx, mask=mask), mask=mask, cache_modifier=".wt")
    tl.debug_barrier()
    _fence(epoch, ASM)
    tl.debug_barrier()
    tl.atomic_add(state + 1, 1, sem="release", scope="gpu")
    if pid == 0:  # the only program that polls host memory
        while tl.atomic_add(state + 1, 0, sem="acquire", scope="gpu") < programs:
            pass
        if live:
            _publish(own.to(tl.pointer_type(tl.int32)), epoch, ASM)
        for q in tl.static_range(WORLD):
            if q != rank:
                flag = tl.load(regions + q).to(tl.pointer_type(tl.int32))
                while (_seen(flag, ASM) - epoch < 0) & (tl.load(abort, volatile=True) == 0):
                    pass
        tl.debug_barrier()
        tl.atomic_xchg(state + 2, epoch, sem="release", scope="gpu")
    while tl.atomic_add(state + 2, 0, sem="acquire", scope="gpu") - epoch < 0:
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
    tl.debug_barrier()
    if tl.atomic_add(state + 3, 1, sem="acq_rel", scope="gpu") == programs - 1:  # the last
        tl.atomic_xchg(state + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(state + 3, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(state, epoch, sem="relaxed", scope="gpu")


def programs(n: int) -> int:
    """Programs of a call of ``n`` elements (every rank runs the same for the same ``n``)."""
    return max(1, min(PROGRAMS, -(-n // BLOCK)))


def host_shot_all_reduce(
    part: torch.Tensor,
    out: torch.Tensor,
    regions: torch.Tensor,
    state: torch.Tensor,
    slot_bytes: int,
    rank: int,
) -> None:
    """On the current stream: ``out`` = the sum over the ranks of their ``part``.

    Args:
        part: this rank's partial, contiguous, ``n`` elements (fp16, bf16 or fp32), in device
            memory (or CPU memory under the interpreter).
        out: contiguous, ``n`` elements of ``part``'s dtype.
        regions: int64 ``[world]``, the address (as the device sees it) of every rank's
            region (``contract.shot_region_bytes(slot_bytes)`` each, zero before the first
            call).
        state: int32 ``[4]``, this rank's counts (module docstring; zero at first).
        slot_bytes: bytes of a slot (at least ``part``'s).
        rank: this rank's index in ``regions``.
    """
    _launch(*_arguments(part, out, regions, state, slot_bytes, rank), num_warps=4)


def _arguments(part, out, regions, state, slot_bytes: int, rank: int) -> tuple[int, dict]:
    """The grid and the kernel's arguments by name of ``host_shot_all_reduce``'s call."""
    n, size = part.numel(), part.element_size()
    assert n * size <= slot_bytes and out.numel() == n, (n, slot_bytes)
    a = dict(part_ptr=part, out_ptr=out, regions=regions, state=state, n=n,
             slot_elems=slot_bytes // size, rank=rank, WORLD=regions.numel(), BLOCK=BLOCK,
             FLAGS=FLAGS, ABORT=ABORT, ASM=part.is_cuda)  # fmt: skip
    return programs(n), a


class HostShot:
    """``host_shot_all_reduce`` of one partial buffer (a transport's, one shape and dtype)
    with every argument but ``out`` bound: the first call launches through ``Launcher`` (which
    compiles), later ones launch its compiled kernel directly (the arguments' dict, their
    order and the specialization key made at every call cost ~8 us of host time on an H200
    host). An ``out`` not 16-byte aligned (a specialization of its own), the interpreter and
    launch hooks (profilers) always take ``Launcher``'s way."""

    def __init__(self, part, regions, state, slot_bytes: int, rank: int) -> None:
        self.bound = (part, regions, state, slot_bytes, rank)
        self.k: CompiledKernel | None = None
        self.grid, self.head, self.tail = 0, (), ()
        self.stream = None  # (Triton's driver's: the current stream of a device index)

    def __call__(self, out: torch.Tensor) -> None:
        """On the current stream: ``out`` = the sum over the ranks of the bound partial."""
        k = self.k
        if k is None or out.data_ptr() % 16 or _launch.hooked():
            part, regions, state, slot_bytes, rank = self.bound
            grid, a = _arguments(part, out, regions, state, slot_bytes, rank)
            k = _launch(grid, a, num_warps=4)
            if self.k is None and part.is_cuda and not (out.data_ptr() % 16 or _launch.hooked()):
                values = _launch.values(a)  # (the output second: the signature's order)
                self.grid, self.head, self.tail = grid, values[:1], values[2:]
                self.device, self.stream = part.get_device(), _launch.stream()
                self.k = k
            return
        k.run(self.grid, 1, 1, self.stream(self.device), k.function, k.packed_metadata, None,
              None, None, *self.head, out, *self.tail)  # fmt: skip


_launch = Launcher(_host_shot_kernel)
assert _launch.names[:2] == ("part_ptr", "out_ptr")  # (HostShot's head and tail)
