"""Make a stream wait until a chunk counter reaches its target.

Three ways, one chosen per process (``method()``):

- ``"stream_wait"``: ``cuStreamWaitValue32(GEQ)`` from cuda-python on the stream; the front end
  of the GPU waits, no SM is used (measured working on H200s).
- ``"spin"``: a one-CTA Triton kernel (``spin.py``) where stream memory operations are missing
  (no cuda-python, or the driver refuses them). Tests force it with ``_method = "spin"``; it
  passed the two-GPU suite before the counters became one-shot, and has not run on GPUs since.
- CPU tensors (Triton interpreter, gloo): the kernel ran synchronously, so the counter is read
  on the host; a counter short of its target means tiles were lost, and raises.
"""

from __future__ import annotations

import functools
import warnings

import torch

_method: str | None = None


@functools.cache  # asked for at every driver call: the import statement costs 0.3 us (H200 host)
def _driver():
    try:
        from cuda.bindings import driver  # cuda-python >= 12.6
    except ImportError:
        from cuda import cuda as driver  # older cuda-python
    return driver


def method() -> str:
    """``"stream_wait"`` or ``"spin"``: how CUDA streams wait in this process."""
    global _method
    if _method is None:
        try:
            _driver()
            _method = "stream_wait"
        except ImportError:
            _method = "spin"
    return _method


def _stream_wait(stream: torch.cuda.Stream, counters: torch.Tensor, c: int, target: int) -> None:
    global _method
    drv = _driver()
    try:
        (err,) = drv.cuStreamWaitValue32(
            drv.CUstream(stream.cuda_stream),
            drv.CUdeviceptr(counters.data_ptr() + 4 * c),  # (no view made per chunk)
            target,
            drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ,
        )
        failure = None if err == drv.CUresult.CUDA_SUCCESS else str(err)
    except (TypeError, AttributeError) as e:  # a cuda-python whose API differs
        failure = repr(e)
    if failure is not None:
        # No stream memory operations here: use the spin kernel from now on.
        warnings.warn(
            f"cuStreamWaitValue32 failed ({failure}); waiting with a spin kernel",
            RuntimeWarning,
            stacklevel=3,
        )
        _method = "spin"
        _spin(stream, counters[c : c + 1], target)


def _spin(stream: torch.cuda.Stream, counter: torch.Tensor, target: int) -> None:
    from .spin import spin_until

    with torch.cuda.stream(stream):
        spin_until(counter, target)


# torch's raw getter of the current stream (the one its compiler's generated code uses), where
# this torch build has it (CUDA builds)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_raw_stream(device: torch.device) -> int:
    """Handle of ``device``'s current CUDA stream, through torch's raw getter where there is
    one: it skips the Stream object that ``torch.cuda.current_stream`` builds (~4.5 us each),
    which the host profile showed 7 times per call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _raw_stream is None:
        return torch.cuda.current_stream(index).cuda_stream
    return _raw_stream(index)


def check(err, what: str) -> None:
    """Raise RuntimeError naming the driver call ``what`` unless ``err`` is success."""
    drv = _driver()
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")


_WAIT, _WRITE = "wait", "write"
_MAX_BATCH = 255  # cuStreamBatchMemOp takes fewer than 256 operations


@functools.lru_cache(maxsize=4096)  # the same flags and counters at every call: host time
def _param(drv, kind: str, addr: int, value: int):
    """One ``CUstreamBatchMemOpParams``: a 32-bit wait (GEQ) or write (with the fence over the
    stream's earlier work, as ``cuStreamWriteValue32`` without flags)."""
    p = drv.CUstreamBatchMemOpParams()
    types = drv.CUstreamBatchMemOpType
    if kind == _WAIT:
        p.operation = p.waitValue.operation = types.CU_STREAM_MEM_OP_WAIT_VALUE_32
        v = p.waitValue
        v.flags = int(drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
    else:
        p.operation = p.writeValue.operation = types.CU_STREAM_MEM_OP_WRITE_VALUE_32
        v = p.writeValue
        v.flags = 0
    v.address = drv.CUdeviceptr(addr)
    v.value = value
    return p


class StreamOps:
    """What the copy-engine transports issue on one CUDA stream: copies, and stream memory
    operations (32-bit waits and writes of flags and counters) gathered in issue order and
    issued as one ``cuStreamBatchMemOp`` before the next copy or at ``flush``.

    In a CUDA graph a batch is one node, and every replay costs ~1.1-1.7 us of host time per
    such node however many operations it holds, where copy and kernel nodes cost next to
    nothing (one H200, 2026-11-24, ``bench_results/graph_launch_h200.json``: 16 waits as 16
    nodes 20-31 us per replay, 16 operations as one batch 4.1-4.5 us, 32 copies 2.7-3.0
    us). ``flush`` before anything else orders work after this stream's (``wait_stream``, an
    event) and at the end of a call.
    """

    def __init__(self, stream: int) -> None:
        self.stream = stream  # the raw handle
        self._ops: list[tuple[str, int, int]] = []

    def _add(self, op: tuple[str, int, int]) -> None:
        if len(self._ops) == _MAX_BATCH:
            self.flush()
        self._ops.append(op)

    def wait(self, addr: int, value: int) -> None:
        """Later work on the stream waits until the int32 at device address ``addr`` is at
        least ``value``."""
        self._add((_WAIT, addr, value))

    def write(self, addr: int, value: int) -> None:
        """Write ``value`` into the int32 at device address ``addr`` once the stream's
        earlier work (copies included) is done and visible."""
        self._add((_WRITE, addr, value))

    def copy(self, dst: int, src: int, n: int) -> None:
        """``n`` bytes from device address ``src`` to ``dst`` (either may be mapped from a
        peer or from host memory) by a copy engine, after everything queued so far."""
        self.flush()
        drv = _driver()
        cu = drv.CUstream(self.stream)
        (err,) = drv.cuMemcpyAsync(drv.CUdeviceptr(dst), drv.CUdeviceptr(src), n, cu)
        check(err, "cuMemcpyAsync")

    def flush(self) -> None:
        """Issue the queued waits and writes (one driver call)."""
        if not self._ops:
            return
        drv = _driver()
        params = [_param(drv, *op) for op in self._ops]
        self._ops.clear()
        (err,) = drv.cuStreamBatchMemOp(drv.CUstream(self.stream), len(params), params, 0)
        check(err, "cuStreamBatchMemOp")


def wait_counter(
    counters: torch.Tensor,
    c: int,
    target: int,
    stream: torch.cuda.Stream | None,
    ops: StreamOps | None = None,
) -> None:
    """Order everything issued later on ``stream`` after ``counters[c]`` reaches ``target``.

    Args:
        counters: the call's int32 chunk counters (zeroed before its kernel).
        c: the chunk.
        target: the chunk's tile count.
        stream: the CUDA stream that waits; ``None`` on CPU (the kernel has finished: the
            counter is read on the host).
        ops: the stream's ``StreamOps`` where the caller batches its stream memory
            operations (the copy-engine transports): the wait joins them.

    Raises:
        RuntimeError: (CPU) the counter is short of its target after the kernel finished.
    """
    if ops is not None:
        ops.wait(counters.data_ptr() + 4 * c, target)
        return
    if stream is None:
        value = int(counters[c])
        if value < target:
            raise RuntimeError(
                f"chunk counter is {value}, expected at least {target}: the GEMM did not "
                "signal every tile of this chunk"
            )
        return
    if method() == "stream_wait":
        _stream_wait(stream, counters, c, target)
    else:
        _spin(stream, counters[c : c + 1], target)
