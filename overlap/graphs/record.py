"""Recorded calls: a repeated eager call replays a CUDA graph of itself.

An eager call made a second time with the same arguments, inputs and outputs (its
``signature`` and its ``outputs``: dtypes, shapes, strides, 16-byte alignment, the weight's
address) through a transport that declares ``recorded`` (the copy engines) is captured into a
CUDA graph, which that call and every later one like it replays (``replay``, without
planning: the call's memo, ``context.calls``, gives its plan and output shapes): one
graph launch instead of the ~25 driver calls and the kernel launch of an eager call (the GPU
work is the same: every call zeroes its own counters and flags). Only the first sighting runs
eagerly, so calls that never repeat pay no capture.

The input's and the outputs' addresses are in no key: a call whose tensors moved still
replays a graph of its record. A dense call's graph is pointed at them (``rebind``: one
driver call per node that holds them). The all-gather's graph (cuBLAS kernels, whose
parameters ``rebind`` cannot read for certain), and a dense one that ``rebind.bind``
refused, are not: a record keeps two graphs, the one it replayed last and a spare (the one
before), and a call at the addresses of either replays it; at a third address set the
spare's executable graph is updated from a capture of the call for them
(``cuGraphExecUpdate``: the driver checks that both have one topology, and the kernels'
parameters are cuBLAS's own) and replayed (``"updated"`` in ``overlap.stats``). Two address
sets taking turns (a forward recomputed for its backward) replay without captures.

Measured (the model bench's modes in turns, each a turn of three training steps after the
others' steps, 8B dims, fused layout, 4x H100, 2026-11-27): while the all-gather's key held
its addresses, a turn's first step ran its all-gathers eagerly and the second captured
them; overlap_sp took 25.3 / 25.7 / 23.5 ms at TP 2 and 19.6 / 21.6 / 14.1 at TP 4. Updated
graphs: 25.3 / 23.1 / 23.5 and 21.1 / 14.1 / 14.2 (one run: 19.0 / 13.9 / 14.1). A fresh
capture instantiated instead of the update: 26.2 / 23.8 / 24.0 and 24.7 / 14.5 / 14.5; the
all-gather never recorded: 17.0-17.3 ms every step at TP 4.

The graphs of one transport (one group on one device) share a memory pool, its
``graph_pool``: a call's temporaries (counters, slots) die with it, so graphs captured later
reuse them, which is safe because the group's copy-engine calls never run at once; another
group's calls may run beside them, on another stream, and take another pool.

Not in validation mode (its watch needs the communication stream), not for NCCL (not yet run
on two GPUs), not on CPU, not while capturing, not where ``x`` was copied to make it 2-D (no
key then). The outputs' addresses and devices are in no key: the engine checks a given
``out`` at every call (``check_out``), a replayed one included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import guard
from ..comm import Transport
from ..context import Context, records
from ..signal import current_raw_stream
from . import rebind

# CUDA graphs of eager calls kept (all streams, least recently used out). A training step cycles
# through every overlapped call site (a 32-layer model: 128 or more): with 64 kept, a step of
# 128 signatures recorded nothing and paid 0.31 ms per call against 0.066 with all recorded;
# each recorded graph held ~0.5 MB of device memory (4-chunk all-reduce 1024x4096x4096 on the
# host road, one H200, 2026-11-24, records_scale_h200.json).
MAX_RECORDS = 512


class Record(NamedTuple):
    """A recorded eager call: its context and transport class, the generation of the
    transport's buffers it was recorded with, its CUDA graph (None: seen once), the
    addresses of the tensors its graph now reads and writes that the key leaves out, where
    the graph holds them (None: it is not rebound), and a graph not rebound may have a
    spare: the graph and addresses it replayed for before (``recorded``)."""

    ctx: Context
    cls: type[Transport]
    generation: int
    graph: torch.cuda.CUDAGraph | None
    bases: tuple[int, ...]
    binding: rebind.Binding | None = None
    spare: tuple[torch.cuda.CUDAGraph, tuple[int, ...]] | None = None


def signature(x, w, collective, group, op, backend, chunks) -> tuple | None:
    """The key of an eager call's memo (``context.calls``) and, with its ``outputs``, of its
    recorded graph: its arguments (a ``_checks.Call``'s values, in its order: the full way
    passes ``*call``, the fast lane the same values one by one), the caller stream, the
    input's device, dtype, shape, strides and 16-byte alignment (the kernel's TMA loads), the
    weight's device, address, dtype, shape and strides: every value the argument checks read
    (``_checks.py``) and the plan depends on. None in validation mode (nothing is kept)."""
    if guard.validating():
        return None
    if group is None:  # the default group of the moment: a call made before init_process_group
        group = dist.group.WORLD  # (world size 1) must not answer for one made after it
    stream = current_raw_stream(x.device) if x.is_cuda else 0
    return (collective, group, op, backend, chunks, x.device, stream, x.data_ptr() % 16,
            x.dtype, x.shape, x.stride(), w.device, w.data_ptr(), w.dtype, w.shape,
            w.stride())  # fmt: skip


def outputs(*tensors: torch.Tensor) -> tuple:
    """The outputs' part of a record's key: dtypes, shapes, strides, 16-byte alignment."""
    return tuple((t.data_ptr() % 16, t.dtype, t.shape, t.stride()) for t in tensors)


def bases(*tensors: torch.Tensor) -> tuple[int, ...]:
    """The tensors' addresses (what ``signature`` and ``outputs`` leave out)."""
    return tuple(t.data_ptr() for t in tensors)


def replay(key: tuple, at: tuple[int, ...]) -> Transport | None:
    """Replay the recorded graph of the call ``key`` (a signature and its outputs) for the
    tensors at ``at`` (``bases`` of the moved tensors ``recorded`` was given); returns its
    transport, or None where there is none, its transport has new buffers, or the graph
    cannot be pointed at ``at``. A failed transport raises (``Context.transport``)."""
    rec = records.get(key)
    if rec is None or rec.graph is None:
        return None
    t = rec.ctx.transport(rec.cls)  # this stream after the last one of another stream
    if t.generation != rec.generation:
        return None
    if rec.bases != at and (rec := _point(key, rec, at)) is None:
        return None
    records.move_to_end(key)
    rec.graph.replay()
    return t


def _point(key: tuple, rec: Record, at: tuple[int, ...]) -> Record | None:
    """``rec`` for the tensors at ``at``: its spare where that replayed for them, else
    rebound; None where it has no binding, or where the driver refused (the record is
    dropped: some of its nodes may point elsewhere now)."""
    if rec.spare is not None and rec.spare[1] == at:
        rec = records[key] = rec._replace(
            graph=rec.spare[0], bases=at, spare=(rec.graph, rec.bases)
        )
        return rec
    if rec.binding is None:
        return None
    try:
        rec.binding.rebind(at)
    except rebind.DriverError:
        del records[key]
        return None
    rec = records[key] = rec._replace(bases=at)
    return rec


def recorded(
    call: Callable[[bool], None],
    ctx: Context,
    cls: type[Transport],
    *,
    capturing: bool,
    key: tuple | None,
    moved: tuple[torch.Tensor, ...] = (),
    rebound: bool = True,
) -> bool:
    """``call(capturing)`` issues an overlapped call through a transport of ``cls`` on the
    current stream; recorded and replayed as the module docstring says where ``key`` (the
    call's ``signature`` and ``outputs``) is not None and ``cls`` declares ``recorded``.
    ``moved``: the tensors whose addresses the key leaves out; ``rebound``: whether
    ``rebind`` may point the graph at them (else a capture for them updates it). True
    where the call replayed an updated graph."""
    if key is None or not cls.recorded:
        call(capturing)
        return False
    t = ctx.transport(cls)  # this stream after the last one of another stream
    at = bases(*moved)
    rec = records.get(key)
    if rec is not None and rec.generation != t.generation:
        rec = None  # (the transport's buffers are new: a first sighting)
    if rec is not None and rec.graph is not None and rec.bases != at:
        if (pointed := _point(key, rec, at)) is not None or rec.binding is not None:
            rec = pointed  # (None: the driver refused, the record dropped: a first sighting)
        else:  # a graph for these addresses, its spare the one for the last
            records.move_to_end(key)
            rec, updated = _another(rec, call, ctx, t, at)
            records[key] = rec
            rec.graph.replay()
            return updated
    if rec is None:  # first sighting (with these buffers)
        if len(records) >= MAX_RECORDS and key not in records:
            records.popitem(last=False)
        records[key] = Record(ctx, cls, t.generation, None, at)
        call(False)
        return False
    records.move_to_end(key)
    if rec.graph is None:
        bind = bool(moved) and rebound
        graph = _captured(call, ctx, t, keep=bind)
        binding = None
        if bind:
            graph.instantiate()
            binding = rebind.bind(graph, moved)
        rec = records[key] = rec._replace(graph=graph, bases=at, binding=binding)
    rec.graph.replay()
    return False


def _captured(call: Callable[[bool], None], ctx: Context, t: Transport, keep: bool):
    """A CUDA graph of ``call(True)``, captured on the context's record stream into the
    transport's graph pool; ``keep``: its graph kept (instantiated later), else instantiated."""
    graph = torch.cuda.CUDAGraph(keep_graph=keep)
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
    return graph


def _another(
    rec: Record, call: Callable[[bool], None], ctx: Context, t: Transport, at: tuple[int, ...]
) -> tuple[Record, bool]:
    """``(rec for the tensors at at, whether updated)``: ``rec``'s graph is not rebound and
    neither it nor its spare replays for ``at``. Without a spare, a new graph captured for
    them; else the spare's executable graph updated from a capture for them (where the driver
    refuses, that capture instantiated). The graph replayed before becomes the spare."""
    spare = (rec.graph, rec.bases)
    if rec.spare is None:
        return rec._replace(graph=_captured(call, ctx, t, keep=False), bases=at, spare=spare), False
    graph = _captured(call, ctx, t, keep=True)
    try:
        rebind.update(rec.spare[0], graph)
    except rebind.DriverError:
        graph.instantiate()
        return rec._replace(graph=graph, bases=at, spare=spare), False
    return rec._replace(graph=rec.spare[0], bases=at, spare=spare), True
