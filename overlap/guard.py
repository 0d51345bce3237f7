"""Validation mode: ranks agree on each call before any collective runs, and no wait is endless.

Off by default (it costs a store round trip and a host synchronization per call). Turn it on
with ``overlap.configure(validate=True)``, ``OVERLAP_VALIDATE=1``, or
``TORCH_DISTRIBUTED_DEBUG=DETAIL``. When on, every call with more than one rank:

1. Publishes a fingerprint of the call (collective, op, shapes, dtype, and the plan that
   runs: its transport and chunks) in the default group's key-value store, under the group's
   name and the call's number in that group, and waits up to ``timeout`` seconds for every
   rank's fingerprint. A rank that does not arrive (dead, or stuck elsewhere) gives
   ``TimeoutError`` naming it; ranks that disagree give ``RankMismatchError`` with every
   rank's fingerprint. Both are raised before this call has launched anything, so the GPU is
   never left waiting.
2. After issuing the chunks, waits on the host up to ``timeout`` seconds for the last
   collective. If it does not finish (a peer died mid-call), the communicator is aborted, so
   that the GPU's streams are released, and ``TimeoutError`` is raised; the group is unusable
   afterwards, as after any NCCL abort. With torch's default
   ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, its watchdog may also end the process after the abort;
   set it to 0 to handle the error yourself (the GPU tests do).

Off, the process group's own timeout governs (``init_process_group(timeout=...)``): gloo
raises at once when a peer's connection closes, or after that timeout; torch's NCCL watchdog
aborts the communicator after it. The GEMM's counters cannot hang a stream by themselves: a
chunk waits only for this rank's own GEMM, launched before the wait.

Store keys: ``overlap/<group name>/<call number>/<rank>``; each rank deletes its key of call
``n - 2`` once every rank has reached call ``n - 1`` (so every rank has read it).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist


class RankMismatchError(ValueError):
    """Ranks called the same collective with different arguments or plans."""


def _env_validate() -> bool:
    return (
        os.environ.get("OVERLAP_VALIDATE", "0") == "1"
        or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
    )


_settings = {
    "validate": _env_validate(),
    "timeout": float(os.environ.get("OVERLAP_TIMEOUT", "300")),
}


def configure(*, validate: bool | None = None, timeout: float | None = None) -> None:
    """Turn validation mode on or off and set its timeout in seconds (module docstring).

    Every rank of a group must use the same setting: validation is itself a rendezvous.

    Raises:
        ValueError: ``timeout`` is not positive.
    """
    if timeout is not None:
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        _settings["timeout"] = float(timeout)
    if validate is not None:
        _settings["validate"] = bool(validate)


def validating() -> bool:
    """Whether validation mode is on."""
    return _settings["validate"]


def timeout() -> float:
    """The validation timeout in seconds."""
    return _settings["timeout"]


def group_name(group: dist.ProcessGroup | None) -> str:
    """The name of ``group`` (``None``: the default group), the same on all of its ranks."""
    return (group if group is not None else dist.group.WORLD).group_name


class Rendezvous:
    """Per-group agreement through the default store (``agree`` keeps one per group name: the
    call numbers must go on across contexts and ``overlap.release``, or a new count would
    meet the keys of old calls)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.store = dist.distributed_c10d._get_default_store()
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.prefix = f"overlap/{group_name(group)}/"
        self.calls = 0

    def _key(self, n: int, r: int) -> str:
        return f"{self.prefix}{n}/{r}"

    def agree(self, fingerprint: str, what: str, splits=None) -> None:
        """Publish this rank's fingerprint of call ``what`` and check every rank's; with
        ``splits`` (``(sends, receives)``: rows per rank), also that what every rank sends
        to each other is what that one receives from it.

        Raises:
            TimeoutError: a rank did not publish within the timeout.
            RankMismatchError: the fingerprints differ, or the splits do not match.
        """
        n = self.calls
        self.calls += 1
        keys = [self._key(n, r) for r in range(self.size)]
        if splits is not None:
            fingerprint += f" splits={list(splits[0])}>{list(splits[1])}"
        self.store.set(keys[self.rank], fingerprint)
        try:
            self.store.wait(keys, timedelta(seconds=timeout()))
        except RuntimeError as e:  # the store's "Wait timeout", or a store that went away
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            raise TimeoutError(
                f"{what}: rank(s) {missing} of the group did not reach call #{n} within "
                f"{timeout():g} s (dead, or waiting elsewhere); nothing was launched. ({e})"
            ) from e
        if n >= 2:
            self.store.delete_key(self._key(n - 2, self.rank))
        values = [v.decode() for v in self.store.multi_get(keys)]
        bad = any(v.split(" splits=")[0] != fingerprint.split(" splits=")[0] for v in values)
        if splits is not None and not bad:  # rank a sends rank b what b receives from a
            sr = [_parse_splits(v) for v in values]
            R = range(self.size)
            bad = any(sr[a][0][b] != sr[b][1][a] for a in R for b in R)
        if bad:
            table = "\n".join(f"  rank {r}: {v}" for r, v in enumerate(values))
            raise RankMismatchError(
                f"{what}: ranks disagree on call #{n}; nothing was launched.\n{table}"
            )


def _parse_splits(value: str) -> tuple[list[int], list[int]]:
    """The ``(sends, receives)`` a published fingerprint with splits carries."""
    sends, receives = value.split(" splits=")[1].split(">")
    return json.loads(sends), json.loads(receives)


_rendezvous: dict[str, Rendezvous] = {}  # group name -> its rendezvous (a few ints each)


def agree(group: dist.ProcessGroup | None, fingerprint: str, what: str, splits=None) -> None:
    """``Rendezvous.agree`` on ``group``'s rendezvous (made on first use)."""
    name = group_name(group)
    if name not in _rendezvous:
        _rendezvous[name] = Rendezvous(group)
    _rendezvous[name].agree(fingerprint, what, splits)


def watch(stream: torch.cuda.Stream | None, abort, what: str) -> None:
    """Wait on the host until ``stream``'s work so far is done, at most ``timeout()`` seconds;
    past it call ``abort()`` and raise ``TimeoutError``. CPU work (``stream=None``) is already
    done when issued."""
    if stream is None:
        return
    done = torch.cuda.Event()
    done.record(stream)
    deadline = time.monotonic() + timeout()
    while not done.query():
        if time.monotonic() > deadline:
            abort()
            raise TimeoutError(
                f"{what}: the collectives did not finish within {timeout():g} s (a peer rank "
                "died or stopped mid-call); the communicator was aborted and the group cannot "
                "be used again"
            )
        time.sleep(1e-4)


def fingerprint(plan, dtype: torch.dtype, op: str) -> str:
    """What must be equal on every rank for a call to be valid: the collective, shapes, dtype,
    op and the plan that runs (path, transport, layout, tiles per chunk and tiles). An
    uneven all-to-all's ``M`` differs by rank: its splits are checked instead (``agree``)."""
    M = "uneven" if plan.splits is not None else plan.M
    return (
        f"{plan.collective} op={op} M={M} N={plan.N} K={plan.K} {dtype} path={plan.path} "
        f"transport={plan.transport} blocked={plan.blocked} chunks={plan.tiles_per_chunk} "
        f"tiles={plan.tiles}"
    )
