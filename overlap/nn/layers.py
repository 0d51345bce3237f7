"""Tensor-parallel linear layers (Megatron's conventions) on the library's overlapped ops.

A transformer block pairs them: a ``ColumnParallelLinear`` (q/k/v, gate/up) splits the output
features over the ranks, a ``RowParallelLinear`` (o, down) splits the input features and
sums the ranks' partial products. Shapes (``R`` ranks of ``group``, ``T`` tokens = the
product of the leading dims of ``x``):

====================  =========================  ==============================================
layer                 input                      output
====================  =========================  ==============================================
Column                ``[..., in]``              ``[..., out / R]`` (``gather_output``:
                      (``sequence_parallel``:    ``[..., out]``)
                      ``[T / R, ..., in]``,
                      gathered first)
Row                   ``[..., in / R]``          ``[..., out]`` (``sequence_parallel``:
                      (``input_is_parallel``     ``[T / R, ..., out]``, reduce-scattered)
                      False: ``[..., in]``)
====================  =========================  ==============================================

``sequence_parallel`` shards the tokens: the leading dims flattened into ``T`` rows, rank
``r`` holding rows ``[r T / R, (r + 1) T / R)``. For Megatron's sequence-first ``[s, b, h]``
that is dim 0 (the sequence); a batch-first ``[b, s, h]`` model gets the batch dim split
instead, which is the same for the token-wise parts between the two layers (norms, dropout,
residuals) as long as both layers see the same layout; pass ``[s, b, h]`` where the
attention must see whole sequences.

Every collective of the two layers is overlapped with a matmul, forward and backward:

=================  ==========================================  ================================
layer              forward                                     input gradient
=================  ==========================================  ================================
Column             ``x @ w^T`` (no communication)              ``matmul_allreduce(g, w)``
Column, SP         ``all_gather_matmul(x, w^T)``               ``matmul_reduce_scatter(g, w)``
Row                ``matmul_allreduce(x, w^T)``                ``g @ w`` (no communication)
Row, SP            ``matmul_reduce_scatter(x, w^T)``           ``all_gather_matmul(g, w)``
=================  ==========================================  ================================

The weight gradients reuse the gathered tensors (the all-gather's ``x_full``, the gathered
``g``). Plain torch collectives remain in the helpers around them: ``gather_output``,
``input_is_parallel=False`` and the row bias's gradient under sequence parallelism. At world
size 1 (or without an initialized process group) both layers compute ``nn.Linear``'s result
from the whole ``weight [out, in]`` and ``bias [out]``, but are not ``nn.Linear`` instances; a
layer made before ``init_process_group`` raises ``RuntimeError`` when called once the default
group has more ranks (under a launcher that set ``WORLD_SIZE`` > 1, when made).
``torch.compile(fullgraph=True)`` keeps the library's
ops whole (they are custom ops).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn

from ..context import check_group
from ..ops import all_gather_matmul, matmul_allreduce, matmul_reduce_scatter, world
from ..ops.dense import matmul_allreduce_stacked


def _rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This rank's index in ``group`` and its size; ``(0, 1)`` without a process group (and
    ``RuntimeError`` there under a launcher that set ``WORLD_SIZE`` > 1: ``ops.world``)."""
    R = world(group)
    return (dist.get_rank(group), R) if dist.is_available() and dist.is_initialized() else (0, 1)


def _split(n: int, R: int, what: str) -> int:
    if n % R:
        raise ValueError(f"{what} ({n}) must be divisible by the world size ({R})")
    return n // R


def _gather(y: torch.Tensor, group, R: int, dim: int) -> torch.Tensor:
    """``y`` of every rank concatenated along ``dim`` in rank order (``n`` -> ``R n``)."""
    parts = [torch.empty_like(y, memory_format=torch.contiguous_format) for _ in range(R)]
    dist.all_gather(parts, y.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _Column(torch.autograd.Function):
    """``x @ w_i.t()`` for each weight shard ``w_i [N_i, in]`` of column layers sharing a
    replicated input whose gradient is summed over the ranks (each rank's products use
    ``x``): one product per weight, contiguous, as plain torch's separate projections (eager
    elementwise ops and attention on column views of one product ran up to 1.7x longer:
    BENCHMARKS.md, "The model step"); the input gradient is one overlapped all-reduce of the
    products' gradients side by side times the weights stacked (``matmul_allreduce_stacked``)."""

    @staticmethod
    def forward(ctx, *inputs):  # noqa: D102  (x, group, *ws)
        # (not ``forward(ctx, x, group, *ws)``: under no_grad dynamo drops ``ctx`` when the
        # arguments, ctx excluded, number as many as the signature's parameters, ctx and
        # ``*ws`` included: two weights, gate/up, did; here never, they are three or more)
        x, group, *ws = inputs
        ctx.save_for_backward(x, *ws)
        ctx.group = group
        return tuple(x @ w.t() for w in ws)

    @staticmethod
    def backward(ctx, *gs):  # noqa: D102  (gs: zeros for unused products)
        x, *ws = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            g = gs[0] if len(gs) == 1 else torch.cat(gs, dim=-1)
            dx = matmul_allreduce_stacked(g, ws, ctx.group)
        x2 = x.reshape(-1, x.shape[-1])
        dws = [g.reshape(-1, g.shape[-1]).t() @ x2 if need else None
               for g, need in zip(gs, ctx.needs_input_grad[2:], strict=True)]  # fmt: skip
        return dx, None, *dws


class _Gather(torch.autograd.Function):
    """``n`` of every rank along ``dim`` -> ``R n`` (rank order); the gradient: this rank's
    ``n``. Exact where the gradient arriving is the same on every rank (replicated)."""

    @staticmethod
    def forward(ctx, y, group, R, rank, dim):  # noqa: D102
        ctx.rank, ctx.n, ctx.dim = rank, y.shape[dim], dim
        return _gather(y, group, R, dim)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        return g.narrow(ctx.dim, ctx.rank * ctx.n, ctx.n), None, None, None, None


class _Scatter(torch.autograd.Function):
    """A replicated ``R n`` along ``dim`` -> this rank's ``n``; the gradient: every rank's
    ``n`` gathered (replicated again)."""

    @staticmethod
    def forward(ctx, x, group, R, rank, dim):  # noqa: D102
        ctx.group, ctx.R, ctx.dim = group, R, dim
        n = x.shape[dim] // R
        return x.narrow(dim, rank * n, n)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        return _gather(g, ctx.group, ctx.R, ctx.dim), None, None, None, None


class _SumGrad(torch.autograd.Function):
    """Identity whose gradient is summed over the ranks: a replicated parameter used on this
    rank's tokens only (the row layer's bias under sequence parallelism)."""

    @staticmethod
    def forward(ctx, p, group):  # noqa: D102
        ctx.group = group
        return p.view_as(p)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _Sharded(nn.Module):
    """What both layers share: the shard of an ``nn.Linear(in_features, out_features)``
    along ``split_dim`` of its weight (0: output features, 1: input features), the bias
    sharded with the output features or whole."""

    split_dim = 0

    def __init__(self, in_features, out_features, bias, group, sequence_parallel, device, dtype):
        super().__init__()
        check_group(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.rank, self.world_size = _rank_size(group)
        # made before init_process_group: a whole layer, wrong next to sharded ones (forward)
        self.made_without_group = group is None and not dist.is_initialized()
        self.in_features, self.out_features = in_features, out_features
        shape = [out_features, in_features]
        what = ("out_features", "in_features")[self.split_dim]
        shape[self.split_dim] = _split(shape[self.split_dim], self.world_size, what)
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(*shape, **kw))
        self.bias = nn.Parameter(torch.empty(shape[0], **kw)) if bias else None
        _init(self.weight, self.bias, in_features)

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        """World size 1: ``nn.Linear``'s result; raises if the layer was made before the
        process group and the default group now has more ranks."""
        if self.made_without_group and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(
                f"{type(self).__name__} was made before torch.distributed.init_process_group, "
                "so it holds the whole layer on every rank; make it (or call from_linear / "
                "parallelize) after init_process_group"
            )
        return nn.functional.linear(x, self.weight, self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: dist.ProcessGroup | None = None, **kw):
        """This rank's shard of ``linear`` (``weight [out, in]``, ``bias [out]``): the column
        layer takes its rows of ``weight`` and ``bias``, the row layer its columns of
        ``weight`` and the whole ``bias``; ``kw``: the layer's options.

        Raises:
            TypeError: ``linear`` is not an ``nn.Linear``.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        like = dict(device=linear.weight.device, dtype=linear.weight.dtype)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    group=group, **like, **kw)  # fmt: skip
        n = layer.weight.shape[cls.split_dim]
        mine = slice(layer.rank * n, (layer.rank + 1) * n)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[mine] if cls.split_dim == 0 else
                               linear.weight[:, mine])  # fmt: skip
            if layer.bias is not None:
                layer.bias.copy_(linear.bias[mine] if cls.split_dim == 0 else linear.bias)
        layer.weight.requires_grad_(linear.weight.requires_grad)  # (a frozen layer stays so)
        if layer.bias is not None:
            layer.bias.requires_grad_(linear.bias.requires_grad)
        return layer


class ColumnParallelLinear(_Sharded):
    """``nn.Linear(in_features, out_features)`` with the output features split over the ranks
    of ``group`` (``None``: the default group): this rank holds ``weight [out / R, in]`` and
    ``bias [out / R]`` (rows ``[r out / R, (r + 1) out / R)`` of the whole layer's).

    ``x [..., in]`` -> ``[..., out / R]``, or ``[..., out]`` with ``gather_output``. With
    ``sequence_parallel`` the input is this rank's tokens ``[T / R, ..., in]`` (module
    docstring), gathered before the matmul.

    Raises:
        ValueError: ``out_features`` not divisible by the world size.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: dist.ProcessGroup | None = None,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, group, sequence_parallel, device, dtype)
        self.gather_output = gather_output

    # (share_input: the layers sharing this one's input, and this layer's place among them)
    siblings: _Siblings | None = None
    sibling: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` (sequence parallel: ``[T / R, ..., in]``) -> ``[..., out / R]``
        (``gather_output``: ``[..., out]``)."""
        if self.world_size == 1:
            return self._whole(x)
        if self.siblings is not None:
            y = self.siblings.take(self.sibling, x)
        else:
            y = _products([self], x)[0]
        if self.bias is not None:
            y = y + self.bias
        if self.gather_output:
            y = _Gather.apply(y, self.group, self.world_size, self.rank, -1)
        return y


class RowParallelLinear(_Sharded):
    """``nn.Linear(in_features, out_features)`` with the input features split over the ranks
    of ``group``: this rank holds ``weight [out, in / R]`` (columns ``[r in / R, (r + 1) in /
    R)``) and the whole ``bias [out]``, added once after the ranks' products are summed
    (overlapped: ``matmul_allreduce``, or ``matmul_reduce_scatter`` with
    ``sequence_parallel``, where the bias gradient is then summed over the ranks).

    ``x [..., in / R]`` (``input_is_parallel=False``: ``[..., in]``, this rank's columns taken)
    -> ``[..., out]``, or with ``sequence_parallel`` this rank's tokens ``[T / R, ..., out]``.

    Raises:
        ValueError: ``in_features`` not divisible by the world size, or (sequence parallel)
            the input's dim 0 (the tokens, sequence first) not divisible by it.
    """

    split_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: dist.ProcessGroup | None = None,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, group, sequence_parallel, device, dtype)
        self.input_is_parallel = input_is_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in / R]`` (or ``[..., in]``) -> ``[..., out]`` (sequence parallel:
        ``[T / R, ..., out]``)."""
        if self.world_size == 1:
            return self._whole(x)
        if not self.input_is_parallel:
            x = _Scatter.apply(x, self.group, self.world_size, self.rank, -1)
        if self.sequence_parallel:
            _split(x.shape[0], self.world_size, "the input's dim 0 (sequence parallel)")
        matmul = matmul_reduce_scatter if self.sequence_parallel else matmul_allreduce
        y = matmul(x, self.weight.t(), group=self.group)
        if self.sequence_parallel:  # [T / R, N] -> this rank's rows of the leading dims
            y = y.reshape(x.shape[0] // self.world_size, *x.shape[1:-1], y.shape[-1])
        if self.bias is None:
            return y
        # under sequence parallelism each rank adds the bias to its own tokens only, so its
        # gradient is summed over the ranks (Megatron leaves that to its optimizer step)
        return y + (_SumGrad.apply(self.bias, self.group) if self.sequence_parallel else self.bias)


def share_input(*layers: ColumnParallelLinear) -> None:
    """Declares column layers that are called on one input, one after another (q/k/v of an
    attention, gate/up of an MLP): the first call computes every layer's product, with one
    gather of the input under sequence parallelism (``all_gather_matmul`` of the list of
    weights; otherwise one product per weight), and the backward sums their input gradients in
    one overlapped collective (one reduce-scatter, or one all-reduce, instead of one per
    layer); the other layers take their products. ``overlap.nn.parallelize`` calls it for the column
    layers of each module that share an input.

    The layers' weights move into one tensor (each ``weight`` stays the same ``Parameter``, now
    a view of it; make optimizers after this call or before, either works), so that the
    gathered input and the input gradient multiply by all of them without a copy. A layer
    called on another tensor than the one its siblings were last called on (or on one modified
    in place since) computes every product afresh; one called while a sibling has not yet taken
    its product from the last input stops the sharing for good (the layers are evidently not
    called on one input), and each layer then computes alone, as before this call. An
    inference tensor (made under ``torch.inference_mode``) has no version counter, so nothing
    would tell a sibling that it changed in place: on one each layer computes its own product
    (under sequence parallelism its own gather; without, the same work as shared).

    Raises:
        TypeError: a layer is not a ``ColumnParallelLinear``.
        ValueError: the layers differ in group, ``sequence_parallel``, ``in_features``, dtype
            or device, or one already shares its input.
    """
    for layer in layers:
        if not isinstance(layer, ColumnParallelLinear):
            raise TypeError(f"layers must be ColumnParallelLinear, got {type(layer).__name__}")
        if layer.siblings is not None:
            raise ValueError("a layer already shares its input (share_input was called on it)")
    first = layers[0] if layers else None
    for layer in layers[1:]:
        for what in ("group", "sequence_parallel", "in_features"):
            if getattr(layer, what) != getattr(first, what):
                raise ValueError(f"the layers differ in {what}: {getattr(first, what)!r} and "
                                 f"{getattr(layer, what)!r}")  # fmt: skip
        for what in ("dtype", "device"):
            if getattr(layer.weight, what) != getattr(first.weight, what):
                raise ValueError(f"the layers' weights differ in {what}")
    if first is None or first.world_size == 1:
        return  # (world size 1: each layer is nn.Linear's product)
    fused = torch.cat([layer.weight.detach() for layer in layers])
    siblings = _Siblings(layers)
    rows = fused.split([layer.weight.shape[0] for layer in layers])
    for i, (layer, part) in enumerate(zip(layers, rows, strict=True)):
        layer.weight.data = part  # (the same Parameter: optimizers made before still hold it)
        layer.siblings, layer.sibling = siblings, i


class _Siblings:
    """The column layers of one ``share_input`` call and the products computed for the last
    input: ``take(i, x)`` returns layer ``i``'s, computing all of them at a miss."""

    def __init__(self, layers) -> None:
        self.layers, self.shared, self.gathered = list(layers), True, False
        self.x, self.version, self.pending = None, None, []

    def take(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s product ``[..., N_i]`` (its bias not added) for input ``x``."""
        version = _version(x)
        hit = x is self.x and version is not None and version == self.version
        if hit and self.pending[i] is not None:
            y, self.pending[i] = self.pending[i], None
            if all(p is None for p in self.pending):
                self.x, self.pending = None, []  # (drop the input and the products)
            return y
        if self.gathered and torch.is_grad_enabled():
            raise RuntimeError(
                f"overlap.nn.parallelize(sequence_parallel=True): {self.layers[i]} was called on "
                "another tensor than the hidden states its attention module was given "
                "(gathered once for q, k and v by parallelize's pre-hook): its input gradient "
                "would be summed over the ranks twice. Call the projections on the attention "
                "module's input, or parallelize without sequence_parallel"
            )
        if any(p is not None for p in self.pending):  # a sibling never took its product
            self.shared, self.x, self.pending = False, None, []
        if not self.shared or version is None:  # (None: an inference tensor, untracked)
            return _products([self.layers[i]], x)[0]
        self.keep(x, _products(self.layers, x))
        return self.take(i, x)

    def keep(self, x: torch.Tensor, products: list[torch.Tensor]) -> None:
        """Every layer's product for input ``x``, for the layers' calls to take."""
        self.x, self.version, self.pending = x, _version(x), list(products)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Sequence parallel, for layers called on the whole input (attention): this rank's
        tokens ``[s / R, b, K]`` gathered (returned as ``[b, s, K]``) and every layer's
        product for it (``[b, s, N_i]``) computed in one ``all_gather_matmul``; the
        layers' calls on the returned tensor take them."""
        first, self.gathered = self.layers[0], True
        ws = [layer.weight.t() for layer in self.layers]
        s, b = x.shape[0] * first.world_size, math.prod(x.shape[1:-1])
        # made as normal tensors under inference_mode too: ``whole`` then has a version
        # counter, and a layer called on it after an in-place change computes afresh
        with _tracked():
            ys, full = all_gather_matmul(x, ws, group=first.group, return_gathered=True)
            whole = full.view(s, b, full.shape[-1]).transpose(0, 1)
            ys = [y.view(s, b, y.shape[-1]).transpose(0, 1) for y in ys]
        self.keep(whole, ys)
        return whole


def _tracked() -> contextlib.AbstractContextManager:
    """Under ``torch.inference_mode``: a context whose new tensors are normal ones (with a
    version counter), autograd still off; otherwise (and while compiling: ``_version``) none."""
    if torch.compiler.is_compiling() or not torch.is_inference_mode_enabled():
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))  # (which turns autograd on: off again)
    stack.enter_context(torch.no_grad())
    return stack


def _version(x: torch.Tensor) -> int | None:
    """``x``'s version counter (bumped by each in-place change); 0 while compiling (Dynamo
    traces the holder's Python whole: identity is the hit); None for an inference tensor,
    which has none (``take`` never takes a kept product for it)."""
    if torch.compiler.is_compiling():
        return 0
    return None if x.is_inference() else x._version


def _products(layers: list[ColumnParallelLinear], x: torch.Tensor) -> list[torch.Tensor]:
    """Each column layer's product ``[..., N_i]`` (no bias) for input ``x`` (sequence
    parallel: this rank's tokens, gathered once, and column views of one product of their
    weights side by side; otherwise one contiguous product per weight: ``_Column``)."""
    first, one = layers[0], len(layers) == 1  # (one: no list, checked and split once less)
    if first.sequence_parallel:
        ws = [layer.weight.t() for layer in layers]  # (a view costs ~1.2 us of host time)
        lead = (x.shape[0] * first.world_size, *x.shape[1:-1])
        ys = all_gather_matmul(x, ws[0] if one else ws, group=first.group)
        return [y.view(*lead, y.shape[-1]) for y in ([ys] if one else ys)]
    return list(_Column.apply(x, first.group, *(layer.weight for layer in layers)))


def _init(weight: nn.Parameter, bias: nn.Parameter | None, fan_in: int) -> None:
    """``nn.Linear``'s initialization, with the whole layer's fan-in."""
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
    nn.init.uniform_(weight, -bound, bound)
    if bias is not None:
        nn.init.uniform_(bias, -bound, bound)
