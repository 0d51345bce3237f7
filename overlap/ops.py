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

One call: check the arguments -> the context of (group, device, caller stream)
(``overlap/context.py``) -> choose the transport (``comm.choose``) -> make the plan for it
(what ``overlap.plan`` returns and validation mode fingerprints) -> the transport's
``begin`` -> launch the GEMM -> the transport issues the chunks on the communication stream
-> the caller stream waits for it. No step goes back to redo an earlier one.

Failures: ``overlap.configure(validate=True)`` makes every call check that all ranks make the
same call, with a timeout, before anything is launched (``overlap/guard.py``, RELIABILITY.md).

Hazards: calls on one stream are serialized by that stream (the caller waits for the
communication stream at the end of every call, which also makes buffers allocated on the
caller stream safe to reuse). Calls can be captured in CUDA graphs (after one eager warm-up
call): a captured call counts on counters of its own that the graph zeroes at every replay,
and always goes through NCCL (the copy engines' flags hold per-call epochs that a replay
cannot renew). The first call of a group on a CUDA device asks every rank which road the
copy engines have (a collective), so every rank must make it. The Triton interpreter is used
for CPU tensors only when ``TRITON_INTERPRET=1`` is set before ``overlap`` first launches a
kernel (Triton reads it when the kernel is defined).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import torch
import torch.distributed as dist

from . import guard
from .collectives import OPS, collective
from .comm import BACKENDS, choose
from .context import Context, context, tuned, tuned_key
from .plan import Plan, make_plan, splits_rows, tiles_for
from .signal import wait_counter

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _world(group: dist.ProcessGroup | None) -> int:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def check_group(group) -> None:
    """Raises TypeError naming ``group`` unless it is a process group or None."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got "
                        f"{type(group).__name__}")  # fmt: skip


def _check(x: torch.Tensor, w: torch.Tensor, name: str, op: str, backend: str, group) -> None:
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
        x: ``[..., K]``. w: ``[K, N]``. collective, group, chunks, backend: as in
            ``matmul_collective``.

    Raises:
        ValueError, TypeError: on invalid arguments (the same checks as the call).
    """
    _check(x, w, collective, "sum", backend, group)
    return _plan_for(x, w, collective, group, chunks, backend, _capturing(x))[0]


def _plan_for(x, w, name, group, chunks, backend, capturing) -> tuple[Plan, Context | None]:
    """The plan of a checked call, and its context (None at world size 1)."""
    M, K, N = math.prod(x.shape[:-1]), x.shape[-1], w.shape[1]
    R, bits = _world(group), x.element_size() * 8
    if R == 1:
        return make_plan(
            M, N, K, world_size=1, collective=name, dtype_bits=bits, chunks=chunks
        ), None
    ctx = context(group, x.device)
    eligible = x.is_cuda and not capturing  # for the copy engines
    road = ctx.road() if eligible else None  # a collective on the group's first CUDA call
    if chunks is None:
        choice = tuned(tuned_key(group, M, N, K, x.dtype, name))  # set by overlap.tune only
        if choice == "plain":
            why = "overlap.tune measured the plain path fastest"
            return Plan("fallback", why, name, M, N, K, R), ctx
        chunks = choice
    transport = choose(
        backend,
        road,
        eligible=eligible,
        world_size=R,
        rows_split=splits_rows(M, name, R, tiles_for(M, bits, interpreter=not x.is_cuda)),
        rows_divisible=M % R == 0,
    )
    p = make_plan(
        M, N, K, world_size=R, collective=name, dtype_bits=bits, interpreter=not x.is_cuda,
        num_sms=_num_sms(x.device), chunks=chunks, blocked=Context.blocked(transport),
        transport=transport,
    )  # fmt: skip
    if p.path == "overlap" and not x.is_cuda:
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

    Returns:
        The result in the plain torch call's layout: ``[..., N]``, or ``[M / R, N]`` for
        reduce-scatter. Differentiable when ``x`` or ``w`` requires grad (the registered
        backward, ``_backward_op``: not overlapped); usable under ``torch.compile``
        (``fullgraph=True`` too: the call is the custom op ``overlap::matmul_collective``).

    Raises:
        TypeError: wrong type of ``x``, ``w``, ``out`` or ``group``, or wrong dtype.
        ValueError: shape or device mismatch, unknown collective/op/backend, ``M`` not
            divisible by R for reduce-scatter and all-to-all, ``out`` with autograd.
        overlap.RankMismatchError: (validation mode) the ranks' calls differ.
        TimeoutError: (validation mode) a rank did not arrive, or the call's collectives did
            not finish, within ``overlap.configure``'s timeout.
    """
    _check(x, w, collective, op, backend, group)
    grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
    if grad or torch.compiler.is_compiling():
        # the registered op: opaque to torch.compile, its backward registered with autograd
        if out is not None:
            why = "autograd (x or w requires grad)" if grad else "torch.compile"
            raise ValueError(f"out= does not support {why}")
        gname = "" if group is None else group.group_name
        return torch.ops.overlap.matmul_collective(x, w, collective, gname, op, backend, chunks)
    return _forward(x, w, collective, group, op, out, backend, chunks)


def _forward(x, w, collective, group, op, out, backend, chunks) -> torch.Tensor:
    """``matmul_collective`` of checked arguments, without autograd."""
    capturing = _capturing(x)
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
    overlapped(x2, w, out2, p, scale, ctx, capturing)
    return out


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

    transport = ctx.transport(p.transport)
    slots, epilogue = transport.begin(p, out2)
    device = x2.device
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
        chunked_matmul(x2, w, slots, counters, p, scale, epilogue=epilogue, trace=tiles)
        if not capturing:
            ctx.counters.commit(targets)
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
        if guard.validating() and not capturing:  # a capturing stream cannot be queried
            guard.watch(s, transport.abort, p.describe())


# The ops as torch custom ops: torch.compile(fullgraph=True) keeps them whole (Dynamo cannot
# trace the library's Python: locks, driver calls), and autograd runs the registered backward.
# A group travels as its name ("" for None); the ops resolve it in Python, outside tracing.


def _group(name: str) -> dist.ProcessGroup | None:
    return None if not name else dist.distributed_c10d._resolve_process_group(name)


@torch.library.custom_op("overlap::matmul_collective", mutates_args=())
def _matmul_collective_op(
    x: torch.Tensor, w: torch.Tensor, collective: str, group: str, op: str, backend: str,
    chunks: int | None,
) -> torch.Tensor:  # fmt: skip
    """``matmul_collective`` as a custom op; ``group``: the group's name, "" for None."""
    return _forward(x, w, collective, _group(group), op, None, backend, chunks)


@_matmul_collective_op.register_fake
def _(x, w, collective_name, group, op, backend, chunks):
    R = _world(_group(group))
    return x.new_empty(collective(collective_name).result_shape(tuple(x.shape), w.shape[1], R))


@torch.library.custom_op("overlap::matmul_collective_backward", mutates_args=())
def _backward_op(
    g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, collective_name: str, group: str, op: str,
    need_dx: bool, need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(dx, dw)`` of ``matmul_collective`` (empty where not needed), with the conventions of
    tensor parallelism (Megatron's): the gradient of this rank's product is
    ``Collective.backward`` of the result's gradient ``g`` (``overlap/collectives.py``),
    scaled by ``1 / R`` for ``op="avg"``; then ``dx = g_P @ w^T`` and ``dw = x^T @ g_P``.
    Plain torch ops (collective, then two matmuls): not overlapped."""
    pg = _group(group)
    R = _world(pg)
    g2 = g.reshape(-1, w.shape[1]).contiguous()
    gp = collective(collective_name).backward(g2, pg) if R > 1 else g2
    if op == "avg" and R > 1:
        gp = gp / R
    dx = (gp @ w.t()).reshape(x.shape) if need_dx else x.new_empty(0)
    dw = x.reshape(-1, x.shape[-1]).t() @ gp if need_dw else w.new_empty(0)
    return dx, dw


@_backward_op.register_fake
def _(g, x, w, collective_name, group, op, need_dx, need_dw):
    return (x.new_empty(x.shape if need_dx else 0), w.new_empty(w.shape if need_dw else 0))


def _setup(ctx, inputs, output) -> None:
    x, w, ctx.collective, ctx.group, ctx.op = inputs[:5]
    ctx.save_for_backward(x, w)


def _backward(ctx, g):
    x, w = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    dx, dw = _backward_op(g, x, w, ctx.collective, ctx.group, ctx.op, need_dx, need_dw)
    return dx if need_dx else None, dw if need_dw else None, None, None, None, None, None


_matmul_collective_op.register_autograd(_backward, setup_context=_setup)


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
