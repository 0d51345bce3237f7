"""Session 33, one GPU: what splitting a layer's tokens in two halves costs in compute (the
cross-op idea, NOTES "Open ideas"): causal attention as one call against the first half's
queries (causal) plus the second half's against all keys (lower-right causal), forward and
forward+backward; each collective op's GEMM as one product against two of half the rows.
8B and 70B dims at TP 2 (this rank's heads and columns), 8192 tokens, bf16."""
import json, sys, torch, torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from triton.testing import do_bench

dev = torch.device("cuda"); dt = torch.bfloat16; T = 8192
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
lines = [f"{out['device']} torch {torch.__version__}: ms (do_bench median)"]


def attn_full(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def attn_split(q, k, v, expand):
    h = q.shape[2] // 2
    a = F.scaled_dot_product_attention(q[:, :, :h], k[:, :, :h], v[:, :, :h], is_causal=True, enable_gqa=True)
    if expand:  # kv heads repeated for the lower-right mask's flash path (no enable_gqa there)
        g = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(g, dim=1) for t in (k, v))
        b = F.scaled_dot_product_attention(q[:, :, h:], k, v, attn_mask=causal_lower_right(h, 2 * h))
    else:
        b = F.scaled_dot_product_attention(q[:, :, h:], k, v, attn_mask=causal_lower_right(h, 2 * h), enable_gqa=True)
    return torch.cat((a, b), dim=2)


for dims, (hidden, ffn, heads, kv) in {"8b": (4096, 14336, 32, 8), "70b": (8192, 28672, 64, 8)}.items():
    R, d = 2, 128
    H, KV = heads // R, kv // R
    q = torch.randn(1, H, T, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(1, KV, T, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(1, KV, T, d, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn(1, H, T, d, device=dev, dtype=dt)
    ref = attn_full(q, k, v)
    row = {}
    for expand in (False, True):
        name = "split_expand" if expand else "split_gqa"
        try:
            got = attn_split(q, k, v, expand)
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            row[name + "_err"] = err
            row[name + "_fwd"] = do_bench(lambda: attn_split(q, k, v, expand))
            row[name + "_fwdbwd"] = do_bench(lambda: torch.autograd.grad(attn_split(q, k, v, expand), (q, k, v), g))
        except Exception as e:
            row[name + "_error"] = f"{type(e).__name__}: {e}"[:300]
    row["full_fwd"] = do_bench(lambda: attn_full(q, k, v))
    row["full_fwdbwd"] = do_bench(lambda: torch.autograd.grad(attn_full(q, k, v), (q, k, v), g))
    lines.append(f"{dims} attention (H {H}, KV {KV}): " + ", ".join(f"{a} {b:.4g}" if isinstance(b, float) else f"{a} {b}" for a, b in row.items()))
    out[f"{dims}_attention"] = row
    qkv = (heads + 2 * kv) * d // R
    ops = {"qkv": (hidden, qkv), "o": (heads * d // R, hidden), "w13": (hidden, 2 * ffn // R), "w2": (ffn // R, hidden)}
    for name, (K, N) in ops.items():
        x = torch.randn(T, K, device=dev, dtype=dt); w = torch.randn(N, K, device=dev, dtype=dt).t()
        one = do_bench(lambda: x @ w)
        two = do_bench(lambda: (x[: T // 2] @ w, x[T // 2 :] @ w))
        out[f"{dims}_gemm_{name}"] = {"M": T, "K": K, "N": N, "one": one, "two_halves": two}
        lines.append(f"{dims} gemm {name} {T}x{K}x{N}: one {one:.4f}, two halves {two:.4f} ({two / one:.3f}x)")
print("\n".join(lines))
json.dump(out, open(sys.argv[1], "w"), indent=1)
open(sys.argv[1].replace(".json", ".txt"), "w").write("\n".join(lines) + "\n")
