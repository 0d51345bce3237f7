"""Collectives per chunk (no Triton here)."""

from .backends import BACKENDS, CupyComm, TorchComm, make_comm
from .chunks import run_chunks
from .peer import PeerTransport, peer_capable

__all__ = [
    "BACKENDS",
    "CupyComm",
    "PeerTransport",
    "TorchComm",
    "make_comm",
    "peer_capable",
    "run_chunks",
]
