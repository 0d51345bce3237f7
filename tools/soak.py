"""Soak run: thousands of overlapped calls with mixed shapes, collectives (the all-gather's
``all_gather_matmul``, half of them with a list of two weights, the uneven all-to-all, the MoE
ops and the embedding-bag all-to-all too), dtypes, chunk counts and ops, every result checked
against the plain torch path (in float64 for float32 inputs: a float32 cuBLAS reference once
differed from float64 by 1.3e-4 where the library's result was within 6e-7; else in fp32),
memory tracked. Half the cases are issued ``REPEATS``
times in a row with the same weight and fresh inputs, as a model's layer is: through the copy
engines the second call records a CUDA graph and the third replays it, pointed at the new input
and output (``graphs/record.py``; an all-gather's graph is updated for them, from the call after
its record's first two address sets); the JSON counts the replayed and the updated calls.

    torchrun --nproc-per-node=2 tools/soak.py --seconds 90

Every rank draws the same case sequence (seeded), its own inputs. Validation mode is switched
on for every other block of ``BLOCK`` calls (small, so that a short soak, whose first minutes go
into compiling kernels, runs both modes). Prints a summary and writes JSON (rank 0).

``--cycle 100``: the first 100 cases in rounds with their weights kept, as a training loop
calls the same sites step after step: memory at the start of each round, and its drift from
the third round on (nothing compiles or records any more), in the JSON. Only a cycled soak
can show flat memory: a new case's weight, alive or not at a sample, moves "allocated" by up
to 128 MB, and new signatures add records. 10,000 cycled calls per road took 83-155 s on 2
GPUs; three soaks, one per road, run beside each other on one 2-GPU machine with ports of
their own. On a cold Triton cache the first rounds compile kernels: run it after another
suite, or give it ``--seconds 200``. At 4 ranks "auto" without P2P takes NCCL per chunk, so a
4-rank ``NCCL_P2P_DISABLE=1`` soak runs no copy engines.

``--backend torch``: the dense calls through NCCL per chunk (the default, auto, takes the copy
engines: GPU to GPU, or through host memory under ``NCCL_P2P_DISABLE=1``). The JSON has the
drift of memory over the second half of the blocks (allocated, also outside the recorded
graphs' pools; reserved; host RSS; the uneven exchanges' cached row orders).

``--one-gpu``: both ranks on GPU 0 over gloo (a machine with one GPU; start it with
``NCCL_P2P_DISABLE=1``): the copy engines' host road and NCCL per chunk through gloo, with the
real kernels; the references' collectives run on host copies. Correctness only: the two
processes time-slice the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import random
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

import overlap
from overlap.bench import need_gpus
from overlap.context import contexts, records
from overlap.plan import make_split_plan

SHAPES = [  # (M, K, N)
    (2048, 2048, 2048),
    (4096, 1024, 4096),
    (1000, 1000, 3000),
    (778, 333, 1234),
    (8192, 4096, 1024),
    (128, 4096, 8192),
    (16, 4096, 8192),
    (4096, 4096, 8192),
]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
# calls per block: the ranks agree to stop, validation mode switches and memory is sampled
# between blocks (a 100 s soak on 2x H200 ran 250 calls, 2026-11-26: blocks of 250 never
# turned validation on)
BLOCK = 50
REPEATS = 3  # a repeated case's calls: the first eager, the second recorded, the rest replayed
ON_HOST = False  # --one-gpu: gloo takes the references' collectives on host tensors
BACKEND = "auto"  # --backend: the dense calls' (the uneven exchanges take NCCL per chunk)


def _plain(fn, out: torch.Tensor, *ins) -> None:
    """``fn(out, *ins)``, a torch.distributed collective; through host copies on gloo."""
    if not ON_HOST:
        fn(out, *ins)
        return
    o = out.cpu()
    fn(o, *(t.cpu() if isinstance(t, torch.Tensor) else t for t in ins))
    out.copy_(o)


def _up(dtype: torch.dtype) -> torch.dtype:
    """The references' dtype: float64 for float32 inputs, else float32."""
    return torch.float64 if dtype == torch.float32 else torch.float32


def _reference(x, w, collective, op, R, splits=None):
    """``collective(x @ w)`` through torch.distributed, in ``_up(x.dtype)``."""
    up = _up(x.dtype)
    if splits is not None:  # an uneven all-to-all
        prod = x.to(up) @ w.to(up)
        out = prod.new_empty(sum(splits[1]), prod.shape[1])
        _plain(dist.all_to_all_single, out, prod, list(splits[1]), list(splits[0]))
        return out
    if collective == "all_gather":  # x is this rank's shard
        full = x.new_empty(x.shape[0] * R, x.shape[1])
        _plain(dist.all_gather_into_tensor, full, x)
        return full.to(up) @ w.to(up)
    prod = x.to(up) @ w.to(up)
    if op == "avg":
        prod /= R
    if collective == "all_reduce":
        _plain(dist.all_reduce, prod)
        return prod
    out = prod.new_empty(prod.shape[0] // R, prod.shape[1])
    if collective == "reduce_scatter":
        _plain(dist.reduce_scatter_tensor, out, prod)
    else:
        out = torch.empty_like(prod)
        _plain(dist.all_to_all_single, out, prod)
    return out


def _bags_call(rng, gen, dev, R):
    """An ``embedding_bag_all_to_all`` call (one table per rank, widths differing by rank,
    bags of 0-8 rows) against the plain pooling and ``all_to_all_single``."""
    dims, B, me = [64 * (1 + r % 2) for r in range(R)], 1024 * R, dist.get_rank()
    dtype = rng.choice(DTYPES)
    table = torch.randn(20000, dims[me], device=dev, generator=gen, dtype=dtype)
    sizes = torch.randint(0, 9, (B,), device=dev, generator=gen)
    idx = torch.randint(0, 20000, (int(sizes.sum()),), device=dev, generator=gen)
    off = torch.cumsum(sizes, 0) - sizes
    chunks = rng.choice([None, 2, 3, 8])
    got = overlap.embedding_bag_all_to_all([table], [idx], [off], rank_dims=dims, chunks=chunks)
    pooled = torch.nn.functional.embedding_bag(idx, table.float(), off, mode="sum")
    b = B // R
    recv = pooled.new_empty(b * sum(dims))
    _plain(
        dist.all_to_all_single, recv, pooled.reshape(-1), [b * d for d in dims], [b * dims[me]] * R
    )
    ref = torch.cat([p.view(b, d) for p, d in zip(recv.split([b * d for d in dims]), dims,
                                                   strict=True)], dim=1)  # fmt: skip
    p = make_split_plan((b * dims[me],) * R, tuple(b * d for d in dims), 1, 0, chunks=chunks,
                        transport="torch")  # fmt: skip
    p = dataclasses.replace(p, collective="embedding_bag all_to_all")
    return dtype, ((got.float() - ref).norm() / ref.norm()).item(), p, "sum"


def _one_call(rng, gen, dev, R, keep: dict):
    """Draw a case, run it, check it: ``(key, error, plan, op)``. Inputs die on return, so
    memory measured between calls is what the library keeps; the weight is kept in ``keep``
    (empty for a new case) for the case's repeats."""
    if rng.random() < 0.1:
        return _bags_call(rng, gen, dev, R)
    M, K, N = rng.choice(SHAPES)
    M -= M % R  # (the collectives split M rows among the ranks; every shape is even)
    dtype = rng.choice(DTYPES)
    coll = rng.choice((*overlap.COLLECTIVES, "all_gather"))
    op = rng.choice(["sum", "avg"]) if coll in ("all_reduce", "reduce_scatter") else "sum"
    chunks = rng.choice([None, None, 2, 3, 4, 8])
    transposed = rng.random() < 0.7
    rows = M // R if coll == "all_gather" else M  # the all-gather's x is a shard of M rows
    splits = None
    if coll == "all_to_all" and rng.random() < 0.5:  # uneven: S[a][b] rows from a to b
        S = [[rng.randrange(0, 2 * M // R // R + 1) for _ in range(R)] for _ in range(R)]
        me = dist.get_rank()
        splits = (S[me], [S[a][me] for a in range(R)])
        rows = sum(S[me])
    x = torch.randn(rows, K, device=dev, generator=gen, dtype=dtype)
    w = keep.get("w")
    if w is None:  # (a repeat of the case reuses its weight: the same signature)
        w = torch.randn(N, K, device=dev, generator=gen, dtype=dtype) / K**0.5
        w = keep["w"] = w.t() if transposed else w.t().contiguous()
    moe = rng.random() if splits is not None else 1.0
    if moe < 0.25:  # the MoE dispatch: two experts, w and -w, ids per received row
        p = make_split_plan(*map(tuple, splits), N, K, chunks=chunks, transport="torch")
        p = dataclasses.replace(p, collective="dispatch all_to_all")  # its own key below
        ids = torch.randint(0, 2, (sum(splits[1]),), device=dev, generator=gen).sort().values
        got = overlap.all_to_all_grouped_matmul(
            x, torch.stack([w, -w]), ids, input_split_sizes=splits[0],
            output_split_sizes=splits[1], chunks=chunks,
        )  # fmt: skip
        # the receiver's experts: its own w applies to the rows it receives
        up = _up(dtype)
        recv = x.new_empty(sum(splits[1]), K, dtype=up)
        _plain(dist.all_to_all_single, recv, x.to(up), list(splits[1]), list(splits[0]))
        ref = (recv @ w.to(up)) * (1 - 2 * ids[:, None]).to(up)
        if ref.numel() == 0:
            return dtype, 0.0 if got.numel() == 0 else float("nan"), p, op
        return dtype, ((got.to(up) - ref).norm() / ref.norm()).item(), p, op
    if moe < 0.5:  # the MoE combine: two experts, w and -w
        p = make_split_plan(*map(tuple, splits), N, K, chunks=chunks, transport="torch")
        p = dataclasses.replace(p, collective="grouped all_to_all")  # its own key below
        ids = torch.randint(0, 2, (rows,), device=dev, generator=gen).sort().values
        got = overlap.grouped_matmul_all_to_all(
            x, torch.stack([w, -w]), ids, input_split_sizes=splits[0],
            output_split_sizes=splits[1], chunks=chunks,
        )  # fmt: skip
        x = x * (1 - 2 * ids[:, None]).to(x.dtype)  # the reference: rows of expert 1 negated
    elif splits is not None:
        p = make_split_plan(*map(tuple, splits), N, K, chunks=chunks, transport="torch")
        p = dataclasses.replace(p, collective="all_to_all (uneven)")  # its own key below
        got = overlap.matmul_all_to_all(x, w, input_split_sizes=splits[0],
                                        output_split_sizes=splits[1], chunks=chunks)  # fmt: skip
    elif coll == "all_gather":
        p = overlap.plan(x, w, coll, chunks=chunks, backend=BACKEND)
        if rng.random() < 0.5:  # gathered once for two weights: column views of w
            ws = [w[:, : N // 3], w[:, N // 3 :]]  # (adjacent where w is weight.t())
            got = torch.cat(overlap.all_gather_matmul(x, ws, chunks=chunks, backend=BACKEND), dim=1)
        else:
            got = overlap.all_gather_matmul(x, w, chunks=chunks, backend=BACKEND)
    else:
        p = overlap.plan(x, w, coll, chunks=chunks, backend=BACKEND)
        got = overlap.matmul_collective(x, w, coll, op=op, chunks=chunks, backend=BACKEND)
    ref = _reference(x, w, coll, op, R, splits)
    if ref.numel() == 0:  # an uneven all-to-all may bring this rank no rows
        return dtype, 0.0 if got.numel() == 0 else float("nan"), p, op
    err = ((got.to(ref.dtype) - ref).norm() / ref.norm()).item()
    return dtype, err, p, op


def cases(rng: random.Random, cycle: int = 0, round_starts=None) -> Iterator[dict]:
    """The ``keep`` argument of each ``_one_call``, with ``rng`` set for it: a new case (an
    empty dict) is issued once or, half the time, ``REPEATS`` times, each repeat drawing the
    same choices from ``rng`` and sharing the case's dict (its weight).

    ``cycle``: the first ``cycle`` cases in rounds, again and again, each keeping its dict
    (its weight) from round to round, as a training loop's call sites do;
    ``round_starts()`` is called before each round."""
    start, keeps, i = rng.getstate(), {}, 0
    while True:
        if cycle and i % cycle == 0:
            rng.setstate(start)
            if round_starts is not None:
                round_starts()
        n = REPEATS if rng.random() < 0.5 else 1
        case, keep = rng.getstate(), keeps.setdefault(i % cycle, {}) if cycle else {}
        for _ in range(n):
            rng.setstate(case)
            yield keep
        i += 1


def _sample(done: int) -> dict:
    """GPU memory after ``done`` calls, with what the library keeps that may hold some of it:
    the recorded calls (their graphs' pools: ``graphs/record.py``, at most ``MAX_RECORDS``),
    the uneven exchanges' row orders (``NcclTransport.order``, a few), the transports'
    buffers; and this process's resident host memory."""
    graphs = sum(r.graph is not None for r in records.values())
    transports = {t for c in contexts() for t in c._transports.values()}
    orders = sum(o.numel() * o.element_size() for t in transports
                 for o in getattr(t, "_orders", {}).values())  # fmt: skip
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    outside = sum(s["allocated_size"] for s in torch.cuda.memory_snapshot()
                  if tuple(s.get("segment_pool_id", (0, 0))) == (0, 0))  # fmt: skip
    return {
        "call": done,
        "allocated": torch.cuda.memory_allocated(),
        "allocated_outside_graphs": outside,
        "reserved": torch.cuda.memory_reserved(),
        "records": len(records),
        "graphs": graphs,
        "orders": orders,
        "transport_bytes": sum(t.nbytes for t in transports),
        "host_rss": rss,
    }


def _moved(samples: list[dict], what: str) -> dict:
    """How ``what`` moved from the first of ``samples`` to the last: the change, the range,
    bytes per call."""
    values = [m[what] for m in samples]
    calls = samples[-1]["call"] - samples[0]["call"]
    return {"change": values[-1] - values[0], "range": max(values) - min(values),
            "per_call": round((values[-1] - values[0]) / max(calls, 1), 1)}  # fmt: skip


def _drift_rounds(rounds: list[dict], what: str) -> dict:
    """``_moved`` from the start of the third round (``--cycle``: the first compiles and
    sizes, the second records) to the start of the last."""
    if len(rounds) < 4:
        return {}
    return {"rounds": len(rounds) - 3, "calls": rounds[-1]["call"] - rounds[2]["call"],
            **_moved(rounds[2:], what)}  # fmt: skip


def _drift(memory: list[dict], what: str) -> dict:
    """``_moved`` over the second half of the samples (after the warm-up: kernels compiled,
    buffers sized, caches full)."""
    half = memory[len(memory) // 2 :]
    if len(half) < 2:
        return {}
    return {"from_call": half[0]["call"], **_moved(half, what)}


def main() -> None:
    """Parses the arguments, runs the soak as this torchrun worker, reports on rank 0."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seconds", type=float, default=90)
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--out", default="bench_out/soak.json", help="JSON file (default: %(default)s)")
    ap.add_argument("--one-gpu", action="store_true", help="both ranks on GPU 0, over gloo")
    ap.add_argument(
        "--cycle",
        type=int,
        default=0,
        help="repeat the first CYCLE cases in rounds, weights kept (0: never)",
    )
    ap.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "torch"),
        help="the dense calls' backend: auto (the copy engines) or torch (NCCL)",
    )
    a = ap.parse_args()
    global ON_HOST, BACKEND
    ON_HOST, BACKEND = a.one_gpu, a.backend
    need_gpus("tools/soak.py", "torchrun --nproc-per-node=2 tools/soak.py (2 GPUs), or on one GPU: "
              "NCCL_P2P_DISABLE=1 torchrun --nproc-per-node=2 tools/soak.py --one-gpu")  # fmt: skip
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(0 if a.one_gpu else int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo" if a.one_gpu else "nccl")
    R = dist.get_world_size()
    dev = torch.device("cuda")
    rng = random.Random(a.seed)  # same on every rank: the same cases in the same order
    gen = torch.Generator(device=dev).manual_seed(a.seed + 1000 * rank)
    failures, worst, paths, memory = [], {}, {"overlap": 0, "fallback": 0}, []
    t0 = time.monotonic()
    done = validated = 0
    rounds: list[dict] = []  # --cycle: memory at the start of each round
    schedule = cases(rng, a.cycle, lambda: rounds.append(_sample(done)))
    overlap.stats(reset=True)
    while done < a.calls:
        if done % BLOCK == 0:
            stop = torch.tensor(
                [int(time.monotonic() - t0 > a.seconds)], device="cpu" if a.one_gpu else dev
            )
            dist.all_reduce(stop)  # every rank stops at the same call
            if stop.item():
                break
            overlap.configure(validate=(done // BLOCK) % 2 == 1, timeout=60)
            torch.cuda.synchronize()
            memory.append(_sample(done))
        dtype, err, p, op = _one_call(rng, gen, dev, R, next(schedule))
        key = f"{p.collective} {str(dtype)[6:]}"
        worst[key] = max(worst.get(key, 0.0), err)
        paths[p.path] += 1
        validated += (done // BLOCK) % 2
        if not err < TOL[dtype]:  # NaN fails too
            failures.append(f"call {done}: {p.describe()} op={op} {dtype}: error {err:.3g}")
        done += 1
    torch.cuda.synchronize()
    memory.append(_sample(done))
    elapsed = time.monotonic() - t0
    all_fail = [None] * R
    dist.all_gather_object(all_fail, failures)
    if rank == 0:
        after_warmup = [m["allocated"] for m in memory[1:]]
        result = {
            "calls": done,
            "seconds": round(elapsed, 1),
            "paths": paths,
            "validated_calls": validated,
            **{
                f"{kind}_calls_rank0": sum(
                    n
                    for hows in overlap.stats().values()
                    for how, n in hows.items()
                    if how.startswith(kind)
                )
                for kind in ("replayed", "updated")
            },
            "failures": [f for fs in all_fail for f in fs][:50],
            "n_failures": sum(len(fs) for fs in all_fail),
            "worst_error_rank0": {k: float(f"{v:.3g}") for k, v in sorted(worst.items())},
            "memory_rank0": memory,
            "allocated_spread_after_first_block": (
                max(after_warmup) - min(after_warmup) if after_warmup else 0
            ),
            "backend": BACKEND,
            "road": os.environ.get("NCCL_P2P_DISABLE") == "1" and "no P2P" or "P2P",
            "cycle": a.cycle,
            "memory_at_rounds_rank0": rounds,
            "drift_over_rounds_after_the_second": {
                k: _drift_rounds(rounds, k)
                for k in ("allocated", "allocated_outside_graphs", "reserved", "host_rss")
            },
            "drift_second_half": {
                k: _drift(memory, k)
                for k in ("allocated", "allocated_outside_graphs", "reserved", "host_rss", "orders")
            },
        }
        long = ("memory_rank0", "memory_at_rounds_rank0")
        print(json.dumps({k: v for k, v in result.items() if k not in long}, indent=1))
        out = pathlib.Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
