"""The collectives the library overlaps with a matmul, in one table.

Code asks a ``Collective`` for what it needs (does it reduce? which rows does a rank get?)
instead of comparing names. Pure Python at import time, so ``overlap.plan`` can use it;
the torch equivalents import ``torch.distributed`` at their first call (``_torch``: once, an
import statement per call costs the plain path ~0.3 us).

==============  ==========  ============  ==========================  ========================
name            direction   result rows   plain torch                 input gradient
==============  ==========  ============  ==========================  ========================
all_reduce      after       ``M``         ``all_reduce(y)``           ``g @ w^T`` (no comm)
reduce_scatter  after       ``M / R``     ``reduce_scatter_tensor``   all-gather + matmul
all_to_all      after       ``M``         ``all_to_all_single``       inverse all-to-all, then
                                                                      ``@ w^T`` (plain)
all_gather      before      ``R M``       ``all_gather_into_tensor``  matmul + reduce-scatter
                                          of ``x``, then ``@ w``
==============  ==========  ============  ==========================  ========================

``direction`` says where the collective runs relative to the matmul: ``AFTER`` moves the
kernel's product (the producer signals finished chunks); ``BEFORE`` moves its input (the
rows of a chunk are multiplied once they have arrived). For a ``BEFORE`` collective ``M`` is
the gathered rows, ``R`` times the shard's. ``dual``: the collective whose overlapped matmul
computes the input gradient ``g @ w^T`` (tensor parallelism's mirror pairs), or None.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

AFTER, BEFORE = "after", "before"
OPS = ("sum", "avg")


@dataclass(frozen=True)
class Collective:
    """What the library needs to know of one collective.

    ``reduces``: the ranks' products are summed (``op="avg"`` allowed). ``splits_rows``:
    row block ``j`` (``M / R`` rows) of every rank's product belongs to rank ``j``, so
    ``M`` must be divisible by ``R`` and a chunk's rows form one run per rank (for the
    all-gather: rank ``j``'s shard is row block ``j`` of the gathered input).
    """

    name: str
    direction: str
    reduces: bool
    splits_rows: bool
    dual: str | None = None

    # (cached: the plain path reads them at every call)
    @functools.cached_property
    def before(self) -> bool:
        """The collective moves the matmul's input (all-gather), not its product."""
        return self.direction == BEFORE

    @functools.cached_property
    def replicated(self) -> bool:
        """Every rank gets the whole reduced product (all-reduce)."""
        return self.reduces and not self.splits_rows

    @functools.cached_property
    def scatters(self) -> bool:
        """Each rank gets only its own block of the reduced rows (reduce-scatter)."""
        return self.reduces and self.splits_rows

    def result_shape(self, x_shape: tuple[int, ...], N: int, R: int) -> tuple[int, ...]:
        """The result's shape for ``x [..., K]`` and ``N`` columns: ``[M / R, N]`` when it
        scatters, ``[R M, N]`` when it gathers the input ``x`` (leading dims flattened),
        else ``[..., N]``."""
        if self.scatters:
            return (math.prod(x_shape[:-1]) // R, N)
        if self.before:
            return (math.prod(x_shape[:-1]) * R, N)
        return (*x_shape[:-1], N)

    def plain(self, y: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        """The torch collective of a product ``y [M, N]`` into ``out`` (the result;
        the all-reduce runs in place, so ``out`` is ``y`` there); for the all-gather, of the
        input shard ``y [M / R, K]`` into ``out [M, K]``."""
        dist = _dist or _torch()
        if self.before:
            all_gather(out, y, group)
        elif self.replicated:
            dist.all_reduce(y, group=group)
        elif self.reduces:
            reduce_scatter(out, y, group)
        else:
            dist.all_to_all_single(out, y, group=group)

    def backward(
        self, g: torch.Tensor, group: dist.ProcessGroup | None, splits: tuple | None = None
    ) -> torch.Tensor:
        """Gradient of this rank's product ``[M, N]`` from the gradient ``g`` of its result
        (contiguous, 2-D), with tensor parallelism's conventions, where no ``dual`` op
        computes the input gradient: the replicated all-reduce result (and the all-gather's
        product) has a replicated gradient, so the product gets ``g``; all-to-all's gets the
        inverse exchange, which is again an all-to-all (with ``splits``, ``(sends,
        receives)`` of the forward's uneven exchange, sends and receives swap)."""
        import torch
        import torch.distributed as dist

        if self.replicated or self.before:
            return g
        if self.dual is not None:
            raise ValueError(f"{self.name}: the input gradient is {self.dual} + matmul")
        if splits is None:
            gp = torch.empty_like(g)
            dist.all_to_all_single(gp, g, group=group)
            return gp
        sends, receives = splits
        gp = g.new_empty(sum(sends), g.shape[1])
        dist.all_to_all_single(gp, g, list(sends), list(receives), group=group)
        return gp


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """``out`` (``R n``, contiguous) = every rank's ``inp`` (``n``), in rank order: torch's
    ``all_gather_single`` where it exists (2.13 deprecates ``all_gather_into_tensor`` with a
    FutureWarning; the GPU image's 2.11 has only the old name)."""
    getattr(_dist or _torch(), _names[0])(out, inp, group=group)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """``out`` (``n``) = this rank's ``n`` elements of the sum of ``inp`` (``R n``):
    ``reduce_scatter_single`` where it exists, else ``reduce_scatter_tensor`` (as
    ``all_gather``)."""
    getattr(_dist or _torch(), _names[1])(out, inp, group=group)


_dist = None  # torch.distributed, once _torch imported it
_names = ("all_gather_single", "reduce_scatter_single")  # or 2.11's names (_torch)


def _torch():
    """``torch.distributed``, imported at the first call; torch's names for the all-gather
    and reduce-scatter into one tensor looked up with it (by name at every call: tests wrap
    them)."""
    global _dist, _names
    import torch.distributed as dist

    old = ("all_gather_into_tensor", "reduce_scatter_tensor")
    _names = tuple(n if hasattr(dist, n) else o for n, o in zip(_names, old, strict=True))
    _dist = dist
    return dist


_TABLE = {
    c.name: c
    for c in (
        Collective("all_reduce", AFTER, reduces=True, splits_rows=False),
        Collective("reduce_scatter", AFTER, reduces=True, splits_rows=True, dual="all_gather"),
        Collective("all_to_all", AFTER, reduces=False, splits_rows=True),
        Collective("all_gather", BEFORE, reduces=False, splits_rows=True, dual="reduce_scatter"),
    )
}
# what matmul_collective takes (the matmul, then the collective); the all-gather is
# all_gather_matmul's
COLLECTIVES = tuple(n for n, c in _TABLE.items() if not c.before)


def collective(name: str) -> Collective:
    """The table's entry for ``name``.

    Raises:
        ValueError: ``name`` is not a collective of the table (the message names
            ``collective``, the argument of every public op).
    """
    try:
        return _TABLE[name]
    except (KeyError, TypeError):
        raise ValueError(f"collective must be one of {COLLECTIVES}, got {name!r}") from None
