"""No devices: the copy-engine transport's protocol (``overlap/comm/peer.py``, ``host.py``) on
simulated ranks.

The transports run unchanged against a fake CUDA driver that records every copy, flag write
and flag wait per stream; CPU tensors stand for GPU memory (a copy is a ``memmove`` between
their addresses). A scheduler then executes every rank's streams, each op once its wait is
met, with a model of the fused kernel (its own bands wait for the kernel flags and add the
receive slots, as ``gemm/matmul.py`` does). Results are checked against the plain collective
of the partial products, over consecutive calls (epochs) and across the 2**32 wrap. A wait
that is never met is a deadlock and fails the test.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from overlap.comm import host as host_mod
from overlap.comm import peer as peer_mod
from overlap.comm.host import HostTransport
from overlap.comm.peer import _FLAGS_BYTES, PeerTransport, slot_bytes
from overlap.plan import COLLECTIVES, make_plan
from overlap.signal.counters import reached


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
    """The few cuda-python driver calls the transport makes, recorded per stream."""

    class CUresult:
        CUDA_SUCCESS = 0

    class CUstreamWaitValue_flags:
        CU_STREAM_WAIT_VALUE_GEQ = 1

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
        return (0,)

    def cuStreamWaitValue32(self, stream, addr, value, flags):  # noqa: N802
        self.sim.ops[stream].append(("wait", addr, value))
        return (0,)


def _u32(addr: int) -> ctypes.c_uint32:
    return ctypes.c_uint32.from_address(addr)


class _Sim:
    def __init__(self):
        self.ops: dict = {}
        self.done: dict = {}  # stream -> ops executed
        self.counters: dict = {}  # (rank, chunk) reached by the kernel model

    def run(self, kernels) -> None:
        """Execute every stream's ops; ``kernels[rank](op)`` runs the kernel model's ops.
        Adversarial order: the copy and flag streams run as far as their waits allow after
        every single kernel op, so an op that is not properly waited for runs before the
        data it needs exists."""
        self.done = {name: 0 for name in self.ops}
        while True:
            progress = self._advance([n for n in self.ops if not n.startswith("kernel")], kernels)
            progress |= self._advance([n for n in self.ops if n.startswith("kernel")], kernels, 1)
            if all(self.done[n] == len(o) for n, o in self.ops.items()):
                return
            if not progress:
                stuck = {n: o[self.done[n]] for n, o in self.ops.items() if self.done[n] < len(o)}
                raise AssertionError(f"deadlock: {stuck}")

    def _advance(self, names, kernels, most=None) -> bool:
        """Run ops of ``names`` while their waits are met (at most ``most`` ops in all)."""
        ran, progress = 0, True
        while progress and (most is None or ran < most):
            progress = False
            for name in names:
                ops = self.ops[name]
                if self.done[name] < len(ops) and self._step(name, ops[self.done[name]], kernels):
                    self.done[name] += 1
                    ran, progress = ran + 1, True
                    if most is not None and ran >= most:
                        break
        return ran > 0

    def _step(self, name, op, kernels) -> bool:
        kind = op[0]
        if kind == "copy":
            ctypes.memmove(op[1], op[2], op[3])
        elif kind == "write":
            _u32(op[1]).value = op[2]
        elif kind == "wait":
            return reached(_u32(op[1]).value, op[2])
        elif kind == "after":
            return self.done[op[1]] >= op[2]
        elif kind == "counter":
            return (op[1], op[2]) in self.counters
        else:
            return kernels[op[1]](op)
        return True


def _transports(kind, R, sim, start_epoch):
    """R transports over CPU memory, their buffers made by hand (no symmetric memory, no
    pinned host file), every flag set to ``start_epoch``."""
    size = 64 << 20
    shared = torch.zeros(R * size, dtype=torch.uint8)  # the host road's one file
    ts = []
    for r in range(R):
        t = object.__new__(PeerTransport if kind == "peer" else HostTransport)
        t.group, t.device, t.rank, t.size = None, torch.device("cpu"), r, R
        t.epoch, t.broken, t._views = start_epoch, False, {}
        if kind == "peer":
            t.buf = torch.zeros(size, dtype=torch.uint8)
        else:
            t.mapping, t.region, t.base = ("file",), size, shared.data_ptr()
            t.buf, t.recv = shared, torch.zeros(size, dtype=torch.uint8)
            t.dflags = torch.zeros(_FLAGS_BYTES // 4, dtype=torch.int32)
            t.recv_stream = _Stream(sim, f"recv{r}")
        ts.append(t)
    for t in ts:
        t.ptrs = (
            [u.buf.data_ptr() for u in ts]
            if kind == "peer"
            else [t.base + d * t.region for d in range(R)]
        )
        for addr in t._local_flags():
            _u32(addr).value = start_epoch & 0xFFFFFFFF
    return ts


def _one_call(ts, sim, p, dtype, g):
    """Issue one call on every rank, run the simulation, return (results, references)."""
    R, M, N = p.world_size, p.M, p.N
    B, b, rows = M // R, p.bands_per_block, p.run_rows
    parts = [torch.randn(M, N, generator=g).to(dtype) for _ in range(R)]  # each rank's x @ w
    outs, refs, kernels = [], [], {}
    for r, t in enumerate(ts):
        stream = _Stream(sim, f"comm{r}")
        out = torch.full(
            (B if p.collective == "reduce_scatter" else M, N), float("nan"), dtype=dtype
        )
        in_place = p.collective == "all_reduce" or (p.collective == "all_to_all" and t.a2a_in_place)
        p_flat = out.view(-1) if in_place else torch.full((M * N,), float("nan"), dtype=dtype)
        fuse = t.begin(p, dtype, out)
        # the kernel model: peer bands go to the slot buffer at once; own bands wait for the
        # kernel flags, add the receive slots, and go to `out` (gemm/matmul.py's epilogue);
        # a band finishes in two column halves, so a copy of a band issued before its
        # counter is reached reads half a band
        order = [(c + (r + 1) % R * b) % p.n_row_bands for c in range(p.n_row_bands)]
        halves = ((0, N // 2), (N // 2, N))
        sim.ops[f"kernel{r}"] = [
            ("kernel", r, c, a, cols, cols == halves[-1])
            for c, a in enumerate(order)
            for cols in halves
        ]

        def kernel(op, t=t, fuse=fuse, out=out, p_flat=p_flat, r=r, part=parts[r]):
            _, _, chunk, a, (c0, c1), whole = op
            d, k = divmod(a, b)
            band = slice(a * rows, (a + 1) * rows)
            if d != r:
                p_flat.view(M, N)[band, c0:c1] = part[band, c0:c1]
            else:
                acc = part[band, c0:c1].double()
                if fuse.add:
                    for s in range(R):
                        if s != r:
                            if not reached(int(fuse.flags[s * b + k]) & 0xFFFFFFFF, fuse.epoch):
                                return False
                            acc += fuse.recv[s, k * rows : (k + 1) * rows, c0:c1].double()
                row0 = a * rows - (r * B if p.collective == "reduce_scatter" else 0)
                out[row0 : row0 + rows, c0:c1] = acc.to(dtype)
            if whole:  # the band's counter is reached with its last tile
                sim.counters[(r, chunk)] = True
            return True

        kernels[r] = kernel

        def wait(c, r=r, name=stream.cuda_stream):  # api's wait: the chunk's counter
            sim.ops[name].append(("counter", r, c))

        t.run(p, p_flat, out, wait, stream)
        outs.append(out)
    sim.run(kernels)
    total = sum(x.double() for x in parts)
    for r in range(R):
        own = slice(r * B, (r + 1) * B)
        if p.collective == "all_reduce":
            refs.append(total)
        elif p.collective == "reduce_scatter":
            refs.append(total[own])
        else:
            refs.append(torch.cat([parts[s][own].double() for s in range(R)]))
    return outs, refs


@pytest.mark.parametrize("kind", ["peer", "host"])
@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize(
    ("R", "M", "N", "chunks"),
    [(2, 64, 24, 4), (3, 96, 16, 6), (2, 50, 8, 8), (2, 128, 100, 4), (3, 96, 80, 6)],
)
def test_protocol_delivers_every_band(kind, collective, R, M, N, chunks, monkeypatch):
    from overlap.gemm import Fuse  # noqa: F401 (begin imports it: do it outside the fakes)

    sim = _Sim()
    fake = _Driver(sim)
    monkeypatch.setattr(peer_mod, "_driver", lambda: fake)
    monkeypatch.setattr(host_mod, "_driver", lambda: fake)
    g = torch.Generator().manual_seed(R * 1000 + M)
    ts = _transports(kind, R, sim, start_epoch=(1 << 32) - 2)  # the calls cross 2**32
    p = make_plan(M, N, 8, world_size=R, collective=collective, dtype_bits=32, interpreter=True,
                  chunks=chunks, blocked=True)  # fmt: skip
    assert p.path == "overlap" and slot_bytes(p, torch.float32) <= 64 << 20
    for call in range(4):
        sim.ops.clear()
        sim.counters.clear()  # the real counters have epochs too (signal/counters.py)
        for t in ts:
            if kind == "host":
                t.recv_stream = _Stream(sim, f"recv{t.rank}")
        outs, refs = _one_call(ts, sim, p, torch.float32, g)
        for r in range(R):
            assert not torch.isnan(outs[r]).any(), f"call {call} rank {r}: unwritten rows"
            torch.testing.assert_close(outs[r].double(), refs[r], rtol=1e-6, atol=1e-5)
