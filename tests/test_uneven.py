"""``overlap.matmul_all_to_all`` with uneven splits (MoE dispatch and combine) on 2 and 3 gloo
ranks: skewed routing (a rank sending 4x another's rows, a rank receiving none, a rank with
no rows), ragged dims, fp32 and fp16, forward and backward against float64 over every rank's
inputs, outputs poisoned with NaN; validation mode catching splits that do not match; errors;
``torch.compile(fullgraph=True)``; the three ops on subgroups of 4 ranks."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from _dist import TOL, mismatch, on_subgroups, spawn

import overlap


def _routing(R: int, g: torch.Generator) -> list[list[int]]:
    """``S[a][b]``: rows rank ``a`` sends to rank ``b``; skewed, with zeros."""
    S = [[int(torch.randint(0, 40, (1,), generator=g)) for _ in range(R)] for _ in range(R)]
    S[0] = [4 * v + 3 for v in S[0]]  # rank 0 sends 4x more
    for a in range(R):
        S[a][R - 1] = 0  # nobody sends to the last rank
    if R > 2:
        S[1] = [0] * R  # rank 1 has no rows at all
    return S


def _case(rank, R, seed, dtype, K, N, chunks, grad, group=None):
    g = torch.Generator().manual_seed(seed)
    S = _routing(R, g)
    xs = [torch.randn(sum(S[a]), K, generator=g).to(dtype) for a in range(R)]
    ws = [torch.randn(N, K, generator=g).to(dtype) for _ in range(R)]
    gs = [torch.randn(sum(S[a][b] for a in range(R)), N, generator=g).to(dtype) for b in range(R)]
    sends, receives = S[rank], [S[a][rank] for a in range(R)]
    name = f"{dtype} K={K} N={N} chunks={chunks} splits={sends}>{receives} rank {rank}"
    # float64: rank a's product, its block for b goes to b (in a's order)
    X = [x.double().requires_grad_() for x in xs]
    W = [w.double().requires_grad_() for w in ws]
    P = [X[a] @ W[a].t() for a in range(R)]
    Y = [torch.cat([P[a][sum(S[a][:b]) : sum(S[a][: b + 1])] for a in range(R)]) for b in range(R)]
    failures = []
    x, w = xs[rank].clone(), ws[rank].clone()
    if grad:
        x.requires_grad_(), w.requires_grad_()
        sum((Y[b] * gs[b].double()).sum() for b in range(R)).backward()
        y = overlap.matmul_all_to_all(x, w.t(), input_split_sizes=sends,
                                      output_split_sizes=receives, chunks=chunks,
                                      group=group)  # fmt: skip
        (y * gs[rank]).sum().backward()
        checks = (("y", y.detach(), Y[rank]), ("dx", x.grad, X[rank].grad),
                  ("dw", w.grad, W[rank].grad))  # fmt: skip
    else:
        out = torch.full((sum(receives), N), float("nan"), dtype=dtype)
        kw = dict(input_split_sizes=sends, output_split_sizes=receives, chunks=chunks, group=group)
        y = overlap.matmul_all_to_all(x, w.t(), out=out, **kw)
        if y.data_ptr() != out.data_ptr() and out.numel():
            failures.append(f"{name}: the result is not `out`")
        checks = (("y", y, Y[rank]),)
    for what, got, want in checks:
        if got is None or got.shape != want.shape:
            failures.append(f"{name}: {what} is {None if got is None else tuple(got.shape)}")
            continue
        why = mismatch(got, want.detach(), TOL[dtype]) if want.numel() else None
        failures += [f"{name}: {what}: {why}"] if why else []
    return failures


def _forward_and_backward(rank, R, seed, group=None):
    failures = []
    for i, (dtype, K, N, chunks, grad) in enumerate((
        (torch.float32, 24, 40, None, False), (torch.float16, 17, 33, 3, False),
        (torch.float32, 8, 5, 2, False), (torch.float32, 24, 40, 3, True),
    )):  # fmt: skip
        failures += _case(rank, R, seed + i, dtype, K, N, chunks, grad, group)
    return failures


@pytest.mark.parametrize("world_size", [2, 3])
def test_uneven_all_to_all(world_size):
    spawn(_forward_and_backward, world_size, random.randrange(1 << 30))


def _validation_and_errors(rank, R):
    failures = []
    x, w = torch.randn(6, 8), torch.randn(8, 4)
    for kw, text in (
        (dict(input_split_sizes=[3, 3]), "go together"),
        (dict(input_split_sizes=[3, 2], output_split_sizes=[3, 3]), "add up to 5"),
        (dict(input_split_sizes=[6], output_split_sizes=[6]), "must be 2 non-negative ints"),
        (dict(input_split_sizes=[7, -1], output_split_sizes=[3, 3]), "non-negative"),
    ):
        try:
            overlap.matmul_all_to_all(x, w, **kw)
            failures.append(f"{text}: no error")
        except ValueError as e:
            if text not in str(e):
                failures.append(f"{text}: unclear error {e}")
    try:
        overlap.matmul_collective(x, w, "all_reduce", input_split_sizes=[3, 3],
                                  output_split_sizes=[3, 3])  # fmt: skip
        failures.append("splits with all_reduce: no error")
    except ValueError as e:
        failures += [] if "for all_to_all" in str(e) else [f"unclear error {e}"]
    # rank 0 says it sends 2 rows to rank 1, rank 1 expects 3: caught before any collective
    overlap.configure(validate=True, timeout=30)
    try:
        sends, receives = ([4, 2], [4, 3]) if rank == 0 else ([3, 3], [3, 3])
        try:
            overlap.matmul_all_to_all(x, w, input_split_sizes=sends, output_split_sizes=receives)
            failures.append("mismatched splits: no error")
        except overlap.RankMismatchError as e:
            if "splits=" not in str(e):
                failures.append(f"the error does not show the splits: {e}")
        sends, receives = ([4, 2], [4, 3]) if rank == 0 else ([3, 3], [2, 3])
        y = overlap.matmul_all_to_all(x, w, input_split_sizes=sends, output_split_sizes=receives)
        if y.shape != (7 if rank == 0 else 5, 4):
            failures.append(f"matching splits after the mismatch: shape {tuple(y.shape)}")
    finally:
        overlap.configure(validate=False)
    dist.barrier()
    return failures


def test_validation_and_errors():
    spawn(_validation_and_errors, 2)


def _compiled(rank, R, seed):
    torch._dynamo.config.cache_size_limit = 64

    @torch.compile(fullgraph=True, backend="aot_eager")
    def moe_combine(x, w, sends, receives):
        return overlap.matmul_all_to_all(x, w.t(), input_split_sizes=sends,
                                         output_split_sizes=receives, chunks=2) * 2  # fmt: skip

    g = torch.Generator().manual_seed(seed)
    S = _routing(R, g)
    xs = [torch.randn(sum(S[a]), 16, generator=g) for a in range(R)]
    ws = [torch.randn(12, 16, generator=g) for _ in range(R)]
    x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    receives = [S[a][rank] for a in range(R)]
    y = moe_combine(x, w, S[rank], receives)
    prods = [xs[a].double() @ ws[a].double().t() for a in range(R)]
    want = torch.cat([prods[a][sum(S[a][:rank]) : sum(S[a][: rank + 1])] for a in range(R)]) * 2
    why = mismatch(y.detach(), want, TOL[torch.float32])
    y.sum().backward()
    none = [n for n, t in (("dx", x.grad), ("dw", w.grad)) if t is None]
    failures = ([f"compiled rank {rank}: {why}"] if why else []) + [f"{n} is None" for n in none]

    @torch.compile(fullgraph=True, backend="aot_eager")
    def combine(x, w, ids, sends, receives):
        return overlap.grouped_matmul_all_to_all(x, w, ids, input_split_sizes=sends,
                                                 output_split_sizes=receives, chunks=2)  # fmt: skip

    we = torch.randn(2, 16, 12, generator=g)
    ids = [torch.randint(0, 2, (sum(S[a]),), generator=g) for a in range(R)]
    y = combine(xs[rank], we, ids[rank], S[rank], receives)
    prods = [torch.stack([xs[a][r].double() @ we[ids[a][r]].double() for r in range(len(ids[a]))])
             if len(ids[a]) else xs[a].new_zeros(0, 12).double() for a in range(R)]  # fmt: skip
    want = torch.cat([prods[a][sum(S[a][:rank]) : sum(S[a][: rank + 1])] for a in range(R)])
    why = mismatch(y, want, TOL[torch.float32])
    return failures + ([f"compiled combine rank {rank}: {why}"] if why else [])


def test_compile_fullgraph():
    spawn(_compiled, 2, random.randrange(1 << 30))


def _grouped(rank, R, seed, group=None):
    """``grouped_matmul_all_to_all`` (the MoE combine): every row through its expert (3
    experts per rank, one never used, ids sorted within blocks or not), then the uneven
    exchange; forward and backward against float64."""
    failures = []
    for i, (dtype, sort, chunks) in enumerate(
        ((torch.float32, True, None), (torch.float32, False, 3), (torch.float16, True, 2))
    ):
        g = torch.Generator().manual_seed(seed + i)
        S = _routing(R, g)
        K, N, E = 20, 28, 3
        xs = [torch.randn(sum(S[a]), K, generator=g).to(dtype) for a in range(R)]
        ws = [torch.randn(E, N, K, generator=g).to(dtype) for _ in range(R)]  # [E, N, K]
        ids = []
        for a in range(R):
            blocks = [torch.randint(0, E - 1, (n,), generator=g) for n in S[a]]  # expert 2 unused
            ids.append(torch.cat([b.sort().values if sort else b for b in blocks]).long())
        gs = [torch.randn(sum(S[a][b] for a in range(R)), N, generator=g).to(dtype)
              for b in range(R)]  # fmt: skip
        X = [x.double().requires_grad_() for x in xs]
        W = [w.double().requires_grad_() for w in ws]
        P = [torch.stack([X[a][r] @ W[a][ids[a][r]].t() for r in range(len(ids[a]))])
             if len(ids[a]) else X[a].new_zeros(0, N) for a in range(R)]  # fmt: skip
        Y = [torch.cat([P[a][sum(S[a][:b]) : sum(S[a][: b + 1])] for a in range(R)])
             for b in range(R)]  # fmt: skip
        sum((Y[b] * gs[b].double()).sum() for b in range(R)).backward()
        x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
        sends, receives = S[rank], [S[a][rank] for a in range(R)]
        y = overlap.grouped_matmul_all_to_all(
            x, w.transpose(1, 2), ids[rank], input_split_sizes=sends,
            output_split_sizes=receives, chunks=chunks, group=group,
        )  # fmt: skip
        (y * gs[rank]).sum().backward()
        name = f"grouped {dtype} sorted={sort} splits={sends}>{receives} rank {rank}"
        for what, got, want in (("y", y.detach(), Y[rank]), ("dx", x.grad, X[rank].grad),
                                ("dw", w.grad, W[rank].grad)):  # fmt: skip
            if want is None:  # this rank has no rows: no path to its inputs in float64
                want = torch.zeros(got.shape, dtype=torch.float64)
            if want.numel() == 0 or not want.any():
                why = None if got is not None and not got.any() else f"not zero: {got}"
            else:
                why = "None" if got is None else mismatch(got, want.detach(), TOL[dtype])
            failures += [f"{name}: {what}: {why}"] if why else []
        # without autograd, into a NaN-poisoned out
        out = torch.full((sum(receives), N), float("nan"), dtype=dtype)
        with torch.no_grad():
            overlap.grouped_matmul_all_to_all(
                xs[rank], ws[rank].transpose(1, 2), ids[rank], input_split_sizes=sends,
                output_split_sizes=receives, chunks=chunks, out=out, group=group,
            )  # fmt: skip
        why = mismatch(out, Y[rank].detach(), TOL[dtype]) if out.numel() else None
        failures += [f"{name}: out=: {why}"] if why else []
    x, w = torch.randn(4, 8), torch.randn(2, 8, 5)
    for args, text in (
        ((x, w, torch.tensor([0, 1, 2, 0])), "expert_ids must lie in [0, 2)"),
        ((x, w, torch.tensor([0, 1])), "one id per row"),
        ((x, w, torch.zeros(4)), "integer tensor"),
        ((x, w[0], torch.zeros(4, dtype=torch.long)), "[E, K, N]"),
    ):
        try:
            splits = [4] + [0] * (R - 1)  # (every case raises before communicating)
            overlap.grouped_matmul_all_to_all(*args, input_split_sizes=splits,
                                              output_split_sizes=splits, group=group)  # fmt: skip
            failures.append(f"{text}: no error")
        except ValueError as e:
            failures += [] if text in str(e) else [f"{text}: unclear error {e}"]
    dist.barrier()
    return failures


@pytest.mark.parametrize("world_size", [2, 3])
def test_grouped_combine(world_size):
    spawn(_grouped, world_size, random.randrange(1 << 30))


def _dispatch(rank, R, seed, group=None):
    """``all_to_all_grouped_matmul`` (the MoE dispatch): the uneven exchange of the tokens,
    then every received row through its local expert; forward (NaN-poisoned ``out``) and
    backward against float64, compiled once with autograd."""
    failures = []
    for i, (dtype, sort, chunks, compiled) in enumerate((
        (torch.float32, True, None, False), (torch.float32, False, 3, False),
        (torch.float16, True, 2, False), (torch.float32, True, 2, True),
    )):  # fmt: skip
        g = torch.Generator().manual_seed(seed + i)
        S = _routing(R, g)
        K, N, E = 20, 28, 3
        xs = [torch.randn(sum(S[a]), K, generator=g).to(dtype) for a in range(R)]
        ws = [torch.randn(E, N, K, generator=g).to(dtype) for _ in range(R)]
        ids = []  # of the received rows, block s from rank s
        for b in range(R):
            blocks = [torch.randint(0, E - 1, (S[a][b],), generator=g) for a in range(R)]
            ids.append(torch.cat([t.sort().values if sort else t for t in blocks]).long())
        gs = [torch.randn(len(ids[b]), N, generator=g).to(dtype) for b in range(R)]
        X = [x.double().requires_grad_() for x in xs]
        W = [w.double().requires_grad_() for w in ws]
        recv = [torch.cat([X[a][sum(S[a][:b]) : sum(S[a][: b + 1])] for a in range(R)])
                for b in range(R)]  # fmt: skip
        Y = [torch.stack([recv[b][r] @ W[b][ids[b][r]].t() for r in range(len(ids[b]))])
             if len(ids[b]) else recv[b].new_zeros(0, N) for b in range(R)]  # fmt: skip
        sum((Y[b] * gs[b].double()).sum() for b in range(R)).backward()
        sends, receives = S[rank], [S[a][rank] for a in range(R)]
        kw = dict(input_split_sizes=sends, output_split_sizes=receives, chunks=chunks,
                  group=group)  # fmt: skip
        fn = overlap.all_to_all_grouped_matmul
        if compiled:
            fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
        x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
        y = fn(x, w.transpose(1, 2), ids[rank], **kw)
        (y * gs[rank]).sum().backward()
        name = f"dispatch {dtype} sorted={sort} compiled={compiled} {sends}>{receives} rank {rank}"
        for what, got, want in (("y", y.detach(), Y[rank]), ("dx", x.grad, X[rank].grad),
                                ("dw", w.grad, W[rank].grad)):  # fmt: skip
            if want is None:  # no path in float64 (nothing sent or received)
                want = torch.zeros(got.shape, dtype=torch.float64)
            if not want.any():
                why = None if got is not None and not got.any() else f"not zero: {got}"
            else:
                why = "None" if got is None else mismatch(got, want.detach(), TOL[dtype])
            failures += [f"{name}: {what}: {why}"] if why else []
        out = torch.full((len(ids[rank]), N), float("nan"), dtype=dtype)
        with torch.no_grad():
            overlap.all_to_all_grouped_matmul(xs[rank], ws[rank].transpose(1, 2), ids[rank],
                                              out=out, **kw)  # fmt: skip
        why = mismatch(out, Y[rank].detach(), TOL[dtype]) if out.numel() else None
        failures += [f"{name}: out=: {why}"] if why else []
    try:  # ids are per received row here
        splits = [4] + [0] * (R - 1)
        three = torch.zeros(3, dtype=torch.long)
        kw = dict(input_split_sizes=splits, output_split_sizes=splits, group=group)
        overlap.all_to_all_grouped_matmul(torch.randn(4, 8), torch.randn(2, 8, 5), three, **kw)
        failures.append("3 ids for 4 received rows: no error")
    except ValueError as e:
        failures += [] if "per received row (4)" in str(e) else [f"unclear error {e}"]
    dist.barrier()
    return failures


@pytest.mark.parametrize("world_size", [2, 3])
def test_dispatch(world_size):
    spawn(_dispatch, world_size, random.randrange(1 << 30))


def _exchanges(rank, R, seed, group):
    return (_forward_and_backward(rank, R, seed, group) + _grouped(rank, R, seed + 10, group)
            + _dispatch(rank, R, seed + 20, group))  # fmt: skip


def test_subgroups_of_four_ranks():
    """The uneven all-to-all, the MoE combine and dispatch, forward and backward (the dispatch
    compiled once too) on subgroups whose ranks differ from the global ones
    (``_dist.SUBGROUPS``)."""
    spawn(on_subgroups, 4, _exchanges, random.randrange(1 << 30))
