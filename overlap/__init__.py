"""overlap: hide the collective that follows a matmul behind the matmul itself.

``import overlap`` works without a GPU, Triton's GPU backend, CuPy or cuda-python: kernels and
optional backends are imported on first use.

Layers (each knows only those below it): ``plan`` and ``collectives`` (pure Python),
``contract`` (what kernel and copy-engine transports agree on), ``signal`` (counters, stream
waits), ``gemm`` (Triton kernels), ``guard`` (validation mode and the watchdog), ``state``
(per group and device state), ``comm`` (transports, no Triton), ``context`` (per group,
device and stream state), ``graphs`` (recorded calls' CUDA graphs), ``ops`` (the public
calls), ``nn`` (tensor-parallel layers),
``tuner`` and ``bench`` on top; ``stats`` counts the paths the calls took.
"""

from . import nn
from .collectives import COLLECTIVES, OPS
from .context import release
from .guard import RankMismatchError, configure
from .ops import (
    all_gather_matmul,
    all_to_all_grouped_matmul,
    embedding_bag_all_to_all,
    grouped_matmul_all_to_all,
    matmul_all_to_all,
    matmul_allreduce,
    matmul_collective,
    matmul_reduce_scatter,
    plan,
)
from .plan import Plan, SplitPlan
from .stats import stats
from .tuner import Tuned, tune

__all__ = [
    "COLLECTIVES",
    "OPS",
    "Plan",
    "RankMismatchError",
    "SplitPlan",
    "Tuned",
    "all_gather_matmul",
    "all_to_all_grouped_matmul",
    "embedding_bag_all_to_all",
    "grouped_matmul_all_to_all",
    "configure",
    "matmul_all_to_all",
    "matmul_allreduce",
    "matmul_collective",
    "matmul_reduce_scatter",
    "nn",
    "plan",
    "release",
    "stats",
    "tune",
]
__version__ = "0.1.0"
