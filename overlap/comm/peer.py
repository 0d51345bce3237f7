"""Copy-engine transport (``backend="ce"``) for ranks whose GPUs map each other's memory.

NCCL's collectives run as kernels: while the GEMM runs they take SMs from it and each chunk's
collective took ~1.8x its time alone (NOTES.md, the timeline). Here chunks are *pushed* by the
GPU's copy engines (``cuMemcpyAsync`` into torch symmetric-memory mappings of the peers'
buffers, which uses no SM), and the reduction happens in the GEMM's own epilogue.

The plan is *blocked* (``make_plan(blocked=True)``): the standard row layout in ``R * b`` equal
row bands, ``b`` per rank block of ``B = M / R`` rows. Rank ``r`` launches the bands starting
at block ``r + 1`` so that its own block comes last (``gemm.Fuse``):

- a band of block ``d != r`` is stored in the slot buffer and, once its counter is reached,
  pushed into rank ``d``'s receive slot ``r``; then the flag ``ARRIVED[r][k]`` (band ``k`` of
  the block) on rank ``d`` is set to the call's epoch;
- a tile of block ``r`` waits (in the kernel) for every peer's ``ARRIVED`` flag of its band,
  adds their partials from the receive slots and stores the sum straight into ``out``. The
  peers computed this block first, so their pushes landed long before (no wait in practice).

Per collective: reduce-scatter ends there. All-reduce also pushes each finished band of its
own block (from ``out``) into every peer's *gather* slot ``r``; all-to-all adds nothing (own
block stored as is) and its received blocks are its result. Both end with a handshake and a
copy of the gather / receive slots into ``out`` on the caller stream. Data moved per rank: as
NCCL's (R - 1) / R of the product for reduce-scatter and all-to-all, 2 (R - 1) / R for
all-reduce.

Buffer per rank (symmetric memory): flags (int32: ``READY[R]``, ``DONE[R]``,
``ARRIVED[R * b]``), then receive slots ``[R, B, N]``, then (all-reduce) gather slots
``[R, B, N]``. Flags are written by peers with ``cuStreamWriteValue32`` (which fences the
stream's earlier copies) and awaited with ``cuStreamWaitValue32(GEQ)`` or, in the kernel,
with acquire loads; values are the epoch of this transport's calls (ranks call in the same
order, as with NCCL), compared cyclically. A call begins with ``READY`` to every peer and
waits for theirs, so no buffer is written before its owner has finished the previous call.

Needs: CUDA, torch symmetric memory, cuda-python, P2P access between all ranks' GPUs
(``peer_capable``). Column-band plans and CUDA-graph capture (epochs are host values) use
NCCL instead (``overlap.api._resolve_backend``).
"""

from __future__ import annotations

import os
import socket
import warnings

import torch
import torch.distributed as dist

from ..plan import Plan
from ..signal.counters import _MASK
from ..signal.wait import _driver, method

_FLAGS_BYTES = 4096  # flags region at the start of the buffer (2 * R int32 flags)
_ALIGN = 2 << 20


def peer_capable(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether every rank of ``group`` can map every other rank's GPU memory: one host, P2P
    access between all the GPUs, stream memory operations (cuda-python), and NCCL's P2P not
    disabled by the user (``NCCL_P2P_DISABLE=1`` is read as "no P2P here"). A collective: every
    rank gets the same answer."""
    ok = (
        device.type == "cuda"
        and os.environ.get("NCCL_P2P_DISABLE", "0") != "1"
        and method() == "stream_wait"
    )
    uuid = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""
    mine = (socket.gethostname(), uuid, ok)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if not all(o for _, _, o in everyone) or len({h for h, _, _ in everyone}) != 1:
        return False
    visible = {
        str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())
    }
    local = [visible.get(u) for _, u, _ in everyone]
    me = device.index if device.index is not None else torch.cuda.current_device()
    able = all(
        i is not None and (i == me or torch.cuda.can_device_access_peer(me, i)) for i in local
    )
    verdicts: list = [None] * len(everyone)
    dist.all_gather_object(verdicts, able, group=group)
    return all(verdicts)


def _check(err, what: str) -> None:
    drv = _driver()
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")


READY, DONE = 0, 1  # flag kinds: index kind * R + src; ARRIVED at 2 * R + src * b + band


class PeerTransport:
    """Copy-engine pushes into symmetric-memory receive buffers; one per context (caller
    stream), since the buffer and the epoch belong to one stream of calls."""

    name = "ce"

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group, self.device = group, device
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.epoch = 0
        self.broken = False
        self.buf: torch.Tensor | None = None  # uint8, local view of the symmetric buffer
        self.ptrs: list[int] = []  # every rank's buffer, mapped here

    # -- buffer ------------------------------------------------------------------------------
    def _regions(self, p: Plan) -> int:
        """Slot regions of ``[R, B, N]`` a plan needs: receive, and gather for all-reduce."""
        return 2 if p.collective == "all_reduce" else 1

    def _ensure(self, nbytes: int) -> None:
        """A buffer of at least ``nbytes`` of data on every rank (a collective when it grows)."""
        if self.buf is not None and self.buf.numel() >= _FLAGS_BYTES + nbytes:
            return
        from torch.distributed import _symmetric_memory as symm_mem

        if self.buf is not None:
            # No work of ours uses the old buffer any more, and the peers' pushes into it ended
            # before the kernel or the DONE handshake that read them.
            torch.cuda.synchronize(self.device)
        size = -(-(_FLAGS_BYTES + nbytes) // _ALIGN) * _ALIGN
        group = self.group if self.group is not None else dist.group.WORLD
        with warnings.catch_warnings():  # needed by older torch, deprecated by newer
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(group.group_name)
        buf = symm_mem.empty(size, dtype=torch.uint8, device=self.device)
        handle = symm_mem.rendezvous(buf, group.group_name)
        buf[:_FLAGS_BYTES].zero_()  # epochs start at 1, so zeroed flags mean "not yet"
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # every rank's flags are zero before anyone writes
        self.buf, self.handle = buf, handle
        self.ptrs = [int(a) for a in handle.buffer_ptrs]

    def _flag(self, rank: int, index: int) -> int:
        """Address (mapped here) of int32 flag ``index`` on ``rank``."""
        return self.ptrs[rank] + 4 * index

    def slots(self, p: Plan, dtype: torch.dtype, region: int = 0) -> torch.Tensor:
        """This rank's receive (``region`` 0) or gather (1) slots, ``[R, B, N]``."""
        n = p.M * p.N  # R slots of B rows
        es = torch.finfo(dtype).bits // 8
        start = _FLAGS_BYTES + region * n * es
        return self.buf[start : start + n * es].view(dtype).view(p.world_size, -1, p.N)

    # -- one call ----------------------------------------------------------------------------
    def begin(self, p: Plan, dtype: torch.dtype, out2: torch.Tensor):
        """Before the GEMM launches (on the host): size the buffer, open the next epoch, and
        return the kernel's ``gemm.Fuse`` for the blocked plan ``p``."""
        from ..gemm import Fuse  # Triton: only where the GEMM runs

        if self.broken:
            raise RuntimeError(
                "the copy-engine transport of this stream was aborted (validation mode's "
                "timeout); its epochs no longer match the peers'"
            )
        if 2 * self.size + self.size * p.bands_per_block > _FLAGS_BYTES // 4:
            raise ValueError(f"too many ranks ({self.size}) for the transport's flags")
        es = torch.finfo(dtype).bits // 8
        self._ensure(self._regions(p) * p.M * p.N * es)
        self.epoch += 1
        flags = self.buf[:_FLAGS_BYTES].view(torch.int32)[2 * self.size :]
        add = p.collective != "all_to_all"
        return Fuse(out2, self.slots(p, dtype), flags, self.epoch, self.rank, add)

    def _write(self, stream: int, rank: int, index: int) -> None:
        """Write this call's epoch into int32 flag ``index`` of ``rank`` (stream-ordered)."""
        drv = _driver()
        addr = drv.CUdeviceptr(self._flag(rank, index))
        (err,) = drv.cuStreamWriteValue32(drv.CUstream(stream), addr, self.epoch & _MASK, 0)
        _check(err, "cuStreamWriteValue32 to a peer")

    def _handshake(self, stream: int, kind: int) -> None:
        """Flag ``kind`` to every peer, then wait for every peer's."""
        drv, e, R, r = _driver(), self.epoch & _MASK, self.size, self.rank
        peers = [d for d in range(R) if d != r]
        for d in peers:
            self._write(stream, d, kind * R + r)
        geq = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        for s in peers:
            (err,) = drv.cuStreamWaitValue32(
                drv.CUstream(stream), drv.CUdeviceptr(self._flag(r, kind * R + s)), e, geq
            )
            _check(err, "cuStreamWaitValue32")

    def _push(self, cu_stream, src: int, rank: int, region: int, row: int, p: Plan, es: int):
        """Copy one band (``run_rows x N`` elements of ``es`` bytes) from local address ``src``
        into ``rank``'s slot region ``region`` at row ``row`` of its ``[R * B, N]`` view."""
        drv, n = _driver(), p.run_rows * p.N * es
        dst = self.ptrs[rank] + _FLAGS_BYTES + (region * p.M + row) * p.N * es
        (err,) = drv.cuMemcpyAsync(drv.CUdeviceptr(dst), drv.CUdeviceptr(src), n, cu_stream)
        _check(err, "cuMemcpyAsync to a peer")

    def run(self, p: Plan, p_flat: torch.Tensor, out2: torch.Tensor, wait, stream: int) -> None:
        """On ``stream`` (the communication stream): the opening handshake, the pushes of each
        chunk after ``wait(c)`` (module docstring), and for all-reduce and all-to-all the
        closing handshake."""
        R, r, N, b = self.size, self.rank, p.N, p.bands_per_block
        B, rows, n_bands = p.M // R, p.run_rows, p.n_row_bands
        es = p_flat.element_size()
        cu = _driver().CUstream(stream)
        peers = [(r + k) % R for k in range(1, R)]
        self._handshake(stream, READY)
        for c in range(n_bands):
            a = (c + (r + 1) % R * b) % n_bands  # the band launched c-th (gemm.Fuse)
            d, k = divmod(a, b)
            if d != r:  # a peer's band: into its receive slot r, then its ARRIVED flag
                wait(c)
                self._push(cu, p_flat.data_ptr() + a * rows * N * es, d, 0, r * B + k * rows, p, es)
                self._write(stream, d, 2 * R + r * b + k)
            elif p.collective == "all_reduce":  # own reduced band: into every gather slot r
                wait(c)
                for q in peers:
                    self._push(
                        cu, out2.data_ptr() + a * rows * N * es, q, 1, r * B + k * rows, p, es
                    )
        if p.collective != "reduce_scatter":
            self._handshake(stream, DONE)

    def finish(self, p: Plan, out2: torch.Tensor) -> None:
        """On the caller stream, after it waited for ``run``: the peers' blocks into ``out2``
        (all-reduce: the gather slots; all-to-all: the receive slots)."""
        if p.collective == "reduce_scatter":
            return
        got = self.slots(p, out2.dtype, 1 if p.collective == "all_reduce" else 0)
        blocks = out2.view(self.size, -1, p.N)
        for s in range(self.size):
            if s != self.rank:
                blocks[s].copy_(got[s])

    def abort(self) -> None:
        """Release this rank's waits on its peers (validation mode's timeout): every local
        flag is set to the current epoch by stream memory writes on a side stream (no SM: a
        GEMM waiting in its epilogue may hold them all); the transport refuses later calls."""
        self.broken = True
        if self.buf is None:
            return
        side = torch.cuda.Stream(self.device)
        for i in range(_FLAGS_BYTES // 4):
            self._write(side.cuda_stream, self.rank, i)
        side.synchronize()
