"""No devices: ``torch.compile(fullgraph=True)`` of code that calls the library, on 2 gloo ranks
with the kernels in Triton's interpreter: no graph break (fullgraph raises on one), forward
and backward against float64 autograd over every rank's inputs (``_dist.check_grad_case``)."""

from __future__ import annotations

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
