"""Transports: one protocol (``transport.Transport``), NCCL per chunk (``nccl.py``) and the
copy engines (``peer.py`` GPU to GPU, ``host.py`` through host memory). No Triton here."""

from .host import HostTransport
from .nccl import CupyComm, NcclTransport, TorchComm, make_comm
from .peer import PeerTransport, route
from .transport import BACKENDS, Transport, choose, kept

__all__ = [
    "BACKENDS",
    "CupyComm",
    "HostTransport",
    "NcclTransport",
    "PeerTransport",
    "TorchComm",
    "Transport",
    "choose",
    "kept",
    "make_comm",
    "route",
]
