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
prints a table and writes ``--out``. The linears carry no bias (the example's ``o`` bias is
dropped). torch's async-TP is not a mode yet (to be added where it runs, on 2+ GPUs).

    python tools/model_bench.py                    # no GPU (or --cpu): 2 CPU ranks, gloo,
                                                   # Triton's interpreter, small sizes
    NCCL_P2P_DISABLE=1 torchrun --nproc-per-node=2 tools/model_bench.py --one-gpu
    torchrun --nproc-per-node=N tools/model_bench.py --layers 2 --seq 4096

On GPUs each mode also gets its host time (``prefill_host_ms``, ``train_host_ms``, and
``_min``: the median and least wall time to issue one prefill forward, one training step, the
slowest rank's; ``host_ratio_*``: the median over rounds of the library's time over plain
torch's in the same round) with the GPU kept ahead: every issue follows a
``torch.cuda._sleep`` longer than it takes, the four issues of a round alternate in order,
and an issue that the GPU caught up with (its event after the sleep done before the issue
ended) is counted in ``host_issues_caught_up``. ``--profile PATH``: rank 0's cProfile of the
library's training step (the backward on the calling thread), own time first.

CPU and ``--one-gpu`` (two ranks time-slicing GPU 0 over gloo) check correctness only: their
JSON says ``"timing_meaningful": false``. Host times are meaningful on ``--one-gpu`` too, but
gloo's collectives on CUDA tensors wait on the host for the GPU, so there torch's collectives
(the plain mode's and the library's plain-path ones) are issued on each rank's one-rank NCCL
group instead (``_nccl_issue_cost``): the host pays what a NCCL collective costs to issue, no
data move, and the results of those timed rounds are wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import io
import json
import pathlib
import pstats
import statistics
import time

import torch
import torch.distributed as dist
from _benchrun import (
    DTYPES,
    add_options,
    fill_defaults,
    launch,
    load,
    rel_err,
    time_ms,
    write_json,
)
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = dict(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, seq=32)
LARGE = dict(layers=2, hidden=4096, ffn=14336, heads=32, kv_heads=8, seq=4096)


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


def _step(model: nn.Module, x: torch.Tensor, g: torch.Tensor):
    """Forward + backward of ``(model(x) * g).sum()``; returns y, dx and the parameters."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = model(x)
    (y * g).sum().backward()
    return y.detach(), x.grad, dict(model.named_parameters())


@contextlib.contextmanager
def _nccl_issue_cost():
    """torch's collectives on CUDA tensors issued on this rank's one-rank NCCL group (see the
    module docstring): same calls, this rank's part only."""
    rank, R = dist.get_rank(), dist.get_world_size()
    mine = [dist.new_group([r], backend="nccl") for r in range(R)][rank]
    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
             "reduce_scatter_tensor", "reduce_scatter_single")  # fmt: skip
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def first(t, n):  # the leading rows that a one-rank collective of n rows writes or reads
        return t.narrow(0, 0, n)

    def gather(out, t, *a, **k):
        return saved["all_gather_into_tensor"](first(out, t.shape[0]), t, group=mine)

    def scatter(out, t, *a, **k):
        return saved["reduce_scatter_tensor"](out, first(t, out.shape[0]), group=mine)

    patches = dict(
        all_reduce=lambda t, *a, **k: saved["all_reduce"](t, group=mine),
        all_gather=lambda parts, t, *a, **k: saved["all_gather"](parts[:1], t, group=mine),
        all_gather_into_tensor=gather, all_gather_single=gather,
        reduce_scatter_tensor=scatter, reduce_scatter_single=scatter,
    )  # fmt: skip
    for n in saved:
        setattr(dist, n, patches[n])
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


def host_ms(fns: dict, rounds: int, warmup: int) -> tuple[dict, int]:
    """Host milliseconds to issue each of ``fns`` (name -> callable) with the GPU kept ahead,
    per round (the slowest rank's; every round issues each once, in turn, the order reversed
    every other round), and in how many issues the GPU caught up with the host (any rank)."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record(), torch.cuda._sleep(10_000_000), ev[1].record(), ev[1].synchronize()
    per_ms = 10_000_000 / ev[0].elapsed_time(ev[1])  # sleep cycles per ms
    times, caught, ahead = {k: [] for k in fns}, 0, 50.0  # ms of sleep queued before each issue
    for i in range(warmup + rounds):
        for name in list(fns)[:: 1 if i % 2 else -1]:
            dist.barrier()
            torch.cuda._sleep(int(ahead * per_ms))
            slept = torch.cuda.Event()
            slept.record()
            t0 = time.perf_counter()
            fns[name]()
            t = (time.perf_counter() - t0) * 1e3
            done = slept.query()
            torch.cuda.synchronize()
            if i >= warmup:  # (a warm-up issue may be slow once: no longer sleeps after it)
                ahead = min(max(ahead, 3 * t), 500.0)
                times[name].append(t)
                caught += done
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (times, caught))
    slowest = {k: [max(e[0][k][j] for e in every) for j in range(rounds)] for k in fns}
    return slowest, sum(e[1] for e in every)


def _prefill(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def _profile(step, rounds: int, path: str | None) -> None:
    """cProfile of ``rounds`` calls of ``step`` (the backward on this thread), own time first,
    written to ``path`` (every rank steps; None: this rank writes nothing)."""
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        for _ in range(rounds):
            dist.barrier()
            torch.cuda._sleep(50_000_000)
            prof.enable()
            step()
            prof.disable()
            torch.cuda.synchronize()
    if path is None:
        return
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    buf.write(f"{rounds} training steps under cProfile (its overhead included)\n")
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats("overlap", 40)
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(path).write_text(buf.getvalue())


def bench(args: argparse.Namespace, dev: torch.device, timing_meaningful: bool) -> None:
    """Builds, checks and times both modes for each sequence-parallel setting (every rank)."""
    ex = load(ROOT / "examples" / "tp_transformer.py", "tp_transformer")
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
        errs = {"output": rel_err(y1, y0), "input_grad": rel_err(dx1, dx0),
                "weight_grad": max(rel_err(p1[n].grad, p0[n].grad) for n in p0)}  # fmt: skip
        every = [None] * R
        dist.all_gather_object(every, errs)
        errors[f"sp={int(sp)}"] = errs = {k: max(e[k] for e in every) for k in errs}
        bad = {k: v for k, v in errs.items() if not v < tol}
        if bad:
            raise RuntimeError(f"overlap disagrees with plain (sequence_parallel={sp}): relative "
                               f"errors above {tol}: {bad}")  # fmt: skip
        for mode, model in models.items():
            with torch.no_grad():
                pre = time_ms(lambda: model(xs), args.iters, args.warmup, dev.type == "cuda")
            train = time_ms(
                lambda: _step(model, xs, gs), args.iters, args.warmup, dev.type == "cuda"
            )
            rows.append(dict(mode=mode, sequence_parallel=sp, prefill_ms=pre,
                             prefill_tok_s=args.seq / pre * 1e3, train_ms=train,
                             train_tok_s=args.seq / train * 1e3))  # fmt: skip
        if dev.type == "cuda":
            proxy = _nccl_issue_cost() if dist.get_backend() == "gloo" else contextlib.nullcontext()
            with proxy:
                fns = {}
                for mode, model in models.items():
                    fns["prefill", mode] = lambda m=model: _prefill(m, xs)
                    fns["train", mode] = lambda m=model: _step(m, xs, gs)
                host, caught = host_ms(fns, args.iters, args.warmup)
                for row in rows[-2:]:
                    for what in ("prefill", "train"):
                        mine, plain = host[what, row["mode"]], host[what, "plain"]
                        row[f"{what}_host_ms"] = statistics.median(mine)
                        row[f"{what}_host_ms_min"] = min(mine)
                        row[f"host_ratio_{what}"] = statistics.median(
                            a / b for a, b in zip(mine, plain, strict=True)
                        )
                    row["host_issues_caught_up"] = caught
                if args.profile:  # every rank steps (the calls are collectives); rank 0 writes
                    lib, where = models["overlap"], f"{args.profile}.sp{int(sp)}.txt"
                    _profile(lambda: _step(lib, xs, gs), args.iters, where if rank == 0 else None)
        base = rows[-2]
        for row in rows[-2:]:
            row["speedup_prefill"] = base["prefill_ms"] / row["prefill_ms"]
            row["speedup_train"] = base["train_ms"] / row["train_ms"]
        del models, tp, plain, p0, p1  # free this setting's memory before the next
    if rank == 0:
        _report(args, dev, R, timing_meaningful, rows, errors, tol)


def _report(args, dev, R, timing_meaningful, rows, errors, tol) -> None:
    """Prints the table and writes the JSON (rank 0)."""
    head = f"{'mode':8} {'sp':>2} {'prefill ms':>11} {'prefill tok/s':>14} {'train ms':>10} " \
           f"{'train tok/s':>12} {'speedup p/t':>12}"  # fmt: skip
    host = "train_host_ms" in rows[0]
    print(head + (f" {'host ms p/t':>15} {'host x plain p/t':>17}" if host else ""))
    for r in rows:
        print(f"{r['mode']:8} {int(r['sequence_parallel']):>2} {r['prefill_ms']:11.3f} "
              f"{r['prefill_tok_s']:14.0f} {r['train_ms']:10.3f} {r['train_tok_s']:12.0f} "
              f"{r['speedup_prefill']:5.2f}/{r['speedup_train']:.2f}" + (
              f" {r['prefill_host_ms']:7.2f}/{r['train_host_ms']:<7.2f} "
              f"{r['host_ratio_prefill']:8.2f}/{r['host_ratio_train']:.2f}"
              if host else ""))  # fmt: skip
    print("relative errors overlap vs plain:", json.dumps(errors))
    write_json(args, dev, R, timing_meaningful, rows, errors, tol)


def main() -> None:
    """Parses the arguments; spawns 2 CPU ranks, or runs as a torchrun worker."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(ap, SMALL, "bench_out/model_bench.json")
    ap.add_argument("--sequence-parallel", choices=("0", "1", "both"), default="both")
    ap.add_argument("--profile", metavar="PATH", help="GPU: cProfile of the library's step "
                    "(rank 0) to PATH.sp0.txt / PATH.sp1.txt")  # fmt: skip
    args = ap.parse_args()
    launch(args, fill_defaults(args, SMALL, LARGE), bench, "model_bench.py")


if __name__ == "__main__":
    main()
