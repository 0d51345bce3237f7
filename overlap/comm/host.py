"""The copy-engine transport through host memory, for ranks of one host whose GPUs cannot map
each other's memory (PCIe consumer cards, or ``NCCL_P2P_DISABLE=1``).

Same plan, kernel and flags as ``peer.py`` (read that first); what differs is the road. Every
rank maps one pinned shared host buffer (a file in ``/dev/shm``, or in the temp directory when
``/dev/shm`` is too small, mapped by every rank and registered with ``cuMemHostRegister``)
that holds, for each destination rank ``d``, its flags and its slots ``[regions][R][B][N]``.

- Sending (the communication stream): a finished band for rank ``d`` is copied to the host
  (a device-to-host copy engine) into ``d``'s region, slot ``r``, then ``d``'s flag for it is
  set in host memory (``cuStreamWriteValue32`` on the host address, after a fence).
- Receiving (a second stream, so that both directions of the PCIe link work at once): once
  a peer's flag in this rank's region holds the epoch, the band is copied host-to-device
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

import torch
import torch.distributed as dist

from ..plan import Plan
from ..signal.wait import _driver
from .peer import _FLAGS_BYTES, PeerTransport, _check, slot_bytes

_DEVICEMAP_PORTABLE = 0x02 | 0x01  # CU_MEMHOSTREGISTER_DEVICEMAP | _PORTABLE


class HostTransport(PeerTransport):
    """``PeerTransport`` whose buffers live in pinned shared host memory; one per context."""

    a2a_in_place = False  # received bands land in `out` on another stream: no scratch there

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        super().__init__(group, device)
        self.region = 0  # bytes per destination rank: flags, then slots
        self.mapping: tuple | None = None  # (mmap, ctypes view, host address, size)
        self.base = 0  # device address of the host buffer
        self.recv: torch.Tensor | None = None  # device receive slots (uint8)
        _, highest = torch.cuda.Stream.priority_range()
        self.recv_stream = torch.cuda.Stream(device, priority=highest)
        # the kernel's ARRIVED flags, in device memory; epochs only grow, so never reset
        self.dflags = torch.zeros(_FLAGS_BYTES // 4, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        """Memory this transport holds: the shared host buffer (all ranks' regions) and the
        device receive slots."""
        host = self.mapping[3] if self.mapping is not None else 0
        return host + (self.recv.numel() if self.recv is not None else 0)

    def _flag(self, rank: int, index: int) -> int:
        """Device address of int32 flag ``index`` in ``rank``'s region of the host buffer."""
        return self.base + rank * self.region + 4 * index

    def _slot(self, rank: int, region: int, s: int, row: int, p: Plan, es: int) -> int:
        """Device address of row ``row`` of slot ``s`` in ``rank``'s host region."""
        row += region * p.M + s * (p.M // self.size)
        return self.base + rank * self.region + _FLAGS_BYTES + row * p.N * es

    def _ensure(self, nbytes: int) -> None:
        """A shared host buffer with ``nbytes`` of slots per rank (a collective when it grows)."""
        if self.mapping is not None and self.region >= _FLAGS_BYTES + nbytes:
            return
        torch.cuda.synchronize(self.device)  # nothing of ours uses the old buffers any more
        drv = _driver()
        region = -(-(_FLAGS_BYTES + nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
        size = region * self.size
        path = [None]
        if self.rank == 0:
            st = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
            room = st.f_bavail * st.f_frsize if st else 0
            folder = "/dev/shm" if room > 2 * size else tempfile.gettempdir()
            path[0] = os.path.join(folder, f"overlap-{uuid.uuid4().hex}")
            with open(path[0], "wb") as f:
                f.truncate(size)  # zero-filled: epochs start at 1, so zero means "not yet"
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(path, src=src, group=self.group)
        fd = os.open(path[0], os.O_RDWR)
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        view = ctypes.c_char.from_buffer(mm)
        host = ctypes.addressof(view)
        (err,) = drv.cuMemHostRegister(host, size, _DEVICEMAP_PORTABLE)
        _check(err, "cuMemHostRegister")
        err, dev = drv.cuMemHostGetDevicePointer(host, 0)
        _check(err, "cuMemHostGetDevicePointer")
        dist.barrier(group=self.group)  # every rank has mapped the file
        if self.rank == 0:
            os.unlink(path[0])  # the mappings keep the memory
        self._release()
        self.mapping, self.region, self.base = (mm, view, host, size), region, int(dev)
        self.ptrs = [self.base + d * region for d in range(self.size)]  # marks "set up"

    def _release(self) -> None:
        if self.mapping is not None:
            mm, view, host, _ = self.mapping
            _driver().cuMemHostUnregister(host)
            del view
            self.mapping = None
            mm.close()

    def _prepare(self, p: Plan, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        self._ensure(slot_bytes(p, dtype))
        es = torch.finfo(dtype).bits // 8
        n = p.M * p.N * es  # receive slots only: gathered bands go straight into `out`
        if self.recv is None or self.recv.numel() < n:
            torch.cuda.synchronize(self.device)  # the old slots may still be read or written
            self.recv = torch.empty(n, dtype=torch.uint8, device=self.device)
        slots = self.recv[: p.M * p.N * es].view(dtype).view(self.size, -1, p.N)
        return slots, self.dflags[self.size :]

    def run(self, p: Plan, p_flat: torch.Tensor, out2: torch.Tensor, wait, stream: int) -> None:
        """Sends on ``stream`` (READY, then each band after ``wait(c)``: to the host, then its
        flag), receives on the second stream (each band after its flag: to the device slot and
        the kernel's flag, or into ``out2``); ``stream`` then waits for the second."""
        R, r, N, b = self.size, self.rank, p.N, p.bands_per_block
        B, rows, n_bands = p.M // R, p.run_rows, p.n_row_bands
        es = p_flat.element_size()
        band = rows * N * es
        drv = _driver()
        cu = drv.CUstream(stream)
        rs = self.recv_stream
        rs.wait_stream(torch.cuda.current_stream(self.device))
        cur = drv.CUstream(rs.cuda_stream)
        peers = [(r + k) % R for k in range(1, R)]

        def block(s: int, k: int) -> int:  # band k of out2's block s
            return out2.data_ptr() + (s * B + k * rows) * N * es

        for d in peers:
            self._write(stream, d, r)  # READY: this rank's region may be written
        for s in peers:
            self._wait(stream, s)
        for c in range(n_bands):
            a = (c + (r + 1) % R * b) % n_bands  # the band launched c-th (gemm.Fuse)
            d, k = divmod(a, b)
            if d != r:
                wait(c)
                src = p_flat.data_ptr() + a * band
                self._copy(cu, self._slot(d, 0, r, k * rows, p, es), src, band)
                self._write(stream, d, R + r * b + k)
            elif p.collective == "all_reduce":
                wait(c)
                for q in peers:
                    self._copy(cu, self._slot(q, 1, r, k * rows, p, es), block(r, k), band)
                    self._write(stream, q, R + R * b + r * b + k)
        recv = self.recv.data_ptr()
        for k in range(b):  # this rank's block, in the order the peers send it
            for s in peers:
                self._wait(rs.cuda_stream, R + s * b + k)
                src = self._slot(r, 0, s, k * rows, p, es)
                if p.collective == "all_to_all":
                    self._copy(cur, block(s, k), src, band)
                else:
                    self._copy(cur, recv + (s * B + k * rows) * N * es, src, band)
                    self._write_at(rs.cuda_stream, self.dflags.data_ptr() + 4 * (R + s * b + k))
        if p.collective == "all_reduce":
            for k in range(b):
                for s in peers:
                    self._wait(rs.cuda_stream, R + R * b + s * b + k)
                    self._copy(cur, block(s, k), self._slot(r, 1, s, k * rows, p, es), band)
        torch.cuda.current_stream(self.device).wait_stream(rs)

    def _local_flags(self) -> list[int]:
        dev = self.dflags.data_ptr()
        return super()._local_flags() + [dev + 4 * i for i in range(self.dflags.numel())]
