"""Validation mode's watch of one call: from right before its first collective the call has
``timeout()`` seconds, then a timer thread releases it (``Watch``).

Validation mode gives a call's collectives ``timeout`` seconds from the first one's issue
(``arm``), and after issuing waits on the host for the last. If it does not finish (a peer died
mid-call), the communicator is aborted from a timer thread, so that the GPU's streams (and a
host held inside CUDA) are released, and ``TimeoutError`` is raised; the group is unusable
afterwards, as after any NCCL abort. With torch's default ``TORCH_NCCL_ASYNC_ERROR_HANDLING``,
its watchdog may also end the process after the abort; set it to 0 to handle the error
yourself (the GPU tests do).
"""

from __future__ import annotations

import threading
import time

import torch

from . import settings

_issuing = threading.local()  # .watch: the Watch of the call this thread is issuing


def arm() -> None:
    """Right before a call's first collective: start its watch's clock (``Watch``), if the
    call this thread is issuing has a watch."""
    w = getattr(_issuing, "watch", None)
    if w is not None:
        w.arm()


class Watch:
    """Validation mode's watch of one call's work on ``stream`` (None: CPU work, already done
    when issued, so nothing to watch); ``fail(why)`` releases the call's waits on its peers
    and makes the group's later calls raise ``why`` (``Transport.fail``).

    Made before the call issues anything; ``arm`` starts the clock right before its first
    collective, and ``close`` (which arms it too) waits on the host until ``stream``'s work so
    far is done. If ``timeout()`` seconds pass first, ``fail`` runs in a timer thread and
    ``close`` raises ``TimeoutError``. The thread is what makes a call raise whose host is
    held inside CUDA while issuing: on two GPUs (2026-11-26) the all-gather's first cuBLAS
    matmul, the uneven all-to-all's ``index_select`` and the dispatch's matmuls, each issued
    after collectives stuck on a dead peer, did not return (not CUDA's lazy module loading:
    the all-gather hung the same with ``CUDA_MODULE_LOADING=EAGER``); the abort ends the
    collectives and the host goes on. Torch's ops release the GIL while in CUDA, so the
    thread runs. The clock starts at ``arm``, not at ``Watch()``: a first call's kernel
    compilation must not count."""

    def __init__(self, stream: torch.cuda.Stream | None, fail, what: str) -> None:
        self.stream, self.fail, self.what = stream, fail, what
        self.lock, self.state, self.timer = threading.Lock(), "new", None
        _issuing.watch = self

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, kind, error, tb) -> None:
        self.close(error)

    def arm(self) -> None:
        """Start the clock (once; not for CPU work)."""
        if self.stream is None or self.timer is not None:
            return
        self.state = "armed"
        self.timer = threading.Timer(settings.timeout(), self._fire)
        self.timer.daemon = True
        self.timer.start()

    def _fire(self) -> None:
        with self.lock:
            if self.state != "armed":
                return
            self.state = "fired"
        torch.cuda.set_device(self.stream.device)  # (this thread's device: the transports')
        self.fail(
            f"a call ({self.what}) did not finish within {settings.timeout():g} s (validation "
            "mode): a peer rank died or stopped mid-call. Call overlap.release(group) on every "
            "live rank and go on with a new process group, or restart the job"
        )

    def close(self, error: BaseException | None = None) -> None:
        """After the call's work is issued: wait for it (not when ``error``, an exception
        the issue raised, is given); raise ``TimeoutError`` if the clock ran out."""
        _issuing.watch = None
        if self.stream is None:
            return
        self.arm()
        if error is None:
            done = torch.cuda.Event()
            done.record(self.stream)
            while self.state == "armed" and not done.query():
                time.sleep(1e-4)
        with self.lock:
            fired = self.state == "fired"
            self.state = "closed"
        self.timer.cancel()
        if fired:
            self.timer.join()  # the abort has finished
            raise TimeoutError(
                f"{self.what}: the collectives did not finish within {settings.timeout():g} s "
                "(a peer rank died or stopped mid-call); the communicator was aborted and the "
                "group cannot be used again"
            ) from error
