"""Per (group, device, caller stream) state of the overlapped calls, and its lifetime.

``context(group, device)`` returns the context of the current stream, made on first use:

- the communication stream (high priority), made once;
- the chunk counters, which every call zeroes before its GEMM counts into them;
- the transports the calls of this stream used, by name (``transport``).

Per (group, device), also kept here and shared by the contexts of every stream, since a CUDA
graph captures on a stream of its own and neither can be made during a capture: the
communicators (one per backend) and the copy-engine transport, whose buffers an eager call
sizes (a captured call that would need bigger ones takes NCCL, ``ops._plan_for``). Calls of
two streams through that transport would write the same buffers, so an eager call on another
stream than the last one first waits for that stream (``transport``); captured calls cannot
wait on eager work, so a graph's replays must not run beside the group's calls on other
streams. Also per (group, device): the copy engines' road (``comm.route``, a collective asked
on the first call of the group on a CUDA device outside graph capture, whatever its backend
and path, so that every rank asks at the same call). Per group: the chunk counts
``overlap.tune`` chose (``tuned``).

Lifetime: until ``release(group)``, which every rank of the group calls at the same point of
the program with no call of the group in flight; it waits for the device, frees the
transports' buffers (symmetric memory, pinned host memory) and forgets the group's
contexts, communicators and road. A later call starts afresh (a collective on first use, as
the very first call). At most ``MAX_CONTEXTS`` contexts live at once (torch's stream pools
keep the caller streams few); more raise ``RuntimeError``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist

from .comm import HostTransport, NcclTransport, PeerTransport, Transport, kept, make_comm, route
from .guard import group_name
from .plan import MAX_CHUNKS, Plan
from .signal import current_raw_stream

MAX_CONTEXTS = 256


class Context:
    """The state of one (group, device, caller stream); made by ``context``."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group, self.device = group, device
        self.rank = dist.get_rank(group)  # (asking torch costs host time at every call)
        self.comm_stream: torch.cuda.Stream | None = None  # None on CPU
        self.caller: torch.cuda.Stream | None = None  # the stream this context serves
        if device.type == "cuda":
            self.caller = torch.cuda.current_stream(device)
            _, highest = torch.cuda.Stream.priority_range()
            self.comm_stream = torch.cuda.Stream(device, priority=highest)
        self._transports: dict[str, Transport] = {}
        self._counters: torch.Tensor | None = None
        # where this stream's copy-engine calls are captured into CUDA graphs (ops._recorded)
        self.record_stream: torch.cuda.Stream | None = None

    @property
    def counters(self) -> torch.Tensor:
        """This stream's chunk counters, ``MAX_CHUNKS`` int32 (every call zeroes them first;
        a thread of their own makes them, ``comm.transport.kept``)."""
        if self._counters is None:
            self._counters = kept(self.device, lambda: torch.zeros(MAX_CHUNKS, dtype=torch.int32,
                                                                   device=self.device))  # fmt: skip
        return self._counters

    def road(self, capturing: bool = False) -> str | None:
        """``comm.route``'s answer for this group and device: a collective the first time
        (while ``capturing``, which cannot ask: the answer known, or None)."""
        key = (self.group, str(self.device))
        if key not in _roads:
            if capturing:
                return None
            _roads[key] = route(self.group, self.device)
        return _roads[key]

    @staticmethod
    def blocked(name: str) -> bool:
        """Whether transport ``name`` runs blocked plans (without making it)."""
        return (PeerTransport if name == "ce" else NcclTransport).blocked

    def captures(self, p: Plan, dtype: torch.dtype) -> bool:
        """Whether a call of plan ``p`` (copy engines) can be captured in a CUDA graph now:
        the group's copy-engine transport exists and its buffers fit ``p``."""
        t = _engines.get((self.group, str(self.device)))
        return t is not None and t.fits(p, dtype)

    def transport(self, name: str, capturing: bool = False) -> Transport:
        """The transport ``name`` ("torch", "cupy" or "ce") of this context. For "ce", the
        group's, and (not ``capturing``) this stream waits for the one that used it last."""
        t = self._transports.get(name)
        if t is None:
            if name == "ce":
                key = (self.group, str(self.device))
                if key not in _engines:
                    cls = PeerTransport if self.road() == "peer" else HostTransport
                    _engines[key] = cls(self.group, self.device)
                t = _engines[key]
            else:
                key = (self.group, str(self.device), name)
                if key not in _comms:
                    _comms[key] = make_comm(name, self.group)
                t = NcclTransport(_comms[key])
            self._transports[name] = t
        if name == "ce" and not capturing:
            last = _users.get(t)
            if last is not None and last is not self:
                self.caller.wait_stream(last.caller)  # its calls are done with the buffers
            _users[t] = self
        return t

    @property
    def nbytes(self) -> int:
        """Memory the transports of this context keep between calls."""
        return sum(t.nbytes for t in self._transports.values())

    def close(self) -> None:
        """Free the transports' buffers (no call may be in flight)."""
        for t in self._transports.values():
            t.close()
        self._transports.clear()


_contexts: dict[tuple, Context] = {}  # (group, device, caller stream handle) -> Context
_comms: dict[tuple, object] = {}  # (group, device, backend) -> communicator
_roads: dict[tuple, str | None] = {}  # (group, device) -> comm.route's answer
_engines: dict[tuple, Transport] = {}  # (group, device) -> the copy-engine transport
_users: dict[Transport, Context] = {}  # copy-engine transport -> the context that used it last
_tuned: dict[tuple, int | str] = {}  # (group name, M, N, K, dtype, collective) -> overlap.tune's
# Plans of eager calls by signature (ops._plan_for): a plan depends on the signature, the road
# and the tuned choices, so it is forgotten when either changes.
plans: dict[tuple, Plan] = {}
# Recorded eager copy-engine calls (ops._recorded), least recent first: (call signature,
# outputs) -> ops.Record; and each recorded signature's output shapes, so that a repeated call
# can make its outputs and find its record without planning. Forgotten with the plans (the
# graphs hold the transports' addresses).
records: OrderedDict[tuple, object] = OrderedDict()
shapes: dict[tuple, tuple] = {}


def forget() -> None:
    """Forget the plans and recorded calls (the road, the tuned choices or the buffers change)."""
    plans.clear()
    records.clear()
    shapes.clear()


def tuned_key(group, M: int, N: int, K: int, dtype: torch.dtype, collective: str) -> tuple:
    """The key of ``tuned``: calls of any context of ``group`` with these shapes share it."""
    return (group_name(group), M, N, K, str(dtype), collective)


def tuned(key: tuple) -> int | str | None:
    """What ``overlap.tune`` chose for calls of ``key`` (``tuned_key``), or None."""
    return _tuned.get(key) if _tuned else None


def set_tuned(key: tuple, choice: int | str | None) -> None:
    """Record ``overlap.tune``'s ``choice`` (a chunk count or "plain"; None forgets it)."""
    if choice is None:
        _tuned.pop(key, None)
    else:
        _tuned[key] = choice
    forget()


def context(group: dist.ProcessGroup | None, device: torch.device) -> Context:
    """The context of ``group`` on ``device`` for the current stream (made on first use).

    Raises:
        RuntimeError: ``MAX_CONTEXTS`` contexts exist already.
    """
    stream = current_raw_stream(device) if device.type == "cuda" else 0
    key = (group, str(device), stream)
    ctx = _contexts.get(key)
    if ctx is None:
        if len(_contexts) >= MAX_CONTEXTS:
            raise RuntimeError(
                f"{MAX_CONTEXTS} overlap contexts (one per group, device and caller stream) "
                "exist already; call overlap.release(group) for groups no longer used"
            )
        ctx = _contexts[key] = Context(group, device)
    return ctx


def release(group: dist.ProcessGroup | None = None) -> None:
    """Free everything the library keeps for ``group``, the object the calls passed
    (``None`` for calls that passed none): the buffers of its transports,
    communicators, contexts and tuned choices.

    Every rank of the group calls it at the same point of the program, with no call of the
    group in flight; the next call of the group starts afresh. Communicators are dropped,
    not aborted or destroyed: torch's own process group stays usable.
    """
    mine = [k for k in _contexts if k[0] is group]
    for device in {k[1] for k in mine if k[1].startswith("cuda")}:
        torch.cuda.synchronize(device)
    forget()  # (before the buffers the recorded graphs use are freed)
    for k in mine:
        _contexts.pop(k).close()
    for k in [k for k in _engines if k[0] is group]:
        _users.pop(_engines.pop(k), None)
    for store in (_comms, _roads):
        for k in [k for k in store if k[0] is group]:
            del store[k]
    name = group_name(group) if dist.is_initialized() else None
    for k in [k for k in _tuned if k[0] == name]:
        del _tuned[k]
