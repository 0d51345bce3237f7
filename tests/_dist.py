"""Multi-rank harness shared by the gloo and the GPU tests: spawn ranks, run cases, compare
against a float64 reference built from every rank's inputs."""

from __future__ import annotations

import faulthandler
import math
import os
import sys
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import overlap

# ||out - ref|| / ||ref|| bounds. CPU fp32 runs the interpreter (exact fp32 dot); CUDA fp32
# follows torch.matmul (TF32 off by default). 16-bit: rounding of the product and of the sum.
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _entry(rank, world_size, init_file, backend, fn, args, errors_dir):
    after = os.environ.get("OVERLAP_TEST_TRACEBACKS_AFTER")  # (docs/design.md, "Hangs")
    if after:
        faulthandler.dump_traceback_later(float(after))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=120),
        )
        if backend == "gloo":
            # gloo connects the ranks pairwise inside init; a rank that is done with its side
            # and exits at once (a case with no collective) can close a pair its peer is still
            # setting up ("Connection closed by peer", seen once in CI). Meet first.
            dist.barrier()
        failures = fn(rank, world_size, *args)
    except Exception:
        failures = [traceback.format_exc()]
    if failures:
        with open(os.path.join(errors_dir, f"rank{rank}.txt"), "w") as f:
            f.write("\n".join(failures))
    if getattr(fn, "no_teardown", False):
        os._exit(0)  # a peer is gone or the group was aborted: tearing down could block
    if dist.is_initialized():
        dist.destroy_process_group()
    # Skip the interpreter's finalization: gloo's worker threads can abort it ("terminate
    # called without an active exception", SIGABRT after a passing compile test, once in
    # CI; torch PR 179291 describes the race). The failures are already written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# The gloo ranks start from a fork server that imported these once (a fresh interpreter
# importing torch costs ~2 s on 2 cores, most of a small test's time); the server is made with
# the environment of the moment, so a call in a different one (a test that set a variable)
# spawns fresh interpreters instead, as do the NCCL ranks (CUDA is never initialized in a fork).
PRELOAD = ["torch", "torch.distributed", "triton", "numpy"]
_server_env: dict | None = None


def _start_method(backend: str) -> str:
    global _server_env
    if backend != "gloo":
        return "spawn"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # (per test)
    if _server_env is None:
        mp.set_forkserver_preload(PRELOAD)
        _server_env = env
    return "forkserver" if env == _server_env else "spawn"


def spawn(fn, world_size: int, *args, backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args) -> list[str]`` on ``world_size`` ranks; raise
    AssertionError with every rank's failures."""
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(
            _entry,
            args=(world_size, os.path.join(d, "init"), backend, fn, args, d),
            nprocs=world_size,
            start_method=_start_method(backend),
        )
        reports = sorted(f for f in os.listdir(d) if f.startswith("rank"))
        text = "\n".join(open(os.path.join(d, f)).read() for f in reports)
    assert not reports, text


# Two groups of 2 in a world of 4 whose group ranks differ from the global ones (global 1 and 3
# are ranks 0 and 1 of the first, global 2 is rank 1 of the second): tensor-parallel groups
# inside TP x DP, as a real job has them.
SUBGROUPS = ((1, 3), (0, 2))


def on_subgroups(rank: int, world_size: int, fn, *args) -> list[str]:
    """``fn(group_rank, group_size, *args, group=g)`` on the group of ``SUBGROUPS`` this rank
    is in (``spawn(on_subgroups, 4, fn, ...)``); every rank makes both groups, in order. Both
    groups run the same cases at once; the failures say which group and rank."""
    assert world_size == 4, world_size
    groups = [dist.new_group(list(members)) for members in SUBGROUPS]
    i = next(i for i, members in enumerate(SUBGROUPS) if rank in members)
    g = groups[i]
    failures = fn(dist.get_rank(g), dist.get_world_size(g), *args, group=g)
    dist.barrier()  # (a group's last collective is done before any rank tears down)
    return [f"group {SUBGROUPS[i]}, global rank {rank}: {f}" for f in failures]


def poison_with_specials(x: torch.Tensor, w_nk: torch.Tensor) -> None:
    """Put NaN, +Inf and -Inf into ``x [M, K]`` and ``w_nk [N, K]`` in place, including an
    ``Inf * 0`` product and an ``Inf - Inf`` sum (``M, N >= 20``, ``K >= 8``)."""
    inf, nan = float("inf"), float("nan")
    x[1, 2] = inf  # row 1: +-Inf, or NaN where w[2, j] == 0
    w_nk[5, 2] = 0.0
    x[3, 4] = nan  # row 3: NaN everywhere
    x[7, 0], x[7, 1] = inf, inf  # row 7, column 9: Inf * w + Inf * (-w) = NaN
    w_nk[9, 0], w_nk[9, 1] = 1.0, -1.0
    w_nk[13, 6] = -inf  # column 13: +-Inf everywhere (x[i, 6] != 0), NaN on rows 1, 3, 7
    x[19, 3] = -inf


def mismatch(got: torch.Tensor, ref: torch.Tensor, tol: float) -> str | None:
    """Why ``got`` differs from the float64 ``ref``, or None: NaN (also: never written, as
    outputs start as NaN), +Inf and -Inf must be exactly where ``ref`` has them, and the
    finite rest within ``tol`` in relative norm."""
    got, ref = got.double(), ref.double()
    for name, f in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
        bad = (f(got) != f(ref)).nonzero().tolist()
        if bad:
            return f"{len(bad)} elements differ in being {name}, first at {bad[:3]}"
    fin = torch.isfinite(ref)
    err = ((got[fin] - ref[fin]).norm() / ref[fin].norm().clamp_min(1e-30)).item()
    return None if err < tol else f"relative error {err:.3g} > {tol:g}"


def check_case(
    rank: int,
    R: int,
    device: str,
    collective: str,
    dtype: torch.dtype,
    shape: tuple,
    seed: int,
    *,
    op: str = "sum",
    transposed_w: bool = True,
    backend: str = "torch",
    expect: str = "overlap",
    chunks: int | None = None,
    count_calls: dict | None = None,
    group: dist.ProcessGroup | None = None,
    specials: bool = False,
) -> str | None:
    """One call of ``overlap.matmul_collective`` on this rank, checked; a message on failure.

    ``rank`` and ``R`` are this rank's index in ``group`` and its size. ``shape`` is
    ``(lead..., K, N)``; every rank draws every rank's inputs from ``seed`` so the float64
    reference needs no communication. ``specials`` puts NaN and Inf into every rank's inputs.
    """
    g, xs, ws = _draw(R, dtype, shape, seed)
    *lead, K, N = shape
    M = math.prod(lead)
    if specials:
        for r in range(R):
            poison_with_specials(xs[r].view(M, K), ws[r])
    x = xs[rank].to(device)
    w = ws[rank].to(device).t() if transposed_w else ws[rank].t().contiguous().to(device)
    prods = [
        xs[r].to(device, torch.float64).reshape(M, K) @ ws[r].to(device, torch.float64).t()
        for r in range(R)
    ]
    Mr = M // R
    if collective == "all_reduce":
        ref = sum(prods).reshape(*lead, N)
    elif collective == "reduce_scatter":
        ref = sum(prods)[rank * Mr : (rank + 1) * Mr]
    else:
        ref = torch.cat([p[rank * Mr : (rank + 1) * Mr] for p in prods]).reshape(*lead, N)
    if op == "avg":
        ref = ref / R
    p = overlap.plan(x, w, collective, chunks=chunks, group=group, backend=backend)
    out = torch.full(ref.shape, float("nan"), dtype=dtype, device=device)
    before = dict(count_calls) if count_calls is not None else None
    name = f"{collective} {dtype} {shape} op={op} backend={backend} rank={rank}"
    try:
        res = overlap.matmul_collective(
            x, w, collective, op=op, out=out, backend=backend, chunks=chunks, group=group
        )
    except Exception as e:  # report the case; the other ranks fail their own way or time out
        return f"{name}: {type(e).__name__}: {e} ({p.describe()})"
    if p.path != expect:
        return f"{name}: path {p.path} ({p.reason}), expected {expect}"
    if res.data_ptr() != out.data_ptr():
        return f"{name}: result is not `out`"
    if count_calls is not None and p.path == "overlap":
        issued = sum(count_calls.values()) - sum(before.values())
        if issued != p.n_chunks:
            return f"{name}: {issued} collectives issued for {p.n_chunks} chunks"
    why = mismatch(res, ref, TOL[dtype])
    return f"{name}: {why} ({p.describe()})" if why else None


def _draw(R: int, dtype: torch.dtype, shape: tuple, seed: int):
    """Every rank's ``x [lead..., K]`` and ``nn.Linear`` weight ``[N, K]`` from ``seed`` (the
    same on every rank, so a float64 reference needs no communication), and the generator for
    anything drawn after them."""
    *lead, K, N = shape
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(*lead, K, generator=g).to(dtype) for _ in range(R)]
    ws = [torch.randn(N, K, generator=g).to(dtype) for _ in range(R)]
    return g, xs, ws


def check_grad_case(
    rank: int,
    R: int,
    device: str,
    case: tuple,
    seed: int,
    *,
    chunks: int | None = None,
    call=None,
    group: dist.ProcessGroup | None = None,
) -> str | None:
    """Forward and backward of one ``overlap.matmul_collective`` call on this rank
    (``x [..., K]`` and ``w = weight.t()``, both requiring grad), against float64 autograd over
    every rank's inputs: the loss is ``<y, g>`` with one ``g`` for the replicated all-reduce
    result, and the sum of every rank's ``<y_r, g_r>`` otherwise (the registered backward,
    ``overlap.ops._backward_op``).

    ``case`` is ``(collective, dtype, shape, op)``, ``shape`` as in ``check_case``. ``call``
    replaces ``overlap.matmul_collective`` (e.g. a ``torch.compile`` of it). ``rank`` and
    ``R`` are this rank's index in ``group`` and its size."""
    collective, dtype, shape, op = case
    g, xs, ws = _draw(R, dtype, shape, seed)
    *lead, K, N = shape
    M = math.prod(lead)
    rows = M if collective != "reduce_scatter" else M // R
    gs = [torch.randn(rows, N, generator=g).to(dtype) for _ in range(R)]
    X = [t.double().reshape(M, K).requires_grad_() for t in xs]
    W = [t.double().requires_grad_() for t in ws]
    P = [X[s] @ W[s].t() for s in range(R)]
    scale = 1.0 / R if op == "avg" else 1.0
    Mr = M // R
    if collective == "all_reduce":
        Y = [sum(P) * scale] * R
    elif collective == "reduce_scatter":
        Y = [sum(P)[r * Mr : (r + 1) * Mr] * scale for r in range(R)]
    else:
        Y = [torch.cat([p[r * Mr : (r + 1) * Mr] for p in P]) for r in range(R)]
    if collective == "all_reduce":
        loss = (Y[0] * gs[0].double()).sum()
    else:
        loss = sum((Y[r] * gs[r].double()).sum() for r in range(R))
    loss.backward()
    x = xs[rank].to(device).requires_grad_()
    weight = ws[rank].to(device).requires_grad_()
    name = f"backward {collective} {dtype} {shape} op={op} rank={rank}"
    try:
        kw = {} if group is None else {"group": group}
        y = (call or overlap.matmul_collective)(x, weight.t(), collective, op=op, chunks=chunks,
                                                **kw)  # fmt: skip
        mine = gs[0] if collective == "all_reduce" else gs[rank]
        (y.reshape(-1, N) * mine.to(device)).sum().backward()
    except Exception as e:
        return f"{name}: {type(e).__name__}: {e}"
    got_y = y.detach().reshape(-1, N).cpu()
    checks = (("y", got_y, Y[rank].detach()), ("dx", x.grad, X[rank].grad),
              ("dw", weight.grad, W[rank].grad))  # fmt: skip
    for what, got, ref in checks:
        if got is None:
            return f"{name}: {what} is None"
        why = mismatch(got.reshape(ref.shape).cpu(), ref, TOL[dtype])
        if why:
            return f"{name}: {what}: {why}"
    return None


def fault_scenarios(rank: int, R: int, scenario: str, device: str) -> list[str]:
    """One fault on 2 ranks; the rank that sees it must raise a clear error, quickly.

    - ``disagree``: validation mode; the ranks differ in shape, dtype, collective, chunk plan.
      Both raise ``RankMismatchError`` and no collective runs; a matching call then works.
    - ``never_arrives``: validation mode, 2 s timeout; rank 1 never calls. Rank 0 raises
      ``TimeoutError`` naming rank 1 within a few seconds.
    - ``killed_mid_call``: rank 1 exits inside its second chunk's collective. Rank 0 raises:
      gloo at once (the connection closes; validation off), NCCL through validation mode's
      watch (5 s timeout, then the communicator is aborted).
    - ``killed_mid_gather``: the same inside ``all_gather_matmul``'s second chunk.
    - ``killed_mid_split``, ``killed_mid_grouped``, ``killed_mid_dispatch``,
      ``killed_mid_bags``: the same inside the second chunk of an uneven all-to-all, of the
      MoE combine, of the MoE dispatch, or of the embedding-bag all-to-all.
    - ``killed_mid_call_ce``: the same through the copy-engine transport (GPU only): rank 1
      exits before pushing its second band, for which rank 0's GEMM waits in its epilogue;
      rank 0's watch releases the waits (flags written from a side stream) and raises.
    - ``killed_mid_call_ce_off``, ``killed_mid_gather_ce_off``: validation off, through the
      copy engines (GPU only), on a group whose own timeout is 8 s, after a first call: rank 1
      exits before pushing its second band, or its shard; the call returns, rank 0 waits for the
      GPU, and the watchdog (``guard.Watchdog``) raises ``TimeoutError`` in it within the
      timeout; the group's next call raises ``RuntimeError`` at once.
    - ``stuck_ce_off``: the same when rank 1 does not die but stops before its fourth call
      (three calls warm): a peer that hangs rather than dies.
    - ``killed_mid_call_shot_off``, ``stuck_shot_off``: the same through the latency
      all-reduce (``comm/shot.py``: a product too small to overlap, either road; 40 calls at
      a time): rank 1 dies before its kernel, for which rank 0's kernels wait in their barriers,
      or stops.
    - ``killed_mid_call_shot``: validation on (5 s), the latency all-reduce on either road (GPU
      only), after a first call: rank 1 dies before its reduction; rank 0's watch aborts the
      transport (its kernels' waits end) and the call raises.
    - ``stuck_nccl_off``, ``killed_mid_call_nccl_off``, ``killed_mid_split_nccl_off``:
      validation off, NCCL per chunk (``backend="torch"``; an uneven exchange takes it on every
      backend but CuPy's), group timeout 8 s: torch's own watchdog ends rank 0's process (by
      default it tears the process down); rank 0 reaching its end is the failure.
    """
    import time

    store = dist.distributed_c10d._get_default_store()
    dev = "cpu" if device == "cpu" else f"cuda:{rank}"
    M, K, N = (256, 64, 96) if device == "cpu" else (1024, 256, 512)  # 4 row bands of tiles
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(M, K, generator=gen).to(dev)
    w = torch.randn(K, N, generator=gen).to(dev)
    failures: list[str] = []
    if scenario == "disagree":
        overlap.configure(validate=True, timeout=60)
        counts = count_collectives()
        x16 = x.half() if rank else x  # float16 on rank 1
        mc, ag = overlap.matmul_collective, overlap.all_gather_matmul
        for what, fn, args, kw in (
            ("shape", mc, (x[: M // 2 * (2 - rank)], w, "all_reduce"), {"chunks": 2}),
            ("dtype", mc, (x16, w.to(x16.dtype), "all_reduce"), {"chunks": 2}),
            ("collective", mc, (x, w, "reduce_scatter" if rank else "all_to_all"), {"chunks": 2}),
            ("plan", mc, (x, w, "all_reduce"), {"chunks": 2 + rank}),
            ("shard size", ag, (x[: M // 2 * (2 - rank)], w), {"chunks": 2}),
        ):
            try:
                fn(*args, **kw)
                failures.append(f"{what}: ranks disagree and no error was raised")
            except overlap.RankMismatchError as e:
                if "rank 0:" not in str(e) or "rank 1:" not in str(e):
                    failures.append(f"{what}: the error lacks the ranks' fingerprints: {e}")
        if sum(counts.values()):
            failures.append(f"collectives ran before the mismatch was found: {counts}")
        msg = check_case(rank, R, dev, "all_reduce", torch.float32, (M, K, N), 7, chunks=2)
        failures += [f"after the mismatches: {msg}"] if msg else []
        overlap.configure(validate=False)
    elif scenario == "never_arrives":
        overlap.configure(validate=True, timeout=2)
        if rank == 0:
            t0 = time.monotonic()
            try:
                overlap.matmul_collective(x, w, chunks=2)
                failures.append("no error although rank 1 never called")
            except TimeoutError as e:
                if "[1]" not in str(e):
                    failures.append(f"the error does not name rank 1: {e}")
            took = time.monotonic() - t0
            if not 2 <= took < 15:
                failures.append(f"raised after {took:.1f} s for a 2 s timeout")
            store.set("test/done", "1")
        else:
            store.wait(["test/done"], timedelta(seconds=60))
        overlap.configure(validate=False)
    elif scenario.endswith("_off"):
        failures += _watchdog_scenario(rank, scenario, dev, x, w)
    elif scenario == "killed_mid_call_shot":
        failures += _shot_watch_scenario(rank, dev, x, w)
    elif scenario.startswith("killed_mid_"):
        validate = device != "cpu"
        backend = "ce" if scenario.endswith("_ce") else "torch"
        gather = scenario == "killed_mid_gather"
        split = scenario in ("killed_mid_split", "killed_mid_grouped", "killed_mid_dispatch",
                             "killed_mid_bags")  # fmt: skip
        overlap.configure(validate=validate, timeout=5)
        if rank == 1 and backend == "torch":
            name = _ALL_GATHER if gather else "all_to_all_single" if split else "all_reduce"
            _die_in_second(name)
        elif rank == 1:  # the copy-engine transport: die before pushing the second chunk
            from overlap.comm import PeerTransport

            orig_run = PeerTransport.run

            def dying_run(self, p, slots, out, wait, stream):
                def wait_or_die(c, ops=None):  # (ops: the batch, as `produce`'s wait takes)
                    if c == 1:  # rank 0's own tiles of this band wait for it in the kernel
                        os._exit(0)
                    wait(c, ops)

                return orig_run(self, p, slots, out, wait_or_die, stream)

            PeerTransport.run = dying_run
        t0 = time.monotonic()
        coll = "all_gather" if gather else "all_reduce"
        if overlap.plan(x, w, coll, chunks=4, backend=backend).n_chunks < 3:
            failures.append("the plan has too few chunks to die in the middle")
        try:
            if gather:
                overlap.all_gather_matmul(x, w, chunks=4, backend=backend)
            elif split:  # rank 0 sends 100 rows to itself and 150 to rank 1, and back
                splits = [100, 150] if rank == 0 else [150, 100]
                kw = dict(input_split_sizes=splits, output_split_sizes=splits, chunks=4)
                ids = torch.arange(250, device=dev) % 2  # two experts, alternating rows
                if scenario == "killed_mid_grouped":
                    overlap.grouped_matmul_all_to_all(x[:250], torch.stack([w, w]), ids, **kw)
                elif scenario == "killed_mid_dispatch":
                    overlap.all_to_all_grouped_matmul(x[:250], torch.stack([w, w]), ids, **kw)
                elif scenario == "killed_mid_bags":  # M bags of one row of x each
                    bags = torch.arange(M, device=dev)
                    overlap.embedding_bag_all_to_all([x], [bags], [bags], chunks=4)
                else:
                    overlap.matmul_all_to_all(x[:250], w, **kw)
            else:
                overlap.matmul_collective(x, w, chunks=4, backend=backend)
            failures.append("no error although rank 1 died mid-call")
        except (RuntimeError, TimeoutError) as e:
            took = time.monotonic() - t0
            if took > (20 if validate else 10):
                failures.append(f"raised only after {took:.1f} s: {e}")
        overlap.configure(validate=False)
    else:
        raise ValueError(scenario)
    return failures


fault_scenarios.no_teardown = True


def _die_in_second(name: str) -> None:
    """This process exits inside its second call of ``torch.distributed``'s ``name`` from now
    on (like a crash: no teardown, no message)."""
    orig, calls = getattr(dist, name), [0]

    def dying(*a, **k):
        calls[0] += 1
        if calls[0] == 2:
            os._exit(0)
        return orig(*a, **k)

    setattr(dist, name, dying)


def _die_in_latency_all_reduce() -> None:
    """This process exits in its next latency all-reduce, on either road, before its
    reduction (its peers' kernels wait for it)."""
    from overlap.comm import ShotTransport
    from overlap.gemm import shot as host_shot

    ShotTransport.reduce = lambda *a, **k: os._exit(0)
    host_shot.HostShot.__call__ = lambda *a, **k: os._exit(0)


def _shot_watch_scenario(rank: int, dev: str, x, w) -> list[str]:
    """``fault_scenarios``' ``killed_mid_call_shot`` (its docstring)."""
    import time

    overlap.configure(validate=True, timeout=5)
    try:
        overlap.matmul_allreduce(x[:64], w)  # (makes the transport: a collective)
        torch.cuda.synchronize(dev)
        p = overlap.plan(x[:64], w)
        if p.transport not in ("one-shot", "host one-shot"):
            return [f"the call does not take the one-shot all-reduce: {p.describe()}"]
        if rank == 1:
            _die_in_latency_all_reduce()
        t0 = time.monotonic()
        try:
            overlap.matmul_allreduce(x[:64], w)
            torch.cuda.synchronize(dev)
            return ["no error although rank 1 died mid-call"]
        except (RuntimeError, TimeoutError) as e:
            took = time.monotonic() - t0
            return [f"raised only after {took:.1f} s: {e}"] if took > 20 else []
    finally:
        overlap.configure(validate=False)


def _watchdog_scenario(rank: int, scenario: str, dev: str, x, w) -> list[str]:
    """``fault_scenarios``' validation-off cases (its docstring)."""
    import time

    from overlap.comm import PeerTransport

    overlap.configure(validate=False)
    g = dist.new_group([0, 1], timeout=timedelta(seconds=8))  # the watchdog's limit
    if scenario.endswith("_nccl_off"):
        return _nccl_off_scenario(rank, scenario, dev, x, w, g)
    gather, shot = "gather" in scenario, "shot" in scenario
    failures: list[str] = []

    def call():
        if gather:
            return overlap.all_gather_matmul(x, w, chunks=4, backend="ce", group=g)
        if shot:  # (40 calls in flight: the release goes on until every one has ended)
            return [overlap.matmul_allreduce(x[:64], w, group=g) for _ in range(40)]
        return overlap.matmul_collective(x, w, chunks=4, backend="ce", group=g)

    for _ in range(3 if scenario.startswith("stuck") else 1):  # (sizes the buffers: collectives)
        call()  # the second is recorded in a CUDA graph, the third replays it
    torch.cuda.synchronize(dev)
    if scenario.startswith("stuck"):
        if rank == 1:
            time.sleep(25)  # stopped, not dead: rank 0 must not wait for it
            os._exit(0)
    elif rank == 1 and gather:
        PeerTransport.gather = lambda *a, **k: os._exit(0)
    elif rank == 1 and shot:
        _die_in_latency_all_reduce()
    elif rank == 1:
        orig_send = PeerTransport._send

        def dying_send(self, p, slots, out, wait, q, own):
            def wait_or_die(c, ops=None):
                if c == 1:  # rank 0's tiles of this band wait for it in the kernel
                    os._exit(0)
                wait(c, ops)

            return orig_send(self, p, slots, out, wait_or_die, q, own)

        PeerTransport._send = dying_send  # (the host road's `run` calls it too)
    if shot:
        p = overlap.plan(x[:64], w, group=g)
        if p.transport not in ("one-shot", "host one-shot"):
            return [f"the call does not take the one-shot all-reduce: {p.describe()}"]
    else:
        p = overlap.plan(x, w, "all_gather" if gather else "all_reduce", chunks=4, backend="ce",
                         group=g)  # fmt: skip
        if p.path != "overlap" or p.transport != "ce":
            return [f"the call does not take the copy engines: {p.describe()}"]
    t0 = time.monotonic()
    try:
        call()  # validation off: returns once issued
        torch.cuda.synchronize(dev)  # held until the watchdog releases the waits
        for _ in range(500):  # the exception is pending by then: it comes here at the latest
            time.sleep(0.01)
        failures.append("no error although rank 1 died or stopped")
    except TimeoutError as e:
        took = time.monotonic() - t0
        if not 8 <= took < 25 or "died or stopped" not in str(e):
            failures.append(f"raised after {took:.1f} s (group timeout 8 s): {e}")
    t0 = time.monotonic()
    try:
        call()
        failures.append("a call after the timeout did not raise")
    except RuntimeError as e:
        if "aborted" not in str(e) or time.monotonic() - t0 > 1:
            failures.append(f"the call after the timeout: {e}")
    return failures


def _nccl_off_scenario(rank: int, scenario: str, dev: str, x, w, g) -> list[str]:
    """``fault_scenarios``' validation-off NCCL cases: rank 0 must not live to the end."""
    import time

    split = "split" in scenario
    splits = [100, 150] if rank == 0 else [150, 100]  # rank 0 sends 100 rows to itself ...

    def call():
        if split:
            kw = dict(input_split_sizes=splits, output_split_sizes=splits, chunks=4, group=g)
            return overlap.matmul_all_to_all(x[:250], w, **kw)
        return overlap.matmul_collective(x, w, chunks=4, backend="torch", group=g)

    for _ in range(3):
        call()
    torch.cuda.synchronize(dev)
    if rank == 1 and scenario == "stuck_nccl_off":
        time.sleep(100)  # stopped, not dead (the test ends it once rank 0 has ended)
        os._exit(0)
    elif rank == 1:
        _die_in_second("all_to_all_single" if split else "all_reduce")
    call()
    torch.cuda.synchronize(dev)  # rank 0: held until torch's watchdog ends the process
    time.sleep(40)
    return [f"rank {rank} still ran 40 s after its peer died or stopped (group timeout 8 s)"]


# the names overlap.collectives calls: torch 2.13's, or the GPU image's 2.11 ones
_ALL_GATHER = (
    "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
)
_REDUCE_SCATTER = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)


def count_collectives(*extra: str) -> dict:
    """Wrap torch.distributed's collectives in this process (and the functions named in
    ``extra``) to count calls."""
    counts: dict = {}
    for fname in ("all_reduce", _REDUCE_SCATTER, "all_to_all", "all_to_all_single", *extra):
        orig = getattr(dist, fname)
        counts[fname] = 0

        def wrapped(*a, _orig=orig, _name=fname, **k):
            counts[_name] += 1
            return _orig(*a, **k)

        setattr(dist, fname, wrapped)
    return counts
