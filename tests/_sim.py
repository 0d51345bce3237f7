"""Simulated CUDA streams on CPU tensors, shared by the no-device transport tests
(test_transport.py: the copy engines; test_sim_nccl.py: NCCL per chunk, the all-gather's
consumer and the uneven exchanges).

The library's own orchestration (``overlap.ops.engine.overlapped`` and ``_gathered``,
``exchange.split_forward`` and ``dispatch_forward``, the embedding bags) is called as on a
GPU, with these stand-ins (``install``):

- ``Stream``: a name and its ops in issue order; ``torch.cuda.current_stream`` and
  ``torch.cuda.stream`` read and switch the simulation's current stream, ``torch.cuda.Event``
  records a stream's position (``Event``), ``wait_stream``/``wait_event`` append a wait;
- torch's work is asynchronous: while a call is issued (``Sim.issuing``) a torch function
  mode puts every op that writes a tensor (an in-place op, ``out=``, ``__setitem__``, or an
  op that makes a new tensor, poisoned with NaN until its turn comes) on the current stream,
  and runs the rest (views, shapes, addresses) at once. ``kept`` tensors of a transport are
  synchronous, as on a GPU, and so is ``NcclTransport.order`` (host work on CPU tensors
  there);
- ``Driver``: the cuda-python calls of ``overlap.signal.wait`` (copies, stream memory waits
  and writes, batches of them, at most 255 per batch as the driver takes), per stream;
- ``chunked_matmul``: a launch on the current stream; when the stream reaches it, the real
  kernel runs under Triton's interpreter in a thread of its own, each of its programs in a
  thread too (persistent programs wait on one another through the protocol), one tile at a
  time (``Kernels``);
- ``Comm``: an NCCL communicator per rank whose collectives are stream ops, executed once
  every rank's stream has reached the same collective.

``Sim.run`` executes every stream of every rank: after each tile of each kernel (and each
poll of a flag by a waiting tile) the other streams run as far as their waits allow, one
operation per stream in turn. ``ahead``: one rank's streams (and kernel) take 16 steps to
the others' one; ``slow``: the streams whose name starts with it run only when nothing else
can, so that whatever waits for them, and forgets to, reads unfinished data. A wait that is
never met fails as a deadlock.

Limits: ``Kernels`` patches internals of Triton's interpreter (``set_grid_idx``,
``set_grid_dim``, ``create_atomic_rmw``, ``GridExecutor.__call__``, ``_patch_lang``), so a
Triton upgrade may break these tests, not the library. The fake driver accepts any argument
types (a wrong cuda-python call passes here) and runs operations in program order (memory
ordering of real hardware is not modelled): the GPU suite covers both.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import threading
import types

import torch
from torch.overrides import TorchFunctionMode
from triton.runtime import interpreter

import overlap.gemm
from overlap.comm import nccl
from overlap.plan import MAX_CHUNKS
from overlap.signal import wait as signal_wait

MAX_BATCH = 255  # operations per cuStreamBatchMemOp: the driver takes fewer than 256


class Stream:
    """A stream of the simulation: a name (its ``cuda_stream`` handle) and its ops."""

    def __init__(self, sim: Sim, name: str) -> None:
        self.sim, self.cuda_stream = sim, name
        sim.ops[name] = []

    def wait_stream(self, other: Stream) -> None:  # later ops wait for other's ops so far
        self.sim.ops[self.cuda_stream].append(
            ("after", other.cuda_stream, len(self.sim.ops[other.cuda_stream]))
        )

    def wait_event(self, event: Event) -> None:
        if event.at is not None:  # (an event never recorded is complete)
            self.sim.ops[self.cuda_stream].append(("after", *event.at))

    def synchronize(self) -> None:  # every stream runs as far as it can (no kernel steps)
        self.sim.run(0)


class Event:
    """A CUDA event: the position of a stream when it was recorded."""

    def __init__(self, sim: Sim) -> None:
        self.sim, self.at = sim, None

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or self.sim.current
        self.at = (stream.cuda_stream, len(self.sim.ops[stream.cuda_stream]))


class Driver:
    """The few cuda-python driver calls the library makes, recorded per stream (a batch of
    stream memory operations as its operations in order)."""

    class CUresult:
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1

    class CUstreamWaitValue_flags:
        CU_STREAM_WAIT_VALUE_GEQ = 0

    class CUstreamBatchMemOpType:
        CU_STREAM_MEM_OP_WAIT_VALUE_32 = 1
        CU_STREAM_MEM_OP_WRITE_VALUE_32 = 2

    class CUstreamBatchMemOpParams:
        def __init__(self):
            self.operation = None
            self.waitValue, self.writeValue = types.SimpleNamespace(), types.SimpleNamespace()

    def __init__(self, sim: Sim) -> None:
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
        if not 0 < count <= MAX_BATCH:  # as the driver: nothing issued, an error returned
            return (self.CUresult.CUDA_ERROR_INVALID_VALUE,)
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


class Kernels:
    """Real kernels in threads that take turns with the scheduler: a kernel thread runs
    until its next tile starts or a tile polls a flag, then hands the turn back.

    A launch's programs run as threads of their own too, stepped in turn by the launch's
    thread (one step of each per step of the launch), as on a GPU where every program of a
    persistent launch is resident: Triton's interpreter would run them one after another,
    and a program spinning on a peer's flag would then wait for programs of its own launch
    that never start."""

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
            if hasattr(self.local, "program"):  # one program of a launch (``_programs``)
                dim = (self.local.program[1], 1, 1)
            self.local.dim = dim
            real_dim(*dim)

        def set_grid_idx(*idx):
            self._yield("tile")
            if hasattr(self.local, "program"):
                idx = (self.local.program[0], 0, 0)
            self.local.idx = idx
            real_idx(*idx)

        real_call = interpreter.GridExecutor.__call__

        def call(executor, *args, **kwargs):
            grid = executor.grid
            me = threading.current_thread().name
            if me not in self.threads or callable(grid) or len(grid) != 1 or grid[0] == 1:
                return real_call(executor, *args, **kwargs)
            return self._programs(real_call, executor, grid[0], args, kwargs)

        monkeypatch.setattr(interpreter.GridExecutor, "__call__", call)

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
        """End every kernel thread (a failed simulation leaves some waiting); a launch's
        thread ends its programs' threads."""
        self.abort = True
        for name, th in list(self.threads.items()):
            while th["owner"] == "main" and not th["done"]:
                self._step(name)
        for scope in reversed(self.scopes.values()):
            scope.restore()

    def _programs(self, real_call, executor, n: int, args, kwargs) -> None:
        """Run a launch of ``n`` programs (this thread's kernel) as ``n`` threads, each
        stepped once per step of this one."""
        me = threading.current_thread().name
        one = copy.copy(executor)
        one.grid = (1,)

        def program(x: int):
            self.local.program = (x, n)
            real_call(one, *args, **kwargs)

        kids = [f"{me}/{x}" for x in range(n)]
        for x, kid in enumerate(kids):
            self.start(kid, functools.partial(program, x), owner=me)
        try:
            while kids:
                kinds = [self.step(kid) for kid in kids]
                kids = [k for k, kind in zip(kids, kinds, strict=True) if kind != "done"]
                if kids:  # a round of the programs is one step of the launch
                    self._yield("poll" if all(k == "poll" for k in kinds) else "tile")
        finally:  # (an abort or a program's error): end the others
            for kid in kids:
                while not self.threads[kid]["done"]:
                    self._step(kid)

    def _yield(self, kind: str) -> None:
        me = threading.current_thread().name
        if me not in self.threads:
            return
        if self.abort:
            raise _Abort
        with self.cv:
            self.threads[me]["last"] = kind
            self.turn = self.threads[me]["owner"]
            self.cv.notify_all()
            self.cv.wait_for(lambda: self.turn == me)
        if self.abort:
            raise _Abort
        builder = interpreter.interpreter_builder
        # another kernel ran meanwhile: this one's grid again (its size is set before the
        # first tile's index: a launch of one tile beside a launch of several)
        if hasattr(self.local, "dim"):
            builder.grid_dim = self.local.dim
        if hasattr(self.local, "idx"):
            builder.grid_idx = self.local.idx

    def start(self, name: str, launch, owner: str = "main") -> None:
        """Start ``launch()`` in a thread; it runs only in ``step``s of ``owner`` (the
        scheduler, or the thread of the launch whose program it is)."""
        state = {"done": False, "last": "start", "error": None, "owner": owner}

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
                self.turn = owner
                self.cv.notify_all()

        self.threads[name] = state
        threading.Thread(target=body, name=name, daemon=True).start()

    def _step(self, name: str) -> None:
        owner = self.threads[name]["owner"]
        with self.cv:
            self.turn = name
            self.cv.notify_all()
            self.cv.wait_for(lambda: self.turn == owner)

    def step(self, name: str) -> str:
        """Run kernel ``name`` to its next yield: "tile", "poll" or "done"."""
        state = self.threads[name]
        self._step(name)
        if state["error"] is not None:
            raise state["error"]
        return "done" if state["done"] else state["last"]


def _tensors(args) -> list[torch.Tensor]:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, list | tuple):
            out += _tensors(a)
    return out


_ALLOCS = {torch.empty, torch.Tensor.new_empty, torch.empty_like}


class _Async(TorchFunctionMode):
    """Torch ops issued on the simulation's current stream (the module docstring)."""

    def __init__(self, sim: Sim) -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.sim.synchronous:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        target = kwargs.get("out")
        writes = name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))
        if target is None and writes:
            target = args[0]
        if isinstance(target, torch.Tensor):
            self.sim.enqueue(lambda: func(*args, **kwargs))
            return None if name == "__setitem__" else target
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor) or out.numel() == 0:
            return out
        storage = out.untyped_storage().data_ptr()
        if any(t.untyped_storage().data_ptr() == storage for t in _tensors((args, kwargs))):
            return out  # a view: made now, its data comes with its base's
        if out.is_floating_point():
            out.fill_(float("nan"))  # (an int tensor keeps its value: indices on the host)
        if func not in _ALLOCS:
            self.sim.enqueue(lambda: out.copy_(func(*args, **kwargs)))
        return out


class Group:
    """The collectives of R simulated ranks: each runs once every rank has reached it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.pending: dict[int, dict[int, tuple]] = {}
        self.done: set[int] = set()

    def arrive(self, seq: int, rank: int, kind: str, args: tuple) -> bool:
        """Rank ``rank``'s stream is at collective ``seq``; whether it has run."""
        if seq not in self.done:
            calls = self.pending.setdefault(seq, {})
            calls[rank] = (kind, args)
            if len(calls) == self.size:
                kinds = {k for k, _ in calls.values()}
                assert len(kinds) == 1, f"collective {seq}: the ranks issued {calls}"
                _COLLECTIVES[kinds.pop()]([calls[r][1] for r in range(self.size)])
                self.done.add(seq)
                del self.pending[seq]
        return seq in self.done


def _all_reduce(calls) -> None:
    total = sum(buf.double() for (buf,) in calls)
    for (buf,) in calls:
        buf.copy_(total)


def _reduce_scatter(calls) -> None:
    total = sum(inp.double() for _, inp in calls).view(len(calls), -1)
    for r, (out, _) in enumerate(calls):
        out.copy_(total[r])


def _all_to_all(calls) -> None:
    pieces = [[p.clone() for p in ins] for _, ins in calls]
    for r, (outs, _) in enumerate(calls):
        for s, o in enumerate(outs):
            o.copy_(pieces[s][r])


def _all_gather(calls) -> None:
    full = torch.cat([inp.clone() for _, inp in calls])
    for out, _ in calls:
        out.copy_(full)


def _all_to_all_v(calls) -> None:
    pieces = [list(inp.clone().split(list(in_rows))) for _, inp, _, in_rows in calls]
    for r, (out, _, out_rows, _) in enumerate(calls):
        for s, o in enumerate(out.split(list(out_rows))):
            o.copy_(pieces[s][r])


_COLLECTIVES = {
    "all_reduce": _all_reduce,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
    "all_gather": _all_gather,
    "all_to_all_v": _all_to_all_v,
}


class Comm:
    """An NCCL communicator of rank ``rank``: each collective is an op of the current
    stream (``nccl.TorchComm``'s methods)."""

    def __init__(self, sim: Sim, group: Group, rank: int) -> None:
        self.sim, self.group, self.rank, self.seq = sim, group, rank, 0

    def _issue(self, kind: str, *args) -> None:
        self.sim.ops[self.sim.current.cuda_stream].append(
            ("coll", self.group, self.seq, self.rank, kind, args)
        )
        self.seq += 1

    def all_reduce(self, buf):
        self._issue("all_reduce", buf)

    def reduce_scatter(self, out, inp):
        self._issue("reduce_scatter", out, inp)

    def all_to_all(self, outs, ins):
        self._issue("all_to_all", outs, ins)

    def all_gather(self, out, inp):
        self._issue("all_gather", out, inp)

    def all_to_all_v(self, out, inp, out_rows, in_rows):
        self._issue("all_to_all_v", out, inp, out_rows, in_rows)


class Context:
    """What the call engine asks of ``overlap.context.Context``: one rank's transport,
    communication stream and chunk counters."""

    def __init__(self, transport, comm_stream: Stream, rank: int) -> None:
        self._transport, self.comm_stream, self.rank = transport, comm_stream, rank
        self.counters = torch.zeros(MAX_CHUNKS, dtype=torch.int32)

    def transport(self, cls, capturing: bool = False):
        return self._transport


class Sim:
    """Every rank's streams (``ops``: name -> ops in issue order) and the scheduler."""

    def __init__(self, kernels: Kernels) -> None:
        self.ops: dict[str, list] = {}
        self.kernels = kernels
        self.memop_calls = 0  # driver calls that issue stream memory operations
        self.current: Stream | None = None
        self.callers: list[Stream] = []  # rank r's caller stream (``streams``)
        self.slow: str | None = None
        self.synchronous = False  # (``kept`` tensors)
        self.done: dict[str, int] = {}  # ops run per stream
        self._async = _Async(self)

    def enqueue(self, fn) -> None:
        """``fn()`` when the current stream reaches it."""
        self.ops[self.current.cuda_stream].append(("call", fn))

    @contextlib.contextmanager
    def issuing(self, stream: Stream):
        """Issue a call's work with ``stream`` as the caller's (current) stream."""
        self.current = stream
        with self._async:
            yield
        self.current = None

    @contextlib.contextmanager
    def on(self, stream: Stream | None):
        """``torch.cuda.stream(stream)``."""
        before, self.current = self.current, stream or self.current
        try:
            yield
        finally:
            self.current = before

    def run(self, ranks: int, ahead: int | None = None, slow: str | None = None) -> None:
        """Execute every stream. In each round every running kernel takes steps (rank
        ``ahead``: up to 16, the others one), each step followed by the other streams
        running as far as their waits allow (``slow``: the module docstring)."""
        self.slow = slow
        done = self.done
        for n in self.ops:
            done.setdefault(n, 0)
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
                stuck = {n: o[done[n]][:3] for n, o in self.ops.items() if done[n] < len(o)}
                raise AssertionError(f"deadlock: {stuck}")

    def _advance(self, done, running, ahead: int | None) -> bool:
        """Run ops of every stream while their waits are met, a few at a time per stream in
        turn: one copy, write, collective or torch op (16 for the streams of rank
        ``ahead``), any number of met waits, so that a flag written before its copy is seen
        before the copy lands and a fast rank can overwrite what a slow one has yet to read;
        the ``slow`` streams one op only where no other stream moved. Start kernels
        reached."""
        ran = False
        while True:
            progress = self._pass(done, running, ahead, slow=False)
            if not progress and self.slow is not None:
                progress = self._pass(done, running, ahead, slow=True)
            if not progress:
                return ran
            ran = True

    def _pass(self, done, running, ahead, slow: bool) -> bool:
        progress = False
        for name, ops in self.ops.items():
            if self.slow is not None and name.startswith(self.slow) != slow:
                continue
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
                progress = True
                budget -= op[0] not in ("wait", "after")
            if slow and progress:
                return True
        return progress

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
        elif kind == "call":  # a torch op
            op[1]()
        elif kind == "coll":
            return op[1].arrive(*op[2:])
        return True


def two_calls(sim, R, ahead, issue, contexts, make, slow=None):
    """Two calls on every rank issued through the call engine (``issue(r, ctx, *inputs)``
    on rank r's caller stream, returning the result), each followed by a copy of its result
    on the caller stream; then every stream runs. Returns per call the inputs, results and
    copies."""
    calls = []
    for _ in range(2):  # two calls in flight on every rank
        inputs, outs, seen = make(), [], []
        for r, ctx in enumerate(contexts):
            with sim.issuing(sim.callers[r]):
                outs.append(issue(r, ctx, *inputs[r]))
                seen.append(outs[-1].clone())  # what the caller's next op reads
        calls.append((inputs, outs, seen))
    sim.run(R, ahead, slow)
    return calls


def check(outs, seen, ref, i: int, r: int, **tol) -> None:
    """Call ``i``'s result on rank ``r`` and the caller stream's copy of it against ``ref``."""
    for what, got in (("result", outs[r]), ("result seen by the caller stream", seen[r])):
        assert not bool(got.isnan().any()), f"call {i} rank {r}: unwritten rows in the {what}"
        torch.testing.assert_close(got.double(), ref, **tol, msg=lambda m, w=what: f"{w}: {m}")


def streams(sim: Sim, R: int) -> list[Stream]:
    """Caller streams (``sim.callers``) and communication streams of ``R`` ranks."""
    sim.callers = [Stream(sim, f"caller{r}") for r in range(R)]
    return [Stream(sim, f"comm{r}") for r in range(R)]


def install(monkeypatch) -> tuple[Sim, Kernels, Driver]:
    """A simulation with torch's CUDA streams and events, the driver, the GEMM's launch and
    ``kept`` tensors replaced (the module docstring)."""
    kernels = Kernels(monkeypatch)
    sim = Sim(kernels)
    driver = Driver(sim)
    monkeypatch.setattr(signal_wait, "_driver", lambda: driver)
    monkeypatch.setattr(signal_wait, "_method", "stream_wait")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: sim.current)
    monkeypatch.setattr(torch.cuda, "stream", sim.on)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: Event(sim))
    real = overlap.gemm.chunked_matmul

    def launch(*args, **kwargs):
        sim.ops[sim.current.cuda_stream].append(("kernel", lambda: real(*args, **kwargs)))

    monkeypatch.setattr(overlap.gemm, "chunked_matmul", launch)

    def synchronous(fn):
        def run(*args, **kwargs):
            sim.synchronous = True
            try:
                return fn(*args, **kwargs)
            finally:
                sim.synchronous = False

        return run

    # made in a thread of their own and synchronized there; host work on CPU tensors
    monkeypatch.setattr(nccl, "kept", synchronous(lambda device, make: make()))
    monkeypatch.setattr(nccl.NcclTransport, "order", synchronous(nccl.NcclTransport.order))
    return sim, kernels, driver
