"""``graphs/record.py``'s decisions on CPU, with stand-ins for CUDA graphs and the driver: which
call of a record runs eagerly, is captured, replays a graph, or updates one, as the tensors'
addresses move. The graphs themselves, and what they compute after an update, need a GPU:
tests/test_gpu.py (``test_recorded_moving_one_gpu``)."""

from __future__ import annotations

import pytest

from overlap import context
from overlap.graphs import rebind, record


class _Graph:
    """A stand-in CUDA graph: the addresses its executable graph uses (``keep``: not yet
    instantiated, as ``_captured`` leaves a graph to update from)."""

    def __init__(self, at, log, keep):
        self.at, self.log, self.instantiated = at, log, not keep

    def instantiate(self):
        self.instantiated = True

    def replay(self):
        assert self.instantiated, "a graph replayed before it was instantiated"
        self.log.append(("replay", self.at))


class _Transport:
    recorded, generation, name = True, 0, "ce"


class _Ctx:
    def __init__(self):
        self.t = _Transport()

    def transport(self, cls):
        return self.t


@pytest.fixture
def sim(monkeypatch):
    """``call(at)``: one eager call through the engine's order (``replay``, then
    ``recorded``) for tensors at ``at``; the log of what ran. ``refuse``: the driver refuses
    updates."""
    log, state = [], {"refuse": False, "at": None}
    monkeypatch.setattr(context, "records", context.records.__class__())
    monkeypatch.setattr(record, "records", context.records)

    def captured(call, ctx, t, keep):
        call(True)
        return _Graph(state["at"], log, keep)

    def update(graph, source):
        if state["refuse"]:
            raise rebind.DriverError("refused")
        assert graph.instantiated and not source.instantiated
        log.append(("update", graph.at, source.at))
        graph.at = source.at

    monkeypatch.setattr(record, "_captured", captured)
    monkeypatch.setattr(rebind, "update", update)
    ctx, key = _Ctx(), ("sig", "outputs")

    def call(at, rebound=False):
        state["at"] = at
        if record.replay(key, at) is not None:
            return "replayed"
        ran = []
        updated = record.recorded(lambda capturing: ran.append(capturing), ctx, _Transport,
                                   capturing=False, key=key, moved=(), rebound=rebound)  # fmt: skip
        return "updated" if updated else {(False,): "eager", (True,): "captured"}[tuple(ran)]

    monkeypatch.setattr(record, "bases", lambda *t: state["at"])
    return call, log, state


def test_moved_graph_replays_after_one_capture(sim):
    """A record's first sighting runs eagerly and the next captures; new addresses take a
    second graph (the first kept as the spare), and after that the spare is updated for the
    new ones: every call of a known record replays a graph, and two address sets taking
    turns (a recomputed forward) replay without captures."""
    call, log, _ = sim
    assert [call("A"), call("A"), call("A")] == ["eager", "captured", "replayed"]
    assert call("B") == "captured"  # a second graph; A's is the spare
    assert [call("A"), call("B"), call("A")] == ["replayed"] * 3  # the two take turns
    log.clear()
    assert call("C") == "updated"  # the graph of the last but one (B's) now for C
    assert log == [("update", "B", "C"), ("replay", "C")]
    assert [call("A"), call("C"), call("C")] == ["replayed"] * 3
    assert log[-3:] == [("replay", "A"), ("replay", "C"), ("replay", "C")]


def test_refused_update_takes_the_new_capture(sim):
    """Where the driver refuses an update, the capture made for it is instantiated and
    replayed instead (a record is never left pointing at the old addresses)."""
    call, log, state = sim
    for at in "AABC":
        call(at)
    state["refuse"] = True
    log.clear()
    assert call("D") == "captured"
    assert log == [("replay", "D")]
    assert call("C") == "replayed" and log[-1] == ("replay", "C")
