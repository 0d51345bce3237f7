"""Host time of the plain path on GPUs, piece by piece (session 32, 2x H200, host_plain_s32_h200.txt):
    torchrun --nproc-per-node=2 bench_results/hostparts_s32.py OUT.txt"""
import os, sys, time, statistics, torch, torch.distributed as dist
local = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(local); dev = torch.device("cuda", local)
dist.init_process_group("nccl", device_id=dev)
import overlap
from overlap.ops import _engine, _record
from overlap.ops._checks import capturing, needs_grad
x = torch.randn(16, 4096, device=dev, dtype=torch.bfloat16)
w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16).t()
rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
def t_rs(): y = x @ w; rs(y.new_empty(8, 4096), y)
def o_rs(): overlap.matmul_reduce_scatter(x, w)
def t_ar(): y = x @ w; dist.all_reduce(y)
def o_ar(): overlap.matmul_allreduce(x, w)
for f in (t_rs, o_rs, t_ar, o_ar): f(); f()
torch.cuda.synchronize()
sig = _record.signature("reduce_scatter", None, "sum", "auto", None, x, w)
known = _engine.calls.get(sig)
def per_call(f, n=50, rounds=40):
    best = []
    for _ in range(rounds):
        torch.cuda.synchronize(); dist.barrier(); torch.cuda._sleep(5_000_000)
        t0 = time.perf_counter()
        for _ in range(n): f()
        best.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(best), min(best)
lines = [f"{torch.cuda.get_device_name()} torch {torch.__version__}; us per call, median / min of 40 rounds of 50"]
pairs = [("torch RS", t_rs), ("library RS", o_rs), ("torch AR", t_ar), ("library AR", o_ar)]
for rep in range(2):
    for name, f in pairs:
        med, low = per_call(f)
        lines.append(f"{name:12s} {med:7.1f} / {low:7.1f}")
# the same with NCCL's calls replaced by no-ops: the Python around them on CUDA tensors
noop = lambda *a, **k: None
for n in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single"):
    if hasattr(dist, n): setattr(dist, n, noop)
rs = noop
for name, f in pairs:
    lines.append(f"no-op NCCL: {name:12s} {per_call(f)[0]:7.1f}")
pieces = {
    "x @ w": lambda: x @ w,
    "y.new_empty": lambda: x.new_empty(8, 4096),
    "signature": lambda: _record.signature("reduce_scatter", None, "sum", "auto", None, x, w),
    "calls.get(sig)": lambda: _engine.calls.get(sig),
    "needs_grad": lambda: needs_grad(x, w),
    "is_compiling": lambda: torch.compiler.is_compiling(),
    "capturing (not asked on a hit)": lambda: capturing(x),
    "plain_again (no-op NCCL)": lambda: _engine.plain_again(x, w, "reduce_scatter", None, "sum", "auto", None, "l"),
    "_engine.plain (no-op NCCL)": lambda: _engine.plain(x, w, None, known.plan, None, None, known.shape),
}
for name, f in pieces.items():
    lines.append(f"piece {name:32s} {per_call(f, n=200, rounds=10)[1]:6.2f}")
if dist.get_rank() == 0:
    print("\n".join(lines))
    open(sys.argv[1], "w").write("\n".join(lines) + "\n")
dist.destroy_process_group()
