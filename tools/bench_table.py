"""Markdown table of one or more ``python -m overlap.bench`` JSON files.

Usage: python tools/bench_table.py bench_results/bench_nvlink.json [...]
"""

import argparse
import json


def _f(v, fmt="{:.3f}"):
    return "-" if v is None else fmt.format(v)


def main(paths: list[str]) -> None:
    """Prints one markdown row per JSON row of every file in ``paths``."""
    print(
        "| mode | shape | collective | chunks | cuBLAS | our GEMM | comm | sequential | "
        "overlap | speedup | eta | async-TP | host ms/call | peak MB seq/ovl |"
    )
    print("|" + "---|" * 14)
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        mode = {"default": "NVLink", "no_p2p": "no P2P", "net": "net"}[d["meta"]["mode"]]
        for r in d["rows"]:
            chunks = r["chunks"] or "plain"
            print(
                f"| {mode} | {r['shape']} | {r['collective']} | {chunks} | "
                f"{_f(r['gemm_cublas'])} | {_f(r.get('gemm_overlap_kernel'))} | "
                f"{_f(r['comm'])} | {_f(r['sequential'])} | {_f(r['overlap'])} | "
                f"{_f(r['speedup'], '{:.2f}')} | {_f(r['eta'], '{:.2f}')} | "
                f"{_f(r.get('async_tp'))} | {_f(r['host_ms_per_call'], '{:.2f}')} | "
                f"{r['peak_mb_sequential']:.0f}/{r['peak_mb_overlap']:.0f} |"
            )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="JSON files written by python -m overlap.bench")
    main(ap.parse_args().json)
