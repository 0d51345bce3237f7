"""Collectives per chunk (no Triton here)."""

from .backends import BACKENDS, CupyComm, TorchComm, make_comm
from .chunks import run_chunks

__all__ = ["BACKENDS", "CupyComm", "TorchComm", "make_comm", "run_chunks"]
