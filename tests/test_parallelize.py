"""``overlap.nn.parallelize`` on 2 gloo ranks (the kernels in Triton's interpreter): tiny
Llama (with biases), Qwen3 (q/k norms: ``replicated_with_grad_allreduce``), Gemma (tied
embeddings) and Phi3 (fused projections: ``colwise_gather_output``, ``rowwise_split_input``)
built from their configs with fresh random fp32 weights, with and without sequence
parallelism, against the unsharded model in float64 on the same data: logits, and the
gradient of every parameter (a shard's against its rows or columns of the whole model's);
Llama with sequence parallelism on subgroups of 4 ranks too, and under
``torch.compile(fullgraph=True)``. Bad configs and plans raise before the model changes;
world size 1 is a no-op. Skipped without ``transformers``."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from _dist import mismatch, on_subgroups, spawn
from torch import nn

import overlap
from overlap.nn import ColumnParallelLinear, RowParallelLinear, parallelize

transformers = pytest.importorskip("transformers")

# ||out - ref|| / ||ref|| of the fp32 model against float64: mostly under 1e-5, where the
# unsharded fp32 model's own error reaches 2.4e-6; the q/k projections' small gradients reached
# 2.9e-5 once (CI, 2026-11-27), so each gradient is also allowed 10x the fp32 model's own error
TOL = 2e-5
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, num_hidden_layers=2, vocab_size=128)  # fmt: skip
FAMILIES = {  # config class, model class, extra config fields, column and row layers per layer
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True},
              (5, 2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, (5, 2)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}, (5, 2)),
    # fused qkv and gate_up: colwise_gather_output, rowwise_split_input
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}, (2, 2)),
}  # fmt: skip


def _tiny(family: str, seed: int, **fields) -> nn.Module:
    """A tiny ``*ForCausalLM`` of ``family`` with every parameter drawn from ``seed``."""
    config_cls, model_cls, extra, _ = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**TINY, **extra, **fields})
    model = getattr(transformers, model_cls)(config).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # not the init's 0.02 and ones: every weight and norm matters
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def _shard_of(model: nn.Module, name: str, whole: torch.Tensor, rank: int, R: int):
    """What parameter ``name`` of the parallelized ``model`` holds of ``whole`` on ``rank``."""
    owner = model.get_submodule(name.rpartition(".")[0])
    if isinstance(owner, ColumnParallelLinear):
        dim = 0
    elif isinstance(owner, RowParallelLinear) and name.endswith("weight"):
        dim = 1
    else:
        return whole
    n = whole.shape[dim] // R
    return whole.narrow(dim, rank * n, n)


def _family_case(rank: int, R: int, family: str, sp: bool, seed: int, group=None,
                 compiled: bool = False, then: str | None = None) -> list[str]:  # fmt: skip
    """``compiled``: the parallelized model runs under ``torch.compile(fullgraph=True)``;
    ``then``: what happens to it first: ``"deepcopy"`` (the copy runs), ``"assign"`` (its
    state loaded into another parallelized model with ``assign=True``, which runs), ``"frozen"``
    (every parameter frozen before ``parallelize``, trained after): new ``Parameter`` objects,
    or ones that had no gradient when parallelized, still get theirs summed over the ranks."""
    ref = _tiny(family, seed)
    model = copy.deepcopy(ref).requires_grad_(then != "frozen")
    model = parallelize(model, group=group, sequence_parallel=sp).requires_grad_(True)
    if then == "deepcopy":
        model = copy.deepcopy(model)
    elif then == "assign":
        other = parallelize(_tiny(family, seed + 5), group=group, sequence_parallel=sp)
        other.load_state_dict(model.state_dict(), assign=True)
        model = other
    run = torch.compile(model, fullgraph=True) if compiled else model
    ref32 = copy.deepcopy(ref)  # the unsharded model in fp32: the floor of a gradient's error
    ref.double()
    name = f"{family} sequence_parallel={sp} compiled={compiled} then={then} rank={rank}"
    layers = ref.config.num_hidden_layers
    kinds = [type(m) for m in model.modules()]
    counts = (kinds.count(ColumnParallelLinear), kinds.count(RowParallelLinear))
    expected = tuple(layers * n for n in FAMILIES[family][3])
    if counts != expected:
        return [f"{name}: {counts} column and row layers, expected {expected}"]
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, ref.config.vocab_size, (2, 8), generator=g)  # [b, s]
    weights = torch.randn(2, 8, ref.config.vocab_size, generator=g)  # d loss / d logits
    failures = []
    logits_ref = ref(ids).logits
    overlap.stats(reset=True)
    logits = run(ids).logits
    why = mismatch(logits.detach(), logits_ref.detach(), TOL)
    failures += [f"{name}: logits: {why}"] if why else []
    (logits_ref * weights.double()).sum().backward()
    (logits * weights).sum().backward()
    (ref32(ids).logits * weights).sum().backward()
    if family != "phi3":  # q/k/v share one input and gate/up another (share_input): per
        # layer, without sequence parallelism o and down all-reduce and the two groups' input
        # gradients are all-reduced; with it, each of the four also has its mirror op
        calls = sum(sum(h.values()) for h in overlap.stats(reset=True).values())
        if calls != layers * (8 if sp else 4):
            failures.append(f"{name}: {calls} calls of the library's ops in a step, expected "
                            f"{layers * (8 if sp else 4)}")  # fmt: skip
    grads_ref, grads32 = dict(ref.named_parameters()), dict(ref32.named_parameters())
    for pname, p in model.named_parameters():
        want = _shard_of(model, pname, grads_ref[pname].grad, rank, R)
        if p.grad is None or p.grad.shape != want.shape:
            failures.append(f"{name}: {pname}.grad is {None if p.grad is None else p.grad.shape}"
                            f", expected {tuple(want.shape)}")  # fmt: skip
            continue
        # a gradient that cancels (k_proj's bias: rotary keeps it from vanishing, as softmax's
        # shift invariance would) has a large relative error in fp32 torch too: allow 10x that
        own = _shard_of(model, pname, grads32[pname].grad, rank, R)
        floor = ((own.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
        why = mismatch(p.grad, want, max(TOL, 10 * floor))
        failures += [f"{name}: {pname}.grad: {why}"] if why else []
    if not compiled:  # (inference tensors have no version counter: share_input's products)
        with torch.inference_mode():
            why = mismatch(run(ids).logits, logits_ref.detach(), TOL)
        failures += [f"{name}: logits under inference_mode: {why}"] if why else []
    return failures


# every family once, sequence parallelism on and off (the column and row layers' own options
# are tested in test_nn.py; each case here costs 4-13 s in the interpreter on 2 cores)
CASES = [("llama", False), ("llama", True), ("qwen3", True), ("gemma", False), ("phi3", False)]


def _families(rank: int, R: int, seed: int) -> list[str]:
    failures = []
    for i, (family, sp) in enumerate(CASES):
        failures += _family_case(rank, R, family, sp, seed + 10 * i)
    return failures


def test_parallelize_matches_the_unsharded_model():
    spawn(_families, 2, random.randrange(1 << 30))


def _copied(rank: int, R: int, seed: int) -> list[str]:
    failures = []
    cases = [("qwen3", False, "deepcopy"), ("llama", True, "deepcopy"), ("qwen3", True, "assign"),
             ("qwen3", True, "frozen")]  # fmt: skip
    for i, (family, sp, then) in enumerate(cases):
        failures += _family_case(rank, R, family, sp, seed + 10 * i, then=then)
    return failures


def test_parallelize_after_deepcopy_assign_and_freezing():
    """The gradients summed over the ranks (Qwen3's q/k norms; with sequence parallelism
    every norm) after ``copy.deepcopy``, ``load_state_dict(assign=True)`` and a model frozen
    when parallelized; the deep copy's attention gathers with its own siblings."""
    spawn(_copied, 2, random.randrange(1 << 30))


def _compiled(rank: int, R: int, seed: int) -> list[str]:
    torch._dynamo.config.cache_size_limit = 64
    return _family_case(rank, R, "llama", True, seed, compiled=True)


def test_parallelize_compiles_fullgraph():
    """A parallelized transformers Llama with sequence parallelism under
    ``torch.compile(fullgraph=True)`` (inductor; fullgraph raises on a graph break): the same
    logits, gradients and calls as above."""
    spawn(_compiled, 2, random.randrange(1 << 30))


def _on_subgroup(rank: int, R: int, seed: int, group) -> list[str]:
    return _family_case(rank, R, "llama", True, seed, group)


def test_parallelize_on_subgroups_of_four_ranks():
    """``parallelize(group=...)`` (Llama with sequence parallelism: every layer kind and the
    hooks that split and gather by rank) on subgroups whose ranks differ from the global ones
    (``_dist.SUBGROUPS``)."""
    spawn(on_subgroups, 4, _on_subgroup, random.randrange(1 << 30))


def _expect(failures: list, exc: type, match: str, fn) -> None:
    """Appends to ``failures`` unless ``fn()`` raises ``exc`` with ``match`` in its text."""
    try:
        fn()
        failures.append(f"no {exc.__name__} ({match!r})")
    except exc as e:
        failures += [] if match in str(e) else [f"unclear {exc.__name__}: {e}"]


def _bad(rank: int, R: int) -> list[str]:
    failures = []
    for field, fields in (
        (
            "num_attention_heads",
            {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1},
        ),
        ("num_key_value_heads", {"num_key_value_heads": 1}),
        ("intermediate_size", {"intermediate_size": 127}),
    ):
        model = _tiny("llama", 0, **fields)
        value = fields[field]
        msg = f"config.{field}={value} is not divisible by the tensor-parallel size {R}"
        _expect(failures, ValueError, msg, lambda m=model: parallelize(m))
        if not isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear):
            failures.append(f"{field}: the model changed before the error")
    model = _tiny("llama", 0)
    plan = model.config.base_model_tp_plan
    model.config.base_model_tp_plan = {**plan, "embed_tokens": "embedding_rowwise"}
    _expect(failures, NotImplementedError, "embed_tokens: 'embedding_rowwise'",
            lambda: parallelize(model))  # fmt: skip
    model.config.base_model_tp_plan = {"norm": "colwise"}
    _expect(failures, NotImplementedError, "not an nn.Linear", lambda: parallelize(model))
    model.config.base_model_tp_plan = {}
    _expect(failures, ValueError, "base_model_tp_plan is empty", lambda: parallelize(model))
    model = _tiny("phi3", 0)
    _expect(failures, NotImplementedError, "sequence_parallel covers",
            lambda: parallelize(model, sequence_parallel=True))  # fmt: skip
    model = _tiny("llama", 0)
    model.config.base_model_tp_plan = {k: v for k, v in plan.items() if "self_attn" in k}
    _expect(failures, NotImplementedError, "layers.0.mlp.gate_proj (Linear) would see",
            lambda: parallelize(model, sequence_parallel=True))  # fmt: skip
    if not isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear):
        failures.append("sequence_parallel: the model changed before the error")
    model = parallelize(_tiny("llama", 0), sequence_parallel=True)
    _expect(failures, ValueError, "sequence length",
            lambda: model(torch.zeros(1, 5, dtype=torch.long)))  # fmt: skip
    _expect(failures, NotImplementedError, "parallelized already", lambda: parallelize(model))
    return failures


def test_bad_configs_and_plans_raise_before_changing_the_model():
    spawn(_bad, 2)


def test_world_size_one_is_a_no_op():
    model = _tiny("llama", 0)
    assert parallelize(model, sequence_parallel=True) is model
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    with pytest.raises(TypeError, match="model must be"):
        parallelize(nn.Linear(4, 4))
