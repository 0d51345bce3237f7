"""Chunk counters, epochs and stream waits."""

from .counters import ChunkCounters, reached
from .wait import current_raw_stream, method, wait_counter

__all__ = ["ChunkCounters", "current_raw_stream", "method", "reached", "wait_counter"]
