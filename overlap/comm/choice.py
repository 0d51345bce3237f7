"""Where transports are chosen and made: the one place that reads ``backend`` names.

``select`` picks a transport class for a call from what the classes declare
(``Transport``'s capabilities) and what the group's ranks can do (``road``); ``make`` returns
the instance a context uses.

Kept in the group's state on the device (``overlap/state.py``, closed by ``overlap.release``):
the road (a collective asked on the first CUDA call of the group outside graph capture,
whatever its backend and path, so that every rank asks at the same call), the communicator of
each NCCL transport class and the ``sized`` transports (one per group and device, shared by
every caller stream: a call captured in a CUDA graph uses the buffers an eager call sized).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .. import guard
from ..state import UNASKED, state
from .host import HostTransport
from .nccl import CupyTransport, NcclTransport, TorchTransport
from .peer import PeerTransport, route
from .transport import Transport

BACKENDS = ("auto", "torch", "cupy", "ce")
_NAMED: dict[str, type[Transport]] = {"torch": TorchTransport, "cupy": CupyTransport}
_ENGINES = (PeerTransport, HostTransport)  # the copy engines, by road
_log = logging.getLogger("overlap")


def road(group: dist.ProcessGroup | None, device: torch.device, capturing: bool) -> str | None:
    """``route``'s answer for ``group`` on the CUDA ``device``: a collective the first time
    (while ``capturing``, which cannot ask: the answer known, or None), which validation mode
    precedes with an agreement (a rank that never arrives raises ``TimeoutError`` there)."""
    s = state(group, device)
    if s.road == UNASKED:
        if capturing:
            return None
        if guard.validating():  # every rank there first: the collective has no timeout
            guard.agree(group, "road", "the group's first CUDA call asks which road it has")
        s.road = route(group, device)
    return s.road


def select(
    backend: str,
    road: str | None,
    *,
    eligible: bool,
    world_size: int,
    rows_split: bool,
    rows_divisible: bool,
    fits=None,
) -> type[Transport]:
    """The transport class a call with ``backend`` takes.

    "torch" and "cupy" are taken as asked. "auto" and "ce" take the copy engines of the
    group's ``road`` ("peer" or "host"; None: several hosts, no CUDA or no stream memory
    operations) where they can run: a CUDA call (``eligible``), a row-band plan
    (``rows_split``: decode-sized products are cut into column bands, which the copy engines
    do not move), ``M`` divisible by the world size, and, for a call being captured into a
    CUDA graph, buffers an eager call has sized big enough (``fits(cls)``; None when not
    capturing). "auto" takes the road through host memory only for 2 ranks: with 4 H200s
    without P2P it was slower than sequential (0.79-0.94x) where NCCL per chunk reached
    0.94-1.22x. Elsewhere both take NCCL through torch.

    Raises:
        ValueError: ``backend="ce"`` on an eligible call and no road.
    """
    if backend in _NAMED:
        return _NAMED[backend]
    if not eligible:
        return TorchTransport
    engines = next((cls for cls in _ENGINES if cls.road == road), None)
    if engines is None:
        if backend == "ce":
            raise ValueError(
                "backend='ce' needs all ranks on one host and stream memory operations "
                "(cuda-python); use 'auto' or 'torch'"
            )
        return TorchTransport
    if (not rows_split and not engines.column_bands) or not rows_divisible:
        return TorchTransport
    if backend == "auto" and engines.road == "host" and world_size > 2:
        return TorchTransport
    if fits is not None and not fits(engines):
        return TorchTransport  # a capture cannot make or grow the buffers: NCCL runs anywhere
    return engines


def select_uneven(backend: str) -> type[Transport]:
    """The transport class of an uneven exchange: one that declares ``uneven`` (NCCL per
    chunk; "auto" and "ce" take torch's)."""
    cls = _NAMED.get(backend, TorchTransport)
    return cls if cls.uneven else TorchTransport


def make(cls: type[Transport], group: dist.ProcessGroup | None, device: torch.device) -> Transport:
    """A new transport of ``cls`` for one context of ``group`` on ``device``: the group's
    shared one for ``sized`` classes, else one over the group's communicator."""
    s = state(group, device)
    if cls.sized:
        if cls not in s.shared:
            s.shared[cls] = cls(group, device)
        return s.shared[cls]
    assert issubclass(cls, NcclTransport)
    if cls not in s.comms:
        s.comms[cls] = cls.comm_type(group)
    return cls(s.comms[cls], group, device)


def ready(
    cls: type[Transport], group: dist.ProcessGroup | None, device: torch.device, capturing: bool
) -> bool:
    """Whether the group's ``sized`` transport of ``cls`` can take a call on ``device``: made
    already, or made now by every rank of the group (a collective; never while ``capturing``:
    a capture cannot map buffers). Where its making raises on any rank (torch's symmetric
    memory or a host mapping unavailable there), every rank gives the class up for the group
    (``GroupState.failed``, logged once) and the call takes another path."""
    s = state(group, device)
    if cls in s.shared:
        return True
    if capturing or cls in s.failed:
        return False
    why, t = "", None
    try:
        t = cls(group, device)
    except Exception as e:  # noqa: BLE001 (every rank learns of it below, and gives it up)
        why = f"{type(e).__name__}: {e}"
    whys: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(whys, why, group=group)
    why = next((w for w in whys if w), "")
    if why:
        if t is not None:
            t.close()
        s.failed[cls] = why
        _log.warning("overlap: the %r transport could not be made on every rank (%s): its "
                     "calls take another path", cls.name, why)  # fmt: skip
        return False
    s.shared[cls] = t
    return True


def shared(
    cls: type[Transport], group: dist.ProcessGroup | None, device: torch.device
) -> Transport | None:
    """The group's ``sized`` transport of ``cls`` on ``device`` if one was made, else None."""
    return state(group, device).shared.get(cls)
