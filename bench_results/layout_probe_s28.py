"""One GPU: why the model bench's separate layout is faster than its fused one in plain prefill (8B TP 2
shapes, T = 8192, bf16): each part of a layer's column products and what consumes them, fused (one product,
column views) against separate (one product per weight, contiguous)."""
import json, sys
import torch
import torch.nn.functional as F

sys.path.insert(0, "tools")
from model_bench import attention  # noqa: E402

torch.manual_seed(0)
dev, dt, T, H, R = "cuda", torch.bfloat16, 8192, 4096, int(sys.argv[1]) if len(sys.argv) > 1 else 2
heads, kvh, d, ffn = 32 // R, 8 // R, 128, 14336 // R
x = torch.randn(T, H, device=dev, dtype=dt)
widths = [heads * d, kvh * d, kvh * d]
wqkv = torch.randn(sum(widths), H, device=dev, dtype=dt) / 64
w13 = torch.randn(2 * ffn, H, device=dev, dtype=dt) / 64
wq, wk, wv = (t.clone() for t in wqkv.split(widths))
w1, w3 = (t.clone() for t in w13.chunk(2))


def t_ms(fn, n=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    res = []
    for _ in range(5):
        torch.cuda._sleep(1_000_000)
        s.record()
        for _ in range(n):
            fn()
        e.record()
        torch.cuda.synchronize()
        res.append(s.elapsed_time(e) / n)
    return sorted(res)[2]


cases = {
    "qkv gemm fused": lambda: x @ wqkv.t(),
    "qkv gemm separate": lambda: (x @ wq.t(), x @ wk.t(), x @ wv.t()),
    "attn fused (views)": lambda: attention(*(x @ wqkv.t()).split(widths, dim=-1), d),
    "attn separate": lambda: attention(x @ wq.t(), x @ wk.t(), x @ wv.t(), d),
    "w13 gemm fused": lambda: x @ w13.t(),
    "w13 gemm separate": lambda: (x @ w1.t(), x @ w3.t()),
    "swiglu fused (views)": lambda: (lambda g, u: F.silu(g) * u)(*(x @ w13.t()).chunk(2, dim=-1)),
    "swiglu separate": lambda: F.silu(x @ w1.t()) * (x @ w3.t()),
}
y = x @ wqkv.t()
q, k, v = y.split(widths, dim=-1)
cases["attention only, views"] = lambda: attention(q, k, v, d)
cases["attention only, contiguous"] = (lambda qc, kc, vc: lambda: attention(qc, kc, vc, d))(q.contiguous(), k.contiguous(), v.contiguous())
z = x @ w13.t()
g, u = z.chunk(2, dim=-1)
cases["silu*mul only, views"] = lambda: F.silu(g) * u
cases["silu*mul only, contiguous"] = (lambda gc, uc: lambda: F.silu(gc) * uc)(g.contiguous(), u.contiguous())
out = {k: t_ms(fn) for k, fn in cases.items()}
for k, v in out.items():
    print(f"{k:32s} {v:.4f} ms")
json.dump(dict(R=R, T=T, device=torch.cuda.get_device_name(), torch=torch.__version__, ms=out), open(sys.argv[2] if len(sys.argv) > 2 else "/tmp/probe.json", "w"), indent=1)
