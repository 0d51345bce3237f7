"""The model step: a stack of Llama-style decoder layers, tensor-parallel every way a user
could run it, checked against each other and timed in one run.

Modes (each from the same unsharded weights, every rank holding its shard):

==================  ===========================================================================
``plain``           Megatron's tensor parallelism in plain torch, eager: column linears on the
                    whole input (its gradient all-reduced once per module), row linears
                    all-reduced
``plain_sp``        the same with sequence parallelism: each module's input all-gathered once
                    (its gradient reduce-scattered), row linears reduce-scattered
``nocomm``          ``plain`` with every collective skipped: the same compute, the ceiling
``nocomm_c``        ``nocomm`` under ``torch.compile``: the compiled modes' ceiling
``overlap``         ``overlap.nn`` layers, eager (separate projections share their input:
                    ``overlap.nn.share_input``)
``overlap_sp``      the same with sequence parallelism
``overlap_sp_c``    ``overlap_sp`` under ``torch.compile``
``torch_tp``        torch's own TP + SP (DTensor, ``parallelize_module`` with torchtitan's plan:
                    ``SequenceParallel`` norms, ``PrepareModuleInput``, ``ColwiseParallel``,
                    ``RowwiseParallel(output_layouts=Shard(0))``), ``torch.compile``
``async_tp``        ``torch_tp`` with inductor's micro-pipeline TP and symmetric memory
                    (async-TP; CUDA with P2P only)
==================  ===========================================================================

Layouts: ``fused`` (one ``wqkv`` and one ``w13`` per layer, as Megatron and torchtitan lay
them out, the rows of each rank's q/k/v and gate/up adjacent so that every framework's plain
row split gives each rank its own heads) and ``separate`` (``wq``, ``wk``, ``wv``, ``w1``,
``w3``). Tokens ``[T, hidden]`` (one sequence; sequence parallel: this rank's ``T / R``
rows), causal attention with grouped KV heads, SwiGLU, RMSNorm, no biases.

Per layout and mode: ``prefill`` (forward under ``no_grad``) and ``train`` (forward +
backward of ``(y * g).sum()``), median ms over ``--iters`` rounds after ``--warmup``, the
slowest rank's; every mode of a layout is built (and compiled) first, then the modes take
turns of ``TURN`` steps within each round (``_benchrun.time_turns``: the GPU's clocks, capped
by its power, drift alike for all), the last step of a turn timed (the JSON has every
step's, ``*_turn_ms``, and the library's calls by path, ``paths``); speedups over
``plain``, ``torch_tp`` and ``async_tp``.
Every mode's output, input gradient and linear weights' gradients are checked against
``plain``'s (relative norm error under 3e-2 for 16-bit, 1e-4 for fp32, or the run fails;
the ``nocomm`` modes are not checked: they sum nothing; the norms' weights are left out:
under sequence parallelism their gradients are per-rank partial sums).

``--breakdown`` (after the modes): every collective op of a layer's forward and backward,
with and without sequence parallelism, at this run's shapes and in the layout autograd uses
(the backward multiplies by ``weight`` itself, not ``weight.t()``): cuBLAS alone, the
library's kernel alone, the collective alone, plain (cuBLAS, then the collective), the
library's op, host ms per call of each, and their results against each other; per op the
bytes one rank sends (and receives), the GB/s of the collective alone, the op's ``bound``
(the GEMM or the transfer, whichever is longer, the other all hidden; the transfer: the
collective alone, or with ``NCCL_P2P_DISABLE=1`` the host-copy bound each way where that is
faster) and what is ``left`` above it (the library's op minus the bound); then a
profile of two training steps and of two prefills of ``plain_sp`` and ``overlap_sp`` (and
without SP, and ``nocomm``): GPU time by kind of kernel, the top kernels and the idle
gaps; then the bytes a training step's collectives move per
rank (sequence parallel), the time they take alone and the GB/s that is, the host-copy bound
measured in the same run (pinned copies, every rank at once), and the share of the
collectives' time each profiled mode hides (``_bytes``; with ``NCCL_P2P_DISABLE=1`` plain's
go through NCCL's host-memory transport and the library's through its host road).

    python tools/model_bench.py                    # no GPU (or --cpu): 2 CPU ranks, gloo,
                                                   # Triton's interpreter, small sizes
    torchrun --nproc-per-node=N tools/model_bench.py [--dims 70b] [--breakdown]
    NCCL_P2P_DISABLE=1 torchrun --nproc-per-node=2 tools/model_bench.py --one-gpu

CPU and ``--one-gpu`` (two ranks time-slicing GPU 0 over gloo; no DTensor modes: gloo has
no CUDA reduce-scatter) check correctness only (``"timing_meaningful": false``).
``--eager`` runs the compiled modes uncompiled (the CPU test's quick check).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import pathlib
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _benchrun import (
    DTYPES,
    add_options,
    fill_defaults,
    launch,
    rel_err,
    time_steps,
    write_json,
)
from torch import nn

import overlap
from overlap.collectives import all_gather, reduce_scatter

SMALL = dict(layers=2, seq=32)
LARGE = dict(layers=2, seq=8192)
DIMS = {  # hidden, ffn, heads, kv_heads
    "small": (64, 128, 4, 2),
    "8b": (4096, 14336, 32, 8),
    "70b": (8192, 28672, 64, 8),
}
MODES = ("plain", "plain_sp", "nocomm", "nocomm_c", "overlap", "overlap_sp", "overlap_sp_c",
         "torch_tp", "async_tp")  # fmt: skip
SP = {"plain_sp", "overlap_sp", "overlap_sp_c", "torch_tp", "async_tp"}
COMPILED = {"nocomm_c", "overlap_sp_c", "torch_tp", "async_tp"}
# Steps per turn in the timed rounds (``_timed``); the last is timed. A step after the other
# modes' finds the activations at new addresses: while the all-gathers' records were keyed
# by address, a turn's first step ran them eagerly and its second captured them, and only
# the third replayed (8B TP 4, overlap_sp training: 19.6, 21.6, 14.1 ms; 4x H100,
# 2026-11-27); graphs/record.py now replays an updated graph from the first.
TURN = 3


# -- the model ---------------------------------------------------------------------------------
def attention(q, k, v, d: int) -> torch.Tensor:
    """Causal attention of ``q [T, heads * d]``, ``k, v [T, kv_heads * d]`` -> ``[T, heads
    * d]``; each group of ``heads / kv_heads`` query heads shares a KV head."""
    T = q.shape[0]
    q, k, v = (t.reshape(T, -1, d).transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1).reshape(T, -1)


class Attention(nn.Module):
    """``x [T, hidden]`` -> ``[T, hidden]``; ``enter``: what the input goes through first (a
    plain mode's collective)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, fused: bool) -> None:
        super().__init__()
        self.d, self.enter = hidden // heads, _identity
        widths = [heads * self.d, kv_heads * self.d, kv_heads * self.d]
        if fused:
            self.wqkv = nn.Linear(hidden, sum(widths), bias=False)
        else:
            self.wq, self.wk, self.wv = (nn.Linear(hidden, n, bias=False) for n in widths)
        self.wo = nn.Linear(widths[0], hidden, bias=False)
        self.parts = widths  # q/k/v widths of the local output (divided by R when sharded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        x = self.enter(x)
        if hasattr(self, "wqkv"):
            q, k, v = self.wqkv(x).split(self.parts, dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        return self.wo(attention(q, k, v, self.d))


class FeedForward(nn.Module):
    """SwiGLU: ``x [T, hidden]`` -> ``[T, hidden]``."""

    def __init__(self, hidden: int, ffn: int, fused: bool) -> None:
        super().__init__()
        self.enter = _identity
        if fused:
            self.w13 = nn.Linear(hidden, 2 * ffn, bias=False)
        else:
            self.w1, self.w3 = (
                nn.Linear(hidden, ffn, bias=False),
                nn.Linear(hidden, ffn, bias=False),
            )
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        x = self.enter(x)
        gate, up = (
            self.w13(x).chunk(2, dim=-1) if hasattr(self, "w13") else (self.w1(x), self.w3(x))
        )
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    """A decoder layer: ``x [T, hidden]`` (sequence parallel: ``[T / R, hidden]``) -> the same."""

    def __init__(self, hidden: int, ffn: int, heads: int, kv_heads: int, fused: bool) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.attention = Attention(hidden, heads, kv_heads, fused)
        self.feed_forward = FeedForward(hidden, ffn, fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


COLUMNS = ("attention.wqkv", "attention.wq", "attention.wk", "attention.wv", "feed_forward.w13",
           "feed_forward.w1", "feed_forward.w3")  # fmt: skip
ROWS = ("attention.wo", "feed_forward.w2")


def interleave(block: Block, R: int) -> None:
    """Reorders a fused layer's ``wqkv`` rows as ``[q_0 k_0 v_0 q_1 k_1 v_1 ...]`` and
    ``w13``'s as ``[gate_0 up_0 gate_1 up_1 ...]`` (``_r``: rank ``r``'s heads or columns), so
    that row block ``r`` of ``R`` is rank ``r``'s; sets the local q/k/v widths."""
    att, ff = block.attention, block.feed_forward
    with torch.no_grad():
        if hasattr(att, "wqkv"):
            parts = [p.chunk(R) for p in att.wqkv.weight.split(att.parts)]
            att.wqkv.weight.copy_(torch.cat([t for r in range(R) for t in (q[r] for q in parts)]))
        if hasattr(ff, "w13"):
            gate, up = (p.chunk(R) for p in ff.w13.weight.chunk(2))
            ff.w13.weight.copy_(torch.cat([t for r in range(R) for t in (gate[r], up[r])]))
    att.parts = [n // R for n in att.parts]


# -- the modes ---------------------------------------------------------------------------------
class _Enter(torch.autograd.Function):
    """A plain mode's module input: sequence parallel, the tokens all-gathered (the gradient
    reduce-scattered); else as is, the gradient all-reduced (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, x, group, sp):  # noqa: D102
        ctx.group, ctx.sp = group, sp
        if not sp:
            return x
        full = x.new_empty(x.shape[0] * dist.get_world_size(group), *x.shape[1:])
        all_gather(full, x.contiguous(), group)
        return full

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        g = g.contiguous()
        if not ctx.sp:
            dist.all_reduce(g, group=ctx.group)
            return g, None, None
        out = g.new_empty(g.shape[0] // dist.get_world_size(ctx.group), *g.shape[1:])
        reduce_scatter(out, g, ctx.group)
        return out, None, None


class _Exit(torch.autograd.Function):
    """A plain row linear's sum over the ranks: all-reduced, or (sequence parallel)
    reduce-scattered with the gradient all-gathered (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx, y, group, sp):  # noqa: D102
        ctx.group, ctx.sp = group, sp
        y = y.contiguous()
        if not sp:
            dist.all_reduce(y, group=group)
            return y
        out = y.new_empty(y.shape[0] // dist.get_world_size(group), *y.shape[1:])
        reduce_scatter(out, y, group)
        return out

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        if not ctx.sp:
            return g, None, None
        full = g.new_empty(g.shape[0] * dist.get_world_size(ctx.group), *g.shape[1:])
        all_gather(full, g.contiguous(), ctx.group)
        return full, None, None


class PlainRow(nn.Module):
    """A row linear's shard ``weight [out, in / R]``: ``x @ weight.t()`` summed over the ranks
    (``comm`` False: not summed, the ``nocomm`` ceiling)."""

    def __init__(self, weight: torch.Tensor, sp: bool, comm: bool) -> None:
        super().__init__()
        self.weight, self.sp, self.comm = nn.Parameter(weight), sp, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        y = F.linear(x, self.weight)
        return _Exit.apply(y, None, self.sp) if self.comm else y


def _shard(linear: nn.Linear, dim: int) -> torch.Tensor:
    R, r = dist.get_world_size(), dist.get_rank()
    n = linear.weight.shape[dim] // R
    return linear.weight.detach().narrow(dim, r * n, n).clone()


def build(mode: str, ref: list[Block], mesh) -> nn.Sequential:
    """``mode``'s stack from the unsharded, interleaved blocks ``ref`` (copied)."""
    sp, R = mode in SP, dist.get_world_size()
    blocks = [copy.deepcopy(b) for b in ref]
    for block in blocks:
        if mode in ("torch_tp", "async_tp"):
            _torch_tp(block, mesh)
            continue
        for name in COLUMNS + ROWS:
            parent, _, child = name.rpartition(".")
            owner = block.get_submodule(parent)
            linear = getattr(owner, child, None)
            if linear is None:
                continue
            column = name in COLUMNS
            if mode.startswith("overlap"):
                cls = overlap.nn.ColumnParallelLinear if column else overlap.nn.RowParallelLinear
                layer = cls.from_linear(linear, sequence_parallel=sp)
            elif column:
                layer = nn.Linear(linear.in_features, linear.out_features // R, bias=False)
                layer.weight = nn.Parameter(_shard(linear, 0))
            else:
                layer = PlainRow(_shard(linear, 1), sp, comm=not mode.startswith("nocomm"))
            setattr(owner, child, layer.to(linear.weight.device))
        for owner in (block.attention, block.feed_forward):
            if mode in ("plain", "plain_sp"):
                owner.enter = lambda x, sp=sp: _Enter.apply(x, None, sp)
            if mode.startswith("overlap") and not hasattr(owner, "wqkv") and \
                    not hasattr(owner, "w13"):  # fmt: skip
                columns = [getattr(owner, n) for n in ("wq", "wk", "wv", "w1", "w3")
                           if hasattr(owner, n)]  # fmt: skip
                overlap.nn.share_input(*columns)
    return nn.Sequential(*blocks)


def _torch_tp(block: Block, mesh) -> None:
    """torchtitan's TP + SP plan on ``block`` (tokens on dim 0)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    gather = dict(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),))
    plan = {
        "attention_norm": SequenceParallel(sequence_dim=0),
        "ffn_norm": SequenceParallel(sequence_dim=0),
        "attention": PrepareModuleInput(**gather),
        "feed_forward": PrepareModuleInput(**gather),
        "attention.wo": RowwiseParallel(output_layouts=Shard(0)),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(0)),
    }
    for name in COLUMNS:
        parent, _, child = name.rpartition(".")
        if hasattr(block.get_submodule(parent), child):
            plan[name] = ColwiseParallel()
    parallelize_module(block, mesh, plan)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _step(model: nn.Module, x: torch.Tensor, g: torch.Tensor):
    """Forward + backward of ``(model(x) * g).sum()``: ``(y, dx)``."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = model(x)
    (y * g).sum().backward()
    return y.detach(), x.grad


def _errors(model, x, g, ref: dict) -> dict:
    """Relative errors of ``model``'s output, input and linear weights' gradients against
    ``ref`` (``plain``'s), the slowest rank's."""
    y, dx = _step(model, x, g)
    rows = ref["rows"] if y.shape[0] != ref["y"].shape[0] else slice(None)
    grads = {n: _local(p.grad) for n, p in model.named_parameters() if "norm" not in n}
    errs = {"output": rel_err(y, ref["y"][rows]), "input_grad": rel_err(dx, ref["dx"][rows]),
            "weight_grad": max(rel_err(grads[n], w) for n, w in ref["grads"].items())}  # fmt: skip
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, errs)
    return {k: max(e[k] for e in every) for k in errs}


def _applies(mode: str, dev: torch.device) -> str | None:
    """Why ``mode`` cannot run here, or None."""
    if mode in ("torch_tp", "async_tp") and dist.get_backend() != "nccl" and dev.type == "cuda":
        return "DTensor on gloo has no CUDA reduce-scatter"
    if mode == "async_tp" and (dev.type != "cuda" or os.environ.get("NCCL_P2P_DISABLE") == "1"):
        return "async-TP needs CUDA GPUs with P2P"
    return None


def _mode_context(mode: str):
    """What ``mode`` runs under: async-TP's inductor pass and symmetric memory."""
    if mode != "async_tp":
        return contextlib.nullcontext()
    import warnings

    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    with warnings.catch_warnings():  # (deprecated, and unneeded, in newer torch)
        warnings.simplefilter("ignore")
        enable_symm_mem_for_group(dist.group.WORLD.group_name)
    return torch._inductor.config.patch(_micro_pipeline_tp=True)


def bench(args: argparse.Namespace, dev: torch.device, timing_meaningful: bool) -> None:
    """Builds, checks and times every mode of every layout (every rank)."""
    R, rank, dtype = dist.get_world_size(), dist.get_rank(), DTYPES[args.dtype]
    hidden, ffn, heads, kv_heads = DIMS[args.dims]
    if heads % R or kv_heads % R or ffn % R or args.seq % R:
        raise ValueError(f"heads ({heads}), kv_heads ({kv_heads}), ffn ({ffn}) and --seq "
                         f"({args.seq}) must be divisible by the world size ({R})")  # fmt: skip
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    mesh = None
    if any(m in ("torch_tp", "async_tp") for m in args.modes):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(dev.type, (R,))
    torch._dynamo.config.cache_size_limit = 64
    mine = slice(rank * args.seq // R, (rank + 1) * args.seq // R)
    rows, errors, skipped, failed = [], {}, {}, {}
    for layout in args.layouts:
        with torch.device(dev):
            torch.manual_seed(0)
            ref = [Block(hidden, ffn, heads, kv_heads, layout == "fused").to(dtype)
                   for _ in range(args.layers)]  # fmt: skip
            x = torch.randn(args.seq, hidden, dtype=dtype)
            g = torch.randn(args.seq, hidden, dtype=dtype)
        for block in ref:
            interleave(block, R)
        reference, ready = None, {}
        for mode in args.modes:
            why = _applies(mode, dev)
            if why:
                skipped[mode] = why
                continue
            xs, gs = (x[mine], g[mine]) if mode in SP else (x, g)
            if reference is None:  # plain: the reference every mode is checked against
                model = build(mode, ref, mesh)
                y, dx = _step(model, xs, gs)
                grads = {n: p.grad for n, p in model.named_parameters() if "norm" not in n}
                reference, model = dict(y=y, dx=dx, grads=grads, rows=mine), None
            try:  # (a mode that fails is reported, and the others still run)
                ready[mode] = _ready(args, layout, mode, ref, mesh, xs, gs, reference, errors, tol)
            except Exception as e:
                failed[f"{layout}/{mode}"] = f"{type(e).__name__}: {e}"[:800]
                print(f"rank {rank}: {layout}/{mode} failed: {failed[f'{layout}/{mode}']}")
        rows += _timed(args, layout, ready, rank, x.is_cuda)
        del ref, reference, ready
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # (the layout's memory, before the next layout's)
    _speedups(rows)
    breakdown = _breakdown(args, dev, dtype) if args.breakdown else None
    if rank == 0:
        _report(args, dev, R, timing_meaningful, rows, errors, tol, skipped, failed, breakdown)
    if failed:
        raise SystemExit(f"model_bench.py: {len(failed)} modes failed: {sorted(failed)}")


def _ready(args, layout, mode, ref, mesh, xs, gs, reference, errors, tol) -> tuple:
    """One mode of one layout built, checked against ``reference`` and called once each
    way (compiled: compiled); ``(prefill, train)``: its two steps, for ``_timed``."""
    model = build(mode, ref, mesh)
    if mode in COMPILED and not args.eager:
        for block in model:
            block.compile(dynamic=False)
    with _mode_context(mode):
        if not mode.startswith("nocomm"):  # (the ceiling skips the sums: results differ)
            errors[f"{layout}/{mode}"] = _errors(model, xs, gs, reference)
        bad = {k: v for k, v in errors.get(f"{layout}/{mode}", {}).items() if not v < tol}
        if bad:
            raise RuntimeError(f"{layout}/{mode} disagrees with plain: relative errors above "
                               f"{tol}: {bad}")  # fmt: skip
    prefill, train = _steps(model, xs, gs, mode)
    prefill()
    return prefill, train


def _steps(model: nn.Module, xs: torch.Tensor, gs: torch.Tensor, mode: str) -> tuple:
    """``(prefill, train)``: one step of ``model`` each way, under ``mode``'s context."""

    def prefill():
        with _mode_context(mode), torch.no_grad():
            model(xs)

    def train():
        with _mode_context(mode):
            _step(model, xs, gs)

    return prefill, train


def _timed(args, layout: str, ready: dict, rank: int, cuda: bool) -> list[dict]:
    """Every ready mode's prefill and train steps timed taking turns of ``TURN`` steps
    (``time_steps``); their rows: the last step's median (``*_ms``), every step's
    (``*_turn_ms``) and the library's calls by path over every step (``paths``)."""
    timed = time_steps(ready, args.iters, args.warmup, cuda, TURN)
    rows, T = [], args.seq
    for mode, r in timed.items():
        pre, train = r["prefill_ms"], r["train_ms"]
        rows.append(dict(layout=layout, mode=mode, sequence_parallel=mode in SP,
                         compiled=mode in COMPILED and not args.eager, prefill_ms=pre,
                         train_ms=train, prefill_tok_s=T / pre * 1e3,
                         train_tok_s=T / train * 1e3, prefill_turn_ms=r["prefill_turn_ms"],
                         train_turn_ms=r["train_turn_ms"], paths=r["paths"]))  # fmt: skip
        if rank == 0:
            by = ", ".join(
                f"{ph} {c['replayed']} replayed / {c['updated']} updated / {c['overlap']} eager"
                for ph, c in r["paths"].items()
                if c["replayed"] + c["updated"] + c["overlap"]
            )
            print(
                f"{layout}/{mode}: prefill {pre:.3f} ms, train {train:.3f} ms"
                + (f" (the library's overlapped calls: {by})" if by else ""),
                flush=True,
            )
    return rows


def _speedups(rows: list[dict]) -> None:
    """Each row's speedups over its layout's ``plain``, ``torch_tp`` and ``async_tp``."""
    for row in rows:
        for base in ("plain", "torch_tp", "async_tp"):
            other = [r for r in rows if r["layout"] == row["layout"] and r["mode"] == base]
            for what in ("prefill", "train"):
                row[f"{what}_x_{base}"] = (other[0][f"{what}_ms"] / row[f"{what}_ms"]
                                           if other else None)  # fmt: skip


# -- the breakdown -----------------------------------------------------------------------------
def _layer_ops(args, R: int) -> list[tuple]:
    """A layer's collective ops at this run's shapes: ``(name, collective, M, K, N, layout)``,
    ``M`` the tokens of the product, ``layout`` "nk" for ``w = weight.t()`` (the forward's)
    and "kn" for the weight itself (the input gradient's ``g @ weight``)."""
    hidden, ffn, heads, kv_heads = DIMS[args.dims]
    d, T = hidden // heads, args.seq
    q, qkv, f = heads * d // R, (heads + 2 * kv_heads) * d // R, ffn // R
    return [
        ("fwd qkv", "all_gather", T, hidden, qkv, "nk"),
        ("fwd o", "reduce_scatter", T, q, hidden, "nk"),
        ("fwd w13", "all_gather", T, hidden, 2 * f, "nk"),
        ("fwd w2", "reduce_scatter", T, f, hidden, "nk"),
        ("bwd qkv dx", "reduce_scatter", T, qkv, hidden, "kn"),
        ("bwd o dx", "all_gather", T, hidden, q, "kn"),
        ("bwd w13 dx", "reduce_scatter", T, 2 * f, hidden, "kn"),
        ("bwd w2 dx", "all_gather", T, hidden, f, "kn"),
        ("fwd o, no SP", "all_reduce", T, q, hidden, "nk"),
        ("fwd w2, no SP", "all_reduce", T, f, hidden, "nk"),
        ("bwd qkv dx, no SP", "all_reduce", T, qkv, hidden, "kn"),
        ("bwd w13 dx, no SP", "all_reduce", T, 2 * f, hidden, "kn"),
    ]


def _op_functions(coll: str, M: int, K: int, N: int, layout: str, dtype, dev) -> tuple:
    """``(functions, results)``: cuBLAS, the library's kernel alone, the collective alone,
    plain and the library's op of one layer op; ``results()`` gives plain's and the op's."""
    from overlap.bench import kernel_alone

    R, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator(device=dev).manual_seed(7 + rank)
    new = dict(device=dev, dtype=dtype)
    w = torch.randn(N, K, generator=gen, **new).t() if layout == "nk" else \
        torch.randn(K, N, generator=gen, **new)  # fmt: skip
    gathers = coll == "all_gather"
    x = torch.randn(M // R if gathers else M, K, generator=gen, **new)
    full, y = x.new_empty(M, K), x.new_empty(M, N)
    spec = overlap.collectives.collective(coll)
    out = x.new_empty(spec.result_shape((M, K), N, R) if not gathers else (M, N))
    fns = {}
    if gathers:
        all_gather(full, x, None)  # (cuBLAS alone multiplies the gathered rows)
        fns["cublas"] = lambda: torch.matmul(full, w, out=y)
        fns["comm"] = lambda: all_gather(full, x, None)

        def plain():
            all_gather(full, x, None)
            return torch.matmul(full, w, out=out)

        def lib():
            return overlap.all_gather_matmul(x, w, return_gathered=layout == "kn")
    else:
        fns["cublas"] = lambda: torch.matmul(x, w, out=y)
        p = overlap.plan(x, w, coll)
        if p.path == "overlap":
            fns["kernel"] = kernel_alone(x, w, p, rank)[0]
        fns["comm"] = lambda: spec.plain(y, out if not spec.replicated else y, None)

        def plain():
            prod = torch.matmul(x, w)
            spec.plain(prod, out, None)
            return prod if spec.replicated else out

        def lib():
            return overlap.matmul_collective(x, w, coll)

    fns["plain"], fns["overlap"] = plain, lib

    def results():
        got = lib()
        return plain().clone(), got[0] if isinstance(got, tuple) else got

    return fns, results


def _time_functions(fns: dict, iters: int, warmup: int, dev) -> dict:
    """Per function: median GPU ms and host ms per call (``overlap.tuner.time_queued``: the
    host queued ahead of the GPU), the functions taking turns; the slowest rank's."""
    from overlap.tuner import time_queued

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {k: ([], []) for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            gpu, host = time_queued(fn, dev, None)
            times[k][0].append(gpu)
            times[k][1].append(host)
    mine = {k: (statistics.median(a), statistics.median(b)) for k, (a, b) in times.items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: tuple(max(e[k][i] for e in every) for i in range(2)) for k in fns}


def _kind(name: str) -> str:
    """A kernel's kind, from its name."""
    n = name.lower()
    for kind, marks in (("nccl", ("nccl",)), ("library gemm (triton)", ("chunked_matmul",)),
                        ("cublas gemm", ("gemm", "nvjet", "cutlass", "xmma")),
                        ("attention", ("flash", "fmha", "attention", "sdpa")),
                        ("memset", ("memset",))):  # fmt: skip
        if any(m in n for m in marks):
            return kind
    if "memcpy" in n:
        return name  # (the profiler names copies by direction: "Memcpy PtoP (Device -> Device)")
    return "elementwise and other"


def _profile(step, trace: str | None, steps: int = 2) -> dict:
    """Over ``steps`` calls of ``step`` (a training step or a prefill, ``_steps``): GPU ms per
    kind of kernel, the top kernels, and the timeline per step (``_timeline``); ``trace``:
    where the Chrome trace goes (gzipped). The
    GPU sleeps first while the host queues the steps (the profiler slows the host: without
    it, up to 45% of a profiled step was the GPU waiting for the host), so that idle time on
    the GPU is waiting for a transfer or a wait the host itself made; the ranks meet at a
    barrier first (without it, at TP 4, plain's first all-reduce absorbed the ranks' skew: 7
    ms of "transfers alone")."""
    import gzip
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    dist.barrier()  # (the ranks' sleeps end together: skew would count as transfer time)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(400_000_000)  # (~0.2 s: the host queues the steps before they run)
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kinds, kernels = {}, {}
    for e in prof.key_averages():
        ms = getattr(e, "self_device_time_total", 0) / 1e3 / steps
        if ms > 0 and "spin_kernel" not in e.key:  # (not the sleep)
            kinds[_kind(e.key)] = kinds.get(_kind(e.key), 0.0) + ms
            kernels[e.key] = kernels.get(e.key, 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        text = pathlib.Path(path).read_text()
    if trace:
        pathlib.Path(trace).write_bytes(gzip.compress(text.encode()))
    timeline = _timeline(json.loads(text)["traceEvents"], steps)
    return dict(kinds=dict(sorted(kinds.items(), key=lambda kv: -kv[1])), top=top, **timeline)


def _timeline(events: list[dict], steps: int) -> dict:
    """Per step, from a Chrome trace's GPU events: ``wall_ms`` (first to last), ``compute_ms``
    (some SM kernel other than NCCL's running, on any stream), ``exposed_comm_ms`` (only
    transfers: NCCL kernels or copies), ``idle_ms`` (nothing: the GPU waited for the host or
    a stream wait); and the longest idle gaps with the events around them."""
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                  and "dur" in e), key=lambda e: e["ts"])  # fmt: skip
    # from the end of torch.cuda._sleep's kernel (work of other streams may run before it)
    start = max((e["ts"] + e["dur"] for e in gpu if "spin_kernel" in e["name"]), default=None)
    gpu = [e for e in gpu if start is None or e["ts"] >= start]
    if not gpu:
        return {}

    def comm(e):
        return e["cat"] == "gpu_memcpy" or "nccl" in e["name"].lower()

    def union(evs):
        merged = []
        for e in evs:
            a, b = e["ts"], e["ts"] + e["dur"]
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        return merged

    busy, compute = union(gpu), union([e for e in gpu if not comm(e)])
    wall = busy[-1][1] - busy[0][0]
    measure = [sum(b - a for a, b in m) for m in (busy, compute)]
    gaps = sorted(((b[0] - a[1], a[1], b[0]) for a, b in zip(busy, busy[1:], strict=False)),
                  reverse=True)[:8]  # fmt: skip

    def around(t0, t1):  # the events that end at the gap's start and begin at its end
        before = max((e for e in gpu if e["ts"] + e["dur"] <= t0), key=lambda e: e["ts"] + e["dur"])
        after = min((e for e in gpu if e["ts"] >= t1), key=lambda e: e["ts"])
        return before["name"][:60], after["name"][:60]

    ms = 1e-3 / steps
    return dict(wall_ms=wall * ms, compute_ms=measure[1] * ms,
                exposed_comm_ms=(measure[0] - measure[1]) * ms, idle_ms=(wall - measure[0]) * ms,
                gaps=[(g / 1e3, *around(t0, t1)) for g, t0, t1 in gaps])  # fmt: skip


def moved_bytes(collective: str, M: int, width: int, R: int, itemsize: int) -> int:
    """Bytes one rank sends (and as many it receives) in a ring-style collective of an
    ``[M, width]`` tensor (the all-gather's result, the reduce-scatter's and all-reduce's
    input): (R - 1) / R of it, twice for the all-reduce."""
    return (2 if collective == "all_reduce" else 1) * (R - 1) * M * width * itemsize // R


def _width(o: dict) -> int:
    """The width of the tensor an op's collective moves: the all-gather's input ``K``, the
    reductions' product ``N``."""
    return o["K"] if o["collective"] == "all_gather" else o["N"]


def _copy_bound(dev, mb: int = 64, iters: int = 10) -> dict:
    """GB/s of pinned host <-> device copies with every rank copying at once (the ranks meet
    at a barrier first): device to host alone, and each way with both directions at once
    (what a collective through host memory can reach at best)."""
    host = torch.empty(2, mb << 20, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(2, mb << 20, dtype=torch.uint8, device=dev)
    down, up = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def timed(streams) -> float:  # ms per copy, the slowest rank's
        for s in streams:
            s.wait_stream(torch.cuda.current_stream(dev))
        torch.cuda.synchronize(dev)
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for s in streams:
            s.wait_event(start)
            with torch.cuda.stream(s):
                for _ in range(iters):
                    if s is down:
                        host[0].copy_(gpu[0], non_blocking=True)
                    else:
                        gpu[1].copy_(host[1], non_blocking=True)
            torch.cuda.current_stream(dev).wait_stream(s)
        end.record()
        end.synchronize()
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, start.elapsed_time(end) / iters)
        return max(every)

    gbps = lambda ms: (mb << 20) / ms / 1e6  # noqa: E731
    return dict(one_way_gbps=gbps(timed([down])), each_way_both_gbps=gbps(timed([down, up])))


def _bytes(args, ops: list[dict], profiles: dict, bound: dict | None) -> dict:
    """Per training step and rank, sequence parallel: the bytes the layers' collectives send
    (and receive; the ops' ``bytes``), the time they take alone (the ops' ``comm``, run one at a
    time) and the GB/s that is, against the host-copy ``bound``; per profiled mode, the transfer
    time left exposed and the share of plain_sp's exposed transfer time that is gone (plain_sp's
    own exceeds the ops' ``comm`` alone: in a step its collectives also wait for the slower
    rank)."""
    sp = [o for o in ops if "no SP" not in o["op"]]
    sent = args.layers * sum(o["bytes"] for o in sp)
    alone = args.layers * sum(o["comm"] for o in sp)
    out = dict(bytes_per_rank=sent, collectives_alone_ms=alone,
               gbps=sent / alone / 1e6 if alone else None, host_copy_bound=bound)  # fmt: skip
    plain = profiles.get("plain_sp", {}).get("exposed_comm_ms")
    for mode, prof in profiles.items():
        if mode in SP and "exposed_comm_ms" in prof:
            out[f"{mode}_exposed_ms"] = prof["exposed_comm_ms"]
            out[f"{mode}_hidden_share"] = 1 - prof["exposed_comm_ms"] / plain if plain else None
            copies = {k: v for k, v in prof.get("kinds", {}).items() if "Pinned" in k}
            if copies:  # the host road's copies: the step's bytes over each direction's busy time
                out[f"{mode}_host_copy_gbps"] = {k: sent / ms / 1e6 for k, ms in copies.items()}
    return out


def _breakdown(args, dev, dtype) -> dict:
    """Every collective op of a layer, plain against the library's (``_layer_ops``); on GPUs,
    the kernels of a training step and of a prefill per mode (fused layout)."""
    R, ops = dist.get_world_size(), []
    for name, coll, M, K, N, layout in _layer_ops(args, R):
        fns, results = _op_functions(coll, M, K, N, layout, dtype, dev)
        t = _time_functions(fns, args.iters, args.warmup, dev)
        want, got = results()
        row = dict(op=name, collective=coll, M=M, K=K, N=N, layout=layout,
                   error=rel_err(got, want), **{k: v[0] for k, v in t.items()},
                   **{f"host_{k}": v[1] for k, v in t.items()})  # fmt: skip
        row["saved"] = row["plain"] - row["overlap"]
        hideable = row["plain"] - max(row["cublas"], row["comm"])
        row["eta"] = row["saved"] / hideable if hideable > 0 else None
        ops.append(row)
        del fns, results
    profiles = {}
    if dev.type == "cuda":
        hidden, ffn, heads, kv_heads = DIMS[args.dims]
        with torch.device(dev):
            torch.manual_seed(0)
            ref = [Block(hidden, ffn, heads, kv_heads, True).to(dtype) for _ in range(args.layers)]
            x = torch.randn(args.seq, hidden, dtype=dtype)
            g = torch.randn(args.seq, hidden, dtype=dtype)
        for block in ref:
            interleave(block, R)
        mine = slice(dist.get_rank() * args.seq // R, (dist.get_rank() + 1) * args.seq // R)
        for mode in ("plain", "overlap", "plain_sp", "overlap_sp", "nocomm"):
            xs, gs = (x[mine], g[mine]) if mode in SP else (x, g)
            trace = f"{args.out}.{mode}.trace.json.gz" if dist.get_rank() == 0 else None
            prefill, train = _steps(build(mode, ref, None), xs, gs, mode)
            profiles[mode] = _profile(train, trace)
            profiles[f"{mode} prefill"] = _profile(prefill, None)
            del prefill, train
            torch.cuda.empty_cache()
    bound = _copy_bound(dev) if dev.type == "cuda" else None
    itemsize = torch.empty(0, dtype=dtype).element_size()
    # the transfer at best: NCCL's collective alone, or through host memory (no P2P) the
    # copy engines at the host-copy bound each way both at once, if faster (at 4 ranks NCCL's
    # SM-driven host transport beat it: 23-25 GB/s against 18.9, 4 H100s, 2026-11-27)
    host = bound if os.environ.get("NCCL_P2P_DISABLE") == "1" else None
    for o in ops:
        o["bytes"] = moved_bytes(o["collective"], o["M"], _width(o), R, itemsize)
        o["comm_gbps"] = o["bytes"] / o["comm"] / 1e6 if o["comm"] > 0 else None
        move = o["comm"]
        if host:
            move = min(move, o["bytes"] / host["each_way_both_gbps"] / 1e6)
        o["bound"] = max(o["cublas"], move)  # (ms: the GEMM or the transfer, all hidden)
        o["left"] = o["overlap"] - o["bound"]
    return dict(ops=ops, profiles=profiles, bytes=_bytes(args, ops, profiles, bound))


def _report(args, dev, R, timing_meaningful, rows, errors, tol, skipped, failed, breakdown):
    """Prints the tables and writes the JSON (rank 0)."""
    print(f"{'layout':8} {'mode':12} {'prefill ms':>10} {'train ms':>9} {'x plain p/t':>12} "
          f"{'x torch_tp p/t':>15} {'x async_tp p/t':>15}")  # fmt: skip

    def pair(r, base):
        a, b = r[f"prefill_x_{base}"], r[f"train_x_{base}"]
        return "-" if a is None else f"{a:.3f}/{b:.3f}"

    for r in rows:
        print(
            f"{r['layout']:8} {r['mode']:12} {r['prefill_ms']:10.3f} {r['train_ms']:9.3f} "
            f"{pair(r, 'plain'):>12} {pair(r, 'torch_tp'):>15} {pair(r, 'async_tp'):>15}"
        )
    for mode, why in skipped.items():
        print(f"{mode}: not run ({why})")
    for mode, why in failed.items():
        print(f"{mode}: FAILED: {why}")
    print("relative errors against plain:", json.dumps(errors))
    if breakdown:
        cols = ("cublas", "kernel", "comm", "plain", "overlap", "saved", "bound", "left")
        print(f"\n{'op':18} {'MxKxN':>17} {'lay':3} " + " ".join(f"{c:>7}" for c in cols)
              + f" {'eta':>5} {'MB':>6} {'GB/s':>5} {'host p/o':>11} {'err':>8}")  # fmt: skip
        for o in breakdown["ops"]:
            cells = " ".join("      -" if o.get(c) is None else f"{o[c]:7.3f}" for c in cols)
            eta = "-" if o["eta"] is None else f"{o['eta']:.2f}"
            shape = "x".join(str(o[k]) for k in "MKN")
            rate = "-" if o["comm_gbps"] is None else f"{o['comm_gbps']:.1f}"
            print(
                f"{o['op']:18} {shape:>17} {o['layout']:3} {cells} {eta:>5} "
                f"{o['bytes'] / 1e6:6.1f} {rate:>5} "
                f"{o['host_plain']:5.3f}/{o['host_overlap']:5.3f} {o['error']:8.1e}"
            )
        saved = sum(o["saved"] for o in breakdown["ops"] if "no SP" not in o["op"])
        print(f"\nthe sequence-parallel ops' savings alone add up to {saved:.3f} ms per layer")
        b = breakdown["bytes"]
        gb, alone = b["bytes_per_rank"] / 1e9, b["collectives_alone_ms"]
        rate = b["gbps"] or 0
        print(
            f"a training step's collectives (sequence parallel) send {gb:.3f} GB per rank "
            f"and receive as much; alone they take {alone:.2f} ms: {rate:.1f} GB/s"
        )
        if b["host_copy_bound"]:
            h = b["host_copy_bound"]
            print(f"host-copy bound, every rank at once: {h['one_way_gbps']:.1f} GB/s one way, "
                  f"{h['each_way_both_gbps']:.1f} GB/s each way both at once")  # fmt: skip
        if b.get("overlap_sp_hidden_share") is not None:
            print(f"transfers alone on the GPU per step: plain_sp {b['plain_sp_exposed_ms']:.2f} "
                  f"ms, overlap_sp {b['overlap_sp_exposed_ms']:.2f} ms: "
                  f"{100 * b['overlap_sp_hidden_share']:.0f}% of plain_sp's hidden")  # fmt: skip
        for kind, gbps in b.get("overlap_sp_host_copy_gbps", {}).items():
            print(f"overlap_sp's {kind}: {gbps:.1f} GB/s while busy")
        for mode, prof in breakdown["profiles"].items():
            what = "prefill" if mode.endswith(" prefill") else "training step"
            print(f"\n{mode}: per {what} {prof['wall_ms']:.2f} ms on the GPU: compute "
                  f"{prof['compute_ms']:.2f}, transfers alone {prof['exposed_comm_ms']:.2f}, "
                  f"idle {prof['idle_ms']:.2f}; by kind of kernel: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in prof["kinds"].items()))  # fmt: skip
            for gap, before, after in prof["gaps"][:4]:
                print(f"   idle {gap:.3f} ms after {before} before {after}")
    write_json(args, dev, R, timing_meaningful, rows, errors, tol)
    if breakdown or skipped or failed:  # (added to the JSON write_json wrote)
        path = pathlib.Path(args.out)
        data = json.loads(path.read_text())
        data.update(skipped=skipped, failed=failed, breakdown=breakdown)
        path.write_text(json.dumps(data, indent=1) + "\n")


def add_dims(ap: argparse.ArgumentParser) -> None:
    """``--dims`` (``DIMS``; ``hf_bench.py`` builds its models at them too)."""
    ap.add_argument(
        "--dims",
        choices=tuple(DIMS),
        default=None,
        help="hidden, ffn, heads, kv heads (default: small on CPU, 8b on GPUs)",
    )


def main() -> None:
    """Parses the arguments; spawns 2 CPU ranks, or runs as a torchrun worker."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(ap, SMALL, "bench_out/model_bench.json")
    add_dims(ap)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated (plain first)")
    ap.add_argument("--layouts", default="fused,separate")
    ap.add_argument("--eager", action="store_true", help="compiled modes run uncompiled")
    ap.add_argument("--breakdown", action="store_true", help="every collective op, and profiles")
    args = ap.parse_args()
    cpu = fill_defaults(args, SMALL, LARGE)
    args.dims = args.dims or ("small" if cpu else "8b")
    args.modes = [m for m in args.modes.split(",") if m]
    args.layouts = [x for x in args.layouts.split(",") if x]
    bad = [m for m in args.modes if m not in MODES] + \
        [x for x in args.layouts if x not in ("fused", "separate")]  # fmt: skip
    if bad or not args.modes or args.modes[0] != "plain":
        sys.exit(f"model_bench.py: --modes from {MODES}, plain first; --layouts from fused, "
                 f"separate (got {bad or args.modes})")  # fmt: skip
    launch(args, cpu, bench, "model_bench.py")


if __name__ == "__main__":
    main()
