"""No devices: eager autograd runs each op's ``autograd.Function`` (``ops/_autograd.py``), not
its custom op (whose dispatch costs host time), and both give the same result and gradients;
at world size 1 (no process group) both are checked against float64 autograd."""

from __future__ import annotations

import torch

import overlap


def _grads(fn, x, w, g):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fn(x, w)
    (y * g).sum().backward()
    return y.grad_fn, y.detach(), x.grad, w.grad


def test_eager_autograd_takes_the_function():
    torch.manual_seed(1)
    x, w, g = torch.randn(24, 16), torch.randn(16, 8), torch.randn(24, 8)
    for name, eager, op in (
        ("matmul_collective", lambda a, b: overlap.matmul_collective(a, b),
         lambda a, b: torch.ops.overlap.matmul_collective(a, b, [], "all_reduce", "", "sum",
                                                          "auto", None, "matmul_collective",
                                                          None, None)),
        ("all_gather_matmul", lambda a, b: overlap.all_gather_matmul(a, b),
         lambda a, b: torch.ops.overlap.all_gather_matmul(a, b, [], "", "auto", None, True)[0]),
    ):  # fmt: skip
        fn_e, y_e, dx_e, dw_e = _grads(eager, x, w, g)
        fn_o, y_o, dx_o, dw_o = _grads(op, x, w, g)
        assert type(fn_e).__name__ == "EagerBackward", f"{name}: {type(fn_e).__name__}"
        assert type(fn_e) is not type(fn_o), name
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        (x64 @ w64 * g.double()).sum().backward()
        for got, want in ((y_e, x64 @ w64), (dx_e, x64.grad), (dw_e, w64.grad)):
            assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5), name
        for a, b in ((y_e, y_o), (dx_e, dx_o), (dw_e, dw_o)):
            assert torch.equal(a, b), name


def test_stacked_row_blocks_gradients():
    """``overlap::matmul_collective`` with further row blocks of ``w`` (``others``, stacked
    under it where the call runs): the result and every block's gradient against float64,
    through the op's registered backward, eagerly and compiled."""
    torch.manual_seed(2)
    x, g = torch.randn(24, 12), torch.randn(24, 8)
    blocks = [torch.randn(n, 8) for n in (6, 4, 2)]  # (K = 12)
    x64, b64 = x.double().requires_grad_(), [b.double().requires_grad_() for b in blocks]
    want_y = x64 @ torch.cat(b64)
    (want_y * g.double()).sum().backward()

    def op(a, *bs):
        return torch.ops.overlap.matmul_collective(
            a, bs[0], list(bs[1:]), "all_reduce", "", "sum", "auto", None, "matmul_allreduce",
            None, None,
        )  # fmt: skip

    for name, fn in (("eager", op), ("compiled", torch.compile(op, backend="aot_eager"))):
        xa, bs = x.clone().requires_grad_(), [b.clone().requires_grad_() for b in blocks]
        y = fn(xa, *bs)
        (y * g).sum().backward()
        grads = [(b.grad, w.grad) for b, w in zip(bs, b64, strict=True)]
        pairs = [(y, want_y), (xa.grad, x64.grad), *grads]
        for i, (got, want) in enumerate(pairs):
            assert got is not None and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5), (
                f"{name}: {['y', 'dx', 'dw0', 'dw1', 'dw2'][i]}"
            )
