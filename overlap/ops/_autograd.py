"""Each differentiable op two ways over one Python body: a torch custom op (what
``torch.compile`` keeps whole and AOTAutograd differentiates through its registered backward)
and, for eager autograd, a ``torch.autograd.Function`` around the same body and backward.

An op's body takes its tensors, then one immutable call description (a ``NamedTuple`` of
the values that are not tensors: the group's name, collective, backend, chunks, splits...).
A custom op takes no Python object, so its schema is the body's tensor parameters followed by
the description's fields (``custom_op``): ``differentiable``'s ``apply`` unpacks a
description into them (``op(*tensors, *call)``) and ``_Op.split`` makes it again from them,
the one place each. ``setup`` and
``backward`` see the tensors and the description, never the flat argument list: ``setup(ctx,
tensors, call, output)``, ``backward(ctx, need, *grads)`` with ``need`` the tensor
arguments' ``needs_input_grad`` flags in order, returning their gradients in that order.

The custom op's dispatch costs host time at every call, in the forward and again in the
backward's own op: at world size 1 on a CPU (``x [8, 16] @ w [16, 32]``), ``matmul_collective``
forward and backward took ~218 us through the ops against ~52 us for ``x @ w``. A training
step issues two of them per layer of a model, so eager calls take the ``Function``
(``differentiable``'s ``apply``); under ``torch.compile`` they take the op. A backward calls
its backward op through ``call``: the op's body where the forward ran eagerly, else the op.
The embedding-bag op stays on its custom op (``register``): its tables come as a list, and a
``Function`` differentiates no tensor inside a list.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import NamedTuple

import torch


class _Op(NamedTuple):
    """A custom op's Python body, how many tensor arguments come first (``tensors``) and the
    type of the call description after them (None: the body takes its arguments flat)."""

    body: Callable
    tensors: int
    described: type | None

    def split(self, flat) -> tuple[tuple, tuple]:
        """``(tensors, description)`` of the op's flat argument list ``flat``."""
        n = self.tensors
        return tuple(flat[:n]), self.described(*flat[n:])


_OPS: dict[object, _Op] = {}  # custom op -> its body and layout


def custom_op(name: str, described: type | None = None) -> Callable[[Callable], object]:
    """``torch.library.custom_op(name, mutates_args=())`` of the body, which is kept for
    ``call`` and ``differentiable``. With ``described`` (a ``NamedTuple`` type), the body is
    ``body(*tensors, call)``, ``call`` a ``described``: the op's schema is the body's
    parameters before ``call`` followed by ``described``'s fields."""

    def wrap(body: Callable) -> object:
        if described is None:
            op = torch.library.custom_op(name, mutates_args=())(body)
            _OPS[op] = _Op(body, 0, None)
            return op
        hints = typing.get_type_hints(body)
        params = list(inspect.signature(body).parameters)[:-1]  # (the last: the description)
        layout = _Op(body, len(params), described)

        def flat(*args):
            tensors, described_call = layout.split(args)
            return body(*tensors, described_call)

        fields = typing.get_type_hints(described)
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        flat.__signature__ = inspect.Signature(
            [inspect.Parameter(p, kind, annotation=hints[p]) for p in params]
            + [inspect.Parameter(f, kind, annotation=fields[f]) for f in described._fields],
            return_annotation=hints["return"],
        )
        flat.__name__ = body.__name__
        op = torch.library.custom_op(name, mutates_args=())(flat)
        _OPS[op] = layout
        return op

    return wrap


def fake(op) -> Callable[[Callable], Callable]:
    """Registers ``fn(*tensors, call)`` as the fake (meta) implementation of the described
    custom op ``op``."""

    def wrap(fn: Callable) -> Callable:
        layout = _OPS[op]

        def flat(*args):
            tensors, described_call = layout.split(args)
            return fn(*tensors, described_call)

        op.register_fake(flat)
        return fn

    return wrap


def call(ctx, op, *args, **kwargs):
    """In a backward: custom op ``op`` of ``args`` and ``kwargs``, as its body where the
    forward ran eagerly (through ``differentiable``'s ``Function``)."""
    return (_OPS[op].body if getattr(ctx, "eager", False) else op)(*args, **kwargs)


def register(op, setup: Callable, backward: Callable) -> None:
    """Registers ``backward`` with ``setup`` (``register_autograd``'s ``setup_context``) on the
    described custom op ``op``, as the module docstring says they are written: the flat
    inputs split into tensors and description, the gradients of the description's fields
    None."""
    layout = _OPS[op]

    def setup_context(ctx, inputs, output) -> None:
        tensors, described = layout.split(inputs)
        setup(ctx, tensors, described, output)

    def grads(ctx, *g):
        need = ctx.needs_input_grad
        got = backward(ctx, need[: layout.tensors], *g)
        return *got, *[None] * (len(need) - layout.tensors)  # (the fields: no gradients)

    op.register_autograd(grads, setup_context=setup_context)


def differentiable(op, setup: Callable, backward: Callable) -> Callable:
    """Registers ``backward`` and ``setup`` on the described custom op ``op`` (``register``)
    and returns ``apply(*tensors, call)``: the op under ``torch.compile``, else an
    ``autograd.Function`` of the op's body with the same ``setup`` and ``backward`` (where a
    tensor argument that is a list gets no gradient: a ``Function`` differentiates no tensor
    inside a list)."""
    register(op, setup, backward)
    layout = _OPS[op]
    body = layout.body
    hints = typing.get_type_hints(body)
    listed = [
        typing.get_origin(hints[p]) is list
        for p in list(inspect.signature(body).parameters)[: layout.tensors]
    ]

    def forward(ctx, *args):  # (a separate setup_context would bind the arguments by
        out = body(*args)  # inspect.signature at every apply: ~40 us)
        setup(ctx, args[:-1], args[-1], out)
        ctx.eager = True
        return out

    def eager_backward(ctx, *g):
        got = backward(ctx, ctx.needs_input_grad[:-1], *g)
        return *[None if lst else d for d, lst in zip(got, listed, strict=True)], None

    members = dict(forward=staticmethod(forward), backward=staticmethod(eager_backward))
    function = type("Eager", (torch.autograd.Function,), members)

    def apply(*args):
        if torch.compiler.is_compiling():
            return op(*args[:-1], *args[-1])
        return function.apply(*args)

    return apply
