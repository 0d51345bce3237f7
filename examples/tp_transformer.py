"""A Llama-style decoder layer made tensor-parallel with ``overlap.nn``, checked against the
unsharded layer: output and gradients, with and without sequence parallelism.

    python examples/tp_transformer.py

The layer: RMSNorm, attention with grouped KV heads (q/k/v column-parallel by heads, o
row-parallel), RMSNorm, SwiGLU MLP (gate/up column-parallel, down row-parallel); activations
are sequence-first ``[s, b, h]`` (Megatron's layout). With sequence parallelism each rank
holds ``s / R`` of the sequence between the layers; the column layers gather it, the row
layers reduce-scatter it back. With 2 or more CUDA GPUs it relaunches itself under torchrun,
one rank per GPU (NCCL, bf16); without, it spawns 2 CPU ranks on gloo with the real Triton
kernel in Triton's interpreter (fp32). Under sequence parallelism the norms' weights are
used on each rank's tokens only: sum their gradients over the ranks before an optimizer step
(as Megatron does for its sequence-parallel parameters).
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import overlap
from overlap.nn import ColumnParallelLinear, RowParallelLinear


def attention(q, k, v, heads: int, kv_heads: int) -> torch.Tensor:
    """Causal attention, ``q [s, b, heads * d]``, ``k, v [s, b, kv_heads * d]`` ->
    ``[s, b, heads * d]``; each group of ``heads / kv_heads`` query heads shares a KV head."""
    s, b, _ = q.shape
    q, k, v = (t.reshape(s, b, n, -1).permute(1, 2, 0, 3) for t, n in
               ((q, heads), (k, kv_heads), (v, kv_heads)))  # fmt: skip
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, d]
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)


class DecoderLayer(nn.Module):
    """The unsharded layer: ``x [s, b, hidden]`` -> ``[s, b, hidden]``."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        d = hidden // heads
        self.heads, self.kv_heads = heads, kv_heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.q, self.o = nn.Linear(hidden, heads * d, bias=False), nn.Linear(heads * d, hidden)
        self.k = nn.Linear(hidden, kv_heads * d, bias=False)
        self.v = nn.Linear(hidden, kv_heads * d, bias=False)
        self.gate, self.up = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.attn_norm(x)
        h = x + self.o(attention(self.q(n), self.k(n), self.v(n), self.heads, self.kv_heads))
        n = self.mlp_norm(h)
        return h + self.down(F.silu(self.gate(n)) * self.up(n))


class TPDecoderLayer(nn.Module):
    """``layer`` cut over the ranks of ``group``: each rank holds ``heads / R`` query heads,
    ``kv_heads / R`` KV heads and ``ffn / R`` of the MLP. ``x [s, b, hidden]`` (sequence
    parallel: this rank's ``[s / R, b, hidden]``) -> the same shape."""

    def __init__(self, layer: DecoderLayer, group=None, sequence_parallel: bool = False):
        super().__init__()
        R = dist.get_world_size(group)
        if layer.kv_heads % R:
            raise ValueError(f"kv_heads ({layer.kv_heads}) must be divisible by R ({R})")
        self.heads, self.kv_heads = layer.heads // R, layer.kv_heads // R
        self.attn_norm, self.mlp_norm = layer.attn_norm, layer.mlp_norm  # replicated
        kw = dict(group=group, sequence_parallel=sequence_parallel)
        for name in ("q", "k", "v", "gate", "up"):
            setattr(self, name, ColumnParallelLinear.from_linear(getattr(layer, name), **kw))
        self.o = RowParallelLinear.from_linear(layer.o, **kw)
        self.down = RowParallelLinear.from_linear(layer.down, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.attn_norm(x)
        h = x + self.o(attention(self.q(n), self.k(n), self.v(n), self.heads, self.kv_heads))
        n = self.mlp_norm(h)
        return h + self.down(F.silu(self.gate(n)) * self.up(n))


def check(rank: int, R: int, device: torch.device, dtype: torch.dtype, sizes: dict) -> None:
    """Both variants against the unsharded layer (every rank builds it from one seed)."""
    s, b, hidden = sizes["s"], sizes["b"], sizes["hidden"]
    for sp in (False, True):
        torch.manual_seed(0)
        ref = DecoderLayer(hidden, sizes["heads"], sizes["kv_heads"], sizes["ffn"])
        ref = ref.to(device=device, dtype=dtype)
        x = torch.randn(s, b, hidden, device=device, dtype=dtype)
        g = torch.randn(s, b, hidden, device=device, dtype=dtype)
        tp = TPDecoderLayer(ref, sequence_parallel=sp)
        ref64 = DecoderLayer(hidden, sizes["heads"], sizes["kv_heads"], sizes["ffn"]).double()
        ref64.to(device).load_state_dict({k: v.double() for k, v in ref.state_dict().items()})
        x64 = x.double().requires_grad_()
        (ref64(x64) * g.double()).sum().backward()
        rows = slice(rank * s // R, (rank + 1) * s // R) if sp else slice(None)
        xr = x[rows].clone().requires_grad_()
        y = tp(xr)
        (y * g[rows]).sum().backward()
        y_ref = ref64(x64.detach())[rows]
        errors = {"output": _err(y, y_ref), "input grad": _err(xr.grad, x64.grad[rows])}
        for name in ("q", "o", "down"):
            mine, whole = getattr(tp, name).weight, getattr(ref64, name).weight
            n = mine.shape[0] if name == "q" else mine.shape[1]
            part = whole.grad[rank * n : (rank + 1) * n] if name == "q" else \
                whole.grad[:, rank * n : (rank + 1) * n]  # fmt: skip
            errors[f"{name} weight grad"] = _err(mine.grad, part)
        print(f"rank {rank}, sequence_parallel={sp}: relative errors vs float64 "
              + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()), flush=True)  # fmt: skip
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
        bad = {k: v for k, v in errors.items() if not v < tol}
        assert not bad, f"rank {rank} sequence_parallel={sp}: errors above {tol}: {bad}"
    if rank == 0:
        print(overlap.stats(), flush=True)  # which path each op's calls took, and why


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def _cpu_rank(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    sizes = dict(s=32, b=2, hidden=64, heads=4, kv_heads=2, ffn=128)
    check(rank, world, torch.device("cpu"), torch.float32, sizes)
    dist.destroy_process_group()
    # skip the interpreter's finalization, which gloo's worker threads can abort ("terminate
    # called without an active exception", SIGABRT after a correct run; torch PR 179291)
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    if "RANK" in os.environ:  # a torchrun worker
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        sizes = dict(s=2048, b=2, hidden=4096, heads=32, kv_heads=8, ffn=14336)
        check(dist.get_rank(), dist.get_world_size(), torch.device("cuda", local),
              torch.bfloat16, sizes)  # fmt: skip
        dist.destroy_process_group()
    elif torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        n = torch.cuda.device_count()
        os.execvp(sys.executable, [sys.executable, "-m", "torch.distributed.run",
                                   f"--nproc-per-node={n}", os.path.abspath(__file__)])  # fmt: skip
    else:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined (spawn inherits)
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_cpu_rank, args=(2, os.path.join(d, "init")), nprocs=2)
        print("ok: 2 CPU ranks, the tensor-parallel layer equals the unsharded one")


if __name__ == "__main__":
    main()
