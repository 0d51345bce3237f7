"""The copy-engine transport through host memory, for ranks of one host whose GPUs cannot map
each other's memory (PCIe consumer cards, or ``NCCL_P2P_DISABLE=1``).

Same plan, kernel and flags as ``peer.py`` (read that first); what differs is the road. Every
rank maps one pinned shared host buffer (a file in ``/dev/shm``, or in the temp directory when
``/dev/shm`` is too small, mapped by every rank and registered with ``cuMemHostRegister``)
that holds, for each destination rank ``d``, its flags and its slots ``[regions][R][B][N]``.

- Sending (the communication stream): a finished band for rank ``d`` is copied to the host
  (a device-to-host copy engine) into ``d``'s region, slot ``r``, then ``d``'s flag for it is
  set in host memory (a stream memory write on the host address, after a fence).
- Receiving (a second stream, so that both directions of the PCIe link work at once): once
  a peer's flag in this rank's region is set, the band is copied host-to-device
  into the device receive slot and the kernel's device flag is set (all-reduce and
  reduce-scatter: the GEMM's epilogue adds it), or straight into ``out`` (all-to-all, and
  all-reduce's gathered bands).

No SM is used for any transfer. Data crosses PCIe twice (to the host and back), as with
NCCL's shared-memory transport, whose copies are kernels that compete with the GEMM.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import uuid
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..contract import FLAGS_BYTES, kernel_flags_start
from ..guard import RankMismatchError
from ..plan import Plan
from ..signal.wait import StreamOps, _driver, check
from .peer import PeerTransport, need_bytes, receive_slots, slot_bytes
from .transport import kept, same_need

_DEVICEMAP_PORTABLE = 0x02 | 0x01  # CU_MEMHOSTREGISTER_DEVICEMAP | _PORTABLE


def map_shared(group: dist.ProcessGroup | None, rank: int, size: int, need) -> tuple:
    """One zero-filled host buffer of ``size`` bytes that every rank of ``group`` maps,
    pinned and registered for its GPU (a collective; ``need``: what every rank must agree on,
    ranks that disagree raise ``RankMismatchError``). Returns ``(mapping, address)``: the
    mapping (``[mmap, ctypes view, host address, size]``, for ``unmap``) and the buffer's
    address as the GPU sees it. Where mapping or registering fails on any rank, every rank
    raises ``RuntimeError`` naming it (one agreement after the local steps: no rank waits
    in a collective the others left)."""
    path = [None]
    if rank == 0:
        st = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
        room = st.f_bavail * st.f_frsize if st else 0
        folder = "/dev/shm" if room > 2 * size else tempfile.gettempdir()
        path[0] = os.path.join(folder, f"overlap-{uuid.uuid4().hex}")
        with open(path[0], "wb") as f:
            f.truncate(size)  # zero-filled: no flag set
    try:  # rank 0's path; every rank's need (ranks that disagree raise)
        path = same_need(group, need, path[0])[:1]
    except RankMismatchError:
        if rank == 0:
            os.unlink(path[0])
        raise
    mapping, dev, why = None, 0, ""
    try:  # (a rank that fails here still takes part in the agreement below)
        fd = os.open(path[0], os.O_RDWR)
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        view = ctypes.c_char.from_buffer(mm)
        host = ctypes.addressof(view)
        mapping = [mm, view, host, 0]  # (size 0: not registered yet)
        del view, mm  # (only `mapping` holds them: `unmap` must close the mmap)
        drv = _driver()
        (err,) = drv.cuMemHostRegister(host, size, _DEVICEMAP_PORTABLE)
        check(err, "cuMemHostRegister")
        mapping[3] = size
        err, dev = drv.cuMemHostGetDevicePointer(host, 0)
        check(err, "cuMemHostGetDevicePointer")
    except Exception as e:  # noqa: BLE001 (every rank learns of it below)
        why = f"rank {rank}: {type(e).__name__}: {e}"
    whys: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(whys, why, group=group)  # every rank has mapped the file, or not
    if rank == 0:
        os.unlink(path[0])  # the mappings keep the memory
    why = next((w for w in whys if w), "")
    if why:
        if mapping is not None:
            unmap(mapping)
        raise RuntimeError(f"overlap: the shared host buffer could not be mapped ({why})")
    return mapping, int(dev)


def unmap(mapping: list) -> None:
    """Unregister and unmap a buffer of ``map_shared`` (no call may use it any more); empties
    ``mapping`` (the view into the mmap must be gone before it closes)."""
    mm, view, host, registered = mapping
    mapping.clear()
    if registered:
        _driver().cuMemHostUnregister(host)
    del view
    mm.close()


class HostTransport(PeerTransport):
    """``PeerTransport`` whose buffers live in pinned shared host memory; one per context."""

    road, covers = "host", True  # (a dx op's transfer outlasts its GEMM by up to ~0.8 ms)
    a2a_in_place = False  # received bands land in `out` on another stream: no scratch there

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        super().__init__(group, device)
        self.region = 0  # bytes per destination rank: flags, then slots
        self.mapping: list | None = None  # [mmap, ctypes view, host address, size] (map_shared)
        self.base = 0  # device address of the host buffer
        self.recv: torch.Tensor | None = None  # device receive slots (uint8)
        _, highest = torch.cuda.Stream.priority_range()
        self.recv_stream = torch.cuda.Stream(device, priority=highest)
        # the kernel's ARRIVED flags, in device memory (zeroed by _clear, set by the receives)
        self.dflags = kept(device, lambda: torch.zeros(FLAGS_BYTES // 4, dtype=torch.int32,
                                                       device=device))  # fmt: skip

    @property
    def nbytes(self) -> int:
        """Memory this transport holds: the shared host buffer (all ranks' regions) and the
        device receive slots."""
        host = self.mapping[3] if self.mapping is not None else 0
        return host + (self.recv.numel() if self.recv is not None else 0)

    def kernel_flag(self, index: int) -> int:
        """The kernel's ARRIVED flags are in device memory here (``dflags``)."""
        return self.dflags.data_ptr() + 4 * (kernel_flags_start(self.size) + index)

    def _ensure(self, nbytes: int) -> None:
        """A shared host buffer with ``nbytes`` of slots per rank (a collective when it grows)."""
        if self.mapping is not None and self.region >= FLAGS_BYTES + nbytes:
            return
        region = -(-(FLAGS_BYTES + nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
        mapping, dev = map_shared(self.group, self.rank, region * self.size, nbytes)
        torch.cuda.synchronize(self.device)  # nothing of ours uses the old buffers any more
        self._release()
        self.mapping, self.region, self.base = mapping, region, dev
        self.generation += 1
        # every rank's region, as PeerTransport's buffers: _flag and _slot work unchanged
        self.ptrs = [self.base + d * region for d in range(self.size)]

    def _release(self) -> None:
        if self.mapping is not None:
            unmap(self.mapping)
            self.mapping = None

    def fits(self, M: int, N: int, K: int, spec, dtype: torch.dtype) -> bool:
        """Whether the call needs no bigger host or device buffers."""
        need = need_bytes(M, N, K, spec, dtype)
        device = M * (K if spec.before else N) * dtype.itemsize
        return (self.mapping is not None and self.region >= FLAGS_BYTES + need
                and self.recv is not None and self.recv.numel() >= device)  # fmt: skip

    def _clear(self, q: StreamOps) -> None:
        """Zero this rank's flags in host memory but READY, and the kernel's device flags."""
        super()._clear(q)
        q.copy(self.dflags.data_ptr(), self.zeros.data_ptr(), FLAGS_BYTES)

    def _device_recv(self, n: int) -> None:
        """Device receive slots of at least ``n`` bytes."""
        if self.recv is None or self.recv.numel() < n:
            torch.cuda.synchronize(self.device)  # the old slots may still be read or written
            self.recv = kept(self.device, lambda: torch.empty(n, dtype=torch.uint8,
                                                              device=self.device))  # fmt: skip
            self.generation += 1
            self._views.clear()  # they would keep the old slots alive

    def _gathered(self, p: Plan, dtype: torch.dtype, stream: torch.cuda.Stream) -> torch.Tensor:
        """The all-gather's receiving side (``gather``'s pushes go to the host): on the
        receive stream, after ``stream``'s work so far, each peer's band ``k`` from this
        rank's host region into the device receive slots once its host flag is set, then
        the device flag that ``arrived`` waits on. Returns the device receive slots
        ``[M, K]``."""
        n = p.M * p.K * dtype.itemsize
        self._device_recv(n)
        self.recv_stream.wait_stream(stream)  # after this call's start (the caller's reads)
        q = StreamOps(self.recv_stream.cuda_stream)
        for k in range(p.bands_per_block):
            self._receive(p, None, k, q, self.recv.data_ptr(), dtype.itemsize)
        q.flush()
        return self.recv[:n].view(dtype).view(p.M, p.K)

    def gather(
        self, p: Plan, x: torch.Tensor, stream: torch.cuda.Stream, caller: torch.cuda.Stream
    ) -> torch.Tensor:
        """``PeerTransport.gather`` through host memory: pushes on ``stream``, receives on
        the receive stream (both directions of the link at once); ``stream`` then waits for
        the receives (after its pushes: the peers' receives wait for those)."""
        buf = super().gather(p, x, stream, caller)
        stream.wait_stream(self.recv_stream)
        return buf

    def _prepare(self, p: Plan, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        self._ensure(slot_bytes(p, dtype))
        self._device_recv(p.M * p.N * dtype.itemsize)  # (gathered bands go into `out`)
        key = (self.recv.data_ptr(), p, dtype)
        if key not in self._views:
            if len(self._views) >= 256:  # one entry per plan: varying M would grow it
                self._views.clear()
            flags = self.dflags[kernel_flags_start(self.size) :]
            self._views[key] = receive_slots(self.recv, p, dtype), flags
        return self._views[key]

    def run(
        self,
        p: Plan,
        slots: torch.Tensor,
        out: torch.Tensor,
        wait: Callable[..., None],
        stream: torch.cuda.Stream,
    ) -> None:
        """Sends on ``stream`` (``_send``); receives on a second stream, so that both
        directions of the PCIe link work at once: each band of this rank's block after its
        flag in host memory, into the device receive slot and the kernel's flag (when the
        collective reduces: the kernel adds it) or into ``out`` (all-to-all); all-reduce's
        gathered bands into ``out``. ``stream`` then waits for the second stream."""
        rs = self.recv_stream
        rs.wait_stream(stream)
        q, rq = StreamOps(stream.cuda_stream), StreamOps(rs.cuda_stream)
        self._send(p, slots, out, wait, q, None)
        q.flush()
        into = self.recv.data_ptr() if p.spec.reduces else 0
        for k in range(p.bands_per_block):
            self._receive(p, out, k, rq, into)
        if p.spec.replicated:
            for k in range(p.bands_per_block):
                self._receive(p, out, k, rq)
        rq.flush()
        stream.wait_stream(rs)

    def _local_flags(self) -> list[int]:
        dev = self.dflags.data_ptr()
        return super()._local_flags() + [dev + 4 * i for i in range(self.dflags.numel())]

    def close(self) -> None:
        """Unmap the shared host buffer and free the device receive slots."""
        super().close()
        self._release()
        self.recv = None
