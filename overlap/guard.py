"""Validation mode: ranks agree on each call before any collective runs, and no wait is endless.

Off by default (it costs a store round trip and a host synchronization per call). Turn it on
with ``overlap.configure(validate=True)``, ``OVERLAP_VALIDATE=1``, or
``TORCH_DISTRIBUTED_DEBUG=DETAIL``. When on, every call with more than one rank:

1. Publishes a fingerprint of the call (``fingerprint``: the op, its dtype, the sizes every
   rank must share, and the layout of the plan that runs: its transport and chunks) in the
   default group's key-value store, under the group's name and the call's number in that
   group (calls that make a host collective first, ``overlap.tune`` and
   ``embedding_bag_all_to_all(rank_dims=None)``, agree before it), and waits up to
   ``timeout`` seconds for every rank's fingerprint. A rank that does not arrive (dead, or
   stuck elsewhere) gives ``TimeoutError`` naming it; ranks that disagree give
   ``RankMismatchError`` with every rank's fingerprint. Both are raised before this call has
   launched anything, so the GPU is never left waiting.
2. Gives the call's collectives ``timeout`` seconds from the first one's issue (``Watch``),
   and after issuing waits on the host for the last. If it does not finish (a peer died
   mid-call), the communicator is aborted from a timer thread, so that the GPU's streams (and
   a host held inside CUDA) are released, and ``TimeoutError`` is raised; the group is unusable
   afterwards, as after any NCCL abort. With torch's default
   ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, its watchdog may also end the process after the abort;
   set it to 0 to handle the error yourself (the GPU tests do).

Off, the process group's own timeout governs (``init_process_group(timeout=...)``): gloo
raises at once when a peer's connection closes, or after that timeout; torch's NCCL watchdog
aborts the communicator after it. The GEMM's counters cannot hang a stream by themselves: a
chunk waits only for this rank's own GEMM, launched before the wait.

Store keys: ``overlap/<group name>/<call number>/<rank>`` and ``.../<call number>/verdict``
(``Rendezvous``); each rank deletes its key of call ``n - 2`` once every rank has reached call
``n - 1`` (so every rank has read it), rank 0 the verdict.

After a ``TimeoutError`` at call ``n`` this rank's calls on the group raise ``RuntimeError``
(saying so) until every rank has reached call ``n``: a late rank raises there too, and the
ranks go on in step; a dead rank never does (a new process group is needed).
"""

from __future__ import annotations

import json
import math
import os
import threading
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
        TypeError: ``validate`` is not a bool, or ``timeout`` not a number.
        ValueError: ``timeout`` is not positive and finite.
    """
    if validate is not None and not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
        if not 0 < timeout < math.inf:  # (False for NaN)
            raise ValueError(f"timeout must be positive and finite seconds, got {timeout!r}")
        _settings["timeout"] = float(timeout)
    if validate is not None:
        _settings["validate"] = validate


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
    meet the keys of old calls).

    Call ``n`` also has a verdict key, written once by whichever rank decides first
    (``compare_set``): "met" by a rank that found every fingerprint, or "gave up" by a rank
    whose wait timed out. So a rank that arrives after a peer gave up raises there too,
    instead of launching collectives that peer never joins; once every rank has failed call
    ``n`` their counts agree again. Until then (``out_of_step``) this rank's calls on the
    group raise at once: their numbers would meet the keys of other calls."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.store = dist.distributed_c10d._get_default_store()
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.name = group_name(group)
        self.prefix = f"overlap/{self.name}/"
        self.calls = 0
        self.out_of_step: tuple[int, str] | None = None  # (call, why) after a timeout here

    def _key(self, n: int, r: int) -> str:
        return f"{self.prefix}{n}/{r}"

    def _check_in_step(self) -> None:
        """Raise while a call this rank gave up on has not been reached by every rank."""
        n, why = self.out_of_step
        if self.store.check([self._key(n, r) for r in range(self.size)]):
            self.out_of_step = None  # every rank reached call n and failed it: in step again
            return
        raise RuntimeError(
            f"overlap: group {self.name!r} fell out of step at call #{n} ({why}); this rank's "
            f"later calls on it cannot be matched with the other ranks'. A rank that reaches "
            f"call #{n} late raises there too, and then the ranks are in step again. If a rank "
            "died or will not call again, every live rank must call overlap.release(group) "
            "and go on with a new process group (dist.new_group, or destroy_process_group and "
            "init_process_group again)."
        )

    def agree(self, fingerprint: str, what: str, splits=None) -> None:
        """Publish this rank's fingerprint of call ``what`` and check every rank's; with
        ``splits`` (``(sends, receives)``: rows per rank), also that what every rank sends
        to each other is what that one receives from it.

        Raises:
            TimeoutError: a rank did not publish within the timeout, or gave up on this call
                before this rank arrived.
            RankMismatchError: the fingerprints differ, or the splits do not match.
            RuntimeError: this rank gave up on an earlier call that a peer has not reached.
        """
        if self.out_of_step is not None:
            self._check_in_step()
        n = self.calls
        self.calls += 1
        keys = [self._key(n, r) for r in range(self.size)]
        verdict = f"{self.prefix}{n}/verdict"
        if splits is not None:
            fingerprint += f" splits={list(splits[0])}>{list(splits[1])}"
        self.store.set(keys[self.rank], fingerprint)
        try:
            self.store.wait(keys, timedelta(seconds=timeout()))
        except RuntimeError as e:  # the store's "Wait timeout", or a store that went away
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            why = f"rank(s) {missing} did not reach it within {timeout():g} s"
            try:
                seen = self.store.compare_set(verdict, "", f"gave up: {why}")
            except RuntimeError:  # the store went away
                seen = b""
            if seen != b"met":
                self.out_of_step = (n, why)
                raise TimeoutError(
                    f"{what}: rank(s) {missing} of the group did not reach call #{n} within "
                    f"{timeout():g} s (dead, or waiting elsewhere); nothing was launched. ({e})"
                ) from e
        else:
            seen = self.store.compare_set(verdict, "", "met").decode()
            if seen != "met":
                raise TimeoutError(f"{what}: a rank gave up on call #{n} before this rank "
                                   f"arrived ({seen}); nothing was launched")  # fmt: skip
        if n >= 2:
            self.store.delete_key(self._key(n - 2, self.rank))
            if self.rank == 0:  # (every rank read it: all have reached call n - 1)
                self.store.delete_key(f"{self.prefix}{n - 2}/verdict")
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


_issuing = threading.local()  # .watch: the Watch of the call this thread is issuing


def arm() -> None:
    """Right before a call's first collective: start its watch's clock (``Watch``), if the
    call this thread is issuing has a watch."""
    w = getattr(_issuing, "watch", None)
    if w is not None:
        w.arm()


class Watch:
    """Validation mode's watch of one call's work on ``stream`` (None: CPU work, already done
    when issued, so nothing to watch); ``abort`` releases the call's waits on its peers.

    Made before the call issues anything; ``arm`` starts the clock right before its first
    collective, and ``close`` (which arms it too) waits on the host until ``stream``'s work so
    far is done. If ``timeout()`` seconds pass first, ``abort`` runs in a timer thread and
    ``close`` raises ``TimeoutError``. The thread is what makes a call raise whose host is
    held inside CUDA while issuing: on two GPUs (2026-11-26) the all-gather's first cuBLAS
    matmul, the uneven all-to-all's ``index_select`` and the dispatch's matmuls, each issued
    after collectives stuck on a dead peer, did not return (not CUDA's lazy module loading:
    the all-gather hung the same with ``CUDA_MODULE_LOADING=EAGER``); the abort ends the
    collectives and the host goes on. Torch's ops release the GIL while in CUDA, so the
    thread runs. The clock starts at ``arm``, not at ``Watch()``: a first call's kernel
    compilation must not count."""

    def __init__(self, stream: torch.cuda.Stream | None, abort, what: str) -> None:
        self.stream, self.abort, self.what = stream, abort, what
        self.lock, self.state, self.timer = threading.Lock(), "new", None
        _issuing.watch = self

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, kind, error, tb) -> None:
        self.close(error)

    def arm(self) -> None:
        """Start the clock (once; not for CPU work)."""
        if self.stream is None or self.timer is not None:
            return
        self.state = "armed"
        self.timer = threading.Timer(timeout(), self._fire)
        self.timer.daemon = True
        self.timer.start()

    def _fire(self) -> None:
        with self.lock:
            if self.state != "armed":
                return
            self.state = "fired"
        torch.cuda.set_device(self.stream.device)  # (this thread's device: the transports')
        self.abort()

    def close(self, error: BaseException | None = None) -> None:
        """After the call's work is issued: wait for it (not when ``error``, an exception
        the issue raised, is given); raise ``TimeoutError`` if the clock ran out."""
        _issuing.watch = None
        if self.stream is None:
            return
        self.arm()
        if error is None:
            done = torch.cuda.Event()
            done.record(self.stream)
            while self.state == "armed" and not done.query():
                time.sleep(1e-4)
        with self.lock:
            fired = self.state == "fired"
            self.state = "closed"
        self.timer.cancel()
        if fired:
            self.timer.join()  # the abort has finished
            raise TimeoutError(
                f"{self.what}: the collectives did not finish within {timeout():g} s (a peer "
                "rank died or stopped mid-call); the communicator was aborted and the group "
                "cannot be used again"
            ) from error


def fingerprint(op: str, dtype: torch.dtype, sizes: dict[str, int | list], layout: str) -> str:
    """What every rank must agree on for a call to be valid, no more: the op's identity
    (``op``: the op and its collective or reduction), ``dtype``, the ``sizes`` that change a
    message or the result (each op names its own: ``M`` and ``N`` after a matmul, the
    gathered ``M`` and ``K`` before one, the ``width`` of an uneven exchange's rows: ``K``
    for the MoE dispatch, ``N`` for the others; the embedding bags' ``bags`` and ``mode``),
    and the plan's ``layout`` (its transport and how it cuts the messages: ``Plan.layout``).
    Sizes that only change this rank's own matmul (``K`` after it, ``N`` before it) are left
    out: ranks may differ in them. An uneven exchange's rows differ by rank: ``agree`` checks
    its splits instead.

    Format: ``"<op> <dtype> <name>=<size>... <layout>"``."""
    return " ".join([op, str(dtype).removeprefix("torch."),
                     *(f"{k}={v}" for k, v in sizes.items()), layout])  # fmt: skip
