"""No devices: ``tools/model_bench.py`` on 2 CPU ranks (gloo, Triton's interpreter), one layer,
one timed call per row: both modes, both sequence-parallel settings, and the overlap mode's
output and gradients equal to the plain mode's."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "model_bench.py"


def test_model_bench_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # it sets its own
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # this overlap
    out = tmp_path / "m.json"
    cmd = [sys.executable, str(TOOL), "--cpu", "--layers", "1", "--iters", "1", "--warmup", "0",
           "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["timing_meaningful"] is False and res["world_size"] == 2
    got = {(r["mode"], r["sequence_parallel"]) for r in res["rows"]}
    assert got == {(m, sp) for m in ("plain", "overlap") for sp in (False, True)}
    assert all(r["prefill_tok_s"] > 0 and r["train_tok_s"] > 0 for r in res["rows"])
    assert set(res["errors"]) == {"sp=0", "sp=1"}
    for errs in res["errors"].values():
        assert set(errs) == {"output", "input_grad", "weight_grad"}
        assert all(e < res["tolerance"] <= 1e-4 for e in errs.values()), res["errors"]
