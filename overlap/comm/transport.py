"""The one protocol every transport implements, and the choice of a transport for a call.

A transport moves the chunks of a plan between the ranks of a group. An overlapped call
(``overlap/ops/engine.py``) asks it, in this order:

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
3. ``fail(why)`` when validation mode's watch or the watchdog (``overlap/guard``) times
   out (a peer died or stopped mid-call): ``abort()``, and later calls raise ``why``;
4. ``close()`` when the context is released (``overlap.release``).

An all-gather (a collective *before* the matmul, ``overlap.all_gather_matmul``) asks instead
``gather(plan, x, stream, caller)``, which orders ``stream`` after ``caller``, issues every
chunk and returns the buffer the chunks arrive in, then ``arrived(plan, chunks, caller)``
before the consumer's matmuls of a band (``GatherPlan.shard_bands``).

An uneven exchange (the all-to-all with split sizes, the MoE ops, the embedding bags) asks a
transport that declares ``uneven`` for ``events``, ``order`` and ``run_splits``.

The transports: ``TorchTransport`` and ``CupyTransport`` (NCCL, one collective per chunk:
``nccl.py``), ``PeerTransport`` (copy engines GPU to GPU: ``peer.py``) and ``HostTransport``
(through pinned host memory: ``host.py``). ``comm.select`` (``choice.py``) chooses among them
by their capabilities and makes them. This package imports no Triton and no kernel.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..contract import Epilogue
from ..guard import RankMismatchError
from ..plan import Plan


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


def same_need(group: dist.ProcessGroup | None, nbytes: int, payload=None) -> list:
    """Every rank's ``payload``, from the collective a transport makes anyway when its buffers
    grow; ``nbytes`` (the call's need) travels with it. Ranks whose needs differ called with
    different sizes (validation off checks nothing else): every rank raises
    ``RankMismatchError`` instead of mapping buffers of different sizes."""
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (nbytes, payload), group=group)
    needs = [n for n, _ in everyone]
    if len(set(needs)) > 1:
        raise RankMismatchError(
            f"the ranks' calls need buffers of different sizes ({needs} bytes by rank): they "
            "called with different sizes. overlap.configure(validate=True) names the call"
        )
    return [p for _, p in everyone]


class Transport:
    """Base of every transport: the protocol above, and the capabilities it declares.

    The call engine (``overlap/ops/engine.py``) and ``comm.select`` ask these class
    attributes, never a transport's name:

    - ``name``: the label plans and messages show ("torch", "cupy", "ce");
    - ``blocked``: runs blocked plans (``make_plan(blocked=True)``), else the standard layout;
    - ``column_bands``: moves column-band plans (decode-sized products);
    - ``uneven``: runs uneven exchanges (``events``, ``order``, ``run_splits``);
    - ``road``: what it needs between the ranks: None (anything NCCL drives, across hosts),
      "peer" (one host, GPUs that map each other's memory) or "host" (one host, pinned
      shared host memory);
    - ``sized``: one transport per (group, device), shared by the contexts of every caller
      stream, whose buffers an eager call sizes: a call captured in a CUDA graph needs
      ``fits`` (a capture cannot grow them), and calls of two streams are serialized;
    - ``recorded``: a repeated eager call is recorded into a CUDA graph and replayed
      (``overlap/graphs/record.py``);
    - ``watched``: with validation off, ``guard.watchdog`` watches its calls in flight (torch
      watches its own collectives). Such a transport has ``group`` and ``device``;
    - ``covers``: the backward's weight gradient is issued inside its calls, where the caller
      stream would wait for the transfers (``engine.produce``'s ``cover``); False GPU to
      GPU, where a transfer outlasts its GEMM by ~0.1 ms at most and the cover's cuBLAS
      kernel would keep a recorded graph from being rebound (more graph updates: the model
      bench's training step 0.3-0.45 ms slower, 8B TP 2, 4x H200, 2026-11-28).

    State every transport has: ``broken`` (why it was failed, ``fail``; empty while usable:
    ``Context.transport`` refuses a broken one), ``generation``
    (grows with every new buffer: recorded graphs hold addresses) and ``graph_pool`` (the
    memory pool of its recorded calls' graphs).
    """

    name: str = ""
    blocked: bool = False
    column_bands: bool = True
    uneven: bool = False
    road: str | None = None
    sized: bool = False
    recorded: bool = False
    watched: bool = False
    covers: bool = True
    broken: str = ""
    generation: int = 0
    graph_pool = None

    def fits(self, M: int, N: int, K: int, spec, dtype: torch.dtype) -> bool:
        """Whether a call of ``[M, K] @ [K, N]`` and collective ``spec`` needs no bigger
        buffer than the transport has (``sized`` transports; the others make none)."""
        return True

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

    # -- uneven exchanges (``uneven``) ---------------------------------------------------------
    def events(self, n: int) -> list:
        """At least ``n`` CUDA events, one per chunk, made once and reused by every call of
        this transport's context (the uneven exchanges mark and wait for chunks on them)."""
        raise NotImplementedError

    def order(self, splits: tuple[int, ...], n: int, device, to_slots: bool) -> torch.Tensor:
        """Row indices between the standard layout of blocks of ``splits`` rows and its
        chunk-major slot layout (``plan.band_rows(splits, n)``): ``standard = slots[order]``,
        or with ``to_slots`` ``slots = standard[order]``."""
        raise NotImplementedError

    def run_splits(
        self,
        plan,
        send: torch.Tensor,
        recv: torch.Tensor,
        wait: Callable[[int], None],
        mark: Callable[[int], None],
        stream: torch.cuda.Stream | None,
        layout: list | None = None,
    ) -> None:
        """An uneven exchange (``SplitPlan``) on ``stream``, chunk by chunk: ``send`` and
        ``recv`` hold their rows in the chunk-major slot layouts; ``wait(c)`` before chunk
        ``c`` is sent, ``mark(c)`` after it has arrived, both on ``stream``. ``layout``:
        per chunk ``(rows received from each rank, rows sent to each)``, where the rows are
        not ``plan.splits``' bands (the embedding bags)."""
        raise NotImplementedError

    def abort(self) -> None:
        """Release this rank's waits on its peers; the transport is unusable afterwards."""
        raise NotImplementedError

    def fail(self, why: str) -> None:
        """``abort``, and make every later call raise ``why`` (``Context.transport``)."""
        self.broken = why
        self.abort()

    def close(self) -> None:
        """Free what the transport holds (buffers, mappings). No call may be in flight."""

    @property
    def nbytes(self) -> int:
        """Memory the transport keeps between calls, in bytes."""
        return 0
