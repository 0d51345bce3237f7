"""No devices: ``tools/decode_bench.py --cpu --quick`` on 2 CPU ranks (gloo, Triton's
interpreter, fp32, tiny dims): every cell of the op sweep (all-reduce and reduce-scatter) and
of the decode step in every mode that runs on CPU, each agreeing with ``nccl`` (the torch
collective, gloo here; the bench exits non-zero otherwise), the symmetric-memory modes and
the captured timings skipped with their reasons, and the library's calls counted by path."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "decode_bench.py"
LIBRARY = ("overlap_op", "overlap_layer")


def test_decode_bench_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # it sets its own
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # this overlap
    env["NCCL_P2P_DISABLE"] = "1"  # (recorded as the road; nothing else on CPU)
    out = tmp_path / "d.json"
    cmd = [sys.executable, str(TOOL), "--cpu", "--quick", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    res = json.loads(out.read_text())
    cfg = res["config"]
    assert res["timing_meaningful"] is False and res["world_size"] == 2
    assert cfg["dims"] == ["small"] and cfg["ms"] == [1, 8] and cfg["bs"] == [1, 4]
    assert res["env"]["NCCL_P2P_DISABLE"] == "1" and "host memory" in res["env"]["road"]
    assert res["env"]["nccl"] is None and res["env"]["driver"] is None
    assert not res["failed"] and not res["unsupported"]
    for mode in ("symm_one", "symm_two"):  # skipped with the reason, no rows
        assert "CUDA" in res["skipped"][mode]
    assert "reduce-scatter" in res["skipped"]["overlap_layer/reduce_scatter"]
    assert "CPU" in res["captured_skipped"]
    # every cell that runs on CPU, and no other
    ar = ("nccl", "overlap_op", "overlap_layer", "nocomm")
    want = {("sweep", "all_reduce", proj, M, m) for proj in ("o_proj", "down") for M in (1, 8)
            for m in ar}  # fmt: skip
    want |= {("sweep", "reduce_scatter", proj, 8, m) for proj in ("o_proj", "down")
             for m in ("nccl", "overlap_op", "nocomm")}  # fmt: skip
    want |= {("decode", None, None, B, m) for B in (1, 4) for m in ar}
    got = [(r["part"], r.get("collective"), r.get("proj"), r.get("M", r.get("B")), r["mode"])
           for r in res["rows"]]  # fmt: skip
    assert sorted(got, key=str) == sorted(want, key=str)
    assert set(res["cell_skipped"]) == {f"sweep/reduce_scatter/small {p}/M=1"
                                        for p in ("o_proj", "down")}  # fmt: skip
    for r in res["rows"]:
        unit = "us" if r["part"] == "sweep" else "ms"
        assert r[f"eager_{unit}"] > 0 and r[f"captured_{unit}"] is None, r
        rounds = cfg["iters"] * (6 if r["part"] == "decode" else 1)  # (decode steps: 6x)
        assert r["rounds"] == {"eager": rounds, "captured": 0}, r
        key = (f"sweep/{r['collective']}/small {r['proj']}/M={r['M']}/{r['mode']}"
               if r["part"] == "sweep" else f"decode/small/B={r['B']}/{r['mode']}")  # fmt: skip
        if r["mode"] == "nocomm":  # the ceiling sums nothing: not checked
            assert r["error"] is None and key not in res["errors"], r
        else:  # agrees with nccl's result (nccl with itself: exactly)
            assert r["error"] < res["tolerance"] <= 1e-4, r
            assert res["errors"][key] == {"eager": r["error"]}
            assert r["error"] == 0 or r["mode"] != "nccl", r
        # the library's calls by path over one eager chain or step: every op one call
        calls = sum(r["paths"]["eager"].values())
        per = cfg["chain"] if r["part"] == "sweep" else 2 * cfg["layers"]
        assert calls == (per if r["mode"] in LIBRARY else 0), r
        if r["part"] == "sweep":
            assert (r["plan"] is not None) == (r["mode"] in LIBRARY), r
            assert r["plan"] is None or r["plan"]["path"] in ("overlap", "fallback"), r
