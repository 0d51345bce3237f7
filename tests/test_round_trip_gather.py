"""The all-gather family's round trip on 2 and 3 gloo ranks: ``all_gather_matmul`` and then
its mirror ``matmul_reduce_scatter``, as a sequence-parallel MLP runs them (tokens sharded
``[m, K]`` -> gathered and multiplied by this rank's ``w1 [K, F / R]`` -> multiplied by
``w2 [F / R, N]`` and reduce-scattered back to ``[m, N]``), forward (outputs poisoned with
NaN) and backward (``dx``, ``dw1``, ``dw2``) against float64 over every rank's inputs."""

from __future__ import annotations

import random

import pytest
import torch
from _dist import TOL, mismatch, spawn

import overlap

# (m, K, F per rank, N, chunks), dtype: ragged sizes, a default chunk count
CASES = [((24, 20, 12, 28, 2), torch.float32), ((17, 33, 9, 16, None), torch.float32),
         ((24, 20, 12, 28, 3), torch.float16)]  # fmt: skip


def _round_trip(rank, R, seed):
    failures = []
    for i, ((m, K, F, N, chunks), dtype) in enumerate(CASES):
        g = torch.Generator().manual_seed(seed + i)
        xs = [torch.randn(m, K, generator=g).to(dtype) for _ in range(R)]
        w1s = [torch.randn(K, F, generator=g).to(dtype) for _ in range(R)]
        w2s = [torch.randn(F, N, generator=g).to(dtype) / F**0.5 for _ in range(R)]
        gs = [torch.randn(m, N, generator=g).to(dtype) for _ in range(R)]
        X = [x.double().requires_grad_() for x in xs]
        W1 = [w.double().requires_grad_() for w in w1s]
        W2 = [w.double().requires_grad_() for w in w2s]
        Y = sum(torch.cat(X) @ W1[r] @ W2[r] for r in range(R))  # [R m, N], row block r: r's
        sum((Y[r * m : (r + 1) * m] * gs[r].double()).sum() for r in range(R)).backward()
        name = f"m={m} K={K} F={F} N={N} chunks={chunks} {dtype} rank {rank}"
        # forward into NaN-poisoned outputs
        h = torch.full((R * m, F), float("nan"), dtype=dtype)
        y = torch.full((m, N), float("nan"), dtype=dtype)
        overlap.all_gather_matmul(xs[rank], w1s[rank], out=h, chunks=chunks)
        overlap.matmul_reduce_scatter(h, w2s[rank], out=y, chunks=chunks)
        want = Y[rank * m : (rank + 1) * m].detach()
        why = mismatch(y, want, TOL[dtype])
        failures += [f"{name}: y: {why}"] if why else []
        # forward and backward
        x, w1, w2 = (t[rank].clone().requires_grad_() for t in (xs, w1s, w2s))
        y = overlap.matmul_reduce_scatter(overlap.all_gather_matmul(x, w1, chunks=chunks), w2,
                                          chunks=chunks)  # fmt: skip
        (y * gs[rank]).sum().backward()
        for what, got, ref in (
            ("y", y.detach(), want),
            ("dx", x.grad, X[rank].grad),
            ("dw1", w1.grad, W1[rank].grad),
            ("dw2", w2.grad, W2[rank].grad),
        ):
            why = "None" if got is None else mismatch(got, ref, TOL[dtype])
            failures += [f"{name}: {what}: {why}"] if why else []
    return failures


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_then_reduce_scatter(world_size):
    spawn(_round_trip, world_size, random.randrange(1 << 30))
