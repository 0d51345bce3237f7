"""Timeline of one overlapped call: when each GEMM tile ran (and on which SM), when each chunk
was ready and when its collective finished, beside the sequential GEMM + collective.

Measure on 2 GPUs (GPU global timer, ns), then draw anywhere (matplotlib):

    torchrun --nproc-per-node=2 tools/timeline.py --shape 4096x8192x4096
    python tools/timeline.py --plot bench_out/timeline.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys


def measure(shape: str, collective: str, chunks: int | None, out: str, backend: str) -> None:
    import torch
    import torch.distributed as dist
    import triton
    import triton.language as tl

    from overlap.collectives import collective as spec
    from overlap.ops import Call
    from overlap.ops.engine import decide, overlapped

    @triton.jit
    def _stamp(ptr, i):
        tl.store(ptr + i, tl.extra.cuda.globaltimer())

    class Trace:
        def __init__(self, n_tiles: int, n_chunks: int, dev) -> None:
            self.tiles = torch.zeros(4 * n_tiles, dtype=torch.int64, device=dev)
            self.stamps = torch.zeros(2 * n_chunks, dtype=torch.int64, device=dev)

        def stamp(self, i: int) -> None:
            _stamp[(1,)](self.stamps, i, num_warps=1)

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    M, N, K = (int(v) for v in shape.split("x"))
    R, dev = dist.get_world_size(), torch.device("cuda", local)
    g = torch.Generator(device=dev).manual_seed(7 + dist.get_rank())
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=g).t()
    known = decide(x, w, Call(collective, None, "sum", backend, chunks), False, None)
    p, ctx, cls = known.plan, known.ctx, known.cls
    assert p.path == "overlap", p.describe()
    out2 = torch.empty(spec(collective).result_shape((M, K), N, R), device=dev, dtype=x.dtype)
    if cls.sized:
        # No stamps: they are kernels on the communication stream, which the copy-engine
        # transport keeps free of SM work (the GEMM's waiting tiles could hold every SM).
        Trace.stamp = lambda self, i: None
    n_tiles = p.num_tile_rows * triton.cdiv(N, p.tiles.block_n)
    runs = []
    for _i in range(6):  # the first calls compile and warm up; keep the last
        trace = Trace(n_tiles, p.n_chunks, dev)
        dist.barrier()
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)  # the host queues the whole call first, as in the bench
        overlapped(x, w, out2, p, None, ctx, cls, False, trace)
        torch.cuda.synchronize()
        runs.append(trace)
    trace = runs[-1]
    tiles = trace.tiles.view(-1, 4).cpu()
    t0 = int(tiles[:, 0].min())

    # The sequential reference, timed with events: GEMM alone, then the collective alone.
    y = x @ w
    seq = {}
    for name, fn in (
        ("gemm", lambda: torch.matmul(x, w, out=y)),
        ("comm", lambda: spec(collective).plain(y, out2, None)),
    ):
        ms = []
        for _ in range(10):
            dist.barrier()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        seq[name] = sorted(ms)[len(ms) // 2]

    per_rank = [None] * R
    record = {
        "rank": dist.get_rank(),
        "tiles_us": [[(a - t0) / 1e3, (b - t0) / 1e3, sm, c] for a, b, sm, c in tiles.tolist()],
        "stamps_us": [(int(v) - t0) / 1e3 for v in trace.stamps.cpu().tolist()],
        "sequential_ms": seq,
    }
    dist.all_gather_object(per_rank, record)
    if dist.get_rank() == 0:
        meta = {"shape": shape, "collective": collective, "plan": p.describe(),
                "backend": p.transport, "device": torch.cuda.get_device_name(),
                "torch": torch.__version__}  # fmt: skip
        path = pathlib.Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": meta, "ranks": per_rank}))
        print(f"wrote {out}: {p.describe()}")
    dist.destroy_process_group()


def plot(path: str, png: str) -> None:
    try:
        import matplotlib
    except ModuleNotFoundError:
        sys.exit("tools/timeline.py --plot needs matplotlib: pip install matplotlib")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(path))
    r0 = data["ranks"][0]
    tiles = r0["tiles_us"]
    # the copy-engine transport records no stamps (see measure): tiles and the sequential bars
    stamps = r0["stamps_us"] if data["meta"].get("backend") != "ce" else []
    n_chunks = 1 + max(t[3] for t in tiles)
    colors = plt.cm.viridis([i / max(1, n_chunks - 1) for i in range(n_chunks)])
    fig, (ax_t, ax_c) = plt.subplots(
        2, 1, figsize=(10, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]}
    )
    sms = sorted({t[2] for t in tiles})
    row_of = {sm: i for i, sm in enumerate(sms)}
    for a, b, sm, c in tiles:
        ax_t.barh(row_of[sm], b - a, left=a, height=0.9, color=colors[c], linewidth=0)
    ax_t.set_ylabel(f"SM ({len(sms)} used)")
    how = "copy-engine transport: colours are chunks in launch order" if not stamps else ""
    title = f"{data['meta']['plan']}\n{data['meta']['device']}, rank 0. {how}"
    ax_t.set_title(title, fontsize=9)
    for c in range(len(stamps) // 2):
        ready, done = stamps[2 * c], stamps[2 * c + 1]
        ax_c.barh(1, done - ready, left=ready, height=0.6, color=colors[c], edgecolor="k")
        ax_c.text(ready, 1.35, f"c{c}", fontsize=7)
    seq = r0["sequential_ms"]
    g_us, c_us = seq["gemm"] * 1e3, seq["comm"] * 1e3
    ax_c.barh(0, g_us, left=0, height=0.6, color="0.7", edgecolor="k")
    ax_c.barh(0, c_us, left=g_us, height=0.6, color="0.4", edgecolor="k")
    ax_c.text(0, -0.45, "cuBLAS GEMM", fontsize=7)
    ax_c.text(g_us, -0.45, data["meta"]["collective"], fontsize=7)
    ax_c.set_yticks([0, 1], ["sequential", "chunk\ncollectives"])
    ax_c.set_xlabel("microseconds from the first tile's start")
    end = max(stamps[-1:] + [max(t[1] for t in tiles), g_us + c_us])
    ax_c.set_xlim(0, end * 1.02)
    fig.tight_layout()
    pathlib.Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=130)
    print(f"wrote {png}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", default="4096x8192x4096", help="MxNxK")
    ap.add_argument("--collective", default="all_reduce")
    ap.add_argument("--chunks", type=int, default=None)
    ap.add_argument("--backend", default="auto", help="auto, torch, cupy or ce")
    ap.add_argument("--out", default="bench_out/timeline.json", help="default: %(default)s")
    ap.add_argument("--plot", help="draw this JSON instead of measuring (any machine)")
    ap.add_argument("--png", default="bench_out/timeline.png", help="default: %(default)s")
    a = ap.parse_args()
    if a.plot:
        plot(a.plot, a.png)
    else:
        from overlap.bench import need_gpus

        need_gpus("tools/timeline.py", "torchrun --nproc-per-node=2 tools/timeline.py (2 GPUs); "
                  "--plot FILE draws a measured timeline on any machine")  # fmt: skip
        measure(a.shape, a.collective, a.chunks, a.out, a.backend)


if __name__ == "__main__":
    main()
