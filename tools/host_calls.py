"""Host cost of the calls an overlapped call makes, on one GPU: what a copy-engine transport call
spends its host time on (NOTES.md: 0.3-0.95 ms per call on 2x H200).

    python tools/host_calls.py OUT.json

Times, in microseconds of host time per call (the GPU is kept busy by a sleep kernel so that no
call waits for it): cuda-python's stream memory write and wait and ``cuMemcpyAsync``, the same
three through ``ctypes`` on ``libcuda`` directly, one ``cuStreamBatchMemOp`` of 8 writes, and
the launch of the chunk GEMM (the plain kernel and the fused one; as the library launches it,
and through Triton's JIT every time, taking turns; and a profile of the fused launch) next to
``torch.matmul``'s; ``_driver()`` (the driver module, looked up for every driver call) uncached
and cached; the same ops queued behind a stream wait that is not met yet (as on a real call's
communication stream); and the Python of the copy-engine transport's ``begin`` + ``run`` for one
call of rank 0 of 2, its driver calls stubbed out (a local buffer stands in for the symmetric
one); and a call that the library hands to its plain path (world size 1) against ``x @ w``."""

from __future__ import annotations

import contextlib
import cProfile
import ctypes
import io
import json
import pstats
import sys
import time
import types

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

    from overlap.contract import Epilogue
    from overlap.gemm import chunked_matmul
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

    # The same ops queued behind a stream wait that is not met yet, as in a real call (the
    # communication stream waits for the GEMM's counters): 16 rounds of wait, copy, write.
    gate = torch.zeros(1, dtype=torch.int32, device="cuda")
    q = torch.cuda.Stream()
    qh, gp = drv.CUstream(q.cuda_stream), drv.CUdeviceptr(gate.data_ptr())
    got = []
    for rnd in range(5):
        torch.cuda.synchronize()
        target = rnd + 1
        t0 = time.perf_counter()
        for _ in range(16):
            drv.cuStreamWaitValue32(qh, gp, target, geq)
            drv.cuMemcpyAsync(drv.CUdeviceptr(dst.data_ptr()), drv.CUdeviceptr(src.data_ptr()),
                              1 << 20, qh)  # fmt: skip
            drv.cuStreamWriteValue32(qh, drv.CUdeviceptr(a), 0, 0)
        got.append((time.perf_counter() - t0) / 48 * 1e6)
        gate.fill_(target)  # on the default stream: releases q
        torch.cuda.synchronize()
    res["ops queued behind an unmet wait, us per op"] = sorted(got)[2]

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
    import overlap  # its plain path, whole (world size 1: the matmul alone), against x @ w

    xd = x[:16]
    res["overlap.matmul_allreduce, plain path, M = 16"] = _per_call(
        lambda: overlap.matmul_allreduce(xd, w), n=50
    )
    res["x @ w, M = 16"] = _per_call(lambda: xd @ w, n=50)
    cnt = torch.zeros(64, dtype=torch.int32, device="cuda")
    plan = make_plan(M, N, K, world_size=2, collective="all_reduce", dtype_bits=16)
    bplan = make_plan(M, N, K, world_size=2, collective="all_reduce", dtype_bits=16, blocked=True)
    recv = torch.zeros(2, M // 2, N, device="cuda", dtype=torch.bfloat16)
    kflags = torch.ones(64, dtype=torch.int32, device="cuda")  # every flag set already
    epi = Epilogue(y, recv, kflags, 0)
    for name, p, kw in (("grid", plan, {}), ("fused grid", bplan, {"epilogue": epi})):
        chunked_matmul(x, w, y.view(-1), cnt, p, **kw)
        for turn in (1, 2):  # taking turns: the first runs after a compile measured slower
            res[f"chunk GEMM launch, {name} ({turn})"] = _per_call(
                lambda p=p, kw=kw: chunked_matmul(x, w, y.view(-1), cnt, p, **kw), n=50
            )
            with _through_jit():
                res[f"chunk GEMM launch, {name}, through Triton's JIT ({turn})"] = _per_call(
                    lambda p=p, kw=kw: chunked_matmul(x, w, y.view(-1), cnt, p, **kw), n=50
                )
    res["launch profile (fused grid, memo)"] = _profile(
        lambda: chunked_matmul(x, w, y.view(-1), cnt, bplan, epilogue=epi)
    )
    from overlap.signal import wait as wait_mod

    for name, fn in (("_driver() uncached", wait_mod._driver.__wrapped__),
                     ("_driver() cached", wait_mod._driver)):  # fmt: skip
        t0 = time.perf_counter()
        for _ in range(10000):
            fn()
        res[name] = (time.perf_counter() - t0) / 10000 * 1e6
    res.update(_transport_python())
    t0 = time.perf_counter()
    for _ in range(200):
        torch.cuda.current_stream()
    res["torch.cuda.current_stream()"] = (time.perf_counter() - t0) / 200 * 1e6
    res["device"] = torch.cuda.get_device_name()
    res["versions"] = f"torch {torch.__version__}"
    for k, v in res.items():
        print(f"{k:45s} {v:.2f}" if isinstance(v, float) else f"{k:45s}\n{v}")
    json.dump(res, open(out_path, "w"), indent=1)


@contextlib.contextmanager
def _through_jit():
    """Launch the chunk GEMM through Triton's JIT every time (the memo of ``_launch`` off)."""
    from overlap.gemm import matmul as mm

    real = mm._launch
    mm._launch = lambda grid, args, consts, warps, stages: mm._chunked_matmul_kernel[(grid,)](
        *args, **consts, num_warps=warps, num_stages=stages)  # fmt: skip
    try:
        yield
    finally:
        mm._launch = real


def _profile(fn, n: int = 200) -> str:
    """cProfile of ``n`` calls of ``fn`` (GPU kept busy): the 12 functions of most own time."""
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
    return buf.getvalue()


def _transport_python() -> dict:
    """Microseconds of Python per ``begin`` + ``run`` of the copy-engine transport (rank 0 of
    2, driver calls stubbed), for the bench's large shapes' plans."""
    from overlap.comm.peer import PeerTransport
    from overlap.contract import FLAGS_BYTES
    from overlap.plan import make_plan
    from overlap.signal import wait as wait_mod

    class Stub:  # the driver calls the transport makes, doing nothing
        class CUresult:
            CUDA_SUCCESS = 0

        class CUstreamWaitValue_flags:
            CU_STREAM_WAIT_VALUE_GEQ = 1

        class CUstreamBatchMemOpType:
            CU_STREAM_MEM_OP_WAIT_VALUE_32 = CU_STREAM_MEM_OP_WRITE_VALUE_32 = 0

        CUstreamBatchMemOpParams = staticmethod(lambda: types.SimpleNamespace(
            waitValue=types.SimpleNamespace(), writeValue=types.SimpleNamespace()))  # fmt: skip
        CUstream = CUdeviceptr = staticmethod(lambda v: v)
        cuMemcpyAsync = cuStreamBatchMemOp = staticmethod(lambda *a: (0,))

    real, wait_mod._driver = wait_mod._driver, lambda: Stub
    res = {}
    try:
        for M, N, K in ((4096, 8192, 4096), (16384, 8192, 4096)):
            for coll in ("all_reduce", "reduce_scatter"):
                p = make_plan(M, N, K, world_size=2, collective=coll, dtype_bits=16, blocked=True)
                t = object.__new__(PeerTransport)
                t.group, t.device, t.rank, t.size, t.broken = None, None, 0, 2, False
                t._views, t.zeros = {}, torch.zeros(FLAGS_BYTES, dtype=torch.uint8, device="cuda")
                stream = types.SimpleNamespace(cuda_stream=0)  # run reads its handle
                t.buf = torch.empty(FLAGS_BYTES + 2 * M * N * 2, dtype=torch.uint8, device="cuda")
                t.ptrs = [t.buf.data_ptr()] * 2
                out = torch.empty(M if coll == "all_reduce" else M // 2, N, device="cuda",
                                  dtype=torch.bfloat16)  # fmt: skip
                t.begin(p, out, stream)
                t0 = time.perf_counter()
                for _ in range(500):
                    slots, _ = t.begin(p, out, stream)
                    t.run(p, slots, out, lambda c, ops: ops.wait(0, 1), stream)
                us = (time.perf_counter() - t0) / 500 * 1e6
                res[f"transport Python, {coll} {M}x{N}, {p.n_chunks} chunks"] = us
                del t
    finally:
        wait_mod._driver = real
    return res


if __name__ == "__main__":
    main(sys.argv[1])
