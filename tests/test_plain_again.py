"""The plain path's fast lane (``ops.engine.plain_again``): an eager call without ``out`` or
autograd whose signature the calls' memo holds with the plain path runs ``x @ w`` and the
collective without the argument checks or the decision (so that the plain path's host time
stays near torch's own).

- Repeated calls with new inputs (2-D and 3-D ``x``, sum and avg, every matmul + collective
  op) on 2 gloo ranks: each result against float64, the calls after the first taking the
  fast lane (``run_after`` entered once per signature), ``overlap.stats`` counting every call.
- After a memo hit the checks still answer invalid arguments (a float ``chunks`` equal to a
  memoized int, an unhashable ``op``, ``out`` given, inputs that need a gradient, validation
  mode), at world size 1.
- An overlapped eager call (``chunks=2`` on 2 gloo ranks, the kernel interpreted) makes its
  signature once: ``plain_again`` hands the one it made to ``run_after``.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
import torch.distributed as dist
from _dist import TOL, mismatch, spawn

import overlap
from overlap import graphs
from overlap.ops import dense, engine

OPS = ("all_reduce", "reduce_scatter", "all_to_all")


@contextlib.contextmanager
def _full_way_counted():
    """Counts the ``dense.run_after`` calls (the full way) in the list yielded."""
    entered, orig = [0], dense.run_after

    def counted(*a, **k):
        entered[0] += 1
        return orig(*a, **k)

    dense.run_after = counted
    try:
        yield entered
    finally:
        dense.run_after = orig


def _repeated(rank, R, seed):
    """Each op, 3-D and 2-D ``x``, sum and avg: 4 calls each with new ``x`` (the same ``w``)."""
    failures = []
    with _full_way_counted() as entered:
        _repeat_each(rank, R, seed, entered, failures)
    dist.barrier()
    return failures


def _repeat_each(rank, R, seed, entered, failures) -> None:
    overlap.stats(reset=True)
    calls = 0
    for op_i, name in enumerate(OPS):
        for lead in ((3, 8), (24,)):  # (M = 24 divisible by R; 3 rows of x's first dim not)
            for red in ("sum", "avg") if name != "all_to_all" else ("sum",):
                K, N = 16, 8
                gw = torch.Generator().manual_seed(seed + op_i)
                w = torch.randn(K, N, generator=gw)
                before = entered[0]
                for i in range(4):
                    xs = [torch.randn(*lead, K, generator=torch.Generator().manual_seed(
                        seed + 1000 * i + 100 * op_i + r)) for r in range(R)]  # fmt: skip
                    got = overlap.matmul_collective(xs[rank], w, name, op=red)
                    calls += 1
                    prods = [(x.double() @ w.double()).reshape(-1, N) for x in xs]
                    if name == "all_reduce":
                        ref = sum(prods).reshape(*lead, N) / (R if red == "avg" else 1)
                    elif name == "reduce_scatter":
                        m = prods[0].shape[0] // R
                        ref = sum(prods)[rank * m : (rank + 1) * m] / (R if red == "avg" else 1)
                    else:  # rank j's block of every rank's product, in rank order
                        m = prods[0].shape[0] // R
                        ref = torch.cat([p[rank * m : (rank + 1) * m] for p in prods])
                        ref = ref.reshape(*lead, N)
                    if got.shape != ref.shape:
                        failures.append(f"{name} {lead} {red} call {i}: shape {tuple(got.shape)}")
                        continue
                    msg = mismatch(got, ref, TOL[torch.float32])
                    if msg:
                        failures.append(f"{name} {lead} {red} call {i}: {msg}")
                full = entered[0] - before
                if full != 1:
                    failures.append(f"{name} {lead} {red}: the full way {full} times in 4 calls")
    counted = sum(n for by_how in overlap.stats().values() for n in by_how.values())
    if counted != calls:
        failures.append(f"overlap.stats counted {counted} calls of {calls}")


def test_repeated_plain_calls_take_the_short_way():
    spawn(_repeated, 2, random.randrange(1 << 30))


def test_checks_after_a_memo_hit():
    """World size 1 (no process group): the fast lane answers only what the checks passed."""
    with _full_way_counted() as entered:
        x, w = torch.randn(8, 16), torch.randn(16, 8)
        overlap.matmul_allreduce(x, w, chunks=2)
        overlap.matmul_allreduce(x, w, chunks=2)
        assert entered[0] == 1  # the second call took the fast lane
        with pytest.raises(TypeError, match="chunks must be an int"):
            overlap.matmul_allreduce(x, w, chunks=2.0)  # (== 2, the same hash)
        with pytest.raises(ValueError, match="op must be one of"):
            overlap.matmul_allreduce(x, w, op=["sum"])  # (unhashable)
        out = torch.full((8, 8), float("nan"))
        overlap.matmul_allreduce(x, w, chunks=2, out=out)
        assert mismatch(out, x.double() @ w.double(), TOL[torch.float32]) is None
        xg = x.clone().requires_grad_()
        overlap.matmul_allreduce(xg, w, chunks=2).sum().backward()
        assert mismatch(xg.grad, w.sum(1).expand(8, 16), TOL[torch.float32]) is None
        entered[0] = 0
        overlap.configure(validate=True)
        try:
            overlap.matmul_allreduce(x, w, chunks=2)
        finally:
            overlap.configure(validate=False)
        assert entered[0] == 1  # validation mode: the full way
        assert engine.plain_again(x, w, "all_reduce", None, "sum", "auto", 2, "t")[0] is not None
        x3 = torch.randn(2, 4, 16)
        for _ in range(2):  # the full way, then the short one: [M, N] at world size 1 too
            got = overlap.matmul_reduce_scatter(x3, w)
            assert got.shape == (8, 8)
            assert mismatch(got, x3.double().reshape(8, 16) @ w.double(), 1e-5) is None


def test_the_fast_lane_finds_what_the_full_way_decided():
    """The full way keys the memo with a ``Call``'s values (``record.signature(x, w,
    *call)``), the fast lane with the same values passed one by one: their orders agree, so a
    call decided on the full way (``overlap.plan``, a call with ``out=``, an "avg" call) takes
    the fast lane at its first call (world size 1)."""
    x, w = torch.randn(8, 16), torch.randn(16, 8)
    with _full_way_counted() as entered:
        overlap.plan(x, w, "all_reduce", chunks=2, backend="torch")
        overlap.matmul_allreduce(x, w, chunks=2, backend="torch")
        assert entered[0] == 0, "a call decided by overlap.plan took the full way"
        overlap.matmul_allreduce(x, w, op="avg", out=torch.empty(8, 8))
        assert entered[0] == 1
        y = overlap.matmul_allreduce(x, w, op="avg")
        assert entered[0] == 1, "a call decided with out= took the full way without it"
        assert mismatch(y, x.double() @ w.double(), TOL[torch.float32]) is None


def _overlapped_once(rank, R, seed):
    """Eager overlapped calls (sum and avg, new ``x`` each): right results, one signature
    each, counted as overlapped."""
    failures, made, orig = [], [0], graphs.signature

    def counted(*a):
        made[0] += 1
        return orig(*a)

    overlap.stats(reset=True)
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(seed))
    graphs.signature = counted
    try:
        for i, red in enumerate(("sum", "avg", "sum")):
            xs = [torch.randn(64, 64, generator=torch.Generator().manual_seed(seed + 10 * i + r))
                  for r in range(R)]  # fmt: skip
            got = overlap.matmul_allreduce(xs[rank], w, op=red, chunks=2)
            ref = sum(x.double() @ w.double() for x in xs) / (R if red == "avg" else 1)
            msg = mismatch(got, ref, TOL[torch.float32])
            if msg:
                failures.append(f"call {i} ({red}): {msg}")
    finally:
        graphs.signature = orig
    if made[0] != 3:
        failures.append(f"{made[0]} signatures made for 3 calls")
    paths = overlap.stats().get("matmul_allreduce", {})
    if sum(n for how, n in paths.items() if how.startswith("overlap")) != 3:
        failures.append(f"not every call overlapped: {paths}")
    return failures


def test_overlapped_calls_make_their_signature_once():
    spawn(_overlapped_once, 2, random.randrange(1 << 30))
