"""One GPU: does cuBLASLt's atomic synchronization give a cuBLAS GEMM that signals each finished
chunk (issue 16's lever), for bf16/fp16, and at what speed? Prints a table and writes JSON.

    python tools/cublaslt_atomic.py OUT.json [--shapes MxNxK,...] [--chunks 2,4,8]

cuBLASLt (through ``ctypes`` on the ``libcublasLt`` that torch loads; no build) computes the row-
major ``out [M, N] = x [M, K] @ w [K, N]`` as the column-major ``D [N, M] = A [N, K] B [K, M]``.
Row bands of ``out`` are column chunks of ``D``:
``CUBLASLT_MATMUL_DESC_ATOMIC_SYNC_NUM_CHUNKS_D_COLS`` = chunks, ``..._OUT_COUNTERS_POINTER`` =
int32 counters set to 1 before the call; the GEMM is to write 0 into a chunk's counter once the
chunk is complete (TransformerEngine's userbuffers protocol). Per shape, dtype and layout (``nk``:
``w = weight.t()``; ``kn``: row-major ``[K, N]``): how many algorithms the heuristic offers with
and without atomic chunks and whether they claim ``ATOMIC_SYNC``; the product against
``torch.matmul``; the counters afterwards; the time (``do_bench`` median) of ``torch.matmul``,
cuBLASLt without and with chunks; and the order in which chunks complete: an observer kernel on a
second stream (one program per chunk) spins on each counter and stamps ``globaltimer`` when it
reads 0, between stamps taken just before and after the GEMM on its stream (fractions of the GEMM's
span; an observer gives up after 1 s and writes -1, so a GEMM that never signals costs a second,
not a hang)."""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import time

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

# cublasLt enums (cublasLt.h, library_types.h)
COMPUTE_32F, R_32F, R_16F, R_16BF = 68, 0, 2, 14
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB = 3, 4
DESC_CHUNKS_D_ROWS, DESC_CHUNKS_D_COLS, DESC_OUT_COUNTERS = 27, 28, 30
PREF_MAX_WORKSPACE = 1
CAP_ATOMIC_SYNC = 20
WORKSPACE = 32 << 20
DTYPES = {"bf16": (torch.bfloat16, R_16BF), "fp16": (torch.float16, R_16F)}


class _Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [
        ("algo", ctypes.c_uint64 * 8),
        ("workspace", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def _lib() -> ctypes.CDLL:
    torch.matmul(torch.ones(8, 8, device="cuda"), torch.ones(8, 8, device="cuda"))  # loads cuBLAS
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    import site

    for d in site.getsitepackages():
        for path in sorted(
            glob.glob(os.path.join(d, "nvidia", "**", "libcublasLt.so*"), recursive=True)
        ):
            return ctypes.CDLL(path)
    raise OSError("libcublasLt not found")


class Lt:
    """The few cuBLASLt calls the probe needs; every status checked."""

    def __init__(self):
        self.lib = _lib()
        ver = self.lib.cublasLtGetVersion
        ver.restype = ctypes.c_size_t
        self.version = ver()
        self.handle = ctypes.c_void_p()
        self._ok(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")

    @staticmethod
    def _ok(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what}: cublasStatus {status}")

    def _set(self, fn, obj, attr: int, value, ctype=ctypes.c_int32) -> None:
        v = ctype(value)
        self._ok(fn(obj, attr, ctypes.byref(v), ctypes.sizeof(v)), f"set attribute {attr}")

    def _layout(self, dt: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        h = ctypes.c_void_p()
        self._ok(
            self.lib.cublasLtMatrixLayoutCreate(
                ctypes.byref(h),
                dt,
                ctypes.c_uint64(rows),
                ctypes.c_uint64(cols),
                ctypes.c_int64(ld),
            ),
            "layout",
        )
        return h

    def plan(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        out: torch.Tensor,
        chunks: int,
        counters: torch.Tensor | None,
        n_algos: int = 8,
    ):
        """``(launch, info)`` for ``out = x @ w`` with ``chunks`` atomic row-band chunks (negative:
        ``-chunks`` column bands of ``out``, i.e. chunks of ``D``'s rows; 0:
        none); ``launch`` is ``None`` when no algorithm is offered."""
        M, K = x.shape
        N = w.shape[1]
        dt = DTYPES[{torch.bfloat16: "bf16", torch.float16: "fp16"}[x.dtype]][1]
        desc = ctypes.c_void_p()
        self._ok(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, R_32F), "desc")
        set_desc = self.lib.cublasLtMatmulDescSetAttribute
        if w.stride(0) == 1:  # w = weight.t(): memory is [N, K] rows, column-major K x N, ld K
            self._set(set_desc, desc, DESC_TRANSA, OP_T)
            a_l = self._layout(dt, K, N, w.stride(1))
        else:  # row-major [K, N]: column-major N x K, ld N
            a_l = self._layout(dt, N, K, w.stride(0))
        b_l = self._layout(dt, K, M, x.stride(0))
        d_l = self._layout(dt, N, M, out.stride(0))
        if chunks:
            self._set(set_desc, desc, DESC_CHUNKS_D_ROWS, max(-chunks, 1))
            self._set(set_desc, desc, DESC_CHUNKS_D_COLS, max(chunks, 1))
            self._set(set_desc, desc, DESC_OUT_COUNTERS, counters.data_ptr(), ctypes.c_void_p)
        pref = ctypes.c_void_p()
        self._ok(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        self._set(
            self.lib.cublasLtMatmulPreferenceSetAttribute,
            pref,
            PREF_MAX_WORKSPACE,
            WORKSPACE,
            ctypes.c_uint64,
        )
        results = (_Heuristic * n_algos)()
        found = ctypes.c_int(0)
        status = self.lib.cublasLtMatmulAlgoGetHeuristic(
            self.handle, desc, a_l, b_l, d_l, d_l, pref, n_algos, results, ctypes.byref(found)
        )
        info = dict(heuristic_status=status, algos=found.value, atomic_caps=[])
        for i in range(found.value):
            cap, written = ctypes.c_int32(-1), ctypes.c_size_t(0)
            self.lib.cublasLtMatmulAlgoCapGetAttribute(
                ctypes.byref(results[i].algo),
                CAP_ATOMIC_SYNC,
                ctypes.byref(cap),
                4,
                ctypes.byref(written),
            )
            info["atomic_caps"].append(cap.value)
        if status != 0 or found.value == 0:
            return None, info
        algo = results[0]
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        launch_args = (desc, a_l, b_l, d_l, pref, results)  # kept alive by the closure
        ws = self.workspace.data_ptr()

        def launch():
            assert launch_args
            s = self.lib.cublasLtMatmul(
                self.handle,
                desc,
                ctypes.byref(alpha),
                ctypes.c_void_p(w.data_ptr()),
                a_l,
                ctypes.c_void_p(x.data_ptr()),
                b_l,
                ctypes.byref(beta),
                ctypes.c_void_p(out.data_ptr()),
                d_l,
                ctypes.c_void_p(out.data_ptr()),
                d_l,
                ctypes.byref(algo.algo),
                ctypes.c_void_p(ws),
                ctypes.c_size_t(WORKSPACE),
                ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
            )
            if s != 0:
                raise RuntimeError(f"cublasLtMatmul: cublasStatus {s}")

        return launch, info


@triton.jit
def _stamp(ptr):
    tl.store(ptr, tl.extra.cuda.globaltimer())


@triton.jit
def _observe(cnt_ptr, stamp_ptr):
    c = tl.program_id(0)
    t0 = tl.extra.cuda.globaltimer()
    v = tl.atomic_add(cnt_ptr + c, 0, sem="acquire", scope="gpu")
    t = t0
    while (v != 0) & (t - t0 < 1_000_000_000):
        v = tl.atomic_add(cnt_ptr + c, 0, sem="acquire", scope="gpu")
        t = tl.extra.cuda.globaltimer()
    tl.store(stamp_ptr + c, tl.where(v == 0, t, -1))


def order(launch, counters: torch.Tensor, chunks: int) -> list[float]:
    """Fractions of the GEMM's span (stamps before and after it) at which each chunk's counter
    read 0; -1 where it never did within a second."""
    stamps = torch.zeros(chunks + 2, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    counters[:chunks].fill_(1)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        _observe[(chunks,)](counters, stamps[2:], num_warps=1)
    _stamp[(1,)](stamps[0:1], num_warps=1)
    launch()
    _stamp[(1,)](stamps[1:2], num_warps=1)
    torch.cuda.synchronize()
    s = stamps.tolist()
    span = max(s[1] - s[0], 1)
    return [round((t - s[0]) / span, 3) if t >= 0 else -1 for t in s[2:]]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument(
        "--shapes",
        default="4096x8192x4096,8192x8192x14336,16384x8192x4096,"
        "8192x4096x4096,4096x4096x7168,1024x3072x4096,4096x8192x3584",
    )
    ap.add_argument("--chunks", default="2,4,8", help="row bands (also the last as column bands)")
    a = ap.parse_args(argv)
    lt = Lt()
    print(
        f"cuBLASLt version {lt.version}, {torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    rows, t0 = [], time.time()
    chunk_list = [int(c) for c in a.chunks.split(",")]
    for shape in a.shapes.split(","):
        M, N, K = (int(v) for v in shape.split("x"))
        for dname, (dtype, _) in DTYPES.items():
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            for layout in ("nk", "kn"):
                w_nk = torch.randn(N, K, device="cuda", dtype=dtype) / K**0.5
                w = w_nk.t() if layout == "nk" else w_nk.t().contiguous()
                ref = torch.matmul(x, w)
                out = torch.empty(M, N, device="cuda", dtype=dtype)
                counters = torch.ones(64, dtype=torch.int32, device="cuda")
                row = dict(M=M, N=N, K=K, dtype=dname, layout=layout, variants={})
                row["cublas_ms"] = do_bench(
                    lambda: torch.matmul(x, w, out=out), warmup=5, rep=30, return_mode="median"
                )
                for chunks in [0] + chunk_list + [-chunk_list[-1]]:
                    v = {}
                    try:
                        launch, info = lt.plan(x, w, out, chunks, counters)
                    except RuntimeError as e:
                        launch, info = None, dict(error=str(e))
                    v.update(info)
                    if launch is not None:
                        out.fill_(float("nan"))
                        counters.fill_(1)
                        launch()
                        torch.cuda.synchronize()
                        v["err"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                        v["counters_after"] = counters[: max(abs(chunks), 1)].tolist()
                        if chunks:
                            v["order"] = order(launch, counters, abs(chunks))
                        v["ms"] = do_bench(launch, warmup=5, rep=30, return_mode="median")
                        v["ratio"] = v["ms"] / row["cublas_ms"]
                    row["variants"][str(chunks)] = v
                rows.append(row)
                line = f"{shape:>18} {dname} {layout} cuBLAS {row['cublas_ms']:.4f}"
                for c, v in row["variants"].items():
                    if "ms" in v:
                        line += (
                            f" | {c}: {v['ratio']:.3f} err {v['err']:.1e} cnt {v['counters_after']}"
                        )
                        line += f" order {v.get('order', '')}"
                    else:
                        line += f" | {c}: none ({v})"
                print(line, flush=True)
                with open(a.out, "w") as f:
                    json.dump(
                        dict(
                            meta=dict(
                                device=torch.cuda.get_device_name(),
                                torch=torch.__version__,
                                cublaslt=lt.version,
                                date=time.strftime("%Y-%m-%d"),
                                seconds=round(time.time() - t0),
                            ),
                            rows=rows,
                        ),
                        f,
                        indent=1,
                    )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
