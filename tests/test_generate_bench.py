"""No devices: ``tools/generate_bench.py --cpu`` on 2 CPU ranks (gloo, Triton's interpreter,
fp32, a one-layer tiny Llama, one batch of 2): ``overlap``'s greedy ``generate`` gives the
reference's ids, eager and with a static cache (the bench exits non-zero otherwise), through
the library's calls; ``tf_tp`` (transformers' ``tp_plan="auto"``), which cannot load here,
is skipped with its reason, not a crash."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "generate_bench.py"


def test_generate_bench_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # it sets its own
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # this overlap
    env["NCCL_P2P_DISABLE"] = "1"  # (recorded; nothing else on CPU)
    out = tmp_path / "g.json"
    cmd = [sys.executable, str(TOOL), "--cpu", "--layers", "1", "--batch", "2", "--prompt", "8",
           "--new-tokens", "4", "--iters", "1", "--warmup", "0", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["timing_meaningful"] is False and res["world_size"] == 2
    assert res["config"]["dtype"] == "fp32" and res["config"]["modes"] == ["tf_tp", "overlap",
                                                                          "single"]  # fmt: skip
    env_ = res["env"]
    assert env_["NCCL_P2P_DISABLE"] == "1" and env_["torch"] and env_["transformers"]
    assert not res["failed"] and not res["diverged"]
    # transformers' TP cannot load here (accelerate missing, or gloo on CPU): skipped, with
    # the exception as the reason; the reference is then the unsharded model
    if "tf_tp" in res["skipped"]:
        assert res["skipped"]["tf_tp"].split(":")[0].endswith("Error"), res["skipped"]
        assert res["reference"] == "single"
    modes = ["overlap", "single"] if "tf_tp" in res["skipped"] else ["tf_tp", "overlap", "single"]
    got = [(r["mode"], r["batch"], r["cache"]) for r in res["rows"]]
    assert got == [(m, 2, c) for c in ("eager", "static") for m in modes]
    for r in res["rows"]:
        assert r["ms_per_token"] > 0 and r["rounds"] == 1, r
        assert r["first_diff"] is None, r  # equal ids (fp32: else the run fails)
        if r["mode"] == "overlap":  # through the library: 2 row-parallel calls a forward
            assert sum(r["paths"].values()) == 2 * 4 and r["paths"]["plain"] == 0, r
            assert res["errors"][f"B=2/{r['cache']}/overlap"] is None
        assert (r["x_tf_tp"] is None) == ("tf_tp" in res["skipped"]), r


def test_first_diff():
    """The first generated position where any sequence differs (a shorter one differs where
    it ends)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from generate_bench import _first_diff
    finally:
        sys.path.remove(str(ROOT / "tools"))
    assert _first_diff([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]]) is None
    assert _first_diff([[1, 2, 3], [4, 0, 6]], [[1, 2, 0], [4, 5, 6]]) == 1
    assert _first_diff([[1, 2]], [[1, 2, 3]]) == 2
