"""``parallelize``: a Hugging Face ``transformers`` model sharded in place by its own
tensor-parallel plan (``config.base_model_tp_plan``) onto the layers of ``layers.py``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..context import check_group
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    _Gather,
    _rank_size,
    _Scatter,
    _Sharded,
    _split,
    share_input,
)

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
    once, overlapped, down reduce-scatters overlapped, norms' gradients summed over the
    ranks); attention needs whole sequences, so a pre-hook gathers its input once and makes
    q/k/v's products in the same overlapped ``all_gather_matmul`` (q/k/v are column layers
    of the whole input that take those products), and its o projection reduce-scatters
    overlapped. Hooks on the base model do the layout: the first decoder layer's input is
    split, each attention's input gathered, o's input made sequence first, the final
    ``norm``'s input gathered back to ``[b, s, h]``. That needs ``base_model.layers`` and
    ``base_model.norm``, attention modules whose class name ends in ``Attention`` holding the
    q/k/v/o of the plan (q/k/v of one input width), plain
    ``colwise``/``rowwise``/``replicated_with_grad_allreduce`` entries only, and in the layers
    no parameters outside the plan's linears and the attention but norms'; other models raise
    ``NotImplementedError``. Hidden states returned by ``output_hidden_states`` are the
    ``[s / R, b, h]`` shards. With autograd on, attention's q/k/v must be called on the
    input its module was given (else ``RuntimeError``: their input gradient would be summed
    twice).

    Gradients summed over the ranks are summed by hooks on the parameters, which a forward
    pre-hook of the base model gives again to each parameter requiring grad that lacks one: a
    parameter frozen here and trained later, and the new parameters of ``copy.deepcopy`` or
    ``load_state_dict(..., assign=True)``. The layers keep each ``nn.Linear``'s
    ``requires_grad``.

    Column layers of one module that take inputs of one width (q/k/v, gate/up) share their
    input (``share_input``): one gather of it (sequence parallel), and one collective for
    their input gradient.

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

    siblings: dict[tuple[str, int], list[ColumnParallelLinear]] = {}
    summed = _SummedGrads(group)
    for name, module, style in named:
        if style == "replicated_with_grad_allreduce":
            summed.add(module.modules())
            continue
        parent_name, _, child = name.rpartition(".")
        cls, kw = _STYLES[style]
        in_attention = parent_name in attention
        # attention gets whole sequences: its q/k/v are column layers of the whole input,
        # which a pre-hook gathers once for all of them (_sequence_parallel_hooks)
        sp = sequence_parallel and not (in_attention and cls is ColumnParallelLinear)
        layer = cls.from_linear(module, group, sequence_parallel=sp, **kw)
        setattr(base.get_submodule(parent_name), child, layer)
        if sp and in_attention:  # o: [b, s, in / R] -> [s, b, in / R], the tokens seq first
            layer.register_forward_pre_hook(lambda m, args: (args[0].transpose(0, 1),))
        if style == "colwise":  # a module's column layers of one width share its input
            siblings.setdefault((parent_name, layer.in_features), []).append(layer)
    for (parent_name, _), layers in siblings.items():
        if len(layers) > 1 or parent_name in attention:
            share_input(*layers)
    if sequence_parallel:
        _sequence_parallel_hooks(base, attention, summed, group, R, rank)
    summed(base, ())
    base.register_forward_pre_hook(summed)
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
    for a in attention:
        widths = {m.in_features for n, m, s in named if s == "colwise" and n.startswith(a + ".")}
        if len(widths) != 1:
            raise NotImplementedError(
                f"sequence_parallel: {a}'s column layers take inputs of widths "
                f"{sorted(widths)}; one input width (the hidden size) is needed"
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


def _sequence_parallel_hooks(base: nn.Module, attention: set, summed, group, R: int, rank: int):
    """The layout hooks of ``parallelize(sequence_parallel=True)`` (its docstring); the
    parameters that see this rank's tokens only join ``summed``."""
    layers, norm = base.layers, base.norm

    def to_shards(x):  # [b, s, h] (replicated) -> this rank's [s / R, b, h]
        _split(x.shape[1], R, "the sequence length (sequence_parallel)")
        return _Scatter.apply(x.transpose(0, 1), group, R, rank, 0).contiguous()

    def to_whole(x):  # this rank's [s / R, b, h] -> [b, s, h]
        return _Gather.apply(x, group, R, rank, 0).transpose(0, 1)

    layers[0].register_forward_pre_hook(_HiddenStates(to_shards), with_kwargs=True)
    for name in attention:  # q/k/v's one gather: their products made with the whole input
        module = base.get_submodule(name)
        column = next(m for m in module.children() if isinstance(m, ColumnParallelLinear))
        module.register_forward_pre_hook(_HiddenStates(column.siblings.gather), with_kwargs=True)
    norm.register_forward_pre_hook(_HiddenStates(to_whole), with_kwargs=True)
    # replicated parameters between the split and the final norm see this rank's tokens only
    inside = {m for n in attention for m in base.get_submodule(n).modules()}
    summed.add(m for m in layers.modules() if not isinstance(m, _Sharded) and m not in inside)


class _HiddenStates:
    """A forward pre-hook replacing a module's hidden states (positional or keyword) by ``fn``
    of them. An object, not a closure: ``copy.deepcopy`` of the model copies it, and so binds
    a bound method ``fn`` (the siblings' ``gather``) to the copy's siblings."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, module, args, kwargs):
        if args:
            return (self.fn(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self.fn(kwargs["hidden_states"])}


class _SumOverRanks:
    """A gradient hook on a leaf: the gradient of each backward pass summed over the ranks
    before it is accumulated into ``.grad`` (each rank applies a whole parameter to its own
    part of the data only)."""

    def __init__(self, group) -> None:
        self.group = group

    def __call__(self, g):
        g = g.clone()
        dist.all_reduce(g, group=self.group)
        return g


class _SummedGrads:
    """The parameters whose gradients ``parallelize`` sums over the ranks, by module and
    name (``add``); called (a forward pre-hook of the base model, and once by
    ``parallelize``), it gives each of them that requires grad and has no ``_SumOverRanks``
    hook one: tensor hooks belong to a ``Parameter`` object, and ``copy.deepcopy`` and
    ``load_state_dict(assign=True)`` make new ones, and a frozen parameter takes no hook.
    Not while compiling (Dynamo traces no hook registration; the eager calls gave them)."""

    def __init__(self, group) -> None:
        self.group, self.named = group, []

    def add(self, modules) -> None:
        """The parameters of ``modules`` (each module's own, not its children's)."""
        self.named += [(m, n) for m in modules for n, _ in m.named_parameters(recurse=False)]

    def __call__(self, module, args) -> None:
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        for owner, name in self.named:
            p = getattr(owner, name)
            if (
                p is not None
                and p.requires_grad
                and not any(
                    isinstance(h, _SumOverRanks) for h in (p._backward_hooks or {}).values()
                )
            ):
                p.register_hook(_SumOverRanks(self.group))
