"""Tensor-parallel layers on the library's overlapped ops: ``ColumnParallelLinear`` and
``RowParallelLinear`` (``layers.py``: shapes, conventions, what each collective overlaps), and
``parallelize`` (``hf.py``: a ``transformers`` model sharded by its own plan)."""

from .hf import parallelize
from .layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "parallelize"]
