"""Bar chart of ``python -m overlap.bench`` JSON files: time of sequential, overlapped and
(reduce-scatter) torch async-TP per shape and collective, relative to sequential, with the
limit max(cuBLAS, collective) and eta written on each group. Async-TP is drawn only for the
NVLink mode (it ignores NCCL_P2P_DISABLE, so it is no peer without P2P).

Usage: python tools/bench_plot.py OUT.png bench_results/bench_nvlink.json [...]
Needs matplotlib (not a dependency of the library).
"""

import argparse
import json
import pathlib
import sys


def main(out_png: str, paths: list[str]) -> None:
    """Draws one panel per JSON file of ``paths`` into ``out_png``."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        sys.exit("tools/bench_plot.py needs matplotlib: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        mode = {"default": "NVLink", "no_p2p": "no P2P", "net": "net"}[d["meta"]["mode"]]
        rows = [r for r in d["rows"] if r["chunks"]]  # overlapped rows only
        title = f"{mode}, {d['meta']['device']} x{d['meta']['world_size']}, {d['meta']['date']}"
        # async-TP uses CUDA P2P itself and ignores NCCL_P2P_DISABLE: no peer in that mode
        panels.append((title, rows, d["meta"]["mode"] == "default"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.6 * len(panels)), squeeze=False)
    for ax, (title, rows, peer) in zip(axes[:, 0], panels, strict=True):
        labels = [
            f"{r['shape'].rsplit('x', 1)[0]}\nx{r['shape'].rsplit('x', 1)[1]}\n{r['collective']}"
            for r in rows
        ]
        xs = range(len(rows))
        limit = [max(r["gemm_cublas"], r["comm"]) / r["sequential"] for r in rows]
        ovl = [r["overlap"] / r["sequential"] for r in rows]
        atp = [(r.get("async_tp") or 0) / r["sequential"] if peer else 0 for r in rows]
        ax.bar([x - 0.3 for x in xs], [1.0] * len(rows), 0.2, label="sequential", color="#999")
        ax.bar([x - 0.1 for x in xs], ovl, 0.2, label="overlap", color="#1f77b4")
        ax.bar([x + 0.1 for x in xs], atp, 0.2, label="torch async-TP", color="#ff7f0e")
        ax.bar([x + 0.3 for x in xs], limit, 0.2, label="limit max(GEMM, comm)", color="#2ca02c")
        for x, r in zip(xs, rows, strict=True):
            eta = "-" if r["eta"] is None else f"{r['eta']:.2f}"
            ax.text(
                x - 0.1, ovl[x] + 0.02, f"{r['speedup']:.2f}x\neta {eta}", ha="center", fontsize=7
            )
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("time / sequential")
        ax.set_ylim(0, 1.25)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, ncol=4, loc="upper right")
    fig.tight_layout()
    pathlib.Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("png", help="the chart to write")
    ap.add_argument("json", nargs="+", help="JSON files written by python -m overlap.bench")
    a = ap.parse_args()
    main(a.png, a.json)
