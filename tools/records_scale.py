"""Recorded calls against the number of distinct call signatures a step cycles through, on one
GPU: two ranks share GPU 0 over gloo, so the copy engines take the host road.

    NCCL_P2P_DISABLE=1 torchrun --nproc-per-node=2 tools/records_scale.py OUT.json

For ``ops.MAX_RECORDS`` of 64 and 1024 and steps of 32, 128 and 384 signatures (a 4-chunk
all-reduce of 1024x4096x4096 bf16 into that many outputs, cycled): host milliseconds per call
in bursts of 10 (the GPU kept busy), how many calls have a recorded graph, the device memory
the records took (``mem_get_info``) and the time of the first two passes (first sightings,
then captures). Rank 0 prints and writes JSON; one last call is checked against float64.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

import overlap
import overlap.ops as ops
from overlap.context import records


def _used_mib() -> float:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def main(out_path: str) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("gloo")
    dev = torch.device("cuda", 0)
    M, N, K = 1024, 4096, 4096
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16).t()

    def call(o: torch.Tensor) -> None:
        overlap.matmul_collective(x, w, "all_reduce", out=o, chunks=4, backend="ce")

    rows = []
    for kept in (64, 1024):
        for n in (32, 128, 384):
            overlap.release()
            ops.MAX_RECORDS = kept
            outs = [torch.empty(M, N, device=dev, dtype=torch.bfloat16) for _ in range(n)]
            call(outs[0])  # the transport's buffers
            before = _used_mib()
            t0 = time.perf_counter()
            for _ in range(2):  # first sightings, then captures
                for o in outs:
                    call(o)
            torch.cuda.synchronize()
            passes = time.perf_counter() - t0
            after = _used_mib()
            per = []
            for r in range(20):
                dist.barrier()
                torch.cuda._sleep(50_000_000)  # the GPU stays busy: only the host is measured
                t0 = time.perf_counter()
                for i in range(10):
                    call(outs[(r * 10 + i) % n])
                per.append((time.perf_counter() - t0) * 1e3 / 10)
                torch.cuda.synchronize()
            per.sort()
            row = dict(max_records=kept, signatures=n, ms_per_call=per[len(per) // 2],
                       ms_min=per[0], graphs=sum(r.graph is not None for r in records.values()),
                       records_mib=after - before, first_two_passes_s=passes)  # fmt: skip
            rows.append(row)
            if dist.get_rank() == 0:
                print(row, flush=True)
            del outs
    o = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
    for _ in range(3):  # a first sighting, a capture, a replay
        call(o)
    prod = (x.double() @ w.double()).cpu()
    prods = [torch.empty_like(prod) for _ in range(2)]
    dist.all_gather(prods, prod)
    want = sum(prods)
    err = ((o.double().cpu() - want).norm() / want.norm()).item()
    if dist.get_rank() == 0:
        print("relative error of the last call against float64:", err)
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                    date=time.strftime("%Y-%m-%d"), shape=[M, N, K])  # fmt: skip
        with open(out_path, "w") as f:
            json.dump(dict(meta=meta, rows=rows, rel_err=err), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
