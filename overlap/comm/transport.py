"""The one protocol every transport implements, and the choice of a transport for a call.

A transport moves the chunks of a plan between the ranks of a group. An overlapped call
(``overlap/ops.py``) asks it, in this order:

1. ``begin(plan, out, caller)`` on the host before the GEMM is launched and before the
   communication stream forks from the caller stream ``caller`` (on which the copy engines
   zero their flags): the flat buffer the GEMM writes its chunk slots into, and the
   ``contract.Epilogue`` the transport asks of the kernel (``None``: the plain epilogue,
   every tile to its slot);
2. ``run(plan, slots, out, wait, stream)``: issue every chunk on ``stream`` (the
   communication stream; ``None`` on CPU), calling ``wait(c)`` first for each chunk ``c``
   it reads from ``slots`` (``wait`` orders the stream after chunk ``c``'s tiles; the copy
   engines call ``wait(c, ops)`` with their ``signal.wait.StreamOps`` of ``stream``, and the
   wait joins its batch);
3. ``abort()`` when validation mode's watch times out (a peer died mid-call);
4. ``close()`` when the context is released (``overlap.release``).

An all-gather (a collective *before* the matmul, ``overlap.all_gather_matmul``) asks instead
``gather(plan, x, stream, caller)``, which orders ``stream`` after ``caller``, issues every
chunk and returns the buffer the chunks arrive in, then ``arrived(plan, chunks, caller)``
before the consumer's matmuls of a band (``Plan.shard_bands``).

``blocked`` says which plan layout it runs (``make_plan(blocked=...)``). The transports:
``"torch"`` and ``"cupy"`` (NCCL, one collective per chunk: ``nccl.py``), ``"ce"`` (copy
engines GPU to GPU: ``peer.py``; through pinned host memory: ``host.py``). This package
imports no Triton and no kernel.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ..contract import Epilogue
from ..plan import Plan

BACKENDS = ("auto", "torch", "cupy", "ce")


def kept(device: torch.device, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()``, for a tensor a transport keeps across calls, run in a thread of its own
    and synchronized there: ``torch.compile(mode="reduce-overhead")`` warms a function up
    with its CUDA-graph pool taking what the warm-up's thread allocates (whatever the
    stream), and rejects allocations that outlive the function (the first call of a group,
    or of a bigger shape, may come there)."""
    if device.type != "cuda":
        return make()
    box: list = []

    def body() -> None:
        torch.cuda.set_device(device)
        try:
            box.append(make())
            torch.cuda.current_stream(device).synchronize()
        except BaseException as e:  # noqa: BLE001 (raised in the caller's thread)
            box.append(e)

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


class Transport:
    """Base of every transport (the protocol above)."""

    name: str = ""
    blocked: bool = False

    def begin(
        self, plan: Plan, out: torch.Tensor, caller: torch.cuda.Stream | None
    ) -> tuple[torch.Tensor, Epilogue | None]:
        """Host side, before the GEMM: ``(slots [M * N], epilogue)`` for ``plan``.

        ``out``: the 2-D result (``Collective.result_shape``), contiguous; ``caller``: the
        caller's stream (``None`` on CPU), on which work may be queued before the GEMM."""
        raise NotImplementedError

    def run(
        self,
        plan: Plan,
        slots: torch.Tensor,
        out: torch.Tensor,
        wait: Callable[..., None],
        stream: torch.cuda.Stream | None,
    ) -> None:
        """Issue every chunk of ``plan`` on ``stream``; ``out`` holds the result once
        ``stream``'s work is done."""
        raise NotImplementedError

    def gather(
        self,
        plan: Plan,
        x: torch.Tensor,
        stream: torch.cuda.Stream | None,
        caller: torch.cuda.Stream | None,
    ) -> torch.Tensor:
        """Order ``stream`` after the caller's stream ``caller`` (after what the transport
        queues there first), then issue the all-gather of this rank's shard ``x [M / R, K]``
        (contiguous) chunk by chunk on ``stream``; returns the ``[M, K]`` buffer the chunks
        arrive in, laid out as ``plan.shard_bands`` says (this rank's own rows may be left
        unwritten)."""
        raise NotImplementedError

    def arrived(
        self, plan: Plan, chunks: tuple[int, ...], stream: torch.cuda.Stream | None
    ) -> None:
        """Make ``stream`` (the caller's) wait until ``chunks`` of the last ``gather`` are in
        its buffer."""
        raise NotImplementedError

    def abort(self) -> None:
        """Release this rank's waits on its peers; the transport is unusable afterwards."""
        raise NotImplementedError

    def close(self) -> None:
        """Free what the transport holds (buffers, mappings). No call may be in flight."""

    @property
    def nbytes(self) -> int:
        """Memory the transport keeps between calls, in bytes."""
        return 0


def choose(
    backend: str,
    road: str | None,
    *,
    eligible: bool,
    world_size: int,
    rows_split: bool,
    rows_divisible: bool,
) -> str:
    """The transport a call with ``backend`` takes.

    "torch" and "cupy" are taken as asked. "auto" and "ce" take the copy engines ("ce")
    where they can run: a CUDA call (``eligible``), a road (``route``'s answer for the group:
    "peer", "host" or None), a row-band plan (``rows_split``: decode-sized products are cut
    into column bands, which NCCL moves) and ``M`` divisible by the world size. "auto" takes
    the road through host memory only for 2 ranks: with 4 H200s without P2P it was slower
    than sequential (0.79-0.94x) where NCCL per chunk reached 0.94-1.22x. Elsewhere both take
    NCCL through torch.

    Raises:
        ValueError: ``backend="ce"`` on an eligible call and no road (ranks on several hosts,
            or no stream memory operations).
    """
    if backend not in ("auto", "ce"):
        return backend
    if not eligible:
        return "torch"
    if road is None:
        if backend == "ce":
            raise ValueError(
                "backend='ce' needs all ranks on one host and stream memory operations "
                "(cuda-python); use 'auto' or 'torch'"
            )
        return "torch"
    if not rows_split or not rows_divisible:
        return "torch"
    if backend == "auto" and road == "host" and world_size > 2:
        return "torch"
    return "ce"
