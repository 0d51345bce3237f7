"""Single-GPU sweep of the chunk-slot GEMM: tile configs x weight layout x TMA, against cuBLAS.

Usage: python tools/gemm_sweep.py OUT.json   (prints a table; the best bf16 config for
w = weight.t() on the first shape is written to OUT.json's "best" and printed last)
"""

import dataclasses
import json
import sys

import torch
from triton.testing import do_bench

from overlap.gemm.matmul import chunked_matmul
from overlap.plan import Tiles, make_plan

CONFIGS = [
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 4),
    (256, 128, 64, 8, 3),
    (128, 128, 128, 8, 3),
]


def _ms(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def main(out_path):
    rows = []
    for shape, dtype, configs, layouts in [
        ((4096, 8192, 4096), torch.bfloat16, CONFIGS, ("weight.t()", "[K,N]")),
        ((8192, 8192, 14336), torch.bfloat16, CONFIGS[:5], ("weight.t()",)),
        (
            (2048, 4096, 4096),
            torch.float32,
            [(128, 128, 32, 8, 3), (128, 64, 32, 4, 4)],
            ("weight.t()",),
        ),
    ]:
        M, N, K = shape
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        w_nk = torch.randn(N, K, device="cuda", dtype=dtype)
        y = torch.empty(M, N, device="cuda", dtype=dtype)
        tflop = 2 * M * N * K / 1e9
        for layout in layouts:
            w = w_nk.t() if layout == "weight.t()" else w_nk.t().contiguous()
            t = _ms(lambda: torch.matmul(x, w, out=y))
            rows.append(
                dict(
                    shape=shape,
                    dtype=str(dtype),
                    layout=layout,
                    kernel="cublas",
                    ms=t,
                    tflops=tflop / t,
                )
            )
            print(rows[-1], flush=True)
            for cfg, coll, tma in [
                (c, k, m)
                for c in configs
                for k in ("all_reduce", "reduce_scatter")
                for m in (True, False)
            ]:
                if not tma and coll == "reduce_scatter":
                    continue
                base = make_plan(M, N, K, world_size=2, collective=coll, dtype_bits=16)
                plan = dataclasses.replace(base, tiles=Tiles(*cfg))
                plan = dataclasses.replace(
                    plan,
                    group_m=min(8, plan.band_tile_rows(0)),
                    tiles_per_chunk=base.tiles_per_chunk,
                )
                cnt = torch.zeros(64, dtype=torch.int32, device="cuda")
                p = torch.empty(M * N, device="cuda", dtype=dtype)
                row = dict(
                    shape=shape,
                    dtype=str(dtype),
                    layout=layout,
                    config=cfg,
                    kernel=f"ours[{coll}]" + (" tma" if tma else " ptr"),
                )
                try:
                    t = _ms(lambda: chunked_matmul(x, w, p, cnt, plan, use_tma=tma))
                    row.update(ms=t, tflops=tflop / t)
                except Exception as e:
                    row.update(error=f"{type(e).__name__}: {str(e)[:160]}")
                rows.append(row)
                print(row, flush=True)
    first = [
        r
        for r in rows
        if r["shape"] == (4096, 8192, 4096)
        and "tma" in r["kernel"]
        and r["layout"] == "weight.t()"
        and "ms" in r
    ]
    best_cfg = min(
        CONFIGS, key=lambda c: sum(r["ms"] for r in first if r["config"] == c) or float("inf")
    )
    json.dump({"rows": rows, "best": best_cfg}, open(out_path, "w"), indent=1)
    print("best", ",".join(map(str, best_cfg)))


if __name__ == "__main__":
    main(sys.argv[1])
