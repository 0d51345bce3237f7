"""Single-GPU sweep of the chunk-slot GEMM: tile configs x weight layout x row gather, against
cuBLAS and the Triton tutorial kernel (control). Prints a table, writes JSON to argv[1]."""

import dataclasses
import json
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from overlap.gemm.matmul import chunked_matmul
from overlap.plan import Tiles, make_plan


@triton.jit
def _tutorial(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    sam,
    sak,
    sbk,
    sbn,
    scm,
    scn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_in_group = GROUP_M * num_pid_n
    first = (pid // num_in_group) * GROUP_M
    gsz = min(num_pid_m - first, GROUP_M)
    pid_m = first + ((pid % num_in_group) % gsz)
    pid_n = (pid % num_in_group) // gsz
    offs_am = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_bn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_am[:, None] * sam + offs_k[None, :] * sak
    b_ptrs = b_ptr + offs_k[:, None] * sbk + offs_bn[None, :] * sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k * BLOCK_K, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_K, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * sak
        b_ptrs += BLOCK_K * sbk
    offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + scm * offs_cm[:, None] + scn * offs_cn[None, :]
    tl.store(
        c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_cm[:, None] < M) & (offs_cn[None, :] < N)
    )


CONFIGS = [
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 4),
    (256, 128, 64, 8, 3),
    (128, 256, 32, 8, 4),
    (128, 128, 32, 4, 4),
    (64, 256, 64, 4, 4),
]


def main(out_path):
    rows = []
    dev = "cuda"
    for shape, dtype, configs in [
        ((4096, 8192, 4096), torch.bfloat16, CONFIGS),
        ((8192, 8192, 14336), torch.bfloat16, CONFIGS[:5]),
        ((2048, 4096, 4096), torch.float16, CONFIGS[:4]),
        (
            (2048, 4096, 4096),
            torch.float32,
            [(128, 128, 32, 8, 3), (128, 128, 32, 4, 3), (128, 64, 32, 4, 4), (64, 128, 32, 4, 3)],
        ),
    ]:
        M, N, K = shape
        x = torch.randn(M, K, device=dev, dtype=dtype)
        w_nk = torch.randn(N, K, device=dev, dtype=dtype)
        y = torch.empty(M, N, device=dev, dtype=dtype)
        flops = 2 * M * N * K
        for layout, w in (("w=weight.t()", w_nk.t()), ("w=[K,N]", w_nk.t().contiguous())):
            t = do_bench(
                lambda: torch.matmul(x, w, out=y), warmup=25, rep=100, return_mode="median"
            )
            rows.append(
                dict(
                    shape=shape,
                    dtype=str(dtype),
                    layout=layout,
                    kernel="cublas",
                    ms=t,
                    tflops=flops / t / 1e9,
                )
            )
            print(rows[-1], flush=True)
            for cfg in configs:
                tiles = Tiles(*cfg)
                for coll in ("all_reduce", "reduce_scatter"):
                    base = make_plan(M, N, K, world_size=2, collective=coll, dtype_bits=16)
                    plan = dataclasses.replace(
                        base, tiles=tiles, group_m=min(8, base.chunk_rows // cfg[0])
                    )
                    cnt = torch.zeros(64, dtype=torch.int32, device=dev)
                    p = torch.empty(M * N, device=dev, dtype=dtype)
                    row = dict(
                        shape=shape,
                        dtype=str(dtype),
                        layout=layout,
                        config=cfg,
                        kernel=f"ours[{coll}]",
                    )
                    try:
                        t = do_bench(
                            lambda: chunked_matmul(x, w, p, cnt, plan),
                            warmup=25,
                            rep=100,
                            return_mode="median",
                        )
                        row.update(ms=t, tflops=flops / t / 1e9)
                    except Exception as e:
                        row.update(error=str(e)[:160])
                    rows.append(row)
                    print(row, flush=True)
                if coll and dtype != torch.float32:
                    bm, bn, bk, nw, ns = cfg
                    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
                    row = dict(
                        shape=shape, dtype=str(dtype), layout=layout, config=cfg, kernel="tutorial"
                    )
                    try:
                        t = do_bench(
                            lambda: _tutorial[grid](
                                x,
                                w,
                                y,
                                M,
                                N,
                                K,
                                x.stride(0),
                                x.stride(1),
                                w.stride(0),
                                w.stride(1),
                                y.stride(0),
                                y.stride(1),
                                BLOCK_M=bm,
                                BLOCK_N=bn,
                                BLOCK_K=bk,
                                GROUP_M=8,
                                num_warps=nw,
                                num_stages=ns,
                            ),
                            warmup=25,
                            rep=100,
                            return_mode="median",
                        )
                        row.update(ms=t, tflops=flops / t / 1e9)
                    except Exception as e:
                        row.update(error=str(e)[:160])
                    rows.append(row)
                    print(row, flush=True)
    json.dump(rows, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
