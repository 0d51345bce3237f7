"""Host cost of the calls an overlapped call makes, on one GPU: what a copy-engine transport
call spends its host time on (NOTES.md: 0.3-0.95 ms per call on 2x H200).

    python tools/host_calls.py OUT.json

Times, in microseconds of host time per call (the GPU is kept busy by a sleep kernel so
that no call waits for it): cuda-python's stream memory write and wait and ``cuMemcpyAsync``,
the same three through ``ctypes`` on ``libcuda`` directly, one ``cuStreamBatchMemOp`` of 8
writes, and the launch of the chunk GEMM (grid and persistent, with and without the fused
epilogue) next to ``torch.matmul``'s.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import torch


def _per_call(fn, n: int = 200, rounds: int = 5) -> float:
    """Median over rounds of host microseconds per call of ``fn`` (n calls behind a sleep)."""
    got = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: the queue never drains
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        got.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return sorted(got)[len(got) // 2]


def main(out_path: str) -> None:
    from cuda.bindings import driver as drv

    from overlap.gemm import Fuse, chunked_matmul
    from overlap.plan import make_plan

    res = {}
    s = torch.cuda.Stream()
    h = s.cuda_stream
    flags = torch.zeros(64, dtype=torch.int32, device="cuda")
    a = flags.data_ptr()
    src = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    geq = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    res["cuda-python write"] = _per_call(
        lambda: drv.cuStreamWriteValue32(drv.CUstream(h), drv.CUdeviceptr(a), 0, 0)
    )
    res["cuda-python wait"] = _per_call(
        lambda: drv.cuStreamWaitValue32(drv.CUstream(h), drv.CUdeviceptr(a), 0, geq)
    )
    res["cuda-python copy 1MB"] = _per_call(lambda: drv.cuMemcpyAsync(
        drv.CUdeviceptr(dst.data_ptr()), drv.CUdeviceptr(src.data_ptr()), 1 << 20,
        drv.CUstream(h)))  # fmt: skip
    cs, cp = drv.CUstream(h), drv.CUdeviceptr(a)
    res["cuda-python write, objects kept"] = _per_call(
        lambda: drv.cuStreamWriteValue32(cs, cp, 0, 0)
    )

    lib = ctypes.CDLL("libcuda.so.1")

    def sym(*names):
        for n in names:
            try:
                return getattr(lib, n)
            except AttributeError:
                pass
        raise AttributeError(names)

    wv = sym("cuStreamWriteValue32_v2", "cuStreamWriteValue32")
    wt = sym("cuStreamWaitValue32_v2", "cuStreamWaitValue32")
    cpy = sym("cuMemcpyAsync")
    for f in (wv, wt):
        f.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        f.restype = ctypes.c_int
    cpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    cpy.restype = ctypes.c_int
    res["ctypes write rc"] = wv(h, a, 0, 0)
    res["ctypes wait rc"] = wt(h, a, 0, 0)
    res["ctypes copy rc"] = cpy(dst.data_ptr(), src.data_ptr(), 1 << 20, h)
    res["ctypes write"] = _per_call(lambda: wv(h, a, 0, 0))
    res["ctypes wait"] = _per_call(lambda: wt(h, a, 0, 0))
    res["ctypes copy 1MB"] = _per_call(lambda: cpy(dst.data_ptr(), src.data_ptr(), 1 << 20, h))

    try:  # 8 flag writes in one batch
        ops = []
        for i in range(8):
            p = drv.CUstreamBatchMemOpParams()
            p.writeValue.operation = drv.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_32
            p.writeValue.address = drv.CUdeviceptr(a + 4 * i)
            p.writeValue.value = 1
            p.writeValue.flags = 0
            ops.append(p)
        res["cuda-python batch of 8 writes rc"] = str(drv.cuStreamBatchMemOp(cs, 8, ops, 0)[0])
        res["cuda-python batch of 8 writes"] = _per_call(
            lambda: drv.cuStreamBatchMemOp(cs, 8, ops, 0)
        )
    except Exception as e:  # noqa: BLE001
        res["batch error"] = repr(e)[:200]

    M, N, K = 4096, 8192, 4096
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t()
    y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    res["torch.matmul launch"] = _per_call(lambda: torch.matmul(x, w, out=y), n=50)
    cnt = torch.zeros(64, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = make_plan(M, N, K, world_size=2, collective="all_reduce", dtype_bits=16)
    bplan = make_plan(M, N, K, world_size=2, collective="all_reduce", dtype_bits=16, blocked=True)
    recv = torch.zeros(2, M // 2, N, device="cuda", dtype=torch.bfloat16)
    kflags = torch.ones(64, dtype=torch.int32, device="cuda")  # epoch 1 already there
    fuse = Fuse(y, recv, kflags, 1, 0, True)
    for name, p, kw in (("grid", plan, {}), ("persistent", plan, {"programs": sms}),
                        ("fused grid", bplan, {"fuse": fuse}),
                        ("fused persistent", bplan, {"fuse": fuse, "programs": sms})):  # fmt: skip
        chunked_matmul(x, w, y.view(-1), cnt, p, **kw)
        res[f"chunk GEMM launch, {name}"] = _per_call(
            lambda p=p, kw=kw: chunked_matmul(x, w, y.view(-1), cnt, p, **kw), n=50)  # fmt: skip
    t0 = time.perf_counter()
    for _ in range(200):
        torch.cuda.current_stream()
    res["torch.cuda.current_stream()"] = (time.perf_counter() - t0) / 200 * 1e6
    res["device"] = torch.cuda.get_device_name()
    res["versions"] = f"torch {torch.__version__}"
    for k, v in res.items():
        print(f"{k:45s} {v:.2f}" if isinstance(v, float) else f"{k:45s} {v}")
    json.dump(res, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
