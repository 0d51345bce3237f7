"""No GPU needed: compile the library's chunk GEMM for Hopper (sm_90) as a call would launch it,
and print what the compiler says of it: registers, spilled bytes, shared memory, and ptxas's
warnings (C7515: the wgmma pipeline serialized). A kernel change that spills or serializes the
wgmma pipeline is slower on the GPU; this shows it before any device time is spent.

    python tools/kernel_report.py [--shapes 4096x8192x4096,...] [--worlds 2,4,8]
        [--kinds ar,ce] [--dtype bf16] [--matmul PATH]

Kinds as in ``tools/gemm_sweep.py``: ``ar``, NCCL per chunk's kernel on an all-reduce plan (one
program per tile); ``ce``, the copy engines' kernel (blocked all-reduce plan, rank 0, the fused
epilogue; persistent). ``--matmul``: another version of ``overlap/gemm/matmul.py`` (its ``from
..`` imports made ``from overlap.``), for an A/B. The host code of that file builds the
arguments (its ``_launch`` is intercepted), so they are what a call passes; Triton's JIT
specialization is imitated (integers equal to 1 become constants, integers and pointers
divisible by 16 are marked so). Runs the ptxas that Triton assembles sm_90 with.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from _benchrun import load
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from triton.tools.tensor_descriptor import TensorDescriptor

import overlap.gemm.matmul
from overlap.contract import Epilogue
from overlap.plan import make_plan

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
KINDS = ("ar", "ce")
_TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32"}


def _signature(kernel, args: dict) -> tuple[dict, dict, dict]:
    """``(signature, constexprs, attrs)`` for ``ASTSource`` from a launch's arguments (by
    name)."""
    consts = {p.name for p in kernel.params if p.is_constexpr}
    sig, cst, attrs = {}, {n: args[n] for n in kernel.arg_names if n in consts}, {}
    for i, name in enumerate(kernel.arg_names):
        a = args[name]
        if name in consts:
            sig[name] = "constexpr"
        elif isinstance(a, TensorDescriptor):
            sig[name] = f"tensordesc<{_TY[a.base.dtype]}{list(a.block_shape)}>"
        elif isinstance(a, torch.Tensor):
            sig[name] = "*" + _TY[a.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # (CPU tensors are 64-byte aligned)
        elif isinstance(a, float):
            sig[name] = "fp32"
        elif a == 1:
            sig[name], cst[name] = "constexpr", 1
        else:
            sig[name] = "i32" if -(2**31) <= a < 2**31 else "i64"
            if a % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, cst, attrs


def report(mm, kind: str, M: int, N: int, K: int, R: int, dtype: torch.dtype) -> dict:
    """Compile module ``mm``'s kernel for one call of ``kind`` and return the compiler's facts."""
    x, w = torch.randn(M, K).to(dtype), torch.randn(N, K).to(dtype).t()
    blocked = kind == "ce"
    kw = dict(world_size=R, collective="all_reduce", dtype_bits=dtype.itemsize * 8, num_sms=132,
              blocked=blocked, transport="ce" if blocked else "torch")  # fmt: skip
    p = make_plan(M, N, K, **kw)
    if p.path != "overlap":  # a small product (plain by default): the plan chunks=R forces
        p = make_plan(M, N, K, chunks=R, **kw)
    epi = None
    if blocked:
        flags = torch.ones(R * p.bands_per_block, dtype=torch.int32)
        epi = Epilogue(torch.empty(M, N, dtype=dtype), torch.empty(R, M // R, N, dtype=dtype),
                       flags, 0)  # fmt: skip
    seen = {}
    real_launch, real_programs = mm._launch, mm._programs

    def launch(grid, *rest):  # what the kernel would be launched with
        if len(rest) == 4:  # older versions: (args in order, constexprs by name, ...)
            args, consts, warps, stages = rest
            named = dict(zip(mm._chunked_matmul_kernel.arg_names, args, strict=False))
            rest = (named | consts, warps, stages)
        seen.update(grid=grid, args=rest[0], warps=rest[1], stages=rest[2])

    mm._launch = launch
    mm._programs = lambda device: 132  # an H100's and an H200's SMs
    try:
        mm.chunked_matmul(x, w, torch.empty(M * N, dtype=dtype),
                          torch.zeros(p.n_chunks, dtype=torch.int32), p, epilogue=epi)  # fmt: skip
    finally:
        mm._launch, mm._programs = real_launch, real_programs
    kernel = mm._chunked_matmul_kernel
    sig, cst, attrs = _signature(kernel, seen["args"])
    src = ASTSource(kernel, sig, constexprs=cst, attrs=attrs)
    opts = dict(num_warps=seen["warps"], num_stages=seen["stages"])
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    ptxas = get_ptxas(90).path  # the one Triton itself assembles sm_90 with
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(k.asm["ptx"])
        done = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", ptx + ".cubin"],
                              capture_output=True, text=True, check=True)  # fmt: skip
    text = done.stdout + done.stderr
    return dict(
        kind=kind,
        shape=f"{M}x{N}x{K}",
        world=R,
        stages=seen["stages"],
        grid=seen["grid"],
        registers=int(re.search(r"Used (\d+) registers", text).group(1)),
        spilled=int(re.search(r"(\d+) bytes spill stores", text).group(1)),
        shared=k.metadata.shared,
        warnings=sorted(set(re.findall(r"\((C\d+)\) ([^']*?) in the function", text))),
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shapes",
        default="4096x8192x4096,16384x8192x1024",
        help="MxNxK,... (small products: the plan that chunks=R forces)",
    )
    ap.add_argument("--worlds", default="2,4,8", help="world sizes of ce (ar: 2)")
    ap.add_argument("--kinds", default="ar,ce", help="of " + ",".join(KINDS))
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--matmul", help="another matmul.py (imports from overlap.)")
    a = ap.parse_args(argv)
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
        worlds = [int(r) for r in a.worlds.split(",")]
    except ValueError:
        ap.error("--shapes takes MxNxK,... and --worlds R,... (integers)")
    if any(len(s) != 3 for s in shapes):
        ap.error(f"--shapes takes MxNxK,...: got {a.shapes}")
    kinds = a.kinds.split(",")
    if not set(kinds) <= set(KINDS):
        ap.error(f"--kinds takes {','.join(KINDS)}: got {a.kinds}")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("tools/kernel_report.py compiles for the GPU: run it without TRITON_INTERPRET=1")
    mm = load(a.matmul, "matmul_other") if a.matmul else overlap.gemm.matmul
    print(f"{'kind':>4} {'MxNxK':>18} {'R':>2} {'stages':>6} {'regs':>4} {'spilled':>7} "
          f"{'shared':>7}  ptxas warnings")  # fmt: skip
    for M, N, K in shapes:
        for kind in kinds:
            for R in worlds if kind == "ce" else [2]:
                r = report(mm, kind, M, N, K, R, DTYPES[a.dtype])
                warn = "; ".join(f"{c}: {t}" for c, t in r["warnings"]) or "-"
                print(f"{kind:>4} {r['shape']:>18} {R:>2} {r['stages']:>6} {r['registers']:>4} "
                      f"{r['spilled']:>7} {r['shared']:>7}  {warn}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
