"""Weights side by side: ``all_gather_matmul``'s list of weights ``[K, N_i]`` as one
``[K, sum N_i]``, a view of their memory where they are adjacent (``overlap.nn.share_input``
lays sibling weights out so), else a copy; or stacked (``[K_i, N]`` as ``[sum K_i, N]``: the
column layers' input gradient, ``matmul_allreduce_stacked``).

Only a call that runs can see adjacency: under ``torch.compile`` the tensors are fake and
have no addresses, so a join traced into the graph is a copy at every call, at an address the
allocator picks, and the weight's address is in every record's signature (the copies churned
the records: 74-120 of 360 compiled training calls ran eagerly at 8B dims, 4x H100). So
under compile the custom ops take the weights as a list (``others``) and join them in their
bodies (``joined``, ``stacked``), forward and backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def side_by_side(ws: Sequence[torch.Tensor]) -> torch.Tensor:
    """``ws [K, N_i]`` (checked, same dtype and device) as one ``[K, sum N_i]`` in
    ``weight.t()``'s layout, differentiable (the gradient goes back as column views): a view
    where they are adjacent, else a copy (``torch.cat``; always under ``torch.compile``)."""
    if len(ws) == 1:
        return ws[0]
    if torch.is_grad_enabled() and any(wi.requires_grad for wi in ws):
        return _SideBySide.apply(*ws)
    return joined(ws)


def joined(ws: Sequence[torch.Tensor]) -> torch.Tensor:
    """``ws [K, N_i]`` as one ``[K, sum N_i]`` (no autograd): ``ws[0]`` alone, a view where
    they are adjacent (``ws[i].t()`` consecutive row blocks of one tensor), else a copy."""
    first, K = ws[0], ws[0].shape[0]
    if len(ws) == 1:
        return first
    if not torch.compiler.is_compiling() and _adjacent(ws):
        return first.as_strided((K, sum(wi.shape[1] for wi in ws)), (1, K))
    return torch.cat([wi.t() for wi in ws]).t()


def stacked(ws: Sequence[torch.Tensor]) -> torch.Tensor:
    """``ws [K_i, N]`` (row blocks, same dtype and device) as one ``[sum K_i, N]`` (no
    autograd): ``ws[0]`` alone, a view where they are consecutive contiguous blocks of one
    tensor (``share_input``'s weights), else a copy (always under ``torch.compile``)."""
    return joined([wi.t() for wi in ws]).t()


def _adjacent(ws: Sequence[torch.Tensor]) -> bool:
    """``ws[i]`` is ``[K, N_i]`` with strides ``(1, K)``, each starting where the previous
    ends, in one storage."""
    K, step, at = ws[0].shape[0], ws[0].element_size(), ws[0].data_ptr()
    storage = ws[0].untyped_storage().data_ptr()
    for wi in ws:
        if wi.stride() != (1, K) or wi.data_ptr() != at:
            return False
        if wi.untyped_storage().data_ptr() != storage:
            return False
        at += wi.shape[1] * K * step
    return True


class _SideBySide(torch.autograd.Function):
    """``side_by_side`` under autograd: the gradient ``[K, sum N_i]`` back as column views."""

    @staticmethod
    def forward(ctx, *ws):  # noqa: D102
        ctx.sizes = [wi.shape[1] for wi in ws]
        return joined(ws)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        return g.split(ctx.sizes, dim=1)
