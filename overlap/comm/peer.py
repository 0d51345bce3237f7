"""Copy-engine transport (``backend="ce"``) for ranks whose GPUs map each other's memory.

NCCL's collectives run as kernels: while the GEMM runs they take SMs from it and each chunk's
collective took ~1.8x its time alone (2x H200, the timeline tool). Here chunks are *pushed* by the
GPU's copy engines (``cuMemcpyAsync`` into torch symmetric-memory mappings of the peers'
buffers, which uses no SM), and the reduction happens in the GEMM's own epilogue.

The plan is *blocked* (``make_plan(blocked=True)``): the standard row layout in ``R * b`` equal
row bands, ``b`` per rank block of ``B = M / R`` rows. Rank ``r`` launches the bands starting
at block ``r + 1`` so that its own block comes last (``overlap/contract.py``: the launch
order, the flag layout and the kernel's ``Epilogue``):

- a band of block ``d != r`` is stored in the slot buffer and, once its counter is reached,
  pushed into rank ``d``'s receive slot ``r``; then the flag ``ARRIVED[r][k]`` (band ``k`` of
  the block) on rank ``d`` is set;
- a tile of block ``r`` waits (in the kernel) for every peer's ``ARRIVED`` flag of its band,
  adds their partials from the receive slots and stores the sum straight into ``out``. The
  peers computed this block first, so their pushes landed long before (no wait in practice).

Per collective: reduce-scatter ends there. All-reduce also pushes each reduced band of its
own block (from ``out``) into every peer's *gather* slot ``r`` and flags it (``GATHERED``);
each rank copies the bands it is sent from its gather slots into ``out``, band by band, as
their flags arrive. All-to-all adds nothing (own block stored as is) and copies its receive
slots into ``out`` the same way. Those copies are local copy-engine copies on the
communication stream, so no reduction or copy kernel runs after the GEMM. Data moved per
rank: as NCCL's ring, (R - 1) / R of the product for reduce-scatter and all-to-all,
2 (R - 1) / R for all-reduce.

Buffer per rank (symmetric memory): flags (``contract.FlagLayout``: ``READY[R]``,
``ARRIVED[R][b]``, ``GATHERED[R][b]``), then receive slots ``[R, B, N]``, then (all-reduce)
gather slots ``[R, B, N]``. Flags are set (``contract.SET``) by peers with stream memory
writes (which fence the stream's earlier copies) and awaited with stream waits (GEQ) or, in
the kernel, with acquire loads; the waits and writes between two copies of a stream go out as
one ``cuStreamBatchMemOp`` (``signal.wait.StreamOps``: in a CUDA graph each batch is a node,
and such nodes cost host time at every replay). They are one-shot, so
every call issues the same operations with the same values and a CUDA graph can replay them.
A call begins (``_handshake``) by zeroing this rank's ARRIVED and GATHERED flags (one copy
from a zeroed buffer: everything the previous call waited for has been seen, since this
stream's previous call is finished), then sets ``READY`` on every peer and waits for theirs,
zeroing each once seen. So no buffer or flag is written before its owner has finished the
previous call (which ended when its kernel had read the receive slots and its copies had
read the gather slots), and a peer's READY for the next call cannot come before its zeroing
(the peer first needs this call's pushes, issued after it). Nothing on the communication
stream needs an SM: the kernel's waiting tiles could otherwise hold every SM while the push
they wait for queued behind a kernel.

Needs: CUDA, torch symmetric memory, cuda-python, P2P access between all ranks' GPUs
(``route``; ranks of one host without P2P go through host memory instead, ``host.py``).
Column-band plans use NCCL (``comm.select``). One transport per (group, device), shared
by the contexts of every caller stream (``overlap/context.py``), so that a call captured in a
CUDA graph uses the buffer an eager call sized: a capture cannot allocate symmetric memory.

Hazard: never put SM work on the communication stream of this transport (a timestamp kernel
there hung both GPUs once): the GEMM's own tiles spin in their epilogue until the peers'
pushes arrive, so they may hold every SM while a kernel queued behind a push waits for one.
"""

from __future__ import annotations

import functools
import os
import socket
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..contract import FLAGS_BYTES, SET, Epilogue, FlagLayout, band_launched, kernel_flags_start
from ..plan import Plan
from ..signal.wait import StreamOps, method
from .transport import Transport, kept, same_need

_ALIGN = 2 << 20
_layout = functools.lru_cache(maxsize=64)(FlagLayout)  # made once per (R, b): host time


def route(group: dist.ProcessGroup | None, device: torch.device) -> str | None:
    """How the copy-engine transport can reach every rank of ``group`` from ``device``:
    ``"peer"`` (one host, P2P access between all the GPUs, and NCCL's P2P not disabled by the
    user: ``NCCL_P2P_DISABLE=1`` is read as "no P2P here"), ``"host"`` (one host without
    that: through pinned shared host memory, ``host.py``) or None (several hosts, no CUDA,
    or no stream memory operations). A collective: every rank gets the same answer."""
    usable = device.type == "cuda" and method() == "stream_wait"
    uuid = str(torch.cuda.get_device_properties(device).uuid) if usable else ""
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (socket.gethostname(), uuid, usable), group=group)
    if not all(u for _, _, u in everyone) or len({h for h, _, _ in everyone}) != 1:
        return None
    visible = {
        str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())
    }
    local = [visible.get(u) for _, u, _ in everyone]
    me = device.index if device.index is not None else torch.cuda.current_device()
    able = os.environ.get("NCCL_P2P_DISABLE", "0") != "1" and all(
        i is not None and (i == me or torch.cuda.can_device_access_peer(me, i)) for i in local
    )
    verdicts: list = [None] * len(everyone)
    dist.all_gather_object(verdicts, able, group=group)
    return "peer" if all(verdicts) else "host"


def slot_bytes(p: Plan, dtype: torch.dtype) -> int:
    """Bytes of the slots one rank receives into: ``[R, B, N]`` receive slots, and as many
    gather slots for all-reduce."""
    return need_bytes(p.M, p.N, p.K, p.spec, dtype)


def need_bytes(M: int, N: int, K: int, spec, dtype: torch.dtype) -> int:
    """Bytes of data a call needs in the buffer: the slots (``slot_bytes``), or the
    all-gather's gathered input ``[M, K]``."""
    if spec.before:
        return M * K * dtype.itemsize
    return (2 if spec.replicated else 1) * M * N * dtype.itemsize


def _width(p: Plan) -> int:
    """Elements per slot row: the product's ``N``, or the all-gather's ``K`` (its input)."""
    return p.K if p.spec.before else p.N


def receive_slots(buf: torch.Tensor, p: Plan, dtype: torch.dtype) -> torch.Tensor:
    """The receive slots ``[R, B, N]`` at the start of the uint8 tensor ``buf``."""
    return buf[: p.M * p.N * dtype.itemsize].view(dtype).view(p.world_size, -1, p.N)


class PeerTransport(Transport):
    """Copy-engine pushes into symmetric-memory receive buffers; one per (group, device)."""

    name, blocked, column_bands, road, sized, recorded = "ce", True, False, "peer", True, True
    watched, covers = True, False
    a2a_in_place = True  # all-to-all may use `out`'s peer blocks as scratch (run's order)

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group, self.device = group, device
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.zeros = kept(device, lambda: torch.zeros(FLAGS_BYTES, dtype=torch.uint8,
                                                      device=device))  # _clear's  # fmt: skip
        self.buf: torch.Tensor | None = None  # uint8, local view of the symmetric buffer
        self.ptrs: list[int] = []  # every rank's buffer, mapped here
        self._views: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # _prepare's

    # -- buffer ------------------------------------------------------------------------------
    def _ensure(self, nbytes: int) -> None:
        """A buffer of at least ``nbytes`` of data on every rank (a collective when it grows)."""
        if self.buf is not None and self.buf.numel() >= FLAGS_BYTES + nbytes:
            return
        from torch.distributed import _symmetric_memory as symm_mem

        same_need(self.group, nbytes)  # (ranks that disagree raise here, not in the mapping)
        if self.buf is not None:
            # No work of ours uses the old buffer any more, and the peers' pushes into it ended
            # before the kernel or the copies that waited for their flags.
            torch.cuda.synchronize(self.device)
        size = -(-(FLAGS_BYTES + nbytes) // _ALIGN) * _ALIGN
        group = self.group if self.group is not None else dist.group.WORLD
        with warnings.catch_warnings():  # needed by older torch, deprecated by newer
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(group.group_name)
        buf = symm_mem.empty(size, dtype=torch.uint8, device=self.device)
        handle = symm_mem.rendezvous(buf, group.group_name)
        buf[:FLAGS_BYTES].zero_()  # no flag set
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # every rank's flags are zero before anyone writes
        self.buf, self.handle = buf, handle
        self.generation += 1
        self._views.clear()  # they would keep the old buffer alive
        self.ptrs = [int(a) for a in handle.buffer_ptrs]

    @property
    def nbytes(self) -> int:
        """Memory this transport holds (the symmetric buffer on this GPU)."""
        return self.buf.numel() if self.buf is not None else 0

    def _flag(self, rank: int, index: int) -> int:
        """Address (mapped here) of int32 flag ``index`` on ``rank``."""
        return self.ptrs[rank] + 4 * index

    # -- one call ----------------------------------------------------------------------------
    def _prepare(self, p: Plan, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers sized for ``p``; returns what the kernel reads: this rank's receive slots
        ``[R, B, N]`` and its ARRIVED flags (views made once per buffer, plan and dtype)."""
        self._ensure(slot_bytes(p, dtype))
        key = (self.buf.data_ptr(), p, dtype)
        if key not in self._views:
            if len(self._views) >= 256:  # one entry per plan: varying M would grow it
                self._views.clear()
            start = kernel_flags_start(self.size)
            flags = self.buf[:FLAGS_BYTES].view(torch.int32)[start:]
            self._views[key] = receive_slots(self.buf[FLAGS_BYTES:], p, dtype), flags
        return self._views[key]

    def _usable(self, p: Plan) -> None:
        _layout(self.size, p.bands_per_block).check()

    def fits(self, M: int, N: int, K: int, spec, dtype: torch.dtype) -> bool:
        """Whether the call needs no bigger buffer (growing one is a collective and
        synchronizes the device, which a CUDA-graph capture cannot do)."""
        need = need_bytes(M, N, K, spec, dtype)
        return self.buf is not None and self.buf.numel() >= FLAGS_BYTES + need

    def begin(
        self, p: Plan, out: torch.Tensor, caller: torch.cuda.Stream
    ) -> tuple[torch.Tensor, Epilogue]:
        """Before the GEMM launches (on the host): size the buffers and zero this rank's
        flags on ``caller`` (``_clear``); the slot buffer (``out`` itself where its peer
        blocks may serve as scratch) and the kernel's ``Epilogue`` for the blocked plan
        ``p``."""
        self._usable(p)
        recv, flags = self._prepare(p, out.dtype)
        self._clear(StreamOps(caller.cuda_stream))
        if p.spec.replicated or (self.a2a_in_place and not p.spec.reduces):
            # the peers' blocks of `out` are scratch until their own data arrives
            slots = out.view(-1)
        else:
            slots = torch.empty(p.M * p.N, dtype=out.dtype, device=out.device)
        return slots, Epilogue(out, recv, flags, self.rank)

    def _slot(self, rank: int, region: int, s: int, k: int, p: Plan, es: int) -> int:
        """Address (mapped here) of band ``k`` of slot ``s`` in ``rank``'s slot region
        ``region`` (0 receive, 1 gather), each ``[R, B, width]`` (``_width``)."""
        row = region * p.M + s * (p.M // self.size) + k * p.run_rows
        return self.ptrs[rank] + FLAGS_BYTES + row * _width(p) * es

    def _receive(self, p: Plan, out, k: int, q: StreamOps, into_recv: int = 0, es: int = 0):
        """Band ``k`` of this rank's block from every peer, on ``q``'s stream, once its flag
        is here: into ``out``'s block s (all-to-all: the receive slot; all-reduce with
        ``into_recv`` 0: the gather slot), or (``into_recv``, a device address of receive
        slots; ``es`` the element size) into the device receive slot, then the kernel's flag
        for it (``HostTransport``; the all-gather's shards too)."""
        R, r, es, width = self.size, self.rank, es or out.element_size(), _width(p)
        flags = _layout(R, p.bands_per_block)
        band, B = p.run_rows * width * es, p.M // R
        gather = p.spec.replicated and not into_recv
        dst0 = into_recv or out.data_ptr()
        for s in ((r + j) % R for j in range(1, R)):
            q.wait(self._flag(r, flags.gathered(s, k) if gather else flags.arrived(s, k)), SET)
            dst = dst0 + (s * B + k * p.run_rows) * width * es
            q.copy(dst, self._slot(r, int(gather), s, k, p, es), band)
            if into_recv:
                q.write(self.kernel_flag(flags.kernel_index(s, k)), SET)

    def _clear(self, q: StreamOps) -> None:
        """Zero this rank's flags but READY, on the caller's stream (``q``'s) before the
        call's other work (the module docstring says why that is safe)."""
        R = self.size
        q.copy(self._flag(self.rank, R), self.zeros.data_ptr(), FLAGS_BYTES - 4 * R)

    def _handshake(self, q: StreamOps, flags: FlagLayout) -> list[int]:
        """On ``q``'s stream: READY to every peer (this rank's buffer may be written), then
        wait for theirs, zeroing each; returns the peers in push order."""
        R, r = self.size, self.rank
        peers = [(r + j) % R for j in range(1, R)]
        for d in peers:
            q.write(self._flag(d, flags.ready(r)), SET)
        for s in peers:
            q.wait(self._flag(r, flags.ready(s)), SET)
            q.write(self._flag(r, flags.ready(s)), 0)
        return peers

    def _send(self, p: Plan, slots: torch.Tensor, out: torch.Tensor, wait, q: StreamOps, own):
        """On ``q``'s stream: READY to every peer and wait for theirs; then per band ``a`` in
        the order the kernel launches them (block ``d``, band ``k`` in it), after
        ``wait(c, q)``: ``d != r``: push it into rank d's receive slot r and set
        ARRIVED[r][k] there; ``d == r``, all-reduce: push the reduced band from ``out`` into
        every peer's gather slot r and set GATHERED[r][k] there; then ``own(k)`` if given.
        A flag write and the next wait go out as one batch (``StreamOps``)."""
        R, r, b, es = self.size, self.rank, p.bands_per_block, slots.element_size()
        flags = _layout(R, b)
        band = p.run_rows * p.N * es  # bytes
        peers = self._handshake(q, flags)
        for c in range(p.n_row_bands):
            a = band_launched(p, r, c)
            d, k = divmod(a, b)
            if d != r:
                wait(c, q)
                q.copy(self._slot(d, 0, r, k, p, es), slots.data_ptr() + a * band, band)
                q.write(self._flag(d, flags.arrived(r, k)), SET)
                continue
            if p.spec.replicated:
                wait(c, q)
                for e in peers:
                    q.copy(self._slot(e, 1, r, k, p, es), out.data_ptr() + a * band, band)
                    q.write(self._flag(e, flags.gathered(r, k)), SET)
            if own is not None:
                own(k)

    def run(
        self,
        p: Plan,
        slots: torch.Tensor,
        out: torch.Tensor,
        wait: Callable[..., None],
        stream: torch.cuda.Stream,
    ) -> None:
        """All of it on ``stream`` (the communication stream; it need not be current):
        ``_send``, and after each own band (all-reduce, all-to-all) the peers' bands of it
        copied into ``out`` as their flags arrive (``_receive``). Reduce-scatter receives
        nothing here: the kernel reads the receive slots. Every copy is a copy engine's; the
        caller waits for ``stream``."""
        q, own = StreamOps(stream.cuda_stream), None
        if not p.spec.scatters:  # every rank's rows come back into `out`
            own = lambda k: self._receive(p, out, k, q)  # noqa: E731
        self._send(p, slots, out, wait, q, own)
        q.flush()

    def gather(
        self, p: Plan, x: torch.Tensor, stream: torch.cuda.Stream, caller: torch.cuda.Stream
    ) -> torch.Tensor:
        """The all-gather (blocked plan ``p``): this rank's flags zeroed on ``caller``, which
        ``stream`` then waits for; READY to every peer and wait for theirs; then band ``k``
        of the shard ``x`` pushed into every peer's receive slot ``r`` (standard layout
        ``[R, M / R, K]``, so the gathered rows land where ``x_full`` has them), each
        followed by ARRIVED[r][k] there, for ``k`` in order. Returns the receive slots as
        ``[M, K]`` (this rank's own rows are not written)."""
        self._usable(p)
        R, r, b, es = self.size, self.rank, p.bands_per_block, x.element_size()
        self._ensure(p.M * p.K * es)
        self._clear(StreamOps(caller.cuda_stream))
        stream.wait_stream(caller)  # the flags are zero and the shard ready before it starts
        buf = self._gathered(p, x.dtype, stream)
        flags, band = _layout(R, b), p.run_rows * p.K * es
        q = StreamOps(stream.cuda_stream)
        peers = self._handshake(q, flags)
        for k in range(b):
            for d in peers:
                q.copy(self._slot(d, 0, r, k, p, es), x.data_ptr() + k * band, band)
                q.write(self._flag(d, flags.arrived(r, k)), SET)
        q.flush()
        return buf

    def _gathered(self, p: Plan, dtype: torch.dtype, stream: torch.cuda.Stream) -> torch.Tensor:
        """Where the shards arrive: this rank's receive slots, ``[M, K]``."""
        n = p.M * p.K * dtype.itemsize
        return self.buf[FLAGS_BYTES : FLAGS_BYTES + n].view(dtype).view(p.M, p.K)

    def arrived(self, p: Plan, chunks: tuple[int, ...], stream: torch.cuda.Stream) -> None:
        """The caller's ``stream`` waits for ``chunks`` (chunk ``c = s b + k``: band ``k`` of
        rank ``s``'s shard) on the kernel's flags for them (one batch; no SM used)."""
        q, flags = StreamOps(stream.cuda_stream), _layout(self.size, p.bands_per_block)
        for c in chunks:
            s, k = divmod(c, p.bands_per_block)
            if s != self.rank:
                q.wait(self.kernel_flag(flags.kernel_index(s, k)), SET)
        q.flush()

    def kernel_flag(self, index: int) -> int:
        """Address of the kernel's flag ``index`` (``FlagLayout.kernel_index``) here."""
        return self._flag(self.rank, kernel_flags_start(self.size) + index)

    def _local_flags(self) -> list[int]:
        """Addresses of every flag this rank waits on (``abort``)."""
        return [self._flag(self.rank, i) for i in range(FLAGS_BYTES // 4)] if self.ptrs else []

    def abort(self) -> None:
        """Release this rank's waits on its peers (``fail``): every local flag is set by
        stream memory writes on a side stream (no SM: a GEMM waiting in its epilogue may hold
        them all)."""
        side = torch.cuda.Stream(self.device)
        q = StreamOps(side.cuda_stream)
        for addr in self._local_flags():
            q.write(addr, SET)
        q.flush()
        side.synchronize()

    def close(self) -> None:
        """Free the symmetric buffer (every rank of the group closes together)."""
        self.buf = self.handle = None
        self.ptrs = []
        self._views.clear()
