"""Exchange benchmark: the library's ops that move rows between ranks before or after a
matmul-like producer, each against the plain torch way of doing the same thing.

- ``all_gather``: ``all_gather_matmul(x_shard, w)`` vs ``all_gather_into_tensor`` then
  ``torch.matmul`` (Llama-3-8B gate+up under sequence parallelism: ``T = R * --tokens``,
  ``K = --hidden``, ``N = 2 * --ffn / R``, ``w = weight.t()``).
- ``uneven_a2a``: ``matmul_all_to_all`` with splits vs ``x @ w`` then ``all_to_all_single``
  (the combine's routing and shape, one matrix).
- ``moe_combine``: ``grouped_matmul_all_to_all`` (down projection ``[E, ffn, hidden]``) vs a
  per-expert loop of matmuls then ``all_to_all_single``.
- ``moe_dispatch``: ``all_to_all_grouped_matmul`` (up projection ``[E, hidden, ffn]``) vs
  ``all_to_all_single`` then the per-expert loop.
- ``embedding``: ``embedding_bag_all_to_all`` vs ``embedding_bag`` per table, ``torch.cat``,
  then ``all_to_all_single`` over batch slices (flattened buffers).

Routing (MoE ops): ``--tokens * --topk`` rows sent per rank; the send matrix ``S[a][b]`` and
each block's expert counts come from a generator seeded identically on every rank (rank 0
receives ``--skew`` times as many rows as each other rank), rows sorted by expert within
each block. The combine sends back what the dispatch received. The plain per-expert loop's
row indices are computed once, outside the timed region. Each op is checked once (relative
norm error against plain, 1e-4 fp32, 3e-2 bf16/fp16; above it the run fails), then both are
timed: median over ``--iters`` after ``--warmup`` (CUDA events; perf_counter on CPU), the
slowest rank's. Rank 0 prints a table and writes ``--out``.

    python tools/exchange_bench.py                 # no GPU (or --cpu): 2 CPU ranks, gloo,
                                                   # Triton's interpreter, tiny sizes, fp32
    NCCL_P2P_DISABLE=1 torchrun --nproc-per-node=2 tools/exchange_bench.py --one-gpu
    torchrun --nproc-per-node=N tools/exchange_bench.py --ops moe_combine,moe_dispatch

CPU and ``--one-gpu`` (two ranks time-slicing GPU 0 over gloo) check correctness only: their
JSON says ``"timing_meaningful": false``. Only the CPU run has been run; nothing of it has run
on GPUs (one or two) yet.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _benchrun import DTYPES, add_options, fill_defaults, launch, rel_err, time_ms, write_json

OPS = ("all_gather", "uneven_a2a", "moe_combine", "moe_dispatch", "embedding")
SMALL = dict(tokens=32, hidden=64, ffn=128, experts=2, topk=2, tables=2, table_rows=1000,
             dim=16, batch=64, max_bag=40)  # fmt: skip
LARGE = dict(tokens=4096, hidden=4096, ffn=14336, experts=2, topk=2, tables=8,
             table_rows=100_000, dim=128, batch=65536, max_bag=40)  # fmt: skip
Fn = Callable[[], torch.Tensor]


def routing(a: argparse.Namespace, R: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """``S[a][b]`` rows from rank a to b, and ``C[a][b][e]`` of them for b's expert e; the same
    on every rank (seeded CPU generator)."""
    g = torch.Generator().manual_seed(a.seed)
    probs = torch.tensor([a.skew] + [1.0] * (R - 1))
    S = [torch.multinomial(probs, a.tokens * a.topk, True, generator=g).bincount(minlength=R)
         for _ in range(R)]  # fmt: skip
    C = [[torch.multinomial(torch.ones(a.experts), int(n), True, generator=g)
          .bincount(minlength=a.experts).tolist() if n else [0] * a.experts for n in row]
         for row in S]  # fmt: skip
    return [row.tolist() for row in S], C


def _experts(x: torch.Tensor, w: torch.Tensor, idx: list[torch.Tensor]) -> torch.Tensor:
    """Plain MoE loop: ``y[i] = x[i] @ w[e]`` for the rows ``idx[e]`` of each expert."""
    y = x.new_empty(x.shape[0], w.shape[-1])
    for e, i in enumerate(idx):
        y.index_copy_(0, i, x.index_select(0, i) @ w[e])
    return y


def _a2a(x: torch.Tensor, sends: list[int], receives: list[int]) -> torch.Tensor:
    out = x.new_empty(sum(receives), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), receives, sends)
    return out


def build(op: str, a: argparse.Namespace, dev, dtype) -> tuple[Fn, Fn, str]:
    """``(plain, overlapped, shape)`` for ``op`` on this rank (inputs seeded per rank)."""
    import overlap

    R, me, E, H, FF = dist.get_world_size(), dist.get_rank(), a.experts, a.hidden, a.ffn
    torch.manual_seed(a.seed + 1 + me)
    ck = dict(chunks=a.chunks)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=dev) * scale).to(dtype)

    if op == "all_gather":
        n = 2 * FF // R
        x, w = randn(a.tokens, H), randn(n, H, scale=H**-0.5).t()  # w = weight.t()

        def plain() -> torch.Tensor:
            full = x.new_empty(a.tokens * R, H)
            dist.all_gather_into_tensor(full, x)
            return torch.matmul(full, w)

        path = overlap.plan(x, w, "all_gather", **ck).path
        return plain, lambda: overlap.all_gather_matmul(x, w, **ck), \
            f"T={a.tokens * R} K={H} N={n} ({path})"  # fmt: skip
    if op == "embedding":
        tabs = [randn(a.table_rows, a.dim) for _ in range(a.tables)]
        sizes = [torch.randint(1, a.max_bag + 1, (a.batch,), device=dev) for _ in tabs]
        idx = [torch.randint(0, a.table_rows, (int(s.sum()),), device=dev) for s in sizes]
        off = [torch.cumsum(s, 0) - s for s in sizes]
        D, b = a.tables * a.dim, a.batch // R
        dims = [D] * R

        def plain() -> torch.Tensor:
            pooled = torch.cat([F.embedding_bag(i, t, o, mode="sum")
                                for t, i, o in zip(tabs, idx, off, strict=True)], 1)  # fmt: skip
            recv = _a2a(pooled.reshape(-1), [b * D] * R, [b * d for d in dims])
            parts = recv.split([b * d for d in dims])
            return torch.cat([p.view(b, d) for p, d in zip(parts, dims, strict=True)], 1)

        return plain, lambda: overlap.embedding_bag_all_to_all(
            tabs, idx, off, mode="sum", rank_dims=dims, **ck
        ), f"B={a.batch} tables={a.tables}x{a.table_rows}x{a.dim} per rank"  # fmt: skip
    S, C = routing(a, R)
    got = [S[s][me] for s in range(R)]  # rows received in the dispatch, sent back in the combine
    ids = torch.cat([torch.repeat_interleave(torch.arange(E), torch.tensor(C[s][me]))
                     for s in range(R)]).to(dev)  # fmt: skip
    rows = [(ids == e).nonzero().flatten() for e in range(E)]
    shape = f"S={S}"
    if op == "moe_dispatch":
        x, w = randn(sum(S[me]), H), randn(E, FF, H, scale=H**-0.5).transpose(1, 2)
        kw = dict(input_split_sizes=S[me], output_split_sizes=got, **ck)
        return lambda: _experts(_a2a(x, S[me], got), w, rows), \
            lambda: overlap.all_to_all_grouped_matmul(x, w, ids, **kw), \
            f"E={E} K={H} N={FF} {shape}"  # fmt: skip
    x = randn(sum(got), FF)
    kw = dict(input_split_sizes=got, output_split_sizes=S[me], **ck)
    if op == "uneven_a2a":
        w = randn(H, FF, scale=FF**-0.5).t()
        return lambda: _a2a(x @ w, got, S[me]), \
            lambda: overlap.matmul_all_to_all(x, w, **kw), f"K={FF} N={H} {shape}"  # fmt: skip
    if op != "moe_combine":
        raise ValueError(f"unknown op {op!r}; choose from {OPS}")
    w = randn(E, H, FF, scale=FF**-0.5).transpose(1, 2)
    return lambda: _a2a(_experts(x, w, rows), got, S[me]), \
        lambda: overlap.grouped_matmul_all_to_all(x, w, ids, **kw), \
        f"E={E} K={FF} N={H} {shape}"  # fmt: skip


def bench(a: argparse.Namespace, dev: torch.device, timing_meaningful: bool) -> None:
    """Checks and times every selected op, plain and overlapped (every rank)."""
    R, dtype, cuda = dist.get_world_size(), DTYPES[a.dtype], dev.type == "cuda"
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    if a.batch % R:
        raise ValueError(f"--batch ({a.batch}) must be divisible by the world size ({R})")
    rows, errors = [], {}
    for op in a.ops:
        plain, over, shape = build(op, a, dev, dtype)
        every = [None] * R
        dist.all_gather_object(every, rel_err(over(), plain()))
        errors[op] = err = max(every, key=lambda e: e if e == e else float("inf"))  # NaN first
        if not err < tol:
            raise RuntimeError(f"{op}: overlap disagrees with plain: relative error {err:.3g} "
                               f"above {tol} ({shape})")  # fmt: skip
        t_plain = time_ms(plain, a.iters, a.warmup, cuda)
        t_over = time_ms(over, a.iters, a.warmup, cuda)
        rows.append(dict(op=op, shape=shape, plain_ms=t_plain, overlap_ms=t_over,
                         speedup=t_plain / t_over, error=err))  # fmt: skip
        del plain, over
    if dist.get_rank() == 0:
        _report(a, dev, R, timing_meaningful, rows, errors, tol)


def _report(a, dev, R, timing_meaningful, rows, errors, tol) -> None:
    """Prints the table and writes the JSON (rank 0)."""
    print(f"{'op':13} {'plain ms':>10} {'overlap ms':>11} {'speedup':>8} {'error':>9}  shape")
    for r in rows:
        print(f"{r['op']:13} {r['plain_ms']:10.3f} {r['overlap_ms']:11.3f} {r['speedup']:8.2f} "
              f"{r['error']:9.2e}  {r['shape']}")  # fmt: skip
    write_json(a, dev, R, timing_meaningful, rows, errors, tol)


def main() -> None:
    """Parses the arguments; spawns 2 CPU ranks, or runs as a torchrun worker."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(ap, SMALL, "bench_out/exchange_bench.json")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {OPS}")
    ap.add_argument("--skew", type=float, default=2.0, help="rank 0 receives this many times more")
    ap.add_argument("--chunks", type=int, default=None, help="default: the library's (CPU: 2)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    a.ops = [o for o in a.ops.split(",") if o]
    if not a.ops or set(a.ops) - set(OPS):
        ap.error(f"--ops: unknown {sorted(set(a.ops) - set(OPS))}; choose from {OPS}")
    cpu = fill_defaults(a, SMALL, LARGE)
    if cpu and a.chunks is None:
        a.chunks = 2  # tiny products: force the chunked paths
    launch(a, cpu, bench, "exchange_bench.py")


if __name__ == "__main__":
    main()
