"""Single-GPU sweep of the chunk-slot GEMM (w = weight.t()) over tile configs, against cuBLAS;
each variant's product is also checked against cuBLAS's and its chunk counters against the plan.

Usage: python tools/gemm_sweep.py OUT.json [--fp32] [--configs "BM,BN,BK,W,S[,MODE];..."]
    [--ir FILE]  (append each variant's TTGIR on the first shape to FILE)

MODE: ``grid`` (the kernel on the NCCL path's plan, the default), ``blocked`` (the plain kernel
on a copy-engine transport's blocked plan), ``fused`` (the copy-engine transport's kernel:
blocked plan, rank 0 of 2, this rank's block adding a peer partial whose flags are already
set). Each variant is timed twice: ``ms`` by ``triton.testing.do_bench`` (back to back, L2
flushed) and ``queued_ms`` as ``overlap.bench`` times (a ~1 ms GPU sleep before each call,
CUDA events around it; the functions take turns). Rows also hold the kernel's registers,
spills and counts of some TTGIR ops (whether the K loop was software-pipelined). Prints one
line per variant and, last, "best ..." (least total queued time).
``--fp32``: fp32 inputs instead (the kernel's three-TF32-product path against cuBLAS fp32).
"""

import json
import statistics
import sys

import torch
from triton.testing import do_bench

from overlap.contract import Epilogue
from overlap.gemm import chunked_matmul
from overlap.plan import Tiles, make_plan
from overlap.tuner import time_queued

SHAPES = [(4096, 8192, 4096), (8192, 8192, 14336), (16384, 8192, 4096), (8192, 4096, 4096)]
# (block_m, block_n, block_k, num_warps, num_stages, mode)
CONFIGS = [(256, 128, 64, 8, 4, "grid"), (256, 128, 64, 8, 4, "blocked"),
           (256, 128, 64, 8, 4, "fused")]  # fmt: skip
FP32_CONFIGS = [(128, 64, 32, 4, 4, "grid")]
IR_OPS = ("scf.for", "async_tma_copy_global_to_local", "warp_group_dot_wait", "ttg.local_alloc")


def _ms(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _queued(fns: dict, iters: int = 30) -> dict:
    """Median ms of each function timed as overlap.bench does, taking turns."""
    dev = torch.device("cuda", torch.cuda.current_device())
    times = {k: [] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            times[k].append(time_queued(fn, dev, None)[0])
    return {k: statistics.median(v) for k, v in times.items()}


def _parse(spec: str) -> tuple:
    parts = spec.split(",")
    return (*(int(v) for v in parts[:5]), parts[5] if len(parts) > 5 else "grid")


def _variant(x, w, y, cfg, dtype):
    """(launch, check) for one variant: ``launch()`` runs it, ``check()`` returns the error
    against cuBLAS's ``y`` and whether the counters grew by the plan's tiles per chunk."""
    M, K = x.shape
    N = w.shape[1]
    *tile, mode = cfg
    blocked = mode != "grid"
    plan = make_plan(
        M, N, K, world_size=2, collective="all_reduce", dtype_bits=dtype.itemsize * 8,
        tiles=Tiles(*tile), blocked=blocked, **({"chunks": 4} if blocked else {}),
    )  # fmt: skip
    kw = {}
    cnt = torch.zeros(64, dtype=torch.int32, device="cuda")
    p = torch.full((M * N,), float("nan"), device="cuda", dtype=dtype)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
    fused = mode == "fused"
    if fused:  # rank 0: block 0 is its own, to which rank 1's partial is added; flags are set
        recv = torch.randn(2, M // 2, N, device="cuda", dtype=dtype)
        recv[0] = float("nan")  # rank 0's own slot is never read
        flags = torch.full((64,), 1 << 30, dtype=torch.int32, device="cuda")
        kw["epilogue"] = Epilogue(out, recv, flags, 1, 0)
    calls = [0]

    def launch():
        calls[0] += 1
        return chunked_matmul(x, w, p, cnt, plan, **kw)

    def check():
        torch.cuda.synchronize()
        got = p.view(M, N).float()
        if fused:
            got[: M // 2] = out[: M // 2].float() - recv[1].float()
        err = ((got - y.float()).norm() / y.float().norm()).item()
        want = [calls[0] * t for t in plan.tiles_per_chunk]
        return err, cnt[: plan.n_chunks].tolist() == want

    return launch, check


def main(out_path, fp32=False, configs=None, ir_path=None):
    dtype = torch.float32 if fp32 else torch.bfloat16
    configs = configs or (FP32_CONFIGS if fp32 else CONFIGS)
    shapes = [(2048, 4096, 4096), (4096, 8192, 4096)] if fp32 else SHAPES
    rows, total = [], {c: 0.0 for c in configs}
    for M, N, K in shapes:
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        w = torch.randn(N, K, device="cuda", dtype=dtype).t()
        y = torch.empty(M, N, device="cuda", dtype=dtype)
        tflop = 2 * M * N * K / 1e9
        fns = {"cublas": lambda: torch.matmul(x, w, out=y)}
        shape_rows = {"cublas": dict(shape=(M, N, K), kernel="cublas", ms=_ms(fns["cublas"]))}
        checks = {}
        for cfg in configs:
            row = dict(shape=(M, N, K), kernel="ours", config=cfg)
            shape_rows[cfg] = row
            try:
                launch, check = _variant(x, w, y, cfg, dtype)
                k = launch()
                ir = k.asm.get("ttgir", "")
                if ir_path and (M, N, K) == shapes[0]:
                    with open(ir_path, "a") as f:
                        f.write(f"// ===== {cfg}\n{ir}\n")
                row.update(regs=k.n_regs, spills=k.n_spills, ir={op: ir.count(op) for op in IR_OPS})
                row["ms"] = _ms(launch)
                fns[cfg], checks[cfg] = launch, check
            except Exception as e:  # noqa: BLE001 (a config that does not compile)
                row.update(error=f"{type(e).__name__}: {str(e)[:160]}")
                total[cfg] = float("inf")
        for name, t in _queued(fns).items():
            shape_rows[name]["queued_ms"] = t
        for cfg, check in checks.items():
            err, counted = check()
            row = shape_rows[cfg]
            row.update(err_vs_cublas=err, counters_ok=counted)
            ok = err < 1e-2 and counted
            total[cfg] += row["queued_ms"] if ok else float("inf")
        cub = shape_rows["cublas"]
        for row in shape_rows.values():
            if "queued_ms" in row:
                row["tflops"] = tflop / row["queued_ms"]
                row["vs_cublas"] = row["queued_ms"] / cub["queued_ms"]
                row["vs_cublas_do_bench"] = row["ms"] / cub["ms"]
            rows.append(row)
            print(row, flush=True)
    best = min(configs, key=lambda c: total[c])
    json.dump(
        {"rows": rows, "best": best, "total_ms": {str(k): v for k, v in total.items()}},
        open(out_path, "w"),
        indent=1,
    )
    print("best", ",".join(map(str, best)))


if __name__ == "__main__":
    args = sys.argv[1:]
    chosen = None
    if "--configs" in args:
        chosen = [_parse(c) for c in args[args.index("--configs") + 1].split(";")]
    ir_file = args[args.index("--ir") + 1] if "--ir" in args else None
    main(args[0], fp32="--fp32" in args, configs=chosen, ir_path=ir_file)
