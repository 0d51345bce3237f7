"""The watchdog: with validation off, a call through a transport no one else watches that has
not finished within the timeout makes its issuing thread raise (``Watchdog``).

Off validation mode, the process group's own timeout governs (``init_process_group(timeout=
...)``): gloo raises at once when a peer's connection closes, or after that timeout; torch's
NCCL watchdog aborts the communicator after it. The calls through the copy engines (and CuPy's
NCCL communicator), which torch does not see, are watched here with the same timeout (or
``configure(timeout=)`` where set): a call not finished in time releases its waits, raises
``PeerTimeoutError`` in the thread that issued it and fails its group's later calls. The GEMM's
counters cannot hang a stream by themselves: a chunk waits only for this rank's own GEMM,
launched before the wait.

The process's watchdog is ``dog``; ``issued`` and ``forget`` are its methods.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
import time

import torch

from . import settings
from .groups import group_timeout

log = logging.getLogger("overlap")


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


RECYCLE = 0.05  # seconds between the watchdog's looks while calls are in flight


class Flights(collections.deque):
    """A transport's calls in flight, oldest first: ``(event, issued at, what, thread)``; and
    ``spare``, the events of its finished calls, recorded again for its next ones (a CUDA event
    belongs to the device it was first recorded on: a transport's are on its device)."""

    def __init__(self) -> None:
        super().__init__()
        self.spare: list = []


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
    the same transport's finished calls (``Flights.spare``), which this thread recycles every
    ``RECYCLE`` seconds while calls are in flight (a new event per call, as in a burst before
    any was recycled, cost ~15 us of host time each on 2 H200s). The issuing thread never
    queries an event: while another thread captures a CUDA graph (torch's default "global"
    mode) that query would fail and invalidate the capture; this thread queries in relaxed
    mode (``_relaxed``).
    """

    def __init__(self) -> None:
        self.flights: dict[object, Flights] = {}  # transport -> its calls in flight
        self.limits: dict = {}  # transport -> its group's own timeout
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()  # (flights made, looked at and dropped)

    def issued(self, t, stream: torch.cuda.Stream, what) -> None:
        """The call ``what`` (its plan: ``describe()`` names it) was just issued through
        transport ``t`` (``t.group``, ``t.device``) on the caller ``stream``."""
        q = self.flights.get(t)
        if q is None:
            q = self._watch(t)
        try:  # (a list's pop and append are atomic: no lock)
            event = q.spare.pop()
        except IndexError:
            event = torch.cuda.Event()
        event.record(stream)
        q.append((event, time.monotonic(), what, threading.get_ident()))

    def track(self, t, event, what) -> None:
        """Watch ``event`` (``query()`` tells whether the call is done) for ``t``."""
        q = self.flights.get(t)
        if q is None:
            q = self._watch(t)
        q.append((event, time.monotonic(), what, threading.get_ident()))

    def _watch(self, t) -> Flights:
        """``t``'s flights, made (its group's timeout read, the thread started) under the lock:
        two threads issuing ``t``'s first calls at once (a backward runs in autograd's thread)
        must not each make flights, one of them then watched by nobody, or two threads."""
        with self.lock:
            q = self.flights.get(t)
            if q is None:
                self.limits[t] = group_timeout(t.group, t.device)
                q = self.flights[t] = Flights()
                if self.thread is None:
                    self.thread = threading.Thread(target=self._run, name="overlap-watchdog",
                                                   daemon=True)  # fmt: skip
                    self.thread.start()
            return q

    def forget(self, t) -> None:
        """Stop watching ``t`` (released: no call of it is in flight)."""
        with self.lock:
            self.flights.pop(t, None)
            self.limits.pop(t, None)

    def limit(self, t) -> float:
        """Seconds a call through ``t`` may take from its issue."""
        return settings.timeout_set() or self.limits.get(t, 600.0)

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
                    q.spare.append(q.popleft()[0])
                oldest = q[0] if q else None
            if oldest is not None and now - oldest[1] > self.limit(t):
                self._fire(t, oldest, now - oldest[1])

    def _fire(self, t, entry: tuple, waited: float) -> None:
        _, _, what, thread = entry
        limit = self.limit(t)  # (before ``forget`` drops the group's own)
        self.forget(t)
        name = what.describe() if hasattr(what, "describe") else str(what)
        why = (
            f"a call ({name}) had not finished {waited:.0f} s after it was issued (timeout "
            f"{limit:g} s): a peer rank died or stopped. Its waits on the peers were "
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


dog = Watchdog()  # the process's (its thread starts with the first watched call)
issued, forget = dog.issued, dog.forget


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
