"""Bad input to every public op, as a new user gives it: each raises a TypeError or ValueError
naming the argument, or returns what torch returns for the same call (compared on
NaN-poisoned outputs).

Cases that do not depend on the world size run in this process at world size 1 (the
``CASES`` table); those that do (split sizes, batch and row divisibility, the embedding bags'
offsets read at band edges, K = 0 through the kernel's path) run on 2 gloo ranks, many cases
in one spawn (``test_two_ranks``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from _dist import _ALL_GATHER, _REDUCE_SCATTER, spawn

import overlap

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# the ops that take x [M, K] and a weight, by name: call(x, w, R, **kwargs)
SPLIT_OPS = ("matmul_all_to_all splits", "grouped_matmul_all_to_all", "all_to_all_grouped_matmul")
OUT_OPS = (
    "matmul_collective",
    "matmul_allreduce",
    "matmul_reduce_scatter",
    "matmul_all_to_all",
    "all_gather_matmul",
    *SPLIT_OPS,
)
OPS = (*OUT_OPS, "plan")


def call(op: str, x, w, R: int = 1, **kw):
    """``op`` on ``x [M, K]`` and ``w [K, N]`` with equal splits (the MoE ops: one expert,
    ``w`` stacked to ``[1, K, N]``, every id 0) unless ``kw`` gives them."""
    if op == "plan":
        return overlap.plan(x, w, **kw)
    if op in SPLIT_OPS:
        M = math.prod(x.shape[:-1]) if isinstance(x, torch.Tensor) else 0
        kw.setdefault("input_split_sizes", [M // R] * R)
        kw.setdefault("output_split_sizes", [M // R] * R)
    if op == "matmul_all_to_all splits":
        return overlap.matmul_all_to_all(x, w, **kw)
    if op in SPLIT_OPS:
        if isinstance(w, torch.Tensor) and w.dim() == 2:
            w = w.unsqueeze(0)
        ids = kw.pop("expert_ids", torch.zeros(M, dtype=torch.long))
        return getattr(overlap, op)(x, w, ids, **kw)
    return getattr(overlap, op)(x, w, **kw)


def result_shape(op: str, M: int, N: int, R: int) -> tuple[int, int]:
    rows = {"matmul_reduce_scatter": M // R, "all_gather_matmul": M * R}.get(op, M)
    return rows, N


def _xw(M=8, K=16, N=12, dtype=torch.float32):
    return torch.randn(M, K, dtype=dtype), torch.randn(K, N, dtype=dtype)


def _aliased(op: str, where: str):
    """``(x, w, out)`` with ``out`` sharing memory with ``x`` or ``w`` (``where``): the whole
    tensor, a partial overlap, or a view."""
    M, K, N = 8, 8, 8
    rows, _ = result_shape(op, M, N, 1)
    if where == "w":  # (the MoE ops' w is [1, K, N]: the same memory)
        w = torch.randn(K, N)
        return torch.randn(M, K), w, w.view(rows, N)
    base = torch.randn(3 * M * K)
    x = base[: M * K].view(M, K)
    start = {"x": 0, "partial": M * K // 2, "view": M * K - 1}[where]
    return x, torch.randn(K, N), base[start : start + rows * N].view(rows, N)


def _bags(B=4, rows=10, D=4, L=8):
    """One table's ``(tables, indices, offsets)``: ``B`` bags of ``L // B`` indices."""
    return [torch.randn(rows, D)], [torch.randint(0, rows, (L,))], [torch.arange(0, L, L // B)]


def _bag_call(**change):
    """``embedding_bag_all_to_all`` with one argument changed (``tables``, ``indices``,
    ``offsets`` replaced; a callable ``f(tables, indices, offsets)`` edits them)."""
    tables, indices, offsets = _bags()
    edit = change.pop("edit", None)
    if edit is not None:
        edit(tables, indices, offsets)
    args = {"tables": tables, "indices": indices, "offsets": offsets, **change}
    return overlap.embedding_bag_all_to_all(args.pop("tables"), args.pop("indices"),
                                            args.pop("offsets"), **args)  # fmt: skip


def _set(seq: str, change):
    """An edit for ``_bag_call``: the first tensor of ``seq`` replaced by ``change`` of it."""

    def edit(tables, indices, offsets):
        tensors = {"tables": tables, "indices": indices, "offsets": offsets}[seq]
        tensors[0] = change(tensors[0])

    return edit


def _cases():
    """``(id, thunk, exception type, text the message must hold)``."""
    cases = []

    def add(name, fn, exc, text):
        cases.append(pytest.param(fn, exc, text, id=name))

    for op in OPS:
        for bad, exc in (("4", TypeError), (4.0, TypeError), (True, TypeError), (1, ValueError),
                         (65, ValueError)):  # fmt: skip
            add(f"{op}-chunks={bad!r}", lambda op=op, bad=bad: call(op, *_xw(), chunks=bad),
                exc, "chunks")  # fmt: skip
        add(f"{op}-group=5", lambda op=op: call(op, *_xw(), group=5), TypeError, "group")
        add(f"{op}-backend", lambda op=op: call(op, *_xw(), backend="nccl"), ValueError,
            "backend")  # fmt: skip
        add(f"{op}-x-list", lambda op=op: call(op, [[1.0]], _xw()[1]), TypeError, "x must be")
        add(f"{op}-w-list", lambda op=op: call(op, _xw()[0], [[1.0]]), TypeError, "w must be")
        add(f"{op}-x-float64", lambda op=op: call(op, *(t.double() for t in _xw())), TypeError,
            "x.dtype")  # fmt: skip
        add(f"{op}-x-int", lambda op=op: call(op, *(t.int() for t in _xw())), TypeError,
            "x.dtype")  # fmt: skip
        add(f"{op}-w-dtype", lambda op=op: call(op, _xw()[0], _xw()[1].half()), TypeError,
            "w.dtype")  # fmt: skip
        add(f"{op}-K-mismatch", lambda op=op: call(op, _xw()[0], torch.randn(15, 12)),
            ValueError, "K mismatch: x is")  # fmt: skip
        add(f"{op}-w-meta", lambda op=op: call(op, _xw()[0], _xw()[1].to("meta")), ValueError,
            "w is on meta")  # fmt: skip
        add(f"{op}-x-0d", lambda op=op: call(op, torch.tensor(1.0), _xw()[1]), ValueError,
            "x must have")  # fmt: skip
        w3 = "w must be [E, K, N]" if op in SPLIT_OPS[1:] else "w must be 2-D"
        add(f"{op}-w-3d", lambda op=op: call(op, _xw()[0], torch.randn(2, 2, 16, 12)),
            ValueError, w3)  # fmt: skip
    for op in OUT_OPS:
        shape = result_shape(op, 8, 12, 1)
        for name, out, exc, text in (
            ("shape", lambda s: torch.empty(s[0], 13), ValueError, "out must have shape"),
            ("dtype", lambda s: torch.empty(s, dtype=torch.float16), TypeError, "out.dtype"),
            ("device", lambda s: torch.empty(s, device="meta"), ValueError, "out is on meta"),
            ("strides", lambda s: torch.empty(s[::-1]).t(), ValueError, "out must be contiguous"),
            ("list", lambda s: [0.0], TypeError, "out must be"),
        ):
            add(f"{op}-out-{name}", lambda op=op, out=out, s=shape: call(op, *_xw(), out=out(s)),
                exc, text)  # fmt: skip
        for where in ("x", "partial", "view", "w"):
            add(f"{op}-out-aliases-{where}",
                lambda op=op, where=where: _call_out(op, *_aliased(op, where)),
                ValueError, "out must not share memory")  # fmt: skip
        add(f"{op}-out-with-autograd",
            lambda op=op: call(op, _xw()[0].requires_grad_(), _xw()[1],
                               out=torch.empty(result_shape(op, 8, 12, 1))),
            ValueError, "out= does not support autograd")  # fmt: skip
    for name, kw, exc, text in (
        ("collective", dict(collective="gather"), ValueError, "collective"),
        ("collective-all_gather", dict(collective="all_gather"), ValueError, "all_gather_matmul"),
        ("op", dict(op="max"), ValueError, "op"),
        ("op-all_to_all", dict(collective="all_to_all", op="avg"), ValueError, "op"),
        ("splits-all_reduce", dict(input_split_sizes=[8], output_split_sizes=[8]), ValueError,
         "are for all_to_all"),
    ):  # fmt: skip
        add(f"matmul_collective-{name}", lambda kw=kw: overlap.matmul_collective(*_xw(), **kw),
            exc, text)  # fmt: skip
    add("all_gather_matmul-return_gathered=1",
        lambda: overlap.all_gather_matmul(*_xw(), return_gathered=1), TypeError,
        "return_gathered")  # fmt: skip
    for op in SPLIT_OPS:
        for name, kw, exc, text in (
            ("int", dict(input_split_sizes=8), TypeError, "input_split_sizes must be a list"),
            ("floats", dict(input_split_sizes=[8.0]), TypeError, "input_split_sizes must be"),
            ("bools", dict(output_split_sizes=[True]), TypeError, "output_split_sizes must be"),
            ("tensor", dict(input_split_sizes=torch.tensor([8])), TypeError, "input_split_siz"),
            ("negative", dict(input_split_sizes=[-8]), ValueError, "non-negative"),
            ("length", dict(output_split_sizes=[4, 4]), ValueError, "output_split_sizes must be"),
            ("sum", dict(input_split_sizes=[7], output_split_sizes=[7]), ValueError, "add up"),
            ("self", dict(output_split_sizes=[5]), ValueError, "output_split_sizes[0] (5)"),
            ("only-one", dict(output_split_sizes=None), ValueError, "go together"),
        ):
            add(f"{op}-splits-{name}", lambda op=op, kw=kw: call(op, *_xw(), **kw), exc, text)
    for op in SPLIT_OPS[1:]:
        for name, ids in (
            ("float", lambda: torch.zeros(8)),
            ("bool", lambda: torch.zeros(8, dtype=torch.bool)),
            ("length", lambda: torch.zeros(7, dtype=torch.long)),
            ("list", lambda: [0] * 8),
            ("above", lambda: torch.tensor([0] * 7 + [1])),
            ("negative", lambda: torch.tensor([0] * 7 + [-1])),
            ("meta", lambda: torch.zeros(8, dtype=torch.long, device="meta")),
        ):
            add(f"{op}-expert_ids-{name}", lambda op=op, ids=ids: call(op, *_xw(),
                expert_ids=ids()), ValueError, "expert_ids")  # fmt: skip
        add(f"{op}-w-E=0", lambda op=op: call(op, _xw()[0], torch.randn(0, 16, 12)), ValueError,
            "w must be [E, K, N]")  # fmt: skip
    B = overlap.embedding_bag_all_to_all
    for bad, exc in (("4", TypeError), (4.0, TypeError), (True, TypeError), (1, ValueError),
                     (65, ValueError)):  # fmt: skip
        add(f"bags-chunks={bad!r}", lambda bad=bad: _bag_call(chunks=bad), exc, "chunks")
    for name, fn, exc, text in (
        ("group=5", lambda: _bag_call(group=5), TypeError, "group"),
        ("mode", lambda: _bag_call(mode="avg"), ValueError, "mode"),
        ("backend", lambda: _bag_call(backend="nccl"), ValueError, "backend"),
        ("tables-tensor", lambda: _bag_call(tables=torch.randn(10, 4)), TypeError, "tables"),
        ("tables-empty", lambda: B([], [], []), TypeError, "tables"),
        ("rank_dims-str", lambda: _bag_call(rank_dims="4"), TypeError, "rank_dims"),
        ("rank_dims-float", lambda: _bag_call(rank_dims=[4.0]), TypeError, "rank_dims"),
        ("rank_dims-wrong", lambda: _bag_call(rank_dims=[5]), ValueError, "rank_dims"),
    ):
        add(f"bags-{name}", fn, exc, text)
    for name, seq, edit, exc, text in (  # one tensor of the call changed
        ("tables-1d", "tables", lambda t: t[0], TypeError, "tables"),
        ("tables-float64", "tables", lambda t: t.double(), TypeError, "tables"),
        ("tables-meta", "tables", lambda t: t.to("meta"), ValueError, "tables"),
        ("indices-float", "indices", lambda i: i.float(), ValueError, "indices"),
        ("indices-bool", "indices", lambda i: i > 0, ValueError, "indices"),
        ("indices-2d", "indices", lambda i: i.view(2, 4), ValueError, "indices"),
        ("indices-meta", "indices", lambda i: i.to("meta"), ValueError, "indices"),
        ("indices-above", "indices", lambda i: i + 10, ValueError, "indices must lie"),
        ("indices-negative", "indices", lambda i: i - 10, ValueError, "indices must lie"),
        ("offsets-float", "offsets", lambda o: o.float(), ValueError, "offsets"),
        ("offsets-meta", "offsets", lambda o: o.to("meta"), ValueError, "offsets"),
        ("offsets-first", "offsets", lambda o: o + 1, ValueError, "offsets[0]"),
        ("offsets-decreasing", "offsets", lambda o: o[[0, 2, 1, 3]], ValueError, "non-decreasing"),
        ("offsets-last", "offsets", lambda o: o * 3, ValueError, "offsets[-1]"),
    ):
        add(f"bags-{name}", lambda seq=seq, edit=edit: _bag_call(edit=_set(seq, edit)), exc, text)
    two = [torch.zeros(2, dtype=torch.long)] * 2
    add("bags-tables-dtypes", lambda: B([torch.randn(4, 2), torch.randn(4, 2).half()], two, two),
        ValueError, "tables")  # fmt: skip
    add("bags-indices-tensor", lambda: _bag_call(indices=torch.zeros(8, dtype=torch.long)),
        ValueError, "indices")  # fmt: skip
    for bad in (5, "tp"):
        add(f"release({bad!r})", lambda bad=bad: overlap.release(bad), TypeError, "group")
    return cases


def _call_out(op, x, w, out):
    return call(op, x, w, out=out)


@pytest.mark.parametrize("fn, exc, text", _cases())
def test_bad_input_raises_naming_it(fn, exc, text):
    with pytest.raises(exc) as e:
        fn()
    assert type(e.value) is exc and text in str(e.value), (type(e.value), str(e.value))


def torch_result(op: str, x: torch.Tensor, w: torch.Tensor, R: int) -> torch.Tensor:
    """What plain torch returns for ``call(op, x, w, R)``, in float64 (meta stays meta): the
    matmul and ``torch.distributed``'s collective of it (equal splits)."""
    dev = x.device
    x2, w = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).double(), w.double()
    M, N = x2.shape[0], w.shape[1]
    if op == "all_gather_matmul":
        full = x2.new_empty(M * R, x2.shape[1])
        if R > 1:
            getattr(dist, _ALL_GATHER)(full, x2)
        else:
            full.copy_(x2)
        return full @ w
    if op == "all_to_all_grouped_matmul":
        got = torch.empty(x2.shape, dtype=x2.dtype, device=dev)
        if R > 1:
            dist.all_to_all_single(got, x2.contiguous())
        else:
            got.copy_(x2)
        return got @ w
    y = x2 @ w
    if R == 1:
        return y.reshape(*x.shape[:-1], N) if op != "matmul_reduce_scatter" else y
    if op in ("matmul_collective", "matmul_allreduce"):
        dist.all_reduce(y)
        return y.reshape(*x.shape[:-1], N)
    out = torch.empty(result_shape(op, M, N, R), dtype=y.dtype, device=dev)
    if op == "matmul_reduce_scatter":
        getattr(dist, _REDUCE_SCATTER)(out, y)
    else:
        dist.all_to_all_single(out, y)
    return out.reshape(*x.shape[:-1], N) if op == "matmul_all_to_all" else out


def check_like_torch(op: str, x, w, R: int, **kw) -> str | None:
    """``call(op, ...)`` into a NaN-poisoned ``out`` against ``torch_result``; a message on
    failure."""
    from _dist import TOL, mismatch

    ref = torch_result(op, x, w, R)
    kw = dict(kw)
    if not x.is_meta:
        shape = ref.shape if op not in SPLIT_OPS else (math.prod(x.shape[:-1]), w.shape[-1])
        kw["out"] = torch.full(shape, float("nan"), dtype=x.dtype)
    name = f"{op} x {tuple(x.shape)} {x.dtype} on {x.device}, {kw.get('chunks')} chunks"
    try:
        got = call(op, x, w, R, **kw)
    except Exception as e:
        return f"{name}: {type(e).__name__}: {e}"
    if got.device != ref.device or got.shape != ref.reshape(got.shape).shape:
        return f"{name}: {tuple(got.shape)} on {got.device}, torch: {tuple(ref.shape)}"
    if x.is_meta or not got.numel():
        return None
    why = mismatch(got, ref.reshape(got.shape), TOL[x.dtype])
    return f"{name}: {why}" if why else None


def _like_torch_cases(R: int):
    """``(op, x, w, kwargs)`` whose result must be torch's: K = 0 for every op and dtype (and
    chunks), empty M and N, 3-D and non-contiguous x, meta tensors. ``M = 64 R`` and ``N = 48``
    make two bands of the interpreter's 32 x 32 tiles: the overlapped path where ``R > 1``."""
    M, K, N = 64 * R, 16, 48
    for op in OUT_OPS:
        for dtype in DTYPES:
            for chunks in (None, 2):
                x0, w0 = torch.randn(M, 0, dtype=dtype), torch.randn(0, N, dtype=dtype)
                yield op, x0, w0, {"chunks": chunks}
        yield op, torch.randn(0, K), torch.randn(K, N), {"chunks": 2}
        yield op, torch.randn(M, K), torch.randn(K, 0), {"chunks": 2}
        yield op, torch.randn(2, M // 2, K), torch.randn(N, K).t(), {"chunks": 2}
        yield op, torch.randn(2, M // 2, K), torch.randn(K, 0), {"chunks": 2}
        yield op, torch.randn(K, M).t(), torch.randn(K, N), {"chunks": 2}
        if op not in SPLIT_OPS:
            yield op, torch.randn(M, K, device="meta"), torch.randn(K, N, device="meta"), {}


@pytest.mark.parametrize("op", OUT_OPS)
def test_like_torch_at_world_size_one(op):
    failures = [check_like_torch(*case[:3], 1, **case[3]) for case in _like_torch_cases(1)
                if case[0] == op]  # fmt: skip
    assert not any(failures), "\n".join(f for f in failures if f)


def _two_ranks(rank: int, R: int) -> list[str]:
    """On every rank the same call, so that a raising case stays in step: the world-size
    dependent checks, then torch's results."""
    failures = []

    def raises(name, fn, exc, text):
        try:
            fn()
            failures.append(f"{name}: no error")
        except Exception as e:
            if type(e) is not exc or text not in str(e):
                failures.append(f"{name}: {type(e).__name__}: {e} (expected {exc.__name__} "
                                f"naming {text!r})")  # fmt: skip
        dist.barrier()

    x, w = torch.randn(16, 8), torch.randn(8, 6)
    for op in ("matmul_reduce_scatter", "matmul_all_to_all"):
        raises(f"{op} M odd", lambda op=op: call(op, x[:15], w, R), ValueError, "divisible")
    sends = [5, 11] if rank == 0 else [11, 5]  # rank 0 sends 5 rows to itself, 11 to rank 1
    for op in SPLIT_OPS:
        for name, kw, exc, text in (
            ("one split", dict(input_split_sizes=[16], output_split_sizes=[16]), ValueError,
             "input_split_sizes must be 2 non-negative"),
            ("own rows", dict(input_split_sizes=sends, output_split_sizes=sends[::-1]),
             ValueError, f"output_split_sizes[{rank}]"),
        ):  # fmt: skip
            raises(f"{op} {name}", lambda op=op, kw=kw: call(op, x, w, R, **kw), exc, text)
    tables, indices, offsets = _bags(B=8, L=16)
    E = overlap.embedding_bag_all_to_all
    for name, kw, exc, text in (
        ("B odd", dict(offsets=[offsets[0][:7]]), ValueError, "batch (7 bags)"),
        ("rank_dims one", dict(rank_dims=[4]), ValueError, "rank_dims"),
        ("rank_dims negative", dict(rank_dims=[4, -4]), ValueError, "rank_dims"),
        ("rank_dims float", dict(rank_dims=[4.0, 4.0]), TypeError, "rank_dims"),
        ("offsets[0]", dict(offsets=[offsets[0] + 1]), ValueError, "offsets[0]"),
        ("offsets decreasing", dict(offsets=[offsets[0][[0, 1, 2, 5, 4, 3, 6, 7]]]), ValueError,
         "offsets must be non-decreasing"),
        ("offsets[-1]", dict(offsets=[torch.cat([offsets[0][:-1], torch.tensor([17])])]),
         ValueError, "offsets[-1]"),
        ("index above", dict(indices=[indices[0].clone().index_fill_(0, torch.tensor([9]), 10)]),
         ValueError, "indices must lie in [0, 10)"),
        ("index negative", dict(indices=[indices[0].clone().index_fill_(0, torch.tensor([3]), -1)]),
         ValueError, "indices must lie in [0, 10)"),
    ):  # fmt: skip
        args = {"tables": tables, "indices": indices, "offsets": offsets, "rank_dims": [4, 4]}
        args.update(kw)
        raises(f"bags {name}", lambda a=args: E(a.pop("tables"), a.pop("indices"),
                                                a.pop("offsets"), **a), exc, text)  # fmt: skip
    raises("release(5)", lambda: overlap.release(5), TypeError, "group")
    for op in ("matmul_allreduce", "all_gather_matmul"):  # out aliasing x, across ranks' calls
        base = torch.randn(64 * 8)
        xa = base[: 8 * 8].view(8, 8)
        rows = 16 if op == "all_gather_matmul" else 8
        raises(f"{op} out aliases x", lambda op=op, xa=xa, base=base, rows=rows: call(
            op, xa, torch.randn(8, 8), R, out=base[32 : 32 + rows * 8].view(rows, 8), chunks=2
        ), ValueError, "out must not share memory")  # fmt: skip
    for op, xc, wc, kw in _like_torch_cases(R):
        why = check_like_torch(op, xc, wc, R, **kw)
        failures += [why] if why else []
        dist.barrier()
    K0 = overlap.plan(torch.randn(128, 0), torch.randn(0, 48), "all_reduce", chunks=2)
    if K0.path != "fallback" or "K = 0" not in K0.reason:
        failures.append(f"K = 0: plan {K0.describe()}")
    return failures


def test_two_ranks():
    spawn(_two_ranks, 2)


@pytest.mark.parametrize(
    "op, K, N",
    [(op, 16, 12) for op in ("matmul_allreduce", "all_gather_matmul", *SPLIT_OPS[1:3])]
    + [
        (op, K, N)
        for op in ("matmul_allreduce", "all_gather_matmul", "grouped_matmul_all_to_all")
        for K, N in ((0, 12), (16, 0))
    ],
)  # fmt: skip
def test_gradients_like_torch_at_world_size_one(op, K, N):
    """Autograd at world size 1 (a one-GPU run of a tensor-parallel model), empty K or N
    included: ``dx`` and ``dw`` are torch's."""
    x, w = torch.randn(8, K, requires_grad=True), torch.randn(K, N, requires_grad=True)
    g = torch.randn(8, N)
    (call(op, x, w) * g).sum().backward()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ((x64 @ w64) * g.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)
