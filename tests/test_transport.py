"""No devices: the copy-engine transports (``overlap/comm/peer.py``, ``host.py``) and the real
fused GEMM kernel (Triton's interpreter) on simulated ranks.

The transports run unchanged against a fake CUDA driver that records every copy, flag write
and flag wait per stream; CPU tensors stand for GPU memory (a copy is a ``memmove`` between
their addresses). Each rank's caller stream holds its kernel launches: when a launch is
reached, the real ``chunked_matmul`` runs in a thread of its own, one tile at a time. A
scheduler hands the turn around: after every tile of every kernel, and after every poll of a
flag by a waiting tile, the copy and flag streams run as far as their waits allow, so a copy
issued before its chunk's counter is reached reads half a band, and a kernel and a transport
that disagree on the launch order (``overlap/contract.py``) deadlock or add the wrong
partials. One rank can run ahead of the others (``ahead``), and every rank issues two calls
before anything runs, so the second call of a fast rank meets the first call of a slow one:
that exercises the handshake (``ready`` flags) that keeps a call from overwriting buffers the
previous one still reads, and the zeroing of the one-shot flags: both calls issue the same
operations with the same values, as a CUDA graph's replays do, so a flag zeroed too late lets
the second call read a band early, and one zeroed too early deadlocks. Results are checked
against float64. A wait that is never met fails as a deadlock.
"""

from __future__ import annotations

import ctypes
import threading
import types

import pytest
import torch
from triton.runtime import interpreter

from overlap.collectives import COLLECTIVES
from overlap.comm.host import HostTransport
from overlap.comm.peer import PeerTransport, slot_bytes
from overlap.contract import FLAGS_BYTES
from overlap.gemm import chunked_matmul
from overlap.plan import make_plan
from overlap.signal import wait as signal_wait


class _Stream:
    """A stream of the simulation: a name and its ops in issue order."""

    def __init__(self, sim, name):
        self.sim, self.cuda_stream = sim, name
        sim.ops[name] = []

    def wait_stream(self, other):  # later ops on self wait for other's ops issued so far
        self.sim.ops[self.cuda_stream].append(
            ("after", other.cuda_stream, len(self.sim.ops[other.cuda_stream]))
        )


class _Driver:
    """The few cuda-python driver calls the transport makes, recorded per stream (a batch of
    stream memory operations as its operations in order)."""

    class CUresult:
        CUDA_SUCCESS = 0

    class CUstreamWaitValue_flags:
        CU_STREAM_WAIT_VALUE_GEQ = 0

    class CUstreamBatchMemOpType:
        CU_STREAM_MEM_OP_WAIT_VALUE_32 = 1
        CU_STREAM_MEM_OP_WRITE_VALUE_32 = 2

    class CUstreamBatchMemOpParams:
        def __init__(self):
            self.operation = None
            self.waitValue, self.writeValue = types.SimpleNamespace(), types.SimpleNamespace()

    def __init__(self, sim):
        self.sim = sim

    @staticmethod
    def CUstream(s):  # noqa: N802 (cuda-python's names)
        return s

    @staticmethod
    def CUdeviceptr(p):  # noqa: N802
        return p

    def cuMemcpyAsync(self, dst, src, n, stream):  # noqa: N802
        self.sim.ops[stream].append(("copy", dst, src, n))
        return (0,)

    def cuStreamWriteValue32(self, stream, addr, value, flags):  # noqa: N802
        self.sim.ops[stream].append(("write", addr, value))
        self.sim.memop_calls += 1
        return (0,)

    def cuStreamWaitValue32(self, stream, addr, value, flags):  # noqa: N802
        self.sim.ops[stream].append(("wait", addr, value))
        self.sim.memop_calls += 1
        return (0,)

    def cuStreamBatchMemOp(self, stream, count, params, flags):  # noqa: N802
        assert count == len(params) and flags == 0
        for p in params:
            if p.operation == self.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_32:
                assert p.waitValue.flags == self.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
                self.sim.ops[stream].append(("wait", p.waitValue.address, p.waitValue.value))
            else:
                assert p.operation == self.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_32
                self.sim.ops[stream].append(("write", p.writeValue.address, p.writeValue.value))
        self.sim.memop_calls += 1
        return (0,)


def _u32(addr: int) -> ctypes.c_uint32:
    return ctypes.c_uint32.from_address(addr)


class _Abort(BaseException):
    """Raised in a kernel thread to end it (the simulation failed)."""


class _Kernels:
    """Real kernels in threads that take turns with the scheduler: a kernel thread runs
    until its next tile starts or a tile polls a flag, then hands the turn back."""

    def __init__(self, monkeypatch):
        self.cv = threading.Condition()
        self.turn = "main"
        self.abort = False
        self.local = threading.local()
        builder = interpreter.interpreter_builder
        real_idx, real_dim, real_rmw = (
            builder.set_grid_idx,
            builder.set_grid_dim,
            builder.create_atomic_rmw,
        )

        def set_grid_dim(*dim):
            self.local.dim = dim
            real_dim(*dim)

        def set_grid_idx(*idx):
            self._yield("tile")
            self.local.idx = idx
            real_idx(*idx)

        def create_atomic_rmw(op, ptr, val, mask, sem, scope):
            out = real_rmw(op, ptr, val, mask, sem, scope)
            if not val.data.any():  # a poll (atomic add of 0): a waiting tile
                self._yield("poll")
            return out

        monkeypatch.setattr(builder, "set_grid_dim", set_grid_dim)
        monkeypatch.setattr(builder, "set_grid_idx", set_grid_idx)
        monkeypatch.setattr(builder, "create_atomic_rmw", create_atomic_rmw)
        # Threads interleave inside kernels: triton.language is patched once per module the
        # interpreted functions use, for all threads, and restored at the end (each launch
        # would otherwise restore it when it ends, under the other kernels' feet).
        real_patch, self.scopes = interpreter._patch_lang, {}

        def patch_lang(fn):
            if id(fn.__globals__) not in self.scopes:
                self.scopes[id(fn.__globals__)] = real_patch(fn)
            return interpreter._LangPatchScope()  # restores nothing

        monkeypatch.setattr(interpreter, "_patch_lang", patch_lang)
        self.threads: dict[str, dict] = {}

    def close(self):
        """End every kernel thread (a failed simulation leaves some waiting)."""
        self.abort = True
        for name, th in self.threads.items():
            while not th["done"]:
                self._step(name)
        for scope in reversed(self.scopes.values()):
            scope.restore()

    def _yield(self, kind: str) -> None:
        me = threading.current_thread().name
        if me not in self.threads:
            return
        if self.abort:
            raise _Abort
        with self.cv:
            self.threads[me]["last"] = kind
            self.turn = "main"
            self.cv.notify_all()
            self.cv.wait_for(lambda: self.turn == me)
        if self.abort:
            raise _Abort
        builder = interpreter.interpreter_builder
        if hasattr(self.local, "idx"):  # another kernel ran meanwhile: this one's grid again
            builder.grid_dim, builder.grid_idx = self.local.dim, self.local.idx

    def start(self, name: str, launch) -> None:
        """Start ``launch()`` in a thread; it runs only in ``step``s."""
        state = {"done": False, "last": "start", "error": None}

        def body():
            with self.cv:
                self.cv.wait_for(lambda: self.turn == name)
            try:
                launch()
            except _Abort:
                pass
            except BaseException as e:  # noqa: BLE001 (reported by the scheduler)
                state["error"] = e
            with self.cv:
                state["done"] = True
                self.turn = "main"
                self.cv.notify_all()

        self.threads[name] = state
        threading.Thread(target=body, name=name, daemon=True).start()

    def _step(self, name: str) -> None:
        with self.cv:
            self.turn = name
            self.cv.notify_all()
            self.cv.wait_for(lambda: self.turn == "main")

    def step(self, name: str) -> str:
        """Run kernel ``name`` to its next yield: "tile", "poll" or "done"."""
        state = self.threads[name]
        self._step(name)
        if state["error"] is not None:
            raise state["error"]
        return "done" if state["done"] else state["last"]


class _Sim:
    """Every rank's streams; ``kernel`` ops on a caller stream start a real kernel."""

    def __init__(self, kernels: _Kernels):
        self.ops: dict[str, list] = {}
        self.kernels = kernels
        self.memop_calls = 0  # driver calls that issue stream memory operations

    def run(self, ranks: int, ahead: int | None) -> None:
        """Execute every stream. In each round every running kernel takes steps (rank
        ``ahead``: up to 16, the others one), each step followed by the other streams
        running as far as their waits allow."""
        done = {n: 0 for n in self.ops}
        running: dict[str, str] = {}  # caller stream -> its kernel's thread name
        idle_rounds = 0
        while True:
            progress = self._advance(done, running, ahead)
            for r in range(ranks):
                name = f"caller{r}"
                for _ in range(16 if r == ahead else 1):
                    if name not in running:
                        break
                    kind = self.kernels.step(running[name])
                    progress |= kind != "poll"
                    if kind == "done":
                        del running[name]
                        done[name] += 1
                    progress |= self._advance(done, running, ahead)
            if all(done[n] == len(o) for n, o in self.ops.items()):
                return
            idle_rounds = 0 if progress else idle_rounds + 1
            if idle_rounds > 2:
                stuck = {n: o[done[n]] for n, o in self.ops.items() if done[n] < len(o)}
                raise AssertionError(f"deadlock: {stuck}")

    def _advance(self, done, running, ahead: int | None = None) -> bool:
        """Run ops of every stream while their waits are met, a few at a time per stream in
        turn: one copy or write (16 for the streams of rank ``ahead``), any number of met
        waits, so that a flag written before its copy is seen before the copy lands and a
        fast rank can overwrite what a slow one has yet to read. Start kernels reached."""
        ran, progress = False, True
        while progress:
            progress = False
            for name, ops in self.ops.items():
                budget = 16 if ahead is not None and name.endswith(str(ahead)) else 1
                while budget and done[name] < len(ops) and name not in running:
                    op = ops[done[name]]
                    if op[0] == "kernel":
                        thread = f"{name}.{done[name]}"
                        self.kernels.start(thread, op[1])
                        running[name] = thread
                        break
                    if not self._step(op, done):
                        break
                    done[name] += 1
                    ran = progress = True
                    budget -= op[0] not in ("wait", "after")
        return ran

    @staticmethod
    def _step(op, done) -> bool:
        kind = op[0]
        if kind == "copy":
            ctypes.memmove(op[1], op[2], op[3])
        elif kind == "write":
            _u32(op[1]).value = op[2]
        elif kind == "wait":  # GEQ
            return _u32(op[1]).value >= op[2]
        elif kind == "after":
            return done[op[1]] >= op[2]
        elif kind == "call":  # a matmul of the all-gather's consumer
            op[1]()
        return True


def _transports(kind, R, sim):
    """R transports over CPU memory, their buffers made by hand (no symmetric memory, no
    pinned host file), no flag set."""
    size = 16 << 20
    shared = torch.zeros(R * size, dtype=torch.uint8)  # the host road's one file
    ts = []
    for r in range(R):
        t = object.__new__(PeerTransport if kind == "peer" else HostTransport)
        t.group, t.device, t.rank, t.size = None, torch.device("cpu"), r, R
        t.broken, t._views = False, {}
        t.zeros = torch.zeros(FLAGS_BYTES, dtype=torch.uint8)
        if kind == "peer":
            t.buf = torch.zeros(size, dtype=torch.uint8)
        else:
            t.mapping, t.region, t.base = ("file",), size, shared.data_ptr()
            t.buf, t.recv = shared, torch.zeros(size, dtype=torch.uint8)
            t.dflags = torch.zeros(FLAGS_BYTES // 4, dtype=torch.int32)
            t.recv_stream = _Stream(sim, f"recv{r}")
        ts.append(t)
    for t in ts:
        t.ptrs = (
            [u.buf.data_ptr() for u in ts]
            if kind == "peer"
            else [t.base + d * t.region for d in range(R)]
        )
    return ts


def _issue(sim, rank, t, p, x, w, out, caller, comm):
    """What ``overlap.ops.overlapped`` does for one call, on simulated streams (the call's
    own zeroed counters)."""
    slots, epilogue = t.begin(p, out, caller)
    counters = torch.zeros(p.n_chunks, dtype=torch.int32)
    comm.wait_stream(caller)

    def launch():
        chunked_matmul(x, w, slots, counters, p, epilogue=epilogue)

    sim.ops[caller.cuda_stream].append(("kernel", launch))

    def wait(c, ops):  # as ops.wait_counter: the wait joins the transport's batch
        ops.wait(counters.data_ptr() + 4 * c, p.tiles_per_chunk[c])

    t.run(p, slots, out, wait, comm)
    caller.wait_stream(comm)


def _reference(p, xs, ws, rank):
    R, M = p.world_size, p.M
    prods = [x.double() @ w.double() for x, w in zip(xs, ws, strict=True)]
    own = slice(rank * (M // R), (rank + 1) * (M // R))
    if p.spec.replicated:
        return sum(prods)
    if p.spec.reduces:
        return sum(prods)[own]
    return torch.cat([q[own] for q in prods])


@pytest.mark.parametrize("kind", ["peer", "host"])
@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize(
    ("R", "M", "N", "chunks", "ahead"),
    [(2, 128, 80, 4, 0), (2, 100, 40, 8, 1), (3, 96, 70, 6, 2), (3, 192, 40, 6, 0)],
)
def test_protocol_with_the_real_kernel(kind, collective, R, M, N, chunks, ahead, monkeypatch):
    kernels = _Kernels(monkeypatch)
    sim = _Sim(kernels)
    fake = _Driver(sim)
    monkeypatch.setattr(signal_wait, "_driver", lambda: fake)
    g = torch.Generator().manual_seed(R * 1000 + M + N)
    K = 16
    ts = _transports(kind, R, sim)
    p = make_plan(M, N, K, world_size=R, collective=collective, dtype_bits=32, interpreter=True,
                  chunks=chunks, blocked=True, transport="ce")  # fmt: skip
    assert p.path == "overlap" and slot_bytes(p, torch.float32) <= 16 << 20
    assert p.band_tile_rows(0) * -(-N // p.tiles.block_n) >= 2, "a band must have 2+ tiles"
    callers = [_Stream(sim, f"caller{r}") for r in range(R)]
    comms = [_Stream(sim, f"comm{r}") for r in range(R)]
    rows = M // R if p.spec.scatters else M
    calls = []
    try:
        for _ in range(2):  # two calls in flight on every rank
            xs = [torch.randn(M, K, generator=g) for _ in range(R)]
            ws = [torch.randn(N, K, generator=g).t() for _ in range(R)]
            outs = [torch.full((rows, N), float("nan")) for _ in range(R)]
            for r, t in enumerate(ts):
                _issue(sim, r, t, p, xs[r], ws[r], outs[r], callers[r], comms[r])
            calls.append((xs, ws, outs))
        sim.run(R, ahead)
    finally:
        kernels.close()
    for i, (xs, ws, outs) in enumerate(calls):
        for r in range(R):
            assert not torch.isnan(outs[r]).any(), f"call {i} rank {r}: unwritten rows"
            ref = _reference(p, xs, ws, r)
            torch.testing.assert_close(outs[r].double(), ref, rtol=1e-5, atol=1e-4)
    # Stream memory operations go out in batches (each one graph node, which costs host time
    # at every replay): per stream at most one between two copies, and one at its end.
    copies = sum(op[0] == "copy" for ops in sim.ops.values() for op in ops)
    assert sim.memop_calls <= copies, (sim.memop_calls, copies)


def _issue_gather(sim, rank, t, p, x, w, out, caller, comm):
    """What ``overlap.ops._gather_forward`` does for one call, on simulated streams: the own
    rows first, then each band of the shards after ``arrived`` for its chunks."""
    R, m = p.world_size, p.M // p.world_size
    buf = t.gather(p, x, comm, caller)
    own = slice(rank * m, (rank + 1) * m)
    sim.ops[caller.cuda_stream].append(("call", lambda: out[own].copy_(x @ w)))
    for q, h, chunks in p.shard_bands:
        t.arrived(p, chunks, caller)

        def band(q=q, h=h):  # the copy engines' standard layout
            for s in (s for s in range(R) if s != rank):
                out[s * m + q : s * m + q + h] = buf[s * m + q : s * m + q + h] @ w

        sim.ops[caller.cuda_stream].append(("call", band))
    caller.wait_stream(comm)


@pytest.mark.parametrize("kind", ["peer", "host"])
@pytest.mark.parametrize(
    ("R", "m", "chunks", "ahead"), [(2, 64, 4, 0), (2, 48, 2, 1), (3, 64, 6, 2)]
)
def test_all_gather_protocol(kind, R, m, chunks, ahead, monkeypatch):
    """The all-gather through the copy engines: two calls in flight on every rank, a rank
    running ahead; every result row against float64 (a row read before its band arrived, or
    after the next call overwrote it, would differ)."""
    kernels = _Kernels(monkeypatch)  # (no kernel runs: the consumer's matmuls are "call"s)
    sim = _Sim(kernels)
    fake = _Driver(sim)
    monkeypatch.setattr(signal_wait, "_driver", lambda: fake)
    g = torch.Generator().manual_seed(R * 100 + m)
    K, N, M = 24, 20, R * m
    ts = _transports(kind, R, sim)
    p = make_plan(M, N, K, world_size=R, collective="all_gather", dtype_bits=32, interpreter=True,
                  chunks=chunks, blocked=True, transport="ce")  # fmt: skip
    assert p.path == "overlap" and p.bands_per_block >= 2, p.describe()
    callers = [_Stream(sim, f"caller{r}") for r in range(R)]
    comms = [_Stream(sim, f"comm{r}") for r in range(R)]
    calls = []
    try:
        for _ in range(2):
            xs = [torch.randn(m, K, generator=g) for _ in range(R)]
            ws = [torch.randn(K, N, generator=g) for _ in range(R)]
            outs = [torch.full((M, N), float("nan")) for _ in range(R)]
            for r, t in enumerate(ts):
                _issue_gather(sim, r, t, p, xs[r], ws[r], outs[r], callers[r], comms[r])
            calls.append((xs, ws, outs))
        sim.run(R, ahead)
    finally:
        kernels.close()
    for i, (xs, ws, outs) in enumerate(calls):
        full = torch.cat(xs).double()
        for r in range(R):
            assert not torch.isnan(outs[r]).any(), f"call {i} rank {r}: unwritten rows"
            torch.testing.assert_close(
                outs[r].double(), full @ ws[r].double(), rtol=1e-5, atol=1e-5
            )
