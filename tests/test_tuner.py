"""overlap.tune on 2 and 3 gloo ranks (interpreter): one choice on every rank, used by later
calls, cached on disk, a corrupt cache ignored; the slowest rank's time decides (ranks timed
differently agree); ranks whose calls differ raise; the cache key holds the world size and the
copy engines' road; ``overlap.release`` of the default group (as None or as the group) forgets
its tuned choices, contexts and decided calls. The timings themselves mean nothing on CPU."""

from __future__ import annotations

import os
import random
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from _dist import check_case, mismatch, spawn

import overlap
from overlap.plan import make_plan


def _tune_cases(rank, R, cache, seed):
    os.environ["OVERLAP_TUNE_CACHE"] = cache
    failures = []
    x, w = torch.randn(96, 40), torch.randn(40, 64)
    cands = ("plain", 2, 3)
    overlap.plan(x, w, "all_reduce")  # the signature's plan is kept: the tuned choice replaces it
    t1 = overlap.tune(x, w, "all_reduce", candidates=cands, iters=2)
    choices = [None] * R
    dist.all_gather_object(choices, t1.choice)
    if len(set(choices)) != 1 or t1.source != "measured" or set(t1.ms) != set(map(str, cands)):
        failures.append(f"first tune: {t1} (choices on the ranks: {choices})")
    p = overlap.plan(x, w, "all_reduce")
    if t1.choice == "plain":
        want = "fallback"
        ok = p.path == "fallback" and "tune" in p.reason
    else:
        want = "overlap"
        ok = p.n_chunks == make_plan(
            96, 64, 40, world_size=R, collective="all_reduce", dtype_bits=32, interpreter=True,
            chunks=t1.choice,
        ).n_chunks  # fmt: skip
    if not ok:
        failures.append(f"a later call does not use the tuned choice {t1.choice}: {p.describe()}")
    msg = check_case(rank, R, "cpu", "all_reduce", torch.float32, (96, 40, 64), seed, expect=want)
    failures += [msg] if msg else []
    t2 = overlap.tune(x, w, "all_reduce", candidates=cands, iters=2)
    if t2.source != "cache" or t2.choice != t1.choice:
        failures.append(f"second tune did not come from the cache: {t2}")
    # GPU-only timing (calls replayed by CUDA graphs) is a cache entry of its own
    t2g = overlap.tune(x, w, "all_reduce", candidates=cands, iters=1, count_host=False)
    if t2g.source != "measured":
        failures.append(f"count_host=False came from the count_host=True entry: {t2g}")
    t1 = overlap.tune(x, w, "all_reduce", candidates=cands, iters=2)  # registered again
    # one candidate: the choice is forced; chunk counts go through the planner (and replace
    # the plan kept for the signature)
    if overlap.plan(x, w, "reduce_scatter").n_chunks == 3:
        failures.append("the default plan has the forced chunk count: the check below is void")
    t3 = overlap.tune(x, w, "reduce_scatter", candidates=(3,), iters=1, use_cache=False)
    want3 = make_plan(
        96, 64, 40, world_size=R, collective="reduce_scatter", dtype_bits=32, interpreter=True,
        chunks=3,
    )  # fmt: skip
    if t3.choice != 3 or overlap.plan(x, w, "reduce_scatter").tiles_per_chunk != (
        want3.tiles_per_chunk
    ):
        failures.append(f"forced tune: {t3}")
    msg = check_case(rank, R, "cpu", "reduce_scatter", torch.float32, (96, 40, 64), seed + 1)
    failures += [msg] if msg else []
    # the all-gather: x is the shard, the tuned plan is the gathered M's
    t5 = overlap.tune(x, w, "all_gather", candidates=(3,), iters=1, use_cache=False)
    want5 = make_plan(96 * R, 64, 40, world_size=R, collective="all_gather", dtype_bits=32,
                      interpreter=True, chunks=3)  # fmt: skip
    if t5.choice != 3 or overlap.plan(x, w, "all_gather").shard_bands != want5.shard_bands:
        failures.append(f"all_gather tune: {t5}, {overlap.plan(x, w, 'all_gather').describe()}")
    # a corrupt cache is ignored with a warning (rank 0 reads it) and rewritten
    dist.barrier()
    if rank == 0:
        with open(cache, "w") as f:
            f.write("{not json")
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t4 = overlap.tune(x, w, "all_to_all", candidates=("plain", 2), iters=1)
    if t4.source != "measured" or (rank == 0 and not any("tuning cache" in str(c.message)
                                                          for c in caught)):  # fmt: skip
        failures.append(f"corrupt cache: {t4}, warnings {[str(c.message) for c in caught]}")
    dist.barrier()
    if rank == 0:
        with open(cache) as f:
            if "all_to_all" not in f.read():
                failures.append("the cache was not rewritten")
    return failures


def test_tune_agrees_caches_and_is_used():
    with tempfile.TemporaryDirectory() as d:
        spawn(_tune_cases, 2, os.path.join(d, "tuned.json"), random.randrange(1 << 30))


def test_tune_rejects_bad_candidates():
    x, w = torch.randn(8, 4), torch.randn(4, 8)
    with pytest.raises(ValueError, match="candidates"):
        overlap.tune(x, w, candidates=(1,))
    with pytest.raises(ValueError, match="iters"):
        overlap.tune(x, w, candidates=(2,), iters=0)


def test_tune_refuses_graph_capture(monkeypatch):
    import overlap.tuner as tuner

    monkeypatch.setattr(tuner, "capturing", lambda t: True)
    with pytest.raises(RuntimeError, match="CUDA-graph capture"):
        overlap.tune(torch.randn(8, 4), torch.randn(4, 8), candidates=(2,))


def _timed_apart(rank, R, cache):
    """Each rank times the candidates differently (``time_queued`` replaced): alone, rank 0
    would take 2 chunks and rank 1 3; the slowest rank's medians make it 4 on both. Then
    ranks whose calls differ raise."""
    import overlap.tuner as tuner

    os.environ["OVERLAP_TUNE_CACHE"] = cache
    x, w = torch.randn(96, 40), torch.randn(40, 64)
    times = iter(
        [(1.0, 0.5), (5.0, 0.5), (3.0, 0.5)] if rank == 0 else [(0.5, 6.0), (0.5, 1.0), (0.5, 3.5)]
    )  # (gpu, host): count_host takes the max
    tuner.time_queued = lambda fn, device, group: next(times)
    failures = []
    t = overlap.tune(x, w, "all_reduce", candidates=(2, 3, 4), iters=1, use_cache=False)
    if t.choice != 4 or t.ms != {"2": 6.0, "3": 5.0, "4": 3.5}:
        failures.append(f"rank {rank}: {t}, expected 4 from the slowest rank's times")
    if overlap.plan(x, w, "all_reduce").n_chunks != make_plan(
        96, 64, 40, world_size=R, collective="all_reduce", dtype_bits=32, interpreter=True,
        chunks=4,
    ).n_chunks:  # fmt: skip
        failures.append(f"rank {rank}: later calls do not use the choice: "
                        f"{overlap.plan(x, w, 'all_reduce').describe()}")  # fmt: skip
    for what, kw in (("M", {"x": x[: 48 * (2 - rank)]}), ("iters", {"iters": 1 + rank})):
        args = {"x": x, "w": w, "candidates": (2, 3), "iters": 1, **kw}
        try:
            overlap.tune(args.pop("x"), args.pop("w"), "reduce_scatter", **args)
            failures.append(f"ranks disagree on {what}: no error")
        except overlap.RankMismatchError as e:
            if "rank 0:" not in str(e) or "rank 1:" not in str(e):
                failures.append(f"{what}: the error lacks the ranks' calls: {e}")
    return failures


def _cached(rank, R, cache):
    """One call tuned, so that the cache has its entry for ``R`` ranks."""
    os.environ["OVERLAP_TUNE_CACHE"] = cache
    x, w = torch.randn(96, 40), torch.randn(40, 64)
    overlap.tune(x, w, "all_to_all", candidates=(2,), iters=1)
    return []


def _other_world(rank, R, cache):
    """The call of ``_cached`` on ``R`` ranks: not the cache's entry for 2 ranks; the second
    time from the cache (or the check above is void)."""
    os.environ["OVERLAP_TUNE_CACHE"] = cache
    x, w = torch.randn(96, 40), torch.randn(40, 64)
    sources = [overlap.tune(x, w, "all_to_all", candidates=(2,), iters=1).source
               for _ in range(2)]  # fmt: skip
    return [] if sources == ["measured", "cache"] else [f"rank {rank}: sources {sources}"]


def test_ranks_timed_apart_agree():
    with tempfile.TemporaryDirectory() as d:
        spawn(_timed_apart, 2, os.path.join(d, "tuned.json"))


def test_the_cache_keys_the_world_size():
    with tempfile.TemporaryDirectory() as d:
        cache = os.path.join(d, "tuned.json")
        spawn(_cached, 2, cache)
        spawn(_other_world, 3, cache)


def _release_forgets_the_default_group(rank, R, seed):
    """A call and an ``overlap.tune`` of the default group (passed as None or as
    ``dist.group.WORLD``; the plain path or a chunk count chosen), then ``overlap.release``
    (of None or of the group): no context, no tuned choice and no decided call of the group
    left, the next plan the default one, and the next call right (against float64, its
    ``out`` NaN first)."""
    from overlap import context
    from overlap.state import states

    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(96, 32, generator=g) for _ in range(R)]
    ws = [torch.randn(32, 32, generator=g) for _ in range(R)]
    x, w = xs[rank], ws[rank]
    ref = sum(xi.double() @ wi.double() for xi, wi in zip(xs, ws, strict=True))
    default = overlap.plan(x, w, "all_reduce").describe()  # (2 chunks)
    world = dist.group.WORLD
    failures = []
    for tuned_on, released, choice in ((None, None, "plain"), (world, None, 3),
                                       (None, world, "plain")):  # fmt: skip
        name = f"tune(group={tuned_on and 'WORLD'}) to {choice}, release({released and 'WORLD'})"
        overlap.matmul_allreduce(x, w, group=tuned_on)
        overlap.tune(x, w, "all_reduce", group=tuned_on, candidates=(choice,), iters=1,
                     use_cache=False)  # fmt: skip
        if overlap.plan(x, w, "all_reduce").describe() == default:
            failures.append(f"{name}: the tuned plan is the default one: the case is void")
        overlap.release(released)
        kept = [s for s in states() if s.group is world]
        left = {"contexts": [c for s in kept for c in s.contexts],
                "tuned choices": [k for s in kept for k in s.tuned],
                "decided calls": list(context.calls)}  # fmt: skip
        failures += [f"{name}: {what} left: {keys}" for what, keys in left.items() if keys]
        after = overlap.plan(x, w, "all_reduce").describe()
        if after != default:
            failures.append(f"{name}: the plan after release is not the default:\n{after}\n"
                            f"default:\n{default}")  # fmt: skip
        out = torch.full((96, 32), float("nan"))
        why = mismatch(overlap.matmul_allreduce(x, w, out=out), ref, 1e-5)
        failures += [f"{name}: the call after release: {why}"] if why else []
    return failures


def test_release_of_the_default_group_forgets_its_tuned_choices():
    spawn(_release_forgets_the_default_group, 2, random.randrange(1 << 30))


def test_the_cache_key_holds_what_changes_the_timing(monkeypatch):
    """One field changed at a time (world size, collective, dtype, shape, the copy engines'
    road, an NCCL setting, host time counted): a key of its own."""
    from overlap.tuner import _cache_key

    x = torch.randn(8, 4)
    base = (x, 8, 16, 4, 2, "all_reduce", True, "peer")
    keys = {_cache_key(*base)}
    for i, other in ((4, 4), (5, "reduce_scatter"), (0, x.half()), (1, 16), (6, False),
                     (7, "host"), (7, None)):  # fmt: skip
        keys.add(_cache_key(*base[:i], other, *base[i + 1 :]))
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0" if os.environ.get("NCCL_P2P_DISABLE") else "1")
    keys.add(_cache_key(*base))
    assert len(keys) == 9, keys
