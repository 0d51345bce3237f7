"""Communicators that run one collective on the current CUDA stream (or on CPU for gloo).

- ``TorchComm``: the caller's ``torch.distributed`` group as it is. Collectives are issued with
  ``async_op=False`` while the communication stream is current, so ProcessGroupNCCL runs them on
  that stream (torch >= 2.6) and gloo runs them on the host.
- ``CupyComm``: a direct NCCL communicator (CuPy's binding) bootstrapped once from the group
  (rank 0's unique id is broadcast through it). It issues ``ncclAllReduce`` etc. on the current
  stream with no torch bookkeeping per call.

Sum is the only reduction: ``op="avg"`` is folded into the GEMM as a ``1 / R`` scale.
This file imports no Triton. The copy-engine transport (``peer.py``) is not a communicator of
this kind: it moves bands, and the GEMM's epilogue reduces.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..signal import current_raw_stream

BACKENDS = ("auto", "torch", "cupy", "ce")  # "auto" and "ce": overlap.api, comm/peer.py


class TorchComm:
    """Collectives through a ``torch.distributed`` process group."""

    name = "torch"

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def all_reduce(self, buf: torch.Tensor) -> None:
        """In-place sum of ``buf`` (contiguous) over the group."""
        dist.all_reduce(buf, group=self.group)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """``out`` (``n``) = this rank's ``n`` elements of the sum of ``inp`` (``R * n``)."""
        dist.reduce_scatter_tensor(out, inp, group=self.group)

    def all_to_all(self, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> None:
        """Send ``ins[j]`` to rank ``j``; receive rank ``j``'s piece into ``outs[j]``."""
        dist.all_to_all(outs, ins, group=self.group)

    def abort(self) -> None:
        """Abort the group's NCCL communicators (releases kernels stuck on a dead peer)."""
        dist.distributed_c10d._abort_process_group(self.group)


_NCCL_DTYPES = {torch.float16: 6, torch.float32: 7, torch.bfloat16: 9}  # ncclDataType_t
_NCCL_SUM = 0


class CupyComm:
    """Collectives through a direct NCCL communicator (``cupy.cuda.nccl``)."""

    name = "cupy"

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        from cupy.cuda import nccl  # optional dependency: imported only when asked for

        self._nccl = nccl
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        uid = [nccl.get_unique_id() if rank == 0 else None]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(uid, src=src, group=group)
        self.comm = nccl.NcclCommunicator(size, uid[0], rank)
        self.size = size

    def all_reduce(self, buf: torch.Tensor) -> None:
        p, s = buf.data_ptr(), current_raw_stream(buf.device)
        self.comm.allReduce(p, p, buf.numel(), _NCCL_DTYPES[buf.dtype], _NCCL_SUM, s)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.comm.reduceScatter(
            inp.data_ptr(),
            out.data_ptr(),
            out.numel(),
            _NCCL_DTYPES[out.dtype],
            _NCCL_SUM,
            current_raw_stream(out.device),
        )

    def all_to_all(self, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> None:
        s, nccl = current_raw_stream(ins[0].device), self._nccl
        nccl.groupStart()
        for peer in range(self.size):
            dt = _NCCL_DTYPES[ins[peer].dtype]
            self.comm.send(ins[peer].data_ptr(), ins[peer].numel(), dt, peer, s)
            self.comm.recv(outs[peer].data_ptr(), outs[peer].numel(), dt, peer, s)
        nccl.groupEnd()

    def abort(self) -> None:
        """Abort this NCCL communicator (releases kernels stuck on a dead peer)."""
        self.comm.abort()


def make_comm(backend: str, group: dist.ProcessGroup | None) -> TorchComm | CupyComm:
    """A communicator for ``group`` through ``backend`` ("torch" or "cupy")."""
    if backend == "torch":
        return TorchComm(group)
    if backend == "cupy":
        return CupyComm(group)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
