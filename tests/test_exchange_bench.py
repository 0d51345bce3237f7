"""No devices: ``tools/exchange_bench.py`` on 2 CPU ranks (gloo, Triton's interpreter), tiny
sizes, one timed call per row: all five exchanges, each overlapped op's result equal to the
plain torch one's."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "exchange_bench.py"
OPS = {"all_gather", "uneven_a2a", "moe_combine", "moe_dispatch", "embedding"}


def test_exchange_bench_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # it sets its own
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # this overlap
    out = tmp_path / "e.json"
    cmd = [sys.executable, str(TOOL), "--cpu", "--iters", "1", "--warmup", "0", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["timing_meaningful"] is False and res["world_size"] == 2
    assert res["device"] == "cpu" and res["config"]["dtype"] == "fp32"
    assert {r["op"] for r in res["rows"]} == OPS and len(res["rows"]) == len(OPS)
    assert set(res["errors"]) == OPS
    assert all(e < res["tolerance"] <= 1e-4 for e in res["errors"].values()), res["errors"]
    for r in res["rows"]:
        assert r["plain_ms"] > 0 and r["overlap_ms"] > 0, r
        assert abs(r["speedup"] - r["plain_ms"] / r["overlap_ms"]) < 1e-9, r
