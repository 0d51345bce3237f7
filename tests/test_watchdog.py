"""The watchdog (``guard.Watchdog``): with validation off, a call through a watched transport
(the copy engines, CuPy's NCCL) that a dead or stopped peer keeps from finishing fails its
transport, releases the waits and raises in the thread that issued it; calls that finish are
left alone. The stand-ins here are CPU objects: the GPU scenarios (a peer killed mid-call or
mid-gather, a peer that never arrives, both copy-engine roads) are in test_gpu.py."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from overlap import guard
from overlap.comm import Transport
from overlap.context import Context


class _Call:
    """A call in flight: done once ``done`` is set (a stand-in CUDA event)."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()


class _Stuck(Transport):
    """A watched transport whose ``abort`` ends the stuck call (sets every flag)."""

    name, watched = "ce", True

    def __init__(self, call: _Call) -> None:
        self.group, self.device, self.call, self.aborts = None, torch.device("cpu"), call, []

    def abort(self) -> None:
        self.aborts.append(threading.current_thread().name)
        self.call.done.set()


class _Plan:
    def describe(self) -> str:
        return "matmul_allreduce 1024x512x256 via ce"


@pytest.fixture
def timeout():
    """``configure(timeout=0.3)`` for the test, the setting as it was afterwards."""
    keep = guard.settings._settings["timeout"]
    guard.settings._settings["timeout"] = 0.3
    yield 0.3
    guard.settings._settings["timeout"] = keep


def test_a_stuck_call_fails_its_transport_and_raises_in_its_thread(timeout):
    """The issue's trial: a call issued, then the issuing thread waits for the GPU (here a
    wait that only the abort ends, as ``torch.cuda.synchronize`` on a stream stuck on a dead
    peer). The watchdog's thread fails the transport within the timeout, which releases the
    wait, and the issuing thread raises ``TimeoutError`` naming the call; the group's later
    calls raise at once."""
    dog, call = guard.Watchdog(), _Call()
    t = _Stuck(call)
    got: list = []

    def issuer() -> None:
        try:
            dog.track(t, call, _Plan())
            released = call.done.wait(20)  # the "synchronize"
            for _ in range(200):  # the exception comes at the next Python instruction
                time.sleep(0.01)
            got.append(f"no exception (released: {released})")
        except TimeoutError as e:
            got.append(e)

    t0 = time.monotonic()
    worker = threading.Thread(target=issuer)
    worker.start()
    worker.join(30)
    took = time.monotonic() - t0
    assert len(got) == 1 and isinstance(got[0], guard.PeerTimeoutError), got
    assert "matmul_allreduce 1024x512x256 via ce" in str(got[0])
    assert "died or stopped" in str(got[0]) and "overlap.release" in str(got[0])
    assert took < 5, took
    assert t.aborts == ["overlap-watchdog"]
    assert t.broken == str(got[0])
    ctx = object.__new__(Context)
    ctx._transports = {_Stuck: t}
    with pytest.raises(RuntimeError, match="aborted: a call .matmul_allreduce"):
        ctx.transport(_Stuck)
    assert t not in dog.flights  # forgotten: fired once


def test_finished_calls_are_left_alone(timeout):
    """Calls that finish (even long after the timeout has passed since an earlier call) are
    recycled and fail nothing; a call in flight younger than the timeout fails nothing; the
    oldest call counts."""
    dog, older, newer = guard.Watchdog(), _Call(), _Call()
    dog.thread = threading.current_thread()  # (no thread started: the test checks)
    t = _Stuck(_Call())
    dog.track(t, older, _Plan())
    older.done.set()
    dog.check(time.monotonic() + 10)  # finished: recycled, whatever its age
    assert dog.flights[t].spare == [older] and not t.aborts
    dog.track(t, newer, _Plan())
    dog.check(time.monotonic())  # in flight, but young
    assert not t.aborts and not t.broken
    checker = threading.Thread(target=dog.check, args=(time.monotonic() + 1,),
                               name="overlap-watchdog")  # fmt: skip
    with pytest.raises(TimeoutError):  # no thread of its own issued it: the main one gets it
        checker.start()
        checker.join()
        for _ in range(100):
            time.sleep(0.01)
    assert t.aborts == ["overlap-watchdog"] and t.broken


def test_an_issued_call_takes_a_spare_event_and_queries_none(monkeypatch):
    """``issued`` records the call on an event of a finished call that the watchdog's thread
    recycled, else on a new one, and never queries an event itself (in the issuing thread a
    query fails while another thread captures a CUDA graph, and invalidates that capture)."""
    made: list = []

    class _Recorded(_Call):
        def record(self, stream) -> None:
            self.done.clear()  # (in flight again, on ``stream``)

        def query(self) -> bool:
            if threading.current_thread().name != "overlap-watchdog":
                raise AssertionError("an event queried outside the watchdog's thread")
            return super().query()

    monkeypatch.setattr(torch.cuda, "Event", lambda: made.append(_Recorded()) or made[-1])
    dog, first = guard.Watchdog(), _Recorded()
    dog.thread = threading.current_thread()  # (no thread started)
    t = _Stuck(_Call())
    dog.track(t, first, _Plan())
    first.done.set()
    dog.issued(t, None, _Plan())  # nothing recycled yet: a new event, no query
    assert len(made) == 1 and [e for e, *_ in dog.flights[t]] == [first, made[0]]
    checker = threading.Thread(target=dog.check, args=(time.monotonic(),),
                               name="overlap-watchdog")  # fmt: skip
    checker.start()
    checker.join()  # recycles the finished first call's event
    assert dog.flights[t].spare == [first]
    dog.issued(t, None, _Plan())
    assert len(made) == 1 and [e for e, *_ in dog.flights[t]] == [made[0], first]
    assert not dog.flights[t].spare and not first.done.is_set()


def test_a_transports_spare_events_are_its_own(monkeypatch):
    """A finished call's event is recorded again only for calls of the same transport: a CUDA
    event belongs to the device it was first recorded on, and two transports of one process
    may be on two devices."""
    made: list = []

    class _Recorded(_Call):
        def record(self, stream) -> None:
            self.done.clear()
            self.stream = stream

    monkeypatch.setattr(torch.cuda, "Event", lambda: made.append(_Recorded()) or made[-1])
    dog = guard.Watchdog()
    dog.thread = threading.current_thread()  # (no thread started)
    a, b = _Stuck(_Call()), _Stuck(_Call())
    dog.issued(a, "stream of device 0", _Plan())
    made[0].done.set()
    dog.check(time.monotonic())  # a's event recycled
    dog.issued(b, "stream of device 1", _Plan())
    assert len(made) == 2 and made[0].stream == "stream of device 0", "b took a's event"
    dog.issued(a, "stream of device 0", _Plan())
    assert len(made) == 2, "a's own spare event was not reused"


def test_two_threads_issuing_a_transports_first_calls_are_both_watched(monkeypatch):
    """Two threads issuing a transport's first calls at once (a backward runs in autograd's
    thread) each get their call watched, by one watchdog thread: the flights are made once."""
    from overlap.guard import watchdog

    class _Recorded(_Call):
        def record(self, stream) -> None:
            pass

    def slow_timeout(group, device):  # (the window between looking and making, widened)
        time.sleep(0.05)
        return 600.0

    monkeypatch.setattr(torch.cuda, "Event", _Recorded)
    monkeypatch.setattr(watchdog, "group_timeout", slow_timeout)
    dog, t, started = guard.Watchdog(), _Stuck(_Call()), []
    dog._run = lambda: started.append(threading.current_thread())  # (starts, then ends)
    both = threading.Barrier(2)

    def issue():
        both.wait()
        dog.issued(t, None, _Plan())

    issuers = [threading.Thread(target=issue) for _ in range(2)]
    for th in issuers:
        th.start()
    for th in issuers:
        th.join()
    time.sleep(0.05)
    assert len(dog.flights[t]) == 2, "a call watched by nobody"
    assert len(started) == 1, f"{len(started)} watchdog threads"


def test_the_timeout_is_the_process_groups_unless_configured(monkeypatch):
    """Unset, a call may take its process group's own timeout (as torch's watchdog gives its
    collectives); ``configure(timeout=)`` replaces it."""
    import os

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # (set for this test only: later tests'
    monkeypatch.setenv("MASTER_PORT", str(29400 + os.getpid() % 500))  # ranks fork, _dist.py)
    keep = guard.settings._settings["timeout"]
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=42))
    try:
        guard.settings._settings["timeout"] = None
        sub = dist.new_group([0], timeout=timedelta(seconds=7))
        dog, cpu = guard.Watchdog(), torch.device("cpu")
        dog.thread = threading.current_thread()  # (no thread: its call never finishes)
        assert guard.group_timeout(None, cpu) == 42
        assert guard.group_timeout(sub, cpu) == 7
        t = _Stuck(_Call())
        t.group = sub
        dog.track(t, _Call(), _Plan())
        assert dog.limit(t) == 7
        guard.configure(timeout=2)
        assert dog.limit(t) == 2
    finally:
        guard.settings._settings["timeout"] = keep
        dist.destroy_process_group()
