"""2, 4 and 8 CPU ranks on gloo: the real chunk plan, Triton kernel (interpreter), counters and
per-chunk collectives end to end, against a float64 reference. Fresh random data every run."""

from __future__ import annotations

import random

import pytest
import torch
from _dist import check_case, count_collectives, spawn

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_to_all")
# (lead..., K, N): ragged edges everywhere, a 3-D x, and decode-like M (column chunks).
SHAPES_2 = [(96, 64, 64), (130, 45, 70), (16, 33, 130), (2, 50, 40, 100), (258, 20, 97)]


def _cases_2ranks(rank, R, seed):
    counts = count_collectives()
    failures = []
    for i, (coll, dtype, shape) in enumerate(
        (c, d, s) for c in COLLECTIVES for d in (torch.float32, torch.float16) for s in SHAPES_2
    ):
        msg = check_case(rank, R, "cpu", coll, dtype, shape, seed + i, chunks=3, count_calls=counts)
        failures += [msg] if msg else []
    # avg, contiguous (non-transposed) w, default chunk count, and calls reusing the counters
    for j, coll in enumerate(("all_reduce", "reduce_scatter")):
        for k in range(2):
            msg = check_case(
                rank,
                R,
                "cpu",
                coll,
                torch.float32,
                (64, 40, 96),
                seed + 100 + j * 2 + k,
                op="avg",
                transposed_w=False,
                count_calls=counts,
            )
            failures += [msg] if msg else []
    # too small to split, or bfloat16 (wrong in the interpreter): the plain path, same answer
    for coll in COLLECTIVES:
        msg = check_case(
            rank, R, "cpu", coll, torch.float32, (8, 16, 24), seed + 200, expect="fallback"
        )
        failures += [msg] if msg else []
        msg = check_case(
            rank, R, "cpu", coll, torch.bfloat16, (64, 40, 96), seed + 300, expect="fallback",
            chunks=2,
        )  # fmt: skip
        failures += [msg] if msg else []
    return failures


def _cases_many(rank, R, seed):
    failures = []
    for i, coll in enumerate(COLLECTIVES):
        for j, shape in enumerate([(8 * R * 3, 40, 72), (2 * R, 24, 200)]):
            msg = check_case(
                rank, R, "cpu", coll, torch.float32, shape, seed + 10 * i + j, chunks=4
            )
            failures += [msg] if msg else []
    return failures


def test_two_ranks_all_collectives():
    spawn(_cases_2ranks, 2, random.randrange(1 << 30))


@pytest.mark.parametrize("world_size", [4, 8])
def test_more_ranks(world_size):
    spawn(_cases_many, world_size, random.randrange(1 << 30))


def _divisibility(rank, R):
    import overlap

    x, w = torch.randn(5, 8), torch.randn(8, 4)
    failures = []
    for coll in ("reduce_scatter", "all_to_all"):
        try:
            overlap.matmul_collective(x, w, coll)
            failures.append(f"{coll}: M=5 on 2 ranks did not raise")
        except ValueError as e:
            if "divisible" not in str(e):
                failures.append(f"{coll}: unclear error {e}")
    return failures


def test_m_not_divisible_by_world_size():
    spawn(_divisibility, 2)
