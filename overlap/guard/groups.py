"""Which process group a ``group`` argument means, its name and its own timeout."""

from __future__ import annotations

import torch
import torch.distributed as dist


def default(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group``, or for None the default group of the moment (None before
    ``init_process_group``): what the library keeps for None must not outlive a destroyed
    default group (a new one may number the ranks otherwise)."""
    return group if group is not None else dist.group.WORLD


def group_name(group: dist.ProcessGroup | None) -> str:
    """The name of ``group`` (``None``: the default group), the same on all of its ranks."""
    return default(group).group_name


def group_timeout(group: dist.ProcessGroup | None, device: torch.device) -> float:
    """``group``'s own timeout in seconds (``init_process_group(timeout=)``,
    ``new_group(timeout=)``), or 600 s where its backend does not say."""
    try:
        return default(group)._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return 600.0
