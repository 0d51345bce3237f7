"""Tensor-parallel layers on the library's overlapped ops: ``ColumnParallelLinear`` and
``RowParallelLinear`` (``layers.py``: shapes, conventions, what each collective overlaps),
``share_input`` (column layers of one input: one gather, one collective for its gradient),
and ``parallelize`` (``hf.py``: a ``transformers`` model sharded by its own plan)."""

from .hf import parallelize
from .layers import ColumnParallelLinear, RowParallelLinear, share_input

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "parallelize", "share_input"]
