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

Failures: ``overlap.configure(validate=True)`` makes every call check that all ranks make the
same call, with a timeout, before anything is launched (``overlap/guard.py``, RELIABILITY.md).

Transports: NCCL, one collective per chunk (``backend="torch"`` or ``"cupy"``), works on any
GPUs; the copy-engine transport (``"ce"``, ``overlap/comm/peer.py``) needs GPUs that map each
other's memory and is what ``"auto"`` (the default) takes there (``_resolve_backend``).

Hazards: state (counters, the communication stream, the copy-engine transport's buffer and
epochs) is kept per (group, device, caller stream), so calls on different streams never share
it; calls on one stream are serialized by that stream. NCCL communicators are kept per
(group, device, backend). Calls can be captured in CUDA graphs (after one eager warm-up call):
a captured call counts on counters of its own that the graph zeroes at every replay, and
always goes through NCCL. The first overlapped call of a group with ``"auto"`` or ``"ce"``
asks every rank whether the transport can run (a collective), so every rank must make it.
The Triton interpreter is used for CPU tensors only when ``TRITON_INTERPRET=1`` is set before
``overlap`` first launches a kernel (Triton reads it when the kernel is defined).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import guard, tuner
from .comm import BACKENDS, HostTransport, PeerTransport, make_comm, route, run_chunks
from .plan import COLLECTIVES, OPS, Plan, make_plan
from .signal import ChunkCounters, current_raw_stream, wait_counter

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _world(group: dist.ProcessGroup | None) -> int:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _check(x: torch.Tensor, w: torch.Tensor, collective: str, op: str, backend: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if op != "sum" and collective == "all_to_all":
        raise ValueError(f"op={op!r} needs a reduction; all_to_all only moves data")
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


def plan(
    x: torch.Tensor,
    w: torch.Tensor,
    collective: str = "all_reduce",
    *,
    group: dist.ProcessGroup | None = None,
    chunks: int | None = None,
) -> Plan:
    """The plan a call with these arguments takes: ``path`` ("overlap" or "fallback"), the
    chunks, tiles and ``reason``; ``plan(...).describe()`` prints it. (Through the copy-engine
    transport the call runs the blocked variant of this plan, ``api._blocked``: the same
    chunk count and tiles, the row bands regrouped by rank block.)

    Args:
        x: ``[..., K]``. w: ``[K, N]``. collective, group, chunks: as in ``matmul_collective``.

    Raises:
        ValueError, TypeError: on invalid arguments (the same checks as the call).
    """
    _check(x, w, collective, "sum", "torch")
    return _plan_checked(x, w, collective, group, chunks)


def _plan_checked(x, w, collective, group, chunks) -> Plan:
    M, K, N = math.prod(x.shape[:-1]), x.shape[-1], w.shape[1]
    R = _world(group)
    if chunks is None and R > 1:
        tuned = tuner.lookup(group, M, N, K, x.dtype, collective)  # set by overlap.tune only
        if tuned == "plain":
            return Plan("fallback", "overlap.tune measured the plain path fastest", collective,
                        M, N, K, R)  # fmt: skip
        chunks = tuned
    p = make_plan(
        M, N, K, world_size=R, collective=collective, dtype_bits=x.element_size() * 8,
        interpreter=not x.is_cuda, num_sms=_num_sms(x.device), chunks=chunks,
    )  # fmt: skip
    if p.path == "overlap" and not x.is_cuda:
        if not _interpreter():
            why = "CPU tensors and TRITON_INTERPRET is not 1"
        elif x.dtype == torch.bfloat16:
            why = "the Triton interpreter computes bfloat16 products wrongly (triton 3.6)"
        else:
            return p
        return Plan("fallback", why, collective, M, N, K, R)
    return p


@functools.lru_cache(maxsize=64)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass
class _Context:
    """Per (group, device, caller stream) state, reused across calls."""

    group: dist.ProcessGroup | None
    device: torch.device
    comm_stream: torch.cuda.Stream | None
    rendezvous: guard.Rendezvous | None = None  # validation mode, made on first use
    _counters: ChunkCounters | None = None  # eager calls only, made on first use
    _peer: PeerTransport | None = None  # backend "ce": its buffer and epoch follow this stream

    @property
    def counters(self) -> ChunkCounters:
        if self._counters is None:
            self._counters = ChunkCounters(self.device)
        return self._counters

    @counters.setter
    def counters(self, value: ChunkCounters) -> None:  # tests start them near the wrap
        self._counters = value

    def comm(self, backend: str):
        """The group's communicator through ``backend``, one per (group, device, backend) for
        every caller stream: a CUDA graph captures on a stream of its own, and a communicator
        cannot be made during capture. NCCL runs one communicator's collectives in issue
        order, whatever stream issued them. The copy-engine transport ("ce") is this context's
        own: its receive buffer and epochs belong to one stream of calls."""
        if backend == "ce":
            if self._peer is None:
                how = _routes[(self.group, str(self.device))]  # set by _resolve_backend
                cls = PeerTransport if how == "peer" else HostTransport
                self._peer = cls(self.group, self.device)
            return self._peer
        key = (self.group, str(self.device), backend)
        if key not in _comms:
            _comms[key] = make_comm(backend, self.group)
        return _comms[key]

    def agree(self, p: Plan, dtype: torch.dtype, op: str, backend: str) -> None:
        """Validation mode: every rank makes this same call (``overlap.guard``)."""
        if self.rendezvous is None:
            self.rendezvous = guard.Rendezvous(self.group)
        self.rendezvous.agree(guard.fingerprint(p, dtype, op, backend), p.describe())


_contexts: dict[tuple, _Context] = {}
_comms: dict[tuple, object] = {}
_routes: dict[tuple, str | None] = {}  # (group, device): comm.route's answer, asked once


def _blocked(p: Plan) -> Plan:
    """The copy-engine transport's plan for ``p`` (``make_plan(blocked=True)``): as many
    chunks, the same tiles."""
    return make_plan(
        p.M, p.N, p.K, world_size=p.world_size, collective=p.collective, dtype_bits=16,
        chunks=p.n_chunks, tiles=p.tiles, blocked=True,
    )  # fmt: skip


def _resolve_backend(backend: str, p: Plan, x: torch.Tensor, group) -> str:
    """The backend an overlapped call uses. "auto" and "ce" take the copy-engine transport
    where it runs: CUDA, all ranks on one host with stream memory operations (asked once per
    group: ``comm.route``, a collective), row-band chunks, ``M`` divisible by R, no CUDA-graph
    capture (its epochs are host values). It goes GPU to GPU where they map each other's
    memory, else through pinned host memory ("auto": only for 2 ranks, ``_by_route``).
    Elsewhere both take NCCL through torch; "ce" on a group it cannot reach raises."""
    if backend not in ("auto", "ce"):
        return backend
    if not x.is_cuda or _capturing(x):
        return "torch"
    key = (group, str(x.device))
    if key not in _routes:
        _routes[key] = route(group, x.device)
    return _by_route(backend, _routes[key], p)


def _by_route(backend: str, road: str | None, p: Plan) -> str:
    """The backend for "auto" or "ce" on a CUDA call outside capture, given ``road``.
    "auto" takes the road through host memory only for 2 ranks: with 4 H200s without P2P it
    was slower than sequential (0.79-0.94x) and NCCL per chunk reached 0.94-1.22x
    (BENCHMARKS.md, fifth session)."""
    if road is None:
        if backend == "ce":
            raise ValueError(
                "backend='ce' needs all ranks on one host and stream memory operations "
                "(cuda-python); use 'auto' or 'torch'"
            )
        return "torch"
    if p.n_col_bands > 1 or p.M % p.world_size:
        return "torch"
    if backend == "auto" and road == "host" and p.world_size > 2:
        return "torch"
    return "ce"


def _context(group: dist.ProcessGroup | None, device: torch.device) -> _Context:
    stream = current_raw_stream(device) if device.type == "cuda" else 0
    key = (group, str(device), stream)
    ctx = _contexts.get(key)
    if ctx is None:
        comm_stream = None
        if device.type == "cuda":
            _, highest = torch.cuda.Stream.priority_range()
            comm_stream = torch.cuda.Stream(device, priority=highest)
        ctx = _Context(group, device, comm_stream)
        _contexts[key] = ctx
    return ctx


def _capturing(t: torch.Tensor) -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _result_shape(x: torch.Tensor, N: int, collective: str, R: int) -> tuple[int, ...]:
    if collective == "reduce_scatter":
        return (math.prod(x.shape[:-1]) // R, N)
    return (*x.shape[:-1], N)


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
            plan or a CUDA-graph capture does not allow it, see ``_resolve_backend``).
        chunks: about how many chunks to use (default: the planner's choice).

    Returns:
        The result in the plain torch call's layout: ``[..., N]``, or ``[M / R, N]`` for
        reduce-scatter. Differentiable when ``x`` or ``w`` requires grad (``_Backward``: the
        backward is not overlapped).

    Raises:
        TypeError: wrong dtype or type of ``x``, ``w`` or ``out``.
        ValueError: shape or device mismatch, unknown collective/op/backend, ``M`` not
            divisible by R for reduce-scatter and all-to-all, ``out`` with autograd.
        overlap.RankMismatchError: (validation mode) the ranks' calls differ.
        TimeoutError: (validation mode) a rank did not arrive, or the call's collectives did
            not finish, within ``overlap.configure``'s timeout.
    """
    _check(x, w, collective, op, backend)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        if out is not None:
            raise ValueError("out= does not support autograd (x or w requires grad)")
        return _Backward.apply(x, w, collective, group, op, backend, chunks)
    p = _plan_checked(x, w, collective, group, chunks)
    R, M, N = p.world_size, p.M, p.N
    shape = _result_shape(x, N, collective, R)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    else:
        _check_out(out, shape, x)
    x2 = x if x.dim() == 2 else x.reshape(M, p.K)
    out2 = out if out.dim() == 2 else out.view(-1, N)
    scale = 1.0 / R if op == "avg" and R > 1 else None
    ctx = None
    if R > 1 and (p.path == "overlap" or guard.validating()):
        ctx = _context(group, x.device)
    if ctx is not None and guard.validating():
        ctx.agree(p, x.dtype, op, backend)  # before anything is launched
    if p.path != "overlap":
        _plain(x2, w, out2, p, scale, group)
        if ctx is not None and guard.validating() and x.is_cuda and not _capturing(x):
            guard.watch(torch.cuda.current_stream(x.device), ctx.comm("torch").abort, p.describe())
        return out

    _overlapped(x2, w, out2, p, scale, ctx, ctx.comm(_resolve_backend(backend, p, x, group)))
    return out


def _overlapped(x2, w, out2, p: Plan, scale, ctx: _Context, comm, trace=None) -> None:
    """The overlapped path: the GEMM on the caller stream, one collective per chunk on the
    communication stream, each after its chunk's counter; the caller waits for the last.

    ``trace`` (``tools/timeline.py``): ``trace.tiles`` goes to the kernel, and
    ``trace.stamp(i)`` is called on the communication stream when chunk ``i // 2`` is ready
    (even ``i``) and when its collective has finished (odd ``i``).
    """
    from .gemm import chunked_matmul  # Triton: imported on first use

    M, N = p.M, p.N
    dtype, device = x2.dtype, x2.device
    in_place = p.n_col_bands == 1
    peer = comm if isinstance(comm, PeerTransport) else None
    fuse = None
    if peer is not None:  # copy engines: the blocked plan, the kernel finishes own tiles
        p = _blocked(p)
        fuse = peer.begin(p, dtype, out2)
    if in_place and (
        p.collective == "all_reduce"
        or (peer is not None and peer.a2a_in_place and p.collective == "all_to_all")
    ):
        # row bands of the standard layout are already contiguous; through copy engines the
        # peers' blocks of `out` are scratch until their own data arrives
        p_flat = out2.view(-1)
    else:
        p_flat = torch.empty(M * N, dtype=dtype, device=device)
    recv_flat = None
    if p.collective != "all_reduce" and not in_place:
        recv_flat = torch.empty(out2.numel(), dtype=dtype, device=device)
    capturing = _capturing(x2)
    if capturing:
        # A CUDA graph replays the targets it captured, so it gets counters of its own, zeroed
        # by the graph itself (on the caller stream, before `s` forks from it) at every replay.
        counters = torch.zeros(p.n_chunks, dtype=torch.int32, device=device)
        targets, views = list(p.tiles_per_chunk), counters.split(1)
    else:
        counters = ctx.counters.tensor
        targets, views = ctx.counters.targets(p.tiles_per_chunk), ctx.counters.views
    s = ctx.comm_stream  # None on CPU: the interpreter runs the kernel to completion, then gloo

    def wait(c: int) -> None:
        if trace is not None and c:
            trace.stamp(2 * c - 1)
        wait_counter(views[c], targets[c], s)
        if trace is not None:
            trace.stamp(2 * c)

    # (the device switch and the stream context cost host time: only where they do something)
    other_device = x2.is_cuda and device.index != torch.cuda.current_device()
    with torch.cuda.device(device) if other_device else contextlib.nullcontext():
        if s is not None:
            caller = torch.cuda.current_stream(device)
            s.wait_stream(caller)  # inputs and buffers are ready before `s` touches them
        tiles = trace.tiles if trace is not None else None
        chunked_matmul(x2, w, p_flat, counters, p, scale, trace=tiles, fuse=fuse)
        if not capturing:
            ctx.counters.commit(targets)
        try:
            if peer is not None:  # driver calls on `s` itself: `s` need not be current
                peer.run(p, p_flat, out2, wait, s)
            else:
                with torch.cuda.stream(s):  # NCCL issues on the current stream
                    run_chunks(p, comm, p_flat, out2, recv_flat, wait)
            if trace is not None:
                with torch.cuda.stream(s):
                    trace.stamp(2 * p.n_chunks - 1)
        finally:
            if s is not None:
                # The caller continues after the last collective, so buffers allocated on it
                # are free to reuse once this call's work on `s` is done (also when a chunk's
                # collective raised: the chunks issued before it still use them).
                caller.wait_stream(s)
        if guard.validating() and not capturing:  # a capturing stream cannot be queried
            guard.watch(s, comm.abort, p.describe())


class _Backward(torch.autograd.Function):
    """``matmul_collective`` under autograd, with the conventions of tensor parallelism
    (Megatron's): the loss is a function of the distinct results, so

    - all-reduce: the result is replicated and so is its gradient ``g``; each rank's product
      gets ``g`` itself (the backward of the all-reduce is the identity);
    - reduce-scatter: rank r's rows get ``g_r``; each rank's product gets the all-gather of
      every rank's ``g`` ``[M, N]``;
    - all-to-all: the inverse exchange, which is again an all-to-all;

    ``op="avg"`` scales it by ``1 / R``. Then ``dx = g_P @ w^T`` and ``dw = x^T @ g_P``. The
    backward runs plain torch ops (collective, then two matmuls): it is not overlapped.
    """

    @staticmethod
    def forward(ctx, x, w, collective, group, op, backend, chunks):  # noqa: D102
        ctx.save_for_backward(x, w)
        ctx.collective, ctx.group, ctx.op = collective, group, op
        return matmul_collective(
            x, w, collective, group=group, op=op, backend=backend, chunks=chunks
        )

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        x, w = ctx.saved_tensors
        R = _world(ctx.group)
        N = w.shape[1]
        g2 = g.reshape(-1, N).contiguous()
        if R > 1 and ctx.collective == "reduce_scatter":
            gp = g2.new_empty(g2.shape[0] * R, N)
            dist.all_gather_into_tensor(gp, g2, group=ctx.group)
        elif R > 1 and ctx.collective == "all_to_all":
            gp = torch.empty_like(g2)
            dist.all_to_all_single(gp, g2, group=ctx.group)
        else:
            gp = g2
        if ctx.op == "avg" and R > 1:
            gp = gp / R
        x2 = x.reshape(-1, x.shape[-1])
        dx = (gp @ w.t()).reshape(x.shape) if ctx.needs_input_grad[0] else None
        dw = x2.t() @ gp if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None, None


def _plain(
    x2: torch.Tensor,
    w: torch.Tensor,
    out2: torch.Tensor,
    p: Plan,
    scale: float | None,
    group: dist.ProcessGroup | None,
) -> None:
    """The sequential path: matmul, then one collective on the whole product."""
    if p.collective == "all_reduce" or p.world_size == 1:
        y = torch.matmul(x2, w, out=out2)
    else:
        y = x2 @ w  # reduce-scatter and all-to-all cannot run in place
    if scale is not None:
        y.mul_(scale)
    if p.world_size > 1:
        _collective(p.collective, y, out2, group)


def _collective(
    collective: str, y: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup | None
) -> None:
    """The plain torch collective of a product ``y [M, N]``: all-reduce in place on ``y``,
    reduce-scatter (``out [M / R, N]``) and all-to-all (``out [M, N]``) into ``out``."""
    if collective == "all_reduce":
        dist.all_reduce(y, group=group)
    elif collective == "reduce_scatter":
        dist.reduce_scatter_tensor(out, y, group=group)
    else:
        dist.all_to_all_single(out, y, group=group)


def matmul_allreduce(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    collective: str = "all_reduce",
    op: str = "sum",
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``dist.all_reduce(x @ w)`` overlapped: ``x [..., K]``, ``w [K, N]`` -> ``[..., N]``.

    ``collective="reduce_scatter"`` makes it a reduce-scatter (``[M / R, N]``); the other
    arguments are those of ``matmul_collective``.
    """
    return matmul_collective(x, w, collective, group=group, op=op, out=out, backend=backend)


def matmul_reduce_scatter(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    op: str = "sum",
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``reduce_scatter_tensor`` of ``x @ w`` overlapped: ``x [..., K]``, ``w [K, N]`` ->
    ``[M / R, N]``, rank r holding rows ``[r * M / R, (r + 1) * M / R)`` of the sum."""
    return matmul_collective(x, w, "reduce_scatter", group=group, op=op, out=out, backend=backend)


def matmul_all_to_all(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``all_to_all_single`` of ``x @ w`` overlapped: ``x [..., K]``, ``w [K, N]`` ->
    ``[..., N]``; row block ``j`` (``M / R`` rows) of the product goes to rank ``j``, and block
    ``s`` of the result came from rank ``s``."""
    return matmul_collective(x, w, "all_to_all", group=group, out=out, backend=backend)
