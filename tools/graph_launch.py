"""Host cost of replaying a CUDA graph, by kind and number of nodes (one GPU, one process).

    python tools/graph_launch.py graph_launch.json

Graphs of n tiny kernels, n 4-byte copies (one stream, or forked onto a second), n stream
memory writes or waits (``cuStreamWriteValue32`` / ``cuStreamWaitValue32``, each one node),
and n alternating writes and waits batched ``k`` to a ``cuStreamBatchMemOp`` ("batchk": n / k
nodes). Per graph: host microseconds per ``graph.replay()``, a replay alone and replays 20
back to back (the GPU kept busy by a sleep so that it never holds the host back), and the
same operations issued eagerly. It is why the copy-engine transports batch their flag waits
and writes (``overlap.signal.wait.StreamOps``).
"""

from __future__ import annotations

import json
import sys
import time

import torch
from cuda.bindings import driver as drv

KINDS = ("kernel", "memcpy", "write", "wait", "batch2", "batch4", "batch32", "fork")


def _param(write: bool, addr: int, value: int):
    p = drv.CUstreamBatchMemOpParams()
    t = drv.CUstreamBatchMemOpType
    if write:
        p.operation = p.writeValue.operation = t.CU_STREAM_MEM_OP_WRITE_VALUE_32
        v, v_flags = p.writeValue, 0
    else:
        p.operation = p.waitValue.operation = t.CU_STREAM_MEM_OP_WAIT_VALUE_32
        v, v_flags = p.waitValue, int(drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
    v.address, v.value, v.flags = drv.CUdeviceptr(addr), value, v_flags
    return p


def issue(kind: str, n: int, s: torch.cuda.Stream, buf: torch.Tensor, src: torch.Tensor):
    """``n`` operations of ``kind`` on stream ``s`` (waits are already met: GEQ 0)."""
    cu, base = drv.CUstream(s.cuda_stream), buf.data_ptr()
    errs = []
    if kind == "kernel":
        for i in range(n):
            buf[i : i + 1].add_(1)
    elif kind == "memcpy":
        for i in range(n):
            ptr = drv.CUdeviceptr(base + 4 * i)
            errs += drv.cuMemcpyAsync(ptr, drv.CUdeviceptr(src.data_ptr()), 4, cu)
    elif kind == "write":
        for i in range(n):
            errs += drv.cuStreamWriteValue32(cu, drv.CUdeviceptr(base + 4 * i), 1, 0)
    elif kind == "wait":
        geq = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        for i in range(n):
            errs += drv.cuStreamWaitValue32(cu, drv.CUdeviceptr(base + 4 * i), 0, geq)
    elif kind.startswith("batch"):  # writes (even i) and waits (odd i), k to a batch
        k = int(kind[5:])
        ops = [_param(i % 2 == 0, base + 4 * i, 1 - i % 2) for i in range(n)]
        for j in range(0, n, k):
            errs += drv.cuStreamBatchMemOp(cu, len(ops[j : j + k]), ops[j : j + k], 0)
    elif kind == "fork":  # n copies on a second stream, forked and joined
        side = torch.cuda.Stream(s.device)
        side.wait_stream(s)
        issue("memcpy", n, side, buf, src)
        s.wait_stream(side)
    assert all(e == drv.CUresult.CUDA_SUCCESS for e in errs), errs


def timed(fn, burst: int) -> float:
    """Median host microseconds per ``fn()`` over 25 rounds of ``burst`` calls."""
    per = []
    for _ in range(25):
        torch.cuda._sleep(10_000_000)  # the GPU stays busy: only the host is measured
        t0 = time.perf_counter()
        for _ in range(burst):
            fn()
        per.append((time.perf_counter() - t0) * 1e6 / burst)
        torch.cuda.synchronize()
    return sorted(per)[len(per) // 2]


def main() -> None:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    buf = torch.zeros(4096, dtype=torch.int32, device=dev)
    src = torch.zeros(1, dtype=torch.int32, device=dev)
    rows = []
    for kind in KINDS:
        for n in (1, 4, 16, 32):
            if kind.startswith("batch") and n < 2:
                continue
            g = torch.cuda.CUDAGraph(keep_graph=True)
            s = torch.cuda.Stream(dev)
            with torch.cuda.stream(s):
                g.capture_begin()
                issue(kind, n, s, buf, src)
                g.capture_end()
            g.instantiate()
            g.replay()
            torch.cuda.synchronize()
            _, _, nodes = drv.cuGraphGetNodes(drv.CUgraph(g.raw_cuda_graph()), 0)
            s2 = torch.cuda.Stream(dev)
            with torch.cuda.stream(s2):
                eager = timed(lambda kind=kind, n=n, s2=s2: issue(kind, n, s2, buf, src), 5)
            row = dict(kind=kind, ops=n, nodes=int(nodes), replay_us_alone=timed(g.replay, 1),
                       replay_us_burst=timed(g.replay, 20), eager_us=eager)  # fmt: skip
            buf.zero_()
            torch.cuda.synchronize()
            rows.append(row)
            print(row, flush=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                date=time.strftime("%Y-%m-%d"))  # fmt: skip
    with open(sys.argv[1], "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
