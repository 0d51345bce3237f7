"""Recorded calls: a repeated eager call replays a CUDA graph of itself.

An eager call made a second time with the same arguments, inputs and outputs (its
``signature`` and its ``outputs``, by address, dtype, shape and strides) through a transport
that declares ``recorded`` (the copy engines) is captured into a CUDA graph, which that call
and every later one like it replays (``replay``, before any planning: the signature's output
shapes, ``context.shapes``, make the outputs first): one graph launch instead of the ~25
driver calls and the kernel launch of an eager call (the GPU work is the same: every call
zeroes its own counters and flags). Only the first sighting runs eagerly, so calls whose
addresses never repeat pay no capture.

The graphs of one transport (one group on one device) share a memory pool, its
``graph_pool``: a call's temporaries (counters, slots) die with it, so graphs captured later
reuse them, which is safe because the group's copy-engine calls never run at once; another
group's calls may run beside them, on another stream, and take another pool.

Not in validation mode (its watch needs the communication stream), not for NCCL (not yet run
on two GPUs), not while capturing, not where ``x`` was copied to make it 2-D (no key then).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .. import guard
from ..comm import Transport
from ..context import Context, records, shapes
from ..signal import current_raw_stream

# CUDA graphs of eager calls kept (all streams, least recently used out). A training step cycles
# through every overlapped call site (a 32-layer model: 128 or more): with 64 kept, a step of
# 128 signatures recorded nothing and paid 0.31 ms per call against 0.066 with all recorded;
# each recorded graph held ~0.5 MB of device memory (4-chunk all-reduce 1024x4096x4096 on the
# host road, one H200, 2026-11-24, records_scale_h200.json).
MAX_RECORDS = 512


class Record(NamedTuple):
    """A recorded eager call: its context and transport class, the generation of the
    transport's buffers it was recorded with, and its CUDA graph (None: seen once)."""

    ctx: Context
    cls: type[Transport]
    generation: int
    graph: torch.cuda.CUDAGraph | None


def signature(name, group, op, backend, chunks, x, w, *extra) -> tuple | None:
    """What an eager call's plan and recorded graph depend on besides its outputs: its
    arguments, the caller stream and the inputs' addresses, dtypes, shapes and strides; None
    where calls are not recorded (CPU, validation mode)."""
    if not x.is_cuda or guard.validating():
        return None
    return (name, group, op, backend, chunks, *extra, x.device, current_raw_stream(x.device),
            x.data_ptr(), x.dtype, x.shape, x.stride(), w.data_ptr(), w.dtype, w.shape,
            w.stride())  # fmt: skip


def outputs(*tensors: torch.Tensor) -> tuple:
    """The outputs' part of a record's key: addresses, dtypes, shapes, strides."""
    return tuple((t.data_ptr(), t.dtype, t.shape, t.stride()) for t in tensors)


def replay(key: tuple) -> str | None:
    """Replay the recorded graph of the call ``key`` (a signature and its outputs); returns
    its transport's name, or None where there is none, or its transport has new buffers or
    is broken."""
    rec = records.get(key)
    if rec is None or rec.graph is None:
        return None
    t = rec.ctx.transport(rec.cls)  # this stream after the last one of another stream
    if t.broken or t.generation != rec.generation:
        return None
    records.move_to_end(key)
    rec.graph.replay()
    return t.name


def recorded(
    call: Callable[[bool], None],
    ctx: Context,
    cls: type[Transport],
    *,
    capturing: bool,
    key: tuple | None,
    out_shapes: tuple,
) -> None:
    """``call(capturing)`` issues an overlapped call through a transport of ``cls`` on the
    current stream; recorded and replayed as the module docstring says where ``key`` (the
    call's ``signature`` and ``outputs``) is not None and ``cls`` declares ``recorded``."""
    if key is None or not cls.recorded:
        call(capturing)
        return
    t = ctx.transport(cls)  # this stream after the last one of another stream
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
        records[key] = Record(ctx, cls, t.generation, None)
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
