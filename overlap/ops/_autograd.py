"""Each differentiable op two ways over one Python body: a torch custom op (what
``torch.compile`` keeps whole and AOTAutograd differentiates through its registered backward)
and, for eager autograd, a ``torch.autograd.Function`` around the same body and backward.

The custom op's dispatch costs host time at every call, in the forward and again in the
backward's own op: at world size 1 on a CPU (``x [8, 16] @ w [16, 32]``), ``matmul_collective``
forward and backward took ~218 us through the ops against ~52 us for ``x @ w``. A training
step issues two of them per layer of a model, so eager calls take the ``Function``
(``differentiable``'s ``apply``); under ``torch.compile`` they take the op. A backward calls
its backward op through ``call``: the op's body where the forward ran eagerly, else the op.
The embedding-bag op stays on its custom op: its tables come as a list, and a ``Function``
differentiates no tensor inside a list.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_BODIES: dict[object, Callable] = {}  # custom op -> its Python body


def custom_op(name: str) -> Callable[[Callable], object]:
    """``torch.library.custom_op(name, mutates_args=())``, its body kept for ``call`` and
    ``differentiable``."""

    def wrap(body: Callable) -> object:
        op = torch.library.custom_op(name, mutates_args=())(body)
        _BODIES[op] = body
        return op

    return wrap


def call(ctx, op, *args):
    """In a backward: custom op ``op`` of ``args``, as its body where the forward ran eagerly
    (through ``differentiable``'s ``Function``)."""
    return (_BODIES[op] if getattr(ctx, "eager", False) else op)(*args)


def differentiable(op, setup: Callable, backward: Callable) -> Callable:
    """Registers ``backward`` (with ``setup``: ``register_autograd``'s ``setup_context``) on the
    custom op ``op`` and returns ``apply(*args)``: the op under ``torch.compile``, else an
    ``autograd.Function`` of the op's body with the same ``setup`` and ``backward``."""
    op.register_autograd(backward, setup_context=setup)
    body = _BODIES[op]

    def forward(ctx, *args):  # (a separate setup_context would bind the arguments by
        out = body(*args)  # inspect.signature at every apply: ~40 us)
        setup(ctx, args, out)
        ctx.eager = True
        return out

    members = dict(forward=staticmethod(forward), backward=staticmethod(backward))
    function = type("Eager", (torch.autograd.Function,), members)

    def apply(*args):
        return op(*args) if torch.compiler.is_compiling() else function.apply(*args)

    return apply
