"""Multi-rank harness shared by the gloo and the GPU tests: spawn ranks, run cases, compare
against a float64 reference built from every rank's inputs."""

from __future__ import annotations

import math
import os
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import overlap

# ||out - ref|| / ||ref|| bounds. CPU fp32 runs the interpreter (exact fp32 dot); CUDA fp32
# follows torch.matmul (TF32 off by default). 16-bit: rounding of the product and of the sum.
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _entry(rank, world_size, init_file, backend, fn, args, errors_dir):
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=120),
        )
        failures = fn(rank, world_size, *args)
    except Exception:
        failures = [traceback.format_exc()]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if failures:
        with open(os.path.join(errors_dir, f"rank{rank}.txt"), "w") as f:
            f.write("\n".join(failures))


def spawn(fn, world_size: int, *args, backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args) -> list[str]`` on ``world_size`` ranks; raise
    AssertionError with every rank's failures."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(
            _entry,
            args=(world_size, os.path.join(d, "init"), backend, fn, args, d),
            nprocs=world_size,
        )
        reports = sorted(f for f in os.listdir(d) if f.startswith("rank"))
        text = "\n".join(open(os.path.join(d, f)).read() for f in reports)
    assert not reports, text


def check_case(
    rank: int,
    R: int,
    device: str,
    collective: str,
    dtype: torch.dtype,
    shape: tuple,
    seed: int,
    *,
    op: str = "sum",
    transposed_w: bool = True,
    backend: str = "torch",
    expect: str = "overlap",
    chunks: int | None = None,
    count_calls: dict | None = None,
) -> str | None:
    """One call of ``overlap.matmul_collective`` on this rank, checked; a message on failure.

    ``shape`` is ``(lead..., K, N)``; every rank draws every rank's inputs from ``seed`` so the
    float64 reference needs no communication.
    """
    *lead, K, N = shape
    M = math.prod(lead)
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(*lead, K, generator=g).to(dtype) for _ in range(R)]
    ws = [torch.randn(N, K, generator=g).to(dtype) for _ in range(R)]  # nn.Linear weights
    x = xs[rank].to(device)
    w = ws[rank].to(device).t() if transposed_w else ws[rank].t().contiguous().to(device)
    prods = [
        xs[r].to(device, torch.float64).reshape(M, K) @ ws[r].to(device, torch.float64).t()
        for r in range(R)
    ]
    Mr = M // R
    if collective == "all_reduce":
        ref = sum(prods).reshape(*lead, N)
    elif collective == "reduce_scatter":
        ref = sum(prods)[rank * Mr : (rank + 1) * Mr]
    else:
        ref = torch.cat([p[rank * Mr : (rank + 1) * Mr] for p in prods]).reshape(*lead, N)
    if op == "avg":
        ref = ref / R
    p = overlap.plan(x, w, collective, chunks=chunks)
    out = torch.full(ref.shape, float("nan"), dtype=dtype, device=device)
    before = dict(count_calls) if count_calls is not None else None
    name = f"{collective} {dtype} {shape} op={op} backend={backend} rank={rank}"
    try:
        res = overlap.matmul_collective(
            x, w, collective, op=op, out=out, backend=backend, chunks=chunks
        )
    except Exception as e:  # report the case; the other ranks fail their own way or time out
        return f"{name}: {type(e).__name__}: {e} ({p.describe()})"
    if p.path != expect:
        return f"{name}: path {p.path} ({p.reason}), expected {expect}"
    if res.data_ptr() != out.data_ptr():
        return f"{name}: result is not `out`"
    if count_calls is not None and p.path == "overlap":
        issued = sum(count_calls.values()) - sum(before.values())
        if issued != p.n_chunks:
            return f"{name}: {issued} collectives issued for {p.n_chunks} chunks"
    got = res.to(torch.float64)
    if torch.isnan(got).any():
        return f"{name}: {int(torch.isnan(got).sum())} elements never written (NaN)"
    err = ((got - ref).norm() / ref.norm()).item()
    if not err < TOL[dtype]:
        return f"{name}: relative error {err:.3g} > {TOL[dtype]:g} ({p.describe()})"
    return None


def count_collectives() -> dict:
    """Wrap torch.distributed's collectives in this process to count calls."""
    counts: dict = {}
    for fname in ("all_reduce", "reduce_scatter_tensor", "all_to_all"):
        orig = getattr(dist, fname)
        counts[fname] = 0

        def wrapped(*a, _orig=orig, _name=fname, **k):
            counts[_name] += 1
            return _orig(*a, **k)

        setattr(dist, fname, wrapped)
    return counts
