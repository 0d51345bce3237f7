"""One GPU: every kernel the library launches in place of a matmul, against cuBLAS, over the shapes
of real models. Prints a table and writes JSON.

    python tools/gemm_sweep.py OUT.json [--suite bench|models|all] [--dtypes bf16,fp16]
        [--layouts nk,kn] [--kernels ar,rs,ce,cel,cbar,cbrs,ce:128x256x64/8/3,ce@main]
        [--configs "BM,BN,BK,W,S;..."] [--fp32] [--baseline NAME=matmul.py ...]

Kernels (each with the plan the library makes for it, world size = the shape's TP degree):

- ``ar``: the NCCL path's chunk GEMM on an all-reduce plan (row bands of the standard layout);
- ``rs``: the same on a reduce-scatter plan (each band one run per rank);
- ``ce``: the copy engines' fused kernel (blocked all-reduce plan, rank 0, the peers' partials
  added from receive slots whose flags are already set);
- ``cel``: the kernel on the copy engines' blocked plan without the fused epilogue (every tile
  to its slot, one program per tile): the band layout alone, for ``ce`` against ``ar``;
- ``cbar``, ``cbrs``: cuBLAS per chunk into the slots of the ``ar`` and ``rs`` plans;
- ``tri``, ``trip``: what Triton gives at best on this chip, the floor of this design: a plain
  matmul through TMA descriptors (no chunks, counters or epilogue), one program per tile
  (``tri``, what NCCL per chunk's plans may launch) or one per SM (``trip``, the copy
  engines' road); with several tile configs, the JSON's summary also has ``KIND best``, per
  shape the fastest.

A kernel named ``KIND:BMxBNxBK/W/S`` runs with that tile config (``--configs``: every kernel). A
kernel name may end in ``@NAME``: the same kernel through ``--baseline NAME=PATH``, a copy of
another version's ``overlap/gemm/matmul.py`` (e.g. ``git show main:overlap/gemm/matmul.py``, its
``from ..`` imports made ``from overlap.``), for an A/B in one run.

Shapes (``--suite``): ``bench``, the benchmark's four; ``models``, the q/k/v, o, gate+up and
down projections of Llama-3-8B (hidden 4096, FFN 14336, 32 heads, 8 KV heads), Llama-3-70B
(8192, 28672, 64, 8) and Qwen2.5-32B (5120, 27648, 40, 8) at TP = 2, 4, 8 with M in {1024, 4096,
16384}, plus ragged M (1000, 3000); ``all``, both. Column-parallel projections (q/k/v, gate+up)
are ``[M, hidden] @ [hidden, out / TP]``, row-parallel ones (o, down) ``[M, in / TP] @ [in / TP,
hidden]``. Layouts: ``nk`` is ``w = weight.t()`` (nn.Linear), ``kn`` a row-major ``[K, N]``
weight. Products the planner leaves on the plain path get the 2-chunk plan that ``chunks=2``
forces (what the planner's rule gives them); the summary also covers products of at least
``BIG`` FLOP alone (the rows ">=2e11", comparable with earlier sweeps). Times:
``triton.testing.do_bench`` medians (L2 flushed), the kernels and cuBLAS taking turns (every
other turn in reverse order); each
product checked against cuBLAS's and the counters against the plan. ``--configs`` replaces the
library's tile config (a variant per config); ``--fp32``: fp32 inputs (the kernel's tf32x3
against cuBLAS fp32).

About 4 minutes on an H200 for ``--suite all``. Back-to-back ``do_bench`` puts the kernel
further behind cuBLAS than the op bench's timing (a ~1 ms GPU sleep before each call): 9-20%
against 5-7% at K = 4096; and a sweep's median moves ~5% between machines: compare kernels
within one run (``--baseline``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch
import triton
import triton.language as tl
from _benchrun import load
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

import overlap.gemm
from overlap.bench import kernel_alone
from overlap.plan import Tiles, make_plan, tiles_for

_BASE = {}  # NAME: the --baseline module NAME

BENCH = [(4096, 8192, 4096), (8192, 8192, 14336), (16384, 8192, 4096), (8192, 4096, 4096)]
# name: (hidden, ffn, heads, kv_heads), head dim 128
MODELS = {
    "llama3-8b": (4096, 14336, 32, 8),
    "llama3-70b": (8192, 28672, 64, 8),
    "qwen2.5-32b": (5120, 27648, 40, 8),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

BIG = 2e11  # the summary's ">=2e11" rows: the planner's plain-path line until 2026-11-27


def model_shapes() -> list[tuple[str, int, int, int, int]]:
    """``(label, M, N, K, tp)`` of every projection of ``MODELS`` at TP 2, 4, 8."""
    out = []
    for name, (h, ffn, heads, kv) in MODELS.items():
        for tp in (2, 4, 8):
            proj = {
                "qkv": (h, (heads + 2 * kv) * 128 // tp),
                "o": (heads * 128 // tp, h),
                "gate_up": (h, 2 * ffn // tp),
                "down": (ffn // tp, h),
            }
            ms = (1024, 4096, 16384) + ((1000, 3000) if name == "llama3-8b" and tp == 2 else ())
            for p, (K, N) in proj.items():
                out += [(f"{name} {p} tp{tp}", M, N, K, tp) for M in ms]
    return out


def suite(which: str) -> list[tuple[str, int, int, int, int]]:
    bench = [("bench", M, N, K, 2) for M, N, K in BENCH]
    return {"bench": bench, "models": model_shapes(), "all": bench + model_shapes()}[which]


def _x_rows(plan) -> torch.Tensor:
    """``plan.x_row`` of every slot row, at once (the Python loop takes seconds at M = 16384)."""
    q = torch.arange(plan.M, device="cuda")
    a = q // plan.chunk_rows
    last = a == plan.n_row_bands - 1
    run = torch.where(last, plan.run_rows_last, plan.run_rows)
    within = q - a * plan.chunk_rows
    r = within // run
    return r * plan.rank_block_rows + a * plan.run_rows + within - r * run


def _cublas_chunks(x, w, plan, slots):
    """The plan's slots filled by cuBLAS, one call per chunk: a matmul of the chunk's rows
    (all-reduce), or a ``bmm`` over the chunk's runs (one per rank block; reduce-scatter),
    each into its contiguous slot (what NCCL per chunk could run without the Triton kernel)."""
    R, K = plan.runs, plan.K
    x3 = x.view(R, plan.M // R, K)
    calls = []
    for c in range(plan.n_chunks):
        off, rows, cols, row0, col0 = plan.chunk_slot(c)
        h, r0 = rows // R, (row0 // plan.chunk_rows) * plan.run_rows
        wc = w[:, col0 : col0 + cols]
        dst = slots[off : off + rows * cols].view(R, h, cols)
        calls.append((x3[:, r0 : r0 + h], wc.expand(R, K, cols), dst))

    def launch():
        for a, b, d in calls:
            if R == 1:
                torch.matmul(a[0], b[0], out=d[0])
            else:
                torch.bmm(a, b, out=d)

    return launch


@triton.jit
def _plain_matmul(x_desc, w_desc, y_desc, M, N, K, W_NK: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, PERSISTENT: tl.constexpr):  # fmt: skip
    """``y = x @ w`` by tiles grouped 8 tile rows at a time; ``w`` described as ``[N, K]``
    (``W_NK``) or ``[K, N]``."""
    tm, tn = tl.cdiv(M, BM), tl.cdiv(N, BN)
    step = tl.num_programs(0) if PERSISTENT else tm * tn
    for t in tl.range(tl.program_id(0), tm * tn, step, flatten=PERSISTENT):
        first = (t // (8 * tn)) * 8
        rows = min(tm - first, 8)
        m0, n0 = (first + t % rows) * BM, (t % (8 * tn)) // rows * BN
        acc = tl.zeros((BM, BN), tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            a = x_desc.load([m0, k * BK])
            b = w_desc.load([n0, k * BK]).T if W_NK else w_desc.load([k * BK, n0])
            acc = tl.dot(a, b, acc)
        y_desc.store([m0, n0], acc.to(y_desc.dtype))


def _plain(x, w, tiles, persistent: bool):
    """``(launch, y)``: ``launch()`` runs ``_plain_matmul`` of ``x @ w`` into ``y``."""
    (M, K), N = x.shape, w.shape[1]
    t = tiles
    nk = w.stride(0) == 1
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    xd = TensorDescriptor.from_tensor(x, [t.block_m, t.block_k])
    wd = TensorDescriptor.from_tensor(w.t() if nk else w, [t.block_n, t.block_k] if nk
                                      else [t.block_k, t.block_n])  # fmt: skip
    yd = TensorDescriptor.from_tensor(y, [t.block_m, t.block_n])
    n = triton.cdiv(M, t.block_m) * triton.cdiv(N, t.block_n)
    grid = (min(n, torch.cuda.get_device_properties(x.device).multi_processor_count)
            if persistent else n,)  # fmt: skip

    consts = (nk, t.block_m, t.block_n, t.block_k, persistent)

    def launch():
        return _plain_matmul[grid](xd, wd, yd, M, N, K, *consts, num_warps=t.num_warps,
                                   num_stages=t.num_stages)  # fmt: skip

    return launch, y


@contextlib.contextmanager
def _kernel_of(base: str):
    """``overlap.gemm.chunked_matmul`` replaced by the ``--baseline`` module ``base``'s (if
    not "") while ``kernel_alone`` binds it."""
    keep = overlap.gemm.chunked_matmul
    if base:
        overlap.gemm.chunked_matmul = _BASE[base].chunked_matmul
    try:
        yield
    finally:
        overlap.gemm.chunked_matmul = keep


def _variant(kind, x, w, tp, dtype, tiles):
    """``(launch, check)``: ``launch()`` runs the kernel, ``check(y)`` returns its error
    against cuBLAS's ``y`` and whether its counters match the plan. Kinds: ``ar``, ``rs``
    (the kernel of the NCCL transport's plans), ``ce`` (the copy engines' fused epilogue),
    ``cel`` (``ce``'s plan, plain epilogue), ``cbar``, ``cbrs`` (cuBLAS per chunk into the
    slots of the ``ar`` and ``rs`` plans), ``tri``, ``trip`` (a plain Triton matmul);
    ``@NAME``: through the ``--baseline`` module NAME."""
    kind, _, base = kind.partition("@")
    M, K = x.shape
    N = w.shape[1]
    if kind in ("tri", "trip"):
        tiles = tiles or tiles_for(M, dtype.itemsize * 8, interpreter=False)
        launch, mine = _plain(x, w, tiles, kind == "trip")
        rel = lambda y: ((mine.float() - y.float()).norm() / y.float().norm()).item()  # noqa: E731
        return launch, lambda y: (rel(y), True), None
    coll = "reduce_scatter" if kind.endswith("rs") else "all_reduce"
    blocked = kind in ("ce", "cel")
    if coll == "reduce_scatter" and M % tp:
        return None
    kw = dict(world_size=tp, collective=coll, dtype_bits=dtype.itemsize * 8, tiles=tiles,
              blocked=blocked, transport="ce" if blocked else "torch")  # fmt: skip
    plan = make_plan(M, N, K, **kw)
    if plan.path != "overlap":  # a small product takes the plain path by default; the
        plan = make_plan(M, N, K, chunks=2, **kw)  # planner's rule gives 2 chunks there
    if plan.path != "overlap":
        return None
    with _kernel_of(base):
        launch, bufs = kernel_alone(x, w, plan)
        if kind == "cel":  # the blocked plan's tiles, every one to its slot
            mm = overlap.gemm.chunked_matmul
            launch = lambda: mm(x, w, bufs["slots"], bufs["counters"], plan)  # noqa: E731
            blocked = False
    slots, cnt, out, recv = bufs["slots"], bufs["counters"], bufs.get("out"), bufs.get("recv")
    calls = [0]
    cublas = _cublas_chunks(x, w, plan, slots) if kind.startswith("cb") else None

    def counted_launch():
        if cublas is not None:
            return cublas()
        calls[0] += 1
        return launch()

    def check(y):
        torch.cuda.synchronize()
        if blocked:  # own block from `out` less the partials, the rest from the slots
            B = M // tp
            got = slots.view(M, N).float()
            got[:B] = out[:B].float() - recv[1:].float().sum(0)
        else:
            got, x_rows = torch.empty(M, N, device="cuda"), _x_rows(plan)
            for c in range(plan.n_chunks):
                off, rows, cols, row0, col0 = plan.chunk_slot(c)
                block = slots[off : off + rows * cols].view(rows, cols).float()
                got[x_rows[row0 : row0 + rows], col0 : col0 + cols] = block
        err = ((got - y.float()).norm() / y.float().norm()).item()
        if cublas is not None:
            return err, True  # no counters
        return err, cnt[: plan.n_chunks].tolist() == [calls[0] * t for t in plan.tiles_per_chunk]

    return counted_launch, check, plan


def _write(path: str, rows: list[dict], t0: float, verbose: bool = False) -> None:
    """The JSON: rows, and per kernel (and per kind run with several configs, its fastest
    config shape by shape: ``KIND best``) the median and worst ratio to cuBLAS."""
    ratios = [{n: k["ratio"] for n, k in r["kernels"].items()} for r in rows]
    for rr in ratios:
        for kind in {n.split(":")[0] for n in rr if ":" in n}:
            same = [v for n, v in rr.items() if n.split(":")[0] == kind]
            if len(same) > 1:
                rr[f"{kind} best"] = min(same)
    summary = {}
    for n in sorted({k for rr in ratios for k in rr}):
        for big in (False, True):  # all rows; the products of at least BIG FLOP
            sel = [(r, rr[n]) for r, rr in zip(rows, ratios, strict=True) if n in rr
                   and (not big or 2 * r["M"] * r["N"] * r["K"] >= BIG)]  # fmt: skip
            if not sel:
                continue
            worst, high = max(sel, key=lambda s: s[1])
            key = f"{n} >=2e11" if big else n
            at = f"{worst['M']}x{worst['N']}x{worst['K']} {worst['dtype']} {worst['layout']}"
            summary[key] = dict(median=statistics.median(v for _, v in sel), worst=high,
                                n=len(sel), worst_at=f"{worst['label']} {at}")  # fmt: skip
            if verbose:
                s = summary[key]
                print(f"{key}: x cuBLAS median {s['median']:.3f}, worst {s['worst']:.3f} at "
                      f"{s['worst_at']} ({len(sel)} rows)")  # fmt: skip
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, cuda=torch.version.cuda,
                date=time.strftime("%Y-%m-%d"), seconds=round(time.time() - t0))  # fmt: skip
    with open(path, "w") as f:
        json.dump({"meta": meta, "summary": summary, "rows": rows}, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--suite", default="all", choices=["bench", "models", "all"])
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--layouts", default="nk,kn")
    ap.add_argument("--kernels", default="ar,rs,ce")
    ap.add_argument("--configs", default="", help="BM,BN,BK,W,S;... (default: the library's)")
    ap.add_argument("--fp32", action="store_true", help="fp32 inputs (--dtypes fp32)")
    ap.add_argument("--rounds", type=int, default=4, help="turns of every variant per shape")
    ap.add_argument("--baseline", action="append", default=[],
                    help="NAME=PATH: another matmul.py, for kernels named KIND@NAME")  # fmt: skip
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("tools/gemm_sweep.py needs CUDA GPUs and this machine has none; on one that "
                 "has: python tools/gemm_sweep.py OUT.json")  # fmt: skip
    for b in a.baseline:
        name, path = b.split("=", 1)
        _BASE[name] = load(path, f"gemm_{name}")
    dtypes = ["fp32"] if a.fp32 else a.dtypes.split(",")
    configs = [Tiles(*(int(v) for v in c.split(","))) for c in a.configs.split(";") if c] or [None]
    kernels = a.kernels.split(",")
    rows, t0 = [], time.time()
    print(f"{'shape':>28} {'MxNxK':>18} dt lay {'cuBLAS':>7}  kernel ms (x cuBLAS) ...", flush=True)
    for label, M, N, K, tp in suite(a.suite):
        for dname in dtypes:
            dtype = DTYPES[dname]
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            for layout in a.layouts.split(","):
                w_nk = torch.randn(N, K, device="cuda", dtype=dtype) / K**0.5
                w = w_nk.t() if layout == "nk" else w_nk.t().contiguous()
                y = torch.empty(M, N, device="cuda", dtype=dtype)
                fns = {"cublas": lambda x=x, w=w, y=y: torch.matmul(x, w, out=y)}
                checks, plans, regs = {}, {}, {}
                for spec in kernels:
                    kind, _, own = spec.partition(":")  # KIND:BMxBNxBK/W/S[@NAME]: own config
                    if "@" in own:
                        own, base = own.split("@")
                        kind += "@" + base
                    own = own.replace("/", "x").split("x") if own else None
                    for cfg in [Tiles(*(int(v) for v in own))] if own else configs:
                        name = kind if cfg is None else f"{kind}:{cfg.block_m}x{cfg.block_n}x" \
                            f"{cfg.block_k}/{cfg.num_warps}/{cfg.num_stages}"  # fmt: skip
                        v = _variant(kind, x, w, tp, dtype, cfg)
                        if v is None:
                            continue
                        launch, check, plan = v
                        try:
                            k = launch()
                        except triton.runtime.errors.OutOfResources as e:  # (a --configs one)
                            print(f"{name} at {M}x{N}x{K}: {e}", flush=True)
                            continue
                        regs[name] = (k.n_regs, k.n_spills) if k is not None else None
                        fns[name], checks[name], plans[name] = launch, check, plan
                times = {n: [] for n in fns}
                for i in range(a.rounds):
                    # every other round backwards: a kernel's place in the turn moved its time
                    # by ~2-4% (the same kernel 2.4% apart, gemm_ce_s13_peers.json)
                    for n, fn in list(fns.items())[:: 1 - 2 * (i % 2)]:
                        times[n].append(do_bench(fn, warmup=5, rep=20, return_mode="median"))
                fns["cublas"]()
                cub = statistics.median(times["cublas"])
                row = dict(label=label, M=M, N=N, K=K, tp=tp, dtype=dname, layout=layout,
                           cublas_ms=cub, cublas_tflops=2 * M * N * K / cub / 1e9,
                           kernels={})  # fmt: skip
                line = f"{label:>28} {M}x{N}x{K:<6} {dname} {layout} {cub:7.4f} "
                for n, check in checks.items():
                    ms = statistics.median(times[n])
                    err, counted = check(y)
                    chunks = plans[n].n_chunks if plans[n] else None  # (None: tri, trip)
                    row["kernels"][n] = dict(ms=ms, ratio=ms / cub, err=err, counters_ok=counted,
                                             chunks=chunks, regs=regs[n])  # fmt: skip
                    bad = "" if err < 1e-2 and counted else " WRONG"
                    line += f" {n} {ms:.4f} ({ms / cub:.3f}){bad}"
                rows.append(row)
                print(line, flush=True)
        _write(a.out, rows, t0)  # after every shape: a run cut short keeps what it measured
    _write(a.out, rows, t0, verbose=True)
    print(f"wrote {a.out} ({round(time.time() - t0)} s)")


if __name__ == "__main__":
    main()
