"""Model-level benchmark: a stack of L tensor-parallel Llama-style decoder layers (the layer of
``examples/tp_transformer.py``) in two modes, tokens per second and the speedup.

- ``plain``: the linears as plain torch (Megatron's conventions): column = ``x @ w.t()``
  (sequence parallel: ``all_gather_into_tensor`` of the tokens first), input gradient
  all-reduced (reduce-scattered); row = matmul then ``all_reduce`` (``reduce_scatter_tensor``),
  gradient all-gathered under sequence parallelism.
- ``overlap``: ``overlap.nn.ColumnParallelLinear`` / ``RowParallelLinear``.

Both modes are sharded from one unsharded stack (same seed on every rank). Per mode and
sequence-parallel setting: ``prefill`` (forward under ``no_grad``) and ``train`` (forward +
backward of ``(y * g).sum()``), the median over ``--iters``; tokens/s = ``--seq`` / time. The
overlap mode's output, input and weight gradients are checked against the plain mode's once
per setting (relative norm error, 1e-4 fp32, 3e-2 bf16/fp16; above it the run fails). Rank 0
prints a table and writes ``--json``. The linears carry no bias (the example's ``o`` bias is
dropped). torch's async-TP is not a mode yet (to be added where it runs, on 2+ GPUs).

    python tools/model_bench.py                    # no GPU (or --cpu): 2 CPU ranks, gloo,
                                                   # Triton's interpreter, small sizes
    NCCL_P2P_DISABLE=1 torchrun --nproc-per-node=2 tools/model_bench.py --one-gpu
    torchrun --nproc-per-node=N tools/model_bench.py --layers 2 --seq 4096

CPU and ``--one-gpu`` (two ranks time-slicing GPU 0 over gloo) check correctness only: their
JSON says ``"timing_meaningful": false``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = dict(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, seq=32)
LARGE = dict(layers=2, hidden=4096, ffn=14336, heads=32, kv_heads=8, seq=4096)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """``[T / R, ...]`` of every rank -> ``[T, ...]``."""
    full = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
    dist.all_gather_into_tensor(full, x.contiguous(), group=group)
    return full


def _reduce(y: torch.Tensor, group, sp: bool) -> torch.Tensor:
    """Sum over the ranks: all-reduce, or (``sp``) reduce-scatter of the rows."""
    y = y.contiguous()
    if not sp:
        dist.all_reduce(y, group=group)
        return y
    out = y.new_empty((y.shape[0] // dist.get_world_size(group), *y.shape[1:]))
    dist.reduce_scatter_tensor(out, y, group=group)
    return out


def _wgrad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


class _PlainColumn(torch.autograd.Function):
    """``x @ w.t()``, ``w [out / R, in]``; sp: tokens gathered first, dx reduce-scattered."""

    @staticmethod
    def forward(ctx, x, w, group, sp):  # noqa: D102
        full = _gather_rows(x, group) if sp else x
        ctx.save_for_backward(full, w)
        ctx.group, ctx.sp = group, sp
        return full @ w.t()

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        full, w = ctx.saved_tensors
        return _reduce(g @ w, ctx.group, ctx.sp), _wgrad(g, full), None, None


class _PlainRow(torch.autograd.Function):
    """``x @ w.t()`` summed over the ranks, ``w [out, in / R]``; sp: reduce-scattered, the
    gradient all-gathered."""

    @staticmethod
    def forward(ctx, x, w, group, sp):  # noqa: D102
        ctx.save_for_backward(x, w)
        ctx.group, ctx.sp = group, sp
        return _reduce(x @ w.t(), group, sp)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        x, w = ctx.saved_tensors
        g = _gather_rows(g, ctx.group) if ctx.sp else g
        return g @ w, _wgrad(g, x), None, None


class PlainLinear(nn.Module):
    """This rank's shard of ``linear`` as ``overlap.nn``'s ``from_linear`` cuts it: ``dim``
    0 (column) takes rows of the weight, 1 (row) columns."""

    def __init__(self, linear: nn.Linear, dim: int, sp: bool, group=None) -> None:
        super().__init__()
        R, r = dist.get_world_size(group), dist.get_rank(group)
        n = linear.weight.shape[dim] // R
        self.weight = nn.Parameter(linear.weight.detach().narrow(dim, r * n, n).clone())
        self.fn, self.group, self.sp = (_PlainColumn, _PlainRow)[dim], group, sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.fn.apply(x, self.weight, self.group, self.sp)


def plain_layer(layer: nn.Module, sp: bool) -> nn.Module:
    """An unsharded ``DecoderLayer`` converted: q/k/v/gate/up plain column, o/down plain row."""
    layer, R = copy.deepcopy(layer), dist.get_world_size()
    if layer.kv_heads % R:
        raise ValueError(f"kv_heads ({layer.kv_heads}) must be divisible by R ({R})")
    layer.heads, layer.kv_heads = layer.heads // R, layer.kv_heads // R
    for name in ("q", "k", "v", "gate", "up", "o", "down"):
        dim = 1 if name in ("o", "down") else 0
        setattr(layer, name, PlainLinear(getattr(layer, name), dim, sp))
    return layer


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _step(model: nn.Module, x: torch.Tensor, g: torch.Tensor):
    """Forward + backward of ``(model(x) * g).sum()``; returns y, dx and the parameters."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = model(x)
    (y * g).sum().backward()
    return y.detach(), x.grad, dict(model.named_parameters())


def _time(fn: Callable[[], object], iters: int, warmup: int, cuda: bool) -> float:
    """Median milliseconds of ``fn`` over ``iters`` calls after ``warmup``, the slowest rank's."""
    times = []
    for i in range(warmup + iters):
        if cuda:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record(), fn(), ev[1].record(), ev[1].synchronize()
            t = ev[0].elapsed_time(ev[1])
        else:
            t0 = time.perf_counter()
            fn()
            t = (time.perf_counter() - t0) * 1e3
        times += [t] if i >= warmup else []
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, statistics.median(times))
    return max(every)


def bench(args: argparse.Namespace, dev: torch.device, timing_meaningful: bool) -> None:
    """Builds, checks and times both modes for each sequence-parallel setting (every rank)."""
    spec = importlib.util.spec_from_file_location("tp_transformer", ROOT / "examples" /
                                                  "tp_transformer.py")  # fmt: skip
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    R, rank, dtype = dist.get_world_size(), dist.get_rank(), DTYPES[args.dtype]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    with torch.device(dev):
        torch.manual_seed(0)
        ref = [ex.DecoderLayer(args.hidden, args.heads, args.kv_heads, args.ffn)
               for _ in range(args.layers)]  # fmt: skip
        x = torch.randn(args.seq, 1, args.hidden, dtype=dtype)
        g = torch.randn(args.seq, 1, args.hidden, dtype=dtype)
    for layer in ref:
        layer.o.bias = None
        layer.to(dtype)
    sps = {"0": [False], "1": [True], "both": [False, True]}[args.sequence_parallel]
    rows, errors = [], {}
    for sp in sps:
        if sp and args.seq % R:
            raise ValueError(f"--seq ({args.seq}) must be divisible by the world size ({R})")
        mine = slice(rank * args.seq // R, (rank + 1) * args.seq // R) if sp else slice(None)
        xs, gs = x[mine].contiguous(), g[mine].contiguous()
        tp = [ex.TPDecoderLayer(copy.deepcopy(ly), sequence_parallel=sp) for ly in ref]
        plain = [plain_layer(ly, sp) for ly in ref]
        models = {"plain": nn.Sequential(*plain), "overlap": nn.Sequential(*tp)}
        (y0, dx0, p0), (y1, dx1, p1) = (_step(models[m], xs, gs) for m in ("plain", "overlap"))
        errs = {"output": _err(y1, y0), "input_grad": _err(dx1, dx0),
                "weight_grad": max(_err(p1[n].grad, p0[n].grad) for n in p0)}  # fmt: skip
        every = [None] * R
        dist.all_gather_object(every, errs)
        errors[f"sp={int(sp)}"] = errs = {k: max(e[k] for e in every) for k in errs}
        bad = {k: v for k, v in errs.items() if not v < tol}
        if bad:
            raise RuntimeError(f"overlap disagrees with plain (sequence_parallel={sp}): relative "
                               f"errors above {tol}: {bad}")  # fmt: skip
        for mode, model in models.items():
            with torch.no_grad():
                pre = _time(lambda: model(xs), args.iters, args.warmup, dev.type == "cuda")
            train = _time(lambda: _step(model, xs, gs), args.iters, args.warmup, dev.type == "cuda")
            rows.append(dict(mode=mode, sequence_parallel=sp, prefill_ms=pre,
                             prefill_tok_s=args.seq / pre * 1e3, train_ms=train,
                             train_tok_s=args.seq / train * 1e3))  # fmt: skip
        base = rows[-2]
        for row in rows[-2:]:
            row["speedup_prefill"] = base["prefill_ms"] / row["prefill_ms"]
            row["speedup_train"] = base["train_ms"] / row["train_ms"]
        del models, tp, plain, p0, p1  # free this setting's memory before the next
    if rank == 0:
        _report(args, dev, R, timing_meaningful, rows, errors, tol)


def _report(args, dev, R, timing_meaningful, rows, errors, tol) -> None:
    """Prints the table and writes the JSON (rank 0)."""
    import triton

    head = f"{'mode':8} {'sp':>2} {'prefill ms':>11} {'prefill tok/s':>14} {'train ms':>10} " \
           f"{'train tok/s':>12} {'speedup p/t':>12}"  # fmt: skip
    print(head)
    for r in rows:
        print(f"{r['mode']:8} {int(r['sequence_parallel']):>2} {r['prefill_ms']:11.3f} "
              f"{r['prefill_tok_s']:14.0f} {r['train_ms']:10.3f} {r['train_tok_s']:12.0f} "
              f"{r['speedup_prefill']:5.2f}/{r['speedup_train']:.2f}")  # fmt: skip
    print("relative errors overlap vs plain:", json.dumps(errors))
    if not timing_meaningful:
        print("timings mean nothing here (CPU, or two ranks sharing one GPU): correctness only")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    date = datetime.datetime.now().isoformat(timespec="seconds")
    out = dict(config={k: v for k, v in vars(args).items() if k != "json"}, world_size=R,
               backend=dist.get_backend(), device=name, torch=torch.__version__,
               triton=triton.__version__, date=date, timing_meaningful=timing_meaningful,
               tolerance=tol, errors=errors, rows=rows)  # fmt: skip
    path = pathlib.Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


def _cpu_rank(rank: int, world: int, init_file: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        bench(args, torch.device("cpu"), False)
    finally:
        dist.destroy_process_group()


def main() -> None:
    """Parses the arguments; spawns 2 CPU ranks, or runs as a torchrun worker."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in SMALL:
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    ap.add_argument("--sequence-parallel", choices=("0", "1", "both"), default="both")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--json", default="bench_results/model_bench.json")
    ap.add_argument("--cpu", action="store_true", help="2 CPU ranks even with GPUs")
    ap.add_argument("--one-gpu", action="store_true", help="2 ranks on GPU 0 over gloo")
    args = ap.parse_args()
    cpu = args.cpu or not torch.cuda.is_available()
    for k, v in (SMALL if cpu else LARGE).items():
        setattr(args, k, v if getattr(args, k) is None else getattr(args, k))
    for k, v in dict(dtype=("bf16", "fp32"), iters=(20, 2), warmup=(5, 1)).items():
        setattr(args, k, v[cpu] if getattr(args, k) is None else getattr(args, k))
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before overlap defines a kernel (spawn inherits)
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_cpu_rank, args=(2, os.path.join(d, "init"), args), nprocs=2)
        return
    if "RANK" not in os.environ:
        sys.exit("run under torchrun: torchrun --nproc-per-node=N tools/model_bench.py (N GPUs), "
                 "or on one GPU: NCCL_P2P_DISABLE=1 torchrun --nproc-per-node=2 "
                 "tools/model_bench.py --one-gpu (correctness only); --cpu: CPU ranks")  # fmt: skip
    local = 0 if args.one_gpu else int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    if args.one_gpu:
        os.environ.setdefault("NCCL_P2P_DISABLE", "1")  # the copy engines' host road
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl", device_id=dev)
    try:
        bench(args, dev, not args.one_gpu)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
