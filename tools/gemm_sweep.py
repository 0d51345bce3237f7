"""Single-GPU sweep of the chunk-slot GEMM (all-reduce plan, TMA loads, w = weight.t()) over tile
configs, against cuBLAS; each variant's product is also checked against cuBLAS's.

Usage: python tools/gemm_sweep.py OUT.json [--fp32] [--configs "BM,BN,BK,W,S;..."]
Prints one line per variant and, last, "best BM,BN,BK,warps,stages" (least total time).
``--fp32``: fp32 inputs instead (the kernel's three-TF32-product path against cuBLAS fp32).
"""

import json
import sys

import torch
from triton.testing import do_bench

from overlap.gemm.matmul import chunked_matmul
from overlap.plan import Tiles, make_plan

SHAPES = [(4096, 8192, 4096), (8192, 8192, 14336), (16384, 8192, 4096), (8192, 4096, 4096)]
# (block_m, block_n, block_k, num_warps, num_stages)
CONFIGS = [
    (256, 128, 64, 8, 3), (256, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4),
    (128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 128, 128, 4, 3),
]  # fmt: skip
FP32_CONFIGS = [(128, 64, 32, 4, 4), (128, 128, 32, 8, 3), (64, 128, 32, 4, 4)]


def _ms(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def main(out_path, fp32=False, configs=None):
    dtype = torch.float32 if fp32 else torch.bfloat16
    configs = configs or (FP32_CONFIGS if fp32 else CONFIGS)
    shapes = [(2048, 4096, 4096), (4096, 8192, 4096)] if fp32 else SHAPES
    rows, total = [], {c: 0.0 for c in configs}
    for M, N, K in shapes:
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        w = torch.randn(N, K, device="cuda", dtype=dtype).t()
        y = torch.empty(M, N, device="cuda", dtype=dtype)
        tflop = 2 * M * N * K / 1e9
        t = _ms(lambda: torch.matmul(x, w, out=y))
        rows.append(dict(shape=(M, N, K), kernel="cublas", ms=t, tflops=tflop / t))
        print(rows[-1], flush=True)
        for cfg in configs:
            tiles = Tiles(*cfg)
            plan = make_plan(
                M, N, K, world_size=2, collective="all_reduce",
                dtype_bits=dtype.itemsize * 8, tiles=tiles,
            )  # fmt: skip
            cnt = torch.zeros(64, dtype=torch.int32, device="cuda")
            p = torch.full((M * N,), float("nan"), device="cuda", dtype=dtype)
            row = dict(shape=(M, N, K), kernel="ours", config=cfg)
            try:
                chunked_matmul(x, w, p, cnt, plan)
                err = ((p.view(M, N).float() - y.float()).norm() / y.float().norm()).item()
                t = _ms(lambda: chunked_matmul(x, w, p, cnt, plan))
                row.update(ms=t, tflops=tflop / t, err_vs_cublas=err)
                total[cfg] += t if err < 1e-2 else float("inf")
            except Exception as e:
                row.update(error=f"{type(e).__name__}: {str(e)[:160]}")
                total[cfg] = float("inf")
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
        spec = args[args.index("--configs") + 1]
        chosen = [tuple(int(v) for v in c.split(",")) for c in spec.split(";")]
    main(args[0], fp32="--fp32" in args, configs=chosen)
