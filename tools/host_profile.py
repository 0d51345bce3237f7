"""Where the host time of an overlapped call goes: cProfile over many calls, on 2 GPUs.
``--collective all_gather`` profiles ``all_gather_matmul`` (``--shape``: the gathered M).

    torchrun --nproc-per-node=2 tools/host_profile.py --shape 4096x8192x4096 \
        --collective reduce_scatter --backend torch

Rank 0 prints (and writes) the host milliseconds per call of torch's own calls (a result
made at each), the library's call without ``out=`` (as a model makes it: a product under the
plain-path line takes ``ops.engine.plain_again`` from its second call on) and the
overlapped path, the overlapped call's when replayed from a CUDA graph (``graph.replay()``),
and the functions that take the most time, own time first (the overlapped call's raw profile
goes to OUT.prof). The GPU sleeps between calls so that the host never waits for it and only
the host's own work is measured: each call alone after a barrier, after other work (a matmul
and an activation issued just before it, as between a model's layers), the same with the
ranks taking turns (``--one-gpu``: while one rank issues, the other waits at a barrier, as
if each had its GPU to itself), and calls back to back in bursts of ``BURST``; then the call
and its graph's bare replay alternating in the same rounds (their medians drift apart when
timed minutes apart), after other work, at once and in turn; and torch's calls and the
library's without ``out=`` alternating in bursts (the plain path's cost over torch's). Calls
repeat their arguments, so copy-engine calls replay their recorded graphs
(``graphs/record.py``); ``--distinct`` lets the library keep one record
(``graphs.record.MAX_RECORDS = 1``) and alternates two outputs, so every call is issued in
full.

``--latency``: the latency all-reduce's eager call (``ops/engine.py``'s ``_shot``) on one
GPU, as one torchrun worker (``--nproc-per-node=1``; ``NCCL_P2P_DISABLE=1``: the host road's
kernel): the engine is told its 1-rank group has 2 ranks, so the call takes that path while
its kernels see one rank. Per call, in the same rounds (the GPU asleep under them): ``x @ w``,
torch's ``x @ w`` + ``dist.all_reduce``, torch's one-shot called directly (the matmul into a
symmetric buffer, a kept output), ``matmul_allreduce`` and ``RowParallelLinear``; then the
library's call under cProfile. ``--shape`` is ``MxNxK`` (default ``16x4096x2048``: 8B's
o_proj at TP 2, 16 tokens).

``--one-gpu``: both ranks on GPU 0 over gloo (a machine with one GPU; the overlapped call
only). The copy-engine transport then maps the other process's buffer on the same GPU, and
the two processes' kernels share the GPU by time slices: GPU times mean nothing there, the
host's work per call is the real one.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import itertools
import os
import pathlib
import pstats
import statistics
import time

BURST = 10  # calls back to back in a burst


def _node_kinds(graph) -> dict[str, int]:
    """How many nodes of each type the captured ``graph`` has (cuda-python)."""
    from cuda.bindings import driver as drv

    g = drv.CUgraph(graph.raw_cuda_graph())
    _, _, count = drv.cuGraphGetNodes(g, 0)
    _, nodes, _ = drv.cuGraphGetNodes(g, count)
    kinds: dict[str, int] = {}
    for n in nodes:
        _, t = drv.cuGraphNodeGetType(n)
        name = t.name.removeprefix("CU_GRAPH_NODE_TYPE_")
        kinds[name] = kinds.get(name, 0) + 1
    return kinds


def latency(args) -> None:
    """``--latency`` (module docstring): a table of host us per call, JSON next to it."""
    import json

    import torch
    import torch.distributed as dist
    from torch.distributed import _symmetric_memory as symm_mem

    import overlap
    import overlap.ops.engine
    from overlap.comm import shot

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    if dist.get_world_size() != 1:
        raise SystemExit("--latency runs as one torchrun worker (--nproc-per-node=1)")
    # the latency path taken (its kernels see 1 rank, so the check below covers this rank's
    # own steps, not the reduction: tests/test_gpu.py checks that); this process only
    overlap.ops.engine.world = lambda group: 2
    M, N, K = (int(v) for v in args.shape.split("x"))
    weight = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K**0.5
    w, x = weight.t(), torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    layer = overlap.nn.RowParallelLinear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.world_size = 2
    name = dist.group.WORLD.group_name
    buf = symm_mem.empty(M * N, dtype=torch.bfloat16, device=dev)
    symm_mem.rendezvous(buf, name)
    kept = torch.empty(M, N, dtype=torch.bfloat16, device=dev)

    def nccl():
        y = x @ w
        dist.all_reduce(y)
        return y

    def one_shot():
        torch.matmul(x, w, out=buf.view(M, N))
        torch.ops.symm_mem.one_shot_all_reduce_out.default(buf.view(M, N), "sum", name, kept)
        return kept

    runs = {"x @ w": lambda: x @ w, "torch: x @ w, dist.all_reduce": nccl,
            "torch: one-shot called directly": one_shot,
            "overlap.matmul_allreduce": lambda: overlap.matmul_allreduce(x, w),
            "overlap.nn.RowParallelLinear": lambda: layer(x)}  # fmt: skip
    want = x.double() @ w.double()
    with torch.no_grad():
        for what, run in runs.items():
            for _ in range(3):
                y = run()
            err = ((y.double() - want).norm() / want.norm()).item()
            if not err < 2e-2:
                raise SystemExit(f"{what}: relative error {err:.3g} against float64")
        how = overlap.stats()["matmul_allreduce"]
        if not {h.removeprefix("plain via ") for h in how} <= set(shot.KINDS):
            raise SystemExit(f"--shape {args.shape}: the library's calls took {sorted(how)}, "
                             "not the latency all-reduce (overlap/comm/shot.py)")  # fmt: skip
        host = {what: [] for what in runs}
        for _ in range(args.calls):
            for what, run in runs.items():
                torch.cuda._sleep(20_000_000)  # ~10 ms: the GPU never holds the host back
                t0 = time.perf_counter()
                for _ in range(BURST):
                    run()
                host[what].append((time.perf_counter() - t0) * 1e6 / BURST)
                torch.cuda.synchronize()
        prof = cProfile.Profile()
        for _ in range(args.calls):
            torch.cuda._sleep(20_000_000)
            prof.enable()
            for _ in range(BURST):
                overlap.matmul_allreduce(x, w)
            prof.disable()
            torch.cuda.synchronize()
    med = {what: statistics.median(v) for what, v in host.items()}
    lines = [f"{args.shape} bf16, the library's path {sorted(how)}, {torch.__version__}",
             f"host us per call (median of rounds of bursts of {BURST}):",
             *(f"  {what:<34} {us:7.1f}" for what, us in med.items())]  # fmt: skip
    table = io.StringIO()
    pstats.Stats(prof, stream=table).sort_stats("tottime").print_stats(25)
    text = "\n".join(lines) + "\n(the profile includes the profiler's own overhead)\n"
    print(text + table.getvalue())
    pathlib.Path(args.out).write_text(text + table.getvalue())
    with open(pathlib.Path(args.out).with_suffix(".json"), "w") as f:
        json.dump({"shape": args.shape, "path": sorted(how), "host_us": med,
                   "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                   "date": time.strftime("%Y-%m-%d")}, f, indent=1)  # fmt: skip
    overlap.release()
    dist.destroy_process_group()


def main() -> None:
    import torch
    import torch.distributed as dist

    import overlap
    from overlap.bench import need_gpus
    from overlap.collectives import collective

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", help="MxNxK (default 4096x8192x4096; --latency: 16x4096x2048)")
    ap.add_argument("--collective", default="reduce_scatter")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", help="bench_out/host_profile.txt, --latency: host_latency.txt")
    ap.add_argument("--one-gpu", action="store_true")
    ap.add_argument("--latency", action="store_true", help="the latency all-reduce, one GPU")
    ap.add_argument(
        "--distinct",
        action="store_true",
        help="a new output address at every call (no recorded graph is replayed)",
    )
    args = ap.parse_args()
    tool = "tools/host_profile.py"
    need_gpus(tool, f"torchrun --nproc-per-node=2 {tool} (2 GPUs), or on one GPU: "
              f"NCCL_P2P_DISABLE=1 torchrun --nproc-per-node=2 {tool} --one-gpu, or "
              f"torchrun --nproc-per-node=1 {tool} --latency")  # fmt: skip
    if args.latency:
        args.shape = args.shape or "16x4096x2048"
        args.out = args.out or "bench_out/host_latency.txt"
    args.shape = args.shape or "4096x8192x4096"
    args.out = args.out or "bench_out/host_profile.txt"
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.latency:
        return latency(args)
    local = 0 if args.one_gpu else int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    if args.one_gpu:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl", device_id=dev)
    M, N, K = (int(v) for v in args.shape.split("x"))
    R = dist.get_world_size()
    gathers = collective(args.collective).before  # all_gather: x is the shard of M rows
    x = torch.randn(M // R if gathers else M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16).t()
    out = torch.empty(M // R if args.collective == "reduce_scatter" else M, N, dtype=x.dtype,
                      device=dev)  # fmt: skip

    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def plain():  # what users write today: torch's own calls, the result made at every call
        if gathers:
            full = x.new_empty(M, K)
            ag(full, x)
            torch.matmul(full, w, out=out)
            return
        y = x @ w
        if args.collective == "all_reduce":
            dist.all_reduce(y)
        elif args.collective == "reduce_scatter":
            rs(y.new_empty(M // R, N), y)
        else:
            dist.all_to_all_single(torch.empty_like(y), y)

    import overlap.graphs.record

    # --distinct: the library keeps one record and calls alternate two outputs, so each call
    # evicts the other's record and every call is a first sighting, issued in full
    if args.distinct:
        overlap.graphs.record.MAX_RECORDS = 1
    ring = itertools.cycle([out, torch.empty_like(out)] if args.distinct else [out])

    def ovl(o=None):
        o = next(ring) if o is None else o
        if gathers:
            overlap.all_gather_matmul(x, w, out=o, backend=args.backend)
        else:
            overlap.matmul_collective(x, w, args.collective, out=o, backend=args.backend)

    lines = [f"{args.shape} {args.collective} backend={args.backend} {torch.__version__}"]
    runs = [("plain: x @ w, then the collective", plain)] if not args.one_gpu else []
    if not (args.one_gpu or gathers):  # as a model calls it (no out=): a plain-path call
        runs.append(("the library, no out=", lambda: overlap.matmul_collective(
            x, w, args.collective, backend=args.backend)))  # fmt: skip
    planned = overlap.plan(x, w, args.collective, backend=args.backend)
    described = planned.describe()

    def other_work():  # what a model issues between two calls: a matmul, an activation
        torch.nn.functional.silu(x[: min(x.shape[0], 1024)] @ w)

    def timed(run, burst: int = 1, before=None, turns: bool = False, also=()) -> list:
        """Host ms per call of ``run``, sorted; with ``also``, per round (each run in turn,
        the order reversed every other round) a list of ``run``'s and each of ``also``'s."""
        fns, host = (run, *also), []
        for i in range(args.calls):
            host.append([0.0] * len(fns))
            for j in range(len(fns))[:: 1 - 2 * (i % 2)]:
                dist.barrier()
                torch.cuda._sleep(20_000_000)  # ~10 ms: the GPU never holds the host back
                for turn in range(R) if turns else [None]:
                    if turns:  # one rank issues while the others wait here
                        dist.barrier()
                    if turn not in (None, dist.get_rank()):
                        continue
                    if before is not None:
                        before()
                    t0 = time.perf_counter()
                    for _ in range(burst):
                        fns[j]()
                    host[-1][j] = (time.perf_counter() - t0) * 1e3 / burst
                torch.cuda.synchronize()
        return host if also else sorted(h[0] for h in host)

    def stats(run) -> str:  # a call alone after a barrier, after other work, back to back
        parts = (("alone", timed(run)), ("after other work", timed(run, before=other_work)),
                 *((("after other work, ranks in turn", timed(run, before=other_work, turns=True)),)
                   if args.one_gpu else ()),
                 (f"in bursts of {BURST}", timed(run, BURST)))  # fmt: skip
        return "; ".join(f"{what}: median {t[len(t) // 2]:.3f}, min {t[0]:.3f}"
                         for what, t in parts)  # fmt: skip

    for what, run in (*runs, (described, ovl)):
        for _ in range(3):
            run()  # compile, make communicators
        torch.cuda.synchronize()
        host = stats(run)
        prof = cProfile.Profile()  # then where the time goes
        timed(lambda run=run: (prof.enable(), run(), prof.disable()))
        lines.append(f"\n== {what}\nhost ms per call: {host}")
        lines.append("(the profile below includes the profiler's own overhead)")
        if dist.get_rank() == 0 and run is ovl:
            prof.dump_stats(args.out + ".prof")  # for pstats elsewhere
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        lines.append(buf.getvalue())
    if len(runs) == 2:  # torch's and the library's without out=, alternating in the same rounds
        per = timed(runs[0][1], BURST, also=(runs[1][1],))  # (apart, they drift 20-40 us)
        med = [statistics.median(v) for v in zip(*per, strict=True)]
        diff = sorted((b - a) * 1e3 for a, b in per)
        lines.append(f"in bursts of {BURST}, torch's calls and the library's without out= "
                     f"alternating: median {med[0]:.4f} and {med[1]:.4f} ms per call; the "
                     f"library's minus torch's per round: median {diff[len(diff) // 2]:.1f} us, "
                     f"quartiles {diff[len(diff) // 4]:.1f} / "
                     f"{diff[3 * len(diff) // 4]:.1f}")  # fmt: skip
    replay = functools.partial(ovl, out)
    if planned.path == "overlap":
        graph = torch.cuda.CUDAGraph(keep_graph=True)  # the overlapped call captured, replayed
        with torch.cuda.graph(graph):
            ovl(out)
        replay = graph.replay
        lines.append(f"graph replay host ms per call: {stats(replay)}")
        for turns in (False, True) if args.one_gpu else (False,):
            per = timed(ovl, before=other_work, turns=turns, also=(replay,))  # paired: no drift
            med = [statistics.median(v) for v in zip(*per, strict=True)]
            diff = statistics.median(a - b for a, b in per)
            lines.append(f"after other work{', ranks in turn' if turns else ''}, the call and "
                         f"the graph's replay alternating: median {med[0]:.3f} and {med[1]:.3f}, "
                         f"difference per round {diff:.3f}")  # fmt: skip
        lines.append(f"graph nodes: {_node_kinds(graph)}")
    else:  # (and a gloo collective cannot be captured)
        lines.append("the call takes the plain path: no graph (a larger --shape overlaps)")
    if args.one_gpu:  # one more call's result (NaN before), replayed, against float64
        out.fill_(float("nan"))
        replay()
        r, B = dist.get_rank(), M // R
        if gathers:
            shards = [torch.empty_like(x.cpu()) for _ in range(R)]
            dist.all_gather(shards, x.cpu())
            want = torch.cat(shards).double() @ w.double().cpu()
        else:
            prod = (x.double() @ w.double()).cpu()
            prods = [torch.empty_like(prod) for _ in range(R)]
            dist.all_gather(prods, prod)
            total, mine = sum(prods), slice(r * B, (r + 1) * B)
            want = {"all_reduce": total, "reduce_scatter": total[mine],
                    "all_to_all": torch.cat([q[mine] for q in prods])}[args.collective]  # fmt: skip
        errs = [None] * R
        dist.all_gather_object(errs, ((out.double().cpu() - want).norm() / want.norm()).item())
        ok = all(e < 2e-2 for e in errs)  # NaN fails
        lines.append(f"relative error against float64 per rank: {errs} ({'ok' if ok else 'WRONG'})")
    if dist.get_rank() == 0:
        text = "\n".join(lines)
        print(text)
        with open(args.out, "w") as f:
            f.write(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
