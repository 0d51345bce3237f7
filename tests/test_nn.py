"""``overlap.nn`` on 2 and 4 gloo ranks and on subgroups of 4 (the kernels in Triton's
interpreter): every layer variant's output and gradients (input, weight, bias) against float64
autograd of the unsharded ``nn.Linear`` it was cut from; column layers sharing their input
(``share_input``): the same results with one collective each way, their weights one tensor,
and still exact for calls that do not share an input, an input changed in place between the
siblings' calls (an inference tensor too) and a sibling frozen after sharing; world size 1
computes ``nn.Linear``; bad sizes, a non-Linear to ``from_linear`` and a layer made before the
process group raise."""

from __future__ import annotations

import contextlib
import copy
import itertools
import random
import time

import pytest
import torch
from _dist import mismatch, on_subgroups, spawn
from torch import nn

import overlap
from overlap.nn import ColumnParallelLinear, RowParallelLinear, share_input
from overlap.nn.layers import _products

TOL = 1e-5


def _layer_case(rank, R, seed, kind, kw, lead, group=None):
    """One layer of ``kind`` ("column" or "row") with options ``kw`` on ``x [*lead, in]``
    (sequence parallel: this rank's ``lead[0] / R`` rows of it); a failure message or None."""
    g = torch.Generator().manual_seed(seed)
    fin, fout = (48, 64) if kind == "column" else (64, 40)
    full = nn.Linear(fin, fout)
    with torch.no_grad():
        full.weight.copy_(torch.randn(fout, fin, generator=g))
        full.bias.copy_(torch.randn(fout, generator=g))
    x_full = torch.randn(*lead, fin, generator=g)
    g_full = torch.randn(*lead, fout, generator=g)  # the gradient of the whole output

    # float64 reference: the whole layer
    ref = nn.Linear(fin, fout).double()
    ref.load_state_dict(full.state_dict())
    xr = x_full.double().requires_grad_()
    yr = ref(xr)
    (yr * g_full.double()).sum().backward()

    sp = kw.get("sequence_parallel", False)
    T = lead[0] // R
    mine = slice(rank * T, (rank + 1) * T)  # this rank's tokens (sequence parallel)
    if kind == "column":
        layer = ColumnParallelLinear.from_linear(full, group=group, **kw)
        n = fout // R
        cols = slice(rank * n, (rank + 1) * n)
        x = (x_full[mine] if sp else x_full).clone().requires_grad_()
        y = layer(x)
        y_ref = yr if kw.get("gather_output") else yr[..., cols]
        g_mine = g_full if kw.get("gather_output") else g_full[..., cols]
        w_ref, b_ref = ref.weight.grad[cols], ref.bias.grad[cols]
        dx_ref = xr.grad[mine] if sp else xr.grad
    else:
        layer = RowParallelLinear.from_linear(full, group=group, **kw)
        n = fin // R
        cols = slice(rank * n, (rank + 1) * n)
        parallel = kw.get("input_is_parallel", True)
        x = (x_full[..., cols] if parallel else x_full).clone().requires_grad_()
        y = layer(x)
        y_ref = yr[mine] if sp else yr
        g_mine = g_full[mine] if sp else g_full
        w_ref, b_ref = ref.weight.grad[:, cols], ref.bias.grad
        dx_ref = xr.grad[..., cols] if parallel else xr.grad
    # each rank's loss is its part of <y_full, g_full> (all of it where the output is
    # replicated): the shards' gradients are then those of the whole layer
    (y * g_mine).sum().backward()
    name = f"{kind} {kw} lead={lead} rank={rank}"
    for what, got, want in (("y", y, y_ref), ("dx", x.grad, dx_ref),
                            ("dweight", layer.weight.grad, w_ref),
                            ("dbias", layer.bias.grad, b_ref)):  # fmt: skip
        if got is None or tuple(got.shape) != tuple(want.shape):
            return f"{name}: {what} has shape {None if got is None else tuple(got.shape)}, " \
                f"expected {tuple(want.shape)}"  # fmt: skip
        why = mismatch(got.detach(), want.detach(), TOL)
        if why:
            return f"{name}: {what}: {why}"
    return None


CASES = [
    ("column", {}),
    ("column", {"gather_output": True}),
    ("column", {"sequence_parallel": True}),
    ("row", {}),
    ("row", {"input_is_parallel": False}),
    ("row", {"sequence_parallel": True}),
]


def _layers(rank, R, seed, group=None):
    failures = []
    leads = ((8 * R, 6), (16 * R,)) if group is None else ((8 * R, 6),)  # [s, b] tokens, 2-D
    for i, (kind, kw) in enumerate(CASES):
        for j, lead in enumerate(leads):
            msg = _layer_case(rank, R, seed + 10 * i + j, kind, kw, lead, group)
            failures += [msg] if msg else []
    return failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_layers_match_the_unsharded_linear(world_size):
    spawn(_layers, world_size, random.randrange(1 << 30))


def _calls() -> int:
    """The library's op calls since the last count (``overlap.stats``), every path."""
    return sum(sum(hows.values()) for hows in overlap.stats(reset=True).values())


def _siblings_case(rank, R, seed, sp):
    """q/k/v-like column layers (with biases) sharing one input, against float64 autograd of
    the unsharded layers; a failure message or None."""
    g = torch.Generator().manual_seed(seed)
    fulls = [nn.Linear(24, n) for n in (8 * R, 4 * R, 4 * R)]
    for p in (p for f in fulls for p in f.parameters()):
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g))
    x_full = torch.randn(4 * R, 3, 24, generator=g)  # [s, b, h]
    gs = [torch.randn(4 * R, 3, f.out_features, generator=g) for f in fulls]
    refs = [copy.deepcopy(f).double() for f in fulls]
    xr = x_full.double().requires_grad_()
    sum((r(xr) * gi.double()).sum() for r, gi in zip(refs, gs, strict=True)).backward()
    layers = [ColumnParallelLinear.from_linear(f, sequence_parallel=sp) for f in fulls]
    weights = [layer.weight for layer in layers]
    share_input(*layers)
    name = f"share_input sp={sp} rank={rank}"
    fused = weights[0].data_ptr()
    for i, layer in enumerate(layers):
        if layer.weight is not weights[i]:
            return f"{name}: layer {i}'s weight is another Parameter"
        if layer.weight.data_ptr() != fused:
            return f"{name}: layer {i}'s weight is not next to the previous one"
        fused += layer.weight.numel() * layer.weight.element_size()
    T = x_full.shape[0] // R
    mine = slice(rank * T, (rank + 1) * T) if sp else slice(None)
    products = _products(layers, x_full[mine])  # (no bias: the layers' adds make a copy)
    if not sp and not all(y.is_contiguous() for y in products):  # one product per weight
        return f"{name}: products not contiguous: {[y.stride() for y in products]}"
    for step in range(2):  # (the second step: the products of the first were all taken)
        for layer in layers:
            layer.zero_grad()
        x = x_full[mine].clone().requires_grad_()
        _calls()
        ys = [layer(x) for layer in layers]
        loss = 0
        for y, layer, gi in zip(ys, layers, gs, strict=True):
            n = layer.weight.shape[0]
            loss = loss + (y * gi[..., rank * n : (rank + 1) * n]).sum()
        loss.backward()
        calls, want = _calls(), 2 if sp else 1  # sp: a gather, a reduce-scatter; else all-reduce
        if calls != want:
            return f"{name} step {step}: {calls} calls of the library's ops, expected {want}"
        for i, (y, layer, ref) in enumerate(zip(ys, layers, refs, strict=True)):
            n = layer.weight.shape[0]
            cols = slice(rank * n, (rank + 1) * n)
            for what, got, want in (("y", y, ref(xr)[..., cols]),
                                    ("dweight", layer.weight.grad, ref.weight.grad[cols]),
                                    ("dbias", layer.bias.grad, ref.bias.grad[cols])):  # fmt: skip
                why = mismatch(got.detach(), want.detach(), TOL)
                if why:
                    return f"{name} step {step}: layer {i} {what}: {why}"
        why = mismatch(x.grad, xr.grad[mine], TOL)
        if why:
            return f"{name} step {step}: dx: {why}"
    # not one input: layer 1 on another tensor while layer 2 has not taken its product
    other_full = x_full.flip(0)
    x, other = x_full[mine].clone(), other_full[mine].clone()
    calls = ((0, x, x_full), (1, other, other_full), (2, x, x_full), (2, other, other_full))
    ys = [layers[i](inp) for i, inp, _ in calls]
    for j, (y, (i, _, whole)) in enumerate(zip(ys, calls, strict=True)):
        n = layers[i].weight.shape[0]
        rows = slice(None) if sp else mine  # (sequence parallel: every token's output)
        want = refs[i](whole.double())[rows][..., rank * n : (rank + 1) * n]
        why = mismatch(y.detach(), want.detach(), TOL)
        if why:
            return f"{name}: call {j} of layers on two inputs: {why}"
    if layers[0].siblings.shared:
        return f"{name}: still sharing after calls on two inputs"
    return None


def _gathered(rank, R, seed) -> list[str]:
    """``parallelize``'s attention under sequence parallelism: column layers of the whole
    input take the products ``_Siblings.gather`` made (under ``inference_mode`` too, where the
    gathered input is made a normal tensor, with a version counter); called on another tensor
    with autograd on they raise (the input gradient would be summed over the ranks twice:
    their own all-reduce, then the gather's reduce-scatter), without autograd they compute
    it."""
    g = torch.Generator().manual_seed(seed)
    fulls = [nn.Linear(24, 4 * R) for _ in range(2)]
    with torch.no_grad():
        for p in (p for f in fulls for p in f.parameters()):
            p.copy_(torch.randn(p.shape, generator=g))
    x_full = torch.randn(4 * R, 3, 24, generator=g)  # [s, b, h]
    layers = [ColumnParallelLinear.from_linear(f) for f in fulls]
    share_input(*layers)
    x, n = x_full[rank * 4 : (rank + 1) * 4].clone(), 4
    wants = [f.double()(x_full.double().transpose(0, 1))[..., rank * n : (rank + 1) * n]
             for f in fulls]  # fmt: skip
    failures = []
    _calls()
    with torch.inference_mode():
        whole = layers[0].siblings.gather(x)
        ys = [layer(whole) for layer in layers]
    if _calls() != 1 or not layers[0].siblings.shared:  # the gather's; the layers took its
        failures.append("inference_mode: the layers did not take the gather's products")
    for y, want in zip(ys, wants, strict=True):
        why = mismatch(y, want, TOL)
        failures += [f"inference_mode: {why}"] if why else []
    whole = layers[0].siblings.gather(x.requires_grad_())
    try:
        layers[0](whole * 1)
        failures.append("a gathered sibling called on another tensor with autograd: no error")
    except RuntimeError as e:
        if "summed over the ranks twice" not in str(e):
            failures.append(f"unclear error: {e}")
    with torch.no_grad():
        why = mismatch(layers[1](whole * 1), wants[1], TOL)
    return failures + ([f"no_grad, another tensor: {why}"] if why else [])


def _siblings(rank, R, seed):
    failures = []
    for i, sp in enumerate((False, True)):
        msg = _siblings_case(rank, R, seed + i, sp)
        failures += [msg] if msg else []
    failures += _gathered(rank, R, seed + 2)
    layers = [ColumnParallelLinear(8, 2 * R), ColumnParallelLinear(6, 2 * R)]
    try:
        share_input(*layers)
        failures.append("in_features 8 and 6: no error")
    except ValueError as e:
        failures += [] if "in_features" in str(e) else [f"unclear error: {e}"]
    return failures


def test_share_input(world_size=2):
    spawn(_siblings, world_size, random.randrange(1 << 30))


def _fulls(R, seed, widths=(4, 2, 2)):
    """q/k/v-like ``nn.Linear(24, w R)`` with random weights and biases, and a generator."""
    g = torch.Generator().manual_seed(seed)
    fulls = [nn.Linear(24, w * R) for w in widths]
    with torch.no_grad():
        for p in (p for f in fulls for p in f.parameters()):
            p.copy_(torch.randn(p.shape, generator=g))
    return fulls, g


MODES = {
    "autograd": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
}


def _changed_in_place(rank, R, seed) -> list[str]:
    """Siblings sharing an input: one called, the input changed in place, the next ones
    called: theirs are products of the changed input (eager, with and without autograd and
    under ``inference_mode``, whose tensors have no version counter; with and without
    sequence parallelism; and the gathered input of ``_Siblings.gather``), against float64."""
    failures = []
    for sp, mode in itertools.product((False, True), MODES):
        seed += 1
        fulls, g = _fulls(R, seed)
        refs = [copy.deepcopy(f).double() for f in fulls]
        layers = [ColumnParallelLinear.from_linear(f, sequence_parallel=sp) for f in fulls]
        share_input(*layers)
        x_full = torch.randn(4 * R, 3, 24, generator=g)  # [s, b, h]
        gs = [torch.randn(4 * R, 3, f.out_features, generator=g) for f in fulls]
        mine = slice(rank * 4, (rank + 1) * 4) if sp else slice(None)
        name = f"sp={sp} {mode} rank={rank}"
        with MODES[mode]():  # (x made inside: under inference_mode an inference tensor)
            leaf = x_full[mine].clone().requires_grad_(mode == "autograd")
            x = leaf * 1 if mode == "autograd" else leaf  # (a leaf needing grad: no mul_)
            if x.is_inference() != (mode == "inference_mode"):
                return [f"{name}: x.is_inference() is {x.is_inference()}: the case is void"]
            ys = [layers[0](x)]
            x.mul_(2)
            ys += [layer(x) for layer in layers[1:]]
        xr = x_full.double().requires_grad_()
        loss = 0
        for i, (y, layer, ref) in enumerate(zip(ys, layers, refs, strict=True)):
            n = layer.weight.shape[0]
            cols = slice(rank * n, (rank + 1) * n)  # (sp: every token's output, its columns)
            want = ref(xr * (1 if i == 0 else 2))
            why = mismatch(y.detach(), want.detach()[..., cols], TOL)
            failures += [f"{name}: layer {i} after x.mul_(2): {why}"] if why else []
            if i:  # (layer 0's product used x before the change: no backward through it)
                loss = loss + (y * gs[i][..., cols]).sum()
                (want * gs[i].double()).sum().backward()
        if mode != "autograd" or failures:
            continue
        loss.backward()
        for i, (layer, ref) in enumerate(zip(layers[1:], refs[1:], strict=True), 1):
            n = layer.weight.shape[0]
            why = mismatch(layer.weight.grad, ref.weight.grad[rank * n : (rank + 1) * n], TOL)
            failures += [f"{name}: layer {i} dweight: {why}"] if why else []
        why = mismatch(leaf.grad, xr.grad[mine], TOL)
        failures += [f"{name}: dx: {why}"] if why else []
    for mode in ("no_grad", "inference_mode"):  # attention's gathered input (parallelize)
        fulls, g = _fulls(R, seed + 1, (2, 2))
        layers = [ColumnParallelLinear.from_linear(f) for f in fulls]
        share_input(*layers)
        x_full = torch.randn(4 * R, 3, 24, generator=g)  # [s, b, h]
        with MODES[mode]():
            whole = layers[0].siblings.gather(x_full[rank * 4 : (rank + 1) * 4].clone())
            ys = [layers[0](whole)]
            whole.mul_(2)
            ys.append(layers[1](whole))
        for i, (y, f) in enumerate(zip(ys, fulls, strict=True)):
            want = f.double()(x_full.double().transpose(0, 1) * (1 if i == 0 else 2))
            why = mismatch(y, want[..., rank * 2 : (rank + 1) * 2], TOL)
            failures += [f"gathered, {mode}: layer {i} after whole.mul_(2): {why}"] if why else []
    return failures


def test_share_input_after_an_in_place_change():
    spawn(_changed_in_place, 2, random.randrange(1 << 30))


def _frozen_after_sharing(rank, R, seed) -> list[str]:
    """Siblings sharing an input, one of them frozen after ``share_input`` (then another, then
    none): the trained ones' weight gradients, every bias's and the input's match float64
    autograd; the frozen weight gets none (with and without sequence parallelism)."""
    failures = []
    for sp in (True, False):
        fulls, g = _fulls(R, seed + sp)
        refs = [copy.deepcopy(f).double() for f in fulls]
        layers = [ColumnParallelLinear.from_linear(f, sequence_parallel=sp) for f in fulls]
        share_input(*layers)
        x_full = torch.randn(4 * R, 3, 24, generator=g)  # [s, b, h]
        gs = [torch.randn(4 * R, 3, f.out_features, generator=g) for f in fulls]
        xr = x_full.double().requires_grad_()
        sum((r(xr) * gi.double()).sum() for r, gi in zip(refs, gs, strict=True)).backward()
        mine = slice(rank * 4, (rank + 1) * 4) if sp else slice(None)
        for frozen in (1, 0, None):  # k, then q, then none
            for i, layer in enumerate(layers):
                layer.zero_grad(set_to_none=True)
                layer.weight.requires_grad_(i != frozen)
            x = x_full[mine].clone().requires_grad_()
            loss = 0
            for layer, gi in zip(layers, gs, strict=True):
                n = layer.weight.shape[0]
                loss = loss + (layer(x) * gi[..., rank * n : (rank + 1) * n]).sum()
            loss.backward()
            name = f"sp={sp} layer {frozen} frozen, rank={rank}"
            for i, (layer, ref) in enumerate(zip(layers, refs, strict=True)):
                cols = slice(rank * layer.weight.shape[0], (rank + 1) * layer.weight.shape[0])
                if i == frozen:
                    if layer.weight.grad is not None:
                        failures.append(f"{name}: the frozen weight has a gradient")
                    pairs = (("dbias", layer.bias.grad, ref.bias.grad[cols]),)
                else:
                    pairs = (("dweight", layer.weight.grad, ref.weight.grad[cols]),
                             ("dbias", layer.bias.grad, ref.bias.grad[cols]))  # fmt: skip
                for what, got, want in pairs:
                    why = "None" if got is None else mismatch(got, want, TOL)
                    failures += [f"{name}: layer {i} {what}: {why}"] if why else []
            why = mismatch(x.grad, xr.grad[mine], TOL)
            failures += [f"{name}: dx: {why}"] if why else []
    return failures


def test_share_input_with_a_sibling_frozen_after_sharing():
    spawn(_frozen_after_sharing, 2, random.randrange(1 << 30))


def test_layers_on_subgroups_of_four_ranks():
    """Every layer variant, forward and backward, on subgroups whose ranks differ from the
    global ones (``_dist.SUBGROUPS``): the shards, gathers and scatters by group rank."""
    spawn(on_subgroups, 4, _layers, random.randrange(1 << 30))


def test_world_size_one_computes_nn_linear():
    full = nn.Linear(12, 20)
    x = torch.randn(3, 5, 12)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        layer = cls.from_linear(full)
        torch.testing.assert_close(layer(x), full(x))
        assert not isinstance(layer, nn.Linear)  # as the module docstring says


def test_from_linear_keeps_requires_grad():
    full = nn.Linear(4, 6).requires_grad_(False)
    full.bias.requires_grad_(True)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        layer = cls.from_linear(full)
        assert (layer.weight.requires_grad, layer.bias.requires_grad) == (False, True), cls


def test_from_linear_of_a_non_linear():
    for cls in (ColumnParallelLinear, RowParallelLinear):
        with pytest.raises(TypeError, match="linear must be a torch.nn.Linear, got Conv1d"):
            cls.from_linear(nn.Conv1d(4, 4, 1))


def _made_before_the_group(rank, R):
    """Layers made with no process group, called once the default group has ``R`` ranks."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    dist.destroy_process_group()
    # every rank has closed the old group's connections before any opens the new one's (a CI
    # run once had gloo's connectFullMesh refused: "Connection closed by peer")
    store.add("destroyed", 1)
    while store.add("destroyed", 0) < R:
        time.sleep(0.01)
    layers = [ColumnParallelLinear(8, 8), RowParallelLinear(8, 8)]
    dist.init_process_group("gloo", store=dist.PrefixStore("again", store), rank=rank,
                            world_size=R)  # fmt: skip
    failures = []
    for layer in layers:
        try:
            layer(torch.randn(2, 8))
            failures.append(f"{type(layer).__name__}: no error")
        except RuntimeError as e:
            if "before torch.distributed.init_process_group" not in str(e):
                failures.append(f"{type(layer).__name__}: unclear error: {e}")
    return failures


def test_layer_made_before_init_process_group_raises():
    spawn(_made_before_the_group, 2)


def test_group_of_the_wrong_type():
    for cls in (ColumnParallelLinear, RowParallelLinear):
        with pytest.raises(TypeError, match="group must be"):
            cls(8, 8, group="tp")


def _bad_sizes(rank, R):
    failures = []
    for make, what in ((lambda: ColumnParallelLinear(8, 7), "out_features"),
                       (lambda: RowParallelLinear(7, 8), "in_features")):  # fmt: skip
        try:
            make()
            failures.append(f"{what} not divisible: no error")
        except ValueError as e:
            failures += [] if what in str(e) else [f"unclear error: {e}"]
    layer = RowParallelLinear(8, 8, sequence_parallel=True)
    try:
        layer(torch.randn(3, 4))
        failures.append("3 tokens on 2 ranks: no error")
    except ValueError as e:
        failures += [] if "dim 0" in str(e) else [f"unclear error: {e}"]
    import torch.distributed as dist

    only_0 = dist.new_group([0])  # every rank makes it; rank 1 is not in it
    for cls in (ColumnParallelLinear, RowParallelLinear):
        try:
            cls(8, 8, group=only_0)
            failures += [f"{cls.__name__}: rank 1 outside the group: no error"] if rank else []
        except ValueError as e:
            if not rank or "not a member" not in str(e):
                failures.append(f"{cls.__name__} rank {rank}: {e}")
    return failures


def test_sizes_not_divisible_by_the_world_size():
    spawn(_bad_sizes, 2)
