"""No devices: ``tools/model_bench.py`` on 2 CPU ranks (gloo, Triton's interpreter), one
layer, the compiled modes run eagerly (``--eager``), one timed call per row: every mode that
runs on CPU in both layouts, each agreeing with plain tensor parallelism (the bench fails
otherwise, and the JSON's errors say so), async-TP skipped with its reason, and
``--breakdown``'s every op of a layer with the library's result equal to plain's."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "model_bench.py"


def test_model_bench_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # it sets its own
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # this overlap
    out = tmp_path / "m.json"
    cmd = [sys.executable, str(TOOL), "--cpu", "--eager", "--layers", "1", "--iters", "1",
           "--warmup", "0", "--breakdown", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["timing_meaningful"] is False and res["world_size"] == 2
    modes = ("plain", "plain_sp", "nocomm", "nocomm_c", "overlap", "overlap_sp", "overlap_sp_c",
             "torch_tp")  # fmt: skip
    got = {(r["layout"], r["mode"]) for r in res["rows"]}
    assert got == {(lay, m) for lay in ("fused", "separate") for m in modes}
    assert "P2P" in res["skipped"]["async_tp"]
    assert all(r["prefill_ms"] > 0 and r["train_ms"] > 0 for r in res["rows"])
    for r in res["rows"]:  # the library's calls by path, over every step of every turn
        turn = len(r["train_turn_ms"])
        assert turn == len(r["prefill_turn_ms"]) >= 2 and r["train_ms"] == r["train_turn_ms"][-1]
        calls = {ph: sum(r["paths"][ph].values()) for ph in ("prefill", "train")}
        if r["mode"].startswith("overlap"):  # a layer's 2 (no SP) or 4 forward collectives
            per_step = 2 if r["mode"] == "overlap" else 4
            assert calls == {"prefill": per_step * turn, "train": 2 * per_step * turn}, r
        else:
            assert calls == {"prefill": 0, "train": 0}, r
    checked = {(lay, m) for lay in ("fused", "separate") for m in modes if "nocomm" not in m}
    assert set(res["errors"]) == {f"{lay}/{m}" for lay, m in checked}
    for errs in res["errors"].values():
        assert set(errs) == {"output", "input_grad", "weight_grad"}
        assert all(e < res["tolerance"] <= 1e-4 for e in errs.values()), res["errors"]
    ops = res["breakdown"]["ops"]
    assert len(ops) == 12 and {o["layout"] for o in ops} == {"nk", "kn"}
    assert all(o["error"] < 1e-5 for o in ops), [(o["op"], o["error"]) for o in ops]
    for o in ops:  # per op: half the [M, width] fp32 tensor each way, twice for an all-reduce
        width = o["K"] if o["collective"] == "all_gather" else o["N"]
        assert o["bytes"] == (2 if o["collective"] == "all_reduce" else 1) * o["M"] * width * 2, o
        assert o["bound"] == max(o["cublas"], o["comm"]) and o["left"] == o["overlap"] - o["bound"]
    # a layer's sequence-parallel collectives: 4 all-gathers and 4 reduce-scatters of
    # [seq, hidden] fp32, each rank sending half of each (hidden 64 at --dims small)
    moved = res["breakdown"]["bytes"]
    assert moved["bytes_per_rank"] == 8 * res["config"]["seq"] * 64 * 4 // 2
    assert moved["collectives_alone_ms"] > 0 and moved["host_copy_bound"] is None


def test_timeline_attributes_a_step():
    """``_timeline`` on a made-up trace: from the end of the GPU sleep (another stream's work
    before it left out), compute where an SM kernel (not NCCL's) runs, transfers alone where
    only NCCL or copies run, idle where nothing does."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from _benchrun import load

        bench = load(TOOL, "model_bench_under_test")
    finally:
        sys.path.remove(str(ROOT / "tools"))

    def ev(cat, name, ts, dur):
        return dict(cat=cat, name=name, ts=ts, dur=dur)

    events = [ev("kernel", "zero_flags", -500, 1), ev("kernel", "at::spin_kernel", -400, 400),
              ev("kernel", "gemm_a", 0, 10), ev("kernel", "ncclDevKernel_x", 5, 15),
              ev("gpu_memcpy", "Memcpy PtoP", 20, 10), ev("cpu_op", "aten::mm", 0, 99),
              ev("kernel", "flash_b", 40, 10)]  # fmt: skip
    t = bench._timeline(events, steps=2)
    got = (t["wall_ms"], t["compute_ms"], t["exposed_comm_ms"], t["idle_ms"])
    assert got == pytest.approx((0.025, 0.01, 0.01, 0.005))
    assert t["gaps"][0] == (0.01, "Memcpy PtoP", "flash_b")


def _turns(rank, R):
    """``time_turns`` on 2 gloo ranks: every function called once per round, the order
    reversed every other round; each key's median is the slower rank's."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from _benchrun import time_turns
    finally:
        sys.path.remove(str(ROOT / "tools"))
    calls = []
    fns = {k: (lambda k=k: calls.append(k)) for k in "abc"}
    t = time_turns(fns, iters=3, warmup=1, cuda=False, calls=2)
    failures = []
    if calls != list("aabbccccbbaaaabbccccbbaa"):
        failures.append(f"call order {''.join(calls)}")
    if set(t) != set("abc") or not all(len(v) == 2 and min(v) >= 0 for v in t.values()):
        failures.append(f"result {t}")
    n = [0]

    def first_slow():  # the first call of each turn sleeps on rank 1
        n[0] += 1
        time.sleep(0.02 if rank == 1 and n[0] % 2 == 1 else 0)

    slow = time_turns({"s": first_slow}, 2, 0, False, calls=2)["s"]
    if not (slow[0] >= 20 and slow[1] < 20):
        failures.append(f"not the slower rank's first call: {slow}")
    return failures


def test_time_turns_takes_turns():
    from _dist import spawn

    spawn(_turns, 2)
