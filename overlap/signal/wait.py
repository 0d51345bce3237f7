"""Make a stream wait until a chunk counter reaches its target.

Three ways, one chosen per process (``method()``):

- ``"stream_wait"``: ``cuStreamWaitValue32(GEQ)`` from cuda-python on the stream; the front end
  of the GPU waits, no SM is used (measured working on H200s).
- ``"spin"``: a one-CTA Triton kernel (``spin.py``) where stream memory operations are missing
  (no cuda-python, or the driver refuses them).
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
    one: it skips the Stream object that ``torch.cuda.current_stream`` builds, which the host
    profile showed 7 times per call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _raw_stream is None:
        return torch.cuda.current_stream(index).cuda_stream
    return _raw_stream(index)


def wait_counter(
    counters: torch.Tensor, c: int, target: int, stream: torch.cuda.Stream | None
) -> None:
    """Order everything issued later on ``stream`` after ``counters[c]`` reaches ``target``.

    Args:
        counters: the call's int32 chunk counters (zeroed before its kernel).
        c: the chunk.
        target: the chunk's tile count.
        stream: the CUDA stream that waits; ``None`` for CPU counters.

    Raises:
        RuntimeError: (CPU) the counter is short of its target after the kernel finished.
    """
    if not counters.is_cuda:
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
