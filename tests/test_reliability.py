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


@pytest.mark.parametrize(
    "scenario",
    [
        "disagree",
        "never_arrives",
        "killed_mid_call",
        "killed_mid_gather",
        "killed_mid_split",
        "killed_mid_grouped",
        "killed_mid_dispatch",
        "killed_mid_bags",
    ],
)
def test_faults_raise_instead_of_hanging(scenario):
    spawn(fault_scenarios, 2, scenario, "cpu")


def _wrap_and_specials(rank, R, seed):
    from overlap.context import context

    failures = []
    # Counters of this (group, device, stream) start 5 below 2**32: targets wrap on call 1.
    ctx = context(None, torch.device("cpu"))
    ctx._counters = ChunkCounters(torch.device("cpu"), start=(1 << 32) - 5)
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
    import overlap.ops as ops
    from overlap.context import context

    cpu = torch.device("cpu")
    ctx = context(None, cpu)
    ctx._counters = ChunkCounters(cpu, start=1000)  # eager targets would be 1000 + tiles
    before, expected = ctx.counters.tensor.clone(), list(ctx.counters.expected)
    real, ops._capturing = ops._capturing, lambda t: True
    failures = []
    try:
        for i, coll in enumerate(("all_reduce", "reduce_scatter", "all_to_all") * 2):
            msg = check_case(rank, R, "cpu", coll, torch.float32, (64, 40, 48), seed + i, chunks=3)
            failures += [msg] if msg else []
    finally:
        ops._capturing = real
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
    # Each group's counters hold the tiles of that group's calls and no other's.
    from overlap.context import context
    from overlap.plan import make_plan

    for g, gsize in ((None, R), (mine_a, 2), (mine_b, 2)):
        want = [0] * 3
        for i in range(3):
            coll = ("all_reduce", "reduce_scatter", "all_to_all")[(i + gsize) % 3]
            p = make_plan(64, 48, 32, world_size=gsize, collective=coll, dtype_bits=32,
                          interpreter=True, chunks=2, transport="torch")  # fmt: skip
            for c, tiles in enumerate(p.tiles_per_chunk):
                want[c] += tiles
        got = context(g, torch.device("cpu")).counters.tensor[:3].tolist()
        if got != want or context(g, torch.device("cpu")).counters.expected[:3] != want:
            failures.append(f"group of size {gsize}: counters {got}, expected {want}")
    return failures


def test_several_groups_interleaved():
    spawn(_groups, 4, random.randrange(1 << 30))


def test_configure_rejects_bad_timeout():
    with pytest.raises(ValueError, match="timeout"):
        overlap.configure(timeout=0)


def _release_and_bound(rank, R, seed):
    """``overlap.release`` forgets a group's contexts (later calls start afresh and are right),
    and no more than ``MAX_CONTEXTS`` contexts live at once."""
    import torch.distributed as dist

    import overlap.context as octx

    cpu = torch.device("cpu")
    failures = []
    groups = [dist.new_group([0, 1]) for _ in range(3)]
    real_max, octx.MAX_CONTEXTS = octx.MAX_CONTEXTS, 2
    try:
        for i, g in enumerate(groups[:2]):
            msg = check_case(rank, R, "cpu", "all_reduce", torch.float32, (64, 32, 48), seed + i,
                             chunks=2, group=g)  # fmt: skip
            failures += [msg] if msg else []
        try:
            overlap.matmul_collective(torch.randn(64, 32), torch.randn(32, 48), chunks=2,
                                      group=groups[2])  # fmt: skip
            failures.append("a third context was made beyond MAX_CONTEXTS = 2")
        except RuntimeError as e:
            if "overlap.release" not in str(e):
                failures.append(f"the error does not point to overlap.release: {e}")
        ctx = octx.context(groups[0], cpu)
        overlap.release(groups[0])
        if any(k[0] is groups[0] for k in octx._contexts) or ctx._counters is not None:
            failures.append("release kept the group's context or its counters")
        if not any(k[0] is groups[1] for k in octx._contexts):
            failures.append("release dropped another group's context")
        for i, g in enumerate((groups[2], groups[0])):  # room again; a released group anew
            msg = check_case(rank, R, "cpu", "reduce_scatter", torch.float32, (64, 32, 48),
                             seed + 10 + i, chunks=2, group=g)  # fmt: skip
            failures += [msg] if msg else []
            overlap.release(groups[1 - i])
    finally:
        octx.MAX_CONTEXTS = real_max
    return failures


def test_release_and_the_bound_on_contexts():
    spawn(_release_and_bound, 2, random.randrange(1 << 30))
