"""Chunk-count tuner (``overlap.tune``): time the candidate plans of a call, keep the fastest.

``overlap.tune(x, w, collective, group=...)`` is a collective call (every rank of ``group``
makes it, with its own ``x`` and ``w`` of the same shapes). It

1. looks the call up in the disk cache: rank 0 reads it, and one host collective gives every
   rank what it found and every rank's call (shapes, dtype, collective, candidates), so all
   ranks see the same entry, and ranks whose calls differ raise ``RankMismatchError``
   (validation mode or not) before anything is timed;
2. on a miss, times each candidate (chunk counts, and ``"plain"``: the matmul then one
   collective) on every rank, as the bench does: each call's GPU time with the host queued
   ahead, or its host time where that is larger (``time_queued``); takes the slowest rank's
   median per candidate (an all-reduce, so every rank holds the same numbers) and picks the
   fastest; rank 0 writes the cache;
3. records the choice in this process for ``group`` (``overlap.context``): later calls with
   ``chunks=None`` and the same shapes, dtype and collective use it (``overlap.plan`` shows
   it).

Calls never tune by themselves: a cold call takes the planner's default, so nothing waits on
tuning, and the choice is the same on every rank because it only ever comes from this
collective call. Cache key: GPU name, world size, collective, dtype, M, N, K, the copy
engines' road (``comm.road``: "peer", "host", or None where they do not run) and the NCCL
settings that change the transport (``NCCL_P2P_DISABLE``, ``NCCL_SHM_DISABLE``,
``NCCL_P2P_LEVEL``, ``NCCL_NET``). File: ``OVERLAP_TUNE_CACHE`` or
``~/.cache/overlap/tuned.json``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import comm, guard
from .context import set_tuned, tuned_key
from .ops import Call, all_gather_matmul, capturing, check_operands, matmul_collective
from .plan import MAX_CHUNKS

_TRANSPORT_VARS = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_P2P_LEVEL", "NCCL_NET")
DEFAULT_CANDIDATES = ("plain", 2, 4, 8)


@dataclass(frozen=True)
class Tuned:
    """What ``tune`` chose: ``choice`` (a chunk count or ``"plain"``), the slowest rank's median
    milliseconds per candidate (as cached, on a cache hit), and ``source``: ``"measured"`` or
    ``"cache"``."""

    choice: int | str
    ms: dict
    source: str


def cache_path() -> str:
    """The tuning cache file (``OVERLAP_TUNE_CACHE`` or ``~/.cache/overlap/tuned.json``)."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "overlap", "tuned.json")
    return os.environ.get("OVERLAP_TUNE_CACHE", default)


def _cache_key(
    x: torch.Tensor, M: int, N: int, K: int, R: int, collective: str, count_host: bool, road
) -> str:
    gpu = torch.cuda.get_device_name(x.device) if x.is_cuda else "cpu"
    transport = ",".join(f"{v}={os.environ.get(v, '')}" for v in _TRANSPORT_VARS)
    return (f"{gpu}|R={R}|{collective}|{x.dtype}|{M}x{N}x{K}|road={road}|{transport}"
            f"|host={count_host}")  # fmt: skip


def _read_cache(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(f"ignoring the unreadable tuning cache {path}: {e}", stacklevel=3)
        return {}


def _write_cache(path: str, key: str, entry: dict) -> None:
    data = _read_cache(path)
    data[key] = entry
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


def time_queued(fn, device: torch.device, group) -> tuple[float, float]:
    """``(gpu_ms, host_ms)`` of one ``fn()``: the ranks meet at a barrier, then the GPU sleeps
    ~1 ms so that the host queues the whole call before the GPU reaches it (as in a training
    step whose host runs ahead); ``gpu_ms`` is the GPU's time for the call from CUDA events,
    ``host_ms`` the host's time to issue it. A stream of such calls costs about the larger of
    the two per call. On CPU both are the host's time. Without a process group there is no
    barrier."""
    if dist.is_initialized():
        dist.barrier(group=group)
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        return ms, ms
    torch.cuda.synchronize(device)
    torch.cuda._sleep(2_000_000)  # ~1 ms at H100/H200 clocks
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    fn()
    end.record()
    host_ms = (time.perf_counter() - t0) * 1e3
    end.synchronize()
    return start.elapsed_time(end), host_ms


def tune(
    x: torch.Tensor,
    w: torch.Tensor,
    collective: str = "all_reduce",
    *,
    group: dist.ProcessGroup | None = None,
    candidates: tuple = DEFAULT_CANDIDATES,
    iters: int = 5,
    use_cache: bool = True,
    count_host: bool = True,
) -> Tuned:
    """Choose the chunk count (or the plain path) for calls shaped like this one; collective
    over ``group``.

    Args:
        x: ``[..., K]``, w: ``[K, N]``: as in ``matmul_collective`` (this rank's operands).
        collective: "all_reduce", "reduce_scatter", "all_to_all" or "all_gather" (for
            ``all_gather_matmul``; ``x`` is this rank's shard).
        group: the process group the calls will use (an initialized one, also for one rank:
            ``tune`` asks torch for its size).
        candidates: chunk counts (2-64) and/or ``"plain"``; the same on every rank.
        iters: timed calls per candidate (after one warm-up call).
        use_cache: read and write the disk cache (``cache_path()``).
        count_host: a call costs the larger of its GPU time and its host time (eager calls:
            an overlapped call takes 0.3-0.6 ms of host time on 2x H200, more than the GPU
            time of small products). ``False``: GPU time only, for calls that CUDA graphs will
            replay, or whose host runs far ahead.

    Returns:
        ``Tuned``; the choice is also registered for later calls in this process.

    Raises:
        ValueError: no candidates, a candidate that is neither ``"plain"`` nor in [2, 64],
            ``iters`` < 1, or arguments ``matmul_collective`` refuses.
        RuntimeError: called while the current CUDA stream is being captured.
        overlap.RankMismatchError: the ranks' calls differ (shapes, dtype, collective,
            candidates, iters, ``use_cache``, ``count_host``), found at the cache lookup's host
            collective (validation mode: before it).
        TimeoutError: (validation mode) a rank did not call, found before any host collective.
    """
    before = check_operands(x, w, Call(collective, group, "sum", "torch")).before
    if capturing(x):
        raise RuntimeError("overlap.tune times calls: run it before CUDA-graph capture")
    if not candidates or iters < 1:
        raise ValueError("tune needs at least one candidate and iters >= 1")
    for c in candidates:
        if c != "plain" and not (isinstance(c, int) and 2 <= c <= MAX_CHUNKS):
            raise ValueError(
                f"candidates are 'plain' or chunk counts in [2, {MAX_CHUNKS}], got {c!r}"
            )
    R = dist.get_world_size(group)
    M, K, N = math.prod(x.shape[:-1]) * (R if before else 1), x.shape[-1], w.shape[1]
    if R > 1 and guard.validating():  # before this call's first host collective (below)
        fp = guard.fingerprint(f"tune({collective})", x.dtype, {"M": M, "N": N, "K": K},
                               f"candidates={list(candidates)} iters={iters} "
                               f"cache={use_cache} host={count_host}")  # fmt: skip
        guard.agree(group, fp, f"overlap.tune {collective} {M}x{N}x{K}")
    road = comm.road(group, x.device, False) if x.is_cuda else None  # (asked once per group)
    key = _cache_key(x, M, N, K, R, collective, count_host, road)
    # (the all-gather's plan does not depend on N, so neither does its tuned choice)
    rkey = tuned_key(M, 0 if before else N, K, x.dtype, collective)
    path = cache_path()
    mine = (collective, str(x.dtype), M, 0 if before else N, K, list(candidates), iters,
            use_cache, count_host)  # fmt: skip
    found = _read_cache(path).get(key) if use_cache and dist.get_rank(group) == 0 else None
    seen: list = [None] * R  # every rank's call, and what rank 0 found in the cache
    dist.all_gather_object(seen, (mine, found), group=group)
    if any(call != mine for call, _ in seen):
        table = "\n".join(f"  rank {r}: {call}" for r, (call, _) in enumerate(seen))
        raise guard.RankMismatchError(f"overlap.tune: ranks disagree (collective, dtype, M, N, "
                                      f"K, candidates, iters, cache, host); nothing was "
                                      f"timed.\n{table}")  # fmt: skip
    entry = seen[0][1]
    if entry is not None and entry.get("choice") in candidates:
        result = Tuned(entry["choice"], entry.get("ms", {}), "cache")
    else:
        medians = []
        # "plain" is timed through the tuned choices (calls with chunks=None consult them)
        set_tuned(group, x.device, rkey, "plain")
        try:
            for c in candidates:
                chunks = None if c == "plain" else c

                def call(chunks=chunks):
                    if before:
                        all_gather_matmul(x, w, group=group, chunks=chunks)
                    else:
                        matmul_collective(x, w, collective, group=group, chunks=chunks)

                call()  # warm-up (compiles kernels)
                samples = [time_queued(call, x.device, group) for _ in range(iters)]
                times = [max(s) if count_host else s[0] for s in samples]
                medians.append(statistics.median(times))
        finally:
            set_tuned(group, x.device, rkey, None)
        t = torch.tensor(medians, dtype=torch.float64, device=x.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # identical on every rank
        ms = {str(c): v for c, v in zip(candidates, t.tolist(), strict=True)}
        choice = candidates[min(range(len(candidates)), key=lambda i: (t[i].item(), i))]
        result = Tuned(choice, ms, "measured")
        if use_cache and dist.get_rank(group) == 0:
            _write_cache(path, key, {"choice": choice, "ms": ms, "date": time.strftime("%F")})
    set_tuned(group, x.device, rkey, result.choice)
    return result
