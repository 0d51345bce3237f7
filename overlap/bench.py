"""Benchmark: ``torchrun --nproc-per-node=2 -m overlap.bench [--out bench_out/bench.json]``.

Per shape and collective (bf16, ``x [M, K]`` and ``w = weight.t()`` of ``[N, K]``): cuBLAS GEMM
alone, the kernel the call runs alone (``kernel_alone``: with its signals and, through the copy
engines, its fused epilogue with the peers' partials already there), the collective alone on the
product, sequential (cuBLAS + collective), this library, the speedup over sequential and the
hidden fraction ``eta = (T_seq - T_overlap) / (T_seq - max(T_gemm, T_comm))``; for reduce-
scatter also torch's async-TP (``fused_matmul_reduce_scatter``) where it runs. Peak GPU memory
of the sequential and the overlapped call, and host time per overlapped call.

Timing: CUDA events around each call, ranks lined up by a barrier and a ~1 ms GPU sleep before
each timed call, so the host has queued the whole call before the GPU reaches it, as in a
training step whose host runs ahead; the host time per call is reported beside it. Median over
the iterations, max over ranks. Prints a table; rank 0 writes JSON. ``--graph`` times CUDA-graph
replays of every function instead (no host time at all); ``--tune`` lets ``overlap.tune`` choose
each row's plan first."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

import overlap
from overlap.collectives import collective
from overlap.comm import BACKENDS
from overlap.context import context
from overlap.tuner import time_queued

SHAPES = [
    "4096x8192x4096",
    "8192x8192x14336",
    "16384x8192x4096",
    "8192x4096x4096",
    "16x8192x4096",
    "128x8192x4096",
]


def _time_all(fns: dict, iters: int, warmup: int = 3) -> dict:
    """Median milliseconds of each ``fns[name]()``, max over ranks. The functions take turns
    in every iteration, so slow drifts of clocks or of the other rank hit them all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict = {name: [] for name in fns}
    dev = torch.device("cuda", torch.cuda.current_device())
    for _ in range(iters):
        for name, fn in fns.items():
            times[name].append(time_queued(fn, dev, None)[0])
    t = torch.tensor([statistics.median(v) for v in times.values()], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(fns, t.tolist(), strict=True))


def kernel_alone(x: torch.Tensor, w: torch.Tensor, plan: overlap.Plan, rank: int = 0):
    """``(launch, buffers)``: ``launch()`` runs the GEMM that a call with ``plan`` runs
    (``x [M, K]``, ``w [K, N]``), with no transport: the plain epilogue, or for blocked plans
    the copy engines' fused epilogue as rank ``rank``, the peers' partials in its receive
    slots and their flags already set. ``buffers``: ``slots`` (NaN first), ``counters`` and,
    for blocked plans, ``out`` (NaN first) and ``recv`` (``[R, M / R, N]``, random)."""
    from overlap.contract import SET, Epilogue
    from overlap.gemm import chunked_matmul

    M, N, K, R = plan.M, plan.N, plan.K, plan.world_size
    new = dict(device=x.device, dtype=x.dtype)
    bufs = dict(slots=torch.full((M * N,), float("nan"), **new),
                counters=torch.zeros(64, dtype=torch.int32, device=x.device))  # fmt: skip
    kw = {}
    if plan.blocked:
        bufs["out"] = torch.full(plan.spec.result_shape((M, K), N, R), float("nan"), **new)
        bufs["recv"] = torch.randn(R, M // R, N, **new)
        bufs["recv"][rank] = float("nan")  # a rank's own slot is never read
        flags = torch.full((plan.n_chunks,), SET, dtype=torch.int32, device=x.device)
        kw["epilogue"] = Epilogue(bufs["out"], bufs["recv"], flags, rank)

    def launch():
        return chunked_matmul(x, w, bufs["slots"], bufs["counters"], plan, **kw)

    return launch, bufs


def _graphed(fn):
    """``fn`` captured in a CUDA graph (after one warm-up call on a side stream): the replay
    costs one launch of host time however many kernels and collectives ``fn`` issues."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _peak_mb(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _async_tp(x, w, group):
    """torch's fused matmul + reduce-scatter, or None where it does not run."""
    try:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        with warnings.catch_warnings():  # deprecated (and unneeded) in newer torch
            warnings.simplefilter("ignore")
            enable_symm_mem_for_group(group.group_name)
        fn = torch.ops.symm_mem.fused_matmul_reduce_scatter
        fn(x, w, "sum", scatter_dim=0, group_name=group.group_name)
        return lambda: fn(x, w, "sum", scatter_dim=0, group_name=group.group_name)
    except Exception as e:  # not built, no P2P, or no symmetric memory here
        if dist.get_rank() == 0:
            print(f"async-TP unavailable: {type(e).__name__}: {str(e)[:120]}")
        return None


def _cta_group(max_ctas: int):
    """A second NCCL communicator over all ranks whose collectives use at most ``max_ctas``
    CTAs (SMs), for the overlapped calls only; ``None`` (the default group) for 0."""
    if not max_ctas:
        return None
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.max_ctas = max_ctas
    return dist.new_group(list(range(dist.get_world_size())), backend="nccl", pg_options=opts)


def bench_one(
    shape: str,
    coll: str,
    iters: int,
    backend: str,
    chunks: int | None,
    ovl_group=None,
    tune: bool = False,
    graph: bool = False,
) -> dict:
    M, N, K = (int(v) for v in shape.split("x"))
    group = dist.group.WORLD
    R = dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(1234 + dist.get_rank())
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=g).t()  # weight.t()
    spec = collective(coll)
    out_shape = spec.result_shape((M, K), N, R)
    out = torch.empty(out_shape, device=dev, dtype=torch.bfloat16)
    y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)  # for the parts timed alone
    tuned = None
    if tune and chunks is None:  # overlap.tune times plain / 2 / 4 / 8 chunks and keeps the best
        # the bench times GPU work with the host queued ahead, so the tuner does too
        tuned = overlap.tune(x, w, coll, group=ovl_group, use_cache=False, count_host=False)
    p = overlap.plan(x, w, coll, chunks=chunks, group=ovl_group, backend=backend)
    plain = spec.plain

    def seq():  # what users write today
        prod = x @ w
        plain(prod, out, group)

    def ovl():
        overlap.matmul_collective(
            x, w, coll, out=out, backend=backend, chunks=chunks, group=ovl_group
        )

    row = {
        "shape": shape,
        "collective": coll,
        "backend": backend,
        "transport": p.transport or None,
        "plan": p.describe(),
        "chunks": p.n_chunks,
        "tuned": tuned and tuned.choice,
        "tuned_ms": tuned and tuned.ms,
    }
    fns = {"gemm_cublas": lambda: torch.matmul(x, w, out=y)}
    if p.path == "overlap":  # the kernel the call runs, with its transport's epilogue
        fns["gemm_overlap_kernel"] = kernel_alone(x, w, p, dist.get_rank(ovl_group))[0]
    fns["comm"] = lambda: plain(y, out, group)
    fns["sequential"] = seq
    fns["overlap"] = ovl
    if spec.scatters and not graph:  # torch's fused matmul + reduce-scatter
        fused = _async_tp(x, w, group)
        row["async_tp"] = None
        if fused is not None:
            fns["async_tp"] = fused
    row["graph"] = graph
    if graph:  # every timed function replays a CUDA graph of itself
        fns = {name: _graphed(fn) for name, fn in fns.items()}
    row.update(_time_all(fns, iters))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        ovl()
    row["host_ms_per_call"] = (time.perf_counter() - t0) / 10 * 1e3
    # The timed call's result against the plain torch path (a bench that computes garbage fast
    # would show here).
    ref = x @ w
    want = ref if spec.replicated else torch.empty_like(out)
    plain(ref, want, group)
    ovl()
    row["error_vs_plain"] = ((out.float() - want.float()).norm() / want.float().norm()).item()
    torch.cuda.synchronize()
    row["peak_mb_sequential"] = _peak_mb(seq)
    row["peak_mb_overlap"] = _peak_mb(ovl)  # torch's allocator: not the symmetric memory
    # the transports' buffers kept between calls (the copy engines'; NCCL per chunk keeps none)
    row["transport_buffer_mb"] = context(ovl_group, dev).nbytes / 2**20
    limit = max(row["gemm_cublas"], row["comm"])
    row["speedup"] = row["sequential"] / row["overlap"]
    hideable = row["sequential"] - limit
    row["eta"] = (row["sequential"] - row["overlap"]) / hideable if hideable > 0 else None
    return row


def need_gpus(tool: str, how: str) -> None:
    """Exits with one line (no traceback) unless CUDA GPUs are present and this process is a
    torchrun worker; ``how``: the command lines that launch ``tool``."""
    if not torch.cuda.is_available():
        sys.exit(f"{tool} needs CUDA GPUs and this machine has none; on one that has: {how}")
    if "RANK" not in os.environ:
        sys.exit(f"{tool} runs as torchrun workers: {how}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="MxNxK,MxNxK,...")
    ap.add_argument("--collectives", default="all_reduce,reduce_scatter,all_to_all")
    ap.add_argument("--backend", default="auto", choices=list(BACKENDS))
    ap.add_argument(
        "--chunks",
        default="",
        help="chunk counts to sweep, e.g. 2,4,8 (default: the planner's choice)",
    )
    ap.add_argument(
        "--max-ctas",
        default="0",
        help="CTA limits to sweep for the overlapped calls' NCCL communicator (0: default group)",
    )
    ap.add_argument("--tune", action="store_true", help="overlap.tune each row first")
    ap.add_argument(
        "--graph", action="store_true", help="time CUDA-graph replays of every function"
    )
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument(
        "--out", default="bench_out/bench.json", help="JSON file (default: %(default)s)"
    )
    args = ap.parse_args(argv)
    need_gpus("overlap.bench", "torchrun --nproc-per-node=N -m overlap.bench (N >= 2 GPUs)")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    mode = "default"
    if os.environ.get("NCCL_P2P_DISABLE") == "1":
        mode = "net" if os.environ.get("NCCL_SHM_DISABLE") == "1" else "no_p2p"
    chunk_list = [int(c) for c in args.chunks.split(",") if c] or [None]
    groups = {int(n): _cta_group(int(n)) for n in args.max_ctas.split(",")}
    rows = []
    for shape in args.shapes.split(","):
        for coll in args.collectives.split(","):
            for chunks in chunk_list:
                for max_ctas, group in groups.items():
                    row = bench_one(
                        shape, coll, args.iters, args.backend, chunks, group, args.tune, args.graph
                    )
                    row["mode"], row["max_ctas"] = mode, max_ctas
                    rows.append(row)
                    if dist.get_rank() == 0:
                        print(_fmt(row), flush=True)
    if dist.get_rank() == 0:
        meta = {
            "device": torch.cuda.get_device_name(),
            "world_size": dist.get_world_size(),
            "torch": torch.__version__,
            "nccl": str(torch.cuda.nccl.version()),
            "mode": mode,
            "backend": args.backend,
            "date": time.strftime("%Y-%m-%d"),
        }
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    dist.destroy_process_group()


HEADER = (
    "shape",
    "coll",
    "ch",
    "ctas",
    "cuBLAS",
    "ours_gemm",
    "comm",
    "seq",
    "overlap",
    "speedup",
    "eta",
    "asyncTP",
    "host_ms",
    "err",
)


def _fmt(r: dict) -> str:
    def f(v):
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    return " | ".join(
        f(v)
        for v in (
            r["shape"],
            r["collective"],
            r["chunks"],
            r.get("max_ctas") or "-",
            r["gemm_cublas"],
            r.get("gemm_overlap_kernel"),
            r["comm"],
            r["sequential"],
            r["overlap"],
            r["speedup"],
            r["eta"],
            r.get("async_tp"),
            r["host_ms_per_call"],
            r.get("error_vs_plain"),
        )
    )


if __name__ == "__main__":
    main()
