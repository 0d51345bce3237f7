"""No devices: properties of the chunk plan (hypothesis) and the planner's choices."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from overlap.collectives import COLLECTIVES
from overlap.comm.nccl import _chunks
from overlap.plan import MAX_CHUNKS, Tiles, make_gather_plan, make_plan
from overlap.plan.tiles import HOST_BAND_BYTES, HOST_BAND_ROWS


@st.composite
def plans(draw):
    R = draw(st.sampled_from([2, 3, 4, 8]))
    collective = draw(st.sampled_from(COLLECTIVES))
    M = draw(st.integers(1, 600))
    if collective != "all_reduce":
        M = R * max(1, M // R)
    N = draw(st.integers(1, 500))
    K = draw(st.integers(1, 64))
    chunks = draw(st.integers(2, 12))
    interp = draw(st.booleans())
    return make_plan(
        M,
        N,
        K,
        world_size=R,
        collective=collective,
        dtype_bits=16,
        interpreter=interp,
        chunks=chunks,
    )


@settings(max_examples=300, deadline=None)
@given(plans())
def test_slots_tile_the_buffer_and_rows_are_a_permutation(p):
    if p.path != "overlap":
        return
    M, N, t = p.M, p.N, p.tiles
    assert 2 <= p.n_chunks <= MAX_CHUNKS
    # chunk slots partition [0, M * N): every element written exactly once
    spans = sorted(
        (off, off + rows * cols)
        for off, rows, cols, _, _ in (p.chunk_slot(c) for c in range(p.n_chunks))
    )
    assert spans[0][0] == 0 and spans[-1][1] == M * N
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    # slot rows map onto the rows of x one to one
    assert sorted(p.x_row(q) for q in range(M)) == list(range(M))
    # tiles: every band but the last is whole tiles of every run; counts add up
    for a in range(p.n_row_bands - 1):
        assert p.band_run_rows(a) % t.block_m == 0
    for b in range(p.n_col_bands - 1):
        assert p.band_cols(b) % t.block_n == 0
    assert sum(p.tiles_per_chunk) == p.num_tile_rows * math.ceil(N / t.block_n)
    # a rank's share of each chunk is its own rows, contiguous, in order
    if p.collective != "all_reduce":
        Mr = M // p.world_size
        for c in range(p.n_chunks):
            _, rows, _, row0, _ = p.chunk_slot(c)
            h = rows // p.world_size
            for r in range(p.world_size):
                got = [p.x_row(row0 + r * h + i) for i in range(h)]
                assert got == list(range(got[0], got[0] + h))
                assert r * Mr <= got[0] and got[-1] < (r + 1) * Mr


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([2, 3, 4, 8]), st.sampled_from(COLLECTIVES), st.integers(1, 400),
    st.integers(1, 300), st.integers(2, 16), st.sampled_from([16, 32, 64]),
)  # fmt: skip
def test_blocked_plans_cut_each_rank_block_into_equal_bands(R, collective, m, N, chunks, bm):
    """The copy-engine transport's plans: the standard row layout, equal bands, each inside
    one rank's block, the same number in every block, tiles counted per band."""
    M = R * m
    t = Tiles(bm, 16, 16, 4, 1)
    p = make_plan(M, N, 8, world_size=R, collective=collective, dtype_bits=16, chunks=chunks,
                  tiles=t, blocked=True)  # fmt: skip
    assert p.path == "overlap" and p.blocked and p.runs == 1
    b = p.bands_per_block
    assert p.n_row_bands == R * b and p.n_chunks == R * b <= MAX_CHUNKS
    assert p.run_rows * b == m and p.run_rows_last == p.run_rows
    for c in range(p.n_chunks):
        off, rows, cols, row0, col0 = p.chunk_slot(c)
        assert (off, rows, cols, row0, col0) == (
            c * p.run_rows * N,
            p.run_rows,
            N,
            c * p.run_rows,
            0,
        )
        assert row0 // m == (row0 + rows - 1) // m  # inside one rank's block
    assert set(p.tiles_per_chunk) == {math.ceil(p.run_rows / bm) * math.ceil(N / 16)}
    assert 8 % p.group_m == 0 and math.ceil(p.run_rows / bm) % p.group_m == 0
    if collective == "all_reduce" and 2 * b <= chunks and m % (2 * b) == 0:
        assert m // (2 * b) < 4 * bm  # halved as long as a band keeps 4 tile rows
    with pytest.raises(ValueError, match="divisible"):
        make_plan(M + 1, N, 8, world_size=R, collective="reduce_scatter", dtype_bits=16,
                  chunks=chunks, tiles=t, blocked=True)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([2, 3, 4, 8]), st.integers(1, 300), st.integers(1, 64),
    st.one_of(st.none(), st.integers(2, 12)), st.booleans(), st.booleans(),
)  # fmt: skip
def test_gather_plans_cover_every_shard_row_once_and_never_depend_on_N(
    R, m, K, chunks, interp, blocked
):
    """The all-gather's plan: the same for every N (ranks' weights may differ in width), and
    its bands hand the consumer every row of every shard once, after the chunks carrying it."""
    M = R * m
    kw = dict(world_size=R, dtype_bits=16, interpreter=interp, chunks=chunks, blocked=blocked)
    p = make_gather_plan(M, K, **kw)
    for N in (1, 37, 8192):
        assert make_plan(M, N, K, collective="all_gather", **kw) == p
    if p.path != "overlap":
        return
    assert 1 <= p.n_chunks <= MAX_CHUNKS
    assert [q + i for q, h, _ in p.shard_bands for i in range(h)] == list(range(m))
    assert sorted(c for _, _, cs in p.shard_bands for c in cs) == list(range(p.n_chunks))
    if blocked:  # equal bands; chunk s * bands + k is band k of rank s's shard
        assert all(h == m // p.bands for _, h, _ in p.shard_bands) and m % p.bands == 0
        assert all(cs == tuple(s * p.bands + k for s in range(R))
                   for k, (_, _, cs) in enumerate(p.shard_bands))  # fmt: skip
    else:  # NCCL: chunk k's slot [R, h, K] holds band k of every shard, slots tile [M, K]
        at = 0
        for k, (q, h, cs) in enumerate(p.shard_bands):
            off, rows, width, row0, _ = p.chunk_slot(k)
            assert cs == (k,) and (off, rows, width, row0) == (at * K, R * h, K, R * q)
            at += rows
        assert at == M


def test_blocked_all_reduce_keeps_its_chunks_within_the_counters():
    """Halving all-reduce's bands stops at MAX_CHUNKS chunks (8 ranks, 64 chunks asked,
    a block of 65536 rows would otherwise give 64 bands per block: 512 counters)."""
    p = make_plan(8 * 65536, 16, 16, world_size=8, collective="all_reduce", dtype_bits=16,
                  chunks=64, blocked=True)  # fmt: skip
    assert p.path == "overlap" and p.n_chunks == 8 * p.bands_per_block == MAX_CHUNKS


def test_default_plans_for_the_bench_shapes():
    p = make_plan(4096, 8192, 4096, world_size=2, collective="all_reduce", dtype_bits=16)
    assert p.path == "overlap" and p.n_chunks == 4 and p.n_col_bands == 1
    p = make_plan(16384, 8192, 4096, world_size=2, collective="reduce_scatter", dtype_bits=16)
    assert p.path == "overlap" and p.n_chunks == 8 and p.chunk_rows == 2048 and p.run_rows == 1024


def test_plain_path_by_transport_and_link():
    """The default plain path comes from the GEMM's time against the overlapped call's extra
    host time (the copy engines' recorded calls cost less than NCCL per chunk) and from the
    transfer it could hide over the link (``plan.plain_reason``)."""

    def path(M, N, K, transport, link, R=2):
        return make_plan(M, N, K, world_size=R, collective="reduce_scatter", dtype_bits=16,
                         transport=transport, link=link).path  # fmt: skip

    # the o projection at 8B dims, 8192 tokens, TP 2 (1.4e11 FLOP, ~0.23 ms of GEMM)
    assert path(8192, 4096, 2048, "ce", "peer") == "overlap"
    assert path(8192, 4096, 2048, "torch", "peer") == "fallback"  # NCCL's ~0.4 ms of host
    # at TP 4 a GEMM must outlast 0.2 ms: o (~0.11 ms) stays plain, down (~0.4 ms) overlaps
    assert path(8192, 4096, 1024, "ce", "peer", R=4) == "fallback"
    assert path(8192, 4096, 3584, "ce", "peer", R=4) == "overlap"
    # 6.9e10 FLOP moving 4 MB: too little to hide over NVLink, worth it through host memory
    assert path(2048, 2048, 8192, "ce", "peer") == "fallback"
    assert path(2048, 2048, 8192, "ce", "host") == "overlap"
    assert path(2048, 2048, 8192, "torch", "host") == "fallback"
    for link in ("peer", "host", "network"):  # decode: nothing to gain anywhere
        assert path(16, 8192, 4096, "ce", link) == "fallback"
    # the all-gather judges N as K (each rank's N is its own): 8192 x 4096 rows gathered
    gather = make_plan(8192, 1, 4096, world_size=2, collective="all_gather", dtype_bits=16,
                       transport="ce", link="peer")  # fmt: skip
    assert gather.path == "overlap"
    gather = make_plan(8192, 1, 1024, world_size=2, collective="all_gather", dtype_bits=16,
                       transport="ce", link="peer")  # fmt: skip
    assert gather.path == "fallback" and "small product" in gather.reason


def test_consumer_one_product_where_it_outlasts_the_transfer():
    """An all-gather's consumer multiplies the other shards in one product where this rank's
    own product outlasts their transfer (``ops.engine._outlasts``, ``plan.gemm_outlasts``):
    over NVLink the 8B gate/up and the 70B projections, not the 8B q/k/v or o inputs'
    gradients; through host memory not at 8B dims (bf16, TP 2, 8192 tokens)."""
    from overlap.ops.engine import _outlasts

    def one(K, N, link, R=2, M=8192):
        p = make_plan(M, 1, K, world_size=R, collective="all_gather", dtype_bits=16,
                      blocked=True, transport="ce", link=link, chunks=4)  # fmt: skip
        return _outlasts(p, N, 2, link)

    assert one(4096, 14336, "peer") and one(4096, 7168, "peer")  # 8B w13, w2's dx
    assert not one(4096, 3072, "peer") and not one(4096, 2048, "peer")  # 8B qkv, o's dx
    assert one(8192, 5120, "peer") and one(8192, 4096, "peer")  # 70B qkv, o's dx
    assert not one(4096, 14336, "host") and not one(4096, 14336, None)
    assert not one(4096, 14336, "peer", R=8)  # seven shards to receive


@pytest.mark.parametrize("collective", [*COLLECTIVES, "all_gather"])
@pytest.mark.parametrize("R", [2, 4])
def test_host_road_bands(collective, R):
    """The copy engines' host road moves each band twice in a row, so its blocked plans cut
    every rank block into bands of at most about ``HOST_BAND_BYTES`` (and at least
    ``HOST_BAND_ROWS`` rows); over NVLink, or with ``chunks`` given, they stay as they were."""

    def plan(M, N, K, link, chunks=None):
        return make_plan(M, N, K, world_size=R, collective=collective, dtype_bits=16,
                         blocked=True, transport="ce", link=link, chunks=chunks)  # fmt: skip

    for M, N, K in [(8192, 4096, 7168), (8192, 3072, 4096), (4096, 8192, 28672),
                    (4096, 4096, 8192)]:  # fmt: skip
        peer, host = plan(M, N, K, "peer"), plan(M, N, K, "host")
        assert peer.path == host.path == "overlap", (peer.describe(), host.describe())
        width = K if collective == "all_gather" else N  # (the all-gather moves x's rows)
        band = host.run_rows * width * 2
        assert host.run_rows >= min(HOST_BAND_ROWS, peer.run_rows), host.describe()
        assert band <= HOST_BAND_BYTES or host.run_rows <= HOST_BAND_ROWS, host.describe()
        assert host.bands_per_block >= peer.bands_per_block, (peer.describe(), host.describe())
        assert plan(M, N, K, "host", 4).bands_per_block == plan(M, N, K, "peer", 4).bands_per_block
    if collective == "all_reduce":  # fewer rows than ranks (the interpreter overlaps them)
        tiny = make_plan(1, 64, 64, world_size=R, collective=collective, dtype_bits=16,
                         interpreter=True, blocked=True, transport="ce", link="host")  # fmt: skip
        assert tiny.path == "fallback", tiny.describe()
    if R == 2:  # 8B dims, 8192 tokens: 32 MB rank blocks, 8 bands of 512 rows
        at_8b = plan(8192, 4096, 7168, "host")
        assert at_8b.bands_per_block == 8 and at_8b.run_rows == 512, at_8b.describe()


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_plain_path_choices(collective):
    small = make_plan(16, 8192, 4096, world_size=2, collective=collective, dtype_bits=16)
    assert small.path == "fallback" and "small product" in small.reason
    forced = make_plan(16, 8192, 4096, world_size=2, collective=collective, dtype_bits=16, chunks=2)
    assert forced.path == "overlap" and forced.n_col_bands == 2 and forced.n_row_bands == 1
    one = make_plan(4096, 8192, 4096, world_size=1, collective=collective, dtype_bits=16)
    assert one.path == "fallback" and "world size 1" in one.reason
    tiny = make_plan(
        30, 20, 8, world_size=2, collective=collective, dtype_bits=16, interpreter=True, chunks=2
    )
    assert tiny.path == "fallback" and "too few rows" in tiny.reason


def test_bad_plan_arguments():
    with pytest.raises(ValueError, match="collective"):
        make_plan(8, 8, 8, world_size=2, collective="gather", dtype_bits=16)
    with pytest.raises(ValueError, match="divisible"):
        make_plan(5, 8, 8, world_size=2, collective="reduce_scatter", dtype_bits=16)
    with pytest.raises(ValueError, match="chunks"):
        make_plan(4096, 8, 8, world_size=2, collective="all_reduce", dtype_bits=16, chunks=1)


class _ThreadComm:
    """R ranks as R threads of one process: each collective is a barrier-separated exchange
    through shared lists, with NCCL's semantics (sum; rank r gets piece r). Each rank
    publishes a copy, as a rank may overwrite its buffer before a slower one has read it."""

    def __init__(self, R: int) -> None:
        self.R, self.barrier, self.box = R, threading.Barrier(R), [None] * R

    def _exchange(self, rank: int, value):
        self.box[rank] = value
        self.barrier.wait()
        everyone = list(self.box)
        self.barrier.wait()  # nobody overwrites `box` before all have read it
        return everyone

    def rank(self, r: int):
        comm = self

        class View:
            def all_reduce(self, buf):
                buf.copy_(sum(comm._exchange(r, buf.clone())))

            def reduce_scatter(self, out, inp):
                total = sum(comm._exchange(r, inp.clone()))
                out.copy_(total.chunk(comm.R)[r])

            def all_to_all(self, outs, ins):
                pieces = comm._exchange(r, [t.clone() for t in ins])
                for s in range(comm.R):
                    outs[s].copy_(pieces[s][r])

        return View()


@st.composite
def tiled_plans(draw):
    R = draw(st.sampled_from([2, 3, 4]))
    collective = draw(st.sampled_from(COLLECTIVES))
    M = draw(st.integers(1, 300))
    if collective != "all_reduce":
        M = R * max(1, M // R)
    N, K = draw(st.integers(1, 200)), draw(st.integers(1, 16))
    t = Tiles(
        draw(st.sampled_from([16, 32, 64, 128])), draw(st.sampled_from([16, 32, 64])), 32, 4, 1
    )
    chunks = draw(st.integers(2, 12))
    return make_plan(
        M, N, K, world_size=R, collective=collective, dtype_bits=32, chunks=chunks, tiles=t
    )


@settings(max_examples=150, deadline=None)
@given(tiled_plans(), st.integers(0, 2**31))
def test_chunk_collectives_restore_the_standard_layout(p, seed):
    """Every rank's product written into slots as the plan says, then NCCL's chunks on R
    simulated ranks: the results equal the plain collective of the plain products, and every
    element of the result is written (the result starts as NaN)."""
    if p.path != "overlap":
        return
    R, M, N = p.world_size, p.M, p.N
    g = torch.Generator().manual_seed(seed)
    prods = [torch.randint(-50, 50, (M, N), generator=g).double() for _ in range(R)]
    total = sum(prods)
    Mr = M // R
    comm, results, errors = _ThreadComm(R), [None] * R, []

    def rank(r):
        try:
            flat = torch.full((M * N,), float("nan"), dtype=torch.float64)
            for c in range(p.n_chunks):  # what the GEMM stores: slot rows in x_row order
                off, rows, cols, row0, col0 = p.chunk_slot(c)
                idx = torch.tensor([p.x_row(row0 + i) for i in range(rows)])
                flat[off : off + rows * cols] = prods[r][idx, col0 : col0 + cols].reshape(-1)
            out = torch.full((Mr if p.collective == "reduce_scatter" else M, N), float("nan"))
            out = out.double()
            recv = None
            if p.collective != "all_reduce" and p.n_col_bands > 1:
                recv = torch.full((out.numel(),), float("nan"), dtype=torch.float64)
            slots = out.view(-1) if p.collective == "all_reduce" and p.n_col_bands == 1 else flat
            if slots is not flat:
                slots.copy_(flat)
            _chunks(p, comm.rank(r), slots, out, recv, lambda c: None)
            results[r] = out
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))
            comm.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(R)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for r in range(R):
        if p.collective == "all_reduce":
            ref = total
        elif p.collective == "reduce_scatter":
            ref = total[r * Mr : (r + 1) * Mr]
        else:
            ref = torch.cat([prods[s][r * Mr : (r + 1) * Mr] for s in range(R)])
        assert torch.equal(results[r], ref), (r, p.describe())
