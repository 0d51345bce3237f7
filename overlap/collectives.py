"""The collectives the library overlaps with a matmul, in one table.

Code asks a ``Collective`` for what it needs (does it reduce? which rows does a rank get?)
instead of comparing names. Pure Python at import time, so ``overlap.plan`` can use it;
the torch equivalents import ``torch.distributed`` when called.

==============  ==========  ============  ==========================  =========================
name            direction   result rows   plain torch                 backward of the product
==============  ==========  ============  ==========================  =========================
all_reduce      after       ``M``         ``all_reduce(y)``           ``g`` (identity)
reduce_scatter  after       ``M / R``     ``reduce_scatter_tensor``   all-gather of every ``g``
all_to_all      after       ``M``         ``all_to_all_single``       the inverse all-to-all
==============  ==========  ============  ==========================  =========================

``direction`` says where the collective runs relative to the kernel: ``AFTER`` moves the
kernel's product (the producer signals finished chunks); a collective *before* the kernel
(all-gather + matmul) would move its input instead, the consumer waiting per chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

AFTER = "after"
OPS = ("sum", "avg")


@dataclass(frozen=True)
class Collective:
    """What the library needs to know of one collective.

    ``reduces``: the ranks' products are summed (``op="avg"`` allowed). ``splits_rows``:
    row block ``j`` (``M / R`` rows) of every rank's product belongs to rank ``j``, so
    ``M`` must be divisible by ``R`` and a chunk's rows form one run per rank.
    """

    name: str
    direction: str
    reduces: bool
    splits_rows: bool

    @property
    def replicated(self) -> bool:
        """Every rank gets the whole reduced product (all-reduce)."""
        return self.reduces and not self.splits_rows

    @property
    def scatters(self) -> bool:
        """Each rank gets only its own block of the reduced rows (reduce-scatter)."""
        return self.reduces and self.splits_rows

    def result_shape(self, x_shape: tuple[int, ...], N: int, R: int) -> tuple[int, ...]:
        """The result's shape for ``x [..., K]`` and ``N`` columns: ``[M / R, N]`` when it
        scatters, else ``[..., N]``."""
        if self.scatters:
            return (math.prod(x_shape[:-1]) // R, N)
        return (*x_shape[:-1], N)

    def plain(self, y: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        """The torch collective of a product ``y [M, N]`` into ``out`` (the result;
        the all-reduce runs in place, so ``out`` is ``y`` there)."""
        import torch.distributed as dist

        if self.replicated:
            dist.all_reduce(y, group=group)
        elif self.reduces:
            dist.reduce_scatter_tensor(out, y, group=group)
        else:
            dist.all_to_all_single(out, y, group=group)

    def backward(self, g: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """Gradient of this rank's product ``[M, N]`` from the gradient ``g`` of its result
        (contiguous, 2-D), with tensor parallelism's conventions: the
        replicated all-reduce result has a replicated gradient, so the product gets ``g``;
        reduce-scatter's product gets every rank's ``g`` gathered; all-to-all's the inverse
        exchange, which is again an all-to-all."""
        import torch
        import torch.distributed as dist

        if self.replicated:
            return g
        if self.reduces:
            gp = g.new_empty(g.shape[0] * dist.get_world_size(group), g.shape[1])
            dist.all_gather_into_tensor(gp, g, group=group)
            return gp
        gp = torch.empty_like(g)
        dist.all_to_all_single(gp, g, group=group)
        return gp


_TABLE = {
    c.name: c
    for c in (
        Collective("all_reduce", AFTER, reduces=True, splits_rows=False),
        Collective("reduce_scatter", AFTER, reduces=True, splits_rows=True),
        Collective("all_to_all", AFTER, reduces=False, splits_rows=True),
    )
}
COLLECTIVES = tuple(_TABLE)


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
