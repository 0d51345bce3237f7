"""Everything the library keeps for one process group on one device, in one object.

``state(group, device)`` returns the ``GroupState`` of ``group`` (None: the default group of
the moment, ``guard.default``) on ``device``, made on first use; ``drop(group)`` takes every
one of the group's out (``overlap.release`` closes them). A state holds:

- ``road``: how the copy engines reach the ranks (``comm.route``'s answer, a collective asked
  once: ``UNASKED`` before);
- ``comms``: the communicator of each NCCL transport class;
- ``shared``: the ``sized`` transports, one per class (the copy engines' buffers, the latency
  all-reduce's), shared by the contexts of every caller stream, and ``users``: the context
  that used each last (``Context.transport`` orders a stream after the previous one);
- ``failed``: why the making of a ``sized`` class failed on a rank (``comm.ready``: the group
  gives that class up, every rank alike);
- ``contexts``: the ``Context`` of each caller stream (``overlap/context.py``);
- ``tuned``: ``overlap.tune``'s choices, by (M, N, K, dtype, collective).

States are keyed by the group object, never by its name: a group made after
``destroy_process_group`` is another object (torch names groups from "0" again), so nothing
kept for a destroyed group answers for a new one. The decided calls' memo and the recorded
calls (``context.calls``, ``context.records``) stay global, keyed by the call's signature,
which holds the group: the plain path's fast lane looks a call up there before it resolves any
group (host time); ``release`` forgets them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .guard import default

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

UNASKED = "unasked"  # a road not asked yet (None is an answer: no copy-engine road)


class GroupState:
    """What the library keeps for one (group, device); made by ``state``."""

    def __init__(self, group: dist.ProcessGroup | None, device: str) -> None:
        self.group, self.device = group, device
        self.road: str | None = UNASKED
        self.comms: dict[type, object] = {}
        self.shared: dict[type, object] = {}
        self.failed: dict[type, str] = {}
        self.users: dict[object, object] = {}
        self.contexts: dict[int, object] = {}
        self.tuned: dict[tuple, int | str] = {}


_states: dict[tuple, GroupState] = {}  # (group object, device) -> its state
ALL = object()  # ``drop``'s every group


def state(group: dist.ProcessGroup | None, device: torch.device | str) -> GroupState:
    """The state of ``group`` (None: the default group of the moment) on ``device``."""
    group = default(group)
    key = (group, str(device))
    s = _states.get(key)
    if s is None:
        s = _states[key] = GroupState(group, str(device))
    return s


def states() -> list[GroupState]:
    """Every state kept now."""
    return list(_states.values())


def drop(group: dist.ProcessGroup | None) -> list[GroupState]:
    """Take every state of ``group`` (None: the default group of the moment; ``ALL``: every
    group's) out; the caller closes what they hold."""
    if group is ALL:
        return [_states.pop(k) for k in list(_states)]
    group = default(group)
    return [_states.pop(k) for k in [k for k in _states if k[0] is group]]
