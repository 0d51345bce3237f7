"""Faults and misuse on gloo ranks (CPU, Triton interpreter): disagreeing ranks, a rank that
never arrives, a rank killed mid-call, the CUDA-graph branch, several groups at once, NaN
and Inf. The same scenarios run on 2 GPUs in test_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch
from _dist import check_case, count_collectives, fault_scenarios, spawn

import overlap


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


def _growth_with_different_needs(rank, R):
    """Validation off, ranks whose calls need different buffer sizes: the copy engines'
    buffer growth (a collective that runs anyway) raises ``RankMismatchError`` on every rank,
    before anything is mapped (the host road's shared file removed); equal needs pass."""
    import glob
    import tempfile

    from overlap.comm.host import HostTransport
    from overlap.comm.peer import PeerTransport
    from overlap.comm.transport import same_need

    failures = []
    files = lambda: set(glob.glob("/dev/shm/overlap-*") +  # noqa: E731
                        glob.glob(tempfile.gettempdir() + "/overlap-*"))  # fmt: skip
    before = files()
    for cls in (PeerTransport, HostTransport):
        t = object.__new__(cls)
        t.group, t.device, t.rank, t.size = None, torch.device("cpu"), rank, R
        t.buf = t.mapping = None
        try:
            t._ensure(4096 * (1 + rank))
            failures.append(f"{cls.__name__}: no error although the ranks' needs differ")
        except overlap.RankMismatchError as e:
            if "[4096, 8192]" not in str(e) or "validate=True" not in str(e):
                failures.append(f"{cls.__name__}: the error does not say what differs: {e}")
    if same_need(None, 4096, rank) != list(range(R)):
        failures.append("equal needs: not every rank's payload came back")
    if rank == 0 and files() - before:
        failures.append(f"the host road left its file: {files() - before}")
    return failures


def test_ranks_needing_different_buffers_raise():
    spawn(_growth_with_different_needs, 2)


def _specials(rank, R, seed):
    failures = []
    for j, coll in enumerate(("all_reduce", "reduce_scatter", "all_to_all")):
        for dtype in (torch.float32, torch.float16):
            msg = check_case(
                rank, R, "cpu", coll, dtype, (64, 24, 40), seed + 10 + j, chunks=2, specials=True
            )
            failures += [msg] if msg else []
    return failures


def test_nan_inf_end_to_end():
    spawn(_specials, 2, random.randrange(1 << 30))


def _capture_branch(rank, R, seed):
    """The branch taken under CUDA-graph capture (forced here on CPU), calls of every
    collective between eager ones. Replays of real graphs run in test_gpu.py."""
    import overlap.ops.engine as engine

    real, engine.capturing = engine.capturing, lambda t: True
    failures = []
    try:
        for i, coll in enumerate(("all_reduce", "reduce_scatter", "all_to_all") * 2):
            msg = check_case(rank, R, "cpu", coll, torch.float32, (64, 40, 48), seed + i, chunks=3)
            failures += [msg] if msg else []
    finally:
        engine.capturing = real
    msg = check_case(rank, R, "cpu", "all_reduce", torch.float32, (64, 40, 48), seed, chunks=3)
    return failures + ([msg] if msg else [])


def test_capture_branch():
    spawn(_capture_branch, 2, random.randrange(1 << 30))


def _groups(rank, R, seed):
    """World, pairs {0,1} {2,3} and {0,2} {1,3}: calls interleaved across groups and two
    models (weights drawn per call), each result checked."""
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
        if any(c.group is groups[0] for c in octx.contexts()) or ctx._transports:
            failures.append("release kept the group's context or its transports")
        if not any(c.group is groups[1] for c in octx.contexts()):
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


def _exit_lets_go(rank, R, seed):
    """The library holds the default group after calls (the group state, the memo's keys,
    validation's rendezvous); ``destroy_process_group`` and then the interpreter's exit
    handlers must leave nothing of it (kept until the interpreter finalizes, gloo's group
    could abort the process)."""
    import atexit
    import gc
    import weakref

    import torch.distributed as dist

    failures = []
    for i, chunks in enumerate((2, None)):  # overlapped (a context), then the plain path's memo
        msg = check_case(rank, R, "cpu", "all_reduce", torch.float32, (64, 32, 48), seed + i,
                         chunks=chunks)  # fmt: skip
        failures += [msg] if msg else []
    overlap.configure(validate=True)  # (validation's rendezvous holds the default group too)
    try:
        msg = check_case(rank, R, "cpu", "all_reduce", torch.float32, (64, 32, 48), seed + 2,
                         chunks=2)  # fmt: skip
        failures += [msg] if msg else []
    finally:
        overlap.configure(validate=False)
    group = weakref.ref(dist.group.WORLD)
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    if group() is None:
        return failures + ["the library kept nothing of the group: this test shows nothing"]
    atexit._run_exitfuncs()  # (what the interpreter runs at its exit, before it finalizes)
    if group() is not None:
        failures.append("after the exit handlers something still holds the destroyed group")
    return failures


def test_the_exit_lets_go_of_a_destroyed_group():
    spawn(_exit_lets_go, 2, random.randrange(1 << 30))
