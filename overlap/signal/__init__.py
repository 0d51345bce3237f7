"""Chunk counters' stream waits."""

from .wait import current_raw_stream, method, wait_counter

__all__ = ["current_raw_stream", "method", "wait_counter"]
