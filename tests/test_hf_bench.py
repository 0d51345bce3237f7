"""No devices: ``tools/hf_bench.py`` on 2 CPU ranks (gloo, Triton's interpreter), a one-layer
transformers Llama through ``overlap.nn.parallelize``: every mode agrees with the plain one
(the bench fails otherwise), the plain modes ran every call on the plain path and the
library's modes none (the forcing does not leak into the modes after it)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "hf_bench.py"
MODES = ("plain", "plain_sp", "plain_c", "overlap", "overlap_sp_c")


def test_hf_bench_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # it sets its own
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # this overlap
    out = tmp_path / "h.json"
    cmd = [sys.executable, str(TOOL), "--cpu", "--layers", "1", "--iters", "1", "--warmup",
           "0", "--modes", ",".join(MODES), "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["timing_meaningful"] is False and res["world_size"] == 2
    assert [r["mode"] for r in res["rows"]] == list(MODES)
    for r in res["rows"]:
        plain = r["mode"].startswith("plain")
        for kind in ("prefill", "train"):  # every step of every turn on the mode's own path
            by = r["paths"][kind]
            library = by["overlap"] + by["replayed"] + by["updated"]
            assert (by["plain"] if plain else library) > 0, r
            assert (library if plain else by["plain"]) == 0, r
            assert len(r[f"{kind}_turn_ms"]) == 3 and r[f"{kind}_ms"] > 0
    assert set(res["errors"]) == set(MODES)
    for errs in res["errors"].values():
        assert set(errs) == {"output", "weight_grad"}
        assert all(e < res["tolerance"] <= 1e-4 for e in errs.values()), res["errors"]


@pytest.mark.parametrize("modes", ["plain,overlap_sp_c", "plain,overlap_c,plain_c"])
def test_compiled_modes_need_their_reference_first(modes):
    """A compiled mode is checked against ``plain_c``: listing it without ``plain_c`` before
    it is refused (it once failed a GPU run after its eager modes, against eager plain)."""
    cmd = [sys.executable, str(TOOL), "--cpu", "--modes", modes]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "plain_c (the compiled modes' reference)" in done.stderr
