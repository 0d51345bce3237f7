"""The latency all-reduce: one-shot or two-shot over GPU-to-GPU mappings, for products too
small to overlap (decode, small batches), in place of NCCL's kernel.

A product ``[M, N]`` on the plain path is stored by its matmul straight into this rank's
symmetric-memory buffer (``partial``), and one kernel (``overlap/gemm/shot.py``) reads the
peers' buffers over NVLink and writes the sum into the result: no NCCL call, a few
microseconds of host time (one matmul, one kernel launch) where torch's ``dist.all_reduce``
costs ~45 us eagerly. One-shot (every rank reads every partial) below ``ONE_SHOT_BYTES``,
two-shot (reduce-scatter then all-gather, through the same buffers) up to ``SHOT_BYTES``:
``kind`` decides, the same on every rank.

One transport per (group, device), made by the first eligible eager call on every rank (the
mapping is a collective) and shared by the contexts of every caller stream (``sized``): a
call captured in a CUDA graph uses it where an eager call made it, else NCCL. Flags,
per-program call counts and the abort word stay in device memory, so a graph's replays
count on (``gemm/shot.py``: epochs, no resets). ``watched``: a peer that never arrives holds
the kernel in its barrier until the watchdog's ``abort`` sets the abort word (a stream
write: no SM needed), then the call raises.

Needs: CUDA, torch symmetric memory, cuda-python (the road "peer", ``route``), at most
``FLAGS_BYTES / (4 SHOT_PROGRAMS)`` ranks.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ..contract import FLAGS_BYTES, SHOT_PROGRAMS
from ..signal.wait import StreamOps
from .transport import Transport, kept

# Crossovers, product bytes (2 H200s, NVLink, bf16; tools/decode_bench.py's op sweep): one-shot
# up to ONE_SHOT_BYTES, two-shot up to SHOT_BYTES, NCCL (or the overlapped call) above.
ONE_SHOT_BYTES = 256 << 10
SHOT_BYTES = 16 << 20
# up to these bytes the latency all-reduce runs in place of an overlapped call too (at 512 x
# 8192 bf16, K = 14336 the overlapped call took 238 us, NCCL 221, torch's two-shot 211)
OVER_OVERLAP = 8 << 20
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KINDS = ("one-shot", "two-shot")


def kind(nbytes: int, world_size: int) -> str | None:
    """Which latency all-reduce ("one-shot", "two-shot", or None: NCCL) takes a product of
    ``nbytes`` over ``world_size`` ranks."""
    if 4 * SHOT_PROGRAMS * world_size > FLAGS_BYTES or nbytes > SHOT_BYTES:
        return None
    return "one-shot" if nbytes <= ONE_SHOT_BYTES else "two-shot"


class ShotTransport(Transport):
    """The group's symmetric buffer, flags, call counts and abort word; one per (group,
    device)."""

    name, road, sized, watched, column_bands = "shot", "peer", True, True, True

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.group, self.device = group, device
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        name = (group if group is not None else dist.group.WORLD).group_name
        with warnings.catch_warnings():  # needed by older torch, deprecated by newer
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(name)

        def make() -> tuple[torch.Tensor, ...]:
            buf = symm_mem.empty(FLAGS_BYTES + SHOT_BYTES, dtype=torch.uint8, device=device)
            handle = symm_mem.rendezvous(buf, name)
            buf[:FLAGS_BYTES].zero_()  # no flag set
            ptrs = [int(a) for a in handle.buffer_ptrs]
            flags = torch.tensor(ptrs, dtype=torch.int64, device=device)
            buffers = flags + FLAGS_BYTES
            epochs = torch.zeros(SHOT_PROGRAMS, dtype=torch.int32, device=device)
            abort = torch.zeros(1, dtype=torch.int32, device=device)
            return buf, handle, flags, buffers, epochs, abort

        made = kept(device, make)
        self.buf, self.handle, self.flags, self.buffers, self.epochs, self.word = made
        dist.barrier(group=group)  # every rank's flags are zero before anyone sets one

    def partial(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """This rank's buffer as a contiguous tensor of ``shape`` (at most ``SHOT_BYTES``):
        where the matmul stores its partial product."""
        n = 1
        for d in shape:
            n *= d
        return self.buf[FLAGS_BYTES : FLAGS_BYTES + n * dtype.itemsize].view(dtype).view(shape)

    def abort(self) -> None:
        """End this rank's waits on its peers: the abort word set by a stream write on a
        side stream (no SM: the waiting programs may hold some)."""
        side = torch.cuda.Stream(self.device)
        q = StreamOps(side.cuda_stream)
        q.write(self.word.data_ptr(), 1)
        q.flush()
        side.synchronize()

    def close(self) -> None:
        """Free the symmetric buffer (every rank of the group closes together)."""
        self.buf = self.handle = None

    @property
    def nbytes(self) -> int:
        """Memory this transport holds (the symmetric buffer on this GPU)."""
        return self.buf.numel() if self.buf is not None else 0
