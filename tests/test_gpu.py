"""GPU suite (marker ``gpu``): 2 ranks on NCCL, one GPU each, spawned from one pytest process.

Run on a machine with 2 GPUs:  ``python -m pytest -m gpu tests/test_gpu.py``
Each case is checked against a float64 reference computed on the GPU, output poisoned with NaN.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from _dist import check_case, count_collectives, spawn

pytestmark = pytest.mark.gpu

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_to_all")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (lead..., K, N): large row-band shapes, ragged ones, a 3-D x, and decode M = 16, 128.
SHAPES = [
    (2048, 4096, 4096),
    (1000, 1000, 3000),
    (778, 333, 1234),
    (4, 256, 1024, 2048),
    (16, 4096, 8192),
    (128, 4096, 8192),
    (64, 72, 520),
]


def _suite(rank, R, seed, backend, chunks):
    counts = count_collectives() if backend == "torch" else None
    failures = []
    i = 0
    for coll in COLLECTIVES:
        for dtype in DTYPES:
            for shape in SHAPES:
                i += 1
                msg = check_case(
                    rank,
                    R,
                    f"cuda:{rank}",
                    coll,
                    dtype,
                    shape,
                    seed + i,
                    backend=backend,
                    chunks=chunks,
                    count_calls=counts,
                )
                failures += [msg] if msg else []
    for coll in COLLECTIVES:  # decode-sized: the planner's own choice is the plain path
        msg = check_case(
            rank,
            R,
            f"cuda:{rank}",
            coll,
            torch.bfloat16,
            (16, 4096, 8192),
            seed + 500,
            backend=backend,
            expect="fallback",
        )
        failures += [msg] if msg else []
    for coll in ("all_reduce", "reduce_scatter"):  # avg and a plain-layout w
        msg = check_case(
            rank,
            R,
            f"cuda:{rank}",
            coll,
            torch.bfloat16,
            (512, 256, 768),
            seed + 999,
            op="avg",
            transposed_w=False,
            backend=backend,
            chunks=chunks,
        )
        failures += [msg] if msg else []
    return failures


def _need_gpus(n):
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPUs")


@pytest.mark.parametrize("p2p", ["nvlink", "no_p2p"])
@pytest.mark.parametrize("backend", ["torch", "cupy"])
def test_suite_two_gpus(p2p, backend, monkeypatch):
    _need_gpus(2)
    if backend == "cupy":
        pytest.importorskip("cupy")
    if p2p == "no_p2p":
        monkeypatch.setenv("NCCL_P2P_DISABLE", "1")  # NCCL through host memory, like PCIe cards
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    spawn(_suite, 2, random.randrange(1 << 30), backend, 4, backend="nccl")


@pytest.mark.parametrize("wait", ["spin", "stream_wait"])
def test_wait_methods_and_many_chunks(wait, monkeypatch):
    """Both stream-wait implementations, with the most chunks the planner allows."""
    _need_gpus(2)
    monkeypatch.setenv("OVERLAP_WAIT", wait)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    spawn(_repeat, 2, random.randrange(1 << 30), backend="nccl")


def _repeat(rank, R, seed):
    from overlap.signal import method

    failures = []
    for i in range(20):  # counters grow across calls: epochs, not resets
        coll = COLLECTIVES[i % 3]
        msg = check_case(
            rank, R, f"cuda:{rank}", coll, torch.bfloat16, (4096, 1024, 4096), seed + i, chunks=8
        )
        failures += [msg] if msg else []
    if method() != os.environ["OVERLAP_WAIT"]:
        failures.append(f"wait method {method()}, asked for {os.environ['OVERLAP_WAIT']}")
    return failures
