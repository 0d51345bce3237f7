"""Copy-engine transport (``backend="ce"``) for ranks whose GPUs map each other's memory.

NCCL's collectives run as kernels: while the GEMM runs they take SMs from it and each chunk's
collective took ~1.8x its time alone (NOTES.md, the timeline). Here each finished chunk is
instead *pushed* by the GPU's copy engines (``cuMemcpyAsync`` between torch symmetric-memory
mappings, which use no SM) into its destination ranks' receive buffers, and the reduction is
one kernel after the GEMM. This is the idea of torch's async-TP, driven by our chunk counters.

Receive buffer of each rank (symmetric memory, ``[flags | data]``), slot ``s`` written by rank
``s`` (slot ``r`` of rank ``r`` by itself):

==============  =====================  ============================================
collective      data                   result (on the caller stream, after the GEMM)
==============  =====================  ============================================
all_reduce      ``[R, M, N]``          ``out = data.sum(0)``; the GEMM writes slot r
reduce_scatter  ``[R, M / R, N]``      ``out = data.sum(0)``
all_to_all      ``[R, M / R, N]``      ``out = data`` (a copy)
==============  =====================  ============================================

An all-reduce pushes the whole chunk to every peer ((R - 1) x the product per rank; NCCL's
ring moves 2 (R - 1) / R x): equal at R = 2, worse above, so ``backend="auto"`` takes this
transport for all-reduce only at R = 2. The sum runs in float32 and rounds once.

Flags (int32, on every rank): ``READY[s]`` (rank s's buffer may be written for call e) and
``DONE[s]`` (rank s's pushes into this buffer for call e are complete), written by the peers
with ``cuStreamWriteValue32`` (which fences the stream's earlier copies) and awaited with
``cuStreamWaitValue32(GEQ)``; the epoch ``e`` counts this transport's calls (ranks call in the
same order, as with NCCL). Per call on the communication stream: READY to every peer, wait
for every peer's READY, per chunk (after its counter) the pushes, DONE to every peer, wait for
every peer's DONE. So a buffer is never written before its owner's previous call has read it,
and the caller reduces only after every push into it has landed.

Needs: CUDA, torch symmetric memory, cuda-python, and P2P access between all ranks' GPUs
(``peer_capable``). Plans with column bands and calls captured in CUDA graphs (the epochs are
host values) use NCCL instead (``overlap.api``).
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
    def _data_elems(self, p: Plan) -> int:
        rows = p.M if p.collective == "all_reduce" else p.M // p.world_size
        return p.world_size * rows * p.N

    def _ensure(self, nbytes: int) -> None:
        """A buffer of at least ``nbytes`` of data on every rank (a collective when it grows)."""
        if self.buf is not None and self.buf.numel() >= _FLAGS_BYTES + nbytes:
            return
        from torch.distributed import _symmetric_memory as symm_mem

        if self.buf is not None:
            # No work of ours uses the old buffer any more (every call ends after its DONE
            # wait, and the peers' pushes into it ended before their DONE).
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

    def _flag(self, rank: int, kind: int, src: int) -> int:
        """Address (mapped here) of flag ``kind`` (0 READY, 1 DONE) from ``src`` on ``rank``."""
        return self.ptrs[rank] + 4 * (kind * self.size + src)

    def data(self, p: Plan, dtype: torch.dtype) -> torch.Tensor:
        """This rank's receive slots, ``[R, rows, N]`` (module docstring)."""
        n = self._data_elems(p)
        es = torch.finfo(dtype).bits // 8
        flat = self.buf[_FLAGS_BYTES : _FLAGS_BYTES + n * es].view(dtype)
        return flat.view(p.world_size, -1, p.N)

    # -- one call ----------------------------------------------------------------------------
    def begin(self, p: Plan, dtype: torch.dtype) -> torch.Tensor | None:
        """Before the GEMM launches (on the host): size the buffer, open epoch ``e``. Returns
        the flat buffer the GEMM writes into for all-reduce (this rank's slot), else None."""
        if self.broken:
            raise RuntimeError(
                "the copy-engine transport of this stream was aborted (validation mode's "
                "timeout); its epochs no longer match the peers'"
            )
        es = torch.finfo(dtype).bits // 8
        self._ensure(self._data_elems(p) * es)
        self.epoch += 1
        if p.collective == "all_reduce":
            return self.data(p, dtype)[self.rank].view(-1)
        return None

    def _signal(self, stream: int, kind: int) -> None:
        drv, e = _driver(), self.epoch & _MASK
        for d in range(self.size):
            if d != self.rank:
                (err,) = drv.cuStreamWriteValue32(
                    drv.CUstream(stream), drv.CUdeviceptr(self._flag(d, kind, self.rank)), e, 0
                )
                _check(err, "cuStreamWriteValue32 to a peer")

    def _await(self, stream: int, kind: int) -> None:
        drv, e = _driver(), self.epoch & _MASK
        geq = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        for s in range(self.size):
            if s != self.rank:
                (err,) = drv.cuStreamWaitValue32(
                    drv.CUstream(stream), drv.CUdeviceptr(self._flag(self.rank, kind, s)), e, geq
                )
                _check(err, "cuStreamWaitValue32")

    def run(self, p: Plan, p_flat: torch.Tensor, wait, stream: int) -> None:
        """On ``stream`` (the communication stream): the handshake, then each chunk's pushes
        after ``wait(c)``, then the closing handshake. ``p_flat`` is the GEMM's slot buffer."""
        drv = _driver()
        R, N, r = self.size, p.N, self.rank
        es = p_flat.element_size()
        src0 = p_flat.data_ptr()
        rows_per_slot = p.M if p.collective == "all_reduce" else p.M // R
        order = [(r + k) % R for k in range(1, R)] + [r]  # peers first, own slot last
        cu_stream = drv.CUstream(stream)
        self._signal(stream, 0)
        self._await(stream, 0)
        for c in range(p.n_chunks):
            off, rows, cols, row0, _ = p.chunk_slot(c)
            wait(c)
            for d in order:
                if p.collective == "all_reduce":
                    if d == r:
                        continue  # the GEMM wrote this rank's slot in place
                    src, dst_row, n = src0 + off * es, r * rows_per_slot + row0, rows * cols
                else:
                    h = rows // R  # rank d's run of this chunk
                    src = src0 + (off + d * h * cols) * es
                    dst_row, n = r * rows_per_slot + row0 // R, h * cols
                if n:
                    dst = self.ptrs[d] + _FLAGS_BYTES + dst_row * N * es
                    (err,) = drv.cuMemcpyAsync(
                        drv.CUdeviceptr(dst), drv.CUdeviceptr(src), n * es, cu_stream
                    )
                    _check(err, "cuMemcpyAsync to a peer")
        self._signal(stream, 1)
        self._await(stream, 1)

    def finish(self, p: Plan, out2: torch.Tensor) -> None:
        """On the caller stream, after it waited for ``run``: the result into ``out2``."""
        data = self.data(p, out2.dtype)
        if p.collective == "all_to_all":
            out2.view_as(data).copy_(data)
        else:
            torch.sum(data, dim=0, out=out2)

    def abort(self) -> None:
        """Release this rank's waits on its peers (validation mode's timeout): the flags are
        set to the current epoch from a side stream; the transport refuses later calls."""
        self.broken = True
        if self.buf is not None:
            side = torch.cuda.Stream(self.device)
            with torch.cuda.stream(side):
                flags = self.buf[:_FLAGS_BYTES].view(torch.int32)[: 2 * self.size]
                e = self.epoch & _MASK
                flags.fill_(e - (1 << 32) if e >= 1 << 31 else e)
            side.synchronize()
