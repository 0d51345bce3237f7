"""What the copy-engine transports and the fused GEMM epilogue agree on, written once.

The kernel (``overlap/gemm/matmul.py``), the transports (``overlap/comm/peer.py``,
``host.py``) and the tests import this module; it imports neither Triton nor
``torch.distributed``.

Plans are *blocked* (``make_plan(blocked=True)``): ``R * b`` equal row bands, ``b`` in each
rank's block of ``M / R`` rows; band ``a`` lies in block ``a // b`` as its band ``a % b``.

**Launch order.** Rank ``r`` launches the bands rotated to start at the first band of block
``r + 1`` (``first_band``), so that its own block comes last: chunk ``c`` (its counter) is
the ``c``-th band launched, band ``band_launched(c)``. The kernel computes the same rotation
from ``first_band``; ``tests/test_transport.py`` runs the real kernel against the real
transports, so the two cannot drift apart unnoticed.

**Flags** (int32 at the start of every rank's transport buffer, ``FLAGS_BYTES`` in all) are
one-shot: a writer sets a flag to 1 (``SET``), its reader waits until it is not 0, and the
flag is zeroed before the next call can set it again (``comm/peer.py`` says when). Every call
therefore writes and waits for the same values, which is what lets a CUDA graph replay it.

==============================  ============================================================
index                           set by
==============================  ============================================================
``ready(s)``                    rank ``s``, at the start of a call: its previous call is
                                done with this buffer, which may be written again
``arrived(s, k)``               rank ``s`` after pushing band ``k`` of this rank's block
                                (receive slot ``s``); the kernel's own tiles wait for it
``gathered(s, k)``              rank ``s`` after pushing its reduced band ``k`` (all-reduce's
                                gather slot ``s``)
==============================  ============================================================

The kernel reads the ``arrived`` flags from ``Epilogue.flags``, whose element ``s * b + k``
is ``arrived(s, k)`` (``FlagLayout.kernel_index``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .plan import Plan

FLAGS_BYTES = 4096  # flags at the start of every transport buffer (FlagLayout.check)
SET = 1  # the value of a set flag (zeroed: not set)

# The latency all-reduce through host memory (gemm/shot.py): a rank's region of the host
# buffer is SHOT_FLAGS_BYTES (its flag at 0, the abort word at SHOT_ABORT), then two slots; a
# call runs up to SHOT_PROGRAMS programs; each rank counts its calls in SHOT_STATE int32.
SHOT_PROGRAMS = 32
SHOT_STATE = 4
SHOT_FLAGS_BYTES = 4096
SHOT_ABORT = 2048


def shot_region_bytes(slot_bytes: int) -> int:
    """Bytes of one rank's region of the host latency all-reduce for slots of
    ``slot_bytes``."""
    return SHOT_FLAGS_BYTES + 2 * slot_bytes


def first_band(rank: int, world_size: int, bands_per_block: int) -> int:
    """The band rank ``rank`` launches first: the first band of block ``rank + 1``."""
    return (rank + 1) % world_size * bands_per_block


def band_launched(plan: Plan, rank: int, c: int) -> int:
    """The row band that rank ``rank`` launches ``c``-th (chunk ``c``) in a blocked plan."""
    b = plan.bands_per_block
    return (c + first_band(rank, plan.world_size, b)) % plan.n_row_bands


def kernel_flags_start(world_size: int) -> int:
    """Index of ``arrived(0, 0)``: where the kernel's flags (``Epilogue.flags``) begin."""
    return world_size


@dataclass(frozen=True)
class FlagLayout:
    """Indices (int32 elements) of the flags of ``world_size`` ranks with ``bands`` bands per
    rank block."""

    world_size: int
    bands: int

    def ready(self, src: int) -> int:
        return src

    def arrived(self, src: int, k: int) -> int:
        return kernel_flags_start(self.world_size) + self.kernel_index(src, k)

    def gathered(self, src: int, k: int) -> int:
        return self.world_size * (1 + self.bands) + src * self.bands + k

    def kernel_index(self, src: int, k: int) -> int:
        """``arrived(src, k)`` counted from ``arrived(0, 0)``: what the kernel reads."""
        return src * self.bands + k

    @property
    def count(self) -> int:
        return self.world_size * (1 + 2 * self.bands)

    def check(self) -> None:
        """Raises ValueError when the flags do not fit in ``FLAGS_BYTES``."""
        if 4 * self.count > FLAGS_BYTES:
            raise ValueError(
                f"too many ranks ({self.world_size}) or bands ({self.bands}) for the "
                f"transport's {FLAGS_BYTES} bytes of flags"
            )


@dataclass
class Epilogue:
    """What a copy-engine transport asks of the GEMM's epilogue for a blocked plan: tiles of
    this rank's own block (launched last) wait for the peers' ``arrived`` flags, add the
    peers' partials (when the collective reduces) and store straight into ``out``.

    ``out``: the result (``[M / R, N]`` reduce-scatter, ``[M, N]`` otherwise); ``recv``:
    ``[R, M / R, N]``, this rank's receive slots (slot ``s`` from rank ``s``); ``flags``:
    int32, element ``FlagLayout.kernel_index(s, k)`` is set once rank ``s`` has pushed band
    ``k`` of this call.
    """

    out: torch.Tensor
    recv: torch.Tensor
    flags: torch.Tensor
    rank: int
