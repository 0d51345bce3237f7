"""The call engine: the stages every overlapped op runs, in order, each decided once.

1. check the arguments (the op's file, with ``_checks.py``);
2. ``decide``: what the same arguments were decided to run before (``context.calls``, by the
   call's ``graphs.signature``), else the context of (group, device, caller stream); the
   transport (``comm.select``: the capture fit and every plain-path reason decided here,
   before planning); the plan for it (``make_plan``: what ``overlap.plan`` returns and
   validation mode fingerprints). Nothing later changes the plan;
3. the output made, or the caller's checked (``check_out``, at every call: its address and
   device are in no key); a recorded eager call replays its CUDA graph here
   (``graphs.replay``);
4. validation mode's agreement (``guard.agree``), before anything is launched;
5. the producer: the GEMM (``produce``: the Triton kernel counting finished tiles per
   chunk), or the uneven exchanges' own (cuBLAS per band, ``exchange.py``, ``bags.py``);
6. the transport moves the chunks on the communication stream, each after its chunk;
7. the consumer (the all-gather's and the dispatch's matmuls, each after its chunk arrived);
8. the caller stream waits for the communication stream.

A repeated eager call of the matmul + collective family without ``out=`` or autograd whose
signature the memo holds with the plain path skips stages 1-4 (``plain_again``: the checks
passed for the same values; validation mode keeps no memo): the host time of a product too
small to overlap stays near torch's own.

An all-reduce small enough for the latency all-reduce (``comm.shot.kind``), ``backend="auto"``,
no ``chunks``, takes the plain path with it (``_shot``), also where the call would otherwise
overlap (``comm/shot.py``'s crossovers): on a group whose GPUs map each other's memory (road
"peer"), bf16 or fp32 up to ``comm.shot.SHOT_BYTES``, the product stored into the group's
symmetric buffer and torch's one-shot or two-shot kernel (``Plan.transport`` "one-shot" /
"two-shot"); without P2P (road "host"), up to ``comm.shot.HOST_SHOT_BYTES``, the library's
one-shot kernel through the pinned host buffer (``gemm/shot.py``, "host one-shot").

The direction decides 5-7: a collective *after* the matmul (``run_after``: the kernel
produces, the transport moves) or *before* it (``run_before``: the transport gathers, cuBLAS
consumes band by band). An uneven exchange (the all-to-all with splits, the MoE combine and
dispatch, the embedding bags) is decided by ``decide_exchange`` (no memo: its splits change
from call to call) and run by ``run_exchange``: stages 4 and 8, the count and the watch as
above, around the op's own 5-7 (its ``issue``). Every call is counted by path
(``overlap.stats``).

Hazards: calls on one stream are serialized by that stream (the caller waits for the
communication stream at the end of every call, which also makes buffers allocated on the
caller stream safe to reuse); calls of two streams through the copy engines are serialized
too (they share the group's buffers, ``overlap/context.py``). Calls can be captured in CUDA
graphs after one eager warm-up call of the same shapes: every call's chunk counters and the
copy engines' flags are zeroed by the call itself, so a replay repeats it exactly; the
warm-up sizes the copy engines' buffers, which a capture cannot (without it a captured call
takes NCCL). A graph's replays must not run beside the group's calls on other streams. The
first call of a group on a CUDA device asks every rank which road the copy engines have (a
collective), so every rank must make it. The Triton interpreter is used for CPU tensors only
when ``TRITON_INTERPRET=1`` is set before ``overlap`` first launches a kernel (Triton reads it
when the kernel is defined).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import math
import os
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import comm, graphs, guard, stats
from ..collectives import collective
from ..comm import TorchTransport, Transport, shot
from ..context import Context, calls, context, tuned, tuned_key
from ..plan import (
    GatherPlan,
    Plan,
    SplitPlan,
    gemm_outlasts,
    make_plan,
    make_split_plan,
    splits_rows,
    tiles_for,
)
from ..signal import wait_counter
from ._checks import (
    Call,
    capturing,
    check_operands,
    check_out,
    check_splits,
    needs_grad,
    num_sms,
    world,
)


# -- decide (stage 2) ------------------------------------------------------------------------
class Known(NamedTuple):
    """What a call was decided to run: its plan, context and transport class (None at world
    size 1 or on the plain path: nothing to record or replay) and its result's shape (the
    all-gather's ``[R m, N]``), its path as ``overlap.stats`` counts it and the factor its
    result takes (``how``, ``_scale``: made once, not at every call)."""

    plan: Plan | GatherPlan
    ctx: Context | None
    cls: type[Transport] | None
    shape: tuple[int, ...]
    how: str
    scale: float | None


# calls kept in ``context.calls`` before it is emptied (a model's call sites are a few hundred)
MAX_CALLS = 4096

# a context that does nothing (a call outside validation mode, on its own device): one
# instance for every call (a nullcontext made per call costs a Python call)
_NOTHING = contextlib.nullcontext()


def decide(x, w, call: Call, capturing: bool, sig: tuple | None) -> Known:
    """What a checked call runs: looked up by its signature ``sig`` (``graphs.signature``;
    None while capturing or validating: decided afresh), else decided and kept under it."""
    known = calls.get(sig) if sig is not None else None
    if known is not None:
        return known
    p, ctx, cls = _decide(x, w, call, capturing)
    R = p.world_size
    shape = (p.M, w.shape[1]) if p.spec.before else p.spec.result_shape(tuple(x.shape), p.N, R)
    known = Known(p, ctx, cls, shape, how(p), _scale(call.op, R))
    if sig is not None:  # (not while capturing: its choice depends on the transport's buffers)
        if len(calls) >= MAX_CALLS:
            calls.clear()
        calls[sig] = known
    return known


def _decide(x, w, call: Call, capturing: bool):
    """``(plan, context, transport class)`` of a checked call (``Known``)."""
    name, group, _, backend, chunks = call
    R, bits, spec = world(group), x.element_size() * 8, collective(name)
    M, K, N = math.prod(x.shape[:-1]) * (R if spec.before else 1), x.shape[-1], w.shape[1]
    if spec.before:  # the all-gather's plan never depends on N: the ranks' N may differ
        N = 0
    if R == 1:
        p = make_plan(M, N, K, world_size=1, collective=name, dtype_bits=bits, chunks=chunks)
        return p, None, None
    if spec.splits_rows and M % R:
        raise ValueError(f"{name} needs M ({M}) divisible by the world size ({R})")
    ctx = context(group, x.device)  # (ctx.group: None resolved to the default group)
    road = comm.road(ctx.group, x.device, capturing) if x.is_cuda else None  # a collective, once
    choice = tuned(ctx, tuned_key(M, N, K, x.dtype, name)) if chunks is None else None
    # The latency all-reduce (comm/shot.py: over the GPUs' mapped memory, or through the
    # pinned host buffer without P2P), decided before anything of this rank's own (K) can send
    # it elsewhere than its peers; a tuned "plain" is it (overlap.tune times "plain" through
    # the tuned choices), a tuned chunk count is not.
    if spec.replicated and backend == "auto" and chunks is None and type(choice) is not int:
        kind = shot.kind(M * N * x.element_size(), x.dtype, road, R)
        if kind is not None and not comm.ready(shot.transport(kind), ctx.group, x.device,
                                               capturing):  # fmt: skip
            kind = None  # (not made: while capturing, or its making failed on a rank)
        if kind is not None:  # (in place of an overlapped call too: comm/shot.py's crossovers)
            why = f"{kind} all-reduce: its transfer is shorter than an overlapped call's cost"
            return Plan("fallback", why, name, M, N, K, R, transport=kind), ctx, None
    why = None
    if K == 0:  # (the kernel needs K > 0)
        why = "K = 0: nothing to overlap (the product is zeros, as torch.matmul's)"
    elif x.is_meta:
        why = "meta tensors: shapes only (torch's collectives do nothing on them)"
    elif not x.is_cuda and not spec.before:  # (the all-gather runs no kernel)
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            why = "CPU tensors and TRITON_INTERPRET is not 1"
        elif x.dtype == torch.bfloat16:
            why = f"the Triton interpreter computes bfloat16 products wrongly ({_triton()})"
    if why is None and chunks is None:
        if choice == "plain":
            why = "overlap.tune measured the plain path fastest"
        chunks = None if choice == "plain" else choice
    if why is not None:
        p = GatherPlan("fallback", why, M, K, R) if spec.before else \
            Plan("fallback", why, name, M, N, K, R)  # fmt: skip
        return p, ctx, None

    def fits(cls: type[Transport]) -> bool:  # a capture uses the buffers an eager call sized
        t = comm.shared(cls, ctx.group, x.device)
        return t is not None and t.fits(M, N, K, spec, x.dtype)

    cls = comm.select(
        backend, road, eligible=x.is_cuda, world_size=R,
        rows_split=splits_rows(M, name, R, tiles_for(M, bits, interpreter=not x.is_cuda)),
        rows_divisible=M % R == 0, fits=fits if capturing else None,
    )  # fmt: skip
    p = make_plan(
        M, N, K, world_size=R, collective=name, dtype_bits=bits, interpreter=not x.is_cuda,
        num_sms=num_sms(x.device), chunks=chunks, blocked=cls.blocked, transport=cls.name,
        link=road or "network",
    )  # fmt: skip
    return p, ctx, cls if p.path == "overlap" else None  # (a small product: the plain path)


@functools.cache
def _triton() -> str:
    """The installed Triton's name and version, read without importing it."""
    try:
        return f"triton {importlib.metadata.version('triton')}"
    except importlib.metadata.PackageNotFoundError:
        return "triton"


def how(p: Plan | GatherPlan | SplitPlan) -> str:
    """The path of plan ``p`` as ``overlap.stats`` counts it."""
    if p.path == "overlap":
        return f"overlap via {p.transport}"
    return f"plain via {p.transport}" if p.transport in shot.KINDS else f"plain: {p.reason}"


def plan(
    x: torch.Tensor,
    w: torch.Tensor,
    collective: str = "all_reduce",
    *,
    group: dist.ProcessGroup | None = None,
    chunks: int | None = None,
    backend: str = "auto",
    input_split_sizes: list[int] | None = None,
    output_split_sizes: list[int] | None = None,
) -> Plan | GatherPlan | SplitPlan:
    """The plan a call with these arguments runs: ``path`` ("overlap" or "fallback"), the
    ``transport`` that moves its chunks, the chunks and tiles (the all-gather's: its gather
    bands, ``GatherPlan``), and ``reason``; ``plan(...).describe()`` prints it.

    Like the call, the first one of a group on a CUDA device asks every rank which road the
    copy engines have, and the first whose product the latency all-reduce takes makes its
    buffers (collectives): every rank of ``group`` calls it then.

    Args:
        x: ``[..., K]`` (for ``"all_gather"``: this rank's shard). w: ``[K, N]`` (the MoE
            ops' ``[E, K, N]``: pass one expert's ``w[0]``).
            collective, group, chunks, backend: as in ``matmul_collective`` (and
            ``"all_gather"``: ``all_gather_matmul``'s plan).
        input_split_sizes, output_split_sizes: an uneven all-to-all's splits (the MoE
            combine and dispatch run the same plan): its ``SplitPlan``.

    Raises:
        ValueError, TypeError: on invalid arguments (the same checks as the call).
    """
    call = Call(collective, group, "sum", backend, chunks)
    check_operands(x, w, call)
    if input_split_sizes is None and output_split_sizes is None:
        cap = capturing(x)
        sig = None if cap else graphs.signature(x, w, *call)
        return decide(x, w, call, cap, sig).plan
    sends, receives = check_splits(x, collective, input_split_sizes, output_split_sizes, group)
    return decide_exchange((sends, receives), w.shape[-1], x.shape[-1], call)[0]


def decide_exchange(
    splits: tuple[tuple[int, ...], tuple[int, ...]], N: int, K: int, call: Call
) -> tuple[SplitPlan, type[Transport]]:
    """What an uneven exchange ``call`` runs (``run_exchange``): ``(plan, transport class)``
    for ``splits = (sends, receives)``, ``sends[j]`` rows of ``[M, K] @ [K, N]`` to rank
    ``j``, ``receives[s]`` from rank ``s``, through ``comm.select_uneven(call.backend)``."""
    cls = comm.select_uneven(call.backend)
    return make_split_plan(*splits, N, K, chunks=call.chunks, transport=cls.name), cls


def _agree(group, p: Plan | GatherPlan | SplitPlan, dtype, op: str = "sum", what: str = "",
           sizes: dict | None = None) -> None:  # fmt: skip
    """Validation mode's agreement on a call of plan ``p`` with reduction ``op``
    (``guard.fingerprint``): after the matmul the product's ``M`` and ``N`` travel (``K``
    is this rank's own); the all-gather moves ``[M, K]`` (``N`` is this rank's own); an
    uneven exchange: the op ``what``, its ``sizes`` (every rank's ``M`` differs) and the
    splits (what each rank sends the other is what that one receives)."""
    splits = None
    if isinstance(p, SplitPlan):
        splits = p.splits
    elif isinstance(p, GatherPlan):
        what, sizes = "all_gather_matmul", {"M": p.M, "K": p.K}
    else:
        what, sizes = f"matmul_{p.collective}({op})", {"M": p.M, "N": p.N}
    guard.agree(group, guard.fingerprint(what, dtype, sizes, p.layout()), p.describe(), splits)


def _watch(ctx: Context, cls, p: Plan | GatherPlan, x: torch.Tensor, capturing: bool):
    """Validation mode's watch of the call issued inside it (``guard.Watch``; none while
    capturing: a capturing stream cannot be queried)."""
    if capturing or not x.is_cuda:
        return _NOTHING
    if p.path != "overlap":  # the plain path: the caller stream, the group's own collectives
        s = torch.cuda.current_stream(x.device)  # (or the latency all-reduce's)
        cls = shot.transport(p.transport) if p.transport in shot.KINDS else TorchTransport
    else:
        s = ctx.comm_stream
    return guard.Watch(s, lambda why: ctx.transport(cls).fail(why), p.describe())


def _issued(t: Transport, ctx: Context, p: Plan | GatherPlan) -> None:
    """Validation off: the call of plan ``p`` just issued through ``t`` is watched until it
    is done, where ``t`` declares ``watched`` (``guard.Watchdog``; validation mode's
    ``Watch`` waits for every call itself). The eager paths check ``cls.watched`` first: the
    transport's lookup is host time a call through NCCL need not pay."""
    if t.watched:
        guard.watchdog.issued(t, ctx.caller, p)


# -- after the matmul ------------------------------------------------------------------------
def run_after(x, w, call: Call, label: str, out=None, sig=None, cover: tuple = ()) -> torch.Tensor:
    """A checked matmul + collective call ``call`` without autograd, into ``out`` (None: a new
    tensor); ``label``: the op, as ``overlap.stats`` counts it; ``sig``: the call's signature
    where ``plain_again`` made it (an eager call, not captured), None to make it here;
    ``cover``: ``(a, b, c)``, a product ``c = a @ b`` (the backward's weight gradient) issued
    on the caller stream where it would otherwise wait for the transfers (``produce``), where
    the transport ``covers``; else (and on the plain path) after the call."""
    cap = sig is None and capturing(x)  # (plain_again makes no signature while capturing)
    if sig is None and not cap:
        sig = graphs.signature(x, w, *call)
    p, ctx, cls, shape, path, scale = decide(x, w, call, cap, sig)
    if cover and not (cls is not None and cls.covers):  # after the call (``Transport``)
        y = run_after(x, w, call, label, out, sig)
        torch.matmul(*cover[:2], out=cover[2])
        return y
    if out is not None:
        check_out(out, shape, x, w)
    M, N = p.M, p.N
    validating = ctx is not None and guard.validating()
    if validating:
        _agree(call.group, p, x.dtype, call.op)
    if cls is None:  # the plain path (or world size 1)
        stats.count(label, path)
        with _watch(ctx, cls, p, x, cap) if validating else _NOTHING:
            return plain(x, w, out, p, scale, call.group, shape, ctx)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    key = None
    if sig is not None and cls.recorded and x.is_cuda:
        key = (sig, graphs.outputs(out, *cover))
        replayed = graphs.replay(key, graphs.bases(x, out, *cover))  # a recorded call again
        if replayed is not None:
            stats.count(label, "replayed via " + replayed.name)
            _issued(replayed, ctx, p)
            return out
    x2 = x if x.dim() == 2 else x.reshape(M, p.K)
    out2 = out if out.dim() == 2 else out.view(M, N)  # (-1: ambiguous when N = 0)
    with _watch(ctx, cls, p, x, cap) if validating else _NOTHING:
        issue = functools.partial(overlapped, x2, w, out2, p, scale, ctx, cls, cover=cover)
        if x2.data_ptr() != x.data_ptr():  # (a copy made x 2-D: nothing to record)
            key = None
        # (a cover's cuBLAS kernel: not rebound, as the all-gather's)
        updated = graphs.recorded(issue, ctx, cls, capturing=cap, key=key,
                                   moved=(x, out, *cover), rebound=not cover)  # fmt: skip
        stats.count(label, "updated via " + cls.name if updated else path)
        if cls.watched and not (cap or validating):
            _issued(ctx.transport(cls), ctx, p)
    return out


def plain_again(x, w, collective, group, op, backend, chunks, label: str) -> tuple:
    """``(result, None)`` for an eager call without ``out`` or autograd whose signature the
    memo holds with the plain path (a call with the same values passed every check and was
    decided before): ``x @ w`` and the collective, with nothing else looked at (host time
    within a few microseconds of torch's own). Otherwise ``(None, sig)``: the call takes the
    full way (``run_after``), whose checks raise for invalid arguments; ``sig`` is the
    signature made here for it (None where none was: autograd, compile, capture, unhashable
    or non-tensor arguments). The values come as a ``Call``'s, in its order, but not in one:
    a ``NamedTuple`` made per call costs a Python call, more than the fast lane's own work
    saves of it.

    A capture is looked at only where the memo does not answer (a CUDA call costs host time):
    a call the memo holds with the plain path was decided so eagerly, with the group's road
    known, and a capture decides the same (it can only take a transport with more host time
    than the eager call's, ``comm.select``), so the plain path is what the full way would
    capture too."""
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)) or \
            (chunks is not None and type(chunks) is not int) or needs_grad(x, w) or \
            torch.compiler.is_compiling():  # fmt: skip
        return None, None
    try:
        sig = graphs.signature(x, w, collective, group, op, backend, chunks)
        known = calls.get(sig) if sig is not None else None
    except TypeError:  # an unhashable argument: the checks name it
        return None, None
    # (an all-gather's signature: all_gather_matmul made it, not this op)
    if known is None or known.cls is not None or known.plan.spec.before:
        return None, None if capturing(x) else sig
    p = known.plan
    stats.count(label, known.how)
    return plain(x, w, None, p, known.scale, group, known.shape, known.ctx), None


def _scale(op: str, R: int) -> float | None:
    """The factor an ``avg`` call's result takes (None: none)."""
    return 1.0 / R if op == "avg" and R > 1 else None


def overlapped(
    x2: torch.Tensor,
    w: torch.Tensor,
    out2: torch.Tensor,
    p: Plan,
    scale: float | None,
    ctx: Context,
    cls: type[Transport],
    capturing: bool,
    trace=None,
    cover: tuple = (),
) -> None:
    """Stages 5-8 of plan ``p`` (``p.path == "overlap"``) on the current stream, with the
    context's transport, streams and counters: ``produce``. (``tools/timeline.py`` calls it
    directly, with ``trace``.)"""
    transport = ctx.transport(cls, capturing)
    s = ctx.comm_stream  # None on CPU: the interpreter runs the kernel to completion, then gloo
    caller = torch.cuda.current_stream(x2.device) if s is not None else None
    # Counters zeroed on the caller stream before `s` forks from it: this stream's (the
    # previous call's waits on them are over: the caller stream waited for `s`), or a captured
    # call's own, from the graph's pool (a capture cannot make the stream's: a thread making
    # memory while the capture's stream records is refused), zeroed at every replay.
    if capturing:
        counters = torch.zeros(p.n_chunks, dtype=torch.int32, device=x2.device)
    else:
        counters = ctx.counters
        counters.zero_()
    with _on_device(x2):
        produce(x2, w, out2, p, scale, transport, counters, caller, s, trace, cover)


def _on_device(t: torch.Tensor):
    """``t``'s device made current where it is not (the switch costs host time)."""
    other = t.is_cuda and t.get_device() != torch.cuda.current_device()  # (t.device: an object)
    return torch.cuda.device(t.device) if other else _NOTHING


def produce(
    x2, w, out2, p: Plan, scale, transport: Transport, counters, caller, s, trace=None,
    cover: tuple = (),
) -> None:  # fmt: skip
    """The GEMM of ``x2 [M, K] @ w [K, N]`` on ``caller`` counting each chunk's finished tiles
    in ``counters``, and the transport issuing chunk ``c`` on ``s`` once its counter is
    reached; ``caller`` then waits for ``s``. ``caller`` and ``s`` are None on CPU (the
    interpreter runs the kernel to completion, then the transport runs on the host).

    ``cover``: ``(a, b, c)``, ``c = a @ b`` on ``caller`` where the GEMM would wait for the
    transfers: with a copy-engine epilogue between the peers' blocks' tiles and this rank's
    own block (whose tiles wait for the peers' partials, which travel meanwhile), else after
    the GEMM (beside the last chunks' collectives).

    ``trace``: ``trace.tiles`` goes to the kernel, and ``trace.stamp(i)`` is called on the
    communication stream when chunk ``i // 2`` is ready (even ``i``) and when its transfer
    has finished (odd ``i``)."""
    slots, epilogue = transport.begin(p, out2, caller)
    targets = p.tiles_per_chunk

    def wait(c: int, ops=None) -> None:  # (ops: the copy engines' batch, transport.py)
        if trace is not None and c:
            trace.stamp(2 * c - 1)
        wait_counter(counters, c, targets[c], s, ops)
        if trace is not None:
            trace.stamp(2 * c)

    if s is not None:
        s.wait_stream(caller)  # inputs and buffers are ready before `s` touches them
    tiles = trace.tiles if trace is not None else None
    parts = ("peers", "own") if cover and epilogue is not None else ("all",)
    for part in parts:
        _gemm().chunked_matmul(x2, w, slots, counters, p, scale, epilogue=epilogue,
                               trace=tiles, part=part)  # fmt: skip
        if cover and part != "own":
            torch.matmul(*cover[:2], out=cover[2])
    guard.arm()  # (after the kernel: its first launch compiles it)
    try:
        transport.run(p, slots, out2, wait, s)
        if trace is not None:
            with torch.cuda.stream(s):
                trace.stamp(2 * p.n_chunks - 1)
    finally:
        if s is not None:
            # The caller continues after the last transfer, so buffers allocated on it are
            # free to reuse once this call's work on `s` is done (also when a chunk's
            # collective raised: the chunks issued before it still use them).
            caller.wait_stream(s)


def plain(x, w, out, p: Plan, scale: float | None, group, shape, ctx=None) -> torch.Tensor:
    """The sequential path: ``x @ w``, then one torch collective on the whole product (or the
    latency all-reduce of ``p.transport``, through ``ctx``), into ``out`` (None: a new tensor
    of the result's ``shape``); returns the result."""
    spec, R = p.spec, p.world_size
    if p.transport in shot.KINDS:
        return _shot(x, w, out, p, scale, ctx, shape)
    if R > 1 and spec.splits_rows:  # reduce-scatter and all-to-all cannot run in place
        y = (x if x.dim() == 2 else x.reshape(p.M, p.K)) @ w
        if scale is not None:
            y.mul_(scale)
        if out is None:
            out = y.new_empty(shape)
        spec.plain(y, out if out.dim() == 2 else out.view(p.M, p.N), group)
        return out
    if R == 1 and spec.scatters and x.dim() != 2:  # (its result is [M, N])
        x = x.reshape(p.M, p.K)
    y = torch.matmul(x, w, out=out)
    if scale is not None:
        y.mul_(scale)
    if R > 1:  # the all-reduce, in place
        spec.plain(y, y, group)
    return y


def _shot(x, w, out, p: Plan, scale: float | None, ctx: Context, shape) -> torch.Tensor:
    """``x @ w`` stored into this rank's buffer of the group's latency all-reduce transport
    (``comm.shot.transport(p.transport)``), then its reduction into ``out`` on the caller
    stream: torch's one-shot or two-shot kernel, or the library's through host memory
    (``gemm/shot.py``); an eager call is watched (``_issued``). Decode's eager steps are
    host-bound: each step here was timed on an H200 host (``bench_results/
    host_time_shot_ab_h200.json``: no import statement, no view, no stream hashed, the
    result made like the partial)."""
    cap = torch.cuda.is_current_stream_capturing()
    t = ctx.transport(shot.transport(p.transport), cap)  # (made by ``_decide``: comm.ready)
    t.callers.add(ctx)  # (a context hashes by identity: a stream's hash is Python code)
    part = t.partial(shape, x.dtype)
    torch.matmul(x, w, out=part)
    if scale is not None:
        part.mul_(scale)
    if out is None:
        out = torch.empty_like(part)  # (2.0 us of host time; torch.empty with arguments 3.8)
    if x.get_device() == torch.cuda.current_device():  # (no context manager: host time)
        _reduce(t, p.transport, part, out)
    else:
        with torch.cuda.device(x.device):
            _reduce(t, p.transport, part, out)
    if not (cap or guard.validating()):  # (validation mode watches the call itself)
        _issued(t, ctx, p)
    return out


def _reduce(t: Transport, kind: str, part: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = the sum over the ranks of their ``part`` through ``t``, the latency
    all-reduce ``kind`` (contiguous tensors: the host one-shot reads them flat; its launch
    is bound once per partial buffer, ``gemm.shot.HostShot``, kept in ``t.sites``)."""
    if kind == "host one-shot":
        site = t.sites.get(part)  # (a tensor hashes by identity: the view ``partial`` keeps)
        if site is None:
            site = t.sites[part] = _gemm().shot.HostShot(part, t.regions, t.state,
                                                          t.slot_bytes, t.rank)  # fmt: skip
        site(out)
    else:
        t.reduce(part, out, kind == "two-shot")


@functools.cache
def _gemm():
    """``overlap.gemm`` with its ``shot`` module (Triton), imported at the first call that
    launches a kernel: an import statement in a function costs ~2.5 us at every call."""
    from .. import gemm
    from ..gemm import shot as _  # noqa: F401 (``gemm.shot``)

    return gemm


# -- before the matmul -----------------------------------------------------------------------
def run_before(x, w, call: Call, out, keep: bool, cover: tuple = ()):
    """A checked ``all_gather_matmul`` call ``call`` (its collective "all_gather") without
    autograd, into ``out`` (None: a new tensor): ``(out, x_full)``, the second
    ``[R m, K]`` when ``keep`` (or a cover needed it) else empty; ``cover``: ``(b, c)``,
    ``c = x_full^T @ b`` (the backward's weight gradient, ``x`` the result's gradient) on the
    caller stream, this rank's rows' share while the others travel (``consume``), where the
    transport ``covers``; else (and on the plain path) after the call."""
    cap = capturing(x)
    sig = None if cap else graphs.signature(x, w, *call)
    p, ctx, cls, shape, path, _ = decide(x, w, call, cap, sig)
    if cover and not (cls is not None and cls.covers):  # after the call (``Transport``)
        out, full = run_before(x, w, call, out, True)
        torch.matmul(full.t(), cover[0], out=cover[1])
        return out, full if keep else x.new_empty(0)
    M, K, R = p.M, p.K, p.world_size
    if out is None:
        out = x.new_empty(shape)
    else:
        check_out(out, shape, x, w)
    keep = keep or bool(cover) and not p.blocked  # (NCCL's slots, reused: a cover reads x_full)
    key = None
    if sig is not None and cls is not None and cls.recorded and x.is_cuda:
        full = x.new_empty((M, K) if keep else (0,))  # (outside a recorded graph's pool)
        key = (sig, graphs.outputs(out, full, *cover))
        replayed = graphs.replay(key, graphs.bases(x, out, full, *cover))  # recorded: again
        if replayed is not None:
            stats.count("all_gather_matmul", "replayed via " + replayed.name)
            _issued(replayed, ctx, p)
            return out, full
    x2 = x.reshape(M // R, K)
    validating = ctx is not None and guard.validating()
    if validating:
        _agree(call.group, p, x.dtype)
    with _watch(ctx, cls, p, x, cap) if validating else _NOTHING:
        if p.path != "overlap":
            stats.count("all_gather_matmul", path)
            full = x2
            if R > 1:
                full = x.new_empty(M, K)
                p.spec.plain(x2.contiguous(), full, call.group)
            torch.matmul(full, w, out=out)
            full = (full if R > 1 else full.clone()) if keep else x.new_empty(0)  # (R = 1: x)
        else:
            if key is None:
                full = x.new_empty((M, K) if keep else (0,))
            elif x2.data_ptr() != x.data_ptr():  # (a copy made x 2-D: nothing to record)
                key = None
            issue = functools.partial(_gathered, x2, w, out, full, p, ctx, cls, cover=cover)
            moved = (x, out, full, *cover)  # (cuBLAS kernels: not rebound)
            updated = graphs.recorded(issue, ctx, cls, capturing=cap, key=key, moved=moved,
                                       rebound=False)  # fmt: skip
            stats.count("all_gather_matmul", "updated via " + cls.name if updated else path)
            if cls.watched and not (cap or validating):
                _issued(ctx.transport(cls), ctx, p)
    return out, full


def _outlasts(p: GatherPlan, N: int, itemsize: int, road: str | None) -> bool:
    """Whether this rank's own product ``[M / R, K] @ [K, N]`` takes longer than the other
    shards' transfer, at the planner's rates (``plan.gemm_outlasts``; both below an H200's):
    then they have arrived when it ends, and ``consume`` multiplies them in one product, not
    one per band (the bands' products cost 0.03-0.16 ms per op above one cuBLAS call at 70B,
    TP 2, NVLink). ``N`` is this rank's own: the consumer's order is its own, no rank's
    transfers depend on it."""
    m = p.M // p.world_size
    moved = (p.world_size - 1) * m * p.K * itemsize
    return gemm_outlasts(2 * m * p.K * N, moved, road or "network")


def _keep_gathered(transport: Transport, p: GatherPlan, buf, x2, full, own: slice, s) -> None:
    """``x_full`` of a blocked all-gather: the buffer is in its layout already, so ``s`` (the
    communication stream) waits until every band has arrived and copies it with contiguous
    copies (copy engines: no SM; on the caller stream, one strided copy per band cost 0.73
    ms of a training step's SM time, 8B dims, 8192 tokens, 2 H100s), this rank's rows from
    ``x2``; the caller waits for ``s`` at the end of the call."""
    transport.arrived(p, tuple(range(p.n_chunks)), s)
    with torch.cuda.stream(s):
        full[own].copy_(x2)
        for rows in _others(own, p.M):
            full[rows].copy_(buf[rows])


def _others(own: slice, M: int) -> list[slice]:
    """The rows of ``[0, M)`` on each side of this rank's ``own``, where there are any."""
    return [r for r in (slice(0, own.start), slice(own.stop, M)) if r.stop > r.start]


def _gathered(
    x2, w, out, full, p: GatherPlan, ctx: Context, cls, capturing: bool, cover: tuple = ()
) -> None:
    """Stages 6-8 of an all-gather with plan ``p`` on the current stream: ``consume``."""
    transport = ctx.transport(cls, capturing)
    s = ctx.comm_stream
    with _on_device(x2):
        caller = torch.cuda.current_stream(x2.device) if s is not None else None
        consume(x2, w, out, full, p, transport, ctx.rank, caller, s, cover)


def consume(
    x2, w, out, full, p: GatherPlan, transport: Transport, rank: int, caller, s, cover=()
) -> None:
    """The transport gathers every rank's shard on ``s`` while ``caller`` multiplies this
    rank's own rows ``x2 [m, K]`` (no wait), then each band of the other shards once it has
    arrived, into ``out [R m, N]``; ``full``: ``x_full [R m, K]`` or empty. ``caller`` then
    waits for ``s``.

    Where this rank's own product outlasts the others' transfer (``_outlasts``), a blocked
    plan's other rows are multiplied in one product after their last band, not band by band.

    ``cover``: ``(b [R m, L], c [K, L])``, ``c = x_full^T b`` on ``caller``: with a blocked
    plan this rank's rows' share right after their product (while the other shards travel),
    the others' rows added from the receive buffer after the last band (one or two more
    roundings of ``c``, on each side of this rank's rows); else from ``full`` at the end."""
    R, N, K = p.world_size, w.shape[1], p.K
    m, keep = p.M // R, full.numel() > 0
    own = slice(rank * m, (rank + 1) * m)
    try:
        guard.arm()
        buf = transport.gather(p, x2.contiguous(), s, caller)  # `s` waits for `caller`
        torch.matmul(x2, w, out=out[own])  # own rows: no wait
        if cover and p.blocked:
            torch.matmul(x2.t(), cover[0][own], out=cover[1])
        out3 = out.view(R, m, N)
        bands = p.shard_bands
        if p.blocked and _outlasts(p, N, x2.element_size(), transport.road):
            bands = ((0, m, tuple(range(p.n_chunks))),)
        for q, h, chunks in bands:
            transport.arrived(p, chunks, caller)
            if p.blocked:  # the standard layout: [R, m, K], rows q.. of every shard
                a3 = buf.view(R, m, K)[:, q : q + h]
            else:  # NCCL's slot [R, h, K]
                a3 = buf[R * q : R * (q + h)].view(R, h, K)
            # the other ranks' rows: one batched matmul on each side of this rank's
            # (0.97-1.09x one cuBLAS call at R = 2-8 on H200; a matmul per rank: 1.04-1.15x)
            for lo, hi in ((0, rank), (rank + 1, R)):
                if hi > lo:
                    torch.bmm(a3[lo:hi], w.expand(hi - lo, K, N), out=out3[lo:hi, q : q + h])
            if keep and not p.blocked:  # into the standard layout (the slots are reused)
                full.view(R, m, K)[:, q : q + h] = a3
        if keep and p.blocked:
            _keep_gathered(transport, p, buf, x2, full, own, s)
        elif keep:
            full[own] = x2
        if cover and p.blocked:
            for rows in _others(own, p.M):
                cover[1].addmm_(buf[rows].t(), cover[0][rows])
        elif cover:
            torch.matmul(full.t(), cover[0], out=cover[1])
    finally:
        if s is not None:
            caller.wait_stream(s)  # as in `produce`


# -- the uneven exchanges --------------------------------------------------------------------
class Streams(NamedTuple):
    """What an uneven exchange issues on (``run_exchange``): its transport, the caller stream,
    the communication stream and one event per chunk (the last three None on CPU, where the
    transport runs on the host)."""

    transport: Transport
    caller: torch.cuda.Stream | None
    comm: torch.cuda.Stream | None
    events: list | None

    def mark(self, c: int, stream) -> None:
        """Chunk ``c`` is done on ``stream`` (an event; nothing on CPU)."""
        if self.events is not None:
            self.events[c].record(stream)

    def waiter(self, stream):
        """``wait(c)``: ``stream`` waits for chunk ``c``'s mark."""
        if stream is None:
            return lambda c: None
        return lambda c: stream.wait_event(self.events[c])


def run_exchange(x, call: Call, p: SplitPlan, cls, label: str, sizes: dict, plain, issue):
    """A checked uneven exchange ``call`` of plan ``p`` through transport class ``cls``
    (``decide_exchange``), from ``x``'s device and caller stream, with the stages of every
    call: on the plain path (world size 1) the count, then ``plain()``; else validation's
    agreement (``label``: the op, as ``overlap.stats`` counts it; ``sizes``: what every rank
    shares of it), the count, the context's transport and the communication stream forked
    from the caller, validation's watch, ``issue(streams)`` (the op's producer, the
    transport's exchange and the consumer, on ``Streams``), the caller's wait for the
    communication stream, and an eager call outside validation handed to the watchdog
    (``_issued``). Returns what ``plain`` or ``issue`` returns."""
    if p.path != "overlap":
        stats.count(label, how(p))
        return plain()
    ctx = context(call.group, x.device)
    validating = guard.validating()
    if validating:
        _agree(call.group, p, x.dtype, what=label, sizes=sizes)
    stats.count(label, how(p))  # (after the agreement: a refused call ran nothing)
    t = ctx.transport(cls)
    s = ctx.comm_stream
    if s is None:  # CPU: the transport runs on the host
        return issue(Streams(t, None, None, None))
    caller = torch.cuda.current_stream(x.device)
    streams = Streams(t, caller, s, t.events(p.n_chunks))
    s.wait_stream(caller)
    cap = capturing(x)
    try:
        with _watch(ctx, cls, p, x, cap) if validating else _NOTHING:
            try:
                return issue(streams)
            finally:
                caller.wait_stream(s)
    finally:
        if not (cap or validating):
            _issued(t, ctx, p)
