"""No devices: the latency all-reduce's choice by size and its release of a dead peer's
barriers (``overlap/comm/shot.py``).

torch's symmetric-memory kernels synchronize blocks of the same index across ranks through
signal pads: block ``b`` of rank ``r`` sets its flag in each peer ``q``'s pad (``b * R + r``)
from 0 to 1, then waits for ``q``'s flag in its own pad (``b * R + q``) to be 1 and sets it
back to 0, both by compare-and-swap loops without a timeout; a one-shot call has two such
barriers per block. Here that protocol runs in Python on every live rank, a peer dies before
or between the barriers with several calls queued behind, and the survivors'
``release_writes`` (what ``ShotTransport.abort`` writes by stream writes, round after round
until the calls queued have ended) must let them finish.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from overlap.comm import shot

BASE = 1 << 20  # fake pad addresses: rank r's pad at BASE * (r + 1)


class Pads:
    def __init__(self, R: int, words: int) -> None:
        self.R, self.words = R, words
        self.mem = [[0] * words for _ in range(R)]
        self.addrs = [BASE * (r + 1) for r in range(R)]

    def cas(self, r: int, i: int, old: int, new: int) -> bool:
        if self.mem[r][i] == old:
            self.mem[r][i] = new
            return True
        return False

    def write(self, addr: int, value: int) -> None:
        r, off = divmod(addr, BASE)
        self.mem[r - 1][off // 4] = value


def _rank(pads: Pads, r: int, blocks: int, barriers: int, dies_after: int | None):
    """One rank's kernel as a generator: yields False after each failed CAS (a spin), True
    after each that succeeded."""
    R, done = pads.R, 0
    for _ in range(barriers):
        if dies_after is not None and done == dies_after:
            return  # dead: stops here for good
        for b in range(blocks):
            for q in range(R):  # (threads q of the block, in turn)
                while not pads.cas(q, b * R + r, 0, 1):
                    yield False
                yield True
                while not pads.cas(r, b * R + q, 1, 0):
                    yield False
                yield True
        done += 1


@pytest.mark.parametrize("R", [2, 3, 4])
@pytest.mark.parametrize("dies_after", [0, 1])  # before its first barrier, or between the two
@pytest.mark.parametrize("calls", [1, 16])  # calls in flight (two barriers each)
def test_release_lets_the_survivors_finish(R, dies_after, calls):
    blocks, barriers, dead = 3, 2 * calls, R - 1
    pads = Pads(R, 64)
    for call in range(2):  # a whole call first: the pads as a finished call leaves them
        live = {r: _rank(pads, r, blocks, barriers, dies_after if call and r == dead else None)
                for r in range(R)}  # fmt: skip
        releases = 0
        while live:
            finished, moved = [], False
            for r, gen in live.items():
                for _ in range(100):
                    try:
                        moved |= next(gen)
                    except StopIteration:
                        finished.append(r)
                        break
            for r in finished:
                del live[r]
            if live and not (finished or moved):  # all spin: the survivors' watchdogs fire
                assert call == 1, "a call with every rank alive did not finish"
                assert releases < 4 * barriers, f"still held after {releases} rounds"
                for r in live:
                    for addr, value in shot.release_writes(pads.addrs, pads.words, r):
                        pads.write(addr, value)
                releases += 1
        assert call == 0 or releases > 0


def test_without_release_the_survivor_waits_forever():
    pads = Pads(2, 64)
    alive = _rank(pads, 0, 2, 2, None)
    list(_rank(pads, 1, 2, 2, 0))  # rank 1 dies at once
    for _ in range(10_000):
        next(alive)  # never StopIteration: it spins
    assert not any(next(alive) for _ in range(100))


def test_release_writes_touch_only_this_ranks_flags():
    pads = [1000, 2000, 3000]
    writes = shot.release_writes(pads, 12, 1)
    own = {(a - 2000) // 4 for a, v in writes if 2000 <= a < 3000}
    assert own == {b * 3 + q for b in range(4) for q in (0, 2)}
    assert all(v == 1 for a, v in writes if 2000 <= a < 3000)
    theirs = {(a // 1000, (a % 1000) // 4) for a, v in writes if not 2000 <= a < 3000}
    assert theirs == {(p, b * 3 + 1) for b in range(4) for p in (1, 3)}
    assert all(v == 0 for a, v in writes if not 2000 <= a < 3000)


def test_kind_by_size():
    bf16 = torch.bfloat16
    assert shot.kind(16, bf16, "peer", 2) == "one-shot"
    assert shot.kind(shot.ONE_SHOT_BYTES, bf16, "peer", 2) == "one-shot"
    assert shot.kind(shot.ONE_SHOT_BYTES + 16, torch.float32, "peer", 2) == "two-shot"
    assert shot.kind(shot.SHOT_BYTES, bf16, "peer", 2) == "two-shot"
    assert shot.kind(shot.SHOT_BYTES + 16, bf16, "peer", 2) is None
    assert shot.kind(8 * 3 * 1234 * 2 // 8 + 2, bf16, "peer", 2) is None  # not 16-byte vectors
    assert shot.kind(16, torch.float16, "peer", 2) is None  # (torch's kernels refuse it)
    assert shot.kind(16, bf16, None, 2) is None  # (several hosts, no CUDA)
    # without P2P: the library's kernel, any float type and size up to its slots
    assert shot.kind(shot.HOST_SHOT_MIN_BYTES + 2, torch.float16, "host", 2) == "host one-shot"
    assert shot.kind(shot.HOST_SHOT_BYTES, bf16, "host", 2) == "host one-shot"
    assert shot.kind(shot.HOST_SHOT_BYTES + 2, bf16, "host", 2) is None
    assert shot.kind(shot.HOST_SHOT_MIN_BYTES, bf16, "host", 2) is None  # (NCCL's below)
    assert shot.kind(1 << 17, torch.float64, "host", 2) is None
    assert shot.kind(1 << 17, bf16, "host", shot.HOST_SHOT_RANKS + 1) is None  # (not measured)
    assert shot.transport("host one-shot") is shot.HostShotTransport
    assert shot.transport("two-shot") is shot.ShotTransport


def _ready_cases(rank: int, R: int, seed: int) -> list[str]:
    """``comm.ready`` on gloo ranks, with stand-in ``sized`` classes."""
    import torch.distributed as dist

    from overlap import comm
    from overlap.comm.transport import Transport
    from overlap.state import state

    made, closed = [], []

    class Fine(Transport):
        name, sized = "fine", True

        def __init__(self, group, device):
            made.append(type(self).__name__)

        def close(self):
            closed.append(type(self).__name__)

    class FailsOnRankOne(Fine):
        name = "fails"

        def __init__(self, group, device):
            super().__init__(group, device)
            if dist.get_rank(group) == 1:
                raise RuntimeError("no symmetric memory here")

    dev = torch.device("cpu")
    failures = []
    if comm.ready(Fine, None, dev, capturing=True):
        failures.append("made while capturing")
    if not comm.ready(Fine, None, dev, capturing=False) or comm.shared(Fine, None, dev) is None:
        failures.append("a class every rank makes is not ready")
    if not comm.ready(Fine, None, dev, capturing=True):
        failures.append("made once, a capture may use it")
    for _ in range(2):  # the second asks nobody: given up once
        if comm.ready(FailsOnRankOne, None, dev, capturing=False):
            failures.append("ready although rank 1 could not make it")
    why = state(None, dev).failed.get(FailsOnRankOne, "")
    if "no symmetric memory here" not in why:
        failures.append(f"every rank records rank 1's error: {why!r}")
    if made != ["Fine", "FailsOnRankOne"]:
        failures.append(f"made {made} (once each, never again after a failure)")
    if rank == 0 and closed != ["FailsOnRankOne"]:
        failures.append(f"rank 0 closed {closed}: its own making of what rank 1 failed")
    return failures


def test_a_transport_one_rank_cannot_make_is_given_up_by_all():
    """The latency all-reduce's buffers are made by every rank at the first call that takes
    it (``comm.ready``); where that raises on one rank (torch's symmetric memory or the host
    mapping unavailable), every rank gives the class up for the group and its calls take
    NCCL, instead of one rank raising while its peers wait for it."""
    import random

    from _dist import spawn

    spawn(_ready_cases, 2, random.randrange(1 << 30))


def _map_cases(rank: int, R: int, seed: int) -> list[str]:
    """``comm.host.map_shared`` on gloo ranks with a stand-in driver whose registration of
    host memory fails on rank 1 in the second mapping."""
    import types

    import torch.distributed as dist

    from overlap.comm import host
    from overlap.signal import wait

    calls = {"register": 0, "unregister": 0}

    def register(addr, size, flags):
        calls["register"] += 1
        return (9 if rank == 1 and calls["register"] == 2 else 0,)

    def unregister(addr):
        calls["unregister"] += 1
        return (0,)

    drv = types.SimpleNamespace(
        CUresult=types.SimpleNamespace(CUDA_SUCCESS=0), cuMemHostRegister=register,
        cuMemHostUnregister=unregister, cuMemHostGetDevicePointer=lambda addr, f: (0, addr),
    )  # fmt: skip
    host._driver = wait._driver = lambda: drv
    failures = []
    mapping, address = host.map_shared(None, rank, 8192, 8192)
    view = (ctypes.c_int32 * 2048).from_address(mapping[2])  # (the device's address: the host's)
    if rank == 0:
        view[5] = 1234 + seed % 1000
    dist.barrier()
    if view[5] != 1234 + seed % 1000:
        failures.append("the ranks do not share the buffer")
    del view
    host.unmap(mapping)
    try:
        host.map_shared(None, rank, 8192, 8192)
        failures.append("no error although rank 1 could not register the buffer")
    except RuntimeError as e:
        if "rank 1" not in str(e) or "cuMemHostRegister" not in str(e):
            failures.append(f"the error does not name rank 1's failure: {e}")
    want = 2 if rank == 0 else 1  # (rank 0 unregisters what it had registered)
    if calls["unregister"] != want:
        failures.append(f"{calls['unregister']} unregistered, expected {want}")
    return failures


def test_a_host_buffer_one_rank_cannot_map_raises_on_every_rank():
    """The pinned host buffers (the copy engines' host road, the host latency all-reduce) are
    mapped by every rank with one agreement after the local steps: where one rank cannot
    register its mapping, every rank raises naming it (and frees its own) instead of waiting
    in a collective that rank left."""
    import random

    from _dist import spawn

    spawn(_map_cases, 2, random.randrange(1 << 30))
