"""The MoE family's round trip on 2 and 3 gloo ranks: the dispatch
``all_to_all_grouped_matmul`` (tokens to the ranks of their experts, each received row through
its expert's ``w1 [E, K, F]``) and then its mirror, the combine ``grouped_matmul_all_to_all``
(each row through the same expert's ``w2 [E, F, N]``, sent back with the splits swapped), so
that every token comes home in its own row: ``y[t] = x[t] @ w1_e @ w2_e`` on the rank and
expert it was routed to. Skewed routing with empty blocks and an unused expert; forward
(outputs poisoned with NaN) and backward against float64 over every rank's inputs."""

from __future__ import annotations

import random

import pytest
import torch
from _dist import TOL, mismatch, spawn

import overlap


def _round_trip(rank, R, seed):
    failures = []
    K, F, N, E = 12, 20, 16, 3
    for i, (dtype, chunks) in enumerate(((torch.float32, 2), (torch.float32, None),
                                         (torch.float16, 3))):  # fmt: skip
        g = torch.Generator().manual_seed(seed + i)
        S = torch.randint(0, 12, (R, R), generator=g)  # S[a][b]: tokens of rank a for rank b
        S[0] *= 3  # rank 0 sends more
        S[R - 1, 0] = 0  # an empty block
        S = S.tolist()
        xs = [torch.randn(sum(S[a]), K, generator=g).to(dtype) for a in range(R)]
        w1s = [torch.randn(E, K, F, generator=g).to(dtype) for _ in range(R)]
        w2s = [torch.randn(E, F, N, generator=g).to(dtype) / F**0.5 for _ in range(R)]
        # the experts of every rank's received rows (block s from rank s; expert E - 1 unused)
        ids = [torch.randint(0, E - 1, (sum(S[a][b] for a in range(R)),), generator=g)
               for b in range(R)]  # fmt: skip
        gs = [torch.randn(sum(S[a]), N, generator=g).to(dtype) for a in range(R)]
        X = [x.double().requires_grad_() for x in xs]
        W1 = [w.double().requires_grad_() for w in w1s]
        W2 = [w.double().requires_grad_() for w in w2s]
        Y = [[None] * R for _ in range(R)]  # Y[a][b]: rank a's block for rank b, home again
        for b in range(R):
            at = 0
            for a in range(R):
                rows = X[a][sum(S[a][:b]) : sum(S[a][: b + 1])]
                e = ids[b][at : at + len(rows)]
                Y[a][b] = torch.stack([rows[t] @ W1[b][e[t]] @ W2[b][e[t]]
                                       for t in range(len(rows))]) if len(rows) else \
                    rows.new_zeros(0, N)  # fmt: skip
                at += len(rows)
        Y = [torch.cat(Y[a]) for a in range(R)]
        sum((Y[a] * gs[a].double()).sum() for a in range(R)).backward()
        sends, receives = S[rank], [S[a][rank] for a in range(R)]
        there = dict(input_split_sizes=sends, output_split_sizes=receives, chunks=chunks)
        back = dict(input_split_sizes=receives, output_split_sizes=sends, chunks=chunks)
        name = f"{dtype} chunks={chunks} splits={sends}>{receives} rank {rank}"
        # forward into NaN-poisoned outputs
        h = torch.full((sum(receives), F), float("nan"), dtype=dtype)
        y = torch.full((sum(sends), N), float("nan"), dtype=dtype)
        overlap.all_to_all_grouped_matmul(xs[rank], w1s[rank], ids[rank], out=h, **there)
        overlap.grouped_matmul_all_to_all(h, w2s[rank], ids[rank], out=y, **back)
        why = mismatch(y, Y[rank].detach(), TOL[dtype]) if y.numel() else None
        failures += [f"{name}: y: {why}"] if why else []
        # forward and backward
        x, w1, w2 = (t[rank].clone().requires_grad_() for t in (xs, w1s, w2s))
        h = overlap.all_to_all_grouped_matmul(x, w1, ids[rank], **there)
        y = overlap.grouped_matmul_all_to_all(h, w2, ids[rank], **back)
        (y * gs[rank]).sum().backward()
        for what, got, ref in (
            ("y", y.detach(), Y[rank]),
            ("dx", x.grad, X[rank].grad),
            ("dw1", w1.grad, W1[rank].grad),
            ("dw2", w2.grad, W2[rank].grad),
        ):
            if ref is None or not ref.any():  # no path in float64: nothing sent or received
                why = None if got is None or not got.any() else f"not zero: {got}"
            else:
                why = "None" if got is None else mismatch(got, ref.detach(), TOL[dtype])
            failures += [f"{name}: {what}: {why}"] if why else []
    return failures


@pytest.mark.parametrize("world_size", [2, 3])
def test_dispatch_then_combine(world_size):
    spawn(_round_trip, world_size, random.randrange(1 << 30))
