"""No devices: ``torch.compile(fullgraph=True)`` of code that calls the library, on 2 gloo ranks
with the kernels in Triton's interpreter: no graph break (fullgraph raises on one), forward
and backward against float64 autograd over every rank's inputs (``_dist.check_grad_case``)."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from _dist import TOL, _draw, check_grad_case, mismatch, spawn

import overlap


def _compiled(rank, R, seed, backend):
    torch._dynamo.config.cache_size_limit = 64

    @torch.compile(fullgraph=True, backend=backend)
    def call(x, w, collective, op, chunks):
        # torch ops around the call land in the same graph; the scaling by 2 is exact
        return overlap.matmul_collective(2 * x, w, collective, op=op, chunks=chunks) / 2

    failures = []
    i = 0
    for coll in overlap.COLLECTIVES:
        avg = "avg" if coll != "all_to_all" else "sum"
        for shape, op in (((64, 40, 48), "sum"), ((2, 48, 24, 40), avg)):
            i += 1
            msg = check_grad_case(rank, R, "cpu", (coll, torch.float32, shape, op), seed + i,
                                  chunks=2, call=call)  # fmt: skip
            failures += [msg] if msg else []
        # without autograd the compiled call takes the same op (Dynamo cannot trace the rest)
        _, xs, ws = _draw(R, torch.float32, (96, 40, 64), seed + 100 + i)
        with torch.no_grad():
            y = call(xs[rank], ws[rank].t(), coll, "sum", 2)
        prods = [x.double() @ w.double().t() for x, w in zip(xs, ws, strict=True)]
        own = slice(rank * 96 // R, (rank + 1) * 96 // R)
        ref = {"all_reduce": sum(prods), "reduce_scatter": sum(prods)[own],
               "all_to_all": torch.cat([p[own] for p in prods])}[coll]  # fmt: skip
        why = mismatch(y, ref, TOL[torch.float32])
        failures += [f"no_grad {coll} rank {rank}: {why}"] if why else []
    # a group of the caller's, not the default one: it travels into the op by name
    group = torch.distributed.new_group([0, 1])

    @torch.compile(fullgraph=True, backend=backend)
    def grouped(x, w):
        return overlap.matmul_collective(x, w, group=group, chunks=2)

    _, xs, ws = _draw(R, torch.float32, (64, 32, 48), seed + 200)
    y = grouped(xs[rank], ws[rank].t())
    ref = sum(x.double() @ w.double().t() for x, w in zip(xs, ws, strict=True))
    why = mismatch(y, ref, TOL[torch.float32])
    return failures + ([f"explicit group rank {rank}: {why}"] if why else [])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(backend):
    spawn(_compiled, 2, random.randrange(1 << 30), backend)


def _compiled_gather_and_layers(rank, R, seed, backend):
    """``all_gather_matmul`` (forward and backward) and both layers with and without
    sequence parallelism (the column layers sharing their input) under
    ``torch.compile(fullgraph=True)``, against float64."""
    from torch import nn

    from overlap.nn import ColumnParallelLinear, RowParallelLinear, share_input

    torch._dynamo.config.cache_size_limit = 64
    failures = []
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(40, 24, generator=g) for _ in range(R)]
    ws = [torch.randn(32, 24, generator=g) for _ in range(R)]
    gs = [torch.randn(40 * R, 32, generator=g) for _ in range(R)]

    @torch.compile(fullgraph=True, backend=backend)
    def gathered(x, w):
        y, full = overlap.all_gather_matmul(x, w.t(), chunks=2, return_gathered=True)
        return y * 2, full

    Xs = [t.double().requires_grad_() for t in xs]
    Ws = [t.double().requires_grad_() for t in ws]
    Xf = torch.cat(Xs)
    sum(((Xf @ Ws[r].t()) * 2 * gs[r].double()).sum() for r in range(R)).backward()
    x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    y, full = gathered(x, w)
    (y * gs[rank]).sum().backward()
    y_ref = 2 * Xf.detach() @ Ws[rank].detach().t()
    checks = (("y", y.detach(), y_ref), ("x_full", full.detach(), Xf.detach()),
              ("dx", x.grad, Xs[rank].grad), ("dw", w.grad, Ws[rank].grad))  # fmt: skip
    for what, got, want in checks:
        why = mismatch(got, want, TOL[torch.float32])
        failures += [f"all_gather_matmul {what} rank {rank}: {why}"] if why else []

    # a list of weights that are not adjacent: the op joins them where it runs (a copy)
    @torch.compile(fullgraph=True, backend=backend)
    def listed(x, a, b):
        ya, yb = overlap.all_gather_matmul(x, [a.t(), b.t()], chunks=2)
        return torch.cat([ya, 3 * yb], dim=1)

    scale = torch.tensor([1.0] * 20 + [3.0] * 12, dtype=torch.float64)
    Xs = [t.double().requires_grad_() for t in xs]
    Xf = torch.cat(Xs)
    Ws = [t.double().requires_grad_() for t in ws]
    sum(((Xf @ Ws[r].t()) * scale * gs[r].double()).sum() for r in range(R)).backward()
    for frozen in (False, True):  # the first weight frozen: the others still get gradients
        x = xs[rank].clone().requires_grad_()
        a, b = (p.clone().requires_grad_() for p in ws[rank].split([20, 12]))
        a.requires_grad_(not frozen)
        out = listed(x, a, b)
        (out * gs[rank]).sum().backward()
        checks = [("y", out.detach(), (Xf @ Ws[rank].t() * scale).detach()),
                  ("dx", x.grad, Xs[rank].grad), ("db", b.grad, Ws[rank].grad[20:])]  # fmt: skip
        checks += [] if frozen else [("da", a.grad, Ws[rank].grad[:20])]
        if frozen and a.grad is not None:
            failures.append(f"all_gather_matmul list rank {rank}: a frozen weight got a gradient")
        for what, got, want in checks:
            why = "None" if got is None else mismatch(got, want, TOL[torch.float32])
            failures += (
                [f"all_gather_matmul list frozen={frozen} {what} rank {rank}: {why}"] if why else []
            )

    # the MLP of a transformer block, gate and up sharing their input, both ways
    for sp in (False, True):
        fulls = [nn.Linear(24, 64), nn.Linear(24, 64), nn.Linear(64, 24)]  # gate, up, down
        for p in (p for m in fulls for p in m.parameters()):
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g))
        x_full = torch.randn(2 * R * 8, 3, 24, generator=g)  # [s, b, h]
        g_full = torch.randn(2 * R * 8, 3, 24, generator=g)
        refs = [copy_double(m) for m in fulls]
        xr = x_full.double().requires_grad_()
        y_ref = refs[2](torch.nn.functional.silu(refs[0](xr)) * refs[1](xr))
        (y_ref * g_full.double()).sum().backward()
        gate, up = (ColumnParallelLinear.from_linear(m, sequence_parallel=sp) for m in fulls[:2])
        down = RowParallelLinear.from_linear(fulls[2], sequence_parallel=sp)
        share_input(gate, up)

        @torch.compile(fullgraph=True, backend=backend)
        def mlp(t, gate=gate, up=up, down=down):
            return down(torch.nn.functional.silu(gate(t)) * up(t))

        T = x_full.shape[0] // R
        mine = slice(rank * T, (rank + 1) * T) if sp else slice(None)
        xin = x_full[mine].clone().requires_grad_()
        overlap.stats(reset=True)
        with _weights_seen() as seen:
            out = mlp(xin)
            (out * g_full[mine]).sum().backward()
        calls = sum(sum(h.values()) for h in overlap.stats(reset=True).values())
        # gate and up reach the engine side by side (sequence parallel) or stacked (the
        # input gradient without it) where they lie: a copy made in the graph would be at
        # a new address at every call (records churn, decisions cross models)
        own = {gate.weight.data_ptr(), down.weight.data_ptr()}
        if not seen <= own:
            failures.append(f"layers sp={sp} rank {rank}: the engine got weights at "
                            f"{sorted(seen - own)}, not the layers' own {sorted(own)}")  # fmt: skip
        if calls != (4 if sp else 2):  # gate and up: one gather (sp) and one input gradient
            failures.append(f"layers sp={sp} rank {rank}: {calls} calls of the library's ops")
        n = 64 // R
        cols = slice(rank * n, (rank + 1) * n)
        checks = (("y", out.detach(), y_ref[mine].detach()), ("dx", xin.grad, xr.grad[mine]),
                  ("gate dw", gate.weight.grad, refs[0].weight.grad[cols]),
                  ("up dw", up.weight.grad, refs[1].weight.grad[cols]),
                  ("down dw", down.weight.grad, refs[2].weight.grad[:, cols]))  # fmt: skip
        with torch.no_grad():  # (a prefill: dynamo traces the Functions' forwards alone)
            checks += (("y no_grad", mlp(xin), y_ref[mine].detach()),)
        for what, got, want in checks:
            why = mismatch(got, want, TOL[torch.float32])
            failures += [f"layers sp={sp} {what} rank {rank}: {why}"] if why else []
    return failures


@contextlib.contextmanager
def _weights_seen():
    """The addresses of the weights the call engine is given (``run_before``, ``run_after``)
    while the block runs."""
    from overlap.ops import dense, gather

    seen, patched = set(), [(dense, "run_after"), (dense, "run_before"), (gather, "run_before")]
    real = [getattr(mod, name) for mod, name in patched]

    def spy(fn):
        def wrapped(x, w, *args, **kwargs):
            seen.add(w.data_ptr())
            return fn(x, w, *args, **kwargs)

        return wrapped

    for (mod, name), fn in zip(patched, real, strict=True):
        setattr(mod, name, spy(fn))
    try:
        yield seen
    finally:
        for (mod, name), fn in zip(patched, real, strict=True):
            setattr(mod, name, fn)


def copy_double(m):
    import copy

    return copy.deepcopy(m).double()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_all_gather_and_layers(backend):
    spawn(_compiled_gather_and_layers, 2, random.randrange(1 << 30), backend)
