"""Only ``dx`` and only ``dw``: every differentiable op and both ``overlap.nn`` layers on 2 gloo
ranks with the input frozen and the weight trainable (a model whose lower layers are frozen),
the weight frozen and the input trainable (fine-tuning adapters, LoRA), and both trainable,
against float64 autograd of the plain computation over every rank's inputs. A frozen tensor
must get no gradient (None), a trainable one the right one (autograd's ``need_dx`` /
``need_dw`` masks, ``overlap.ops.dense._backward`` and its siblings)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from _dist import mismatch, spawn
from torch import nn

import overlap
from overlap.nn import ColumnParallelLinear, RowParallelLinear

TOL = 1e-5  # fp32 (the interpreter's exact fp32 dot) against float64
K, N, E = 40, 48, 3  # inner and output features; experts per rank (MoE)
SPLITS = [[40, 24], [13, 51]]  # rows rank a sends to rank b (uneven exchanges)


def _masks(names: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Each leaf alone trainable, then all of them."""
    return [(n,) for n in names] + [names]


def _check(rank, R, name, leaves, forward, reference, seed, replicated=False) -> list[str]:
    """``forward`` on this rank with each mask of trainable ``leaves``, against float64
    autograd of ``reference``.

    ``leaves``: name -> every rank's fp32 input (drawn alike on every rank).
    ``forward(mine)``: this rank's outputs (a tuple) from ``mine``, name -> this rank's leaf.
    ``reference(every)``: every rank's outputs (a list of tuples) from float64 leaves.
    The loss is the sum over ranks of ``<y_r, g_r>``; a ``replicated`` result (all-reduce) is
    one tensor seen by every rank: one ``g``, counted once."""
    every = {k: [t.double().requires_grad_() for t in v] for k, v in leaves.items()}
    Y = reference(every)
    gen = torch.Generator().manual_seed(seed)
    G = [[torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in Y[r]] for r in range(R)]
    if replicated:
        G = [G[0]] * R
    terms = range(1) if replicated else range(R)
    sum((y * g).sum() for r in terms for y, g in zip(Y[r], G[r], strict=True)).backward()
    failures = []
    for mask in _masks(tuple(leaves)):
        case = f"{name} trainable={'+'.join(mask)} rank={rank}"
        mine = {k: v[rank].clone().requires_grad_(k in mask) for k, v in leaves.items()}
        try:
            ys = forward(mine)
            sum((y.reshape(g.shape) * g.float()).sum() for y, g in zip(ys, G[rank], strict=True))\
                .backward()  # fmt: skip
        except Exception as e:  # the peer fails its own way (or waits: gloo's timeout)
            failures.append(f"{case}: {type(e).__name__}: {e}")
            continue
        for i, (y, want) in enumerate(zip(ys, Y[rank], strict=True)):
            why = mismatch(y.detach().reshape(want.shape), want.detach(), TOL)
            failures += [f"{case}: output {i}: {why}"] if why else []
        for k, t in mine.items():
            want = every[k][rank].grad
            if k not in mask:
                failures += [f"{case}: frozen {k} got a gradient"] if t.grad is not None else []
            elif t.grad is None:
                failures.append(f"{case}: trainable {k} got no gradient")
            else:
                why = mismatch(t.grad.reshape(want.shape), want, TOL)
                failures += [f"{case}: d{k}: {why}"] if why else []
    return failures


def _draw(R, seed, **shapes) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {k: [torch.randn(*s, generator=g) for _ in range(R)] for k, s in shapes.items()}


def _exchange(Y: list[torch.Tensor], R: int) -> list[torch.Tensor]:
    """``all_to_all_single`` with ``SPLITS`` of every rank's rows ``Y[a]``: rank ``b`` gets
    block ``b`` of every rank, in rank order."""
    at = [[sum(SPLITS[a][:b]) for b in range(R + 1)] for a in range(R)]
    return [torch.cat([Y[a][at[a][b] : at[a][b + 1]] for a in range(R)]) for b in range(R)]


def _per_expert(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``y[i] = x[i] @ w[ids[i]]``."""
    return torch.einsum("ik,ikn->in", x, w[ids])


# -- matmul_collective --------------------------------------------------------------------------
DENSE = [  # (collective, op, split sizes, x's leading dims)
    ("all_reduce", "sum", False, (2, 32)),
    ("all_reduce", "avg", False, (64,)),
    ("reduce_scatter", "sum", False, (2, 32)),
    ("reduce_scatter", "avg", False, (64,)),
    ("all_to_all", "sum", False, (2, 32)),
    ("all_to_all", "sum", True, (64,)),
]


def _dense(rank, R, seed):
    failures = []
    for i, (coll, op, split, lead) in enumerate(DENSE):
        leaves = _draw(R, seed + i, x=(*lead, K), weight=(N, K))
        receives = [SPLITS[a][rank] for a in range(R)]
        kw = dict(input_split_sizes=SPLITS[rank], output_split_sizes=receives) if split else {}
        scale = 1 / R if op == "avg" else 1

        def forward(m, coll=coll, op=op, kw=kw):
            return (overlap.matmul_collective(m["x"], m["weight"].t(), coll, op=op, chunks=2,
                                              **kw),)  # fmt: skip

        def reference(e, coll=coll, split=split, scale=scale):
            P = [e["x"][s].reshape(-1, K) @ e["weight"][s].t() for s in range(R)]
            Mr = P[0].shape[0] // R
            if coll == "all_reduce":
                return [(sum(P) * scale,)] * R
            if coll == "reduce_scatter":
                return [(sum(P)[r * Mr : (r + 1) * Mr] * scale,) for r in range(R)]
            if split:
                return [(y,) for y in _exchange(P, R)]
            return [(torch.cat([p[r * Mr : (r + 1) * Mr] for p in P]),) for r in range(R)]

        name = f"matmul_collective {coll} op={op} splits={split} x={lead}"
        failures += _check(rank, R, name, leaves, forward, reference, seed + 100 + i,
                           replicated=coll == "all_reduce")  # fmt: skip
    return failures


# -- all_gather_matmul --------------------------------------------------------------------------
def _gather(rank, R, seed):
    failures = []
    for i, (gathered, use_full) in enumerate(((False, False), (True, False), (True, True))):
        leaves = _draw(R, seed + i, x=(2, 16, K), weight=(N, K))

        def forward(m, gathered=gathered, use_full=use_full):
            out = overlap.all_gather_matmul(m["x"], m["weight"].t(), chunks=2,
                                            return_gathered=gathered)  # fmt: skip
            if not gathered:
                return (out,)
            return out if use_full else out[:1]

        def reference(e, use_full=use_full):
            full = torch.cat([x.reshape(-1, K) for x in e["x"]])
            return [(full @ e["weight"][r].t(), full)[: 1 + use_full] for r in range(R)]

        name = f"all_gather_matmul return_gathered={gathered} x_full used={use_full}"
        failures += _check(rank, R, name, leaves, forward, reference, seed + 100 + i)
    return failures


# -- the MoE combine and dispatch ---------------------------------------------------------------
def _moe(rank, R, seed):
    g = torch.Generator().manual_seed(seed)
    kw = dict(
        input_split_sizes=SPLITS[rank], output_split_sizes=[SPLITS[a][rank] for a in range(R)]
    )
    failures = []
    # the combine: every row of x through its expert, then the exchange
    rows = [sum(s) for s in SPLITS]
    ids = [torch.randint(0, E, (m,), generator=g) for m in rows]
    leaves = {"x": [torch.randn(m, K, generator=g) for m in rows],
              "w": [torch.randn(E, K, N, generator=g) for _ in range(R)]}  # fmt: skip

    def combine(m):
        return (overlap.grouped_matmul_all_to_all(m["x"], m["w"], ids[rank], chunks=2, **kw),)

    def combine_ref(e):
        return [(y,) for y in _exchange([_per_expert(e["x"][a], e["w"][a], ids[a])
                                         for a in range(R)], R)]  # fmt: skip

    failures += _check(rank, R, "grouped_matmul_all_to_all", leaves, combine, combine_ref, seed + 1)
    # the dispatch: the exchange, then every received row through its expert
    got = [sum(SPLITS[a][b] for a in range(R)) for b in range(R)]
    ids = [torch.randint(0, E, (m,), generator=g) for m in got]

    def dispatch(m):
        return (overlap.all_to_all_grouped_matmul(m["x"], m["w"], ids[rank], chunks=2, **kw),)

    def dispatch_ref(e):
        return [(_per_expert(r, e["w"][b], ids[b]),) for b, r in enumerate(_exchange(e["x"], R))]

    failures += _check(rank, R, "all_to_all_grouped_matmul", leaves, dispatch, dispatch_ref,
                       seed + 2)  # fmt: skip
    return failures


# -- embedding_bag_all_to_all -------------------------------------------------------------------
def _bags(rank, R, seed):
    g = torch.Generator().manual_seed(seed)
    B, dims, rows = 8, (6, 10), (11, 7)  # bags; table widths and rows (alike on every rank)
    idx = [[torch.randint(0, n, (20,), generator=g) for n in rows] for _ in range(R)]
    off = [[torch.cat([torch.zeros(1, dtype=torch.int64),
                       torch.randint(0, 21, (B - 1,), generator=g).sort().values])
            for _ in rows] for _ in range(R)]  # fmt: skip
    leaves = {f"t{t}": [torch.randn(n, d, generator=g) for _ in range(R)]
              for t, (n, d) in enumerate(zip(rows, dims, strict=True))}  # fmt: skip
    failures = []
    for i, mode in enumerate(("sum", "mean", "max")):

        def forward(m, mode=mode):
            tables = [m[f"t{t}"] for t in range(len(rows))]
            y = overlap.embedding_bag_all_to_all(tables, idx[rank], off[rank], mode=mode,
                                                 rank_dims=[sum(dims)] * R, chunks=2)  # fmt: skip
            return (y,)

        def reference(e, mode=mode):
            pooled = [torch.cat([F.embedding_bag(idx[a][t], e[f"t{t}"][a], off[a][t], mode=mode)
                                 for t in range(len(rows))], dim=1) for a in range(R)]  # fmt: skip
            b = B // R
            return [(torch.cat([p[r * b : (r + 1) * b] for p in pooled], dim=1),)
                    for r in range(R)]  # fmt: skip

        failures += _check(rank, R, f"embedding_bag_all_to_all mode={mode}", leaves, forward,
                           reference, seed + 1 + i)  # fmt: skip
    return failures


# -- overlap.nn ---------------------------------------------------------------------------------
LAYERS = [
    (ColumnParallelLinear, {}),
    (ColumnParallelLinear, {"sequence_parallel": True}),
    (ColumnParallelLinear, {"gather_output": True}),
    (RowParallelLinear, {}),
    (RowParallelLinear, {"sequence_parallel": True}),
    (RowParallelLinear, {"input_is_parallel": False}),
]


def _layer(rank, R, seed, cls, kw, bias) -> list[str]:
    """One layer cut from an ``nn.Linear`` with each mask of trainable (input, weight, bias),
    against float64 autograd of the whole ``nn.Linear``: the shards' gradients are the
    whole layer's, sliced (as tests/test_nn.py)."""
    g = torch.Generator().manual_seed(seed)
    fin, fout, lead = 64, 32, (8 * R, 3)
    full = nn.Linear(fin, fout, bias=bias)
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x_full = torch.randn(*lead, fin, generator=g)
    g_full = torch.randn(*lead, fout, generator=g)
    ref = nn.Linear(fin, fout, bias=bias).double()
    ref.load_state_dict(full.state_dict())
    xr = x_full.double().requires_grad_()
    yr = ref(xr)
    (yr * g_full.double()).sum().backward()
    sp, column = kw.get("sequence_parallel", False), cls is ColumnParallelLinear
    T = lead[0] // R
    tokens = slice(rank * T, (rank + 1) * T) if sp else slice(None)
    n = (fout if column else fin) // R
    mine = slice(rank * n, (rank + 1) * n)
    if column:  # output features split; sequence parallel: the input's tokens
        out = slice(None) if kw.get("gather_output") else mine
        x = x_full[tokens]
        want = {"y": yr[..., out], "x": xr.grad[tokens], "weight": ref.weight.grad[mine],
                "bias": ref.bias.grad[mine] if bias else None}  # fmt: skip
        g_mine = g_full[..., out]
    else:  # input features split; sequence parallel: the output's tokens
        cols = mine if kw.get("input_is_parallel", True) else slice(None)
        x = x_full[..., cols]
        want = {"y": yr[tokens], "x": xr.grad[..., cols], "weight": ref.weight.grad[:, mine],
                "bias": ref.bias.grad if bias else None}  # fmt: skip
        g_mine = g_full[tokens]
    names = ("x", "weight", "bias") if bias else ("x", "weight")
    failures = []
    for mask in _masks(names):
        case = f"{cls.__name__} {kw} bias={bias} trainable={'+'.join(mask)} rank={rank}"
        layer = cls.from_linear(full, **kw)
        for k, p in layer.named_parameters():
            p.requires_grad_(k in mask)
        got = {"x": x.clone().requires_grad_("x" in mask)}
        try:
            y = layer(got["x"])
            (y * g_mine).sum().backward()
        except Exception as e:
            failures.append(f"{case}: {type(e).__name__}: {e}")
            continue
        got.update(layer.named_parameters())
        why = mismatch(y.detach(), want["y"].detach(), TOL)
        failures += [f"{case}: y: {why}"] if why else []
        for k in names:
            grad = got[k].grad
            if k not in mask:
                failures += [f"{case}: frozen {k} got a gradient"] if grad is not None else []
            elif grad is None or grad.shape != want[k].shape:
                failures.append(f"{case}: trainable {k} got {grad if grad is None else grad.shape}")
            else:
                why = mismatch(grad, want[k], TOL)
                failures += [f"{case}: d{k}: {why}"] if why else []
    return failures


def _layers(rank, R, seed):
    failures = []
    for i, (cls, kw) in enumerate(LAYERS):
        for bias in (True, False):
            failures += _layer(rank, R, seed + 2 * i + bias, cls, kw, bias)
    return failures


FAMILIES = {"matmul_collective": _dense, "all_gather_matmul": _gather, "moe": _moe,
            "bags": _bags, "layers": _layers}  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_only_dx_only_dw(family):
    spawn(FAMILIES[family], 2, random.randrange(1 << 30))


def test_single_process_masks():
    """World size 1 (no process group): the masks of the registered backward."""
    leaves = _draw(1, random.randrange(1 << 30), x=(3, 5, K), weight=(N, K))

    def forward(m):
        return (overlap.matmul_allreduce(m["x"], m["weight"].t()),)

    def reference(e):
        return [(e["x"][0].reshape(-1, K) @ e["weight"][0].t(),)]

    failures = _check(0, 1, "world size 1", leaves, forward, reference, 1, replicated=True)
    assert not failures, "\n".join(failures)


def test_frozen_table_gets_no_dense_gradient(monkeypatch):
    """A frozen embedding table's gradient is not made (it is as big as the table)."""
    from overlap.ops import bags

    made = []
    grad = bags._bag_grad
    monkeypatch.setattr(bags, "_bag_grad", lambda t, *a: made.append(t.shape) or grad(t, *a))
    frozen, trained = torch.randn(50, 4), torch.randn(30, 6, requires_grad=True)
    idx = [torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9, 2, 6])]
    off = [torch.tensor([0, 2]), torch.tensor([0, 1])]
    overlap.embedding_bag_all_to_all([frozen, trained], idx, off).sum().backward()
    assert made == [trained.shape] and frozen.grad is None
    ref = torch.zeros(30, 6).index_add_(0, idx[1], torch.ones(3, 6))
    torch.testing.assert_close(trained.grad, ref)
