"""Single-GPU sweep of the chunk-slot GEMM (all-reduce plan, TMA loads, w = weight.t()) over tile
configs, against cuBLAS; each variant's product is also checked against cuBLAS's.

Usage: python tools/gemm_sweep.py OUT.json
Prints one line per variant and, last, "best BM,BN,BK,warps,stages,ws" (least total time).
"""

import dataclasses
import json
import sys

import torch
from triton.testing import do_bench

from overlap.gemm.matmul import chunked_matmul
from overlap.plan import Tiles, make_plan

SHAPES = [(4096, 8192, 4096), (8192, 8192, 14336), (16384, 8192, 4096), (8192, 4096, 4096)]
# (block_m, block_n, block_k, num_warps, num_stages, warp_specialize)
CONFIGS = [
    (256, 128, 64, 8, 3, 0), (256, 128, 64, 8, 4, 0), (256, 128, 64, 8, 3, 1),
    (256, 128, 64, 8, 4, 1), (128, 256, 64, 8, 3, 1), (128, 256, 64, 8, 4, 1),
    (128, 128, 64, 4, 4, 1), (128, 128, 64, 8, 4, 1), (128, 256, 64, 4, 3, 1),
    (128, 128, 128, 4, 3, 1),
]  # fmt: skip


def _ms(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def main(out_path):
    rows, total = [], {c: 0.0 for c in CONFIGS}
    for M, N, K in SHAPES:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t()
        y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        tflop = 2 * M * N * K / 1e9
        t = _ms(lambda: torch.matmul(x, w, out=y))
        rows.append(dict(shape=(M, N, K), kernel="cublas", ms=t, tflops=tflop / t))
        print(rows[-1], flush=True)
        for cfg in CONFIGS:
            tiles = Tiles(*cfg[:5], warp_specialize=bool(cfg[5]))
            base = make_plan(M, N, K, world_size=2, collective="all_reduce", dtype_bits=16)
            plan = dataclasses.replace(base, tiles=tiles)
            plan = dataclasses.replace(plan, group_m=min(8, plan.band_tile_rows(0)))
            cnt = torch.zeros(64, dtype=torch.int32, device="cuda")
            p = torch.full((M * N,), float("nan"), device="cuda", dtype=torch.bfloat16)
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
    best = min(CONFIGS, key=lambda c: total[c])
    json.dump(
        {"rows": rows, "best": best, "total_ms": {str(k): v for k, v in total.items()}},
        open(out_path, "w"),
        indent=1,
    )
    print("best", ",".join(map(str, best)))


if __name__ == "__main__":
    main(sys.argv[1])
