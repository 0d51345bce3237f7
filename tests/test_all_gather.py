"""``overlap.all_gather_matmul`` on 2 and 3 gloo ranks, and on subgroups of 4: forward (result
and ``x_full``) and backward (the overlapped ``matmul_reduce_scatter`` of the input gradient)
against float64 over every rank's inputs, outputs poisoned with NaN; ragged shapes, leading
dims, fp32 and fp16, chunk counts; errors. The NCCL-per-chunk transport runs here (gloo on the
host); the copy engines' protocol is ``test_transport.py``'s."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.distributed as dist
from _dist import TOL, mismatch, on_subgroups, spawn

import overlap

# (shard lead dims..., K, N), chunks: ragged edges, a 3-D shard, one-band and many-band plans
SHAPES = [((48,), 32, 40, 2), ((37,), 24, 17, 3), ((2, 25), 16, 30, 2), ((3,), 8, 5, None),
          ((64,), 20, 64, 4)]  # fmt: skip


def _inputs(R, dtype, lead, K, N, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(*lead, K, generator=g).to(dtype) for _ in range(R)]
    ws = [torch.randn(N, K, generator=g).to(dtype) for _ in range(R)]  # nn.Linear weights
    gs = [torch.randn(R * math.prod(lead), N, generator=g).to(dtype) for _ in range(R)]
    hs = [torch.randn(R * math.prod(lead), K, generator=g).to(dtype) for _ in range(R)]
    return xs, ws, gs, hs


def _forward(rank, R, seed, group=None):
    failures = []
    for i, (dtype, (lead, K, N, chunks)) in enumerate(
        (d, s) for d in (torch.float32, torch.float16) for s in SHAPES
    ):
        xs, ws, _, _ = _inputs(R, dtype, lead, K, N, seed + i)
        X = torch.cat([x.reshape(-1, K) for x in xs]).double()
        ref = X @ ws[rank].double().t()
        out = torch.full((X.shape[0], N), float("nan"), dtype=dtype)
        name = f"forward {dtype} {lead} K={K} N={N} chunks={chunks} rank {rank}"
        p = overlap.plan(xs[rank], ws[rank].t(), "all_gather", chunks=chunks, group=group)
        if p.path != "overlap" or p.M != X.shape[0]:
            failures.append(f"{name}: {p.describe()}")
        y, full = overlap.all_gather_matmul(xs[rank], ws[rank].t(), out=out, chunks=chunks,
                                            return_gathered=True, group=group)  # fmt: skip
        if y.data_ptr() != out.data_ptr():
            failures.append(f"{name}: the result is not `out`")
        for what, got, want in (("y", y, ref), ("x_full", full, X)):
            why = mismatch(got, want, TOL[dtype])
            failures += [f"{name}: {what}: {why} ({p.describe()})"] if why else []
        y2 = overlap.all_gather_matmul(xs[rank], ws[rank].t(), chunks=chunks, group=group)
        why = mismatch(y2, ref, TOL[dtype])
        failures += [f"{name}: without return_gathered: {why}"] if why else []
    return failures


def _backward(rank, R, seed, use_full, group=None):
    """The loss ``sum_r <y_r, g_r>`` (plus ``<x_full_r, h_r>`` with ``use_full``) against
    float64 autograd of the unsharded computation."""
    failures = []
    for i, (lead, K, N, chunks) in enumerate(SHAPES):
        xs, ws, gs, hs = _inputs(R, torch.float32, lead, K, N, seed + i)
        Xs = [x.double().requires_grad_() for x in xs]
        Ws = [w.double().requires_grad_() for w in ws]
        Xf = torch.cat([x.reshape(-1, K) for x in Xs])
        loss = sum(((Xf @ Ws[r].t()) * gs[r].double()).sum() for r in range(R))
        if use_full:
            loss = loss + sum((Xf * hs[r].double()).sum() for r in range(R))
        loss.backward()
        x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
        y, full = overlap.all_gather_matmul(x, w.t(), chunks=chunks, return_gathered=True,
                                            group=group)  # fmt: skip
        mine = (y * gs[rank]).sum() + ((full * hs[rank]).sum() if use_full else 0)
        mine.backward()
        name = f"backward use_full={use_full} {lead} K={K} N={N} rank {rank}"
        for what, got, want in (("dx", x.grad, Xs[rank].grad), ("dw", w.grad, Ws[rank].grad)):
            why = "None" if got is None else mismatch(got, want, TOL[torch.float32])
            failures += [f"{name}: {what}: {why}"] if why else []
        # only one of the two gradients asked for
        for need in ("x", "w"):
            x2, w2 = xs[rank].clone(), ws[rank].clone()
            (x2 if need == "x" else w2).requires_grad_()
            y2 = overlap.all_gather_matmul(x2, w2.t(), chunks=chunks, group=group)
            (y2 * gs[rank]).sum().backward()
            got, want = (x2.grad, Xs[rank].grad) if need == "x" else (w2.grad, Ws[rank].grad)
            if use_full and need == "x":
                continue  # the reference's dx includes x_full's term
            why = mismatch(got, want, TOL[torch.float32])
            failures += [f"{name}: only d{need}: {why}"] if why else []
    return failures


def test_forward_two_ranks():
    spawn(_forward, 2, random.randrange(1 << 30))


def test_forward_three_ranks():
    spawn(_forward, 3, random.randrange(1 << 30))


@pytest.mark.parametrize("use_full", [False, True])
def test_backward_two_ranks(use_full):
    spawn(_backward, 2, random.randrange(1 << 30), use_full)


def _list_case(rank, R, seed, adjacent):
    """``all_gather_matmul(x, [w_0, w_1, w_2])``: the products, ``x_full`` and every gradient
    against float64, one call each way (one gather, one reduce-scatter of the summed input
    gradients), and the weights side by side without a copy where they are adjacent."""
    from overlap.ops._columns import side_by_side

    g = torch.Generator().manual_seed(seed)
    K, m, widths = 24, 20, (16, 8, 12)
    xs = [torch.randn(m, K, generator=g) for _ in range(R)]
    whole = [torch.randn(sum(widths), K, generator=g) for _ in range(R)]  # rows: w_i^T
    gs = [[torch.randn(R * m, n, generator=g) for n in widths] for _ in range(R)]
    Xs = [x.double().requires_grad_() for x in xs]
    Ws = [[p.double().requires_grad_() for p in w.split(widths)] for w in whole]
    Xf = torch.cat(Xs)
    sum((Xf @ p.t() * gi.double()).sum() for r in range(R)
        for p, gi in zip(Ws[r], gs[r], strict=True)).backward()  # fmt: skip
    if adjacent:  # nn.Linear weights that are views of one tensor (as share_input makes them)
        params = [torch.nn.Parameter(p) for p in whole[rank].clone().split(widths)]
    else:
        params = [torch.nn.Parameter(p.clone()) for p in whole[rank].split(widths)]
    x = xs[rank].clone().requires_grad_()
    name = f"list of weights adjacent={adjacent} rank {rank}"
    failures = []
    joined = side_by_side([p.t() for p in params])
    if (joined.data_ptr() == params[0].data_ptr()) != adjacent:
        failures.append(f"{name}: side_by_side {'copied' if adjacent else 'did not copy'}")
    overlap.stats(reset=True)
    ys, full = overlap.all_gather_matmul(x, [p.t() for p in params], return_gathered=True)
    sum((y * gi).sum() for y, gi in zip(ys, gs[rank], strict=True)).backward()
    calls = sum(sum(h.values()) for h in overlap.stats(reset=True).values())
    if calls != 2:
        failures.append(f"{name}: {calls} calls of the library's ops, expected 2")
    checks = [("x_full", full, Xf), ("dx", x.grad, Xs[rank].grad)]
    for i, (y, p) in enumerate(zip(ys, params, strict=True)):
        checks += [(f"y[{i}]", y, Xf @ Ws[rank][i].t()), (f"dw[{i}]", p.grad, Ws[rank][i].grad)]
    for what, got, want in checks:
        why = "None" if got is None else mismatch(got.detach(), want.detach(), TOL[torch.float32])
        failures += [f"{name}: {what}: {why}"] if why else []
    with torch.no_grad():  # without autograd: the same products
        ys = overlap.all_gather_matmul(xs[rank], [p.t() for p in params])
    for i, y in enumerate(ys):
        why = mismatch(y, Xf.detach() @ Ws[rank][i].detach().t(), TOL[torch.float32])
        failures += [f"{name}: no_grad y[{i}]: {why}"] if why else []
    return failures


def _lists(rank, R, seed):
    return _list_case(rank, R, seed, True) + _list_case(rank, R, seed + 1, False)


def test_list_of_weights_gathers_once():
    spawn(_lists, 2, random.randrange(1 << 30))


def _both(rank, R, seed, group):
    return _forward(rank, R, seed, group) + _backward(rank, R, seed, True, group)


def test_subgroups_of_four_ranks():
    """Forward and backward on subgroups whose ranks differ from the global ones (this rank's
    own rows at its group rank's place: ``_dist.SUBGROUPS``)."""
    spawn(on_subgroups, 4, _both, random.randrange(1 << 30))


def _errors(rank, R):
    x, w = torch.randn(6, 8), torch.randn(8, 4)
    failures = []
    for args, kw, err, text in (
        ((x, w), {"out": torch.empty(6, 4)}, ValueError, "out must have shape (12, 4)"),
        ((x, torch.randn(7, 4)), {}, ValueError, "K mismatch"),
        ((x, w.half()), {}, TypeError, "w.dtype"),
        ((x, w), {"group": "tp"}, TypeError, "group must be"),
        ((x, w), {"backend": "nvshmem"}, ValueError, "backend must be"),
        ((x, []), {}, ValueError, "w: an empty list"),
        ((x, [w, w]), {"out": torch.empty(12, 8)}, ValueError, "out= takes one weight"),
        ((x, [w, torch.randn(7, 4)]), {}, ValueError, "w[1]: K mismatch"),
    ):
        try:
            overlap.all_gather_matmul(*args, **kw)
            failures.append(f"{text}: no error")
        except err as e:
            if text not in str(e):
                failures.append(f"{text}: unclear error {e}")
    try:
        overlap.matmul_collective(x, w, "all_gather")
        failures.append("matmul_collective('all_gather') did not raise")
    except ValueError as e:
        if "all_gather_matmul" not in str(e):
            failures.append(f"unclear error {e}")
    dist.barrier()
    return failures


def test_errors():
    spawn(_errors, 2)


def test_world_size_one_is_a_matmul():
    x, w = torch.randn(2, 5, 8), torch.randn(8, 3)
    y, full = overlap.all_gather_matmul(x, w, return_gathered=True)
    torch.testing.assert_close(y, x.reshape(10, 8) @ w)
    torch.testing.assert_close(full, x.reshape(10, 8))


def _renumbered(rank, R, d):
    """The default group destroyed and made again with the ranks numbered the other way (as an
    elastic restart may): calls with ``group=None`` must take the new group's rank, not the
    one the library kept for the old group (this rank's own rows were placed by it)."""
    failures = []

    def check(what: str, r: int) -> None:
        g = torch.Generator().manual_seed(5)
        xs = [torch.randn(33, 40, generator=g) for _ in range(R)]
        w = torch.randn(40, 44, generator=g)
        y = overlap.all_gather_matmul(xs[r], w)
        why = mismatch(y, torch.cat(xs).double() @ w.double(), TOL[torch.float32])
        failures.extend([f"{what}, rank {r}: {why}"] if why else [])

    check("the first default group", rank)
    for name, r in (("renumbered", R - 1 - rank), ("again", rank)):  # (the harness's at the end)
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{d}/{name}", rank=r, world_size=R)
        dist.barrier()
        if name == "renumbered":
            check("a new default group, its ranks numbered the other way", r)
    return failures


def test_default_group_made_again_with_other_ranks(tmp_path):
    spawn(_renumbered, 2, str(tmp_path))
