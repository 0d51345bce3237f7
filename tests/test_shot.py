"""No devices: the latency all-reduce kernel (``overlap/gemm/shot.py``) under Triton's
interpreter, every rank's launch a thread and every program of a launch a thread of its own,
stepped in turn by the simulation's scheduler (``_sim.Kernels``), so that a program spinning
on a peer's flag waits for that peer as on GPUs.

The ranks' buffers and flags are CPU tensors whose addresses every rank's kernel gets, as
the GPUs' symmetric memory. Checked against float64 sums on fresh data: one-shot and
two-shot, sizes below one block, several blocks, more blocks than programs, calls one after
another (epochs), a skewed schedule (one rank many steps ahead: it must wait, not read a
peer's partial of the previous call), the same bits on every rank, and an abort that ends
a wait on a peer that never comes.
"""

from __future__ import annotations

import pytest
import torch
from _sim import Kernels

from overlap.gemm import shot

MAX_STEPS = 200_000


class Ranks:
    """``world`` ranks' buffers, flags, epochs and abort words, as ``comm/shot.py`` keeps
    them per rank."""

    def __init__(self, world: int, n: int, dtype: torch.dtype) -> None:
        self.world, self.n, self.dtype = world, n, dtype
        self.bufs = [torch.zeros(n, dtype=dtype) for _ in range(world)]
        self.flags = [torch.zeros(shot.MAX_PROGRAMS * world, dtype=torch.int32) for _ in
                      range(world)]  # fmt: skip
        self.epochs = [torch.zeros(shot.MAX_PROGRAMS, dtype=torch.int32) for _ in range(world)]
        self.aborts = [torch.zeros(1, dtype=torch.int32) for _ in range(world)]
        self.buffers = torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64)
        self.flag_ptrs = torch.tensor([f.data_ptr() for f in self.flags], dtype=torch.int64)

    def launch(self, r: int, parts: list[torch.Tensor], outs: list[torch.Tensor], two_shot: bool):
        """Rank ``r``'s calls one after another, as its stream would run them: its partial
        ``parts[c]`` stored into its buffer (the matmul's ``out=``), then the kernel into
        ``outs[c]``."""

        def go():
            for part, out in zip(parts, outs, strict=True):
                self.bufs[r].copy_(part)
                shot.shot_all_reduce(out, self.buffers, self.flag_ptrs, self.epochs[r],
                                     self.aborts[r], self.n, r, self.world, two_shot)  # fmt: skip

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


@pytest.mark.parametrize("two_shot", [False, True], ids=["one_shot", "two_shot"])
@pytest.mark.parametrize(
    "world,n", [(2, 1), (2, 100), (2, 3 * shot.BLOCK + 5), (3, 2 * shot.BLOCK + 1), (4, 40)]
)
def test_sum_over_ranks(monkeypatch, two_shot, world, n):
    kernels = Kernels(monkeypatch)
    try:
        calls = 3  # epochs: each call waits for this call's partials only, and no rank
        ranks = Ranks(world, n, torch.float32)  # stores the next before the peers are done
        parts = torch.randn(world, calls, n, dtype=torch.float64).float()
        ref = parts.double().sum(0)
        for ahead in range(world):  # one rank 16 steps to the others' one
            outs = torch.full((world, calls, n), float("nan"))
            names = [f"a{ahead}r{r}" for r in range(world)]
            for r, name in enumerate(names):
                kernels.start(name, ranks.launch(r, list(parts[r]), list(outs[r]), two_shot))
            _run(kernels, names, ahead=names[ahead])
            for r in range(world):
                torch.testing.assert_close(outs[r].double(), ref, atol=1e-5, rtol=1e-5)
                assert torch.equal(outs[r], outs[0]), "ranks' results differ in bits"
        done = [e[: shot.programs(n, world, two_shot)].tolist() for e in ranks.epochs]
        assert all(c == [calls * world] * len(c) for c in done), done
    finally:
        kernels.close()


def test_many_blocks_per_program(monkeypatch):
    """More blocks than programs: each program walks several."""
    monkeypatch.setattr(shot, "MAX_PROGRAMS", 2)
    kernels = Kernels(monkeypatch)
    try:
        n = 5 * shot.BLOCK + 3
        for two_shot in (False, True):
            ranks = Ranks(2, n, torch.float32)
            parts = torch.randn(2, 2, n)
            outs = torch.full((2, 2, n), float("nan"))
            names = [f"{two_shot}{r}" for r in range(2)]
            for r, name in enumerate(names):
                kernels.start(name, ranks.launch(r, list(parts[r]), list(outs[r]), two_shot))
            _run(kernels, names, ahead=names[1])
            for out in outs:
                torch.testing.assert_close(out.double(), parts.double().sum(0), atol=1e-5,
                                           rtol=1e-5)  # fmt: skip
    finally:
        kernels.close()


def test_abort_ends_the_wait_on_a_dead_peer(monkeypatch):
    """Rank 1 never launches: rank 0 spins in its barrier until its abort word is set."""
    kernels = Kernels(monkeypatch)
    try:
        ranks = Ranks(2, 10, torch.float32)
        kernels.start("r0", ranks.launch(0, [torch.ones(10)], [torch.empty(10)], False))
        kinds = [kernels.step("r0") for _ in range(50)]
        assert kinds[-1] == "poll" and "done" not in kinds, kinds
        ranks.aborts[0].fill_(1)
        _run(kernels, ["r0"])
    finally:
        kernels.close()
