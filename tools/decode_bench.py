"""Short calls: the row-parallel all-reduce of ``y = x @ w_shard`` at every size from one
token to a prefill, and a Llama-style decode step built on it, every way a user could run it,
checked against torch's NCCL and timed in one run.

Modes (each a way to compute ``x [M, K / R] @ w [K / R, N]`` summed over the ``R`` ranks;
``w = weight.t()``, ``weight [N, K / R]`` this rank's shard as ``nn.Linear`` holds it, the
same tensor in every mode):

=================  ============================================================================
``nccl``           ``y = x @ w; dist.all_reduce(y)``: torch's own, the reference
``symm_one``       torch's symmetric memory: ``torch.matmul(x, w, out=buf[:M N].view(M, N))``
                   into a buffer allocated and rendezvoused once, then
                   ``torch.ops.symm_mem.one_shot_all_reduce_out`` into a preallocated output
``symm_two``       the same with ``two_shot_all_reduce_`` in place, then copied out
``overlap_op``     ``overlap.matmul_allreduce(x, w, group=group)``
``overlap_layer``  ``overlap.nn.RowParallelLinear`` holding ``weight``
``nocomm``         ``x @ w``, the sum skipped: the ceiling (not checked)
=================  ============================================================================

The symmetric-memory modes run on CUDA GPUs with P2P only (not on CPU, not over gloo, not
with ``NCCL_P2P_DISABLE=1``); where their setup raises they are skipped with the exception
as the reason, and a size one of them refuses is recorded under ``unsupported``.

Part 1, the op sweep (``--parts sweep``): per ``--dims`` (8B, 70B) the o projection (``K =
hidden``) and the down projection (``K = ffn``), ``N = hidden``, ``K / R`` per rank, at every
``M`` of ``--ms`` (1 to 8192); the all-reduce in every mode, and the reduce-scatter
(``dist.reduce_scatter_tensor`` as ``nccl``, ``overlap.matmul_reduce_scatter`` as
``overlap_op``, and ``nocomm``; ``M`` divisible by ``R``). Each cell times a chain of
``--chain`` (16) ops on the same ``x``, their outputs feeding nothing:

- eager: host wall time of the whole chain up to a ``torch.cuda.synchronize()`` at its end
  (the GPU idle at its start), per op;
- captured: the chain captured once in a ``torch.cuda.CUDAGraph`` (after an eager warm-up on
  the capture stream, which the library needs), each replay timed with CUDA events, per op.

The modes take turns within each round (``_benchrun.time_turns``: the GPU's clock drift
weighs on all alike); medians, the slowest rank's; ``--iters`` eager rounds and ``--replays``
captured ones, fewer (at least 3) where a cell's chain is long (a model of its time,
``BUDGET_MS`` per mode and kind; warm-up rounds a third of them, at most ``--warmup``),
chosen so that the full run takes about 4 minutes on 2 H200s (an estimate from a model of
the GPU time; ``elapsed_s`` in the JSON says what it took).

Part 2, the decode step (``--parts decode``): ``--layers`` (8) Llama-style layers, ``B``
sequences of one new token each (``--bs``: 1, 8, 32, 128) over a KV cache of ``--cache``
(4096) positions, tensor parallel over the ``R`` ranks: per layer RMSNorm, the fused q/k/v
column-parallel product (no communication), the new token's k/v written into the cache's
last slot, SDPA of ``q [B, heads / R, 1, d]`` over ``k, v [B, kv_heads / R, cache, d]``
(``enable_gqa``; no rotary), the o projection row-parallel (summed per mode), residual,
RMSNorm, the fused gate/up column-parallel product, SiLU times up, the down projection
row-parallel (summed per mode), residual. Eager: wall time per step up to a synchronize;
captured: the whole step in one CUDA graph, replays timed with events; ``--iters`` and
``--replays`` rounds.

Every mode's outputs (every op of a chain; a step's final hidden states) are checked against
``nccl``'s, eagerly and after a replay of the captured graph (its outputs poisoned with NaN
first, as the symmetric modes' ``out`` is before the eager check): relative norm error under
2e-2 for bf16, 1e-4 for fp32, or the cell is listed under ``failed`` and the run exits
non-zero at the end. Speedups ``*_x_nccl`` are ``nccl``'s time over the mode's. The library's
rows carry ``paths`` (``_benchrun.paths``: its calls by path over one eager chain or step
after the checked one, and while capturing) and, in the sweep, the ``plan``
(``overlap.plan``: path, transport, reason).

The JSON (``--out``): ``rows`` (one per cell and mode: ``eager_us``, ``captured_us`` per op in
the sweep; ``eager_ms``, ``captured_ms`` per step in the decode; speedups, errors, paths,
rounds), ``errors``, ``failed``, ``unsupported``, ``skipped`` (mode: reason), ``cell_skipped``,
``captured_skipped`` (the reason where nothing was captured: CPU, gloo), ``elapsed_s`` per
part, ``timing_meaningful`` (False on CPU and with ``--one-gpu``), ``env`` (NCCL, driver,
CUDA, ``NCCL_P2P_DISABLE`` and its road) and torch, Triton, GPU, date.

    torchrun --nproc-per-node=2 tools/decode_bench.py [--out X.json]        # P2P (NVLink)
    NCCL_P2P_DISABLE=1 torchrun --nproc-per-node=2 tools/decode_bench.py    # without P2P
    torchrun --nproc-per-node=2 tools/decode_bench.py --quick               # a small subset
    python tools/decode_bench.py --cpu        # 2 CPU ranks, gloo, Triton's interpreter,
                                              # tiny dims, fp32: correctness only

Also for 4 ranks (``--nproc-per-node=4``).

Part 3, HF ``generate()`` against transformers' ``tp_plan="auto"``: ``tools/generate_bench.py``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _benchrun import (
    DTYPES,
    add_options,
    fill_defaults,
    launch,
    paths,
    rel_err,
    time_turns,
    write_json,
)
from model_bench import DIMS
from torch import nn

import overlap
from overlap.collectives import reduce_scatter

MODES = ("nccl", "symm_one", "symm_two", "overlap_op", "overlap_layer", "nocomm")
RS_MODES = ("nccl", "overlap_op", "nocomm")  # the reduce-scatter's
LIBRARY = ("overlap_op", "overlap_layer")
SYMM = ("symm_one", "symm_two")
COLLECTIVES = ("all_reduce", "reduce_scatter")
MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
QUICK_MS = (1, 32, 512, 4096)
CPU_MS, CPU_QUICK_MS = (1, 2, 8, 16), (1, 8)
BS, QUICK_BS, CPU_BS = (1, 8, 32, 128), (1, 32), (1, 4)
SMALL = dict(layers=2, cache=16, chain=2, replays=0)
LARGE = dict(layers=8, cache=4096, chain=16, replays=50)
# Per cell, mode and kind (eager, captured): the rounds are cut (to 3 at least) where a model
# of the chain's GPU time (_chain_ms) says they would take longer than this.
BUDGET_MS = 100.0
EPS = 1e-5


# -- the modes ---------------------------------------------------------------------------------
class Symm:
    """torch's symmetric memory for one group: a buffer of ``numel`` elements allocated and
    rendezvoused once, the products written into its first ``M N``; an output per shape."""

    def __init__(self, numel: int, dtype: torch.dtype, dev: torch.device, group) -> None:
        import warnings

        from torch.distributed import _symmetric_memory as symm_mem

        self.name = group.group_name
        try:  # (deprecated, and unneeded, in newer torch)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(self.name)
        except Exception:
            pass
        self.buf = symm_mem.empty(numel, dtype=dtype, device=dev)
        symm_mem.rendezvous(self.buf, self.name)
        self.outs: dict[tuple[int, int], torch.Tensor] = {}

    def op(self, mode: str, w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x [M, K / R]`` -> the sum over the ranks of ``x @ w`` (one- or two-shot)."""
        N = w.shape[1]

        def run(x: torch.Tensor) -> torch.Tensor:
            M = x.shape[0]
            view = self.buf[: M * N].view(M, N)
            torch.matmul(x, w, out=view)
            out = self.outs.get((M, N))
            if out is None:
                out = self.outs[(M, N)] = x.new_empty(M, N)
            if mode == "symm_one":
                torch.ops.symm_mem.one_shot_all_reduce_out(view, "sum", self.name, out)
            else:
                torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", self.name)
                out.copy_(view)
            return out

        return run


def row_op(mode: str, collective: str, weight: torch.Tensor, group, symm: Symm | None):
    """``mode``'s ``x [M, K / R]`` -> ``[M, N]`` (reduce-scatter: ``[M / R, N]``) for the
    shard ``weight [N, K / R]``."""
    w, R = weight.t(), dist.get_world_size(group)
    rs = collective == "reduce_scatter"
    if mode == "nocomm":
        return lambda x: x @ w
    if mode == "nccl":

        def plain(x: torch.Tensor) -> torch.Tensor:
            y = x @ w
            if not rs:
                dist.all_reduce(y, group=group)
                return y
            out = y.new_empty(y.shape[0] // R, y.shape[1])
            reduce_scatter(out, y, group)  # (torch's reduce_scatter_tensor, or its new name)
            return out

        return plain
    if mode == "overlap_op":
        fn = overlap.matmul_reduce_scatter if rs else overlap.matmul_allreduce
        return lambda x: fn(x, w, group=group)
    if mode == "overlap_layer":
        layer = overlap.nn.RowParallelLinear(
            weight.shape[1] * R, weight.shape[0], bias=False, group=group,
            sequence_parallel=rs, device=weight.device, dtype=weight.dtype,
        )  # fmt: skip
        layer.weight = nn.Parameter(weight, requires_grad=False)
        return layer
    return symm.op(mode, w)


def _why_not(mode: str, collective: str, dev: torch.device, symm_error: str | None) -> str | None:
    """Why ``mode`` does not run ``collective`` here, or None."""
    if collective == "reduce_scatter" and mode not in RS_MODES:
        return "not measured for the reduce-scatter"
    if collective == "reduce_scatter" and dev.type == "cuda" and dist.get_backend() != "nccl":
        return "gloo has no CUDA reduce-scatter"
    if mode in SYMM:
        return symm_error
    return None


def _symm_error(dev: torch.device) -> str | None:
    """Why torch's symmetric memory cannot run here (before trying it), or None."""
    import os

    if dev.type != "cuda":
        return "torch's symmetric memory needs CUDA GPUs"
    if dist.get_backend() != "nccl":
        return "torch's symmetric memory needs the NCCL group (refuses two ranks on one GPU)"
    if os.environ.get("NCCL_P2P_DISABLE") == "1":
        return "torch's symmetric memory needs P2P (NCCL_P2P_DISABLE=1 here)"
    return None


# -- checking and timing -----------------------------------------------------------------------
def _worst(values: list[float | None]) -> float | None:
    """The largest (None if none), NaN if any is NaN."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return float("nan") if any(math.isnan(v) for v in values) else max(values)


def _agree(local: dict) -> dict:
    """Every rank's ``{mode: {"error": e, "paths": ...} or message}`` merged: a message where
    any rank raised, else the worst error and this rank's paths (every rank makes the same
    calls)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, local)
    out = {}
    for mode, mine in local.items():
        theirs = [e[mode] for e in every]
        raised = [t for t in theirs if isinstance(t, str)]
        out[mode] = raised[0] if raised else dict(mine, error=_worst([t["error"] for t in theirs]))
    return out


def _capture(fn: Callable[[], list], side: torch.cuda.Stream) -> tuple:
    """``(graph, outputs, paths)``: ``fn`` warmed up on ``side`` (the library's context is
    per caller stream: its buffers are sized for the capture stream there), then captured on
    it; ``paths``: the library's calls by path while capturing."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.synchronize()
    paths()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        outs = fn()
    return graph, outs, paths()


def _chain_ms(L: int, M: int, K: int, N: int, R: int) -> float:
    """A rough model of a sweep chain's GPU ms on an H200 (the same on every rank): the
    product at 600 TFLOP/s or its weight read at 4 TB/s, the sum's bytes at 150 GB/s, 20 us of
    launches per op."""
    gemm = max(2 * M * K * N / 6e14, 2 * K * N / 4e12)
    return L * 1e3 * (gemm + 2 * M * N * 2 * (R - 1) / R / 1.5e11 + 2e-5)


def _rounds(chain_ms: float, want: int, cuda: bool) -> int:
    """``want`` rounds, on GPUs cut to ``BUDGET_MS`` of chains (at least 3)."""
    if not cuda:
        return want
    return max(min(3, want), min(want, int(BUDGET_MS / max(chain_ms, 1e-3))))


def _time(fns: dict, rounds: int, warmup: int, cuda: bool, captured: bool) -> dict:
    """Median ms per call of each function, the slowest rank's (``time_turns``): eager, host
    wall time up to a synchronize; captured (graph replays), CUDA events."""
    if not fns or rounds <= 0:
        return {}
    if cuda and not captured:
        fns = {k: (lambda fn=fn: (fn(), torch.cuda.synchronize())) for k, fn in fns.items()}
    return {k: v[0] for k, v in time_turns(fns, rounds, warmup, cuda and captured).items()}


class Bench:
    """The run: options, device, group, symmetric memory, and what every cell found."""

    def __init__(self, args: argparse.Namespace, dev: torch.device) -> None:
        self.args, self.dev, self.cuda = args, dev, dev.type == "cuda"
        self.group, self.R, self.rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
        self.dtype = DTYPES[args.dtype]
        self.tol = 1e-4 if self.dtype == torch.float32 else 2e-2
        self.rows: list[dict] = []
        self.errors: dict = {}  # cell/mode: {"eager": e, "captured": e}
        self.failed: dict = {}  # cell/mode(/kind): why (the run exits non-zero)
        self.unsupported: dict = {}  # cell/mode: what torch's symmetric memory raised
        self.skipped: dict = {}  # mode (or mode/collective): why it did not run at all
        self.cell_skipped: dict = {}  # cell: why
        self.captured_skipped = None
        if not self.cuda:
            self.captured_skipped = "CPU: no CUDA graphs"
        elif dist.get_backend() != "nccl":
            self.captured_skipped = "gloo's collectives cannot be captured in CUDA graphs"
        self.side = torch.cuda.Stream(dev) if self.captured_skipped is None else None
        self.symm, why = None, _symm_error(dev)
        if why is None and any(m in SYMM for m in args.modes):
            try:
                self.symm = Symm(self._symm_numel(), self.dtype, dev, self.group)
            except Exception as e:
                why = f"setup raised {type(e).__name__}: {e}"[:600]
        self.symm_error = why
        self.skipped.update({m: why for m in SYMM if why and m in args.modes})

    def _symm_numel(self) -> int:
        hidden = max(DIMS[d][0] for d in self.args.dims)
        sweep = max(self.args.ms) * hidden if "sweep" in self.args.parts else 0
        decode = max(self.args.bs) * hidden if "decode" in self.args.parts else 0
        return max(sweep, decode, 1)

    def rng(self, seed: int, per_rank: bool) -> torch.Generator:
        """A generator on the device: the same on every rank, or (``per_rank``) its own."""
        return torch.Generator(device=self.dev).manual_seed(seed + 1000 * self.rank * per_rank)

    def randn(self, *shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
        """Normal ``shape`` times ``scale`` in the run's dtype."""
        t = torch.randn(*shape, generator=gen, device=self.dev) * scale
        return t.to(self.dtype)

    def poison(self) -> None:
        """The outputs the symmetric modes write into, NaN (before a check)."""
        if self.symm is not None:
            for out in self.symm.outs.values():
                out.fill_(float("nan"))

    def cell(self, key: str, make: dict, run: dict, rounds: tuple[int, int]) -> dict:
        """One cell: every mode of ``make`` (``make[mode]()``: its outputs, a list) checked
        against ``nccl``'s first output (eagerly, after a warm-up call, and after a replay of
        the captured ``make[mode]``, outputs poisoned first), then ``run[mode]`` (the same,
        outputs dropped) timed eagerly (``rounds[0]``) and captured (``rounds[1]``). Returns
        ``{mode: row}`` with ``eager_ms`` and ``captured_ms`` per call of ``run``, errors,
        paths and rounds; records errors and failures."""
        want = make["nccl"]()[0].clone()
        local = {}
        for mode, fn in make.items():
            try:
                fn()  # (a warm-up: first sightings, compiles)
                paths()
                self.poison()
                outs = fn()
                counted = paths()
                err = None if mode == "nocomm" else _worst([rel_err(y, want) for y in outs])
                local[mode] = dict(error=err, paths={"eager": counted})
            except Exception as e:
                local[mode] = f"{type(e).__name__}: {e}"[:600]
        rows = {}
        for mode, r in _agree(local).items():
            if isinstance(r, str):
                self._raised(f"{key}/{mode}", mode, r)
                continue
            rows[mode] = dict(mode=mode, error=r["error"], paths=r["paths"], eager_ms=None,
                              captured_ms=None, captured_error=None,
                              rounds={"eager": rounds[0], "captured": 0})  # fmt: skip
            self._check(f"{key}/{mode}", "eager", r["error"])
        warm = min(self.args.warmup, max(1, rounds[0] // 3))
        for m, t in _time({m: run[m] for m in rows}, rounds[0], warm, self.cuda, False).items():
            rows[m]["eager_ms"] = t
        if self.captured_skipped is not None:
            return rows
        graphs, local = {}, {}
        for mode in rows:
            try:
                graph, outs, counted = _capture(make[mode], self.side)
                self.poison()
                for y in outs:
                    y.fill_(float("nan"))
                graph.replay()
                err = None if mode == "nocomm" else _worst([rel_err(y, want) for y in outs])
                graphs[mode], local[mode] = graph, dict(error=err, paths=counted)
            except Exception as e:
                local[mode] = f"{type(e).__name__}: {e}"[:600]
        for mode, r in _agree(local).items():
            if isinstance(r, str):
                self._raised(f"{key}/{mode}/captured", mode, r)
                graphs.pop(mode, None)
                continue
            rows[mode]["paths"]["captured"] = r["paths"]
            rows[mode]["captured_error"] = r["error"]
            rows[mode]["rounds"]["captured"] = rounds[1]
            self._check(f"{key}/{mode}", "captured", r["error"])
        warm = min(self.args.warmup, max(1, rounds[1] // 3))
        replays = {m: g.replay for m, g in graphs.items()}
        for m, t in _time(replays, rounds[1], warm, self.cuda, True).items():
            rows[m]["captured_ms"] = t
        del graphs, replays
        return rows

    def _check(self, key: str, kind: str, err: float | None) -> None:
        """Records ``err`` (None: not checked) and a failure where it is not under tolerance."""
        if err is None:
            return
        self.errors.setdefault(key, {})[kind] = err
        if not err < self.tol:
            why = f"relative error {err:.3g} against nccl's (tolerance {self.tol})"
            self.failed[f"{key}/{kind}"] = why

    def _raised(self, key: str, mode: str, msg: str) -> None:
        """A mode that raised: torch's symmetric memory refusing something is ``unsupported``;
        anything else fails the run."""
        (self.unsupported if mode in SYMM else self.failed)[key] = msg
        if self.rank == 0:
            print(f"{key}: raised {msg}", flush=True)

    # -- part 1 --------------------------------------------------------------------------------
    def sweep(self) -> None:
        """Every (collective, dims, projection, M) cell."""
        a, R = self.args, self.R
        for collective in COLLECTIVES:
            modes = []
            for m in a.modes:
                why = self.skipped.get(m) or _why_not(m, collective, self.dev, self.symm_error)
                if why and m not in self.skipped:
                    self.skipped[f"{m}/{collective}"] = why
                modes += [] if why else [m]
            if "nccl" not in modes:
                continue
            for dims in a.dims:
                hidden, ffn = DIMS[dims][0], DIMS[dims][1]
                for proj, K in (("o_proj", hidden), ("down", ffn)):
                    if K % R:
                        raise ValueError(f"{dims} {proj}: K ({K}) not divisible by {R} ranks")
                    weight = self.randn(hidden, K // R, gen=self.rng(11, True), scale=K**-0.5)
                    ops = {m: row_op(m, collective, weight, self.group, self.symm) for m in modes}
                    for M in a.ms:
                        key = f"sweep/{collective}/{dims} {proj}/M={M}"
                        if collective == "reduce_scatter" and M % R:
                            self.cell_skipped[key] = f"M ({M}) not divisible by {R} ranks"
                            continue
                        x = self.randn(M, K // R, gen=self.rng(M, True))
                        self._sweep_cell(key, ops, x, weight, collective)
                    del ops, weight
                    overlap.release(self.group)  # (the library's records of this weight)
                    if self.cuda:
                        torch.cuda.empty_cache()

    def _sweep_cell(self, key: str, ops: dict, x: torch.Tensor, weight: torch.Tensor,
                    collective: str) -> None:  # fmt: skip
        """A chain of ``--chain`` ops per mode on ``x``, checked and timed."""
        L, (M, K), N = self.args.chain, x.shape, weight.shape[0]

        def chain(op):
            return lambda: [op(x) for _ in range(L)]

        def run(op):
            def ops_dropped():
                for _ in range(L):
                    op(x)

            return ops_dropped

        est = _chain_ms(L, M, K, N, self.R)
        rounds = (_rounds(est, self.args.iters, self.cuda),
                  _rounds(est, self.args.replays, self.cuda))  # fmt: skip
        make = {m: chain(op) for m, op in ops.items()}
        rows = self.cell(key, make, {m: run(op) for m, op in ops.items()}, rounds)
        plan = None
        if any(m in LIBRARY for m in rows):
            p = overlap.plan(x, weight.t(), collective, group=self.group)
            plan = dict(path=p.path, transport=p.transport, reason=p.reason)
        for m, r in rows.items():
            dims, proj = key.split("/")[2].split()
            r.update(part="sweep", collective=collective, dims=dims, proj=proj, M=M, K=K, N=N,
                     chain=L, plan=plan if m in LIBRARY else None)  # fmt: skip
            for kind in ("eager", "captured"):  # per op, us
                t = r.pop(f"{kind}_ms")
                r[f"{kind}_us"] = None if t is None else t * 1e3 / L
        _speedups(rows, "us")
        self.rows += rows.values()
        if self.rank == 0:
            print(_progress(key, rows, "us"), flush=True)

    # -- part 2 --------------------------------------------------------------------------------
    def decode(self) -> None:
        """Every (dims, B) decode step."""
        a = self.args
        modes = [m for m in a.modes if m not in self.skipped]
        for dims in a.dims:
            model = Model(self, dims)
            for B in a.bs:
                key = f"decode/{dims}/B={B}"
                model.new_cache(B)
                h = self.randn(B, model.hidden, gen=self.rng(B, False))  # (replicated)
                steps = {m: model.step(m) for m in modes}
                make = {m: (lambda s=s: [s(h)]) for m, s in steps.items()}
                run = {m: (lambda s=s: s(h)) for m, s in steps.items()}
                # (eager steps are host-bound and noisy, and a few ms each: 6x the rounds; the
                # first cell ran 2x slower with 5 rounds, 2 of them warm-up, on 2 H200s)
                rows = self.cell(key, make, run, (6 * a.iters, a.replays))
                _speedups(rows, "ms")
                for r in rows.values():
                    r.update(part="decode", dims=dims, B=B, layers=a.layers, cache=a.cache)
                self.rows += rows.values()
                if self.rank == 0:
                    print(_progress(key, rows, "ms"), flush=True)
                del steps, make, run
                model.new_cache(0)
                if self.cuda:
                    torch.cuda.empty_cache()
            del model
            overlap.release(self.group)


class Model:
    """This rank's shards of a Llama-style stack at ``DIMS[dims]`` (its heads' rows of the
    fused q/k/v, its columns of o, its gate/up rows and down columns; norms replicated),
    generated per rank, and its KV cache ``[B, kv_heads / R, cache, d]`` per layer."""

    def __init__(self, b: Bench, dims: str) -> None:
        hidden, ffn, heads, kv_heads = DIMS[dims]
        R, self.b, self.hidden, self.d = b.R, b, hidden, hidden // heads
        if heads % R or kv_heads % R or ffn % R:
            raise ValueError(f"{dims}: heads ({heads}), kv heads ({kv_heads}) and ffn ({ffn}) "
                             f"must be divisible by {R} ranks")  # fmt: skip
        self.heads, self.kv_heads, self.ffn = heads // R, kv_heads // R, ffn // R
        d, gen, same = self.d, b.rng(7, True), b.rng(5, False)
        self.parts = [self.heads * d, self.kv_heads * d, self.kv_heads * d]

        def norm():
            return (1 + b.randn(hidden, gen=same, scale=0.1)).to(b.dtype)

        self.layers = [
            dict(norm1=norm(), wqkv=b.randn(sum(self.parts), hidden, gen=gen, scale=hidden**-0.5),
                 wo=b.randn(hidden, self.parts[0], gen=gen, scale=(heads * d) ** -0.5),
                 norm2=norm(), w13=b.randn(2 * self.ffn, hidden, gen=gen, scale=hidden**-0.5),
                 w2=b.randn(hidden, self.ffn, gen=gen, scale=ffn**-0.5))
            for _ in range(b.args.layers)
        ]  # fmt: skip
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.ops: dict[str, list] = {}

    def new_cache(self, B: int) -> None:
        """A KV cache for ``B`` sequences (0: none), random (this rank's heads)."""
        self.cache = []
        gen = self.b.rng(B, True)
        for _ in self.layers if B else ():
            shape = (B, self.kv_heads, self.b.args.cache, self.d)
            self.cache.append((self.b.randn(*shape, gen=gen), self.b.randn(*shape, gen=gen)))

    def step(self, mode: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """``mode``'s decode step: ``h [B, hidden]`` (replicated) -> the next hidden states."""
        if mode not in self.ops:
            b = self.b
            self.ops[mode] = [
                (row_op(mode, "all_reduce", lay["wo"], b.group, b.symm),
                 row_op(mode, "all_reduce", lay["w2"], b.group, b.symm))
                for lay in self.layers
            ]  # fmt: skip
        ops, d, width = self.ops[mode], self.d, (self.hidden,)

        def step(h: torch.Tensor) -> torch.Tensor:
            B = h.shape[0]
            for lay, (o_proj, down), (k_cache, v_cache) in zip(self.layers, ops, self.cache,
                                                               strict=True):  # fmt: skip
                a = F.rms_norm(h, width, lay["norm1"], EPS)
                q, k, v = (a @ lay["wqkv"].t()).split(self.parts, dim=-1)
                k_cache[:, :, -1].copy_(k.view(B, self.kv_heads, d))  # (the new token's slot)
                v_cache[:, :, -1].copy_(v.view(B, self.kv_heads, d))
                q = q.reshape(B, self.heads, 1, d)
                o = F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)
                h = h + o_proj(o.reshape(B, self.heads * d))
                a = F.rms_norm(h, width, lay["norm2"], EPS)
                gate, up = (a @ lay["w13"].t()).chunk(2, dim=-1)
                h = h + down(F.silu(gate) * up)
            return h

        return step


# -- the report --------------------------------------------------------------------------------
def _speedups(rows: dict, unit: str) -> None:
    """Each row's ``eager_x_nccl`` and ``captured_x_nccl``: nccl's time over the row's."""
    base = rows.get("nccl", {})
    for r in rows.values():
        for kind in ("eager", "captured"):
            t, b = r.get(f"{kind}_{unit}"), base.get(f"{kind}_{unit}")
            r[f"{kind}_x_nccl"] = b / t if t and b else None


def _progress(key: str, rows: dict, unit: str) -> str:
    """One line per cell: eager / captured time per mode."""

    def t(v):
        return "-" if v is None else f"{v:.1f}" if unit == "us" else f"{v:.3f}"

    cells = [f"{m} {t(r[f'eager_{unit}'])}/{t(r[f'captured_{unit}'])}" for m, r in rows.items()]
    return f"{key} (eager/captured {unit}): " + ", ".join(cells)


def _tables(b: Bench) -> None:
    """Per part and kind (eager, captured): a row per cell, a column per mode, its time (x
    nccl's time over its); FAIL where the mode disagreed or raised, "-" where it did not run."""
    for part, unit, what in (("sweep", "us", "per op"), ("decode", "ms", "per step")):
        rows = [r for r in b.rows if r["part"] == part]
        for coll in sorted({r.get("collective") for r in rows}, key=str):
            mine = [r for r in rows if r.get("collective") == coll]
            cells: dict = {}  # cell key: (label, {mode: row})
            for r in mine:
                label = f"{r['dims']} {r['proj']} M={r['M']}" if part == "sweep" else \
                    f"{r['dims']} B={r['B']}"  # fmt: skip
                cells.setdefault(_row_key(r).rsplit("/", 1)[0], (label, {}))[1][r["mode"]] = r
            modes = [m for m in b.args.modes if any(m in by for _, by in cells.values())]
            for kind in ("eager", "captured"):
                if not any(r[f"{kind}_{unit}"] is not None for r in mine):
                    continue
                print(f"\n{part}{' ' + coll if coll else ''}, {kind}, {unit} {what} (x nccl)")
                print(f"{'cell':22} " + " ".join(f"{m:>16}" for m in modes))
                for key, (label, by) in cells.items():
                    out = []
                    for m in modes:
                        r, mk = by.get(m), f"{key}/{m}"
                        t = None if r is None else r[f"{kind}_{unit}"]
                        x = None if r is None else r[f"{kind}_x_nccl"]
                        text = "-" if t is None else f"{t:.1f}" if unit == "us" else f"{t:.3f}"
                        text += f" ({x:.2f})" if x else ""
                        if any(k == mk or k.startswith(mk + "/") for k in b.failed):
                            text = f"FAIL {text}"
                        out.append(f"{text:>16}")
                    print(f"{label:22} " + " ".join(out))
    for m, why in b.skipped.items():
        print(f"{m}: not run ({why})")
    if b.captured_skipped:
        print(f"captured: not run ({b.captured_skipped})")
    for k, why in {**b.cell_skipped, **b.unsupported}.items():
        print(f"{k}: not run ({why})")
    for k, why in b.failed.items():
        print(f"{k}: FAILED ({why})")


def _row_key(r: dict) -> str:
    """The key a row's cell and mode are recorded under (``errors``, ``failed``)."""
    if r["part"] == "sweep":
        return f"sweep/{r['collective']}/{r['dims']} {r['proj']}/M={r['M']}/{r['mode']}"
    return f"decode/{r['dims']}/B={r['B']}/{r['mode']}"


def bench(args: argparse.Namespace, dev: torch.device, timing_meaningful: bool) -> None:
    """Both parts on every rank; rank 0 prints the tables and writes the JSON; exits
    non-zero where a mode disagreed with nccl (or the library raised)."""
    elapsed = {}
    with torch.no_grad():
        b = Bench(args, dev)
        for part in args.parts:
            t0 = time.perf_counter()
            getattr(b, part)()
            elapsed[part] = time.perf_counter() - t0
    overlap.release(b.group)
    if b.rank == 0:
        _tables(b)
        extra = dict(failed=b.failed, unsupported=b.unsupported, skipped=b.skipped,
                     cell_skipped=b.cell_skipped, captured_skipped=b.captured_skipped,
                     elapsed_s=elapsed)  # fmt: skip
        print("elapsed:", ", ".join(f"{k} {v:.0f} s" for k, v in elapsed.items()))
        write_json(args, dev, b.R, timing_meaningful, b.rows, b.errors, b.tol, extra)
    if b.failed:
        raise SystemExit(f"decode_bench.py: {len(b.failed)} cells failed: {sorted(b.failed)}")


def main() -> None:
    """Parses the arguments; spawns 2 CPU ranks, or runs as a torchrun worker."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(ap, SMALL, "bench_out/decode_bench.json")
    ap.add_argument("--dims", default=None, help="comma-separated, from "
                    f"{', '.join(DIMS)} (default: small on CPU, 8b,70b on GPUs)")  # fmt: skip
    ap.add_argument("--ms", default=None, help="the sweep's M, comma-separated")
    ap.add_argument("--bs", default=None, help="the decode's batch sizes, comma-separated")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated (nccl included)")
    ap.add_argument("--parts", default="sweep,decode", help="sweep, decode or both")
    ap.add_argument("--quick", action="store_true", help="a small subset, few rounds")
    args = ap.parse_args()
    cpu = args.cpu or not (args.one_gpu or torch.cuda.is_available())
    if args.quick:
        for k, v in dict(iters=1 if cpu else 5, warmup=0 if cpu else 2, replays=10).items():
            setattr(args, k, v if getattr(args, k) is None else getattr(args, k))
    cpu = fill_defaults(args, SMALL, LARGE)
    quick = args.quick
    args.dims = (args.dims or ("small" if cpu else "8b" if quick else "8b,70b")).split(",")
    ms = CPU_QUICK_MS if cpu and quick else CPU_MS if cpu else QUICK_MS if quick else MS
    bs = CPU_BS if cpu else QUICK_BS if quick else BS
    args.ms = [int(m) for m in args.ms.split(",")] if args.ms else list(ms)
    args.bs = [int(x) for x in args.bs.split(",")] if args.bs else list(bs)
    args.modes = [m for m in args.modes.split(",") if m]
    args.parts = [p for p in args.parts.split(",") if p]
    bad = [m for m in args.modes if m not in MODES] + [d for d in args.dims if d not in DIMS] + \
        [p for p in args.parts if p not in ("sweep", "decode")]  # fmt: skip
    if bad or "nccl" not in args.modes or not args.parts:
        sys.exit(f"decode_bench.py: --modes from {MODES} with nccl, --dims from {tuple(DIMS)}, "
                 f"--parts from sweep, decode (got {bad or args.modes})")  # fmt: skip
    args.modes.sort(key=MODES.index)  # (nccl first: the reference)
    launch(args, cpu, bench, "decode_bench.py")


if __name__ == "__main__":
    main()
