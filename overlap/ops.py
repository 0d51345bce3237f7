"""Public API: a matmul whose collective starts while the matmul is still running.

Shapes (R = world size of ``group``; ``x`` is ``[..., K]`` and ``M`` is the product of its leading
dims; ``w`` is ``[K, N]``, any strides):

================  =======================  ====================================================
collective        result                   equals
================  =======================  ====================================================
all_reduce        ``[..., N]``             ``dist.all_reduce(x @ w)``
reduce_scatter    ``[M / R, N]``           ``dist.reduce_scatter_tensor(out, (x @ w).view(M, N))``
all_to_all        ``[..., N]``             ``dist.all_to_all_single(out, x @ w)``: row block
                                           ``j`` of ``M / R`` rows goes to rank ``j``
================  =======================  ====================================================

One call: check the arguments -> (a repeated eager copy-engine call replays its recorded CUDA
graph here, ``_recorded``) -> the context of (group, device, caller stream)
(``overlap/context.py``) -> choose the transport (``comm.choose``) -> make the plan for it
(what ``overlap.plan`` returns and validation mode fingerprints) -> the transport's
``begin`` -> launch the GEMM -> the transport issues the chunks on the communication stream
-> the caller stream waits for it. No step goes back to redo an earlier one.

Failures: ``overlap.configure(validate=True)`` makes every call check that all ranks make the
same call, with a timeout, before anything is launched (``overlap/guard.py``, RELIABILITY.md).

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
when ``TRITON_INTERPRET=1`` is set before ``overlap`` first launches a
kernel (Triton reads it when the kernel is defined).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import math
import os
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import guard
from .collectives import OPS, collective
from .comm import BACKENDS, choose
from .context import Context, context, plans, records, shapes, tuned, tuned_key
from .plan import (
    DEFAULT_SPLIT_CHUNKS,
    Plan,
    band_rows,
    make_plan,
    make_split_plan,
    splits_rows,
    tiles_for,
)
from .signal import current_raw_stream, wait_counter

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _world(group: dist.ProcessGroup | None) -> int:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def check_group(group) -> None:
    """Raises TypeError naming ``group`` unless it is a process group or None, and
    ValueError for what ``dist.new_group`` returns to a process outside the group."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            "group: this process is not a member of it (dist.new_group returned "
            "GroupMember.NON_GROUP_MEMBER here); call on the group's ranks only"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got "
                        f"{type(group).__name__}")  # fmt: skip


def _check(x: torch.Tensor, w: torch.Tensor, name: str, op: str, backend: str, group):
    """Raises on invalid arguments of a call; returns the collective's table entry."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    check_group(group)
    spec = collective(name)
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if op != "sum" and not spec.reduces:
        raise ValueError(f"op={op!r} needs a reduction; {name} only moves data")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [K, N], got shape {tuple(w.shape)}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension [..., K]")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x.dtype must be one of {_DTYPES}, got {x.dtype}")
    if w.dtype != x.dtype:
        raise TypeError(f"w.dtype ({w.dtype}) must equal x.dtype ({x.dtype})")
    if w.device != x.device:
        raise ValueError(f"w is on {w.device} but x is on {x.device}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"K mismatch: x is {tuple(x.shape)} ([..., K]), w is {tuple(w.shape)} ([K, N])"
        )
    return spec


def plan(
    x: torch.Tensor,
    w: torch.Tensor,
    collective: str = "all_reduce",
    *,
    group: dist.ProcessGroup | None = None,
    chunks: int | None = None,
    backend: str = "auto",
) -> Plan:
    """The plan a call with these arguments runs: ``path`` ("overlap" or "fallback"), the
    ``transport`` that moves its chunks, the chunks and tiles, and ``reason``;
    ``plan(...).describe()`` prints it.

    Like the call, the first one of a group on a CUDA device asks every rank which road the
    copy engines have (a collective): every rank of ``group`` calls it then.

    Args:
        x: ``[..., K]`` (for ``"all_gather"``: this rank's shard). w: ``[K, N]``.
            collective, group, chunks, backend: as in ``matmul_collective`` (and
            ``"all_gather"``: ``all_gather_matmul``'s plan).

    Raises:
        ValueError, TypeError: on invalid arguments (the same checks as the call).
    """
    _check(x, w, collective, "sum", backend, group)
    return _plan_for(x, w, collective, group, chunks, backend, _capturing(x))[0]


def _plan_for(x, w, name, group, chunks, backend, capturing) -> tuple[Plan, Context | None]:
    """The plan of a checked call, and its context (None at world size 1). Eager calls look
    the plan up by signature first (``context.plans``: ~40 us less per repeated call)."""
    key = (name, group, _world(group), chunks, backend, x.shape, x.dtype, x.device, w.shape[1])
    p = None if capturing else plans.get(key)
    if p is not None:
        return p, (context(group, x.device) if p.world_size > 1 else None)
    p, ctx = _make_plan_for(x, w, name, group, chunks, backend, capturing)
    if not capturing:  # (a capture's choice depends on the transport's buffers)
        if len(plans) >= 1024:
            plans.clear()
        plans[key] = p
    return p, ctx


def _make_plan_for(x, w, name, group, chunks, backend, capturing) -> tuple[Plan, Context | None]:
    R, bits = _world(group), x.element_size() * 8
    before = collective(name).before  # x is a shard of the all-gather's M rows
    M, K, N = math.prod(x.shape[:-1]) * (R if before else 1), x.shape[-1], w.shape[1]
    if R == 1:
        return make_plan(
            M, N, K, world_size=1, collective=name, dtype_bits=bits, chunks=chunks
        ), None
    ctx = context(group, x.device)
    road = ctx.road(capturing) if x.is_cuda else None  # a collective on the first CUDA call
    if chunks is None:
        choice = tuned(tuned_key(group, M, N, K, x.dtype, name))  # set by overlap.tune only
        if choice == "plain":
            why = "overlap.tune measured the plain path fastest"
            return Plan("fallback", why, name, M, N, K, R), ctx
        chunks = choice
    transport = choose(
        backend,
        road,
        eligible=x.is_cuda,
        world_size=R,
        rows_split=splits_rows(M, name, R, tiles_for(M, bits, interpreter=not x.is_cuda)),
        rows_divisible=M % R == 0,
    )
    p = make_plan(
        M, N, K, world_size=R, collective=name, dtype_bits=bits, interpreter=not x.is_cuda,
        num_sms=_num_sms(x.device), chunks=chunks, blocked=Context.blocked(transport),
        transport=transport,
    )  # fmt: skip
    if capturing and transport == "ce" and not ctx.captures(p, x.dtype):
        # a capture cannot make or grow the copy engines' buffers: NCCL (which runs anywhere)
        p = make_plan(
            M, N, K, world_size=R, collective=name, dtype_bits=bits, num_sms=_num_sms(x.device),
            chunks=chunks, transport="torch",
        )  # fmt: skip
    if p.path == "overlap" and not x.is_cuda and not before:  # (the all-gather runs no kernel)
        if not _interpreter():
            why = "CPU tensors and TRITON_INTERPRET is not 1"
        elif x.dtype == torch.bfloat16:
            why = "the Triton interpreter computes bfloat16 products wrongly (triton 3.6)"
        else:
            return p, ctx
        return Plan("fallback", why, name, M, N, K, R), ctx
    return p, ctx


@functools.lru_cache(maxsize=64)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _capturing(t: torch.Tensor) -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _check_out(out: torch.Tensor, shape: tuple[int, ...], x: torch.Tensor) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != x.dtype:
        raise TypeError(f"out.dtype ({out.dtype}) must equal x.dtype ({x.dtype})")
    if out.device != x.device:
        raise ValueError(f"out is on {out.device} but x is on {x.device}")
    if tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")


def matmul_collective(
    x: torch.Tensor,
    w: torch.Tensor,
    collective: str = "all_reduce",
    *,
    group: dist.ProcessGroup | None = None,
    op: str = "sum",
    out: torch.Tensor | None = None,
    backend: str = "auto",
    chunks: int | None = None,
    input_split_sizes: list[int] | None = None,
    output_split_sizes: list[int] | None = None,
) -> torch.Tensor:
    """``x @ w`` followed by ``collective`` over ``group``, overlapped chunk by chunk.

    Args:
        x: ``[..., K]`` fp16, bf16 or fp32; leading dims are flattened into ``M``.
        w: ``[K, N]``, same dtype and device, any strides (``linear.weight.t()`` is fine).
        collective: "all_reduce", "reduce_scatter" or "all_to_all" (module docstring: shapes).
        group: process group; ``None`` is the default group (or world size 1 if
            ``torch.distributed`` is not initialized).
        op: "sum" or "avg" (reductions only; "avg" divides the product by R before the sum).
        out: optional contiguous result tensor of the result's shape, dtype and device.
        backend: "auto" (default: "ce" where it runs, and without P2P only for 2 ranks;
            else "torch"), "torch" (the group's own NCCL/gloo, one collective per chunk),
            "cupy" (a direct NCCL communicator created once from the group) or "ce"
            (copy-engine pushes, GPU to GPU where the GPUs map each other's memory, else
            through pinned host memory: ``overlap/comm/peer.py``, ``host.py``; NCCL where a
            plan or a CUDA-graph capture does not allow it, ``comm.choose``).
        chunks: about how many chunks to use (default: the planner's choice).
        input_split_sizes, output_split_sizes: (all-to-all; both or neither) rows of the
            product this rank sends to each rank (consecutive, in rank order; they add up to
            ``M``) and rows it receives from each, as ``all_to_all_single`` takes them
            (``_split_forward``: NCCL per chunk, always overlapped in ``chunks``, default 4,
            chunks; equal splits are faster given as None).

    Returns:
        The result in the plain torch call's layout: ``[..., N]``, or ``[M / R, N]`` for
        reduce-scatter, ``[sum(output_split_sizes), N]`` for an all-to-all with splits.
        Differentiable when ``x`` or ``w`` requires grad (the registered backward,
        ``_backward_op``; the reduce-scatter's input gradient is ``all_gather_matmul``'s);
        usable under ``torch.compile`` (``fullgraph=True`` too: the call is the custom op
        ``overlap::matmul_collective``).

    Raises:
        TypeError: wrong type of ``x``, ``w``, ``out`` or ``group``, or wrong dtype.
        ValueError: shape or device mismatch, unknown collective/op/backend, ``M`` not
            divisible by R for reduce-scatter and all-to-all, ``out`` with autograd.
        overlap.RankMismatchError: (validation mode) the ranks' calls differ.
        TimeoutError: (validation mode) a rank did not arrive, or the call's collectives did
            not finish, within ``overlap.configure``'s timeout.
    """
    if _check(x, w, collective, op, backend, group).before:
        raise ValueError(f"collective={collective!r} gathers x before the matmul: call "
                         "overlap.all_gather_matmul")  # fmt: skip
    gname = _via_op(x, w, out, group)
    if gname is not None:
        splits = () if input_split_sizes is None else (input_split_sizes, output_split_sizes)
        return torch.ops.overlap.matmul_collective(x, w, collective, gname, op, backend, chunks,
                                                   *splits)  # fmt: skip
    if input_split_sizes is not None or output_split_sizes is not None:
        splits = _check_splits(x, collective, input_split_sizes, output_split_sizes, group)
        return _split_forward(x, w, group, out, backend, chunks, *splits)
    return _forward(x, w, collective, group, op, out, backend, chunks)


def _needs_grad(x: torch.Tensor, w: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)


def _via_op(x: torch.Tensor, w: torch.Tensor, out, group) -> str | None:
    """The group's name for the custom op (``""`` for None) where a call must go through it:
    under autograd (its backward is registered) or ``torch.compile`` (it is opaque to
    tracing); None where the call runs directly (no dispatch cost)."""
    grad = _needs_grad(x, w)
    if not (grad or torch.compiler.is_compiling()):
        return None
    if out is not None:
        why = "autograd (x or w requires grad)" if grad else "torch.compile"
        raise ValueError(f"out= does not support {why}")
    return "" if group is None else group.group_name


def _check_splits(x, name, sends, receives, group) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The checked ``(input_split_sizes, output_split_sizes)`` as tuples."""
    if name != "all_to_all":
        raise ValueError(f"input_split_sizes / output_split_sizes are for all_to_all, not {name}")
    if sends is None or receives is None:
        raise ValueError("input_split_sizes and output_split_sizes go together (None for both: "
                         "equal splits)")  # fmt: skip
    R, M = _world(group), math.prod(x.shape[:-1])
    for what, s in (("input_split_sizes", sends), ("output_split_sizes", receives)):
        if len(s) != R or not all(isinstance(v, int) and v >= 0 for v in s):
            raise ValueError(f"{what} must be {R} non-negative ints (one per rank), got {s!r}")
    if sum(sends) != M:
        raise ValueError(f"input_split_sizes add up to {sum(sends)}, not to x's {M} rows")
    return tuple(sends), tuple(receives)


def _split_forward(x, w, group, out, backend, chunks, sends, receives, runs=None) -> torch.Tensor:
    """``matmul_collective`` all-to-all with uneven splits (checked): cuBLAS computes the
    product chunk by chunk into the slot layout of ``plan.band_rows`` (chunk ``c``: band ``c``
    of every destination's block), an event after each; NCCL per chunk sends each chunk
    once its event has passed (``NcclTransport.run_splits``); one gather puts the received
    rows in order. ``runs`` (``ExpertRuns``): ``w`` is ``[E, K, N]`` and each run of rows
    uses its expert's matrix (the MoE combine)."""
    M, K, N = math.prod(x.shape[:-1]), x.shape[-1], w.shape[-1]
    x2 = x.reshape(M, K)
    out = _split_out(out, (sum(receives), N), x)
    call = _SplitCall(x, group, backend, chunks, sends, receives, N, K)
    if call.ctx is None:
        _product(x2, w, out, slice(0, M), slice(0, M), runs)
        return out
    p, s, n = call.plan, call.stream, call.plan.n_chunks
    y, recv = x.new_empty(M, N), x.new_empty(sum(receives), N)
    try:
        for c, rows in enumerate(band_rows(sends, n)):
            for std, slot in rows:
                _product(x2, w, y, std, slot, runs)
            call.mark(c, call.caller)
        call.transport.run_splits(p, y, recv, call.waiter(s), lambda c: None, s)
        with torch.cuda.stream(s) if s is not None else contextlib.nullcontext():
            order = call.transport.order(receives, n, x.device, to_slots=False)
            torch.index_select(recv, 0, order, out=out)
    finally:
        call.end(x)
    return out


def _dispatch_forward(x, w, group, out, backend, chunks, sends, receives, runs, keep):
    """``all_to_all_grouped_matmul`` (checked): ``x`` put into the slot layout of the sends,
    NCCL per chunk exchanges band ``c`` of every block, an event after each; the caller
    stream waits for each chunk and multiplies its received rows (``runs``: ids of the
    received rows) straight into ``out``. Returns ``(out, received x [sum(receives), K])``,
    the second empty unless ``keep``."""
    M, K, N = math.prod(x.shape[:-1]), x.shape[-1], w.shape[-1]
    x2 = x.reshape(M, K)
    rows = sum(receives)
    out = _split_out(out, (rows, N), x)
    call = _SplitCall(x, group, backend, chunks, sends, receives, N, K)
    if call.ctx is None:
        _product(x2, w, out, slice(0, M), slice(0, M), runs)
        return out, (x2 if keep else x.new_empty(0))
    p, s, n = call.plan, call.stream, call.plan.n_chunks
    t = call.transport
    recv = x.new_empty(rows, K)
    try:
        send = x2.index_select(0, t.order(sends, n, x.device, to_slots=True))
        if s is not None:
            s.wait_stream(call.caller)  # `send` is made on the caller stream
        t.run_splits(p, send, recv, lambda c: None, lambda c: call.mark(c, s), s)
        for c, bands in enumerate(band_rows(receives, n)):
            call.waiter(call.caller)(c)
            for std, slot in bands:
                _product(recv, w, out, slot, std, runs, ids_at_dst=True)
        full = recv.index_select(0, t.order(receives, n, x.device, to_slots=False)) if keep \
            else x.new_empty(0)  # fmt: skip
    finally:
        call.end(x)
    return out, full


def _split_out(out, shape, x) -> torch.Tensor:
    if out is None:
        return x.new_empty(shape)
    _check_out(out, shape, x)
    return out


class _SplitCall:
    """What an uneven all-to-all call of either direction sets up: its plan (validated when
    validation is on), and off world size 1 the context, transport, streams and events
    (``ctx`` is None at world size 1)."""

    def __init__(self, x, group, backend, chunks, sends, receives, N, K) -> None:
        transport = backend if backend in ("torch", "cupy") else "torch"  # (no copy engines)
        self.plan = make_split_plan(sends, receives, N, K, chunks=chunks, transport=transport)
        self.ctx = self.stream = self.caller = self.events = None
        if self.plan.world_size == 1:
            return
        self.ctx = context(group, x.device)
        self.validating = guard.validating()
        if self.validating:
            p = self.plan
            guard.agree(group, guard.fingerprint(p, x.dtype, "sum"), p.describe(), p.splits)
        self.transport = self.ctx.transport(transport)
        self.stream = self.ctx.comm_stream
        if self.stream is not None:
            self.caller = torch.cuda.current_stream(x.device)
            self.events = self.transport.events(self.plan.n_chunks)
            self.stream.wait_stream(self.caller)

    def mark(self, c: int, stream) -> None:
        """Chunk ``c`` is done on ``stream`` (an event; nothing on CPU)."""
        if self.events is not None:
            self.events[c].record(stream)

    def waiter(self, stream):
        """``wait(c)``: ``stream`` waits for chunk ``c``'s mark."""
        if stream is None:
            return lambda c: None
        return lambda c: stream.wait_event(self.events[c])

    def end(self, x) -> None:
        """The caller waits for the communication stream; validation mode's watch."""
        if self.stream is None:
            return
        self.caller.wait_stream(self.stream)
        if self.validating and not _capturing(x):
            guard.watch(self.stream, self.transport.abort, self.plan.describe())


def _product(x2, w, y, src: slice, dst: slice, runs, ids_at_dst: bool = False) -> None:
    """``y[dst] = x2[src] @ w`` (equal lengths); with ``runs``, row by row ``@ w[expert]``:
    one matmul per run of equal expert ids, which index the source rows (or with
    ``ids_at_dst`` the destination rows)."""
    if dst.stop == dst.start:
        return
    if runs is None:
        torch.matmul(x2[src], w, out=y[dst])
        return
    at, other = (dst, src) if ids_at_dst else (src, dst)
    shift = other.start - at.start
    for a, b, e in runs.within(at.start, at.stop):
        ya, xa = (a, a + shift) if ids_at_dst else (a + shift, a)
        torch.matmul(x2[xa : xa + b - a], w[e], out=y[ya : ya + b - a])


class ExpertRuns:
    """Maximal runs of equal expert ids over the rows, read on the host once per call:
    ``(start, stop, expert)``; rows sorted by expert within each destination's block make
    one run per (block, expert)."""

    def __init__(self, expert_ids: torch.Tensor, experts: int) -> None:
        ids = expert_ids.reshape(-1).to("cpu", torch.int64)  # (a host sync, once per call)
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < experts):
            raise ValueError(f"expert_ids must lie in [0, {experts}) (w has {experts} experts), "
                             f"got values in [{int(ids.min())}, {int(ids.max())}]")  # fmt: skip
        cuts = [0, *((ids[1:] != ids[:-1]).nonzero().flatten() + 1).tolist(), ids.numel()]
        cuts = cuts if ids.numel() else [0]  # no rows: no runs
        self.starts = cuts[:-1]
        self.runs = [(a, b, int(ids[a])) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]

    def within(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """The runs clipped to rows ``[start, stop)``."""
        i = max(bisect.bisect_right(self.starts, start) - 1, 0)
        out = []
        for a, b, e in self.runs[i:]:
            if a >= stop:
                break
            if b > start:
                out.append((max(a, start), min(b, stop), e))
        return out


def _forward(x, w, collective, group, op, out, backend, chunks) -> torch.Tensor:
    """``matmul_collective`` of checked arguments, without autograd."""
    capturing = _capturing(x)
    sig = None if capturing else _signature(collective, group, op, backend, chunks, x, w)
    if sig is not None and sig in shapes:  # a recorded call again: no planning
        if out is None:
            out = torch.empty(shapes[sig][0], dtype=x.dtype, device=x.device)
        if _replay((sig, _outputs(out))):
            return out
    p, ctx = _plan_for(x, w, collective, group, chunks, backend, capturing)
    R, M, N = p.world_size, p.M, p.N
    shape = p.spec.result_shape(tuple(x.shape), N, R)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    else:
        _check_out(out, shape, x)
    x2 = x if x.dim() == 2 else x.reshape(M, p.K)
    out2 = out if out.dim() == 2 else out.view(-1, N)
    scale = 1.0 / R if op == "avg" and R > 1 else None
    validating = ctx is not None and guard.validating()
    if validating:
        guard.agree(group, guard.fingerprint(p, x.dtype, op), p.describe())  # before launches
    if p.path != "overlap":
        _plain(x2, w, out2, p, scale, group)
        if validating and x.is_cuda and not capturing:
            stream = torch.cuda.current_stream(x.device)
            guard.watch(stream, ctx.transport("torch").abort, p.describe())
        return out
    call = functools.partial(overlapped, x2, w, out2, p, scale, ctx)
    key = None if sig is None or x2.data_ptr() != x.data_ptr() else (sig, _outputs(out))
    _recorded(call, ctx, p, capturing, key, (shape,))
    if guard.validating() and not capturing:  # a capturing stream cannot be queried
        guard.watch(ctx.comm_stream, ctx.transport(p.transport).abort, p.describe())
    return out


# CUDA graphs of eager calls kept (all streams, least recently used out). A training step cycles
# through every overlapped call site (a 32-layer model: 128 or more): with 64 kept, a step of
# 128 signatures recorded nothing and paid 0.31 ms per call against 0.066 with all recorded;
# each recorded graph held ~0.5 MB of device memory (4-chunk all-reduce 1024x4096x4096 on the
# host road, one H200, 2026-11-24, records_scale_h200.json).
MAX_RECORDS = 512


class Record(NamedTuple):
    """A recorded eager call (``_recorded``): its context, the generation of the copy-engine
    buffers it was recorded with, and its CUDA graph (None: seen once)."""

    ctx: Context
    generation: int
    graph: torch.cuda.CUDAGraph | None


def _signature(name, group, op, backend, chunks, x, w, *extra) -> tuple | None:
    """What an eager call's plan and recorded graph depend on besides its outputs: its
    arguments, the caller stream and the inputs' addresses, dtypes, shapes and strides; None
    where calls are not recorded (CPU, validation mode)."""
    if not x.is_cuda or guard.validating():
        return None
    return (name, group, op, backend, chunks, *extra, x.device, current_raw_stream(x.device),
            x.data_ptr(), x.dtype, x.shape, x.stride(), w.data_ptr(), w.dtype, w.shape,
            w.stride())  # fmt: skip


def _outputs(*tensors: torch.Tensor) -> tuple:
    """The outputs' part of a record's key: addresses, dtypes, shapes, strides."""
    return tuple((t.data_ptr(), t.dtype, t.shape, t.stride()) for t in tensors)


def _replay(key: tuple) -> bool:
    """Replay the recorded graph of the call ``key`` (a signature and its outputs); False
    where there is none, or its transport has new buffers or is broken."""
    rec = records.get(key)
    if rec is None or rec.graph is None:
        return False
    t = rec.ctx.transport("ce")  # this stream after the last one of another stream
    if t.broken or t.generation != rec.generation:
        return False
    records.move_to_end(key)
    rec.graph.replay()
    return True


def _recorded(call, ctx: Context, p: Plan, capturing: bool, key: tuple | None, out_shapes) -> None:
    """``call(capturing)`` issues an overlapped call of plan ``p`` on the current stream.

    An eager copy-engine call made a second time with the same arguments, inputs and outputs
    (``key``: the call's ``_signature`` and its outputs, by address, dtype, shape and
    strides) is captured into a CUDA graph, which that call and every later one like it
    replays (``_replay``, before any planning: the signature's ``out_shapes`` make the
    outputs first): one graph launch instead of the ~25 driver calls and the kernel launch
    of an eager call (the GPU work is the same: every call zeroes its own counters and
    flags). Only the first sighting runs eagerly, so calls whose addresses never repeat pay
    no capture. The graphs of one transport (one group on one device) share a memory pool,
    its ``graph_pool``: a call's temporaries (counters, slots) die with it, so graphs
    captured later reuse them, which is safe because the group's copy-engine calls never run
    at once; another group's calls may run beside them, on another stream, and take another
    pool. Not in validation mode (its watch needs the
    communication stream), not for NCCL (not yet run on two GPUs), not while capturing, not
    where ``x`` was copied to make it 2-D (``key`` is None then).
    """
    if key is None or p.transport != "ce":
        call(capturing)
        return
    t = ctx.transport("ce")  # this stream after the last one of another stream
    if t.broken:  # (validation mode was on) the call raises
        call(False)
        return
    if len(shapes) >= 4 * MAX_RECORDS:
        shapes.clear()
    shapes[key[0]] = out_shapes  # (also after a clear: the next call replays before planning)
    rec = records.get(key)
    if rec is None or rec.generation != t.generation:  # first sighting (with these buffers)
        if len(records) >= MAX_RECORDS:
            records.popitem(last=False)
        records[key] = Record(ctx, t.generation, None)
        call(False)
        return
    records.move_to_end(key)
    if rec.graph is None:
        graph = torch.cuda.CUDAGraph()
        if ctx.record_stream is None:
            ctx.record_stream = torch.cuda.Stream(ctx.device)
        with torch.cuda.stream(ctx.record_stream):
            if t.graph_pool is None:
                t.graph_pool = torch.cuda.graph_pool_handle()
            graph.capture_begin(pool=t.graph_pool, capture_error_mode="thread_local")
            try:
                call(True)
            finally:
                graph.capture_end()
        rec = records[key] = rec._replace(graph=graph)
    rec.graph.replay()


def overlapped(
    x2: torch.Tensor,
    w: torch.Tensor,
    out2: torch.Tensor,
    p: Plan,
    scale: float | None,
    ctx: Context,
    capturing: bool,
    trace=None,
) -> None:
    """The overlapped path of a checked call with plan ``p`` (``p.path == "overlap"``):
    ``x2 [M, K]``, ``w [K, N]``, ``out2`` the 2-D result. The GEMM on the caller stream,
    the transport's chunks on the communication stream, each after its chunk's counter;
    the caller waits for the last. (``tools/timeline.py`` calls it directly.)

    ``trace``: ``trace.tiles`` goes to the kernel, and ``trace.stamp(i)`` is called on the
    communication stream when chunk ``i // 2`` is ready (even ``i``) and when its transfer
    has finished (odd ``i``).
    """
    from .gemm import chunked_matmul  # Triton: imported on first use

    transport = ctx.transport(p.transport, capturing)
    device = x2.device
    s = ctx.comm_stream  # None on CPU: the interpreter runs the kernel to completion, then gloo
    caller = torch.cuda.current_stream(device) if s is not None else None
    slots, epilogue = transport.begin(p, out2, caller)
    # Counters zeroed on the caller stream before `s` forks from it: this stream's (the
    # previous call's waits on them are over: the caller stream waited for `s`), or a captured
    # call's own, from the graph's pool (a capture cannot make the stream's: a thread making
    # memory while the capture's stream records is refused), zeroed at every replay.
    if capturing:
        counters = torch.zeros(p.n_chunks, dtype=torch.int32, device=device)
    else:
        counters = ctx.counters
        counters.zero_()
    targets = p.tiles_per_chunk

    def wait(c: int, ops=None) -> None:  # (ops: the copy engines' batch, transport.py)
        if trace is not None and c:
            trace.stamp(2 * c - 1)
        wait_counter(counters, c, targets[c], s, ops)
        if trace is not None:
            trace.stamp(2 * c)

    # (the device switch and the stream context cost host time: only where they do something)
    other_device = x2.is_cuda and device.index != torch.cuda.current_device()
    with torch.cuda.device(device) if other_device else contextlib.nullcontext():
        if s is not None:
            s.wait_stream(caller)  # inputs and buffers are ready before `s` touches them
        tiles = trace.tiles if trace is not None else None
        chunked_matmul(x2, w, slots, counters, p, scale, epilogue=epilogue, trace=tiles)
        try:
            transport.run(p, slots, out2, wait, s)
            if trace is not None:
                with torch.cuda.stream(s):
                    trace.stamp(2 * p.n_chunks - 1)
        finally:
            if s is not None:
                # The caller continues after the last transfer, so buffers allocated on it
                # are free to reuse once this call's work on `s` is done (also when a chunk's
                # collective raised: the chunks issued before it still use them).
                caller.wait_stream(s)


def all_gather_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    return_gathered: bool = False,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``dist.all_gather_into_tensor(x_full, x); x_full @ w``, overlapped chunk by chunk.

    This rank's own shard is multiplied first; every chunk of the other shards is multiplied
    as soon as it has arrived (a stream wait per chunk, then one matmul per shard's rows of
    it). The chunks travel through NCCL (one all-gather per chunk: any GPUs, across hosts,
    CUDA graphs) or the copy engines (``backend``; GPU to GPU, or through pinned host memory
    without P2P).

    Args:
        x: this rank's shard ``[..., K]`` (leading dims flattened into ``m`` rows; every rank
            the same ``m``), fp16, bf16 or fp32.
        w: ``[K, N]``, same dtype and device, any strides (``linear.weight.t()`` is fine).
        group, backend, chunks: as in ``matmul_collective``.
        return_gathered: also return ``x_full`` (the weight gradient needs it).
        out: optional contiguous ``[R m, N]`` result.

    Returns:
        ``[R m, N]``, rows ``[r m, (r + 1) m)`` from rank ``r``'s shard; with
        ``return_gathered``, ``(result, x_full [R m, K])``. Differentiable with tensor
        parallelism's conventions (``x``'s gradient is the reduce-scatter of
        ``g @ w^T``, overlapped: ``matmul_reduce_scatter``); usable under ``torch.compile``
        (the custom op ``overlap::all_gather_matmul``).

    Raises:
        TypeError, ValueError: as ``matmul_collective``'s.
        overlap.RankMismatchError: (validation mode) the ranks' calls differ, shards of
            different sizes included.
        TimeoutError: (validation mode) as ``matmul_collective``'s.
    """
    _check(x, w, "all_gather", "sum", backend, group)
    gname = _via_op(x, w, out, group)
    if gname is not None:
        keep = return_gathered or _needs_grad(x, w)  # the backward needs x_full
        y, full = torch.ops.overlap.all_gather_matmul(x, w, gname, backend, chunks, keep)
        return (y, full) if return_gathered else y
    y, full = _gather_forward(x, w, group, out, backend, chunks, return_gathered)
    return (y, full) if return_gathered else y


def _gather_forward(x, w, group, out, backend, chunks, keep) -> tuple[torch.Tensor, torch.Tensor]:
    """``all_gather_matmul`` of checked arguments, without autograd: ``(out, x_full)``, the
    second ``[R m, K]`` when ``keep`` else empty."""
    capturing = _capturing(x)
    sig = None if capturing else _signature("all_gather", group, "sum", backend, chunks, x, w, keep)
    if sig is not None and sig in shapes:  # a recorded call again: no planning
        out_shape, full_shape = shapes[sig]
        out = x.new_empty(out_shape) if out is None else out
        full = x.new_empty(full_shape)
        if _replay((sig, _outputs(out, full))):
            return out, full
    p, ctx = _plan_for(x, w, "all_gather", group, chunks, backend, capturing)
    M, N, K, R = p.M, p.N, p.K, p.world_size
    if out is None:
        out = x.new_empty(M, N)
    else:
        _check_out(out, (M, N), x)
    x2 = x.reshape(M // R, K)
    validating = ctx is not None and guard.validating()
    if validating:
        guard.agree(group, guard.fingerprint(p, x.dtype, "sum"), p.describe())
    if p.path != "overlap":
        full = x2
        if R > 1:
            full = x.new_empty(M, K)
            p.spec.plain(x2.contiguous(), full, group)
        torch.matmul(full, w, out=out)
        if validating and x.is_cuda and not capturing:
            stream = torch.cuda.current_stream(x.device)
            guard.watch(stream, ctx.transport("torch").abort, p.describe())
        return out, (full if keep else x.new_empty(0))
    full_shape = (M, K) if keep else (0,)
    full = x.new_empty(full_shape)  # (outside a recorded graph's pool)
    call = functools.partial(_gather_overlapped, x2, w, out, full, p, ctx)
    key = None if sig is None or x2.data_ptr() != x.data_ptr() else (sig, _outputs(out, full))
    _recorded(call, ctx, p, capturing, key, ((M, N), full_shape))
    if guard.validating() and not capturing:
        guard.watch(ctx.comm_stream, ctx.transport(p.transport).abort, p.describe())
    return out, full


def _gather_overlapped(x2, w, out, full, p: Plan, ctx: Context, capturing: bool) -> None:
    """The overlapped all-gather of a checked call on the current stream: ``x2 [m, K]`` this
    rank's shard, ``out [R m, N]``, ``full`` ``x_full [R m, K]`` or empty."""
    transport = ctx.transport(p.transport, capturing)
    R, N, K = p.world_size, p.N, p.K
    rank, m, keep = ctx.rank, p.M // R, full.numel() > 0
    s = ctx.comm_stream
    other_device = x2.is_cuda and x2.device.index != torch.cuda.current_device()
    with torch.cuda.device(x2.device) if other_device else contextlib.nullcontext():
        caller = torch.cuda.current_stream(x2.device) if s is not None else None
        try:
            buf = transport.gather(p, x2.contiguous(), s, caller)  # `s` waits for `caller`
            torch.matmul(x2, w, out=out[rank * m : (rank + 1) * m])  # own rows: no wait
            out3 = out.view(R, m, N)
            for q, h, chunks in p.shard_bands:
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
                if keep:  # the standard layout (the buffer is reused by the next call)
                    full.view(R, m, K)[:, q : q + h] = a3
            if keep:
                full[rank * m : (rank + 1) * m] = x2
        finally:
            if s is not None:
                caller.wait_stream(s)  # as in `overlapped`


# The ops as torch custom ops: torch.compile(fullgraph=True) keeps them whole (Dynamo cannot
# trace the library's Python: locks, driver calls), and autograd runs the registered backward.
# A group travels as its name ("" for None); the ops resolve it in Python, outside tracing.


def _group(name: str) -> dist.ProcessGroup | None:
    return None if not name else dist.distributed_c10d._resolve_process_group(name)


@torch.library.custom_op("overlap::matmul_collective", mutates_args=())
def _matmul_collective_op(
    x: torch.Tensor, w: torch.Tensor, collective: str, group: str, op: str, backend: str,
    chunks: int | None, sends: list[int] | None = None, receives: list[int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """``matmul_collective`` as a custom op; ``group``: the group's name, "" for None;
    ``sends``, ``receives``: the all-to-all's split sizes (left out for equal splits)."""
    pg = _group(group)
    if sends is not None:
        splits = _check_splits(x, collective, sends, receives, pg)
        return _split_forward(x, w, pg, None, backend, chunks, *splits)
    return _forward(x, w, collective, pg, op, None, backend, chunks)


@_matmul_collective_op.register_fake
def _(x, w, collective_name, group, op, backend, chunks, sends=None, receives=None):
    if sends is not None:
        return x.new_empty(sum(receives), w.shape[1])
    R = _world(_group(group))
    return x.new_empty(collective(collective_name).result_shape(tuple(x.shape), w.shape[1], R))


@torch.library.custom_op("overlap::all_gather_matmul", mutates_args=())
def _all_gather_matmul_op(
    x: torch.Tensor, w: torch.Tensor, group: str, backend: str, chunks: int | None, keep: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``all_gather_matmul`` as a custom op: ``(result, x_full)`` (``x_full`` empty unless
    ``keep``); ``group``: the group's name, "" for None."""
    return _gather_forward(x, w, _group(group), None, backend, chunks, keep)


@_all_gather_matmul_op.register_fake
def _(x, w, group, backend, chunks, keep):
    M = math.prod(x.shape[:-1]) * _world(_group(group))
    return x.new_empty(M, w.shape[1]), x.new_empty((M, x.shape[-1]) if keep else 0)


@torch.library.custom_op("overlap::matmul_collective_backward", mutates_args=())
def _backward_op(
    g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, collective_name: str, group: str, op: str,
    need_dx: bool, need_dw: bool, g_x: torch.Tensor | None = None,
    sends: list[int] | None = None, receives: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(dx [.., K], dw [K, N])`` of ``matmul_collective`` or ``all_gather_matmul`` (empty
    where not needed), with tensor parallelism's conventions (Megatron's), from the
    result's gradient ``g``. ``x``: the forward's input (the all-gather's: ``x_full``, and
    ``dx`` is then this rank's ``[m, K]``); ``g_x``: the gradient of ``x_full`` where the
    caller used it, else None; ``sends``, ``receives``: an uneven all-to-all's splits (its
    backward is the all-to-all back, ``Collective.backward``).

    Where the collective has a ``dual`` (``overlap/collectives.py``), ``dx`` is the dual's
    overlapped matmul of ``g`` and ``w^T``: reduce-scatter's is ``all_gather_matmul(g, w^T)``,
    whose gathered ``g`` gives ``dw = x^T g_full``; the all-gather's is
    ``matmul_reduce_scatter(g, w^T)`` (plus the reduce-scatter of ``g_x``). Otherwise the
    product's gradient is ``Collective.backward(g)`` (plain), then ``dx = g_P w^T``,
    ``dw = x^T g_P``. ``op="avg"`` scales ``g`` by ``1 / R`` first."""
    pg = _group(group)
    R = _world(pg)
    spec = collective(collective_name)
    g2 = g.reshape(-1, w.shape[1]).contiguous()
    x2 = x.reshape(-1, x.shape[-1])
    if op == "avg" and R > 1:
        g2 = g2 / R
    dx = x.new_empty(0)
    if R == 1:
        gp = g2
    elif spec.before:  # x is x_full: dx is this rank's rows of the reduce-scattered sum
        gp = g2
        if need_dx:
            dx = _forward(g2, w.t(), spec.dual, pg, "sum", None, "auto", None)
            if g_x is not None:  # x_full was used: its gradient, reduce-scattered (plain)
                part = torch.empty_like(dx)
                collective(spec.dual).plain(g_x.contiguous(), part, pg)
                dx += part
        need_dx = False
    elif spec.dual is not None:  # reduce-scatter: dx = all_gather_matmul(g, w^T)
        if need_dx:
            dx, gp = _gather_forward(g2, w.t(), pg, None, "auto", None, need_dw)
        else:
            gp = g2.new_empty(g2.shape[0] * R, g2.shape[1])
            collective(spec.dual).plain(g2, gp, pg)
        dx, need_dx = dx.reshape(x.shape), False
    else:
        gp = spec.backward(g2, pg, None if sends is None else (sends, receives))
    if need_dx:
        dx = (gp @ w.t()).reshape(x.shape)
    dw = x2.t() @ gp if need_dw else w.new_empty(0)
    return dx, dw


@_backward_op.register_fake
def _(g, x, w, collective_name, group, op, need_dx, need_dw, g_x=None, sends=None, receives=None):
    dx_shape = x.shape
    if collective(collective_name).before:
        dx_shape = (x.shape[0] // _world(_group(group)), x.shape[1])
    return (x.new_empty(dx_shape if need_dx else 0), w.new_empty(w.shape if need_dw else 0))


def _setup(ctx, inputs, output) -> None:
    x, w, ctx.collective, ctx.group, ctx.op = inputs[:5]
    ctx.splits = tuple(inputs[7:])  # (sends, receives) of an uneven all-to-all, or ()
    ctx.save_for_backward(x, w)


def _backward(ctx, g):
    x, w = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    extra = (None, *ctx.splits) if ctx.splits and ctx.splits[0] is not None else ()
    dx, dw = _backward_op(g, x, w, ctx.collective, ctx.group, ctx.op, need_dx, need_dw, *extra)
    return (dx if need_dx else None, dw if need_dw else None,
            *([None] * (len(ctx.needs_input_grad) - 2)))  # fmt: skip


_matmul_collective_op.register_autograd(_backward, setup_context=_setup)


def _gather_setup(ctx, inputs, output) -> None:
    x, w, ctx.group = inputs[:3]
    ctx.shape = x.shape
    ctx.save_for_backward(output[1], w)
    ctx.set_materialize_grads(False)  # an unused x_full gets no gradient (None)


def _gather_backward(ctx, g, g_full):
    full, w = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    if g is None:
        g = full.new_zeros(full.shape[0], w.shape[1])
    if g_full is not None and g_full.numel() == 0:
        g_full = None
    extra = () if g_full is None else (g_full,)  # (inductor drops a None passed for it)
    dx, dw = _backward_op(g, full, w, "all_gather", ctx.group, "sum", need_dx, need_dw, *extra)
    return (dx.reshape(ctx.shape) if need_dx else None, dw if need_dw else None,
            None, None, None, None)  # fmt: skip


_all_gather_matmul_op.register_autograd(_gather_backward, setup_context=_gather_setup)


def _plain(
    x2: torch.Tensor,
    w: torch.Tensor,
    out2: torch.Tensor,
    p: Plan,
    scale: float | None,
    group: dist.ProcessGroup | None,
) -> None:
    """The sequential path: matmul, then one collective on the whole product."""
    if p.spec.replicated or p.world_size == 1:
        y = torch.matmul(x2, w, out=out2)
    else:
        y = x2 @ w  # reduce-scatter and all-to-all cannot run in place
    if scale is not None:
        y.mul_(scale)
    if p.world_size > 1:
        p.spec.plain(y, out2, group)


def matmul_allreduce(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    collective: str = "all_reduce",
    op: str = "sum",
    out: torch.Tensor | None = None,
    backend: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """``dist.all_reduce(x @ w)`` overlapped: ``x [..., K]``, ``w [K, N]`` -> ``[..., N]``.

    ``collective="reduce_scatter"`` makes it a reduce-scatter (``[M / R, N]``); the other
    arguments are those of ``matmul_collective``, as for the two below.
    """
    return matmul_collective(x, w, collective, group=group, op=op, out=out, backend=backend,
                             chunks=chunks)  # fmt: skip


def matmul_reduce_scatter(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    op: str = "sum",
    out: torch.Tensor | None = None,
    backend: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """``reduce_scatter_tensor`` of ``x @ w`` overlapped: ``x [..., K]``, ``w [K, N]`` ->
    ``[M / R, N]``, rank r holding rows ``[r * M / R, (r + 1) * M / R)`` of the sum."""
    return matmul_collective(x, w, "reduce_scatter", group=group, op=op, out=out,
                             backend=backend, chunks=chunks)  # fmt: skip


def matmul_all_to_all(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    input_split_sizes: list[int] | None = None,
    output_split_sizes: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """``all_to_all_single`` of ``x @ w`` overlapped: ``x [..., K]``, ``w [K, N]`` ->
    ``[..., N]``; row block ``j`` (``M / R`` rows) of the product goes to rank ``j``, and block
    ``s`` of the result came from rank ``s``. With ``input_split_sizes`` and
    ``output_split_sizes`` (as ``all_to_all_single``'s: the rows of ``x``, ordered by
    destination, sent to each rank, and the rows received from each), the blocks are uneven
    and the result is ``[sum(output_split_sizes), N]`` (MoE dispatch and combine)."""
    return matmul_collective(x, w, "all_to_all", group=group, out=out, backend=backend,
                             chunks=chunks, input_split_sizes=input_split_sizes,
                             output_split_sizes=output_split_sizes)  # fmt: skip


def grouped_matmul_all_to_all(
    x: torch.Tensor,
    w: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    input_split_sizes: list[int],
    output_split_sizes: list[int],
    group: dist.ProcessGroup | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """The MoE combine: every row through its expert, then an uneven all-to-all, overlapped
    band by band (as ``matmul_all_to_all`` with splits).

    Equals ``all_to_all_single(out, y, output_split_sizes, input_split_sizes)`` with
    ``y[i] = x[i] @ w[expert_ids[i]]``.

    Args:
        x: ``[M, K]`` (leading dims flattened), rows ordered by destination rank
            (``input_split_sizes[j]`` rows for rank ``j``); fp16, bf16 or fp32.
        w: ``[E, K, N]``, this rank's ``E`` experts, same dtype and device (any strides in
            the last two dims: ``weight.transpose(1, 2)`` of ``[E, N, K]`` is fine).
        expert_ids: ``[M]`` integer tensor, each row's expert in ``[0, E)``. It is read on the
            host once per call (a synchronization with its producer); rows sorted by expert
            within each destination's block make one matmul per (band, expert).
        input_split_sizes, output_split_sizes: rows sent to and received from each rank.
        group, out, backend, chunks: as in ``matmul_collective`` (NCCL per chunk only).

    Returns:
        ``[sum(output_split_sizes), N]``, block ``s`` from rank ``s``. Differentiable in
        ``x`` and ``w`` (the backward sends the gradient back, then per expert
        ``dx = g w_e^T``, ``dw_e = x_e^T g``; plain torch ops); a custom op under
        ``torch.compile``.

    Raises:
        TypeError, ValueError: wrong types, dtypes, devices or shapes (naming the argument),
            splits that do not fit (``matmul_collective``), expert ids out of range.
    """
    sends, receives = _check_grouped(x, w, expert_ids, input_split_sizes, output_split_sizes,
                                     backend, group, received=False)  # fmt: skip
    gname = _via_op(x, w, out, group)
    if gname is not None:
        return torch.ops.overlap.grouped_matmul_all_to_all(
            x, w, expert_ids, gname, backend, chunks, list(sends), list(receives)
        )
    runs = ExpertRuns(expert_ids, w.shape[0])
    return _split_forward(x, w, group, out, backend, chunks, sends, receives, runs)


@torch.library.custom_op("overlap::grouped_matmul_all_to_all", mutates_args=())
def _grouped_op(
    x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor, group: str, backend: str,
    chunks: int | None, sends: list[int], receives: list[int],
) -> torch.Tensor:  # fmt: skip
    """``grouped_matmul_all_to_all`` as a custom op (``group``: its name, "" for None)."""
    runs = ExpertRuns(expert_ids, w.shape[0])
    pg = _group(group)
    return _split_forward(x, w, pg, None, backend, chunks, tuple(sends), tuple(receives), runs)


@_grouped_op.register_fake
def _(x, w, expert_ids, group, backend, chunks, sends, receives):
    return x.new_empty(sum(receives), w.shape[-1])


@torch.library.custom_op("overlap::grouped_matmul_all_to_all_backward", mutates_args=())
def _grouped_backward_op(
    g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor, group: str,
    sends: list[int], receives: list[int], need_dx: bool, need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(dx, dw)`` of ``grouped_matmul_all_to_all`` (empty where not needed): the result's
    gradient sent back (the inverse all-to-all), then per run of an expert's rows. Empty
    ``sends``: no exchange (``x`` are the dispatch's received rows, ``g`` theirs)."""
    pg = _group(group)
    g2 = g.reshape(-1, w.shape[-1]).contiguous()
    exchange = sends and _world(pg) > 1  # (empty splits: the dispatch's rows, no exchange)
    gp = collective("all_to_all").backward(g2, pg, (sends, receives)) if exchange else g2
    x2 = x.reshape(-1, x.shape[-1])
    dx = torch.empty_like(x2) if need_dx else x.new_empty(0)
    dw = torch.zeros_like(w) if need_dw else w.new_empty(0)
    for a, b, e in ExpertRuns(expert_ids, w.shape[0]).runs:
        if need_dx:
            torch.matmul(gp[a:b], w[e].t(), out=dx[a:b])
        if need_dw:
            dw[e] += x2[a:b].t() @ gp[a:b]
    return dx.reshape(x.shape) if need_dx else dx, dw


@_grouped_backward_op.register_fake
def _(g, x, w, expert_ids, group, sends, receives, need_dx, need_dw):
    return x.new_empty(x.shape if need_dx else 0), w.new_empty(w.shape if need_dw else 0)


def _grouped_setup(ctx, inputs, output) -> None:
    x, w, expert_ids, ctx.group, _, _, ctx.sends, ctx.receives = inputs
    ctx.save_for_backward(x, w, expert_ids)


def _grouped_backward(ctx, g):
    x, w, expert_ids = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    dx, dw = _grouped_backward_op(g, x, w, expert_ids, ctx.group, ctx.sends, ctx.receives,
                                  need_dx, need_dw)  # fmt: skip
    return (dx if need_dx else None, dw if need_dw else None, *([None] * 6))


_grouped_op.register_autograd(_grouped_backward, setup_context=_grouped_setup)


def _check_grouped(x, w, expert_ids, sends, receives, backend, group, received: bool):
    """The checks of the two MoE ops; ``expert_ids`` has one id per row of ``x``, or with
    ``received`` per received row. Returns the splits as tuples."""
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.shape[0] < 1:
        raise ValueError(f"w must be [E, K, N] with E >= 1, got {getattr(w, 'shape', w)}")
    _check(x, w[0], "all_to_all", "sum", backend, group)
    splits = _check_splits(x, "all_to_all", sends, receives, group)
    rows = sum(splits[1]) if received else math.prod(x.shape[:-1])
    what = "received row" if received else "row of x"
    if not isinstance(expert_ids, torch.Tensor) or expert_ids.is_floating_point() or (
        expert_ids.numel() != rows
    ):  # fmt: skip
        got = getattr(expert_ids, "shape", expert_ids)
        raise ValueError(
            f"expert_ids must be an integer tensor with one id per {what} ({rows}), got {got}"
        )
    return splits


def all_to_all_grouped_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    input_split_sizes: list[int],
    output_split_sizes: list[int],
    group: dist.ProcessGroup | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """The MoE dispatch: an uneven all-to-all of the tokens, then every received row through
    its local expert, overlapped band by band (each band multiplied as soon as it has
    arrived; the mirror of ``grouped_matmul_all_to_all``).

    Equals ``y[i] = r[i] @ w[expert_ids[i]]`` with
    ``r = all_to_all_single(x, output_split_sizes, input_split_sizes)``.

    Args:
        x: ``[M, K]`` (leading dims flattened), rows ordered by destination rank.
        w: ``[E, K, N]``, this rank's experts (any strides in the last two dims).
        expert_ids: ``[sum(output_split_sizes)]`` integer tensor: the local expert of each
            *received* row, in the received order (block ``s`` from rank ``s``). Read on the
            host once per call; sorted by expert within each source's block is fastest.
        input_split_sizes, output_split_sizes, group, out, backend, chunks: as in
            ``grouped_matmul_all_to_all``.

    Returns:
        ``[sum(output_split_sizes), N]``. Differentiable in ``x`` and ``w`` (the backward
        multiplies per expert, then sends ``dx`` back; plain torch ops); a custom op under
        ``torch.compile``.

    Raises:
        TypeError, ValueError: as ``grouped_matmul_all_to_all``'s.
    """
    sends, receives = _check_grouped(x, w, expert_ids, input_split_sizes, output_split_sizes,
                                     backend, group, received=True)  # fmt: skip
    gname = _via_op(x, w, out, group)
    if gname is not None:
        return torch.ops.overlap.all_to_all_grouped_matmul(
            x, w, expert_ids, gname, backend, chunks, list(sends), list(receives),
            _needs_grad(x, w),
        )[0]  # fmt: skip
    runs = ExpertRuns(expert_ids, w.shape[0])
    return _dispatch_forward(x, w, group, out, backend, chunks, sends, receives, runs, False)[0]


@torch.library.custom_op("overlap::all_to_all_grouped_matmul", mutates_args=())
def _dispatch_op(
    x: torch.Tensor, w: torch.Tensor, expert_ids: torch.Tensor, group: str, backend: str,
    chunks: int | None, sends: list[int], receives: list[int], keep: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``all_to_all_grouped_matmul`` as a custom op: ``(result, received x)`` (the second
    empty unless ``keep``: the weight gradient needs it)."""
    runs = ExpertRuns(expert_ids, w.shape[0])
    return _dispatch_forward(x, w, _group(group), None, backend, chunks, tuple(sends),
                             tuple(receives), runs, keep)  # fmt: skip


@_dispatch_op.register_fake
def _(x, w, expert_ids, group, backend, chunks, sends, receives, keep):
    rows = sum(receives)
    return x.new_empty(rows, w.shape[-1]), x.new_empty((rows, x.shape[-1]) if keep else 0)


def _dispatch_setup(ctx, inputs, output) -> None:
    x, w, expert_ids, ctx.group, _, _, ctx.sends, ctx.receives, _ = inputs
    ctx.x_shape = x.shape
    ctx.save_for_backward(output[1], w, expert_ids)
    ctx.set_materialize_grads(False)


def _dispatch_backward(ctx, g, _g_received):
    received, w, expert_ids = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    if g is None:
        return (None,) * 9
    # the combine's backward of the received rows, exchanged the other way
    dz, dw = _grouped_backward_op(g, received, w, expert_ids, ctx.group, [], [], need_dx,
                                  need_dw)  # fmt: skip
    dx = None
    if need_dx:
        dx = torch.ops.overlap.all_to_all_back(dz, ctx.group, ctx.sends, ctx.receives)
        dx = dx.reshape(ctx.x_shape)
    return (dx, dw if need_dw else None, *([None] * 7))


@torch.library.custom_op("overlap::all_to_all_back", mutates_args=())
def _all_to_all_back(
    g: torch.Tensor, group: str, sends: list[int], receives: list[int]
) -> torch.Tensor:
    """The gradient of the uneven exchange: ``g`` (received rows) sent back to their
    senders, ``[sum(sends), K]``."""
    return collective("all_to_all").backward(g.contiguous(), _group(group), (sends, receives))


@_all_to_all_back.register_fake
def _(g, group, sends, receives):
    return g.new_empty(sum(sends), g.shape[-1])


_dispatch_op.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


_BAG_MODES = ("sum", "mean", "max")


def embedding_bag_all_to_all(
    tables: list[torch.Tensor],
    indices: list[torch.Tensor],
    offsets: list[torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    mode: str = "sum",
    rank_dims: list[int] | None = None,
    backend: str = "auto",
    chunks: int | None = None,
) -> torch.Tensor:
    """Model-parallel embedding tables (table-wise sharding) and the all-to-all over batch
    slices, overlapped: the pooled vectors of every destination's bags travel band by band.

    Rank ``r`` holds ``tables`` and pools them over the global batch of ``B`` bags; the result
    on every rank is its batch slice ``[B / R, D_all]``, column block ``s`` holding rank
    ``s``'s tables' pooled vectors in its table order. Equals ``embedding_bag`` per table,
    concatenated along columns, then ``all_to_all_single`` over batch slices.

    Args:
        tables: this rank's tables ``[rows_t, D_t]``, one dtype and device.
        indices, offsets: one pair per table, ``embedding_bag``'s 1-D format; every
            ``offsets`` has ``B`` entries (the same ``B`` on every rank, divisible by ``R``).
            ``offsets`` is read on the host at the bands' edges once per call.
        group, backend, chunks: as in ``matmul_collective`` (NCCL per chunk only; default 4
            chunks).
        mode: ``"sum"``, ``"mean"`` or ``"max"`` (``embedding_bag``'s).
        rank_dims: every rank's ``sum(D_t)``; None asks the ranks (a host collective every
            call: pass it where it is known).

    Returns:
        ``[B / R, D_all]``. Differentiable in the tables (the gradient is sent back, then
        ``embedding_bag``'s own backward); a custom op under ``torch.compile``.

    Raises:
        TypeError, ValueError: naming the argument (types, shapes, modes, ``B`` not
            divisible by ``R``, ``rank_dims`` that disagree with the tables).
    """
    R, rank = _world(group), (dist.get_rank(group) if _world(group) > 1 else 0)
    B = _check_bags(tables, indices, offsets, mode, backend, group, R)
    D = sum(t.shape[1] for t in tables)
    if rank_dims is None:
        rank_dims = [D]
        if R > 1:
            rank_dims = [None] * R
            dist.all_gather_object(rank_dims, D, group=group)
    if len(rank_dims) != R or rank_dims[rank] != D:
        raise ValueError(f"rank_dims must hold every rank's sum of table widths ({R} ints, "
                         f"this rank's {D}), got {rank_dims!r}")  # fmt: skip
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tables)
    if grad or torch.compiler.is_compiling():
        gname = "" if group is None else group.group_name
        return torch.ops.overlap.embedding_bag_all_to_all(
            tables, indices, offsets, gname, mode, list(rank_dims), backend, chunks
        )
    return _bags_forward(
        tables, indices, offsets, group, mode, tuple(rank_dims), backend, chunks, B
    )


def _check_bags(tables, indices, offsets, mode, backend, group, R) -> int:
    """The embedding-bag op's checks; returns ``B``."""
    check_group(group)
    if not isinstance(tables, (list, tuple)) or not tables:
        raise TypeError("tables must be a non-empty list of [rows, D] tensors")
    for name, seq in (("indices", indices), ("offsets", offsets)):
        if not isinstance(seq, (list, tuple)) or len(seq) != len(tables):
            raise ValueError(f"{name} must be a list with one tensor per table ({len(tables)})")
    if mode not in _BAG_MODES:
        raise ValueError(f"mode must be one of {_BAG_MODES}, got {mode!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    t0 = tables[0]
    for t, i, o in zip(tables, indices, offsets, strict=True):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in _DTYPES:
            raise TypeError(f"tables must be 2-D float tensors, got {getattr(t, 'shape', t)}")
        if t.dtype != t0.dtype or t.device != t0.device:
            raise ValueError("tables must share one dtype and device")
        for name, v in (("indices", i), ("offsets", o)):
            if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.is_floating_point():
                raise ValueError(f"{name} must hold 1-D integer tensors")
    B = offsets[0].numel()
    if any(o.numel() != B for o in offsets):
        raise ValueError("offsets must have the same number of bags (B) for every table")
    if B % R:
        raise ValueError(f"the batch ({B} bags) must be divisible by the world size ({R})")
    return B


def _bags_forward(tables, indices, offsets, group, mode, rank_dims, backend, chunks, B):
    """``embedding_bag_all_to_all`` of checked arguments, without autograd: band ``c`` of
    every destination's batch slice pooled into chunk ``c``'s send slot ``[R, h, D]``, an
    event after each, one ``all_to_all_single`` per chunk (``run_splits`` on the flattened
    slots, ``N = 1``), the received blocks copied into their columns."""
    R, D = len(rank_dims), sum(t.shape[1] for t in tables)
    b, t0 = B // R, tables[0]
    n = chunks or DEFAULT_SPLIT_CHUNKS if R > 1 else 1
    bands = [(c * b // n, (c + 1) * b // n) for c in range(n)]
    # the first index of every band's bags, on the host (one small copy per table)
    edges = sorted({j * b + e for j in range(R) for lo, hi in bands for e in (lo, hi)})
    at_edge = [dict(zip(edges, torch.cat([o, o.new_tensor([i.numel()])])[edges].tolist(),
                        strict=True)) for o, i in zip(offsets, indices, strict=True)]  # fmt: skip

    def pool(lo: int, hi: int) -> torch.Tensor:  # bags [lo, hi) of every table: [hi - lo, D]
        parts = []
        for t, i, o, e in zip(tables, indices, offsets, at_edge, strict=True):
            parts.append(F.embedding_bag(i[e[lo] : e[hi]], t, o[lo:hi] - e[lo], mode=mode))
        return torch.cat(parts, dim=1)

    if R == 1:
        return pool(0, B)
    # per chunk, elements (rows of width 1) received from and sent to every rank
    layout = [([(hi - lo) * d for d in rank_dims], [(hi - lo) * D] * R) for lo, hi in bands]
    sends, receives = tuple(b * D for _ in range(R)), tuple(b * d for d in rank_dims)
    call = _SplitCall(t0, group, backend, n, sends, receives, 1, 0)
    p, s, out = call.plan, call.stream, t0.new_empty(b, sum(rank_dims))
    send, recv = t0.new_empty(B * D, 1), t0.new_empty(b * sum(rank_dims), 1)
    starts = [sum(rank_dims[:s_]) for s_ in range(R)]
    try:
        at = 0
        for c, (lo, hi) in enumerate(bands):
            h = hi - lo
            for j in range(R):  # band c of destination j's slice
                send[at : at + h * D].view(h, D).copy_(pool(j * b + lo, j * b + hi))
                at += h * D
            call.mark(c, call.caller)
        call.transport.run_splits(p, send, recv, call.waiter(s), lambda c: None, s, layout)
        with torch.cuda.stream(s) if s is not None else contextlib.nullcontext():
            at = 0
            for lo, hi in bands:
                for s_, d in enumerate(rank_dims):
                    piece = recv[at : at + (hi - lo) * d].view(hi - lo, d)
                    out[lo:hi, starts[s_] : starts[s_] + d] = piece
                    at += (hi - lo) * d
    finally:
        call.end(t0)
    return out


@torch.library.custom_op("overlap::embedding_bag_all_to_all", mutates_args=())
def _bags_op(
    tables: list[torch.Tensor], indices: list[torch.Tensor], offsets: list[torch.Tensor],
    group: str, mode: str, rank_dims: list[int], backend: str, chunks: int | None,
) -> torch.Tensor:  # fmt: skip
    """``embedding_bag_all_to_all`` as a custom op (``group``: its name, "" for None)."""
    B = offsets[0].numel()
    return _bags_forward(tables, indices, offsets, _group(group), mode, tuple(rank_dims),
                         backend, chunks, B)  # fmt: skip


@_bags_op.register_fake
def _(tables, indices, offsets, group, mode, rank_dims, backend, chunks):
    return tables[0].new_empty(offsets[0].shape[0] // len(rank_dims), sum(rank_dims))


@torch.library.custom_op("overlap::embedding_bag_all_to_all_backward", mutates_args=())
def _bags_backward_op(
    g: torch.Tensor, tables: list[torch.Tensor], indices: list[torch.Tensor],
    offsets: list[torch.Tensor], group: str, mode: str, rank_dims: list[int],
) -> list[torch.Tensor]:  # fmt: skip
    """The tables' gradients: ``g [B / R, D_all]`` sent back (rank ``s`` gets its columns of
    every batch slice: ``[B, D_s]``), then ``embedding_bag``'s own backward per table."""
    pg, R = _group(group), len(rank_dims)
    D = sum(t.shape[1] for t in tables)
    b = g.shape[0]
    full = g
    if R > 1:
        starts = [sum(rank_dims[:s]) for s in range(R)]
        send = torch.cat(
            [g[:, a : a + d].reshape(-1) for a, d in zip(starts, rank_dims, strict=True)]
        )
        recv = g.new_empty(R * b * D)
        dist.all_to_all_single(recv, send, [b * D] * R, [b * d for d in rank_dims], group=pg)
        full = recv.view(R * b, D)
    grads, at = [], 0
    for t, i, o in zip(tables, indices, offsets, strict=True):
        grads.append(_bag_grad(t, i, o, full[:, at : at + t.shape[1]], mode))
        at += t.shape[1]
    return grads


def _bag_grad(t, idx, off, g, mode: str) -> torch.Tensor:
    """``embedding_bag``'s gradient for its table ``t`` from the pooled gradient ``g [B, D]``
    (a custom op's body runs without autograd, so it is written out): each index gets its
    bag's gradient (``"mean"``: over the bag's size); ``"max"``: only the first row holding
    the bag's maximum, per column."""
    acc = torch.zeros(t.shape, dtype=torch.float32, device=t.device)
    L, (B, D) = idx.numel(), g.shape
    if L == 0:
        return acc.to(t.dtype)
    pos = torch.arange(L, device=t.device)
    bag = torch.searchsorted(off.to(t.device), pos, right=True) - 1
    g = g.float()
    if mode != "max":
        part = g[bag]
        if mode == "mean":
            part /= torch.bincount(bag, minlength=B).clamp_min(1)[bag, None]
        return acc.index_add_(0, idx, part).to(t.dtype)
    vals, where = t[idx].float(), bag[:, None].expand(-1, D)
    best = torch.full((B, D), float("-inf"), device=t.device).scatter_reduce(0, where, vals, "amax")
    candidates = torch.where(vals == best[bag], pos[:, None], L)
    first = torch.full((B, D), L, device=t.device).scatter_reduce(0, where, candidates, "amin")
    hit = first < L
    cols = torch.arange(D, device=t.device).expand(B, -1)
    acc.index_put_((idx[first[hit]], cols[hit]), g[hit], accumulate=True)
    return acc.to(t.dtype)


@_bags_backward_op.register_fake
def _(g, tables, indices, offsets, group, mode, rank_dims):
    return [torch.empty_like(t) for t in tables]


def _bags_setup(ctx, inputs, output) -> None:
    tables, indices, offsets, ctx.group, ctx.mode, ctx.rank_dims = inputs[:6]
    ctx.n = len(tables)
    ctx.save_for_backward(*tables, *indices, *offsets)


def _bags_backward(ctx, g):
    saved, n = ctx.saved_tensors, ctx.n
    tables, indices, offsets = saved[:n], saved[n : 2 * n], saved[2 * n :]
    grads = _bags_backward_op(g.contiguous(), list(tables), list(indices), list(offsets),
                              ctx.group, ctx.mode, ctx.rank_dims)  # fmt: skip
    nones = [None] * n
    return grads, nones, nones, None, None, None, None, None


_bags_op.register_autograd(_bags_backward, setup_context=_bags_setup)
