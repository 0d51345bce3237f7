"""The latency all-reduce: torch's symmetric-memory one-shot or two-shot all-reduce, for
products too small to overlap (decode, small batches), in place of NCCL's, GPU to GPU.

A product ``[M, N]`` on the plain path is stored by its matmul straight into this rank's
symmetric-memory buffer (``partial``), and one of torch's kernels
(``torch.ops.symm_mem.one_shot_all_reduce_out`` or ``two_shot_all_reduce_``) reads the
peers' buffers over NVLink and writes the sum into the result: no NCCL call, about 10 us of
host time where ``dist.all_reduce`` costs ~45 us eagerly. Measured against the library's own
Triton one-shot / two-shot kernel on the same buffers (2 H200s, 2026-11-28, 4 KB to 16 MB of
bf16): torch's took 0.5-0.8x its time captured and its launch 10 us of host time against
Triton's 27, so torch's runs (the levers table). Both of torch's kernels end with a barrier
after their last read of the peers' buffers, so the next call's matmul may overwrite this
rank's buffer, and every rank sums the same partials in the same order (the same bits).

``kind`` decides by size, the same on every rank: one-shot up to ``ONE_SHOT_BYTES``, two-shot
up to ``SHOT_BYTES``, in place of an overlapped call too.

One transport per (group, device), made by the first eligible eager call on every rank (the
rendezvous is a collective) and shared by the contexts of every caller stream (``sized``): a
call captured in a CUDA graph uses it where an eager call made it, else the path the rest of the
decision gives (NCCL's plain path, or the copy engines where earlier calls sized them).
``watched``: torch's kernels synchronize through signal pads with compare-and-swap loops that
have no timeout (a rank sets its flag in a peer's pad from 0 to 1, then waits for the peer's
flag in its own pad to be 1 and sets it back to 0); a peer that never arrives holds them, so the
watchdog's ``abort`` releases them with stream writes (no SM needed): this rank's flags for the
peers set to 1, this rank's flags in the peers' pads set to 0, round after round (each passes
one barrier of every block) until every call queued on the streams that issued calls here has
ended, or ``RELEASE_SECONDS`` have passed (their results are garbage; the calls raise).

Needs: CUDA, torch symmetric memory, cuda-python (the road "peer", ``route``).
"""

from __future__ import annotations

import ctypes
import threading
import time
import warnings

import torch
import torch.distributed as dist

from ..contract import SHOT_ABORT, SHOT_STATE, shot_region_bytes
from ..signal.wait import StreamOps
from .host import map_shared, unmap
from .transport import Transport, kept

# Crossovers, product bytes (2 H200s, NVLink, bf16, tools/decode_bench.py's op sweep of
# 2026-11-28, captured us per op with the matmul): one-shot below two-shot up to 256 KB
# (12.3 / 13.6 at 8 KB, 13.8 / 14.6 at 256 KB), even at 512 KB-1 MB; two-shot below NCCL up
# to 16 MB (37.9 / 48.3 at 4 MB, 116 / 125 at 16 MB) and below the overlapped call there
# (116 / 178 at 2048 x 4096, K = 2048; 164 / 156 at 1024 x 8192, K = 4096, 424 / 412 at K =
# 14336: within 3%); above 16 MB equal to NCCL (627 / 653 at 64 MB) and the overlapped
# call wins.
ONE_SHOT_BYTES = 512 << 10
SHOT_BYTES = 16 << 20
DTYPES = (torch.bfloat16, torch.float32)  # (torch 2.11's kernels refuse float16)
# Through host memory (no P2P): the library's one-shot kernel (gemm/shot.py), any float type,
# above HOST_SHOT_MIN_BYTES up to HOST_SHOT_BYTES (the slots' size). Crossovers (2 H200s,
# NCCL_P2P_DISABLE=1, 2026-11-28, captured us per op, the kernel alone against NCCL's
# all-reduce: 15.0 / 16.6 at 8 KB, 15.6 / 15.2 at 32 KB, 20.2 / 25.2 at 128 KB, 26.4 / 40.1 at
# 256 KB, 37.3 / 48.3 at 512 KB, 55.9 / 64.2 at 1 MB, 96.8 / 98.5 at 2 MB; with the matmul, in
# tools/decode_bench.py's sweep: 0.86-0.97x NCCL's time at 8-32 KB, 1.01-1.03x at 64 KB,
# 1.10-1.39x at 128-512 KB). Eagerly its call took ~20 us more host time than matmul +
# dist.all_reduce when the floor was set (0.92-1.00x of it since its launch is bound,
# tools/host_profile.py --latency, one H200; not rerun on 2 GPUs): below 64 KB, where the GPU
# time saved is smaller, NCCL keeps the call.
HOST_SHOT_MIN_BYTES = 64 << 10
HOST_SHOT_BYTES = 1 << 20
HOST_SHOT_RANKS = 4  # (measured at 2 and 4 ranks; each rank reads R - 1 partials over PCIe)
HOST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KINDS = ("one-shot", "two-shot", "host one-shot")
RELEASE_SECONDS = 30.0  # abort: how long it releases barriers at most


def kind(nbytes: int, dtype: torch.dtype, road: str | None, world_size: int) -> str | None:
    """Which latency all-reduce (one of ``KINDS``, or None: none) takes a product of
    ``nbytes`` of ``dtype`` on a group of ``world_size`` ranks whose road is ``road`` ("peer":
    torch's kernels over the GPUs' mapped memory; "host": the library's through the pinned
    host buffer)."""
    if road == "host":
        fits = HOST_SHOT_MIN_BYTES < nbytes <= HOST_SHOT_BYTES and world_size <= HOST_SHOT_RANKS
        return "host one-shot" if fits and dtype in HOST_DTYPES else None
    if road != "peer" or dtype not in DTYPES or nbytes > SHOT_BYTES or nbytes % 16:
        return None  # (torch's kernels: 16-byte vectors)
    return "one-shot" if nbytes <= ONE_SHOT_BYTES else "two-shot"


def transport(kind: str) -> type[Transport]:
    """The transport class of latency all-reduce ``kind``."""
    return HostShotTransport if kind == "host one-shot" else ShotTransport


def release_writes(pads: list[int], words: int, rank: int) -> list[tuple[int, int]]:
    """``(address, value)`` of the int32 writes that release rank ``rank``'s barriers in torch's
    signal pads ``pads`` (one per rank, ``words`` flags each: block ``b``'s flag for rank
    ``q`` at ``b * R + q``): its own flags for every peer set (its waits pass), its flags in
    every peer's pad cleared (its sets pass)."""
    R = len(pads)
    writes = []
    for b in range(words // R):
        for q in range(R):
            if q != rank:
                writes.append((pads[rank] + 4 * (b * R + q), 1))
                writes.append((pads[q] + 4 * (b * R + rank), 0))
    return writes


class _Shot(Transport):
    """What both latency all-reduces keep: the buffer the matmul stores this rank's partial
    product into (``partial``) and the contexts whose caller streams issued calls
    (``callers``: ``abort`` waits for them)."""

    sized, watched = True, True

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group, self.device = group, device
        self.rank = dist.get_rank(group)
        self.buf: torch.Tensor | None = None  # (uint8, ``SHOT_BYTES`` or ``HOST_SHOT_BYTES``)
        self._views: dict[tuple, torch.Tensor] = {}
        self.callers: set = set()  # (``overlap.context.Context``s)
        # the engine's bound launches of the host one-shot, by partial (``gemm.shot.HostShot``:
        # made there, kept here so that they go with the buffers)
        self.sites: dict[torch.Tensor, object] = {}

    def partial(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """This rank's buffer as a contiguous tensor of ``shape`` (at most the buffer's
        bytes): where the matmul stores its partial product (a view made once per shape)."""
        key = (shape, dtype)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= 256:  # (one per call site's shape)
                self._views.clear()
                self.sites.clear()
            n = 1
            for d in shape:
                n *= d
            view = self.buf[: n * dtype.itemsize].view(dtype).view(shape)
            self._views[key] = view
        return view

    def close(self) -> None:
        """Free the buffers (every rank of the group closes together)."""
        self.buf = None
        self._views.clear()
        self.sites.clear()

    @property
    def nbytes(self) -> int:
        """Memory this transport holds on the GPU (the partials' buffer)."""
        return self.buf.numel() if self.buf is not None else 0


class ShotTransport(_Shot):
    """The group's symmetric buffer (``partial``) and torch's reductions (``reduce``); one
    per (group, device) of road "peer"."""

    name, road = "shot", "peer"

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        super().__init__(group, device)
        self.group_name = (group if group is not None else dist.group.WORLD).group_name
        with warnings.catch_warnings():  # needed by older torch, deprecated by newer
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(self.group_name)

        def make() -> tuple:
            buf = symm_mem.empty(SHOT_BYTES, dtype=torch.uint8, device=device)
            return buf, symm_mem.rendezvous(buf, self.group_name)

        self.buf, self.handle = kept(device, make)
        ops = torch.ops.symm_mem  # (the overloads: a packet resolves one at every call)
        self._one, self._two = ops.one_shot_all_reduce_out.default, ops.two_shot_all_reduce_.default

    def reduce(self, part: torch.Tensor, out: torch.Tensor, two_shot: bool) -> None:
        """``out`` = the sum over the ranks of their ``part`` (``partial``), on the current
        stream."""
        if two_shot:  # (in place, then a copy: 2-3 us faster than two_shot_all_reduce_out at
            self._two(part, "sum", self.group_name)  # 1-4 MB, 2 H200s)
            out.copy_(part)
        elif out.data_ptr() % 16:  # (the kernel stores 16-byte vectors into its output)
            whole = torch.empty_like(out)
            self._one(part, "sum", self.group_name, whole)
            out.copy_(whole)
        else:
            self._one(part, "sum", self.group_name, out)

    def abort(self) -> None:
        """Release this rank's barriers in torch's kernels (module docstring): the writes of
        ``release_writes`` by stream writes on a side stream, round after round, until the
        work queued so far on every stream that issued calls here has ended."""
        pads = [int(a) for a in self.handle.signal_pad_ptrs]
        writes = release_writes(pads, self.handle.signal_pad_size // 4, self.rank)
        ends = []
        for ctx in tuple(self.callers):  # (a caller's thread may add one meanwhile)
            ends.append(torch.cuda.Event())
            ends[-1].record(ctx.caller)
        side = torch.cuda.Stream(self.device)
        deadline = time.monotonic() + RELEASE_SECONDS
        while True:
            q = StreamOps(side.cuda_stream)
            for addr, value in writes:
                q.write(addr, value)
            q.flush()
            side.synchronize()
            if all(e.query() for e in ends) or time.monotonic() > deadline:
                return
            time.sleep(0.001)

    def close(self) -> None:
        """Free the symmetric buffer (every rank of the group closes together)."""
        super().close()
        self.handle = None


class HostShotTransport(_Shot):
    """The latency all-reduce without P2P (``gemm/shot.py``): the group's pinned host buffer
    (every rank's region: flags, abort word, two slots of ``HOST_SHOT_BYTES``), this rank's
    device buffer for its partial (``partial``) and its counts of calls (``state``); one per
    (group, device) of road "host". The engine launches the kernel with ``regions``,
    ``state``, ``slot_bytes`` and ``rank`` (no Triton in ``comm``)."""

    name, road = "host-shot", "host"

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        super().__init__(group, device)
        self._lock = threading.Lock()
        R = dist.get_world_size(group)
        self.slot_bytes = HOST_SHOT_BYTES
        region = -(-shot_region_bytes(self.slot_bytes) // 4096) * 4096  # (page-aligned)
        self.region = region
        self.mapping, base = map_shared(group, self.rank, region * R, ("host-shot", region))
        addresses = [base + q * region for q in range(R)]
        self.regions = kept(device, lambda: torch.tensor(addresses, dtype=torch.int64,
                                                         device=device))  # fmt: skip
        self.state = kept(device, lambda: torch.zeros(SHOT_STATE, dtype=torch.int32,
                                                      device=device))  # fmt: skip
        self.buf = kept(device, lambda: torch.empty(HOST_SHOT_BYTES, dtype=torch.uint8,
                                                    device=device))  # fmt: skip

    def abort(self) -> None:
        """Set this rank's abort word in host memory (a host store: no stream needed): every
        wait of its kernels ends, queued calls too (their results are garbage; they store and
        publish nothing, ``gemm/shot.py``)."""
        with self._lock:  # (the watchdog's thread; ``close`` may run in the caller's)
            if self.mapping:
                host = self.mapping[2] + self.rank * self.region + SHOT_ABORT
                ctypes.c_int32.from_address(host).value = 1

    def close(self) -> None:
        """Unmap the host buffer and free the device buffers."""
        super().close()
        with self._lock:
            if self.mapping:
                unmap(self.mapping)
            self.mapping = None
        self.regions = self.state = None

    @property
    def nbytes(self) -> int:
        """Memory this transport holds: the host buffer (every rank's region) and the
        partials' buffer on the GPU."""
        return super().nbytes + (self.mapping[3] if self.mapping is not None else 0)
