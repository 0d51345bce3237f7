"""Collectives per chunk (no Triton here)."""

from .backends import BACKENDS, CupyComm, TorchComm, make_comm
from .chunks import run_chunks
from .host import HostTransport
from .peer import PeerTransport, route

__all__ = [
    "BACKENDS",
    "CupyComm",
    "HostTransport",
    "PeerTransport",
    "TorchComm",
    "make_comm",
    "route",
    "run_chunks",
]
