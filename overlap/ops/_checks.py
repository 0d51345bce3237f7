"""Stage 1 of the call engine: the argument checks every op shares (each raises a
``TypeError`` / ``ValueError`` naming the argument), and the small helpers the ops' files use
before the engine takes over (custom-op routing, the group by name, capture state)."""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..collectives import OPS, Collective, collective
from ..comm import BACKENDS
from ..context import check_group
from ..graphs import span
from ..plan import MAX_CHUNKS

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def world(group: dist.ProcessGroup | None) -> int:
    """The group's world size (1 where ``torch.distributed`` is not initialized).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized, but a launcher (torchrun)
            set ``WORLD_SIZE`` > 1: each rank would compute its own un-summed product.
    """
    if group is None and not (dist.is_available() and dist.is_initialized()):
        launched = os.environ.get("WORLD_SIZE", "1")
        if launched.isdigit() and int(launched) > 1:
            raise RuntimeError(
                f"WORLD_SIZE={launched} is set (a launcher such as torchrun) but no process "
                "group is initialized: call torch.distributed.init_process_group() first; "
                "without it every rank would compute alone (world size 1)"
            )
        return 1
    return dist.get_world_size(group)


def check_backend(backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def check_chunks(chunks) -> None:
    """``chunks``: None or an int in [2, MAX_CHUNKS]."""
    if chunks is None:
        return
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise TypeError(f"chunks must be an int or None, got {type(chunks).__name__}")
    if not 2 <= chunks <= MAX_CHUNKS:
        raise ValueError(f"chunks must be in [2, {MAX_CHUNKS}], got {chunks}")


class Call(NamedTuple):
    """A matmul + collective call, besides its tensors, ``out`` and the public op that made it:
    the values its checks read (``check_operands``) and its memo keys (``record.signature``,
    whose arguments after ``x`` and ``w`` are these, in this order). Made once per call that
    takes the engine's full way (the plain path's fast lane, ``engine.plain_again``, builds
    none: it is given the values)."""

    collective: str
    group: dist.ProcessGroup | None
    op: str = "sum"
    backend: str = "auto"
    chunks: int | None = None


def check_operands(x, w, call: Call) -> Collective:
    """Raises on invalid arguments of a matmul + collective call ``call``; returns the
    collective's table entry."""
    name, group, op, backend, chunks = call
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
    check_backend(backend)
    check_chunks(chunks)
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [K, N], got shape {tuple(w.shape)}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension [..., K]")
    if x.dtype not in DTYPES:
        raise TypeError(f"x.dtype must be one of {DTYPES}, got {x.dtype}")
    if w.dtype != x.dtype:
        raise TypeError(f"w.dtype ({w.dtype}) must equal x.dtype ({x.dtype})")
    if w.device != x.device:
        raise ValueError(f"w is on {w.device} but x is on {x.device}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"K mismatch: x is {tuple(x.shape)} ([..., K]), w is {tuple(w.shape)} ([K, N])"
        )
    return spec


def check_out(out, shape: tuple[int, ...], x: torch.Tensor, *inputs: torch.Tensor) -> None:
    """``out``: a contiguous tensor of ``shape`` and ``x``'s dtype and device that shares no
    memory with ``x`` or ``inputs`` (the call reads them while it writes ``out``)."""
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
    for t in (x, *inputs):
        if out.numel() and t.numel() and _overlaps(out, t):
            raise ValueError("out must not share memory with the inputs (x, w)")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of ``a`` and ``b`` intersect (conservative for strides)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def capturing(t: torch.Tensor) -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def needs_grad(*tensors: torch.Tensor) -> bool:
    if torch.is_grad_enabled():
        for t in tensors:  # (a loop: a generator costs half a microsecond per call)
            if t.requires_grad:
                return True
    return False


def via_op(x: torch.Tensor, w: torch.Tensor, out, group) -> str | None:
    """The group's name for the custom op (``""`` for None) where a call must go through it:
    under autograd (its backward is registered) or ``torch.compile`` (it is opaque to
    tracing); None where the call runs directly (no dispatch cost)."""
    grad = needs_grad(x, w)
    if not (grad or torch.compiler.is_compiling()):
        return None
    if out is not None:
        why = "autograd (x or w requires grad)" if grad else "torch.compile"
        raise ValueError(f"out= does not support {why}")
    return name_of(group)


def name_of(group: dist.ProcessGroup | None) -> str:
    """How a custom op is given ``group``: its name, "" for None (``group_of``'s inverse)."""
    return "" if group is None else group.group_name


def group_of(name: str) -> dist.ProcessGroup | None:
    """The group a custom op was given by name ("" for None)."""
    return None if not name else dist.distributed_c10d._resolve_process_group(name)


@functools.lru_cache(maxsize=64)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def check_splits(x, name, sends, receives, group) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The checked ``(input_split_sizes, output_split_sizes)`` of an uneven all-to-all, as
    tuples."""
    if name != "all_to_all":
        raise ValueError(f"input_split_sizes / output_split_sizes are for all_to_all, not {name}")
    if sends is None or receives is None:
        raise ValueError("input_split_sizes and output_split_sizes go together (None for both: "
                         "equal splits)")  # fmt: skip
    R, M = world(group), math.prod(x.shape[:-1])
    for what, s in (("input_split_sizes", sends), ("output_split_sizes", receives)):
        if not isinstance(s, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in s
        ):  # fmt: skip
            raise TypeError(f"{what} must be a list of ints (one per rank), got {s!r}")
        if len(s) != R or min(s, default=0) < 0:
            raise ValueError(f"{what} must be {R} non-negative ints (one per rank), got {s!r}")
    if sum(sends) != M:
        raise ValueError(f"input_split_sizes add up to {sum(sends)}, not to x's {M} rows")
    rank = dist.get_rank(group) if R > 1 else 0
    if sends[rank] != receives[rank]:  # (the rows this rank sends itself)
        raise ValueError(
            f"input_split_sizes[{rank}] ({sends[rank]}) and output_split_sizes[{rank}] "
            f"({receives[rank]}) differ: they are the rows this rank (rank {rank}) sends itself"
        )
    return tuple(sends), tuple(receives)
