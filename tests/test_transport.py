"""No devices: the copy-engine transports (``overlap/comm/peer.py``, ``host.py``) and the real
fused GEMM kernel (Triton's interpreter) on simulated ranks (``tests/_sim.py``), driven by the
call engine itself (``overlap.ops.engine.overlapped`` and ``_gathered``).

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
previous one still reads, the zeroing of the one-shot flags (both calls issue the same
operations with the same values, as a CUDA graph's replays do, so a flag zeroed too late lets
the second call read a band early, and one zeroed too early deadlocks) and of the context's
chunk counters, which both calls share. After each call the caller stream copies the result
(what the caller's next op would read): both it and the result at the end are checked
against float64. A wait that is never met fails as a deadlock.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from _sim import MAX_BATCH, Context, Stream, check, install, streams, two_calls

from overlap.collectives import COLLECTIVES
from overlap.comm.host import HostTransport
from overlap.comm.peer import PeerTransport, slot_bytes
from overlap.contract import FLAGS_BYTES, SET
from overlap.ops import engine
from overlap.plan import make_plan


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
            t.recv_stream = Stream(sim, f"recv{r}")
        ts.append(t)
    for t in ts:
        t.ptrs = (
            [u.buf.data_ptr() for u in ts]
            if kind == "peer"
            else [t.base + d * t.region for d in range(R)]
        )
    return ts


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
    ("R", "M", "N", "chunks", "ahead", "cover"),
    [(2, 128, 80, 4, 0, False), (2, 100, 40, 8, 1, True), (3, 96, 70, 6, 2, True),
     (3, 192, 40, 6, 0, False)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_protocol_with_the_real_kernel(
    kind, collective, R, M, N, chunks, ahead, cover, dtype, monkeypatch
):
    """fp32 runs the kernel one program per tile (its tf32x3 path), fp16 as on 16-bit GPUs:
    persistent programs (3 in the interpreter), each a thread of its own (``_sim.Kernels``),
    so a program that waits on a flag before counting its earlier tiles deadlocks here as
    on a GPU. With ``cover`` every call also computes a product on the caller stream between
    the peers' tiles and its own block's (two launches, ``engine.produce``), checked too."""
    sim, kernels, _ = install(monkeypatch)
    g = torch.Generator().manual_seed(R * 1000 + M + N)
    K = 16
    comms = streams(sim, R)
    ts = _transports(kind, R, sim)
    p = make_plan(M, N, K, world_size=R, collective=collective, dtype_bits=dtype.itemsize * 8,
                  interpreter=True, chunks=chunks, blocked=True, transport="ce")  # fmt: skip
    assert p.path == "overlap" and slot_bytes(p, dtype) <= 16 << 20
    assert p.band_tile_rows(0) * -(-N // p.tiles.block_n) >= 2, "a band must have 2+ tiles"
    rows = M // R if p.spec.scatters else M
    contexts = [Context(t, comms[r], r) for r, t in enumerate(ts)]

    def make():
        return [(torch.randn(M, K, generator=g).to(dtype), torch.randn(N, K, generator=g)
                 .to(dtype).t(), torch.full((rows, N), float("nan"), dtype=dtype),
                 torch.randn(N, M, generator=g).to(dtype), torch.randn(M, K, generator=g)
                 .to(dtype), torch.full((N, K) if cover else (0,), float("nan"), dtype=dtype))
                for _ in range(R)]  # fmt: skip

    def issue(r, ctx, x, w, out, a, b, c):
        both = (a, b, c) if cover else ()
        engine.overlapped(x, w, out, p, None, ctx, type(ts[r]), False, cover=both)
        return torch.cat((out.flatten(), c.flatten()))  # (on the caller stream)

    try:
        calls = two_calls(sim, R, ahead, issue, contexts, make)
    finally:
        kernels.close()
    tol = 1e-5 if dtype == torch.float32 else 5e-3  # (fp16: partials rounded before the sum)
    for i, (inputs, outs, seen) in enumerate(calls):
        xs, ws = [a[0] for a in inputs], [a[1] for a in inputs]
        for r in range(R):
            a, b, c = inputs[r][3:]
            ref = _reference(p, xs, ws, r).flatten()
            ref = torch.cat((ref, (a.double() @ b.double()).flatten() if cover else c.double()))
            check(outs, seen, ref, i, r, rtol=tol, atol=10 * tol)
    # Stream memory operations go out in batches (each one graph node, which costs host time
    # at every replay): per stream at most one between two copies, and one at its end.
    copies = sum(op[0] == "copy" for ops in sim.ops.values() for op in ops)
    assert sim.memop_calls <= copies, (sim.memop_calls, copies)


@pytest.mark.parametrize("kind", ["peer", "host"])
@pytest.mark.parametrize(
    ("R", "m", "chunks", "ahead", "cover", "one", "slow"),
    [(2, 64, 4, 0, True, False, None), (2, 48, 2, 1, False, False, None),
     (3, 64, 6, 2, True, False, None), (2, 64, 4, 1, True, True, None),
     (3, 64, 6, 2, False, True, None), (3, 64, 6, 0, False, False, "comm1")],
)  # fmt: skip
def test_all_gather_protocol(kind, R, m, chunks, ahead, cover, one, slow, monkeypatch):
    """The all-gather through the copy engines and the call engine's consumer (cuBLAS per
    band, after ``arrived``): two calls in flight on every rank, a rank running ahead; every
    result row against float64 (a row read before its band arrived, or after the next call
    overwrote it, would differ), and (but in the first case) ``x_full``, which the
    communication stream copies out of the receive slots, read by the caller stream after the
    call; with ``cover``, ``x_full^T b``, this rank's rows' share first and the others' from
    the receive slots after the last band (``consume``); with ``one``, the other rows in one
    product after their last band (``_outlasts``: a product that outlasts the transfer);
    with ``slow``, rank 1's communication stream runs only when nothing else can, so that a
    copy of ``x_full`` that does not wait for every band reads rows still in flight."""
    sim, kernels, _ = install(monkeypatch)  # (no kernel runs: the consumer's are torch ops)
    monkeypatch.setattr(engine, "_outlasts", lambda *a: one)
    g = torch.Generator().manual_seed(R * 100 + m)
    K, N, M = 24, 20, R * m
    comms = streams(sim, R)
    ts = _transports(kind, R, sim)
    p = make_plan(M, N, K, world_size=R, collective="all_gather", dtype_bits=32, interpreter=True,
                  chunks=chunks, blocked=True, transport="ce")  # fmt: skip
    assert p.path == "overlap" and p.bands_per_block >= 2, p.describe()
    contexts = [Context(t, comms[r], r) for r, t in enumerate(ts)]

    keep = (R, m) != (2, 64)

    L = 12

    def make():
        return [(torch.randn(m, K, generator=g), torch.randn(K, N, generator=g),
                 torch.full((M, N), float("nan")), torch.full((M, K) if keep else (0,),
                 float("nan")), torch.randn(M, L, generator=g), torch.full((K, L),
                 float("nan"))) for _ in range(R)]  # fmt: skip

    def issue(r, ctx, x, w, out, full, b, c):
        both = (b, c) if cover else ()
        engine._gathered(x, w, out, full, p, ctx, type(ts[r]), False, cover=both)
        parts = [out.flatten(), full.flatten(), c.flatten() if cover else c[:0].flatten()]
        return torch.cat(parts)  # (on the caller stream)

    try:
        calls = two_calls(sim, R, ahead, issue, contexts, make, slow)
    finally:
        kernels.close()
    for i, (inputs, outs, seen) in enumerate(calls):
        full = torch.cat([a[0] for a in inputs]).double()
        for r in range(R):
            b = inputs[r][4].double()
            want = [
                (full @ inputs[r][1].double()).flatten(),
                full.flatten() if keep else full[:0].flatten(),
                (full.t() @ b).flatten() if cover else b[:0].flatten(),
            ]
            check(outs, seen, torch.cat(want), i, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["peer", "host"])
def test_abort_sets_every_flag(kind, monkeypatch):
    """``fail`` marks the transport and ``abort`` sets every flag this rank waits on (1,024
    of them on the peer road, 2,048 on the host road: more than one ``cuStreamBatchMemOp``
    takes, which the fake driver refuses as the driver does) with stream memory writes on a
    side stream."""
    sim, kernels, _ = install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: Stream(sim, "side0"))
    t = _transports(kind, 2, sim)[0]
    flags = t._local_flags()
    assert len(flags) > MAX_BATCH
    try:
        t.fail("a peer died")
    finally:
        kernels.close()
    assert t.broken == "a peer died"
    unset = [a for a in flags if ctypes.c_uint32.from_address(a).value != SET]
    assert not unset, f"{len(unset)} of {len(flags)} flags not set"
    assert sim.memop_calls == -(-len(flags) // MAX_BATCH)
