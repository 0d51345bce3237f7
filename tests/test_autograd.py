"""Backward of ``matmul_collective`` (tensor-parallel conventions, ``overlap.ops._backward_op``) on
2 gloo ranks with the overlapped forward in the interpreter, against float64 autograd over every
rank's inputs; and the single-process and misuse cases."""

from __future__ import annotations

import random

import pytest
import torch
from _dist import check_grad_case, spawn

import overlap
from overlap.context import set_tuned, tuned_key


def _grads(rank, R, seed):
    failures = []
    i = 0
    for coll in ("all_reduce", "reduce_scatter", "all_to_all"):
        for shape, chunks in (((64, 40, 48), 2), ((2, 48, 24, 40), 3)):
            for op in ("sum", "avg") if coll != "all_to_all" else ("sum",):
                i += 1
                case = (coll, torch.float32, shape, op)
                msg = check_grad_case(rank, R, "cpu", case, seed + i, chunks=chunks)
                failures += [msg] if msg else []
    # The reduce-scatter's input gradient (an all-gather) on the plain path, as overlap.tune
    # may choose: the weight gradient then comes after that call (``engine.run_before``), not
    # inside it as on the overlapped path above.
    key = tuned_key(64, 0, 48, torch.float32, "all_gather")
    set_tuned(None, torch.device("cpu"), key, "plain")
    overlap.stats(reset=True)
    try:
        case = ("reduce_scatter", torch.float32, (64, 40, 48), "sum")
        msg = check_grad_case(rank, R, "cpu", case, seed + 99, chunks=2)
    finally:
        set_tuned(None, torch.device("cpu"), key, None)
    paths = overlap.stats(reset=True).get("all_gather_matmul", {})
    if not any("overlap.tune" in path for path in paths):
        msg = f"the backward's all-gather did not take the tuned plain path: {paths}"
    return failures + ([msg] if msg else [])


def test_backward_two_ranks():
    spawn(_grads, 2, random.randrange(1 << 30))


def test_backward_single_process_matches_torch():
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 5, 6, dtype=torch.float64)
    x32, w32 = x.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    (overlap.matmul_allreduce(x32, w32.t()) * g.float()).sum().backward()
    ((x @ weight.t()) * g).sum().backward()
    assert torch.allclose(x32.grad.double(), x.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(w32.grad.double(), weight.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["matmul_allreduce", "all_gather_matmul"])
def test_weight_grad_comes_in_the_weights_layout(op):
    """``w``'s gradient is the transpose of a contiguous ``[N, K]``, whatever ``w``'s strides:
    ``w = weight.t()`` gets ``weight``'s layout (no transposing copy for ``weight.grad``);
    the values against float64."""
    x, g = torch.randn(10, 8), torch.randn(10, 6)
    for w in (torch.randn(6, 8).t().requires_grad_(), torch.randn(8, 6).requires_grad_()):
        (dw,) = torch.autograd.grad((getattr(overlap, op)(x, w) * g).sum(), w)
        assert dw.t().is_contiguous() and dw.shape == w.shape
        torch.testing.assert_close(dw.double(), x.double().t() @ g.double(), rtol=1e-5, atol=1e-5)


def test_out_with_autograd_is_refused():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 6)
    with pytest.raises(ValueError, match="out= does not support autograd"):
        overlap.matmul_allreduce(x, w, out=torch.empty(4, 6))
    with torch.no_grad():
        overlap.matmul_allreduce(x, w, out=torch.empty(4, 6))  # fine without autograd
