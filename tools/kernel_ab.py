"""Whole calls through the library with two chunk GEMMs, in one process on 2+ GPUs: the
library's ``overlap.gemm.chunked_matmul`` and ``--kernel``'s (a copy of ``matmul.py`` whose
``from ..`` imports read ``from overlap.``). Each kernel gets a weight tensor of its own, so
each has its own recorded graph (a graph keeps the kernel it was captured with); the calls
take turns in every round (``time_queued``: GPU ms, max over ranks) and the paired ratio per
round is reported with the errors against float64.

torchrun --nproc-per-node=2 tools/kernel_ab.py OUT.json --kernel PATH [--shapes ...]
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import overlap
import overlap.gemm
from overlap.tuner import time_queued
from tools._benchrun import load

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument(
    "--shapes",
    default="4096x8192x4096,8192x8192x14336,16384x8192x4096,"
    "8192x4096x4096,4096x8192x14336,2048x8192x4096",
)
ap.add_argument("--collectives", default="all_reduce,reduce_scatter,all_to_all")
ap.add_argument("--iters", type=int, default=30)
ap.add_argument("--kernel", required=True)
ap.add_argument("--deadline", type=float, default=1e9, help="seconds; stop starting rows after")
args = ap.parse_args()
t_start = time.time()
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dev = torch.device("cuda", local)
dist.init_process_group("nccl", device_id=dev)
rank, R = dist.get_rank(), dist.get_world_size()
head = overlap.gemm.chunked_matmul
defer = load(args.kernel, "matmul_variant").chunked_matmul
mode = "no_p2p" if os.environ.get("NCCL_P2P_DISABLE") == "1" else "nvlink"


def plain_coll(coll, p, out):
    if coll == "all_reduce":
        out.copy_(p)
        dist.all_reduce(out)
    elif coll == "reduce_scatter":
        dist.reduce_scatter_tensor(out, p)
    else:
        dist.all_to_all_single(out, p)


rows = []
for shape in args.shapes.split(","):
    M, N, K = map(int, shape.split("x"))
    for coll in args.collectives.split(","):
        if time.time() - t_start > args.deadline:
            break
        g = torch.Generator(device=dev).manual_seed(1000 + rank)
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g) / K**0.25
        weight = torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=g) / K**0.25
        wa, wb = weight.t(), weight.clone().t()
        oshape = (M // R, N) if coll == "reduce_scatter" else (M, N)
        ref = torch.empty(oshape, device=dev, dtype=torch.float32)
        plain_coll(coll, (x.double() @ weight.double().t()).float(), ref)
        outs = {
            k: torch.full(oshape, float("nan"), device=dev, dtype=torch.bfloat16)
            for k in ("head", "defer")
        }
        prod = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        seq_out = torch.empty(oshape, device=dev, dtype=torch.bfloat16)

        def run(kernel, w, out):
            overlap.gemm.chunked_matmul = kernel
            overlap.matmul_collective(x, w, coll, out=out)

        fns = {
            "head": lambda: run(head, wa, outs["head"]),
            "defer": lambda: run(defer, wb, outs["defer"]),
            "gemm": lambda: torch.matmul(x, wa, out=prod),
            "comm": lambda: plain_coll(coll, prod, seq_out),
            "seq": lambda: (torch.matmul(x, wa, out=prod), plain_coll(coll, prod, seq_out)),
        }
        p = overlap.plan(x, wa, coll)
        t0 = time.time()
        for fn in fns.values():
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        err = {}
        for k in ("head", "defer"):
            outs[k].fill_(float("nan"))
            fns[k]()
            torch.cuda.synchronize()
            e = ((outs[k].float() - ref).abs().max() / ref.abs().max()).item()
            err[k] = e
        times = {k: [] for k in fns}
        order = list(fns)
        for i in range(args.iters):
            for k in order if i % 2 == 0 else order[::-1]:
                times[k].append(time_queued(fns[k], dev, None)[0])
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = statistics.median(b / a for a, b in zip(times["head"], times["defer"], strict=True))
        t = torch.tensor([*med.values(), ratio, *err.values()], device=dev, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        v = t.tolist()
        med = dict(zip(fns, v[: len(fns)], strict=True))
        row = dict(
            shape=shape,
            collective=coll,
            mode=mode,
            plan=p.describe(),
            transport=p.transport,
            ms=med,
            defer_over_head=v[len(fns)],
            err_head=v[-2],
            err_defer=v[-1],
            secs=round(time.time() - t0, 1),
        )
        for k in ("head", "defer"):
            d = med["seq"] - max(med["gemm"], med["comm"])
            row[f"eta_{k}"] = (med["seq"] - med[k]) / d if d > 0 else None
            row[f"speedup_{k}"] = med["seq"] / med[k]
        rows.append(row)
        if rank == 0:
            print(
                f"{mode} {shape} {coll} via {p.transport}: gemm {med['gemm']:.3f} comm "
                f"{med['comm']:.3f} seq {med['seq']:.3f} head {med['head']:.3f} defer "
                f"{med['defer']:.3f} paired defer/head {row['defer_over_head']:.4f} "
                f"eta {row['eta_head']:.3f}/{row['eta_defer']:.3f} err {row['err_head']:.1e}/"
                f"{row['err_defer']:.1e} ({row['secs']} s)",
                flush=True,
            )
        overlap.gemm.chunked_matmul = head
        overlap.release()
if rank == 0:
    meta = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        nccl=str(torch.cuda.nccl.version()),
        date=time.strftime("%Y-%m-%d"),
        world=R,
    )
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    errs = [max(r["err_head"], r["err_defer"]) for r in rows]
    print(
        f"rows {len(rows)}, worst error {max(errs):.2e}; median paired defer/head "
        f"{statistics.median(r['defer_over_head'] for r in rows):.4f}",
        flush=True,
    )
dist.destroy_process_group()
sys.exit(0)
