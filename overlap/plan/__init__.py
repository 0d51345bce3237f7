"""Chunk plans, one type per kind, identical on every rank for identical arguments: pure
Python (no torch, no Triton), testable anywhere.

- ``kernel.py``: ``Plan`` and ``make_plan``, the GEMM's row or column bands (or a fallback:
  the plain path) for a collective after the matmul;
- ``gather.py``: ``GatherPlan`` and ``make_gather_plan``, the bands in which an all-gather
  before the matmul travels and its consumer multiplies;
- ``split.py``: ``SplitPlan`` and ``make_split_plan``, an uneven exchange's bands;
- ``tiles.py``: the tile configs and the limits they share.
"""

from .gather import GatherPlan, make_gather_plan
from .kernel import Plan, make_plan, splits_rows
from .split import DEFAULT_SPLIT_CHUNKS, SplitPlan, band_rows, make_split_plan
from .tiles import MAX_CHUNKS, Tiles, gemm_outlasts, plain_reason, tiles_for

__all__ = [
    "DEFAULT_SPLIT_CHUNKS",
    "MAX_CHUNKS",
    "GatherPlan",
    "Plan",
    "SplitPlan",
    "Tiles",
    "band_rows",
    "gemm_outlasts",
    "make_gather_plan",
    "make_plan",
    "make_split_plan",
    "plain_reason",
    "splits_rows",
    "tiles_for",
]
