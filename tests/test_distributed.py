"""2, 4 and 8 CPU ranks on gloo: the real chunk plan, Triton kernel (interpreter), counters and
per-chunk collectives end to end, against a float64 reference; ``op="avg"`` on the overlapped
and the plain path; every collective forward and backward on subgroups of 4 ranks whose group
ranks differ from the global ones. Fresh random data every run."""

from __future__ import annotations

import random

import pytest
import torch
from _dist import (
    TOL,
    _draw,
    check_case,
    check_grad_case,
    count_collectives,
    mismatch,
    on_subgroups,
    spawn,
)

import overlap

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_to_all")
# (lead..., K, N): ragged edges everywhere, a 3-D x, and decode-like M (column chunks).
SHAPES_2 = [(96, 64, 64), (130, 45, 70), (16, 33, 130), (2, 50, 40, 100), (258, 20, 97)]


def _cases_2ranks(rank, R, seed, dtype):
    """Every collective at every shape of ``SHAPES_2`` in ``dtype``."""
    counts = count_collectives()
    failures = []
    for i, (coll, shape) in enumerate((c, s) for c in COLLECTIVES for s in SHAPES_2):
        msg = check_case(rank, R, "cpu", coll, dtype, shape, seed + i, chunks=3, count_calls=counts)
        failures += [msg] if msg else []
    return failures


def _cases_2ranks_more(rank, R, seed):
    """avg, a contiguous ``w``, the default chunk count, calls reusing the counters, and the
    plain path (too small to split, or bfloat16: wrong in the interpreter), same answer."""
    counts = count_collectives()
    failures = []
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_two_ranks_all_collectives(dtype):
    spawn(_cases_2ranks, 2, random.randrange(1 << 30), dtype)


def test_two_ranks_avg_contiguous_w_and_the_plain_path():
    spawn(_cases_2ranks_more, 2, random.randrange(1 << 30))


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


def _avg(rank, R, seed):
    """``op="avg"`` for both reductions, through ``matmul_collective`` and the op's own name:
    the overlapped path, and the plain path for each of its causes here (a product too small
    to split, bf16 in the interpreter, ``overlap.tune``'s choice); backward on the plain path
    (the overlapped one: test_autograd.py)."""
    from overlap.context import set_tuned, tuned_key

    failures = []
    shape = (64, 40, 48)
    for i, coll in enumerate(("all_reduce", "reduce_scatter")):
        for j, (dtype, shp, chunks, expect) in enumerate((
            (torch.float32, shape, 2, "overlap"), (torch.float32, (8, 16, 24), None, "fallback"),
            (torch.bfloat16, shape, 2, "fallback"),
        )):  # fmt: skip
            msg = check_case(rank, R, "cpu", coll, dtype, shp, seed + 10 * i + j, op="avg",
                             chunks=chunks, expect=expect)  # fmt: skip
            failures += [msg] if msg else []
        key = tuned_key(shape[0], shape[2], shape[1], torch.float32, coll)
        set_tuned(None, torch.device("cpu"), key, "plain")  # (as overlap.tune records it)
        try:
            msg = check_case(rank, R, "cpu", coll, torch.float32, shape, seed + 10 * i + 5,
                             op="avg", expect="fallback")  # fmt: skip
        finally:
            set_tuned(None, torch.device("cpu"), key, None)
        failures += [msg] if msg else []
        for j, dtype in enumerate((torch.float32, torch.bfloat16)):  # the op's own name
            _, xs, ws = _draw(R, dtype, shape, seed + 10 * i + 6 + j)
            ref = sum(x.double() @ w.double().t() for x, w in zip(xs, ws, strict=True)) / R
            if coll == "reduce_scatter":
                ref = ref[rank * shape[0] // R : (rank + 1) * shape[0] // R]
            fn = overlap.matmul_allreduce if coll == "all_reduce" else overlap.matmul_reduce_scatter
            why = mismatch(fn(xs[rank], ws[rank].t(), op="avg", chunks=2), ref, TOL[dtype])
            failures += [f"{fn.__name__} {dtype} op=avg rank {rank}: {why}"] if why else []
        msg = check_grad_case(rank, R, "cpu", (coll, torch.bfloat16, shape, "avg"), seed + i,
                              chunks=2)  # (bf16 in the interpreter: the plain path)  # fmt: skip
        failures += [msg] if msg else []
    return failures


def test_avg_on_the_overlapped_and_the_plain_path():
    spawn(_avg, 2, random.randrange(1 << 30))


def _subgroup(rank, R, seed, group):
    """Every collective on ``group`` (a subgroup whose ranks differ from the global ones):
    forward into a NaN-poisoned ``out``, then forward and backward."""
    failures = []
    for i, coll in enumerate(COLLECTIVES):
        msg = check_case(rank, R, "cpu", coll, torch.float32, (48, 40, 36), seed + i, chunks=3,
                         group=group)  # fmt: skip
        failures += [msg] if msg else []
        case = (coll, torch.float32, (2, 24, 40, 36), "sum")
        msg = check_grad_case(rank, R, "cpu", case, seed + 10 + i, chunks=2, group=group)
        failures += [msg] if msg else []
    return failures


def test_subgroups_of_four_ranks():
    spawn(on_subgroups, 4, _subgroup, random.randrange(1 << 30))
