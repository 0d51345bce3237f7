"""No devices: the latency all-reduce through host memory (``overlap/gemm/shot.py``) under
Triton's interpreter, every rank's launch a thread and every program of a launch a thread of
its own, stepped in turn by the simulation's scheduler (``_sim.Kernels``), so that a program
spinning on a peer's flag waits for that peer as on GPUs.

The shared host buffer is one CPU tensor whose rank regions every rank's kernel addresses, as
the pinned mapping on GPUs. Checked against float64 sums on fresh data: sizes below one
block, several blocks, more blocks than programs, calls of different sizes one after
another (the slots' parity), a skewed schedule (one rank many steps ahead: it must wait, and
must not overwrite a slot a peer still reads), the same bits on every rank, and an abort
that ends a wait on a peer that never comes.
"""

from __future__ import annotations

import pytest
import torch
from _sim import Kernels as _Kernels
from triton.runtime import interpreter

from overlap.contract import SHOT_STATE, shot_region_bytes
from overlap.gemm import shot

MAX_STEPS = 200_000


def Kernels(monkeypatch) -> _Kernels:
    """The simulation's scheduler, which also hands the turn over right after a flag is set
    (a release): a peer may then see the flag before this program's next store, as on GPUs
    (a flag set before the stores it publishes would be seen early); and the odd programs of
    a launch lag behind the even ones (8 turns before each store), as programs of one launch
    do on GPUs (a program that went on before the others stored their share would be seen)."""
    kernels = _Kernels(monkeypatch)
    builder = interpreter.interpreter_builder
    rmw, store = builder.create_atomic_rmw, builder.create_masked_store

    def create_atomic_rmw(op, ptr, val, mask, sem, scope):
        out = rmw(op, ptr, val, mask, sem, scope)
        if val.data.any():  # (not a poll: a flag set)
            kernels._yield("tile")
        return out

    def create_masked_store(ptrs, value, mask, *rest):
        if getattr(kernels.local, "program", (0,))[0] % 2:
            for _ in range(8):
                kernels._yield("tile")
        return store(ptrs, value, mask, *rest)

    monkeypatch.setattr(builder, "create_atomic_rmw", create_atomic_rmw)
    monkeypatch.setattr(builder, "create_masked_store", create_masked_store)
    return kernels


class Ranks:
    """``world`` ranks' regions in one host buffer, and each rank's state (its counts)."""

    def __init__(self, world: int, slot_bytes: int, pad: int = 0) -> None:
        self.world, self.slot_bytes, self.pad = world, slot_bytes, pad
        region = shot_region_bytes(slot_bytes)
        self.host = torch.zeros(pad + world * region, dtype=torch.uint8)  # (pad: no rank's)
        self.regions = torch.tensor(
            [self.host.data_ptr() + pad + r * region for r in range(world)], dtype=torch.int64
        )
        self.states = [torch.zeros(SHOT_STATE, dtype=torch.int32) for _ in range(world)]
        self.region = region

    def abort(self, r: int) -> None:
        """Rank ``r``'s abort word set (``HostShotTransport.abort``: a host store)."""
        at = self.pad + r * self.region + shot.ABORT
        self.host[at : at + 4].view(torch.int32).fill_(1)

    def count_from(self, calls: int) -> None:
        """Every rank as if it had made ``calls`` calls (its count and its flag)."""
        for r in range(self.world):
            self.states[r][0] = calls
            at = self.pad + r * self.region
            self.host[at : at + 4].view(torch.int32).fill_(calls)

    def launch(self, r: int, parts: list[torch.Tensor], outs: list[torch.Tensor]):
        """Rank ``r``'s calls one after another, as its stream would run them."""

        def go():
            for part, out in zip(parts, outs, strict=True):
                shot.host_shot_all_reduce(part, out, self.regions, self.states[r],
                                          self.slot_bytes, r)  # fmt: skip

        return go


def _run(kernels: Kernels, names: list[str], ahead: str | None = None) -> None:
    """Step the kernels ``names`` until all are done (``ahead``: that one takes 16 steps to
    the others' one); a schedule that never ends fails as a deadlock."""
    live = list(names)
    for _ in range(MAX_STEPS):
        if not live:
            return
        for name in list(live):
            for _ in range(16 if name == ahead else 1):
                if kernels.step(name) == "done":
                    live.remove(name)
                    break
    raise AssertionError(f"deadlock: {live} never finished")


@pytest.mark.parametrize(
    "world,sizes,dtype",
    [
        (2, [1, 100, 7], torch.float32),
        (2, [3 * shot.BLOCK + 6, 40, 2 * shot.BLOCK], torch.float32),  # big, then small ones
        (3, [2 * shot.BLOCK + 1, 5, 2 * shot.BLOCK + 1], torch.float32),
        (4, [40, 40, 40], torch.float32),
        (2, [2 * shot.BLOCK + 2, 2, 7], torch.bfloat16),
        (3, [shot.BLOCK + 2, 6], torch.float16),
    ],
)
def test_sum_over_ranks(monkeypatch, world, sizes, dtype):
    monkeypatch.setattr(shot, "PROGRAMS", 3)  # (every program a thread: the real count is slow)
    kernels = Kernels(monkeypatch)
    try:
        ranks = Ranks(world, max(sizes) * 4)
        calls = len(sizes)
        for ahead in range(world):  # one rank 16 steps to the others' one
            parts = [[torch.randn(n, dtype=torch.float64).to(dtype) for n in sizes]
                     for _ in range(world)]  # fmt: skip
            outs = [[torch.full((n,), float("nan"), dtype=dtype) for n in sizes]
                    for _ in range(world)]  # fmt: skip
            names = [f"a{ahead}r{r}" for r in range(world)]
            for r, name in enumerate(names):
                kernels.start(name, ranks.launch(r, parts[r], outs[r]))
            _run(kernels, names, ahead=names[ahead])
            for c in range(calls):
                ref = sum(parts[r][c].double() for r in range(world))  # (fp32 sums, rounded)
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                for r in range(world):
                    torch.testing.assert_close(outs[r][c].double(), ref, atol=tol, rtol=tol)
                    assert torch.equal(outs[r][c], outs[0][c]), "ranks' results differ in bits"
        done = [st.tolist() for st in ranks.states]  # calls done, the call's counts reset
        assert all(d == [calls * world, 0, d[2], 0] for d in done), done
    finally:
        kernels.close()


def test_many_blocks_per_program(monkeypatch):
    """More blocks than programs: each program walks several."""
    monkeypatch.setattr(shot, "PROGRAMS", 2)
    kernels = Kernels(monkeypatch)
    try:
        n = 5 * shot.BLOCK + 3
        ranks = Ranks(2, n * 4)
        parts = [[torch.randn(n) for _ in range(2)] for _ in range(2)]
        outs = [[torch.full((n,), float("nan")) for _ in range(2)] for _ in range(2)]
        for r in range(2):
            kernels.start(f"r{r}", ranks.launch(r, parts[r], outs[r]))
        _run(kernels, ["r0", "r1"], ahead="r1")
        for c in range(2):
            ref = parts[0][c].double() + parts[1][c].double()
            for r in range(2):
                torch.testing.assert_close(outs[r][c].double(), ref, atol=1e-5, rtol=1e-5)
    finally:
        kernels.close()


def test_abort_ends_the_wait_on_a_dead_peer(monkeypatch):
    """Rank 1 never launches: rank 0 (all ``PROGRAMS`` of it) spins until its abort word is
    set."""
    kernels = Kernels(monkeypatch)
    try:
        ranks = Ranks(2, 128)
        kernels.start("r0", ranks.launch(0, [torch.ones(10)], [torch.empty(10)]))
        kinds = [kernels.step("r0") for _ in range(50)]
        assert kinds[-1] == "poll" and "done" not in kinds, kinds
        ranks.abort(0)
        _run(kernels, ["r0"])
    finally:
        kernels.close()


def test_counts_wrap(monkeypatch):
    """Calls across the int32 counts' wrap (2**31): compared by their difference, the slot by
    the count's lowest bit (a signed remainder made it -1 and stored below the region)."""
    monkeypatch.setattr(shot, "PROGRAMS", 2)
    kernels = Kernels(monkeypatch)
    try:
        sizes = [100, 3000, 100, 100, 7]
        ranks = Ranks(2, max(sizes) * 4, pad=1 << 15)
        ranks.count_from(2**31 - 3)
        parts = [[torch.randn(n) for n in sizes] for _ in range(2)]
        outs = [[torch.full((n,), float("nan")) for n in sizes] for _ in range(2)]
        for r in range(2):
            kernels.start(f"r{r}", ranks.launch(r, parts[r], outs[r]))
        _run(kernels, ["r0", "r1"], ahead="r1")
        for c in range(len(sizes)):
            ref = parts[0][c].double() + parts[1][c].double()
            for r in range(2):
                torch.testing.assert_close(outs[r][c].double(), ref, atol=1e-5, rtol=1e-5)
        assert not ranks.host[: ranks.pad].any(), "stored outside the ranks' regions"
        assert all(int(st[0]) == 2**31 + 2 - 2**32 for st in ranks.states)  # (wrapped)
    finally:
        kernels.close()


def test_an_aborted_rank_stores_and_publishes_nothing_more(monkeypatch):
    """Rank 0 waits for a late (not dead) rank 1 until its abort; its calls queued behind that
    one store and publish nothing, so rank 1, resuming, sums rank 0's real partial in its
    first call and waits in its second until its own abort (its watch raises), instead of
    summing slots rank 0's later calls overwrote and never raising."""
    monkeypatch.setattr(shot, "PROGRAMS", 2)
    kernels = Kernels(monkeypatch)
    try:
        ranks = Ranks(2, 400)
        parts = [[torch.randn(100) for _ in range(3)] for _ in range(2)]
        outs = [[torch.full((100,), float("nan")) for _ in range(3)] for _ in range(2)]
        kernels.start("r0", ranks.launch(0, parts[0], outs[0]))
        kinds = [kernels.step("r0") for _ in range(50)]
        assert kinds[-1] == "poll", kinds
        ranks.abort(0)
        _run(kernels, ["r0"])
        kernels.start("r1", ranks.launch(1, parts[1], outs[1]))
        kinds = []
        while len(kinds) < 200 and "done" not in kinds:
            kinds.append(kernels.step("r1"))
        assert "done" not in kinds and kinds[-1] == "poll", "rank 1 did not wait for rank 0"
        torch.testing.assert_close(outs[1][0], parts[0][0] + parts[1][0], atol=1e-5, rtol=1e-5)
        ranks.abort(1)
        _run(kernels, ["r1"])
    finally:
        kernels.close()
