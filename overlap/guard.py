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
aborts the communicator after it. The calls through the copy engines (and CuPy's NCCL
communicator), which torch does not see, are watched by this module's ``Watchdog`` with the
same timeout (or ``configure(timeout=)`` where set): a call not finished in time releases its
waits, raises ``PeerTimeoutError`` in the thread that issued it and fails its group's later
calls. The GEMM's counters cannot hang a stream by themselves: a chunk waits only for this
rank's own GEMM, launched before the wait.

Store keys: ``overlap/<group name>/<call number>/<rank>`` and ``.../<call number>/verdict``
(``Rendezvous``); each rank deletes its key of call ``n - 2`` once every rank has reached call
``n - 1`` (so every rank has read it), rank 0 the verdict.

After a ``TimeoutError`` at call ``n`` this rank's calls on the group raise ``RuntimeError``
(saying so) until every rank has reached call ``n``: a late rank raises there too, and the
ranks go on in step; a dead rank never does (a new process group is needed).
"""

from __future__ import annotations

import collections
import ctypes
import json
import logging
import math
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("overlap")


class RankMismatchError(ValueError):
    """Ranks called the same collective with different arguments or plans."""


def _env_validate() -> bool:
    return (
        os.environ.get("OVERLAP_VALIDATE", "0") == "1"
        or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
    )


# timeout None: not set (validation mode takes DEFAULT_TIMEOUT, the watchdog the group's own)
_settings = {
    "validate": _env_validate(),
    "timeout": float(os.environ["OVERLAP_TIMEOUT"]) if "OVERLAP_TIMEOUT" in os.environ else None,
}
DEFAULT_TIMEOUT = 300.0


def configure(*, validate: bool | None = None, timeout: float | None = None) -> None:
    """Turn validation mode on or off and set the timeout in seconds of its waits and of the
    watchdog (module docstring; unset: 300 s for validation mode, the process group's own
    timeout for the watchdog).

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
    return _settings["timeout"] or DEFAULT_TIMEOUT


def default(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group``, or for None the default group of the moment (None before
    ``init_process_group``): what the library keeps for None must not outlive a destroyed
    default group (a new one may number the ranks otherwise)."""
    return group if group is not None else dist.group.WORLD


def group_name(group: dist.ProcessGroup | None) -> str:
    """The name of ``group`` (``None``: the default group), the same on all of its ranks."""
    return default(group).group_name


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
        self.world = dist.group.WORLD  # (made under this default group: ``agree``)
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
    """``Rendezvous.agree`` on ``group``'s rendezvous (made on first use, and again under a
    new default group: after ``destroy_process_group`` torch numbers the groups from "0"
    again, and a name's old rendezvous holds the old store, ranks and count). Not covered: a
    second ``init_process_group`` given the same store object, whose new rendezvous counts
    from 0 and may meet the old one's last two keys."""
    name = group_name(group)
    rv = _rendezvous.get(name)
    if rv is None or rv.world is not dist.group.WORLD:
        rv = _rendezvous[name] = Rendezvous(group)
    rv.agree(fingerprint, what, splits)


_issuing = threading.local()  # .watch: the Watch of the call this thread is issuing


def arm() -> None:
    """Right before a call's first collective: start its watch's clock (``Watch``), if the
    call this thread is issuing has a watch."""
    w = getattr(_issuing, "watch", None)
    if w is not None:
        w.arm()


class Watch:
    """Validation mode's watch of one call's work on ``stream`` (None: CPU work, already done
    when issued, so nothing to watch); ``fail(why)`` releases the call's waits on its peers
    and makes the group's later calls raise ``why`` (``Transport.fail``).

    Made before the call issues anything; ``arm`` starts the clock right before its first
    collective, and ``close`` (which arms it too) waits on the host until ``stream``'s work so
    far is done. If ``timeout()`` seconds pass first, ``fail`` runs in a timer thread and
    ``close`` raises ``TimeoutError``. The thread is what makes a call raise whose host is
    held inside CUDA while issuing: on two GPUs (2026-11-26) the all-gather's first cuBLAS
    matmul, the uneven all-to-all's ``index_select`` and the dispatch's matmuls, each issued
    after collectives stuck on a dead peer, did not return (not CUDA's lazy module loading:
    the all-gather hung the same with ``CUDA_MODULE_LOADING=EAGER``); the abort ends the
    collectives and the host goes on. Torch's ops release the GIL while in CUDA, so the
    thread runs. The clock starts at ``arm``, not at ``Watch()``: a first call's kernel
    compilation must not count."""

    def __init__(self, stream: torch.cuda.Stream | None, fail, what: str) -> None:
        self.stream, self.fail, self.what = stream, fail, what
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
        self.fail(
            f"a call ({self.what}) did not finish within {timeout():g} s (validation mode): a "
            "peer rank died or stopped mid-call. Call overlap.release(group) on every live "
            "rank and go on with a new process group, or restart the job"
        )

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


class PeerTimeoutError(TimeoutError):
    """A call through a transport the watchdog watches did not finish within the timeout (a
    peer rank died or stopped): raised by ``Watchdog`` in the thread that issued the call."""

    message = "a call did not finish within the timeout: a peer rank died or stopped"

    def __init__(self, *args) -> None:  # (an asynchronous exception is made with no args)
        super().__init__(*(args or (self.message,)))


def _raise_in(thread: int, message: str) -> bool:
    """``PeerTimeoutError(message)`` raised in the thread ``thread`` at its next Python
    instruction (CPython's asynchronous exception: a thread held inside a C call gets it when
    the call returns); in the main thread where ``thread`` has no Python state any more (an
    autograd worker's may not). Returns whether a thread was found."""
    kind = type("PeerTimeoutError", (PeerTimeoutError,), {"message": message})
    for ident in (thread, threading.main_thread().ident):
        found = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident),
                                                           ctypes.py_object(kind))  # fmt: skip
        if found:
            return True
    return False


def group_timeout(group: dist.ProcessGroup | None, device: torch.device) -> float:
    """``group``'s own timeout in seconds (``init_process_group(timeout=)``,
    ``new_group(timeout=)``), or 600 s where its backend does not say."""
    g = group if group is not None else dist.group.WORLD
    try:
        return g._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return 600.0


RECYCLE = 0.05  # seconds between the watchdog's looks while calls are in flight


class Watchdog:
    """Validation off: the calls in flight through the transports whose waits no one else
    watches (``Transport.watched``: the copy engines' two roads, CuPy's NCCL communicator;
    torch's NCCL watchdog watches its own collectives), so that a peer that died or stopped
    makes the survivors raise instead of waiting forever.

    ``issued``, after each such call (an eager one or a recorded graph's replay; not one the
    user's CUDA graph captured: its replays are the user's), records an event on the caller
    stream, which waits for the whole call. A daemon thread looks at each transport's oldest
    event every ``period`` seconds (a tenth of the timeout, at most 1 s); the calls of one
    transport finish in the order they were issued (``overlap/context.py``). A call not
    finished ``limit`` seconds after it was issued:

    1. is logged (logger ``"overlap"``) and the transport is failed (``Transport.fail``): its
       waits on the peers are released (the GPU, and a host held inside CUDA or in a
       synchronization, go on; the results of the calls in flight are garbage) and every later
       call of the group raises ``RuntimeError`` saying why and what to do;
    2. ``PeerTimeoutError`` (a ``TimeoutError``) is raised in the thread that issued the call
       (``_raise_in``).

    ``limit``: ``configure(timeout=)`` or ``OVERLAP_TIMEOUT`` where set, else the process
    group's own timeout (``group_timeout``, as torch's watchdog). The clock starts when the
    call is issued, as torch's does: a stream queued more than the timeout ahead of its GPU is
    taken for a dead peer. Host cost per call: one event recorded, taken from the events of
    finished calls, which this thread recycles every ``RECYCLE`` seconds while calls are in
    flight (a new event per call, as in a burst before any was recycled, cost ~15 us of host
    time each on 2 H200s). The issuing thread never queries an event: while another thread
    captures a CUDA graph (torch's default "global" mode) that query would fail and invalidate
    the capture; this thread queries in relaxed mode (``_relaxed``).
    """

    def __init__(self) -> None:
        self.flights: dict = {}  # transport -> deque of (event, issued at, what, thread)
        self.limits: dict = {}  # transport -> its group's own timeout
        self.spare: list = []  # events of finished calls, recorded again
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()  # (issuing threads take spare events, this one adds)

    def issued(self, t, stream: torch.cuda.Stream, what) -> None:
        """The call ``what`` (its plan: ``describe()`` names it) was just issued through
        transport ``t`` (``t.group``, ``t.device``) on the caller ``stream``."""
        with self.lock:
            event = self.spare.pop() if self.spare else torch.cuda.Event()
        event.record(stream)
        self.track(t, event, what)

    def track(self, t, event, what) -> None:
        """Watch ``event`` (``query()`` tells whether the call is done) for ``t``."""
        q = self.flights.get(t)
        if q is None:
            self.limits[t] = group_timeout(t.group, t.device)
            q = self.flights[t] = collections.deque()
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="overlap-watchdog",
                                               daemon=True)  # fmt: skip
                self.thread.start()
        q.append((event, time.monotonic(), what, threading.get_ident()))

    def forget(self, t) -> None:
        """Stop watching ``t`` (released: no call of it is in flight)."""
        self.flights.pop(t, None)
        self.limits.pop(t, None)

    def limit(self, t) -> float:
        """Seconds a call through ``t`` may take from its issue."""
        return _settings["timeout"] or self.limits.get(t, 600.0)

    def _run(self) -> None:
        _relaxed()
        while True:
            period = min([1.0] + [self.limit(t) / 10 for t in list(self.limits)])
            if any(self.flights.values()):
                period = min(period, RECYCLE)
            time.sleep(period)
            try:
                self.check(time.monotonic())
            except Exception:  # noqa: BLE001 (the thread must go on watching)
                log.exception("overlap: the watchdog failed to check the calls in flight")

    def check(self, now: float) -> None:
        """Recycle the events of finished calls; fail the transports whose oldest call in
        flight is older than their ``limit``."""
        for t, q in list(self.flights.items()):
            with self.lock:
                while q and q[0][0].query():
                    self.spare.append(q.popleft()[0])
                oldest = q[0] if q else None
            if oldest is not None and now - oldest[1] > self.limit(t):
                self._fire(t, oldest, now - oldest[1])

    def _fire(self, t, entry: tuple, waited: float) -> None:
        _, _, what, thread = entry
        self.forget(t)
        name = what.describe() if hasattr(what, "describe") else str(what)
        why = (
            f"a call ({name}) had not finished {waited:.0f} s after it was issued (timeout "
            f"{self.limit(t):g} s): a peer rank died or stopped. Its waits on the peers were "
            "released, so the results of the calls then in flight are not valid. End the job "
            "and restart it, or call overlap.release(group) on every live rank and go on "
            "with a new process group"
        )
        log.error("overlap: %s", why)
        # ``Transport.fail`` in two steps: the exception is pending before the abort releases
        # a thread held in CUDA, so it raises when that returns; a call it makes first raises
        t.broken = why
        _raise_in(thread, why)
        if t.device.type == "cuda":
            torch.cuda.set_device(t.device)  # (this thread's device: the transport's)
        t.abort()


watchdog = Watchdog()


def _relaxed() -> None:
    """Let this thread query events while another thread captures a CUDA graph: torch's
    captures forbid every other thread's "unsafe" CUDA calls by default (an event query there
    invalidated a user's capture begun within a second of an eager call, 2 H200s), unless the
    querying thread is in relaxed mode. Without cuda-python nothing changes (a capture begun
    within a second of a CuPy call can then fail)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return
    driver.cuThreadExchangeStreamCaptureMode(
        driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    )


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
