"""Validation mode (``overlap.configure(validate=True)``) on 2 gloo ranks (CPU, Triton
interpreter):

- every field of the fingerprint (``overlap.guard.fingerprint``): a call where only that field
  differs between the ranks raises ``RankMismatchError`` on every rank before any collective;
- calls that are valid without validation run with it and are right: ``K`` differing after
  the matmul, ``N`` differing in ``all_gather_matmul`` (and the exchanges' own sizes);
- ``embedding_bag_all_to_all(rank_dims=None)`` and ``overlap.tune`` agree before their host
  collectives, so a silent peer is validation's ``TimeoutError``, not the group's timeout;
- after a ``TimeoutError`` a group says it fell out of step (and what to do) until every rank
  has failed that call; a late rank raises there too, and then the ranks go on in step;
- the watch of a call's collectives (``guard.Watch``, CUDA only; here with a stand-in stream
  and event): its timer thread aborts a call whose host is held inside its issue, and its
  clock starts at the first collective, not before (a first call's compilation);
- ``configure``'s argument checks.
"""

from __future__ import annotations

import math
import random
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _dist import _ALL_GATHER, TOL, count_collectives, mismatch, spawn

import overlap
from overlap import guard
from overlap.comm import TorchTransport
from overlap.context import forget, set_tuned, tuned_key

F32, F16 = torch.float32, torch.float16
CPU = torch.device("cpu")
_HOST = ("all_gather_object", "broadcast_object_list", "barrier")


def _count_all() -> dict:
    """Count every collective overlap can issue, host ones included."""
    return count_collectives(_ALL_GATHER, *_HOST)


def _blocked_on_rank1(rank: int):
    """A context manager: on rank 1 the transport choice returns NCCL with the copy engines'
    blocked layout (the same name), so that only the plan's layout differs."""
    import contextlib

    import overlap.comm as comm

    @contextlib.contextmanager
    def patch():
        real = comm.select
        if rank == 1:
            blocked = type("BlockedTorch", (TorchTransport,), {"blocked": True})
            comm.select = lambda *a, **k: blocked
        forget()  # (decisions are kept by signature)
        try:
            yield
        finally:
            comm.select = real
            forget()

    return patch()


def _mismatch_cases(rank: int) -> dict:
    """Field -> a call in which only that field differs between rank 0 and rank 1."""
    g = torch.Generator().manual_seed(11)

    def r(*shape, dtype=F32):
        return torch.randn(*shape, generator=g).to(dtype)

    one = bool(rank)
    mc, ag = overlap.matmul_collective, overlap.all_gather_matmul
    dt = F16 if one else F32
    ids = torch.arange(250) % 2
    splits = [100, 150] if rank == 0 else [150, 100]
    receives = [100, 150] if rank == 0 else [150, 100]
    kw = dict(input_split_sizes=splits, output_split_sizes=receives)

    def plain_on_rank1():
        key = tuned_key(256, 96, 64, F32, "all_reduce")
        set_tuned(None, CPU, key, "plain" if one else None)
        forget()
        try:
            mc(r(256, 64), r(64, 96))  # rank 0: the default plan (overlapped)
        finally:
            set_tuned(None, CPU, key, None)
            forget()

    def blocked(call):
        def run():
            with _blocked_on_rank1(rank):
                call()

        return run

    def bags(B, dims, mode="sum", rank_dims=True):
        tables = [r(10, 2)]
        idx, off = [torch.arange(B) % 10], [torch.arange(B)]
        overlap.embedding_bag_all_to_all(tables, idx, off, mode=mode,
                                         rank_dims=dims if rank_dims else None)  # fmt: skip

    def moe(which, K=64, N=64):
        x, w = r(250, K), r(2, K, N)
        if which == "combine":
            overlap.grouped_matmul_all_to_all(x, w, ids, chunks=2, **kw)
        else:
            overlap.all_to_all_grouped_matmul(x, w, ids, chunks=2, **kw)

    return {
        # after the matmul: matmul_<collective>(<op>) M N dtype transport rows cols
        "op: the collective": lambda: mc(r(256, 64), r(64, 96),
                                         "reduce_scatter" if one else "all_to_all", chunks=2),
        "op: the reduction": lambda: mc(r(256, 64), r(64, 96), op="avg" if one else "sum",
                                        chunks=2),
        "M": lambda: mc(r(192 if one else 256, 64), r(64, 96), chunks=3 if one else 4),
        "N": lambda: mc(r(256, 64), r(64, 90 if one else 96), chunks=2),
        "dtype": lambda: mc(r(256, 64, dtype=dt), r(64, 96, dtype=dt), chunks=2),
        "band rows": lambda: mc(r(256, 64), r(64, 96), chunks=4 if one else 2),
        "band columns": lambda: mc(r(32, 64), r(64, 96), chunks=3 if one else 2),
        "transport": lambda: mc(r(256, 64), r(64, 96), chunks=2,
                                backend="cupy" if one else "torch"),
        "layout": blocked(lambda: mc(r(256, 64), r(64, 96), chunks=2)),
        "plain path": plain_on_rank1,
        # before the matmul: all_gather_matmul M K dtype transport rows
        "gather M": lambda: ag(r(192 if one else 128, 64), r(64, 40), chunks=3 if one else 2),
        "gather K": lambda: ag(r(128, 32 if one else 64), r(32 if one else 64, 40), chunks=2),
        "gather dtype": lambda: ag(r(128, 64, dtype=dt), r(64, 40, dtype=dt), chunks=2),
        "gather band rows": lambda: ag(r(128, 64), r(64, 40), chunks=4 if one else 2),
        "gather transport": lambda: ag(r(128, 64), r(64, 40), chunks=2,
                                       backend="cupy" if one else "torch"),
        "gather layout": blocked(lambda: ag(r(128, 64), r(64, 40), chunks=2)),
        "op: all_gather_matmul vs matmul_all_reduce": lambda: (
            mc(r(256, 64), r(64, 40), chunks=2) if one else ag(r(128, 64), r(64, 40), chunks=2)
        ),
        # uneven exchanges: <op> width dtype transport chunks, and the splits
        "op: MoE combine vs dispatch": lambda: moe("dispatch" if one else "combine"),
        "exchange width (N)": lambda: overlap.matmul_all_to_all(
            r(250, 64), r(64, 90 if one else 96), chunks=2, **kw),
        "dispatch width (K)": lambda: moe("dispatch", K=48 if one else 64),
        "exchange dtype": lambda: overlap.matmul_all_to_all(
            r(250, 64, dtype=dt), r(64, 96, dtype=dt), chunks=2, **kw),
        "exchange chunks": lambda: overlap.matmul_all_to_all(
            r(250, 64), r(64, 96), chunks=4 if one else 2, **kw),
        "exchange transport": lambda: overlap.matmul_all_to_all(
            r(250, 64), r(64, 96), chunks=2, backend="cupy" if one else "torch", **kw),
        "splits": lambda: overlap.matmul_all_to_all(
            r(250, 64), r(64, 96), chunks=2, input_split_sizes=splits,
            output_split_sizes=receives if one else [100, 140]),
        # embedding bags: bags mode (B with the splits fixes rank_dims); here the splits agree
        "bags B": lambda: bags(4, [4, 2]) if one else bags(8, [2, 1]),
        "bags mode": lambda: bags(8, [2, 2], mode="mean" if one else "sum"),
        "bags rank_dims=None on one rank": lambda: bags(8, [2, 2], rank_dims=one),
    }  # fmt: skip


def _mismatches(rank, R):
    overlap.configure(validate=True, timeout=60)
    counts = _count_all()
    failures = []
    for what, call in _mismatch_cases(rank).items():
        before = dict(counts)
        try:
            call()
            failures.append(f"{what}: ranks disagree and no error was raised")
        except overlap.RankMismatchError as e:
            if "rank 0:" not in str(e) or "rank 1:" not in str(e):
                failures.append(f"{what}: the error lacks the ranks' fingerprints: {e}")
        except Exception as e:
            failures.append(f"{what}: {type(e).__name__} instead of RankMismatchError: {e}")
        ran = {k: counts[k] - before[k] for k in counts if counts[k] != before[k]}
        if ran:
            failures.append(f"{what}: collectives ran before the mismatch was found: {ran}")
    # still in step: a matching call works
    x, w = torch.ones(64, 32), torch.ones(32, 48)
    y = overlap.matmul_allreduce(x, w, chunks=2)
    if not torch.equal(y, torch.full((64, 48), 64.0)):
        failures.append("a matching call after the mismatches is wrong")
    overlap.configure(validate=False)
    return failures


def test_every_fingerprint_field_is_caught_before_launch():
    spawn(_mismatches, 2)


def _splits(rank):
    """Rows sent to and received from each rank (2 ranks) of the exchange cases."""
    every = [[100, 150], [150, 100]]
    return every[rank], [every[s][rank] for s in range(2)]


def _valid(rank, R, seed):
    """Calls whose ranks differ only in what never travels, with validation on: each result
    against float64 from every rank's inputs, outputs poisoned with NaN."""
    overlap.configure(validate=True, timeout=60)
    failures = []
    g = torch.Generator().manual_seed(seed)
    Ks, Ns = (40, 24), (40, 24)  # rank r's own K (after the matmul) or N (before it)
    M, N, K = 64, 48, 32
    xs = [torch.randn(M, Ks[r], generator=g) for r in range(R)]
    ws = [torch.randn(Ks[r], N, generator=g) for r in range(R)]
    prods = [(xs[r].double() @ ws[r].double()) for r in range(R)]
    m = M // R
    refs = {
        "all_reduce": sum(prods),
        "reduce_scatter": sum(prods)[rank * m : (rank + 1) * m],
        "all_to_all": torch.cat([p[rank * m : (rank + 1) * m] for p in prods]),
    }
    for chunks in (2, None):
        for coll, ref in refs.items():
            out = torch.full(ref.shape, float("nan"))
            overlap.matmul_collective(xs[rank], ws[rank], coll, out=out, chunks=chunks)
            why = mismatch(out, ref, TOL[F32])
            failures += [f"{coll} K differing, chunks={chunks}: {why}"] if why else []
        # all_gather_matmul: the ranks' N differ
        shards = [torch.randn(m, K, generator=g) for _ in range(R)]
        wg = [torch.randn(K, Ns[r], generator=g) for r in range(R)]
        full = torch.cat(shards).double()
        out = torch.full((M, Ns[rank]), float("nan"))
        y, xf = overlap.all_gather_matmul(shards[rank], wg[rank], out=out, chunks=chunks,
                                          return_gathered=True)  # fmt: skip
        for what, got, want in (("y", y, full @ wg[rank].double()), ("x_full", xf, full)):
            why = mismatch(got, want, TOL[F32])
            failures += [f"all_gather_matmul N differing, chunks={chunks}: {what}: {why}"] if why \
                else []  # fmt: skip
    # the exchanges: the combine and the all-to-all with splits send x @ w (K is their own),
    # the dispatch sends x (N is its own)
    sends, receives = _splits(rank)
    kw = dict(input_split_sizes=sends, output_split_sizes=receives, chunks=2)
    every = [_splits(s)[0] for s in range(R)]
    xe = [torch.randn(250, Ks[r], generator=g) for r in range(R)]
    we = [torch.randn(2, Ks[r], N, generator=g) for r in range(R)]
    ids = [torch.randint(0, 2, (250,), generator=g) for _ in range(R)]

    def block(s, t, rows):  # rank s's rows for rank t
        a = sum(every[s][:t])
        return rows[a : a + every[s][t]]

    ys = [torch.stack([xe[s][i].double() @ we[s][ids[s][i]].double() for i in range(250)])
          for s in range(R)]  # fmt: skip
    ref = torch.cat([block(s, rank, ys[s]) for s in range(R)])
    out = torch.full(ref.shape, float("nan"))
    overlap.grouped_matmul_all_to_all(xe[rank], we[rank], ids[rank], out=out, **kw)
    why = mismatch(out, ref, TOL[F32])
    failures += [f"MoE combine K differing: {why}"] if why else []
    ys = [xe[s].double() @ we[s][0].double() for s in range(R)]
    ref = torch.cat([block(s, rank, ys[s]) for s in range(R)])
    out = torch.full(ref.shape, float("nan"))
    overlap.matmul_all_to_all(xe[rank], we[rank][0], out=out, **kw)
    why = mismatch(out, ref, TOL[F32])
    failures += [f"matmul_all_to_all with splits, K differing: {why}"] if why else []
    xd = [torch.randn(250, K, generator=g) for _ in range(R)]
    wd = [torch.randn(2, K, Ns[r], generator=g) for r in range(R)]
    got_rows = torch.cat([block(s, rank, xd[s]) for s in range(R)])
    rid = torch.randint(0, 2, (got_rows.shape[0],), generator=torch.Generator().manual_seed(rank))
    ref = torch.stack([got_rows[i].double() @ wd[rank][rid[i]].double()
                       for i in range(got_rows.shape[0])])  # fmt: skip
    out = torch.full(ref.shape, float("nan"))
    overlap.all_to_all_grouped_matmul(xd[rank], wd[rank], rid, out=out, **kw)
    why = mismatch(out, ref, TOL[F32])
    failures += [f"MoE dispatch N differing: {why}"] if why else []
    overlap.configure(validate=False)
    return failures


def test_calls_valid_without_validation_run_with_it():
    spawn(_valid, 2, random.randrange(1 << 30))


def _silent_peer(rank, R):
    """Rank 1 makes the groups, then never calls: rank 0's calls that start with a host
    collective raise validation's TimeoutError (2 s), not the group's (20 s). The road's
    collective (``comm.road``, a group's first CUDA call) is played on gloo without CUDA."""
    from overlap.comm import choice

    store = dist.distributed_c10d._get_default_store()
    groups = [dist.new_group([0, 1], timeout=timedelta(seconds=20)) for _ in range(3)]

    def route(group, device):  # the real one's collective
        everyone: list = [None] * R
        dist.all_gather_object(everyone, rank, group=group)
        return "host"

    choice.route = route
    overlap.configure(validate=True, timeout=2)
    failures = []
    if rank == 0:
        x, w = torch.randn(64, 32), torch.randn(32, 48)
        tables, idx, off = [torch.randn(10, 2)], [torch.arange(8) % 10], [torch.arange(8)]
        for what, call in (
            ("embedding_bag_all_to_all(rank_dims=None)",
             lambda: overlap.embedding_bag_all_to_all(tables, idx, off, group=groups[0])),
            ("tune", lambda: overlap.tune(x, w, candidates=(2,), iters=1, use_cache=False,
                                          group=groups[1])),
            ("the road", lambda: choice.road(groups[2], torch.device("cuda", 0), False)),
        ):  # fmt: skip
            t0 = time.monotonic()
            try:
                call()
                failures.append(f"{what}: no error although rank 1 never called")
            except TimeoutError as e:
                if "[1]" not in str(e):
                    failures.append(f"{what}: the error does not name rank 1: {e}")
            except Exception as e:
                failures.append(f"{what}: {type(e).__name__}, not TimeoutError: {e}")
            took = time.monotonic() - t0
            if not 2 <= took < 10:
                failures.append(f"{what}: raised after {took:.1f} s for a 2 s timeout")
        store.set("test/done", "1")
    else:
        store.wait(["test/done"], timedelta(seconds=120))
    overlap.configure(validate=False)
    return failures


_silent_peer.no_teardown = True


def test_host_collectives_come_after_the_agreement():
    spawn(_silent_peer, 2)


def _out_of_step(rank, R):
    """Rank 1 reaches call #0 late: rank 0 times out there, and its next call says the group
    fell out of step; rank 1 then raises at call #0 too, and both go on in step (right
    results). Then rank 1 stops calling: rank 0's calls keep saying so, at once."""
    store = dist.distributed_c10d._get_default_store()
    overlap.configure(validate=True, timeout=1)
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(64, 32, generator=gen) for _ in range(R)]
    ws = [torch.randn(32, 48, generator=gen) for _ in range(R)]
    ref = sum(x.double() @ w.double() for x, w in zip(xs, ws, strict=True))
    call = lambda: overlap.matmul_allreduce(xs[rank], ws[rank], chunks=2)  # noqa: E731
    failures = []

    def expect(exc, words: tuple[str, ...], what: str, quick: bool = False) -> None:
        t0 = time.monotonic()
        try:
            call()
            failures.append(f"{what}: no error")
        except exc as e:
            missing = [w for w in words if w not in str(e)]
            if missing:
                failures.append(f"{what}: the error lacks {missing}: {e}")
        except Exception as e:
            failures.append(f"{what}: {type(e).__name__}, not {exc.__name__}: {e}")
        if quick and time.monotonic() - t0 > 0.5:
            failures.append(f"{what}: took {time.monotonic() - t0:.1f} s")

    if rank == 0:
        expect(TimeoutError, ("[1]", "call #0"), "the late peer")
        words = ("fell out of step at call #0", "overlap.release", "new process group")
        expect(RuntimeError, words, "the next call", quick=True)
        store.set("test/timed_out", "1")
        store.wait(["test/late_done"], timedelta(seconds=60))
    else:
        store.wait(["test/timed_out"], timedelta(seconds=60))
        expect(TimeoutError, ("gave up on call #0",), "arriving late")
        store.set("test/late_done", "1")
    y = call()  # in step again
    why = mismatch(y, ref, TOL[F32])
    failures += [f"after both failed call #0: {why}"] if why else []
    if rank == 0:  # rank 1 stops calling
        expect(TimeoutError, ("[1]",), "the silent peer")
        for _ in range(2):
            expect(
                RuntimeError, ("fell out of step at call #2",), "after the silent peer", quick=True
            )
        store.set("test/end", "1")
    else:
        store.wait(["test/end"], timedelta(seconds=60))
    overlap.configure(validate=False)
    return failures


_out_of_step.no_teardown = True


def test_a_group_out_of_step_says_so():
    spawn(_out_of_step, 2)


def _made_again(rank, R, d):
    """What the library keeps per group after ``destroy_process_group`` and a new default group
    numbering the ranks the other way (torch names the groups from "0" again): validation's
    call count, ranks and store (an uneven exchange's splits are compared by rank), and
    ``overlap.tune``'s choice (kept for the old group only). A refused uneven call is not
    counted in ``overlap.stats``."""
    failures = []
    overlap.configure(validate=True, timeout=30)

    def exchange(r: int, sends: list, receives: list) -> torch.Tensor:
        return overlap.matmul_all_to_all(xs[r], w, input_split_sizes=sends,
                                         output_split_sizes=receives)  # fmt: skip

    splits = [([10, 15], [10, 12]), ([12, 8], [15, 8])]  # rank r: (sends, receives)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(sum(s), 16, generator=g) for s, _ in splits]
    w = torch.randn(16, 24, generator=g)

    def want(r: int) -> torch.Tensor:
        return torch.cat([(xs[s].double() @ w.double())[sum(splits[s][0][:r]) :][: splits[s][0][r]]
                          for s in range(R)])  # fmt: skip

    exchange(rank, *splits[rank])
    overlap.stats(reset=True)
    bad = ([10, 15], [10, 13]) if rank == 0 else splits[1]  # (rank 0 receives one row too many)
    try:
        exchange(rank, *bad)
        failures.append("splits that do not match: no error")
    except overlap.RankMismatchError:
        pass
    if overlap.stats():
        failures.append(f"a refused uneven call was counted: {overlap.stats()}")
    M, K, N = 64, 16, 24
    x = torch.randn(M, K, generator=g)
    wt = torch.randn(K, N, generator=g)
    overlap.tune(x, wt, "all_reduce", candidates=("plain",), iters=1, use_cache=False)
    dist.destroy_process_group()
    r = R - 1 - rank
    dist.init_process_group("gloo", init_method=f"file://{d}/renumbered", rank=r, world_size=R)
    dist.barrier()
    try:
        why = mismatch(exchange(r, *splits[r]), want(r), TOL[F32])
        failures += [f"after a new default group: {why}"] if why else []
    except Exception as e:  # noqa: BLE001 (reported)
        failures.append(f"after a new default group: {type(e).__name__}: {e}")
    p = overlap.plan(x, wt, "all_reduce")
    if "overlap.tune" in p.reason:
        failures.append(f"the new default group took the old one's tuned choice: {p.reason}")
    overlap.configure(validate=False)
    dist.destroy_process_group()  # (the harness's own group again, for its teardown)
    dist.init_process_group("gloo", init_method=f"file://{d}/again", rank=rank, world_size=R)
    dist.barrier()
    return failures


def test_a_default_group_made_again(tmp_path):
    spawn(_made_again, 2, str(tmp_path))


@pytest.mark.parametrize(
    ("kw", "exc"),
    [
        ({"validate": "no"}, TypeError),
        ({"validate": 1}, TypeError),
        ({"timeout": "10"}, TypeError),
        ({"timeout": True}, TypeError),
        ({"timeout": math.inf}, ValueError),
        ({"timeout": math.nan}, ValueError),
        ({"timeout": 0}, ValueError),
        ({"timeout": -1.0}, ValueError),
    ],
)
def test_configure_rejects_bad_arguments(kw, exc):
    from overlap import guard

    before = dict(guard.settings._settings)
    with pytest.raises(exc, match=next(iter(kw))):
        overlap.configure(**kw)
    assert guard.settings._settings == before
    overlap.configure(timeout=7)
    assert guard.timeout() == 7.0
    overlap.configure(**before)


class _Stream:
    """A stand-in CUDA stream whose work is done once ``done`` is set (``_Event``)."""

    device = "cuda:0"

    def __init__(self) -> None:
        self.done = threading.Event()


class _Event:
    def record(self, stream: _Stream) -> None:
        self.stream = stream

    def query(self) -> bool:
        return self.stream.done.is_set()


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    keep = guard.timeout()
    overlap.configure(timeout=0.5)
    yield _Stream()
    overlap.configure(timeout=keep)


def test_watch_releases_a_host_held_in_the_issue(fake_cuda):
    """Found on two GPUs: a kernel's first launch after a collective stuck on a dead peer held
    the host inside CUDA (not lazy module loading: EAGER loading hung the same; the cause is
    not known), before any wait of the watch's. Here the 'issue' holds until something ends
    the stuck collective: only the timer thread's abort can, and the call then raises
    ``TimeoutError``."""
    stream, aborted = fake_cuda, []

    def abort(why: str) -> None:  # ends the stuck collective: the stream's work is done
        aborted.append(threading.current_thread() is not threading.main_thread())
        assert "did not finish within 0.5 s" in why and "release" in why
        stream.done.set()

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 0.5 s"):
        with guard.Watch(stream, abort, "the call"):
            guard.arm()  # right before the first collective
            assert stream.done.wait(10), "the host was never released"
    assert aborted == [True]
    assert time.monotonic() - t0 < 5


def test_watch_counts_from_the_first_collective(fake_cuda):
    """Host work before ``arm`` (a first call compiles its kernel) does not count, and a call
    whose collectives finish in time is neither aborted nor raises; neither does a call
    whose issue raised, which gets its own exception back."""
    stream, aborted = fake_cuda, []
    with guard.Watch(stream, lambda why: aborted.append(1), "the call"):
        time.sleep(1.0)  # twice the timeout, before the first collective
        guard.arm()
        stream.done.set()
    time.sleep(0.7)  # past the timer's deadline: it must have been stopped
    assert aborted == []
    with pytest.raises(KeyError):
        with guard.Watch(_Stream(), lambda why: aborted.append(1), "the call"):
            guard.arm()
            raise KeyError("issue")
    time.sleep(0.7)
    assert aborted == []
    guard.arm()  # no call is being issued: nothing to start
    time.sleep(0.7)
    assert aborted == []
