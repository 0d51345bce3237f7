"""No devices: NCCL per chunk on simulated streams (``tests/_sim.py``), driven by the library's
own orchestration: the call engine's ``overlapped`` (the real kernel under Triton's
interpreter counting tiles per chunk, a stream wait per chunk's counter, one collective per
chunk) and ``_gathered`` (the all-gather, an event per chunk, cuBLAS per band after its
events), and the uneven exchanges' events (``exchange.split_forward``,
``dispatch_forward``, the embedding bags, all through ``engine.run_exchange``).

gloo and the interpreter run synchronously, so a missing wait cannot show in the multi-rank
tests; here every collective is an op of its rank's communication stream, run once every
rank's stream has reached it, and the scheduler runs the ranks and streams in adversarial
orders: one rank ahead (``ahead``), or the communication streams (``slow="comm"``) or the
caller streams (``slow="caller"``) only when nothing else can move. A collective that does
not wait for its chunk's counter or event reads NaN-poisoned or half-written rows; a
consumer that waits for the wrong chunk multiplies rows not yet arrived; the caller's copy of
the result after the call (what its next op reads) sees the collective unfinished unless the
caller stream waits. Two calls are in flight on every rank (one context: the chunk counters
and events of the first are reused by the second). Every result against float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _sim import Comm, Context, Group, check, install, streams, two_calls
from test_transport import _reference

from overlap.comm.nccl import TorchTransport
from overlap.ops import bags, engine, exchange
from overlap.plan import make_plan

SCHEDULES = [(0, None), (1, "comm"), (None, "caller")]  # (ahead, slow)


def _contexts(sim, R):
    comms, group = streams(sim, R), Group(R)
    return [
        Context(TorchTransport(Comm(sim, group, r), group, torch.device("cpu")), comms[r], r)
        for r in range(R)
    ]


@pytest.mark.parametrize(
    ("collective", "R", "M", "N", "chunks", "ahead", "slow"),
    [  # every schedule for the first (row bands, in place), one each for the others (CI time)
        *[("all_reduce", 2, 128, 40, 4, ahead, slow) for ahead, slow in SCHEDULES],
        ("all_reduce", 2, 16, 96, 3, 1, "comm"),  # column bands: slots, then copies to `out`
        ("reduce_scatter", 2, 128, 40, 4, None, "caller"),
        ("reduce_scatter", 3, 48, 96, 3, 0, None),
        ("all_to_all", 2, 128, 40, 4, 1, "comm"),
        ("all_to_all", 2, 16, 96, 3, None, "caller"),
    ],
)
def test_nccl_per_chunk(collective, R, M, N, chunks, ahead, slow, monkeypatch):
    """The reduce-scatters also compute a product on the caller stream after the GEMM
    (``produce``'s cover: the backward's weight gradient), checked too."""
    sim, kernels, _ = install(monkeypatch)
    g = torch.Generator().manual_seed(R * 1000 + M + N)
    K = 16
    contexts = _contexts(sim, R)
    p = make_plan(M, N, K, world_size=R, collective=collective, dtype_bits=32, interpreter=True,
                  chunks=chunks, blocked=False, transport="torch")  # fmt: skip
    assert p.path == "overlap" and p.n_chunks >= 2, p.describe()
    rows = M // R if p.spec.scatters else M
    cover = collective == "reduce_scatter"

    def make():
        return [(torch.randn(M, K, generator=g), torch.randn(N, K, generator=g).t(),
                 torch.full((rows, N), float("nan")), torch.randn(N, M, generator=g),
                 torch.full((N, K) if cover else (0,), float("nan")))
                for _ in range(R)]  # fmt: skip

    def issue(r, ctx, x, w, out, a, c):
        both = (a, x, c) if cover else ()
        engine.overlapped(x, w, out, p, None, ctx, TorchTransport, False, cover=both)
        return torch.cat((out.flatten(), c.flatten()))

    try:
        calls = two_calls(sim, R, ahead, issue, contexts, make, slow)
    finally:
        kernels.close()
    for i, (inputs, outs, seen) in enumerate(calls):
        xs, ws = [a[0] for a in inputs], [a[1] for a in inputs]
        for r in range(R):
            a, c = inputs[r][3:]
            c = (a.double() @ xs[r].double()) if cover else c.double()
            ref = torch.cat((_reference(p, xs, ws, r).flatten(), c.flatten()))
            check(outs, seen, ref, i, r, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("ahead", "slow"), SCHEDULES)
@pytest.mark.parametrize(("R", "m", "chunks"), [(2, 96, 3), (3, 64, 2)])
def test_nccl_all_gather_consumer(R, m, chunks, ahead, slow, monkeypatch):
    """``all_gather_matmul``'s engine with NCCL: one all-gather per chunk and an event after
    it; the caller multiplies its own rows at once and each band after its chunks' events;
    ``x_full`` kept; at R = 3 also a product of ``x_full^T`` from it at the end (``consume``'s
    cover without a blocked plan)."""
    sim, kernels, _ = install(monkeypatch)
    g = torch.Generator().manual_seed(R * 100 + m)
    K, N, M = 24, 20, R * m
    contexts = _contexts(sim, R)
    p = make_plan(M, N, K, world_size=R, collective="all_gather", dtype_bits=32, interpreter=True,
                  chunks=chunks, blocked=False, transport="torch")  # fmt: skip
    assert p.path == "overlap" and len(p.shard_bands) == chunks, p.describe()
    fulls, cover = [], R == 3

    def make():
        return [(torch.randn(m, K, generator=g), torch.randn(K, N, generator=g),
                 torch.full((M, N), float("nan")), torch.randn(M, 5, generator=g),
                 torch.full((K, 5) if cover else (0,), float("nan")))
                for _ in range(R)]  # fmt: skip

    def issue(r, ctx, x, w, out, b, c):
        fulls.append(torch.full((M, K), float("nan")))
        both = (b, c) if cover else ()
        engine._gathered(x, w, out, fulls[-1], p, ctx, TorchTransport, False, cover=both)
        return torch.cat((out.flatten(), c.flatten()))

    try:
        calls = two_calls(sim, R, ahead, issue, contexts, make, slow)
    finally:
        kernels.close()
    for i, (inputs, outs, seen) in enumerate(calls):
        full = torch.cat([a[0] for a in inputs]).double()
        for r in range(R):
            b, c = inputs[r][3:]
            c = (full.t() @ b.double()) if cover else c.double()
            ref = torch.cat(((full @ inputs[r][1].double()).flatten(), c.flatten()))
            check(outs, seen, ref, i, r, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fulls[i * R + r].double(), full)


def _splits(g, R, rows):
    """Random splits of ``rows`` rows per rank: ``sends[s][j]`` rows from s to j."""
    sends = []
    for _ in range(R):
        cut = sorted(torch.randint(0, rows + 1, (R - 1,), generator=g).tolist())
        sends.append(tuple(b - a for a, b in zip([0, *cut], [*cut, rows], strict=True)))
    return sends


def _exchange(sim, R, ahead, slow, monkeypatch, issue, make):
    """Two uneven exchanges in flight on every rank through ``engine.run_exchange`` (its
    context: rank r's while rank r issues)."""
    contexts = _contexts(sim, R)
    at = [0]
    monkeypatch.setattr(engine, "context", lambda group, device: contexts[at[0]])

    def issue_at(r, ctx, *args):
        at[0] = r
        return issue(r, *args)

    return two_calls(sim, R, ahead, issue_at, contexts, make, slow)


@pytest.mark.parametrize(("ahead", "slow"), SCHEDULES)
@pytest.mark.parametrize("direction", ["combine", "dispatch"])
def test_uneven_exchange_events(direction, ahead, slow, monkeypatch):
    """``split_forward`` (the product computed band by band on the caller, an event after
    each, each chunk sent after its event) and ``dispatch_forward`` (each chunk exchanged,
    an event after it, the caller's product of its rows after the event): uneven random
    splits, 3 ranks, 3 chunks."""
    sim, kernels, _ = install(monkeypatch)
    g = torch.Generator().manual_seed(7 if direction == "combine" else 8)
    R, rows, K, N, chunks = 3, 40, 16, 24, 3
    sends = _splits(g, R, rows)
    receives = [tuple(sends[s][r] for s in range(R)) for r in range(R)]

    def make():
        return [(torch.randn(rows, K, generator=g), torch.randn(K, N, generator=g),
                 torch.full((sum(receives[r]), N), float("nan"))) for r in range(R)]  # fmt: skip

    call = engine.Call("all_to_all", None, "sum", "auto", chunks)

    def issue(r, x, w, out):
        if direction == "combine":
            return exchange.split_forward(
                x, w, call, (sends[r], receives[r]), out, None, "matmul_all_to_all"
            )
        return exchange.dispatch_forward(x, w, call, (sends[r], receives[r]), out, None, False)[0]

    try:
        calls = _exchange(sim, R, ahead, slow, monkeypatch, issue, make)
    finally:
        kernels.close()
    for i, (inputs, outs, seen) in enumerate(calls):
        for r in range(R):
            parts = []
            for s in range(R):
                x, w = inputs[s][0].double(), inputs[r if direction == "dispatch" else s][1]
                lo = sum(sends[s][:r])
                parts.append(x[lo : lo + sends[s][r]] @ w.double())
            check(outs, seen, torch.cat(parts), i, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("ahead", "slow"), SCHEDULES)
def test_embedding_bags_events(ahead, slow, monkeypatch):
    """``embedding_bag_all_to_all``'s forward: each rank's tables pooled band by band on the
    caller (an event after each), each chunk sent after its event, the received columns
    copied into the result on the communication stream."""
    sim, kernels, _ = install(monkeypatch)
    g = torch.Generator().manual_seed(11)
    R, B, chunks, dims = 2, 8, 2, [(3, 5), (4,)]  # rank r's tables' widths
    rank_dims = [sum(d) for d in dims]
    b = B // R

    def make():
        out = []
        for r in range(R):
            tables = [torch.randn(10, d, generator=g) for d in dims[r]]
            lengths = [torch.randint(0, 4, (B,), generator=g) for _ in tables]
            offsets = [torch.cat([n.new_zeros(1), n.cumsum(0)[:-1]]) for n in lengths]
            indices = [torch.randint(0, 10, (int(n.sum()),), generator=g) for n in lengths]
            out.append((tables, indices, offsets))
        return out

    def issue(r, tables, indices, offsets):
        return bags._bags_forward(tables, indices, offsets, None, "sum", rank_dims, "auto",
                                  chunks, B)  # fmt: skip

    try:
        calls = _exchange(sim, R, ahead, slow, monkeypatch, issue, make)
    finally:
        kernels.close()
    for i, (inputs, outs, seen) in enumerate(calls):
        for r in range(R):
            parts = []
            for s in range(R):
                tables, indices, offsets = inputs[s]
                pooled = torch.cat([F.embedding_bag(ix, t.double(), o, mode="sum")
                                    for t, ix, o in zip(tables, indices, offsets, strict=True)],
                                   dim=1)  # fmt: skip
                parts.append(pooled[r * b : (r + 1) * b])
            check(outs, seen, torch.cat(parts, dim=1), i, r, rtol=1e-5, atol=1e-5)
