"""``overlap.embedding_bag_all_to_all`` on 2 and 3 gloo ranks: tables of different widths per
rank (a rank with two tables, one with one), bags of different sizes including empty ones,
every mode; forward and the tables' gradients against float64 ``embedding_bag`` over every
rank's tables; errors; ranks that disagree; the same on subgroups of 4 ranks."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import TOL, mismatch, on_subgroups, spawn

import overlap


def _draw(R, B, seed, dtype):
    """Every rank's tables, indices and offsets (the same on every rank, from ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    ranks = []
    for r in range(R):
        tabs = []
        for _ in range(1 + r % 2):  # 1 or 2 tables
            rows, d = (
                int(torch.randint(5, 30, (1,), generator=g)),
                int(torch.randint(3, 9, (1,), generator=g)),
            )
            sizes = torch.randint(0, 5, (B,), generator=g)  # bag sizes, empty bags included
            idx = torch.randint(0, rows, (int(sizes.sum()),), generator=g)
            off = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]])
            tabs.append((torch.randn(rows, d, generator=g).to(dtype), idx, off))
        ranks.append(tabs)
    return ranks


def _cases(rank, R, seed, group=None):
    failures = []
    B = 6 * R
    for i, (dtype, mode, chunks, dims) in enumerate((
        (torch.float32, "sum", None, True), (torch.float32, "mean", 3, False),
        (torch.float32, "max", 2, True), (torch.float16, "sum", 2, True),
    )):  # fmt: skip
        ranks = _draw(R, B, seed + i, dtype)
        # float64 reference: every rank's pooled [B, D_s], this rank's batch slice of each
        ref_t = [[t.double().requires_grad_() for t, _, _ in tabs] for tabs in ranks]
        pooled = [torch.cat([F.embedding_bag(ix, t, o, mode=mode)
                             for t, (_, ix, o) in zip(ts, tabs, strict=True)], dim=1)
                  for ts, tabs in zip(ref_t, ranks, strict=True)]  # fmt: skip
        b = B // R
        want = [torch.cat([p[r * b : (r + 1) * b] for p in pooled], dim=1) for r in range(R)]
        gen = torch.Generator().manual_seed(seed + 100 + i)
        gs = [torch.randn(w.shape, generator=gen) for w in want]
        sum((w * g.double()).sum() for w, g in zip(want, gs, strict=True)).backward()
        tabs = [t.clone().requires_grad_() for t, _, _ in ranks[rank]]
        kw = dict(mode=mode, chunks=chunks, group=group)
        if dims:
            kw["rank_dims"] = [sum(t.shape[1] for t, _, _ in r_) for r_ in ranks]
        got = overlap.embedding_bag_all_to_all(tabs, [ix for _, ix, _ in ranks[rank]],
                                               [o for _, _, o in ranks[rank]], **kw)  # fmt: skip
        (got * gs[rank].to(dtype)).sum().backward()
        name = f"{dtype} {mode} chunks={chunks} rank_dims={dims} rank {rank}"
        why = mismatch(got.detach(), want[rank].detach(), TOL[dtype])
        failures += [f"{name}: result: {why}"] if why else []
        for k, (t, r_) in enumerate(zip(tabs, ref_t[rank], strict=True)):
            why = mismatch(t.grad, r_.grad, TOL[dtype]) if r_.grad.any() else None
            failures += [f"{name}: table {k} gradient: {why}"] if why else []
    # errors, raised before any communication
    t, ix, o = torch.randn(5, 3), torch.tensor([0, 1]), torch.tensor([0, 1, 1])
    for args, kw, text in (
        (([t], [ix], [o]), dict(mode="median"), "mode must be"),
        (([t], [ix], [o, o]), {}, "one tensor per table"),
        (([t], [ix], [torch.tensor([0.0, 1.0, 1.0])]), {}, "1-D integer"),
        (([t], [ix], [torch.tensor([0, 1, 1, 2, 2][: 2 * R + 1])]), {}, "divisible"),
        (([t], [ix], [torch.tensor(list(range(R)))]), dict(rank_dims=[4] * R), "rank_dims"),
    ):
        try:
            overlap.embedding_bag_all_to_all(*args, **kw, group=group)
            failures.append(f"{text}: no error")
        except (ValueError, TypeError) as e:
            failures += [] if text in str(e) else [f"{text}: unclear error {e}"]
    # ranks that disagree on the batch or the mode, validation off: the widths' host
    # collective (rank_dims=None) carries them, and every rank raises before the exchange
    bags = torch.arange(4 * R)
    for what, B, mode in (("batch", 2 * R if rank else 4 * R, "sum"),
                          ("mode", 4 * R, "max" if rank else "sum")):  # fmt: skip
        try:
            overlap.embedding_bag_all_to_all([t], [bags[:B] % 5], [bags[:B]], mode=mode,
                                             group=group)  # fmt: skip
            failures.append(f"ranks disagree on the {what}: no error")
        except overlap.RankMismatchError as e:
            if "rank 0: bags=" not in str(e) or f"rank {R - 1}: bags=" not in str(e):
                failures.append(f"{what}: the error lacks the ranks' values: {e}")
    got = overlap.embedding_bag_all_to_all([t], [bags % 5], [bags], group=group)  # it goes on
    failures += [] if got.shape == (4, 3 * R) else [f"after the mismatches: {tuple(got.shape)}"]
    dist.barrier()
    return failures


@pytest.mark.parametrize("world_size", [2, 3])
def test_embedding_bag_all_to_all(world_size):
    spawn(_cases, world_size, random.randrange(1 << 30))


def test_subgroups_of_four_ranks():
    """Forward, gradients, errors and ranks that disagree on subgroups whose ranks differ
    from the global ones (``_dist.SUBGROUPS``)."""
    spawn(on_subgroups, 4, _cases, random.randrange(1 << 30))


def test_world_size_one():
    t, ix, o = torch.randn(7, 4), torch.tensor([1, 2, 6, 0]), torch.tensor([0, 2, 2])
    got = overlap.embedding_bag_all_to_all([t], [ix], [o])
    torch.testing.assert_close(got, F.embedding_bag(ix, t, o, mode="sum"))


def _compiled(rank, R, seed):
    """``torch.compile(fullgraph=True)`` with autograd (``rank_dims`` given: asking the ranks
    is a host collective, which Dynamo cannot trace)."""
    ranks = _draw(R, 4 * R, seed, torch.float32)
    dims = [sum(t.shape[1] for t, _, _ in r_) for r_ in ranks]

    @torch.compile(fullgraph=True, backend="aot_eager")
    def pooled(tabs, idx, off):
        return overlap.embedding_bag_all_to_all(tabs, idx, off, rank_dims=dims, chunks=2) * 2

    tabs = [t.clone().requires_grad_() for t, _, _ in ranks[rank]]
    got = pooled(tabs, [ix for _, ix, _ in ranks[rank]], [o for _, _, o in ranks[rank]])
    got.sum().backward()
    full = [torch.cat([F.embedding_bag(ix, t.double(), o, mode="sum") for t, ix, o in r_], 1)
            for r_ in ranks]  # fmt: skip
    b = len(ranks[0][0][2]) // R
    want = torch.cat([f[rank * b : (rank + 1) * b] for f in full], dim=1) * 2
    why = mismatch(got.detach(), want, TOL[torch.float32])
    none = [k for k, t in enumerate(tabs) if t.grad is None]
    return ([f"compiled rank {rank}: {why}"] if why else []) + [f"no grad {k}" for k in none]


def test_compile_fullgraph():
    spawn(_compiled, 2, random.randrange(1 << 30))
