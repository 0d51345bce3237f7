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
group has more ranks. ``torch.compile(fullgraph=True)`` keeps the library's
ops whole (they are custom ops).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .ops import all_gather_matmul, matmul_collective
from .ops._engine import check_group


def _rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


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
    """``x @ w.t()`` of a replicated input whose gradient is summed over the ranks (each
    rank's products use ``x``), overlapped: ``matmul_allreduce(g, w)``. ``w``: the weight
    shard ``[out / R, in]``."""

    @staticmethod
    def forward(ctx, x, w, group):  # noqa: D102
        ctx.save_for_backward(x, w)
        ctx.group = group
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        x, w = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = matmul_collective(g, w, "all_reduce", group=ctx.group)
        if ctx.needs_input_grad[1]:
            dw = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return dx, dw, None


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` (sequence parallel: ``[T / R, ..., in]``) -> ``[..., out / R]``
        (``gather_output``: ``[..., out]``)."""
        if self.world_size == 1:
            return self._whole(x)
        if self.sequence_parallel:
            y = all_gather_matmul(x, self.weight.t(), group=self.group)
            y = y.view(x.shape[0] * self.world_size, *x.shape[1:-1], y.shape[-1])
        else:
            y = _Column.apply(x, self.weight, self.group)
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
            the tokens not divisible by it.
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
        coll = "reduce_scatter" if self.sequence_parallel else "all_reduce"
        if self.sequence_parallel:
            _split(x.shape[0], self.world_size, "the input's dim 0 (sequence parallel)")
        y = matmul_collective(x, self.weight.t(), coll, group=self.group)
        if self.sequence_parallel:  # [T / R, N] -> this rank's rows of the leading dims
            y = y.reshape(x.shape[0] // self.world_size, *x.shape[1:-1], y.shape[-1])
        if self.bias is None:
            return y
        # under sequence parallelism each rank adds the bias to its own tokens only, so its
        # gradient is summed over the ranks (Megatron leaves that to its optimizer step)
        return y + (_SumGrad.apply(self.bias, self.group) if self.sequence_parallel else self.bias)


def _init(weight: nn.Parameter, bias: nn.Parameter | None, fan_in: int) -> None:
    """``nn.Linear``'s initialization, with the whole layer's fan-in."""
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
    nn.init.uniform_(weight, -bound, bound)
    if bias is not None:
        nn.init.uniform_(bias, -bound, bound)


# the entries of a transformers plan that parallelize applies: (layer, its options)
_STYLES = {
    "colwise": (ColumnParallelLinear, {}),
    "rowwise": (RowParallelLinear, {}),
    "colwise_gather_output": (ColumnParallelLinear, {"gather_output": True}),
    "rowwise_split_input": (RowParallelLinear, {"input_is_parallel": False}),
}
# the fields of a config that plain "colwise" / "rowwise" entries split over the ranks
_SPLIT_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def parallelize(
    model: nn.Module, group: dist.ProcessGroup | None = None, sequence_parallel: bool = False
) -> nn.Module:
    """Shards a ``transformers`` model in place over the ranks of ``group`` (``None``: the
    default group) by its own tensor-parallel plan, and returns it.

    The plan is ``model.config.base_model_tp_plan``: module names of ``model.base_model``
    (``layers.*.self_attn.q_proj``; ``*`` stands for a layer number) mapped to a style.
    Every rank must hold the same whole model (same weights); each ``nn.Linear`` named by the
    plan becomes this rank's shard of it (``from_linear``):

    ==================================  =======================================================
    style                               becomes
    ==================================  =======================================================
    ``colwise``                         ``ColumnParallelLinear``: ``[..., in]`` ->
                                        ``[..., out / R]``
    ``rowwise``                         ``RowParallelLinear``: ``[..., in / R]`` ->
                                        ``[..., out]``
    ``colwise_gather_output``           ``ColumnParallelLinear(gather_output=True)``:
                                        ``[..., in]`` -> ``[..., out]``
    ``rowwise_split_input``             ``RowParallelLinear(input_is_parallel=False)``:
                                        ``[..., in]`` -> ``[..., out]``
    ``replicated_with_grad_allreduce``  kept whole, its parameters' gradients summed over the
                                        ranks (a norm applied to this rank's heads: q_norm)
    ==================================  =======================================================

    Attention in transformers 5 reshapes with ``-1`` heads, so q/k/v/o split by heads need no
    change to the modules' head counts. Modules the plan does not name (embeddings, norms,
    ``lm_head``) stay whole on every rank: exact, since their inputs are replicated. Any other
    style (experts, packed or fused weights, embeddings sharded by vocabulary) raises
    ``NotImplementedError``; delete its entry from ``model.config.base_model_tp_plan`` (an
    instance attribute overrides the class's) to keep those modules whole instead, which is
    exact only where the plan's other entries do not pair with them.

    ``sequence_parallel``: between the layers, every rank holds only its tokens, sequence
    first: ``[b, s, h]`` -> ``[s / R, b, h]`` (``s`` divisible by ``R``; so not for one-token
    decoding). The norms, residual adds and MLPs run on those shards (gate/up gather them
    overlapped, down reduce-scatters overlapped, norms' gradients summed over the ranks);
    attention needs whole sequences, so its input is gathered (plain all-gather; q/k/v are
    plain column layers) and its o projection reduce-scatters overlapped. Hooks on the base
    model do the layout: the first decoder layer's input is split, each attention's input
    gathered, o's input made sequence first, the final ``norm``'s input gathered back to
    ``[b, s, h]``. That needs ``base_model.layers`` and ``base_model.norm``, attention modules
    whose class name ends in ``Attention`` holding the q/k/v/o of the plan, plain
    ``colwise``/``rowwise``/``replicated_with_grad_allreduce`` entries only, and in the layers
    no parameters outside the plan's linears and the attention but norms'; other models raise
    ``NotImplementedError``. Hidden states returned by ``output_hidden_states`` are the
    ``[s / R, b, h]`` shards.

    At world size 1 (or without an initialized process group and ``group=None``) it returns
    ``model`` unchanged.

    Raises:
        TypeError: ``model`` has no ``config``; ``group`` is not a process group.
        ValueError: the model's config has no plan; a field the plan splits
            (``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``) or a
            sharded layer's features not divisible by the world size.
        NotImplementedError: a style other than the above, on a module of the model, or a
            plan entry naming a module that is not an ``nn.Linear``; a model whose structure
            ``sequence_parallel`` does not cover.
    """
    check_group(group)
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"model must be a transformers model (with .config), got "
                        f"{type(model).__name__}")  # fmt: skip
    rank, R = _rank_size(group)
    if R == 1:
        return model
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(f"model: {type(config).__name__}.base_model_tp_plan is empty; "
                         "nothing says how to shard it")  # fmt: skip
    base = getattr(model, "base_model", model)
    named = [(name, module, plan.get(_generic(name))) for name, module in base.named_modules()]
    named = [(name, module, style) for name, module, style in named if style is not None]
    _check_plan(named, config, R)
    # the attention modules: they need whole sequences (sequence parallel)
    attention = {n.rpartition(".")[0] for n, _, s in named if s in _STYLES}
    attention = {n for n in attention if type(base.get_submodule(n)).__name__.endswith("Attention")}
    if sequence_parallel:
        _check_sequence_parallel(base, named, attention)

    for name, module, style in named:
        if style == "replicated_with_grad_allreduce":
            for p in module.parameters():
                _sum_grad_over_ranks(p, group)
            continue
        parent_name, _, child = name.rpartition(".")
        cls, kw = _STYLES[style]
        in_attention = parent_name in attention
        # attention gets whole sequences: its q/k/v are plain column layers
        sp = sequence_parallel and not (in_attention and cls is ColumnParallelLinear)
        layer = cls.from_linear(module, group, sequence_parallel=sp, **kw)
        setattr(base.get_submodule(parent_name), child, layer)
        if sp and in_attention:  # o: [b, s, in / R] -> [s, b, in / R], the tokens seq first
            layer.register_forward_pre_hook(lambda m, args: (args[0].transpose(0, 1),))
    if sequence_parallel:
        _sequence_parallel_hooks(base, attention, group, R, rank)
    return model


def _generic(name: str) -> str:
    """``layers.3.mlp.up_proj`` -> ``layers.*.mlp.up_proj`` (the plan's keys)."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def _check_plan(named: list, config, R: int) -> None:
    """Raises before anything is changed: unsupported styles or modules, sizes not divisible
    by ``R``."""
    supported = {*_STYLES, "replicated_with_grad_allreduce"}
    bad = sorted({f"{_generic(n)}: {s!r}" for n, _, s in named if s not in supported})
    if bad:
        raise NotImplementedError(
            f"parallelize supports the plan styles {sorted(supported)}; the model's plan has "
            f"{', '.join(bad)}. Delete those entries from model.config.base_model_tp_plan "
            "to keep the modules whole, where that is exact"
        )
    for name, module, style in named:
        if style in _STYLES and not isinstance(module, nn.Linear):
            kind = type(module).__name__
            again = " (parallelized already)" if isinstance(module, _Sharded) else ""
            raise NotImplementedError(f"the plan makes {name} {style!r}, but it is a {kind}"
                                      f"{again}, not an nn.Linear")  # fmt: skip
    if any(style in ("colwise", "rowwise") for _, _, style in named):
        for field in _SPLIT_FIELDS:
            value = getattr(config, field, None)
            if isinstance(value, int) and value % R:
                raise ValueError(f"config.{field}={value} is not divisible by the "
                                 f"tensor-parallel size {R}")  # fmt: skip
    for name, module, style in named:
        if style in _STYLES:
            cls = _STYLES[style][0]
            what = "out_features" if cls is ColumnParallelLinear else "in_features"
            if getattr(module, what) % R:
                raise ValueError(f"{name}.{what}={getattr(module, what)} is not divisible by "
                                 f"the tensor-parallel size {R}")  # fmt: skip


def _check_sequence_parallel(base: nn.Module, named: list, attention: set) -> None:
    """Raises unless ``parallelize(sequence_parallel=True)`` is exact on ``base`` (its
    docstring): plain entries, the layers and final norm where expected, and nothing between
    the split and the gather but sharded linears, attention and norms (token-wise)."""
    plain = {"colwise", "rowwise", "replicated_with_grad_allreduce"}
    if any(style not in plain for _, _, style in named):
        raise NotImplementedError(
            "sequence_parallel covers plans of colwise, rowwise and "
            "replicated_with_grad_allreduce entries only (gathered outputs or split inputs "
            "would need whole tokens)"
        )
    layers, norm = getattr(base, "layers", None), getattr(base, "norm", None)
    if not isinstance(layers, nn.ModuleList) or not isinstance(norm, nn.Module) or not attention:
        raise NotImplementedError(
            f"sequence_parallel needs base_model.layers (an nn.ModuleList), base_model.norm "
            f"and attention modules named *Attention in the plan; {type(base).__name__} lacks "
            "one. Recipe: split the tokens after the embedding, gather them before each "
            "attention and after the last norm, sequence first for the row layers"
        )
    covered = {n for n, _, s in named if s in _STYLES} | attention
    for name, module in layers.named_modules(prefix="layers"):
        inside = any(name == c or name.startswith(c + ".") for c in covered)
        if not inside and next(module.parameters(recurse=False), None) is not None \
                and "Norm" not in type(module).__name__:  # fmt: skip
            raise NotImplementedError(
                f"sequence_parallel: {name} ({type(module).__name__}) would see this rank's "
                "tokens only, and is not a norm; only norms, attention and the plan's linears "
                "are known to be exact on token shards"
            )


def _sequence_parallel_hooks(base: nn.Module, attention: set, group, R: int, rank: int):
    """The layout hooks of ``parallelize(sequence_parallel=True)`` (its docstring)."""
    layers, norm = base.layers, base.norm

    def to_shards(x):  # [b, s, h] (replicated) -> this rank's [s / R, b, h]
        _split(x.shape[1], R, "the sequence length (sequence_parallel)")
        return _Scatter.apply(x.transpose(0, 1), group, R, rank, 0).contiguous()

    def to_whole(x):  # this rank's [s / R, b, h] -> [b, s, h]
        return _Gather.apply(x, group, R, rank, 0).transpose(0, 1)

    def hook(fn):  # a pre-hook replacing the hidden states, positional or keyword
        def pre(module, args, kwargs):
            if args:
                return (fn(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}

        return pre

    layers[0].register_forward_pre_hook(hook(to_shards), with_kwargs=True)
    for name in attention:
        base.get_submodule(name).register_forward_pre_hook(hook(to_whole), with_kwargs=True)
    norm.register_forward_pre_hook(hook(to_whole), with_kwargs=True)
    # replicated parameters between the split and the final norm see this rank's tokens only
    sharded = {p for m in base.modules() if isinstance(m, _Sharded) for p in m.parameters()}
    in_attention = {p for n in attention for p in base.get_submodule(n).parameters()}
    for p in layers.parameters():
        if p not in sharded and p not in in_attention:
            _sum_grad_over_ranks(p, group)


def _sum_grad_over_ranks(p: nn.Parameter, group) -> None:
    """Sums ``p``'s gradient of each backward pass over the ranks (a hook on the leaf, before
    it is accumulated into ``p.grad``): for a whole parameter each rank applies to its own
    part of the data only."""

    def hook(g):
        g = g.clone()
        dist.all_reduce(g, group=group)
        return g

    p.register_hook(hook)
