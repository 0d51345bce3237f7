"""Cache keys: every field that changes a call's result is in its key.

- The calls' memo (``context.calls``, keyed by ``graphs.signature`` in
  ``ops.engine.decide``): on 2 gloo ranks, calls that differ from a first one in one field
  only (dtype, M, K, N, chunks, backend, collective, group and its world size, a tuned choice
  for another group of the same size)
  each get the plan a fresh process makes (the cache forgotten), which differs from the first
  call's; and a real call after another of another dtype computes right.
- The recorded calls' key (``graphs.signature`` and ``outputs``): every argument, the
  caller stream, the weight's address, and the input's and outputs' dtypes, shapes, strides
  and alignment, but not their addresses (the graph is rebound to them), tried
  here on CPU tensors seen as CUDA ones (only CUDA calls are recorded); the calls themselves
  are tried on a GPU in tests/test_gpu.py (``test_recorded_inputs_move_one_gpu``).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from _dist import TOL, mismatch, spawn

import overlap
from overlap import guard
from overlap.context import forget, set_tuned, tuned_key
from overlap.graphs import record
from overlap.ops import Call
from overlap.ops.engine import decide

BASE = dict(M=256, K=40, N=48, dtype=torch.float32, collective="all_reduce", chunks=4,
            backend="torch")  # fmt: skip
# (what, how it differs from BASE): each changes the plan (checked, so the test can fail)
VARIANTS = [
    ("dtype", dict(dtype=torch.bfloat16)),  # the interpreter's bf16: the plain path
    ("M", dict(M=128)),
    ("M of a 3-D x", dict(M=(2, 64))),
    ("K", dict(K=72)),
    ("N", dict(N=96)),
    ("chunks", dict(chunks=2)),
    ("chunks=None", dict(chunks=None)),  # (the interpreter's default: 2)
    ("backend", dict(backend="cupy")),
    ("collective reduce_scatter", dict(collective="reduce_scatter")),
    ("collective all_to_all", dict(collective="all_to_all")),
    ("collective all_gather", dict(collective="all_gather")),
    ("group of world size 1", dict(group="alone")),
]


def _plans(rank, R, seed):
    alone = [dist.new_group([r]) for r in range(R)][rank]  # (every rank makes every group)
    pair = dist.new_group(list(range(R)))
    groups = {None: None, "alone": alone, "pair": pair}
    g = torch.Generator().manual_seed(seed)

    def args(kw):
        M, K, N, dtype = kw["M"], kw["K"], kw["N"], kw["dtype"]
        x = torch.randn(*(M if isinstance(M, tuple) else (M,)), K, generator=g).to(dtype)
        w = torch.randn(K, N, generator=g).to(dtype)
        return x, w, kw["collective"], groups[kw.get("group")], kw["chunks"], kw["backend"]

    def plan(x, w, name, group, chunks, backend):
        return overlap.plan(x, w, name, group=group, chunks=chunks, backend=backend)

    failures = []
    for what, change in VARIANTS:
        first, other = args(BASE), args({**BASE, **change})
        forget()
        p_first = plan(*first)
        got = plan(*other)  # the cache holds the first call's plan
        forget()
        fresh = plan(*other)
        if fresh == p_first:
            failures.append(f"{what}: the variant's plan is the first call's (a useless case)")
        elif got != fresh:
            failures.append(f"{what}: after a call of plan\n  {p_first}\nthe call got\n  {got}\n"
                            f"where a fresh process makes\n  {fresh}")  # fmt: skip
    # another group of the same size: the same plan unless overlap.tune chose for one group
    # (its table is keyed by group), and that group's context
    x, w, name, _, _, backend = args(BASE)
    key = tuned_key(x.shape[0], w.shape[1], x.shape[1], x.dtype, name)
    set_tuned(pair, x.device, key, 8)  # (forgets the plans)
    p_first = plan(x, w, name, None, None, backend)
    got = plan(x, w, name, pair, None, backend)
    forget()
    fresh = plan(x, w, name, pair, None, backend)
    if fresh == p_first or got != fresh:
        failures.append(f"overlap.tune's choice for another group: after a call of plan\n"
                        f"  {p_first}\nthe call got\n  {got}\nwhere a fresh process makes\n"
                        f"  {fresh}")  # fmt: skip
    set_tuned(pair, x.device, key, None)
    for group in (pair, None):
        call = Call(name, group, "sum", backend, None)
        sig = record.signature(x, w, *call)
        ctx = decide(x, w, call, False, sig).ctx
        if ctx.group is not (group if group is not None else dist.group.WORLD):  # (None: the
            # default group of the moment, guard.default)
            failures.append(f"a call of group {group} got the context of group {ctx.group}")
    # real calls: fp32, then bf16 of the same shapes (the plain path, the interpreter's bf16
    # products being wrong), each against float64
    forget()
    xs = [torch.randn(R, BASE["M"], BASE["K"], generator=g) for _ in range(2)]
    w = torch.randn(BASE["K"], BASE["N"], generator=g)
    for dtype, every in zip((torch.float32, torch.bfloat16), xs, strict=True):
        x, wd = every[rank].to(dtype), w.to(dtype)
        ref = sum(e.to(dtype).double() for e in every) @ wd.double()
        out = torch.full_like(ref, float("nan"), dtype=dtype)
        overlap.matmul_collective(x, wd, "all_reduce", chunks=2, out=out)
        why = mismatch(out, ref, TOL[dtype])
        failures += [f"all_reduce {dtype} after another dtype's call: {why}"] if why else []
    return failures


def test_plan_cache_key():
    spawn(_plans, 2, random.randrange(1 << 30))


class _AsCuda:
    """A CPU tensor as ``signature`` sees a CUDA one (only CUDA calls are recorded)."""

    is_cuda = True

    def __init__(self, t: torch.Tensor, device: int = 0) -> None:
        self.t, self.device = t, torch.device("cuda", device)

    def __getattr__(self, name):
        return getattr(self.t, name)


def test_record_signature_has_every_field(monkeypatch):
    """Calls that differ in one thing that changes what a recorded graph must read or do
    have different keys: a replay of another's graph would read the old input (a new
    activation at a new address), with the old strides, or do the old call."""
    stream = [7]
    monkeypatch.setattr(record, "current_raw_stream", lambda device: stream[0])
    M, K, N = 6, 4, 5
    buf = torch.randn(M * K)  # x's memory, read as [M, K] in two layouts
    wbuf = torch.randn(K * N)
    x, w = buf.view(M, K), wbuf.view(K, N)
    x_t = buf.view(K, M).t()  # [M, K] at the same address, other strides
    w_t = wbuf.view(N, K).t()  # [K, N] likewise (a linear layer's weight.t())
    assert x_t.data_ptr() == x.data_ptr() and x_t.shape == x.shape
    half = torch.randn(M * K).half()  # fp16 and bf16 at one address, one shape
    args = ("all_reduce", None, "sum", "ce", 4)

    def sig(*a, x=x, w=w):
        return record.signature(_AsCuda(x), _AsCuda(w), *(a or args))

    base = sig()
    variants = {
        "collective": sig("reduce_scatter", *args[1:]),
        "group": sig(args[0], "a group", *args[2:]),
        "op": sig(*args[:2], "avg", *args[3:]),
        "backend": sig(*args[:3], "torch", args[4]),
        "chunks": sig(*args[:4], 8),
        "x's alignment": sig(x=torch.randn(M * K + 1)[1:].view(M, K)),
        "x's strides": sig(x=x_t),
        "x's shape": sig(x=buf.view(M // 2, 2 * K)),
        "w's address": sig(w=w.clone()),
        "w's strides": sig(w=w_t),
        "w's shape": sig(w=wbuf.view(K // 2, 2 * N)),
        "x's device": record.signature(_AsCuda(x, 1), _AsCuda(w), *args),
        "w's device": record.signature(_AsCuda(x), _AsCuda(w, 1), *args),
    }
    stream[0] = 8
    variants["caller stream"] = sig()
    stream[0] = 7
    assert sig() == base  # (the same call: the same key)
    for what, key in variants.items():
        assert key != base, f"{what} is not in the recorded call's signature"
    bf16 = half.view(torch.bfloat16)  # the same address and shape, another dtype
    assert sig(x=half.view(M, K)) != sig(x=bf16.view(M, K)), "x's dtype is not in the signature"
    assert sig(x=x.clone()) == base, "x's address is in the key: a moved input never replays"
    out = torch.empty(M, N)
    assert record.outputs(out.clone()) == record.outputs(out)  # (rebound: graphs/rebind.py)
    outs = {
        "alignment": record.outputs(torch.empty(M * N + 1)[1:].view(M, N)),
        "strides": record.outputs(torch.empty(N, M).t()),
        "shape": record.outputs(out.view(N, M)),
        "dtype": record.outputs(out.view(torch.int32)),
    }
    for what, key in outs.items():
        assert key != record.outputs(out), f"the output's {what} is not in the key"


def test_record_signature_none_in_validation_mode():
    """Validation mode keeps nothing: no key."""
    x, w = torch.randn(4, 3), torch.randn(3, 2)
    assert record.signature(x, w, "all_reduce", None, "sum", "ce", 4) is not None
    guard.configure(validate=True)
    try:
        assert record.signature(x, w, "all_reduce", None, "sum", "ce", 4) is None
    finally:
        guard.configure(validate=False)


@pytest.mark.parametrize("device", ["cpu"])
def test_recorded_inputs_move_logic(device):
    """The GPU tests' cases (tests/test_gpu.py ``_recorded_inputs``, ``_moving``) on CPU
    ranks: the calls are not recorded here, but the cases, their layouts and references are
    checked."""
    from test_gpu import _moving, _recorded_inputs

    spawn(_recorded_inputs, 2, random.randrange(1 << 30), device)
    spawn(_moving, 2, random.randrange(1 << 30), device)
