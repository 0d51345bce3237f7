"""GPU suite (marker ``gpu``): 2 ranks on NCCL, one GPU each, spawned from one pytest process
(``test_four_gpus``: 4 ranks, skipped with fewer GPUs).

Run on a machine with 2 GPUs:  ``python -m pytest -m gpu tests/test_gpu.py``
Each case is checked against a float64 reference computed on the GPU, output poisoned with NaN.

The tests whose name ends in ``one_gpu`` run two ranks on one GPU over gloo with
``NCCL_P2P_DISABLE=1`` (the copy engines' host road; NCCL and torch symmetric memory refuse two
ranks on one GPU): results and host times count, GPU times do not. A test takes 14-259 s, the
processes' start included, so the whole suite does not fit a 600 s run on 2 GPUs:
``tools/gpu_run.sh suite`` runs each test in a process of its own with a timeout
(``TEST_TIMEOUT``, 150 s), split with ``PYTEST_K``, or on 4 GPUs as two pairs at once;
``test_four_gpus`` took 25-45 s per road on 4 H200s.
"""

from __future__ import annotations

import random

import pytest
import torch
from _dist import (
    TOL,
    check_case,
    check_grad_case,
    count_collectives,
    fault_scenarios,
    mismatch,
    on_subgroups,
    spawn,
)

pytestmark = pytest.mark.gpu

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_to_all")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (lead..., K, N): large row-band shapes, ragged ones, a 3-D x, and decode M = 16, 128.
SHAPES = [
    (2048, 4096, 4096),
    (1000, 1000, 3000),
    (778, 333, 1234),
    (4, 256, 1024, 2048),
    (16, 4096, 8192),
    (128, 4096, 8192),
    (64, 72, 520),
]


def _ce(ctx):
    """The copy-engine transport a context used, or None."""
    return next((t for t in ctx._transports.values() if t.sized), None)


def _suite(rank, R, seed, backend, chunks):
    counts = count_collectives() if backend == "torch" else None
    failures = []
    i = 0
    for coll in COLLECTIVES:
        for dtype in DTYPES:
            for shape in SHAPES:
                i += 1
                msg = check_case(
                    rank,
                    R,
                    f"cuda:{rank}",
                    coll,
                    dtype,
                    shape,
                    seed + i,
                    backend=backend,
                    chunks=chunks,
                    count_calls=counts,
                )
                failures += [msg] if msg else []
    for coll in COLLECTIVES:  # decode-sized: the planner's own choice is the plain path
        msg = check_case(
            rank,
            R,
            f"cuda:{rank}",
            coll,
            torch.bfloat16,
            (16, 4096, 8192),
            seed + 500,
            backend=backend,
            expect="fallback",
        )
        failures += [msg] if msg else []
    for coll in ("all_reduce", "reduce_scatter"):  # avg and a plain-layout w
        msg = check_case(
            rank,
            R,
            f"cuda:{rank}",
            coll,
            torch.bfloat16,
            (512, 256, 768),
            seed + 999,
            op="avg",
            transposed_w=False,
            backend=backend,
            chunks=chunks,
        )
        failures += [msg] if msg else []
    return failures


def _on_two_gpus(monkeypatch, fn, *args, **env) -> None:
    """Run ``fn(rank, 2, *args)`` on 2 GPUs over NCCL with the variables ``env`` set (skip
    without 2 GPUs); Triton compiles for the GPU, not the interpreter."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spawn(fn, 2, *args, backend="nccl")


@pytest.mark.parametrize("p2p", ["nvlink", "no_p2p"])
@pytest.mark.parametrize("backend", ["torch", "cupy", "ce"])
def test_suite_two_gpus(p2p, backend, monkeypatch):
    if backend == "cupy":
        pytest.importorskip("cupy")
    # no_p2p: NCCL, and the copy-engine transport, through host memory, like PCIe cards
    env = {"NCCL_P2P_DISABLE": "1"} if p2p == "no_p2p" else {}
    _on_two_gpus(monkeypatch, _suite, random.randrange(1 << 30), backend, 4, **env)


def _shot_cases(rank, R, seed, road):
    """The latency all-reduce (``comm/shot.py``) on ``road``: products too small to overlap,
    GPU to GPU one-shot and two-shot by size (float16 takes NCCL), or through host memory (the
    library's one-shot, every float type), every dtype, ragged sizes, a 3-D x,
    ``avg``, ``out=``, calls back to back with NCCL ones between, and captured in a CUDA graph
    whose replays see new data: each against float64, the ranks' results equal in bits."""
    import torch.distributed as dist

    import overlap
    from overlap.comm import shot

    dev = torch.device("cuda", rank)
    gen = torch.Generator(device=dev).manual_seed(seed)
    failures = []

    def check(what, y, x, w, op="sum"):
        xs = [torch.empty_like(x) for _ in range(R)]
        dist.all_gather(xs, x.contiguous())
        ref = sum(a.double() @ w.double() for a in xs)
        ref = ref / R if op == "avg" else ref
        err = (y.double() - ref).norm() / ref.norm().clamp_min(1e-30)
        if not err < TOL[y.dtype]:
            failures.append(f"{what}: relative error {err:.2e}")
        ys = [torch.empty_like(y) for _ in range(R)]
        dist.all_gather(ys, y.contiguous())
        if not all(torch.equal(ys[0], t) for t in ys):
            failures.append(f"{what}: the ranks' results differ in bits")

    cases = [(dt, m, k, n) for dt in DTYPES for m, k, n in
             ((1, 512, 4096), (8, 2048, 4096), (3, 100, 1234), (32, 512, 8192), (512, 256, 4096),
              (1024, 128, 8192))]  # fmt: skip
    for dt, m, k, n in cases:
        x = torch.randn(m, k, device=dev, dtype=dt, generator=gen)
        w = torch.randn(k, n, device=dev, dtype=dt, generator=gen) / k**0.5
        want = shot.kind(m * n * x.element_size(), dt, road, R)
        p = overlap.plan(x, w)
        if (want is not None or p.transport in shot.KINDS) and p.transport != want:
            failures.append(f"{(dt, m, k, n)}: plan {p.describe()}, want {want}")
        for _ in range(2):  # (the first makes the transport: a collective)
            check(f"{(dt, m, k, n)}", overlap.matmul_allreduce(x, w), x, w)
    x = torch.randn(2, 5, 512, device=dev, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(512, 4096, device=dev, dtype=torch.bfloat16, generator=gen) / 512**0.5
    check("3-D x", overlap.matmul_allreduce(x, w).view(10, 4096), x.view(10, 512), w)
    check("avg", overlap.matmul_allreduce(x, w, op="avg").view(10, 4096), x.view(10, 512), w,
          "avg")  # fmt: skip
    out = torch.full((2, 5, 4096), float("nan"), device=dev, dtype=torch.bfloat16)
    overlap.matmul_allreduce(x, w, out=out)
    check("out=", out.view(10, 4096), x.view(10, 512), w)
    out = torch.full((1 + 10 * 4096,), float("nan"), device=dev, dtype=torch.bfloat16)
    out = out[1:].view(2, 5, 4096)  # (2 bytes off 16: torch's one-shot stores 16-byte vectors)
    overlap.matmul_allreduce(x, w, out=out)
    check("out= not 16-byte aligned", out.reshape(10, 4096), x.view(10, 512), w)
    # back to back, alternating kinds and NCCL (a product too big for the buffer)
    xs = [torch.randn(m, 1024, device=dev, dtype=torch.bfloat16, generator=gen)
          for m in (4, 2048, 1, 4096, 64)]  # fmt: skip
    w = torch.randn(1024, 4096, device=dev, dtype=torch.bfloat16, generator=gen) / 32
    ys = [overlap.matmul_allreduce(a, w) for a in xs for _ in range(3)]
    for i, y in enumerate(ys):
        check(f"back to back #{i}", y, xs[i // 3], w)
    # captured: the graph's replays read new data
    x = torch.randn(16, 1024, device=dev, dtype=torch.bfloat16, generator=gen)  # (128 KB)
    overlap.matmul_allreduce(x, w)  # (warm: the transport exists)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    graph = torch.cuda.CUDAGraph()
    first = "plain via one-shot" if road == "peer" else "plain via host one-shot"
    before = overlap.stats().get("matmul_allreduce", {}).get(first, 0)
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        y1 = overlap.matmul_allreduce(x, w)
        x2 = y1[:, :1024].contiguous()
        y2 = overlap.matmul_allreduce(x2, w)
    took = overlap.stats().get("matmul_allreduce", {}).get(first, 0) - before
    if took != 2:
        failures.append(f"captured: {took} of 2 calls took the one-shot all-reduce")
    for i in range(3):
        x.copy_(torch.randn(16, 1024, device=dev, dtype=torch.bfloat16, generator=gen))
        graph.replay()
        check(f"replay {i}", y1, x, w)
        check(f"replay {i}, the second call", y2, x2, w)
        eager = overlap.matmul_allreduce(x, w)  # an eager call between replays
        check(f"eager after replay {i}", eager, x, w)
    paths = overlap.stats().get("matmul_allreduce", {})
    kinds = ("one-shot", "two-shot") if road == "peer" else ("host one-shot",)
    if not all(any(k.endswith(f"via {kind}") for k in paths) for kind in kinds):
        failures.append(f"stats: {paths}")
    return failures


@pytest.mark.parametrize("p2p", ["nvlink", "no_p2p"])
def test_latency_all_reduce(p2p, monkeypatch):
    """Both roads: without P2P (NCCL_P2P_DISABLE=1) through host memory."""
    env = {"NCCL_P2P_DISABLE": "1"} if p2p == "no_p2p" else {}
    road = "peer" if p2p == "nvlink" else "host"
    _on_two_gpus(monkeypatch, _shot_cases, random.randrange(1 << 30), road, **env)


def _ce_specifics(rank, R, seed, want_route):
    """The copy-engine transport: which plans take it and by which road (``want_route``),
    its buffers growing and shrinking back between calls of one stream (epochs continue),
    and "ce" refused on a group it cannot reach (no stream memory operations)."""
    import torch.distributed as dist

    import overlap
    from overlap.context import context
    from overlap.signal import wait as signal_wait

    dev = torch.device(f"cuda:{rank}")
    failures = []
    for coll in COLLECTIVES:
        for (M, K, N), chunks, want in (
            ((2048, 1024, 2048), 4, "ce"),
            ((128, 1024, 2048), 2, "torch"),  # column bands
        ):
            x = torch.empty(M, K, device=dev, dtype=torch.bfloat16)
            w = torch.empty(K, N, device=dev, dtype=torch.bfloat16)
            got = overlap.plan(x, w, coll, chunks=chunks).transport
            if got != want:
                failures.append(f"{coll} {M}x{N}x{K} chunks={chunks}: auto took {got}, not {want}")
    road = overlap.comm.road(None, dev, False)
    if road != want_route:
        failures.append(f"route {road}, expected {want_route}")
    shapes = [(512, 256, 512), (4096, 1024, 4096), (1000, 1000, 3000), (512, 256, 512)]
    for i, shape in enumerate(shapes * 2):
        coll = COLLECTIVES[i % 3]
        dtype = (torch.bfloat16, torch.float16, torch.float32)[i % 3]
        msg = check_case(rank, R, str(dev), coll, dtype, shape, seed + i, backend="ce", chunks=4)
        failures += [msg] if msg else []
    kind = type(_ce(context(None, dev))).__name__
    if kind != {"peer": "PeerTransport", "host": "HostTransport"}[want_route]:
        failures.append(f"the calls went through {kind}")
    signal_wait._method = "spin"  # as without cuda-python: a new group gets no route
    group = dist.new_group([0, 1])
    x = torch.randn(2048, 1024, device=dev, dtype=torch.bfloat16)
    w = torch.randn(1024, 2048, device=dev, dtype=torch.bfloat16)
    p = overlap.plan(x, w, "reduce_scatter", chunks=4, group=group)
    if p.transport != "torch":
        failures.append("auto did not fall back to NCCL without a route")
    try:
        overlap.matmul_collective(x, w, "reduce_scatter", chunks=4, backend="ce", group=group)
        failures.append("backend='ce' without a route raised nothing")
    except ValueError as e:
        failures += [] if "one host" in str(e) else [f"unclear error: {e}"]
    return failures


@pytest.mark.parametrize("p2p", ["nvlink", "no_p2p"])
def test_copy_engine_transport(p2p, monkeypatch):
    env = {"NCCL_P2P_DISABLE": "1"} if p2p == "no_p2p" else {}
    route = "peer" if p2p == "nvlink" else "host"
    _on_two_gpus(monkeypatch, _ce_specifics, random.randrange(1 << 30), route, **env)


def _four_ranks(rank, R, seed, want_backend):
    """4 ranks through the default backend: the backend ``auto`` takes for each overlapped
    plan (the copy-engine transport with P2P; NCCL per chunk without it: the host road lost
    at R = 4) and every result against float64, over shapes with M divisible by 4. With
    ``x [4, 256, 1024]`` a reduce-scatter or all-to-all has 256 rows per rank, one tile row:
    decode-sized, so column bands, which the copy engines do not move (``comm.select``):
    NCCL there on both roads."""
    import overlap

    dev = torch.device(f"cuda:{rank}")
    failures = []
    for i, shape in enumerate([(2048, 4096, 4096), (1000, 1000, 3000), (4, 256, 1024, 2048)]):
        for coll in COLLECTIVES:
            dtype = (torch.bfloat16, torch.float32)[i % 2]
            x = torch.empty(*shape[:-1], device=dev, dtype=dtype)
            w = torch.empty(*shape[-2:], device=dev, dtype=dtype)
            got = overlap.plan(x, w, coll, chunks=8).transport
            want = "torch" if i == 2 and coll != "all_reduce" else want_backend
            if got != want:
                failures.append(f"{coll} {shape}: auto took {got}, not {want}")
            msg = check_case(rank, R, str(dev), coll, dtype, shape, seed + 10 * i, backend="auto",
                             chunks=8)  # fmt: skip
            failures += [msg] if msg else []
    return failures


@pytest.mark.parametrize("p2p", ["nvlink", "no_p2p"])
def test_four_gpus(p2p, monkeypatch):
    """World size 4 (a 4-GPU machine; skipped with fewer GPUs)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 4:
        pytest.skip("needs 4 CUDA GPUs")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if p2p == "no_p2p":
        monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    want = "ce" if p2p == "nvlink" else "torch"
    spawn(_four_ranks, 4, random.randrange(1 << 30), want, backend="nccl")


_TP_SIZES = (2048, 4096, 4096)  # M, K, N of _tp_inside_dp's forward calls


def _tp_inside_dp(rank, R, seed, backend, group):
    """Two tensor-parallel groups of 2 inside 4 ranks (``_dist.SUBGROUPS``: group ranks differ
    from the global ones), both at once: every collective forward (``backend``), forward and
    backward, and the all-gather with a list of two weights, against float64."""
    import torch.distributed as dist

    import overlap

    dev = f"cuda:{dist.get_rank()}" if torch.cuda.is_available() else "cpu"  # (a CPU dry run)
    m, k, n = _TP_SIZES
    failures = []
    for i, coll in enumerate(COLLECTIVES):
        msg = check_case(rank, R, dev, coll, torch.bfloat16, (m, k, n), seed + i, chunks=4,
                         backend=backend, group=group)  # fmt: skip
        failures += [f"{coll}: {msg}"] if msg else []
        case = (coll, torch.bfloat16, (2, m // 2, k // 2, n // 2), "sum")
        msg = check_grad_case(rank, R, dev, case, seed + 10 + i, chunks=2, group=group)
        failures += [f"{coll} backward: {msg}"] if msg else []
    g = torch.Generator().manual_seed(seed + 99)
    shards = [torch.randn(m // 2, k // 2, generator=g) for _ in range(R)]
    w = torch.randn(k // 2, 3 * n // 4, generator=g) / (k // 2) ** 0.5
    ws = [w[:, : n // 4].to(dev, torch.bfloat16), w[:, n // 4 :].to(dev, torch.bfloat16)]
    got = overlap.all_gather_matmul(shards[rank].to(dev, torch.bfloat16), ws, group=group,
                                    backend=backend)  # fmt: skip
    ref = torch.cat(shards).double() @ w.double()
    for part, want in zip(got, (ref[:, : n // 4], ref[:, n // 4 :]), strict=True):
        why = mismatch(part, want.to(dev), TOL[torch.bfloat16])
        failures += [f"all_gather_matmul: {why}"] if why else []
    return failures


@pytest.mark.parametrize("p2p", ["nvlink", "no_p2p"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_four_gpus_tp_inside_dp(backend, p2p, monkeypatch):
    """Tensor-parallel groups inside TP x DP on 4 GPUs (group ranks differ from global ones),
    the copy engines' two roads (``auto``) and NCCL per chunk (skipped with fewer GPUs)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 4:
        pytest.skip("needs 4 CUDA GPUs")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if p2p == "no_p2p":
        monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    spawn(on_subgroups, 4, _tp_inside_dp, random.randrange(1 << 30), backend, backend="nccl")


@pytest.mark.parametrize("wait", ["spin", "stream_wait"])
def test_wait_methods_and_many_chunks(wait, monkeypatch):
    """Both stream-wait implementations, with the most chunks the planner allows."""
    _on_two_gpus(monkeypatch, _repeat, random.randrange(1 << 30), wait)


def _repeat(rank, R, seed, wait):
    from overlap.signal import method
    from overlap.signal import wait as signal_wait

    signal_wait._method = wait  # as where stream memory operations are missing (spin)
    failures = []
    for i in range(20):
        coll = COLLECTIVES[i % 3]
        msg = check_case(
            rank, R, f"cuda:{rank}", coll, torch.bfloat16, (4096, 1024, 4096), seed + i, chunks=8
        )
        failures += [msg] if msg else []
    if method() != wait:
        failures.append(f"wait method {method()}, asked for {wait}")
    return failures


def _streams_specials(rank, R, seed):
    import torch.distributed as dist

    import overlap

    dev = torch.device(f"cuda:{rank}")
    failures = []
    for j, coll in enumerate(COLLECTIVES):
        for dtype in DTYPES:
            msg = check_case(
                rank, R, str(dev), coll, dtype, (512, 256, 512), seed + 10 + j, chunks=2,
                specials=True,
            )  # fmt: skip
            failures += [msg] if msg else []
    # Two models on two caller streams, calls in flight at once (no sync until the end).
    g = torch.Generator(device=dev).manual_seed(seed + rank)
    models = [
        torch.randn(1024, 3072, device=dev, generator=g, dtype=torch.bfloat16) / 32,
        torch.randn(3072, 2048, device=dev, generator=g, dtype=torch.bfloat16) / 32,
    ]
    xs = [torch.randn(4096, 1024, device=dev, generator=g, dtype=torch.bfloat16),
          torch.randn(4096, 3072, device=dev, generator=g, dtype=torch.bfloat16)]  # fmt: skip
    streams = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream(dev))
    outs = [[], []]
    for _ in range(5):
        for k, coll in enumerate(("all_reduce", "reduce_scatter")):
            with torch.cuda.stream(streams[k]):
                outs[k].append(overlap.matmul_collective(xs[k], models[k], coll, chunks=4))
    torch.cuda.synchronize(dev)
    for k, coll in enumerate(("all_reduce", "reduce_scatter")):
        prod = xs[k].float() @ models[k].float()
        if coll == "all_reduce":
            dist.all_reduce(prod)
            ref = prod
        else:
            ref = torch.empty(prod.shape[0] // R, prod.shape[1], device=dev)
            dist.reduce_scatter_tensor(ref, prod)
        for i, o in enumerate(outs[k]):
            why = mismatch(o, ref, TOL[torch.bfloat16])
            failures += [f"stream {k} {coll} call {i}: {why}"] if why else []
    return failures


def test_streams_and_specials(monkeypatch):
    _on_two_gpus(monkeypatch, _streams_specials, random.randrange(1 << 30))


@pytest.mark.parametrize(
    "scenario",
    [
        "disagree",
        "never_arrives",
        "killed_mid_call",
        "killed_mid_call_ce",
        "killed_mid_gather",
        "killed_mid_split",
        "killed_mid_grouped",
        "killed_mid_dispatch",
        "killed_mid_bags",
    ],
)
def test_faults_raise_instead_of_hanging(scenario, monkeypatch):
    """The gloo scenarios of test_reliability.py on NCCL (validation mode's watch aborts the
    communicator when a peer died mid-call)."""
    # torch's watchdog would end the process after our abort; we want to see our error
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    _on_two_gpus(monkeypatch, fault_scenarios, scenario, "cuda", **env)


@pytest.mark.parametrize("p2p", ["nvlink", "no_p2p"])
@pytest.mark.parametrize("scenario", ["killed_mid_call_ce_off", "killed_mid_gather_ce_off",
                                      "stuck_ce_off", "killed_mid_call_shot_off",
                                      "stuck_shot_off"])  # fmt: skip
def test_watchdog_copy_engines(scenario, p2p, monkeypatch):
    """Validation off, a peer dead or stopped on either copy-engine road, or in the latency
    all-reduce on either road: the watchdog makes the survivor raise within the group's
    timeout (``_dist._watchdog_scenario``)."""
    env = {"NCCL_P2P_DISABLE": "1"} if p2p == "no_p2p" else {}
    _on_two_gpus(monkeypatch, fault_scenarios, scenario, "cuda", **env)


@pytest.mark.parametrize("p2p", ["nvlink", "no_p2p"])
def test_validation_watches_latency_all_reduce(p2p, monkeypatch):
    """Validation on, a peer dead before its reduction in the latency all-reduce on either
    road: the watch aborts the transport and the survivor raises (``_dist``'s
    ``killed_mid_call_shot``)."""
    env = {"NCCL_P2P_DISABLE": "1"} if p2p == "no_p2p" else {}
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    _on_two_gpus(monkeypatch, fault_scenarios, "killed_mid_call_shot", "cuda", **env)


@pytest.mark.parametrize("scenario", ["stuck_nccl_off", "killed_mid_call_nccl_off",
                                      "killed_mid_split_nccl_off"])  # fmt: skip
def test_nccl_validation_off_ends_the_survivor(scenario, monkeypatch):
    """Validation off, NCCL per chunk (and every uneven exchange but CuPy's): a peer dead or
    stopped ends the survivor's process through torch's own watchdog within the group's
    timeout (its default error handling tears the process down, as for plain torch code); no
    hang (``_dist._nccl_off_scenario``)."""
    import time

    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("NCCL_ASYNC_ERROR_HANDLING", raising=False)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="process 0 terminated with"):
        _on_two_gpus(monkeypatch, fault_scenarios, scenario, "cuda")
    assert time.monotonic() - t0 < 100, f"rank 0 ended only after {time.monotonic() - t0:.0f} s"


def _reference(coll: str, x: torch.Tensor, w: torch.Tensor, R: int) -> torch.Tensor:
    """float64 ``collective(x @ w)`` through torch.distributed."""
    import torch.distributed as dist

    prod = x.double().reshape(-1, x.shape[-1]) @ w.double()
    if coll == "all_reduce":
        dist.all_reduce(prod)
        return prod.reshape(*x.shape[:-1], -1)
    if coll == "reduce_scatter":
        out = prod.new_empty(prod.shape[0] // R, prod.shape[1])
        dist.reduce_scatter_tensor(out, prod)
        return out
    out = torch.empty_like(prod)
    dist.all_to_all_single(out, prod)
    return out.reshape(*x.shape[:-1], -1)


def _graphs(rank, R, seed, backend):
    """Overlapped calls captured in one CUDA graph and replayed on fresh inputs: every replay
    must wait for its own tiles (the graph zeroes its counters), eager calls between replays
    must keep working, and outputs start as NaN before each replay. Plain-path calls captured
    on the stream of their eager warm-up (the memo answers them there) replay too."""
    import overlap

    dev = torch.device(f"cuda:{rank}")
    g = torch.Generator(device=dev).manual_seed(seed + rank)
    failures = []
    # (collective, x shape, w shape [K, N], chunks): row bands, then column bands (decode).
    cases = [(c, (2048, 1024), (1024, 2048), 4) for c in COLLECTIVES]
    cases += [(c, (128, 4096), (4096, 4096), 2) for c in COLLECTIVES]
    xs = [torch.empty(xs_, device=dev, dtype=torch.bfloat16) for _, xs_, _, _ in cases]
    ws = [torch.randn(ws_, device=dev, generator=g, dtype=torch.bfloat16) / 32
          for _, _, ws_, _ in cases]  # fmt: skip
    outs = [torch.empty(x.shape[0] // (R if c == "reduce_scatter" else 1), w.shape[1],
                        device=dev, dtype=torch.bfloat16)
            for (c, *_), x, w in zip(cases, xs, ws, strict=True)]  # fmt: skip

    # small products without out=: the plain path, which the warm-up's second call takes from
    # the calls' memo (plain_again) and the capture on the same stream too
    small = [(c, torch.empty(16 * R, 64, device=dev, dtype=torch.bfloat16),
              torch.randn(64, 32, device=dev, generator=g, dtype=torch.bfloat16) / 8)
             for c in COLLECTIVES]  # fmt: skip

    def calls():
        for (coll, _, _, chunks), x, w, out in zip(cases, xs, ws, outs, strict=True):
            overlap.matmul_collective(x, w, coll, out=out, chunks=chunks, backend=backend)
        return [overlap.matmul_collective(x, w, coll, backend=backend) for coll, x, w in small]

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up: kernels compiled, communicators made
        for x in [*xs, *(x for _, x, _ in small)]:
            x.normal_(generator=g)
        calls()
        calls()
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        got = calls()
    for replay in range(3):
        for x, out in zip(xs, outs, strict=True):
            x.normal_(generator=g)
            out.fill_(float("nan"))
        for (_, x, _), y in zip(small, got, strict=True):
            x.normal_(generator=g)
            y.fill_(float("nan"))
        graph.replay()
        results = [(coll, x, w, out) for (coll, *_), x, w, out in zip(cases, xs, ws, outs,
                   strict=True)] + [(*c, y) for c, y in zip(small, got, strict=True)]  # fmt: skip
        for coll, x, w, out in results:
            why = mismatch(out, _reference(coll, x, w, R), TOL[torch.bfloat16])
            failures += [f"replay {replay} {coll} {tuple(x.shape)}: {why}"] if why else []
        msg = check_case(  # an eager call between replays: its counters are untouched
            rank, R, str(dev), COLLECTIVES[replay], torch.bfloat16, (1024, 512, 1024),
            seed + replay, chunks=4, backend=backend,
        )  # fmt: skip
        failures += [msg] if msg else []
    return failures


@pytest.mark.parametrize("backend", ["torch", "cupy", "auto"])  # auto: the copy engines,
def test_cuda_graph_capture_and_replay(backend, monkeypatch):  # captured too
    if backend == "cupy":
        pytest.importorskip("cupy")
    _on_two_gpus(monkeypatch, _graphs, random.randrange(1 << 30), backend)


def _grads(rank, R, seed):
    failures = []
    for i, coll in enumerate(COLLECTIVES):
        for j, (dtype, shape, chunks) in enumerate(
            ((torch.bfloat16, (1024, 512, 1024), 4), (torch.float32, (512, 256, 512), 2),
             (torch.bfloat16, (128, 1024, 2048), None))
        ):  # fmt: skip
            case = (coll, dtype, shape, "sum")
            msg = check_grad_case(rank, R, f"cuda:{rank}", case, seed + 10 * i + j, chunks=chunks)
            failures += [msg] if msg else []
    return failures


def test_backward_two_gpus(monkeypatch):
    """Autograd through the overlapped forward (and the planner's plain path for M = 128)."""
    _on_two_gpus(monkeypatch, _grads, random.randrange(1 << 30))


def _launch_memo(rank, R, seed):
    """Launches that skip Triton's JIT (``matmul._launch``, a ``gemm.launch.Launcher``): every
    product right on fresh data,
    and the kernel taken from the memo always the one Triton itself would pick."""
    from test_kernel import _standard
    from triton import knobs
    from triton.runtime.jit import compute_cache_key

    from overlap.contract import Epilogue
    from overlap.gemm import chunked_matmul
    from overlap.gemm import matmul as mm
    from overlap.plan import make_plan

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    seen, failures = [], []
    real = mm._launch

    def spy(grid, a, warps, stages):
        k = real(grid, a, warps, stages)
        kern = mm._chunked_matmul_kernel
        cache, key_cache, _, _, binder = kern.device_caches[torch.cuda.current_device()]
        mode = knobs.compilation.instrumentation_mode  # the JIT's run adds these two
        _, spec, opts = binder(**a, num_warps=warps, num_stages=stages,
                               debug=kern.debug or knobs.runtime.debug,
                               instrumentation_mode=mode)  # fmt: skip
        seen.append(cache.get(compute_cache_key(key_cache, spec, opts)) is k)
        return k

    mm._launch = spy
    # (M, N, K, dtype, x column offset): the offset misaligns x's rows (pointer loads).
    cases = [(1024, 768, 512, torch.bfloat16, 0), (1024, 768, 512, torch.bfloat16, 0),
             (1024, 768, 512, torch.bfloat16, 1), (1000, 520, 264, torch.float16, 0),
             (1024, 768, 512, torch.bfloat16, 0), (1024, 768, 512, torch.float32, 0),
             (1000, 520, 264, torch.float16, 0)]  # fmt: skip
    for i, (M, N, K, dtype, off) in enumerate(cases):
        bits = 8 * dtype.itemsize
        p = make_plan(M, N, K, world_size=2, collective="all_reduce", dtype_bits=bits, chunks=4)
        x = torch.randn(M, K + off, device=dev, generator=g).to(dtype)[:, off:]
        w = torch.randn(N, K, device=dev, generator=g).to(dtype).t()
        flat = torch.full((M * N,), float("nan"), device=dev, dtype=dtype)
        cnt = torch.zeros(p.n_chunks, device=dev, dtype=torch.int32)
        chunked_matmul(x, w, flat, cnt, p)
        why = mismatch(_standard(p, flat.cpu()), (x.double() @ w.double()).cpu(), TOL[dtype])
        if why or cnt.tolist() != list(p.tiles_per_chunk):
            failures.append(f"case {i} {cases[i]}: {why or 'counters'}")
    # The copy-engine epilogue, twice (second launch from the memo): own block + partials.
    M, N, K = 1024, 768, 512
    bp = make_plan(M, N, K, world_size=2, collective="reduce_scatter", dtype_bits=16,
                   blocked=True, chunks=4)  # fmt: skip
    for i in range(2):
        x = torch.randn(M, K, device=dev, generator=g, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=dev, generator=g, dtype=torch.bfloat16).t()
        recv = torch.randn(2, M // 2, N, device=dev, generator=g, dtype=torch.bfloat16)
        out = torch.full((M // 2, N), float("nan"), device=dev, dtype=torch.bfloat16)
        flags = torch.ones(64, device=dev, dtype=torch.int32)  # every peer's band pushed
        cnt = torch.zeros(bp.n_chunks, device=dev, dtype=torch.int32)
        chunked_matmul(x, w, torch.empty(M * N, device=dev, dtype=torch.bfloat16), cnt, bp,
                       epilogue=Epilogue(out, recv, flags, 0))  # fmt: skip
        ref = (x.double() @ w.double())[: M // 2] + recv[1].double()
        why = mismatch(out, ref, TOL[torch.bfloat16])
        failures += [f"fused launch {i}: {why}"] if why else []
    mm._launch = real
    if not all(seen):
        failures.append(f"memo's kernel is not Triton's choice at launches {seen}")
    if len(mm._launch.compiled) != 5:  # 4 plain specializations (two bf16 repeats), 1 fused
        failures.append(f"{len(mm._launch.compiled)} memo entries, expected 5")
    return failures


def test_launch_memo_one_gpu(monkeypatch):
    """One GPU: the launches that bypass Triton's JIT after the first."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    spawn(_launch_memo, 1, random.randrange(1 << 30))


def _on_host_road(monkeypatch, fn) -> None:
    """``fn`` on two ranks sharing GPU 0 over gloo, the copy engines taking the host road."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    spawn(fn, 2, random.randrange(1 << 30))


def _host_road_one_gpu(rank, R, seed):
    """2 ranks on GPU 0 over gloo: the copy-engine transport's road through host memory, with
    the real fused kernel (the GPU is time-sliced between the two processes). Row-band plans
    only: others fall back to the group's collectives, and gloo has no all-to-all."""
    import overlap
    from overlap.comm import HostTransport
    from overlap.context import contexts

    torch.cuda.set_device(0)
    failures = []
    i = 0
    for coll in COLLECTIVES:
        for dtype in DTYPES:
            for shape in ((2048, 4096, 4096), (1000, 1000, 3000), (4, 256, 1024, 2048)):
                i += 1
                msg = check_case(rank, R, "cuda:0", coll, dtype, shape, seed + i, backend="ce",
                                 chunks=4)  # fmt: skip
                failures += [msg] if msg else []
        msg = check_case(rank, R, "cuda:0", coll, torch.bfloat16, (1024, 256, 768), seed + 99,
                         backend="ce", chunks=2, specials=True)  # fmt: skip
        failures += [msg] if msg else []
    roads = [type(_ce(c)).__name__ for c in contexts()]
    if not roads or any(r != HostTransport.__name__ for r in roads):
        failures.append(f"transports of the calls' contexts: {roads}, expected the host road")
    # overlap.release frees the pinned shared memory and the device slots; calls go on after
    transports = [_ce(c) for c in contexts() if _ce(c) is not None]
    if not all(t.nbytes > 0 for t in transports):
        failures.append("a host-road transport holds no memory after its calls")
    overlap.release()
    if contexts() or any(t.mapping is not None or t.nbytes for t in transports):
        failures.append("overlap.release kept a context or a transport's memory")
    msg = check_case(rank, R, "cuda:0", "all_reduce", torch.bfloat16, (1024, 256, 768),
                     seed + 200, backend="ce", chunks=2)  # fmt: skip
    return failures + ([msg] if msg else [])


def test_host_road_one_gpu(monkeypatch):
    """One GPU: two ranks through the copy-engine transport's host road (``NCCL_P2P_DISABLE``),
    every collective and dtype against float64. What a 1-GPU machine can check of it."""
    _on_host_road(monkeypatch, _host_road_one_gpu)


def _host_shot_one_gpu(rank, R, seed):
    """2 ranks on GPU 0 over gloo, no P2P: the library's latency all-reduce through the pinned
    host buffer (``gemm/shot.py``; the two processes' kernels wait for each other across time
    slices): every float dtype, ragged sizes, a 3-D x, ``avg``, ``out=`` (poisoned with NaN),
    calls back to back with gloo ones between, and a CUDA graph whose replays see new data;
    each against float64 from every rank's inputs (drawn alike on both ranks), the ranks'
    results equal in bits."""
    import torch.distributed as dist

    import overlap
    from overlap.comm import shot

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    failures = []

    def draw(i, shape, dtype):  # every rank's tensor of shape, alike on every rank
        g = torch.Generator(device=dev).manual_seed(seed + i)
        return torch.randn(R, *shape, device=dev, dtype=dtype, generator=g)

    def check(what, y, xs, w, op="sum"):
        ref = sum(a.double().reshape(-1, a.shape[-1]) @ w.double() for a in xs)
        ref = ref / R if op == "avg" else ref
        why = mismatch(y.reshape(ref.shape), ref, TOL[y.dtype])
        if why:
            failures.append(f"{what}: {why}")
        ys = [torch.empty(y.shape, dtype=y.dtype) for _ in range(R)]
        dist.all_gather(ys, y.cpu())
        if not all(torch.equal(ys[0], t) for t in ys):
            failures.append(f"{what}: the ranks' results differ in bits")

    def took():
        return overlap.stats().get("matmul_allreduce", {}).get("plain via host one-shot", 0)

    i = 0
    for dt in DTYPES:
        for m, k, n in ((16, 256, 4096), (3, 100, 12345), (64, 128, 4096), (1, 64, 1 << 19)):
            i += 1
            xs = draw(i, (m, k), dt)
            w = draw(i + 1000, (k, n), dt)[0] / k**0.5
            want = shot.kind(m * n * xs.element_size(), dt, "host", R)
            before = took()
            for _ in range(2):  # (the first makes the transport: a collective)
                check(f"{(dt, m, k, n)}", overlap.matmul_allreduce(xs[rank], w), xs, w)
            if (took() - before == 2) != (want == "host one-shot"):
                failures.append(f"{(dt, m, k, n)}: {took() - before} of 2 calls took the host "
                                f"one-shot, want {want}")  # fmt: skip

    def one(what, xs, w, **kw):  # one call that must take the host one-shot, checked
        before = took()
        y = overlap.matmul_allreduce(xs[rank], w, **kw)
        check(what, kw["out"] if "out" in kw else y, xs, w, kw.get("op", "sum"))
        if took() - before != 1:
            failures.append(f"{what}: the call did not take the host one-shot")

    xs = draw(50, (2, 5, 512), torch.bfloat16)
    w = draw(51, (512, 4096), torch.bfloat16)[0] / 512**0.5
    one("3-D x", xs, w)
    one("avg", xs, w, op="avg")
    one("out=", xs, w, out=torch.full((2, 5, 4096), float("nan"), device=dev,
                                       dtype=torch.bfloat16))  # fmt: skip
    odd = torch.full((2 * 5 * 4096 + 1,), float("nan"), device=dev, dtype=torch.bfloat16)
    one("out= not 16-byte aligned", xs, w, out=odd[1:].view(2, 5, 4096))  # (its own kernel)
    one("a bound launch after it", xs, w)
    from overlap.gemm.launch import Launcher

    real, through = Launcher.__call__, []
    Launcher.__call__ = lambda self, *a, **k: (through.append(1), real(self, *a, **k))[1]
    try:  # (this shape's launch is bound: its calls skip Launcher, gemm.shot.HostShot)
        for j in range(3):
            one(f"bound #{j}", draw(52 + j, (2, 5, 512), torch.bfloat16), w)
    finally:
        Launcher.__call__ = real
    if through:
        failures.append(f"{len(through)} of 3 calls of a bound shape launched through Launcher")
    # back to back, fresh data at every call: the host one-shot and gloo (too big for the
    # slots) alternating
    w = draw(60, (1024, 4096), torch.bfloat16)[0] / 32
    xss = [draw(61 + j, (m, 1024), torch.bfloat16) for j, m in enumerate((16, 2048, 32, 128) * 3)]
    ys = [overlap.matmul_allreduce(a[rank], w) for a in xss]
    for j, y in enumerate(ys):
        check(f"back to back #{j}", y, xss[j], w)
    # captured: the graph's replays read new data
    x = torch.empty(16, 1024, device=dev, dtype=torch.bfloat16)
    x.copy_(draw(70, (16, 1024), torch.bfloat16)[rank])
    overlap.matmul_allreduce(x, w)  # (warm-up)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    graph = torch.cuda.CUDAGraph()
    before = took()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        y = overlap.matmul_allreduce(x, w)
    if took() - before != 1:
        failures.append("captured: the call did not take the host one-shot")
    for r in range(3):
        xs = draw(71 + r, (16, 1024), torch.bfloat16)
        x.copy_(xs[rank])
        y.fill_(float("nan"))
        graph.replay()
        check(f"replay {r}", y, xs, w)
    from overlap.comm.shot import HostShotTransport
    from overlap.state import states

    made = [t for s in states() for t in s.shared.values()
            if isinstance(t, HostShotTransport)]  # fmt: skip
    overlap.release()
    if len(made) != 1 or any(t.mapping is not None or t.nbytes for t in made):
        failures.append(f"overlap.release kept the host one-shot's memory ({len(made)} made)")
    return failures


def test_host_latency_all_reduce_one_gpu(monkeypatch):
    """One GPU: the latency all-reduce without P2P between two processes, with the real
    kernel (what a 1-GPU machine can check of it)."""
    _on_host_road(monkeypatch, _host_shot_one_gpu)


def _compile_one_gpu(rank, R, seed):
    """2 ranks on GPU 0 over gloo: ``torch.compile(fullgraph=True)`` of an all-reduce call with
    autograd, through the copy engines' host road, forward and backward against float64 (the
    backward of an all-reduce has no collective, which gloo could not run on CUDA tensors)."""
    torch.cuda.set_device(0)

    @torch.compile(fullgraph=True)
    def call(x, w, collective, op, chunks):
        import overlap

        return overlap.matmul_collective(2 * x, w, collective, op=op, chunks=chunks) / 2

    failures = []
    for i, (dtype, shape) in enumerate(((torch.bfloat16, (1024, 512, 1024)),
                                        (torch.float32, (4, 128, 256, 512)))):  # fmt: skip
        case = ("all_reduce", dtype, shape, "sum")
        msg = check_grad_case(rank, R, "cuda:0", case, seed + i, chunks=4, call=call)
        failures += [msg] if msg else []
    from overlap.context import contexts

    if not any(_ce(c) is not None for c in contexts()):
        failures.append("no call went through the copy engines")
    return failures


def test_compile_host_road_one_gpu(monkeypatch):
    """One GPU: the custom op under torch.compile and autograd, with the real kernel."""
    _on_host_road(monkeypatch, _compile_one_gpu)


def _gather_one_gpu(rank, R, seed):
    """2 ranks on GPU 0 over gloo: ``all_gather_matmul`` through the copy engines' host road
    (pushes to pinned host memory, the caller stream waiting on each band's flag), forward
    in every dtype with ``x_full``, and a backward whose input gradient is the overlapped
    ``matmul_reduce_scatter`` (host road too), against float64 on the GPU."""
    import overlap

    torch.cuda.set_device(0)
    dev = "cuda:0"
    failures = []
    for i, (dtype, lead, K, N) in enumerate(
        (d, lead, K, N)
        for d in DTYPES
        for lead, K, N in (((1024,), 1024, 3000), ((2, 500), 768, 1000))  # fmt: skip
    ):
        g = torch.Generator().manual_seed(seed + i)
        xs = [torch.randn(*lead, K, generator=g).to(dtype).to(dev) for _ in range(R)]
        w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype).to(dev)
        full_ref = torch.cat([x.reshape(-1, K) for x in xs]).double()
        ref = full_ref @ w.double().t()
        name = f"all_gather {dtype} {lead} K={K} N={N} rank {rank}"
        p = overlap.plan(xs[rank], w.t(), "all_gather", chunks=4)
        if p.transport != "ce":
            failures.append(f"{name}: {p.describe()}")
        out = torch.full(ref.shape, float("nan"), dtype=dtype, device=dev)
        for call in range(2):  # the second call reuses the buffers after the handshake
            out.fill_(float("nan"))
            y, full = overlap.all_gather_matmul(xs[rank], w.t(), out=out, chunks=4,
                                                return_gathered=True)  # fmt: skip
            for what, got, want in (("y", y, ref), ("x_full", full, full_ref)):
                why = mismatch(got, want, TOL[dtype])
                failures += [f"{name} call {call}: {what}: {why}"] if why else []
    # backward: big enough for the default plans to overlap (2 M N K > MIN_OVERLAP_FLOPS), so
    # no plain reduce-scatter (which gloo cannot run on CUDA tensors)
    g = torch.Generator().manual_seed(seed + 100)
    m, K, N = 2048, 8192, 4096
    xs = [torch.randn(m, K, generator=g).to(dev, torch.bfloat16) for _ in range(R)]
    ws = [(torch.randn(N, K, generator=g) / K**0.5).to(dev, torch.bfloat16) for _ in range(R)]
    gs = [torch.randn(R * m, N, generator=g).to(dev, torch.bfloat16) for _ in range(R)]
    X = torch.cat(xs).double()
    dx_ref = sum(gs[r].double() @ ws[r].double() for r in range(R))[rank * m : (rank + 1) * m]
    dw_ref = gs[rank].double().t() @ X
    x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    (overlap.all_gather_matmul(x, w.t()) * gs[rank]).sum().backward()
    for what, got, want in (("dx", x.grad, dx_ref), ("dw", w.grad, dw_ref)):
        why = mismatch(got, want, TOL[torch.bfloat16])
        failures += [f"all_gather backward {what} rank {rank}: {why}"] if why else []
    return failures


def test_all_gather_host_road_one_gpu(monkeypatch):
    """One GPU: ``all_gather_matmul`` and its backward through the host road."""
    _on_host_road(monkeypatch, _gather_one_gpu)


def _uneven_one_gpu(rank, R, seed):
    """2 ranks on GPU 0 over gloo: the uneven all-to-all, the MoE combine and dispatch and the
    embedding-bag all-to-all on CUDA tensors (their producers on the caller stream, an
    event per chunk, the exchanges on the communication stream), against float64."""
    import torch.nn.functional as F

    import overlap

    torch.cuda.set_device(0)
    dev, failures = "cuda:0", []
    g = torch.Generator().manual_seed(seed)
    S = [[300, 1000], [0, 700]]  # rows rank a sends rank b
    sends, receives = S[rank], [S[a][rank] for a in range(R)]
    K, N, E = 512, 768, 3
    xs = [torch.randn(sum(S[a]), K, generator=g).to(dev, torch.bfloat16) for a in range(R)]
    ws = [(torch.randn(E, K, N, generator=g) / K**0.5).to(dev, torch.bfloat16) for _ in range(R)]
    kw = dict(input_split_sizes=sends, output_split_sizes=receives, chunks=4)

    def take(blocks, b):  # rank b's received rows, block a from rank a
        return torch.cat([blocks[a][sum(S[a][:b]) : sum(S[a][: b + 1])] for a in range(R)])

    ids_x = [torch.randint(0, E, (sum(S[a]),), generator=g).sort().values for a in range(R)]
    ids_r = [torch.randint(0, E, (sum(S[a][b] for a in range(R)),), generator=g) for b in range(R)]
    X = [x.double() for x in xs]
    W = [w.double() for w in ws]
    per_row = lambda x, w, ids: torch.stack([x[i] @ w[ids[i]] for i in range(len(ids))])  # noqa: E731
    x, w = xs[rank], ws[rank]
    combine = overlap.grouped_matmul_all_to_all(x, w, ids_x[rank].to(dev), **kw)
    dispatch = overlap.all_to_all_grouped_matmul(x, w, ids_r[rank].to(dev), **kw)
    checks = {
        "uneven": (overlap.matmul_all_to_all(x, w[0], **kw),
                   take([X[a] @ W[a][0] for a in range(R)], rank)),
        "combine": (combine, take([per_row(X[a], W[a], ids_x[a]) for a in range(R)], rank)),
        "dispatch": (dispatch, per_row(take(X, rank), W[rank], ids_r[rank])),
    }  # fmt: skip
    tables = [torch.randn(5000, 64 * (1 + r), generator=g).to(dev) for r in range(R)]
    sizes = [torch.randint(0, 6, (2048,), generator=g) for _ in range(R)]
    idx = [torch.randint(0, 5000, (int(s.sum()),), generator=g) for s in sizes]
    off = [torch.cumsum(s, 0) - s for s in sizes]
    got = overlap.embedding_bag_all_to_all(
        [tables[rank]], [idx[rank].to(dev)], [off[rank].to(dev)], rank_dims=[64, 128], chunks=3
    )
    pooled = [F.embedding_bag(idx[r].to(dev), tables[r].double(), off[r].to(dev), mode="sum")
              for r in range(R)]  # fmt: skip
    checks["embedding"] = (got, torch.cat([p[rank * 1024 : (rank + 1) * 1024] for p in pooled], 1))
    for name, (got, want) in checks.items():
        why = mismatch(got, want, TOL[got.dtype])
        failures += [f"{name} rank {rank}: {why}"] if why else []
    return failures


def test_uneven_ops_one_gpu(monkeypatch):
    """One GPU: the uneven all-to-all and the MoE and embedding ops on CUDA tensors."""
    _on_host_road(monkeypatch, _uneven_one_gpu)


def _two_groups_one_gpu(rank, R, seed, rounds=40):
    """2 ranks on GPU 0 over gloo, two groups of both ranks (the default one and a second),
    each with its own copy-engine transport (host road): reduce-scatter calls of each group on
    a stream of its own, issued back to back so that the two groups' calls run at once, and
    repeated, so that from the second round on both replay recorded graphs. Each round's
    results against float64. The graphs of two groups must not share a memory pool: a
    temporary freed at the end of one group's capture (its slots, its counters) would be the
    other group's too, and the two calls would write into each other's."""
    import torch.distributed as dist

    import overlap
    from overlap.context import records

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    dt, M, K, N = torch.bfloat16, 1024, 512, 1024
    groups = [None, dist.new_group(list(range(R)))]
    streams = [torch.cuda.Stream(dev) for _ in groups]
    gw = torch.Generator(device=dev).manual_seed(seed)
    ws = [torch.randn(K, N, device=dev, generator=gw, dtype=dt) / 16 for _ in groups]
    xs = [torch.empty(M, K, device=dev, dtype=dt) for _ in groups]
    outs = [torch.empty(M // R, N, device=dev, dtype=dt) for _ in groups]
    failures = []
    for i in range(rounds):
        g = torch.Generator(device=dev).manual_seed(seed + 1 + i)
        every = [torch.randn(R, M, K, device=dev, generator=g, dtype=dt) for _ in groups]
        for x, out, e in zip(xs, outs, every, strict=True):
            x.copy_(e[rank])
            out.fill_(float("nan"))
        for s in streams:
            s.wait_stream(torch.cuda.current_stream(dev))
        for group, s, x, w, out in zip(groups, streams, xs, ws, outs, strict=True):
            with torch.cuda.stream(s):
                overlap.matmul_collective(x, w, "reduce_scatter", group=group, out=out,
                                          chunks=4, backend="ce")  # fmt: skip
        torch.cuda.synchronize(dev)
        B = M // R
        for j, (w, out, e) in enumerate(zip(ws, outs, every, strict=True)):
            ref = (e.double() @ w.double()).sum(0)[rank * B : (rank + 1) * B]
            why = mismatch(out, ref, TOL[dt])
            failures += [f"round {i} group {j}: {why}"] if why else []
        if len(failures) > 6:
            break
    pools = {r.ctx.group: r.graph.pool() for r in records.values() if r.graph is not None}
    if len(pools) != 2 or len(set(pools.values())) != 2:
        failures.append(f"recorded graphs' pools by group: {pools}, expected two, distinct")
    return failures


def test_recorded_calls_of_two_groups_one_gpu(monkeypatch):
    """One GPU: two groups' recorded copy-engine calls running at once on two streams."""
    _on_host_road(monkeypatch, _two_groups_one_gpu)


def _graph_host_road_one_gpu(rank, R, seed, replays=10_000):
    """2 ranks on GPU 0 over gloo: every op through the copy engines' host road captured in
    one CUDA graph and replayed ``replays`` times on fresh inputs, each replay against float64;
    eager calls of the same ops between replays (they share the transport's buffers and
    flags; from their second time on, replays of their own recorded graphs); then, after
    ``overlap.release``, ``torch.compile(mode="reduce-overhead")`` of a call (the transport
    made in its warm-up). Inputs are drawn from a generator
    both ranks seed alike, so each rank computes every rank's product itself (gloo cannot
    reduce CUDA tensors inside a check)."""
    import overlap
    from overlap.context import contexts

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    dt = torch.bfloat16
    M, K, N = 1024, 256, 512
    gw = torch.Generator(device=dev).manual_seed(seed)
    w = torch.randn(K, N, device=dev, generator=gw, dtype=dt) / 16  # the same on both ranks
    x = torch.empty(M, K, device=dev, dtype=dt)
    xs = torch.empty(M // R, K, device=dev, dtype=dt)  # the all-gather's shard
    outs = {c: torch.empty(M // R if c == "reduce_scatter" else M, N, device=dev, dtype=dt)
            for c in COLLECTIVES}  # fmt: skip
    outs["all_gather"] = torch.empty(M, N, device=dev, dtype=dt)

    def calls():
        for c in COLLECTIVES:
            overlap.matmul_collective(x, w, c, out=outs[c], chunks=4, backend="ce")
        overlap.all_gather_matmul(xs, w, out=outs["all_gather"], chunks=4, backend="ce")

    def draw(i):  # every rank's x and shard of step i, then this rank's into the inputs
        g = torch.Generator(device=dev).manual_seed(seed + 1 + i)
        every = torch.randn(R, M, K, device=dev, generator=g, dtype=dt)
        x.copy_(every[rank])
        xs.copy_(every[rank, : M // R])
        for out in outs.values():
            out.fill_(float("nan"))
        return every.double()

    def check(every, when):
        prods = every @ w.double()  # [R, M, N]
        B = M // R
        refs = {
            "all_reduce": prods.sum(0),
            "reduce_scatter": prods.sum(0)[rank * B : (rank + 1) * B],
            "all_to_all": prods[:, rank * B : (rank + 1) * B].reshape(M, N),
            "all_gather": every[:, : M // R].reshape(M, K) @ w.double(),
        }
        bad = []
        for c, ref in refs.items():
            why = mismatch(outs[c], ref, TOL[dt])
            bad += [f"{when} {c}: {why}"] if why else []
        return bad

    failures = []
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up: kernels compiled, the transport's buffers sized
        every = draw(-1)
        calls()
        failures += check(every, "warm-up")
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    captured = [{cls.name for cls in c._transports} for c in contexts()]
    if any(t != {"ce"} for t in captured):
        failures.append(f"transports used by the contexts: {captured}, expected only 'ce'")
    for i in range(replays):
        every = draw(i)
        graph.replay()
        failures += check(every, f"replay {i}")
        if i % 1000 == 999:  # eager calls between replays, on the caller's stream
            every = draw(replays + i)
            calls()
            failures += check(every, f"eager after replay {i}")
        if len(failures) > 8:
            break
    torch.cuda.synchronize(dev)
    from overlap.context import records

    if not any(r.graph is not None for r in records.values()):
        failures.append("no eager call was replayed from its recorded graph (ops._recorded)")

    # the group's first call (road, transport, buffers) inside reduce-overhead's warm-up
    overlap.release()
    import torch._inductor.config as inductor_config

    inductor_config.triton.cudagraph_trees_history_recording = True  # (origins, if it fails)

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def compiled(a, b):
        return overlap.matmul_allreduce(a, b, chunks=4) * 2

    from torch._dynamo.utils import counters

    for i in range(6):
        every = draw(2 * replays + i)
        got = compiled(x, w).clone()
        why = mismatch(got, 2 * (every @ w.double()).sum(0), TOL[dt])
        failures += [f"reduce-overhead call {i}: {why}"] if why else []
    if counters["inductor"]["cudagraph_skips"]:
        failures.append("torch.compile(mode='reduce-overhead') skipped CUDA graphs")
    return failures


def test_cuda_graph_host_road_one_gpu(monkeypatch):
    """One GPU: the copy engines' host road in a CUDA graph (10,000 replays on fresh inputs,
    eager calls between) and under ``torch.compile(mode="reduce-overhead")``."""
    _on_host_road(monkeypatch, _graph_host_road_one_gpu)


def _recorded_inputs(rank, R, seed, device="cuda"):
    """2 ranks on GPU 0 over gloo (copy engines, host road): a recorded call (its CUDA graph
    replayed from its third sighting with the same buffers) whose input moves to a new
    address, or is read with other strides at the same address (a non-contiguous ``x``, a
    transposed ``w``), into the same ``out``, must compute from the new input; every call
    against float64, ``out`` poisoned with NaN first, and each step's last call must have
    been a replay (else the case tests nothing). ``matmul_collective`` (all-reduce) and
    ``all_gather_matmul`` (without ``return_gathered``: a new ``x_full`` at every call would
    make a new key). ``device="cpu"``: the same cases on CPU ranks, not recorded
    (tests/test_cache_keys.py checks the cases themselves there)."""
    import overlap

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    M, K, N = (1024, 512, 768) if cuda else (64, 32, 48)
    backend = "ce" if cuda else "torch"
    g = torch.Generator().manual_seed(seed)

    def every(n):  # every rank's memory of n elements (the same draws on every rank)
        return torch.randn(R, n, generator=g)

    # every rank's buffers; a layout reads one as [rows, cols] ("t": the transpose of
    # [cols, rows], same address and shape, other strides)
    A, B, W, W2 = every(M * K), every(M * K), every(K * N), every(K * N)

    def view(buf, rows, cols, t):
        return buf.view(cols, rows).t() if t else buf.view(rows, cols)

    def on_dev(buf):
        return buf[rank].to(dev)

    dA, dB, dW, dW2 = on_dev(A), on_dev(B), on_dev(W), on_dev(W2)
    failures = []

    def counted(op, how):  # calls of `op` (as overlap.stats names it) counted `how...`
        return sum(n for h, n in overlap.stats().get(op, {}).items() if h.startswith(how))

    def steps(op, rows, call, reference):
        # (what, x's memory, x transposed, w's memory, w transposed): x's and w's memory stay
        # alive and unchanged, so that a stale replay reads valid but wrong data
        for what, xb, xt, wb, wt in (
            ("first", (A, dA), False, (W, dW), False),
            ("x at a new address", (B, dB), False, (W, dW), False),
            ("x back at the first address", (A, dA), False, (W, dW), False),
            ("x with other strides at the first address", (A, dA), True, (W, dW), False),
            ("w with other strides at the first address", (A, dA), False, (W, dW), True),
            ("w at a new address", (A, dA), False, (W2, dW2), False),
        ):
            xs = [view(xb[0][r], rows, K, xt) for r in range(R)]
            ws = [view(wb[0][r], K, N, wt) for r in range(R)]
            x, w = view(xb[1], rows, K, xt), view(wb[1], K, N, wt)
            refs = reference(xs, ws)
            before = counted(op, "replayed" if cuda else "")
            # eager; eager again where the first call sized the transport's buffers (a new
            # generation: the record starts over); captured and replayed; replayed
            for i in range(4):
                got = call(x, w)
                for j, (y, ref) in enumerate(zip(got, refs, strict=True)):
                    why = mismatch(y, ref.to(dev), TOL[torch.float32])
                    failures.extend([f"{op} {what}, call {i}, output {j}: {why}"] if why else [])
            if counted(op, "replayed" if cuda else "") == before:  # (CPU: counted at all)
                failures.append(f"{op} {what}: no call was replayed (the case tests nothing)")

    out = torch.empty(M, N, device=dev)

    def all_reduce(x, w):
        out.fill_(float("nan"))
        return (overlap.matmul_collective(x, w, out=out, backend=backend, chunks=4),)

    def all_reduce_ref(xs, ws):
        return (sum(x.double() @ w.double() for x, w in zip(xs, ws, strict=True)),)

    steps("matmul_collective", M, all_reduce, all_reduce_ref)
    m = M // R  # the all-gather's shard rows
    gathered = torch.empty(M, N, device=dev)

    def all_gather(x, w):
        gathered.fill_(float("nan"))
        return (overlap.all_gather_matmul(x[:m], w, out=gathered, backend=backend, chunks=4),)

    def gather_ref(xs, ws):
        return (torch.cat([x[:m].double() for x in xs]) @ ws[rank].double(),)

    steps("all_gather_matmul", M, all_gather, gather_ref)
    return failures


def _moving(rank, R, seed, device="cuda"):
    """2 ranks on GPU 0 over gloo (copy engines, host road): dense calls whose input and
    output are at new addresses at every call (a training step's activations; the weights
    stay), two shapes in turn, fp32 (the kernel's tf32x3 path, torch's finiteness kernels
    reading ``x``) and bf16 (``x`` through a TMA descriptor): every call against float64,
    outputs poisoned with NaN, earlier inputs and outputs kept alive (a graph not pointed at
    the new ones reads valid, wrong data), and every call from the fourth of a shape on
    replayed (``graphs/rebind.py``; else the case tests nothing); all-gathers the same way,
    every call from the fourth of a record on an updated graph (``graphs/record.py``); then a
    call like the replayed ones with an ``out`` that aliases ``x`` or lies on the CPU must
    raise (a record's key holds no address or device of its outputs). ``device="cpu"``: the
    same calls on CPU ranks, not recorded (tests/test_cache_keys.py)."""
    import overlap

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    g = torch.Generator().manual_seed(seed)
    failures, kept, weights = [], [], {}
    for dtype in (torch.float32, torch.bfloat16) if cuda else (torch.float32,):
        for i in range(10):
            op = ("all_reduce", "reduce_scatter")[i % 2]
            M, K, N = ((1024, 256, 384) if i % 2 else (1024, 384, 512)) if cuda else (32, 24, 16)
            xs = torch.randn(R, M, K, generator=g).to(dtype)
            if (dtype, K, N) not in weights:  # a layer's weight stays (its address is in the key)
                ws = torch.randn(R, K, N, generator=g).to(dtype)
                weights[dtype, K, N] = ws, ws[rank].to(dev)
            ws, w = weights[dtype, K, N]
            x = xs[rank].to(dev)
            ref = sum(a.double() @ b.double() for a, b in zip(xs, ws, strict=True))
            if op == "reduce_scatter":
                ref = ref[rank * M // R : (rank + 1) * M // R]
            out = torch.full(ref.shape, float("nan"), dtype=dtype, device=dev)
            before = overlap.stats().get("matmul_collective", {}).get("replayed via ce", 0)
            overlap.matmul_collective(x, w, op, out=out, backend="ce" if cuda else "torch",
                                      chunks=4)  # fmt: skip
            kept += [x, out]
            why = mismatch(out, ref.to(dev), TOL[dtype])
            what = f"{op} {dtype} call {i // 2} at new addresses"
            failures.extend([f"{what}: {why}"] if why else [])
            replayed = overlap.stats().get("matmul_collective", {}).get("replayed via ce", 0)
            replayed = replayed > before
            if cuda and i >= 6 and not replayed:
                failures.append(f"{what}: not replayed (its graph was not rebound)")
    for dtype in (torch.float32, torch.bfloat16) if cuda else (torch.float32,):
        # all-gathers (cuBLAS in their graphs: not rebound) at new addresses at every call,
        # with and without x_full in turn (two records): a record's third address set takes a
        # new graph, its fourth on updates the graph of the last but one (``record.py``)
        m, K, N = (512, 256, 384) if cuda else (16, 24, 16)
        ws = torch.randn(R, K, N, generator=g).to(dtype)
        w = ws[rank].to(dev)
        for i in range(12):
            xs = torch.randn(R, m, K, generator=g).to(dtype)
            x, keep = xs[rank].to(dev), i % 2 == 1
            x_full = torch.cat(list(xs)).double()
            out = torch.full((R * m, N), float("nan"), dtype=dtype, device=dev)
            before = overlap.stats().get("all_gather_matmul", {}).get("updated via ce", 0)
            got = overlap.all_gather_matmul(x, w, out=out, return_gathered=keep, chunks=4,
                                            backend="ce" if cuda else "torch")  # fmt: skip
            kept += [x, out, *(got[1:] if keep else ())]
            what = f"all_gather {dtype} return_gathered={keep} call {i // 2} at new addresses"
            why = mismatch(out, (x_full @ ws[rank].double()).to(dev), TOL[dtype])
            if keep and not torch.equal(got[1], x_full.to(dtype).to(dev)):
                why = (why or "") + " x_full differs"
            failures.extend([f"{what}: {why}"] if why else [])
            updated = overlap.stats().get("all_gather_matmul", {}).get("updated via ce", 0)
            if cuda and i >= 6 and not updated > before:
                failures.append(f"{what}: no graph updated (the case tests nothing)")
    if cuda:  # a bad out for a call that replays (its record's key holds no address or device)
        dtype, (M, K, N) = torch.bfloat16, (1024, 384, 512)
        buf = torch.randn(M * (K + N), device=dev).to(dtype)
        x = buf[: M * K].view(M, K)
        for out, match in ((buf[: M * N].view(M, N), "share memory"),
                           (torch.empty(M, N, dtype=dtype), "out is on cpu")):  # fmt: skip
            try:
                overlap.matmul_collective(x, weights[dtype, K, N][1], "all_reduce", out=out,
                                          backend="ce", chunks=4)  # fmt: skip
                failures.append(f"a repeated call with a bad out ({match}) did not raise")
            except ValueError as e:
                failures.extend([] if match in str(e) else [f"{match}: raised {e}"])
    return failures


def test_recorded_moving_one_gpu(monkeypatch):
    """One GPU: recorded dense calls whose input and output move at every call replay their
    graph pointed at the new tensors, and compute from them."""
    _on_host_road(monkeypatch, _moving)


def test_recorded_inputs_move_one_gpu(monkeypatch):
    """One GPU: a recorded call whose input moves or changes strides computes from it."""
    _on_host_road(monkeypatch, _recorded_inputs)
