"""Faults and misuse on gloo ranks (CPU, Triton interpreter): disagreeing ranks, a rank that
never arrives, a rank killed mid-call, counters across wrap-around, several groups at once,
NaN and Inf. The same scenarios run on 2 GPUs in test_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch
from _dist import check_case, count_collectives, fault_scenarios, spawn

import overlap
from overlap.signal import ChunkCounters


@pytest.mark.parametrize("scenario", ["disagree", "never_arrives", "killed_mid_call"])
def test_faults_raise_instead_of_hanging(scenario):
    spawn(fault_scenarios, 2, scenario, "cpu")


def _wrap_and_specials(rank, R, seed):
    from overlap.api import _context

    failures = []
    # Counters of this (group, device, stream) start 5 below 2**32: targets wrap on call 1.
    ctx = _context(None, torch.device("cpu"))
    ctx.counters = ChunkCounters(torch.device("cpu"), start=(1 << 32) - 5)
    for i in range(4):
        coll = ("all_reduce", "reduce_scatter", "all_to_all")[i % 3]
        msg = check_case(rank, R, "cpu", coll, torch.float32, (96, 40, 64), seed + i, chunks=3)
        failures += [msg] if msg else []
    if not ctx.counters.expected[0] < 1 << 31:
        failures.append(f"counters did not wrap: {ctx.counters.expected[:3]}")
    for j, coll in enumerate(("all_reduce", "reduce_scatter", "all_to_all")):
        for dtype in (torch.float32, torch.float16):
            msg = check_case(
                rank, R, "cpu", coll, dtype, (64, 24, 40), seed + 10 + j, chunks=2, specials=True
            )
            failures += [msg] if msg else []
    return failures


def test_counter_wrap_and_nan_inf_end_to_end():
    spawn(_wrap_and_specials, 2, random.randrange(1 << 30))


def _capture_branch(rank, R, seed):
    """The branch taken under CUDA-graph capture (forced here on CPU): each call counts on
    counters of its own starting at 0 and leaves the eager counters alone. Replays of real
    graphs run in test_gpu.py."""
    import overlap.api as api

    cpu = torch.device("cpu")
    ctx = api._context(None, cpu)
    ctx.counters = ChunkCounters(cpu, start=1000)  # eager targets would be 1000 + tiles
    before, expected = ctx.counters.tensor.clone(), list(ctx.counters.expected)
    real, api._capturing = api._capturing, lambda t: True
    failures = []
    try:
        for i, coll in enumerate(("all_reduce", "reduce_scatter", "all_to_all") * 2):
            msg = check_case(rank, R, "cpu", coll, torch.float32, (64, 40, 48), seed + i, chunks=3)
            failures += [msg] if msg else []
    finally:
        api._capturing = real
    if not torch.equal(ctx.counters.tensor, before) or ctx.counters.expected != expected:
        failures.append("a captured call changed the eager counters")
    msg = check_case(rank, R, "cpu", "all_reduce", torch.float32, (64, 40, 48), seed, chunks=3)
    return failures + ([msg] if msg else [])


def test_capture_branch_uses_its_own_counters():
    spawn(_capture_branch, 2, random.randrange(1 << 30))


def _groups(rank, R, seed):
    """World, pairs {0,1} {2,3} and {0,2} {1,3}: calls interleaved across groups and two
    models (weights drawn per call), each group with its own counters and checked result."""
    import torch.distributed as dist

    pairs_a = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pairs_b = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine_a, mine_b = pairs_a[rank // 2], pairs_b[rank % 2]
    counts = count_collectives()
    failures = []
    for i in range(3):
        for g, grank, gsize, gseed in (
            (None, rank, R, seed + i),
            (mine_a, rank % 2, 2, seed + 100 * (rank // 2) + i),
            (mine_b, rank // 2, 2, seed + 1000 * (rank % 2) + i),
        ):
            coll = ("all_reduce", "reduce_scatter", "all_to_all")[(i + gsize) % 3]
            msg = check_case(
                grank, gsize, "cpu", coll, torch.float32, (64, 32, 48), gseed, chunks=2,
                group=g, count_calls=counts,
            )  # fmt: skip
            failures += [msg] if msg else []
    from overlap.api import _contexts

    if len({id(c.counters) for c in _contexts.values()}) != len(_contexts) or len(_contexts) < 3:
        failures.append(f"groups share counters: {len(_contexts)} contexts")
    return failures


def test_several_groups_interleaved():
    spawn(_groups, 4, random.randrange(1 << 30))


def test_configure_rejects_bad_timeout():
    with pytest.raises(ValueError, match="timeout"):
        overlap.configure(timeout=0)
