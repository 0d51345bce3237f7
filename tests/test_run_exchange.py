"""No devices: the engine's lifecycle of an uneven exchange (``ops.engine.run_exchange``), on
stand-in streams, contexts and guards that log what they are asked, in order: validation's
agreement before the count (a refused call counted nothing), the communication stream forked
from the caller before the op's ``issue``, the caller's wait for it after ``issue`` (also
when ``issue`` raised: the chunks issued before still use its buffers), validation's watch
around both and told of the error, or else the watchdog; the plain path counted, then run.
The exchanges' own producers and consumers run on simulated streams in
``test_sim_nccl.py``, on gloo ranks in ``test_uneven.py`` and ``test_embedding.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from overlap.ops import engine


class _Stream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")


def _install(monkeypatch, validating: bool) -> tuple[list, SimpleNamespace]:
    log: list = []
    caller, comm = _Stream("caller", log), _Stream("comm", log)
    transport = SimpleNamespace(watched=True, events=lambda n: [None] * n, fail=None)
    ctx = SimpleNamespace(comm_stream=comm, caller=caller, transport=lambda cls: transport)

    class Watch:
        def __init__(self, stream, fail, what) -> None:
            assert stream is comm
            log.append("watch")

        def __enter__(self) -> Watch:
            return self

        def __exit__(self, kind, error, tb) -> None:
            log.append(f"watch closed: {type(error).__name__}")

    monkeypatch.setattr(engine, "context", lambda group, device: ctx)
    monkeypatch.setattr(engine, "capturing", lambda x: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: caller)
    monkeypatch.setattr(engine.stats, "count", lambda label, how: log.append(f"count {how}"))
    guard = engine.guard
    monkeypatch.setattr(guard, "validating", lambda: validating)
    monkeypatch.setattr(guard, "agree", lambda group, fp, what, splits=None: log.append(
        f"agree {splits}"))  # fmt: skip
    monkeypatch.setattr(guard, "Watch", Watch)
    monkeypatch.setattr(guard.watchdog, "issued", lambda t, s, p: log.append(f"watchdog {s.name}"))
    x = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32, is_cuda=True)
    return log, x


def _run(x, splits, log, fail: bool = False):
    call = engine.Call("all_to_all", None, "sum", "auto", 2)
    p, cls = engine.decide_exchange((splits, splits), 4, 3, call)

    def issue(streams: engine.Streams) -> str:
        assert streams.caller.name == "caller" and streams.comm.name == "comm"
        log.append("issue")
        if fail:
            raise RuntimeError("a collective failed")
        return "issued"

    return engine.run_exchange(x, call, p, cls, "op", {"width": 4}, lambda: "plain", issue)


def _expected(validating: bool, last: str) -> list[str]:
    how = "count overlap via torch"
    issued = ["comm waits for caller", "issue", "caller waits for comm"]
    if validating:
        return ["agree ((2, 2), (2, 2))", how, issued[0], "watch", *issued[1:], last]
    return [how, *issued, "watchdog caller"]


@pytest.mark.parametrize("validating", [False, True])
def test_run_exchange_lifecycle(validating, monkeypatch):
    log, x = _install(monkeypatch, validating)
    assert _run(x, (2, 2), log) == "issued"
    assert log == _expected(validating, "watch closed: NoneType")


@pytest.mark.parametrize("validating", [False, True])
def test_run_exchange_joins_when_issue_raises(validating, monkeypatch):
    log, x = _install(monkeypatch, validating)
    with pytest.raises(RuntimeError, match="a collective failed"):
        _run(x, (2, 2), log, fail=True)
    assert log == _expected(validating, "watch closed: RuntimeError")


def test_run_exchange_plain_path(monkeypatch):
    """World size 1: counted as the plain path, ``plain()`` run, no context or streams."""
    log, x = _install(monkeypatch, True)
    assert _run(x, (4,), log) == "plain"
    assert log == ["count plain: world size 1: nothing to communicate"]
