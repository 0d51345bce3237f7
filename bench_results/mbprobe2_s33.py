"""Session 33, one GPU: which kernel runs the second half's lower-right causal attention, and
at what cost against the first half's and the whole (8B TP 2: 16 query heads, 4 KV heads,
8192 tokens, bf16)."""
import sys, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from triton.testing import do_bench
dev, dt, T, h = torch.device("cuda"), torch.bfloat16, 8192, 4096
q = torch.randn(1, 16, T, 128, device=dev, dtype=dt, requires_grad=True)
k = torch.randn(1, 4, T, 128, device=dev, dtype=dt, requires_grad=True)
v = torch.randn(1, 4, T, 128, device=dev, dtype=dt, requires_grad=True)
ke, ve = (t.repeat_interleave(4, dim=1).detach().requires_grad_() for t in (k, v))
qb = q[:, :, h:].detach().requires_grad_()
ref = F.scaled_dot_product_attention(qb, ke, ve, attn_mask=causal_lower_right(h, T))
lines = []
def run(name, f, ok=True):
    try:
        y = f()
        err = ((y.float() - ref.float()).norm() / ref.float().norm()).item() if ok else float("nan")
        g = torch.randn_like(y)
        fw = do_bench(f); fb = do_bench(lambda: torch.autograd.grad(f(), [t for t in (qb, ke, ve, q, k, v) if t.requires_grad], g, allow_unused=True))
        lines.append(f"{name:40s} fwd {fw:.4f} fwd+bwd {fb:.4f} err {err:.2e}")
    except Exception as e:
        lines.append(f"{name:40s} {type(e).__name__}: {str(e)[:200]}")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    F.scaled_dot_product_attention(qb, ke, ve, attn_mask=causal_lower_right(h, T)); torch.cuda.synchronize()
lines.append("kernels of the default lower-right call: " + ", ".join(sorted({e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})))
run("B lower-right, default dispatch", lambda: F.scaled_dot_product_attention(qb, ke, ve, attn_mask=causal_lower_right(h, T)))
for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
    def f(be=be):
        with sdpa_kernel([be]):
            return F.scaled_dot_product_attention(qb, ke, ve, attn_mask=causal_lower_right(h, T))
    run(f"B lower-right, {be.name}", f)
run("B aten flash is_causal (lower right)", lambda: torch.ops.aten._scaled_dot_product_flash_attention(qb, ke, ve, 0.0, True)[0])
run("A causal 4096 (gqa)", lambda: F.scaled_dot_product_attention(q[:, :, :h], k[:, :, :h], v[:, :, :h], is_causal=True, enable_gqa=True), ok=False)
run("A causal 4096 (expanded kv)", lambda: F.scaled_dot_product_attention(q[:, :, :h], ke[:, :, :h], ve[:, :, :h], is_causal=True), ok=False)
run("whole causal 8192 (gqa)", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), ok=False)
run("whole causal 8192 (expanded kv)", lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True), ok=False)
run("B no mask vs first half keys (flash)", lambda: F.scaled_dot_product_attention(qb, ke[:, :, :h], ve[:, :, :h]), ok=False)
print("\n".join(lines)); open(sys.argv[1], "w").write("\n".join(lines) + "\n")
