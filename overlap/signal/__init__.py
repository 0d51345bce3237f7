"""Chunk counters, epochs and stream waits."""

from .counters import ChunkCounters, reached
from .wait import method, wait_counter

__all__ = ["ChunkCounters", "method", "reached", "wait_counter"]
