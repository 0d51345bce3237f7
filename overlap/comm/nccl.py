"""NCCL per chunk: one collective per chunk on the communication stream. Works on any GPUs
NCCL drives, across hosts, and inside CUDA graphs.

Buffers (``plan`` names the layout, see ``overlap.plan``):

=================  ===========================  ==========================================
collective         GEMM writes (``slots``)      each chunk's result goes to
=================  ===========================  ==========================================
all_reduce         ``out`` itself (row bands)   in place
                   or a slot buffer (columns)   in place, then copied into ``out``
reduce_scatter     slot buffer ``[M * N]``      ``out[M / R, N]`` rows of the chunk
                                                (through ``recv`` for column bands)
all_to_all         slot buffer ``[M * N]``      ``out[M, N]`` viewed ``[R, M / R, N]``
                                                (through ``recv`` for column bands)
all_gather         (the input: ``gather``)      ``[M, K]`` in slots ``[R, rows, K]`` per
                                                chunk; an event per chunk on CUDA
=================  ===========================  ==========================================

Communicators:

- ``TorchComm``: the caller's ``torch.distributed`` group as it is. Collectives are issued with
  ``async_op=False`` while the communication stream is current, so ProcessGroupNCCL runs them on
  that stream (torch >= 2.6) and gloo runs them on the host.
- ``CupyComm``: a direct NCCL communicator (CuPy's binding) bootstrapped once from the group
  (rank 0's unique id is broadcast through it). It issues ``ncclAllReduce`` etc. on the current
  stream with no torch bookkeeping per call.

Sum is the only reduction: ``op="avg"`` is folded into the GEMM as a ``1 / R`` scale.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..collectives import all_gather, reduce_scatter
from ..plan import Plan, band_rows
from ..signal import current_raw_stream
from .transport import Transport, kept


class TorchComm:
    """Collectives through a ``torch.distributed`` process group."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        # gloo has no list all-to-all of CUDA tensors: it takes one all_to_all_single there
        self.single = dist.get_backend(group) == "gloo"

    def all_reduce(self, buf: torch.Tensor) -> None:
        """In-place sum of ``buf`` (contiguous) over the group."""
        dist.all_reduce(buf, group=self.group)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """``out`` (``n``) = this rank's ``n`` elements of the sum of ``inp`` (``R * n``)."""
        reduce_scatter(out, inp, self.group)

    def all_to_all(self, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> None:
        """Send ``ins[j]`` to rank ``j``; receive rank ``j``'s piece into ``outs[j]`` (1-D
        pieces; on gloo through two staging buffers and ``all_to_all_single``)."""
        if not self.single:
            dist.all_to_all(outs, ins, group=self.group)
            return
        sizes = [o.numel() for o in outs]
        got = outs[0].new_empty(sum(sizes))
        dist.all_to_all_single(got, torch.cat(ins), sizes, [i.numel() for i in ins],
                               group=self.group)  # fmt: skip
        for o, piece in zip(outs, got.split(sizes), strict=True):
            o.copy_(piece)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """``out`` (``R * n``, contiguous) = every rank's ``inp`` (``n``), in rank order."""
        all_gather(out, inp, self.group)

    def all_to_all_v(self, out, inp, out_rows: list[int], in_rows: list[int]) -> None:
        """``inp``'s consecutive blocks of ``in_rows[j]`` rows to rank ``j``; rank ``s``'s block
        for this rank into ``out``'s consecutive blocks of ``out_rows[s]`` rows (both
        contiguous ``[rows, N]``)."""
        dist.all_to_all_single(out, inp, out_rows, in_rows, group=self.group)

    def abort(self) -> None:
        """Abort the group's NCCL communicators (releases kernels stuck on a dead peer)."""
        dist.distributed_c10d._abort_process_group(self.group)


_NCCL_DTYPES = {torch.float16: 6, torch.float32: 7, torch.bfloat16: 9}  # ncclDataType_t
_NCCL_SUM = 0


class CupyComm:
    """Collectives through a direct NCCL communicator (``cupy.cuda.nccl``)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        try:
            from cupy.cuda import nccl  # optional dependency: imported only when asked for
        except ImportError as e:
            raise ImportError(
                "backend='cupy' needs CuPy: pip install 'overlap[cupy]' (or use backend='torch')"
            ) from e

        self._nccl = nccl
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        uid = [nccl.get_unique_id() if rank == 0 else None]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(uid, src=src, group=group)
        self.comm = nccl.NcclCommunicator(size, uid[0], rank)
        self.size = size

    def all_reduce(self, buf: torch.Tensor) -> None:
        p, s = buf.data_ptr(), current_raw_stream(buf.device)
        self.comm.allReduce(p, p, buf.numel(), _NCCL_DTYPES[buf.dtype], _NCCL_SUM, s)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.comm.reduceScatter(
            inp.data_ptr(),
            out.data_ptr(),
            out.numel(),
            _NCCL_DTYPES[out.dtype],
            _NCCL_SUM,
            current_raw_stream(out.device),
        )

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        s, dt = current_raw_stream(inp.device), _NCCL_DTYPES[inp.dtype]
        self.comm.allGather(inp.data_ptr(), out.data_ptr(), inp.numel(), dt, s)

    def all_to_all_v(self, out, inp, out_rows: list[int], in_rows: list[int]) -> None:
        s, nccl = current_raw_stream(inp.device), self._nccl
        dt, row = _NCCL_DTYPES[inp.dtype], inp.shape[1] * inp.element_size()
        nccl.groupStart()
        for peer in range(self.size):
            i0, o0 = sum(in_rows[:peer]), sum(out_rows[:peer])
            n_in, n_out = in_rows[peer] * inp.shape[1], out_rows[peer] * inp.shape[1]
            self.comm.send(inp.data_ptr() + i0 * row, n_in, dt, peer, s)
            self.comm.recv(out.data_ptr() + o0 * row, n_out, dt, peer, s)
        nccl.groupEnd()

    def all_to_all(self, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> None:
        s, nccl = current_raw_stream(ins[0].device), self._nccl
        nccl.groupStart()
        for peer in range(self.size):
            dt = _NCCL_DTYPES[ins[peer].dtype]
            self.comm.send(ins[peer].data_ptr(), ins[peer].numel(), dt, peer, s)
            self.comm.recv(outs[peer].data_ptr(), outs[peer].numel(), dt, peer, s)
        nccl.groupEnd()

    def abort(self) -> None:
        """Abort this NCCL communicator (releases kernels stuck on a dead peer)."""
        self.comm.abort()


class NcclTransport(Transport):
    """One collective per chunk through a communicator (``comm_type``: ``TorchComm`` or
    ``CupyComm``), made once per (group, device) and shared by every context of them (a CUDA
    graph captures on a stream of its own, and a communicator cannot be made during
    capture); a transport per context (its events are its stream's)."""

    comm_type: type = TorchComm
    uneven = True

    def __init__(self, comm: TorchComm | CupyComm, group, device: torch.device) -> None:
        self.comm, self.group, self.device = comm, group, device
        self._events: list[torch.cuda.Event] = []  # one per chunk (`events`)
        self._orders: dict[tuple, torch.Tensor] = {}  # run_splits' row orders

    def gather(
        self,
        plan: Plan,
        x: torch.Tensor,
        stream: torch.cuda.Stream | None,
        caller: torch.cuda.Stream | None,
    ) -> torch.Tensor:
        """One ``all_gather_into_tensor`` per chunk into its slot (``[R, rows, K]``: the
        chunk's rows of every shard, in rank order); on CUDA an event recorded after each."""
        buf = x.new_empty(plan.M, plan.K)
        R = plan.world_size
        if stream is None:  # CPU: gloo runs on the host
            for c in range(plan.n_chunks):
                self._gather_chunk(plan, c, x, buf, R)
            return buf
        stream.wait_stream(caller)  # the shard is ready before `stream` reads it
        events = self.events(plan.n_chunks)
        with torch.cuda.stream(stream):  # NCCL issues on the current stream
            for c in range(plan.n_chunks):
                self._gather_chunk(plan, c, x, buf, R)
                events[c].record(stream)
        return buf

    def events(self, n: int) -> list[torch.cuda.Event]:
        """At least ``n`` CUDA events, one per chunk, made once and reused by every call of
        this context (the all-gather's arrivals, the uneven exchanges' chunks)."""
        while len(self._events) < n:
            self._events.append(torch.cuda.Event())
        return self._events

    def _gather_chunk(self, plan: Plan, c: int, x: torch.Tensor, buf: torch.Tensor, R: int):
        _, rows, _, row0, _ = plan.chunk_slot(c)
        self.comm.all_gather(buf[row0 : row0 + rows], x[row0 // R : (row0 + rows) // R])

    def arrived(
        self, plan: Plan, chunks: tuple[int, ...], stream: torch.cuda.Stream | None
    ) -> None:
        if stream is not None:
            for c in chunks:
                stream.wait_event(self._events[c])

    def run_splits(
        self,
        plan: Plan,
        send: torch.Tensor,
        recv: torch.Tensor,
        wait: Callable[[int], None],
        mark: Callable[[int], None],
        stream: torch.cuda.Stream | None,
        layout: list | None = None,
    ) -> None:
        """An uneven all-to-all (``make_split_plan``) on ``stream``, chunk by chunk: ``send``
        and ``recv`` hold their rows in the chunk-major slot layouts of ``plan.band_rows``
        (of the sends and of the receives), so chunk ``c`` (band ``c`` of every block) is one
        ``all_to_all_single`` (gloo's list all-to-all takes equal sizes only, so views of
        standard-layout tensors cannot be sent as they are); ``wait(c)`` before it,
        ``mark(c)`` after it, both on ``stream``. ``layout`` replaces ``band_rows``' chunks:
        per chunk ``(rows received from each rank, rows sent to each)``, consecutive."""
        n = plan.n_chunks
        if layout is None:
            sends, receives = (band_rows(s, n) for s in plan.splits)
            layout = [([s.stop - s.start for _, s in receives[c]],
                       [s.stop - s.start for _, s in sends[c]]) for c in range(n)]  # fmt: skip
        at_in = at_out = 0
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for c, (out_rows, in_rows) in enumerate(layout):
                wait(c)
                n_in, n_out = sum(in_rows), sum(out_rows)
                self.comm.all_to_all_v(recv[at_out : at_out + n_out], send[at_in : at_in + n_in],
                                       out_rows, in_rows)  # fmt: skip
                at_in, at_out = at_in + n_in, at_out + n_out
                mark(c)

    def order(self, splits: tuple[int, ...], n: int, device, to_slots: bool) -> torch.Tensor:
        """``Transport.order``, made once per splits and device."""
        key = (splits, n, str(device), to_slots)
        if key not in self._orders:
            if len(self._orders) >= 8:  # routing changes every step in MoE: keep a few
                self._orders.clear()
            order = torch.empty(sum(splits), dtype=torch.long)
            for row in band_rows(splits, n):
                for std, slot in row:
                    a, b = (slot, std) if to_slots else (std, slot)
                    order[a] = torch.arange(b.start, b.stop)
            self._orders[key] = kept(torch.device(device), lambda: order.to(device))
        return self._orders[key]

    def begin(
        self, plan: Plan, out: torch.Tensor, caller: torch.cuda.Stream | None
    ) -> tuple[torch.Tensor, None]:
        if plan.spec.replicated and plan.n_col_bands == 1:
            return out.view(-1), None  # row bands of the standard layout are contiguous
        return torch.empty(plan.M * plan.N, dtype=out.dtype, device=out.device), None

    def run(
        self,
        plan: Plan,
        slots: torch.Tensor,
        out: torch.Tensor,
        wait: Callable[[int], None],
        stream: torch.cuda.Stream | None,
    ) -> None:
        recv = None
        if not plan.spec.replicated and plan.n_col_bands > 1:
            recv = torch.empty(out.numel(), dtype=out.dtype, device=out.device)
        if stream is None:  # CPU: the kernel already ran; gloo runs on the host
            _chunks(plan, self.comm, slots, out, recv, wait)
            return
        with torch.cuda.stream(stream):  # NCCL issues on the current stream
            _chunks(plan, self.comm, slots, out, recv, wait)

    def abort(self) -> None:
        self.comm.abort()


class TorchTransport(NcclTransport):
    """NCCL per chunk through the group's own ``torch.distributed`` backend (gloo on CPU)."""

    name = "torch"


class CupyTransport(NcclTransport):
    """NCCL per chunk through a direct NCCL communicator (CuPy's binding)."""

    name, comm_type, watched = "cupy", CupyComm, True


def _chunks(
    plan: Plan,
    comm: TorchComm | CupyComm,
    slots: torch.Tensor,
    out: torch.Tensor,
    recv: torch.Tensor | None,
    wait: Callable[[int], None],
) -> None:
    """The collective of every chunk of ``plan`` in chunk order on the current stream, each
    after ``wait(c)``. ``recv``: receive slots for column-band reduce-scatter
    (``[M / R * N]``) and all-to-all (``[M * N]``); None otherwise."""
    R, N = plan.world_size, plan.N
    spec = plan.spec
    in_place = plan.n_col_bands == 1  # results land directly in `out`
    for c in range(plan.n_chunks):
        off, rows, cols, row0, col0 = plan.chunk_slot(c)
        slot = slots[off : off + rows * cols]
        wait(c)
        if spec.replicated:
            comm.all_reduce(slot)
            if not in_place:
                out[row0 : row0 + rows, col0 : col0 + cols].copy_(slot.view(rows, cols))
            continue
        h_a = rows // R  # rows of each rank's block in this chunk
        r0 = row0 // R  # first of them, within the rank's block
        if spec.reduces:
            if in_place:
                comm.reduce_scatter(out[r0 : r0 + h_a].view(-1), slot)
            else:
                part = recv[off // R : off // R + h_a * cols]
                comm.reduce_scatter(part, slot)
                out[r0 : r0 + h_a, col0 : col0 + cols].copy_(part.view(h_a, cols))
        else:
            out3 = out.view(R, -1, N)
            if in_place:
                comm.all_to_all(
                    [out3[s, r0 : r0 + h_a].view(-1) for s in range(R)], list(slot.chunk(R))
                )
            else:
                part = recv[off : off + rows * cols]
                comm.all_to_all(list(part.chunk(R)), list(slot.chunk(R)))
                out3[:, r0 : r0 + h_a, col0 : col0 + cols].copy_(part.view(R, h_a, cols))
