"""No devices: the command-line edges of ``tools/`` and ``python -m overlap.bench``. Every tool
(each file of ``tools/`` not starting with ``_``, found anew at every run) answers ``--help``
with a usage line and no default output under the tracked ``bench_results/``; the GPU-only ones,
on a machine without a GPU, exit non-zero with one line that says how to launch them, not a
traceback."""

from __future__ import annotations

import json
import os
import pathlib
import random
import subprocess
import sys

import pytest
import torch
from _dist import spawn

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOLS = sorted(p for p in (ROOT / "tools").iterdir() if p.suffix in (".py", ".sh")
               and not p.name.startswith("_"))  # fmt: skip
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="tests the message without GPUs")


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """``args`` run from the repository root, importing this checkout's ``overlap``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _command(tool: pathlib.Path) -> list[str]:
    return ["bash", str(tool)] if tool.suffix == ".sh" else [sys.executable, str(tool)]


def test_tools_found():
    names = {p.name for p in TOOLS}
    assert {"soak.py", "timeline.py", "model_bench.py", "gpu_run.sh"} <= names, names


@pytest.mark.parametrize(
    "command",
    [_command(t) for t in TOOLS] + [[sys.executable, "-m", "overlap.bench"]],
    ids=[t.name for t in TOOLS] + ["overlap.bench"],
)
def test_help(command):
    done = _run([*command, "--help"])
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.lower().splitlines()
    assert any(line.startswith("usage:") for line in lines), done.stdout
    assert "bench_results" not in done.stdout, "a default output in the tracked bench_results/"


GPU_ONLY = [  # (command, a part of the launch hint it must print)
    (["-m", "overlap.bench"], "torchrun --nproc-per-node=N -m overlap.bench"),
    (["tools/timeline.py"], "--plot"),
    (["tools/soak.py"], "tools/soak.py --one-gpu"),
    (["tools/soak.py", "--one-gpu"], "tools/soak.py --one-gpu"),
    (["tools/host_profile.py"], "tools/host_profile.py --one-gpu"),
    (["tools/host_profile.py", "--latency"], "--nproc-per-node=1 tools/host_profile.py --latency"),
    (["tools/model_bench.py", "--one-gpu"], "--cpu"),
    (["tools/exchange_bench.py", "--one-gpu"], "--cpu"),
    (["bash", "tools/gpu_run.sh", "suite"], "gpu_run.sh"),
    (["tools/gemm_sweep.py", "out.json"], "tools/gemm_sweep.py OUT.json"),
]


@NO_GPU
@pytest.mark.parametrize("command, hint", GPU_ONLY, ids=[" ".join(c) for c, _ in GPU_ONLY])
def test_gpu_only_says_so(command, hint):
    done = _run(command if command[0] == "bash" else [sys.executable, *command])
    err = done.stderr.strip()
    assert done.returncode != 0, done.stdout[-1000:]
    assert "Traceback" not in err and len(err.splitlines()) == 1, err[-2000:]
    assert "needs CUDA GPUs" in err and hint in err, err


def test_need_gpus_under_torchrun(monkeypatch):
    """With GPUs, ``need_gpus`` passes only in a torchrun worker."""
    from overlap.bench import need_gpus

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="tool runs as torchrun workers: torchrun x"):
        need_gpus("tool", "torchrun x")
    monkeypatch.setenv("RANK", "0")
    need_gpus("tool", "torchrun x")


def _bench_json(path: pathlib.Path) -> pathlib.Path:
    """A two-row ``overlap.bench`` JSON (the fields the table and the plot read)."""
    row = dict(shape="4096x8192x4096", collective="all_reduce", chunks=4, gemm_cublas=0.36,
               gemm_overlap_kernel=0.38, comm=0.27, sequential=0.61, overlap=0.56, speedup=1.09,
               eta=0.21, async_tp=None, host_ms_per_call=0.5, peak_mb_sequential=64.0,
               peak_mb_overlap=0.0)  # fmt: skip
    meta = dict(mode="no_p2p", device="H200", world_size=2, date="2026-11-25")
    path.write_text(json.dumps(dict(meta=meta, rows=[row, dict(row, collective="all_to_all")])))
    return path


def test_bench_table(tmp_path):
    done = _run([sys.executable, "tools/bench_table.py", str(_bench_json(tmp_path / "b.json"))])
    assert done.returncode == 0, done.stderr[-2000:]
    rows = done.stdout.splitlines()[2:]
    assert [r.split(" | ")[2] for r in rows] == ["all_reduce", "all_to_all"], done.stdout
    assert all(r.startswith("| no P2P | 4096x8192x4096 |") for r in rows), done.stdout


def test_bench_plot(tmp_path):
    """Draws the chart where matplotlib is installed; says it is missing where it is not."""
    png = tmp_path / "sub" / "b.png"
    done = _run([sys.executable, "tools/bench_plot.py", str(png),
                 str(_bench_json(tmp_path / "b.json"))])  # fmt: skip
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        assert done.returncode != 0 and done.stderr.strip() == (
            "tools/bench_plot.py needs matplotlib: pip install matplotlib"
        ), done.stderr[-2000:]
    else:
        assert done.returncode == 0 and png.stat().st_size > 0, done.stderr[-2000:]


def _gemm_sweep(monkeypatch):
    """``tools/gemm_sweep.py`` imported, on a fake device of 3 SMs (persistent grids)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gemm_sweep
    finally:
        sys.path.remove(str(ROOT / "tools"))
    props = type("Props", (), {"multi_processor_count": 3})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    return gemm_sweep


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_gemm_sweep_floor_kernel(layout, persistent, monkeypatch):
    """``gemm_sweep``'s floor (``tri`` / ``trip``: a plain Triton matmul) against float64 under
    the interpreter: ragged edges, 9 tile rows (a group of 8, then one cut short), 3 programs
    for 27 tiles when persistent. fp16: the interpreter's descriptors mishandle bf16."""
    from overlap.plan import Tiles

    gemm_sweep = _gemm_sweep(monkeypatch)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(272, 80, generator=g).half()
    weight = torch.randn(72, 80, generator=g).half()  # [N, K]
    w = weight.t() if layout == "nk" else weight.t().contiguous()
    launch, y = gemm_sweep._plain(x, w, Tiles(32, 32, 16, 4, 2), persistent)
    y.fill_(float("nan"))
    launch()
    want = x.double() @ w.double()
    assert ((y.double() - want).norm() / want.norm()).item() < 2e-3


@pytest.mark.parametrize("kind", ["tri", "trip"])
def test_gemm_sweep_floor_default_tiles(kind, monkeypatch):
    """``gemm_sweep``'s floor as ``--kernels tri`` (no tile config) builds it: the library's
    GPU tiles (256x128x64), checked against float64 under the interpreter."""
    gemm_sweep = _gemm_sweep(monkeypatch)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(272, 80, generator=g).half()
    w = torch.randn(72, 80, generator=g).half().t()
    launch, check, plan = gemm_sweep._variant(kind, x, w, 2, torch.float16, None)
    assert plan is None
    launch()
    err, counted = check((x.double() @ w.double()).half())
    assert err < 2e-3 and counted


def test_kernel_report_no_spills_no_serialized_wgmma():
    """``tools/kernel_report.py`` compiles the real kernels for sm_90 without a GPU: the NCCL
    road's and the copy engines' (R = 2 and 8) spill no register, and ptxas keeps their wgmma
    pipeline (no C7515: a branch merging the accumulator in the flattened loop made the copy
    engines' kernel 1.41x slower on an H200). The fused epilogue holds more registers."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "tools/kernel_report.py", "--shapes", "1024x2048x512",
                           "--worlds", "2,8"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {}
    for line in done.stdout.splitlines()[1:]:
        kind, _, R, _, regs, spilled, shared, warnings = line.split(maxsplit=7)
        rows[kind, int(R)] = (int(regs), int(spilled), int(shared), warnings)
    assert set(rows) == {("ar", 2), ("ce", 2), ("ce", 8)}, done.stdout
    for key, (regs, spilled, shared, warnings) in rows.items():
        assert 0 < regs <= 255 and shared > 0, (key, done.stdout)
        assert spilled == 0, f"{key} spills: {done.stdout}"
        assert "C7515" not in warnings, f"{key}: {done.stdout}"
    assert rows["ce", 2][0] > rows["ar", 2][0], done.stdout


def _soak_cases(rank: int, R: int) -> list[str]:
    """32 calls of the soak's schedule on CPU ranks (tiny fp32 shapes, the interpreter; seed
    105 draws every kind of call at 2 and 4 ranks: the four collectives, the uneven
    all-to-all, the MoE combine and dispatch, the embedding bags): each repeat of a case draws
    the same choices, reuses the case's weight tensor (the same signature, so on a GPU the
    copy engines record, then replay) and is right against the soak's own reference."""
    sys.path.insert(0, str(ROOT / "tools"))
    import soak

    soak.SHAPES, soak.DTYPES = [(62, 32, 48), (30, 20, 40)], [torch.float32]  # (M even, not 4k)
    rng, gen = random.Random(105), torch.Generator().manual_seed(rank)
    schedule, failures, calls, kinds = soak.cases(rng), [], [], set()
    for i in range(32):
        keep = next(schedule)
        dtype, err, p, op = soak._one_call(rng, gen, torch.device("cpu"), R, keep)
        calls.append((keep, p.describe(), op, keep.get("w")))
        kinds.add(p.collective)
        if not err < soak.TOL[dtype]:
            failures.append(f"call {i}: {p.describe()}: error {err}")
    repeated = 0
    for (k0, *first), (k1, *then) in zip(calls, calls[1:], strict=False):
        if k1 is k0:  # a repeat of the case before
            repeated += 1
            if then[:2] != first[:2] or then[2] is not first[2]:
                failures.append(f"a repeat differs from its case: {first[:2]} -> {then[:2]}, "
                                f"the same weight: {then[2] is first[2]}")  # fmt: skip
    if len(kinds) < 8:
        failures.append(f"not every kind of call was drawn: {sorted(kinds)}")
    if repeated < 4:
        failures.append(f"{repeated} repeats in 32 calls")
    return failures


@pytest.mark.parametrize("R", [2, 4])
def test_soak_repeats_cases(R, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spawn(_soak_cases, R)


def test_soak_cycle_repeats_its_cases_with_their_weights():
    """``--cycle``: the first ``cycle`` cases come back round after round, in order, each with
    the dict (the weight) of its first round, and the round hook runs before each round."""
    sys.path.insert(0, str(ROOT / "tools"))
    import soak

    rng, starts = random.Random(5), []
    schedule = soak.cases(rng, 4, lambda: starts.append(len(seen)))
    seen: list = []
    for _ in range(40):
        keep = next(schedule)
        keep.setdefault("id", len({id(k) for k in seen}))
        seen.append((keep, rng.random()))  # what the call draws
    rounds = [seen[a:b] for a, b in zip(starts, starts[1:], strict=False)]
    assert len(rounds) >= 3 and starts[0] == 0
    for r in rounds[1:]:
        assert [(k["id"], x) for k, x in r] == [(k["id"], x) for k, x in rounds[0]]
        assert all(k is k0 for (k, _), (k0, _) in zip(r, rounds[0], strict=True))
    assert len({k["id"] for k, _ in seen}) == 4
