"""The all-to-all family's round trip on 2 and 3 gloo ranks: ``matmul_all_to_all`` there and
``matmul_all_to_all`` back, so that every row comes home: rank ``a``'s block for rank ``b`` is
multiplied by ``a``'s ``w1``, sent to ``b``, multiplied by ``b``'s ``w2`` and sent back
(``y_a = x_a @ w1_a @ w2_b`` block by block). Equal blocks (the overlapped kernel path) and
uneven splits with empty blocks (back with the splits swapped); forward (outputs poisoned with
NaN) and backward against float64 over every rank's inputs."""

from __future__ import annotations

import random

import pytest
import torch
from _dist import TOL, mismatch, spawn

import overlap


def _round_trip(rank, R, seed):
    failures = []
    K, F, N = 20, 40, 36
    for i, (uneven, dtype, chunks) in enumerate(((False, torch.float32, 2),
        (False, torch.float16, None), (True, torch.float32, 3), (True, torch.float16, None),
    )):  # fmt: skip
        g = torch.Generator().manual_seed(seed + i)
        if uneven:  # S[a][b]: rows of rank a for rank b, skewed, one block empty
            S = torch.randint(0, 20, (R, R), generator=g)
            S[0, R - 1] = 0
            S = S.tolist()
        else:
            S = [[32] * R for _ in range(R)]  # (both products overlap: checked below)
        xs = [torch.randn(sum(S[a]), K, generator=g).to(dtype) for a in range(R)]
        w1s = [torch.randn(K, F, generator=g).to(dtype) for _ in range(R)]
        w2s = [torch.randn(F, N, generator=g).to(dtype) / F**0.5 for _ in range(R)]
        gs = [torch.randn(sum(S[a]), N, generator=g).to(dtype) for a in range(R)]
        X = [x.double().requires_grad_() for x in xs]
        W1 = [w.double().requires_grad_() for w in w1s]
        W2 = [w.double().requires_grad_() for w in w2s]
        Y = [torch.cat([X[a][sum(S[a][:b]) : sum(S[a][: b + 1])] @ W1[a] @ W2[b]
                        for b in range(R)]) for a in range(R)]  # fmt: skip
        sum((Y[a] * gs[a].double()).sum() for a in range(R)).backward()
        sends, receives = S[rank], [S[a][rank] for a in range(R)]
        there = dict(input_split_sizes=sends, output_split_sizes=receives) if uneven else {}
        back = dict(input_split_sizes=receives, output_split_sizes=sends) if uneven else {}
        name = f"uneven={uneven} {dtype} chunks={chunks} {sends}>{receives} rank {rank}"
        if not uneven:
            for a, b in ((xs[rank], w1s[rank]), (torch.empty(sum(receives), F, dtype=dtype),
                                                 w2s[rank])):  # fmt: skip
                p = overlap.plan(a, b, "all_to_all", chunks=chunks)
                failures += [] if p.path == "overlap" else [f"{name}: {p.describe()}"]
        # forward into NaN-poisoned outputs
        h = torch.full((sum(receives), F), float("nan"), dtype=dtype)
        y = torch.full((sum(sends), N), float("nan"), dtype=dtype)
        overlap.matmul_all_to_all(xs[rank], w1s[rank], out=h, chunks=chunks, **there)
        overlap.matmul_all_to_all(h, w2s[rank], out=y, chunks=chunks, **back)
        why = mismatch(y, Y[rank].detach(), TOL[dtype])
        failures += [f"{name}: y: {why}"] if why else []
        # forward and backward
        x, w1, w2 = (t[rank].clone().requires_grad_() for t in (xs, w1s, w2s))
        h = overlap.matmul_all_to_all(x, w1, chunks=chunks, **there)
        y = overlap.matmul_all_to_all(h, w2, chunks=chunks, **back)
        (y * gs[rank]).sum().backward()
        for what, got, ref in (
            ("y", y.detach(), Y[rank]),
            ("dx", x.grad, X[rank].grad),
            ("dw1", w1.grad, W1[rank].grad),
            ("dw2", w2.grad, W2[rank].grad),
        ):
            why = "None" if got is None else mismatch(got, ref.detach(), TOL[dtype])
            failures += [f"{name}: {what}: {why}"] if why else []
    return failures


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_to_all_there_and_back(world_size):
    spawn(_round_trip, world_size, random.randrange(1 << 30))
