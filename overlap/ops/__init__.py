"""The public ops, one file per family, every one run by the call engine (``engine.py``):

- ``dense.py``: ``matmul_collective`` and its three shorthands (matmul, then all-reduce,
  reduce-scatter or all-to-all), and ``matmul_allreduce_stacked`` for ``overlap.nn``;
- ``gather.py``: ``all_gather_matmul`` (all-gather, then matmul);
- ``exchange.py``: the uneven exchanges (the all-to-all with split sizes, the MoE combine
  ``grouped_matmul_all_to_all`` and dispatch ``all_to_all_grouped_matmul``);
- ``bags.py``: ``embedding_bag_all_to_all``;
- ``engine.py``: the stages every op runs (``decide``, ``overlapped``: what
  ``tools/timeline.py`` traces; the uneven exchanges' ``decide_exchange`` and
  ``run_exchange``); a repeated eager call replays a CUDA graph of itself through
  ``overlap.graphs`` (the layer below);
- ``_columns.py``: a list of weights side by side or stacked (a view where they are
  adjacent), joined where a call runs, also under ``torch.compile``;
- ``_autograd.py``: each differentiable op as a custom op (``torch.compile``) and as an
  ``autograd.Function`` over the same body (eager autograd, less host time).

Each family's file holds its checks, forward, custom op (schema, fake, autograd) and
backward. For ``overlap.nn`` and ``overlap.tune``: ``world`` (a group's size, 1 where
``torch.distributed`` is not initialized), ``capturing`` and ``check_operands`` (the ops'
checks, of a ``Call``: a matmul + collective call's values besides its tensors).
"""

from ._checks import Call, capturing, check_operands, world
from .bags import embedding_bag_all_to_all
from .dense import matmul_all_to_all, matmul_allreduce, matmul_collective, matmul_reduce_scatter
from .engine import plan
from .exchange import all_to_all_grouped_matmul, grouped_matmul_all_to_all
from .gather import all_gather_matmul

__all__ = [
    "Call",
    "all_gather_matmul",
    "capturing",
    "check_operands",
    "all_to_all_grouped_matmul",
    "embedding_bag_all_to_all",
    "grouped_matmul_all_to_all",
    "matmul_all_to_all",
    "matmul_allreduce",
    "matmul_collective",
    "matmul_reduce_scatter",
    "plan",
    "world",
]
