"""Transports: one protocol (``transport.Transport``, with the capabilities each declares),
NCCL per chunk (``nccl.py``), the copy engines (``peer.py`` GPU to GPU, ``host.py`` through
host memory) and the latency all-reduces (``shot.py``), chosen and made in one place
(``choice.py``). No Triton here."""

from . import shot
from .choice import BACKENDS, make, ready, road, select, select_uneven, shared
from .host import HostTransport
from .nccl import CupyComm, CupyTransport, NcclTransport, TorchComm, TorchTransport
from .peer import PeerTransport, route
from .shot import HostShotTransport, ShotTransport
from .transport import Transport, kept

__all__ = [
    "BACKENDS",
    "CupyComm",
    "CupyTransport",
    "HostShotTransport",
    "HostTransport",
    "NcclTransport",
    "PeerTransport",
    "ShotTransport",
    "TorchComm",
    "TorchTransport",
    "Transport",
    "kept",
    "make",
    "ready",
    "road",
    "route",
    "select",
    "select_uneven",
    "shared",
    "shot",
]
