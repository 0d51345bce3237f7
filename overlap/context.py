"""Per (group, device, caller stream) state of the overlapped calls, and its lifetime.

``context(group, device)`` returns the context of the current stream, made on first use:

- the communication stream (high priority), made once;
- the chunk counters, which every call zeroes before its GEMM counts into them;
- the transports the calls of this stream used, by class (``transport``; made by
  ``comm.make``).

The contexts live in the group's state on the device (``overlap/state.py``), with what the
group's contexts share: a ``sized`` transport (the copy engines, the latency all-reduce) is
one per (group, device), shared by the contexts of every stream (``comm.make``): calls of two
streams would write the same buffers, so an eager call on another stream than the last one
first waits for that stream (``transport``); captured calls cannot wait on eager work, so a
graph's replays must not run beside the group's calls on other streams. There too: the chunk
counts ``overlap.tune`` chose (``tuned``).

Lifetime: until ``release(group)``, which every rank of the group calls at the same point of
the program with no call of the group in flight; it waits for the device, frees the
transports' buffers (symmetric memory, pinned host memory) and drops the group's states
(contexts, communicators, road, tuned choices). A later call starts afresh (a collective on
first use, as the very first call). At most ``MAX_CONTEXTS`` contexts live at once (torch's
stream pools keep the caller streams few); more raise ``RuntimeError``.
"""

from __future__ import annotations

import atexit
import gc
from collections import OrderedDict

import torch
import torch.distributed as dist

from . import comm
from .comm import Transport, kept
from .guard import agreement, watchdog
from .plan import MAX_CHUNKS
from .signal import current_raw_stream
from .state import ALL, GroupState, drop, state, states

MAX_CONTEXTS = 256


class Context:
    """The state of one (group, device, caller stream); made by ``context``."""

    def __init__(self, s: GroupState, device: torch.device) -> None:
        self.state, self.group, self.device = s, s.group, device
        self.rank = dist.get_rank(self.group)  # (asking torch costs host time at every call)
        self.comm_stream: torch.cuda.Stream | None = None  # None on CPU
        self.caller: torch.cuda.Stream | None = None  # the stream this context serves
        if device.type == "cuda":
            self.caller = torch.cuda.current_stream(device)
            _, highest = torch.cuda.Stream.priority_range()
            self.comm_stream = torch.cuda.Stream(device, priority=highest)
        self._transports: dict[type, Transport] = {}
        self._counters: torch.Tensor | None = None
        # where this stream's recorded calls are captured into CUDA graphs (graphs/record.py)
        self.record_stream: torch.cuda.Stream | None = None

    @property
    def counters(self) -> torch.Tensor:
        """This stream's chunk counters, ``MAX_CHUNKS`` int32 (every call zeroes them first;
        a thread of their own makes them, ``comm.transport.kept``)."""
        if self._counters is None:
            self._counters = kept(self.device, lambda: torch.zeros(MAX_CHUNKS, dtype=torch.int32,
                                                                   device=self.device))  # fmt: skip
        return self._counters

    def transport(self, cls: type[Transport], capturing: bool = False) -> Transport:
        """This context's transport of class ``cls`` (``comm.make``). For a ``sized`` one,
        shared by the group's streams, this stream (not ``capturing``) first waits for the
        stream that used it last."""
        t = self._transports.get(cls)
        if t is None:
            t = self._transports[cls] = comm.make(cls, self.group, self.device)
        if t.broken:
            raise RuntimeError(f"overlap: the {t.name!r} transport of this group was aborted: "
                               f"{t.broken}")  # fmt: skip
        if cls.sized and not capturing:
            last = self.state.users.get(t)
            if last is not None and last is not self:
                self.caller.wait_stream(last.caller)  # its calls are done with the buffers
            self.state.users[t] = self
        return t

    @property
    def nbytes(self) -> int:
        """Memory the transports of this context keep between calls."""
        return sum(t.nbytes for t in self._transports.values())

    def close(self) -> None:
        """Free this context's own transports (no call may be in flight); the shared ones
        are the group state's (``release``)."""
        for t in self._transports.values():
            if not t.sized:
                watchdog.forget(t)
                t.close()
        self._transports.clear()


# What an eager call's arguments were decided to run (ops/engine.py ``Known``), by the call's
# signature (graphs/record.py): kept once a call passed the checks and was planned, forgotten when
# the road, the tuned choices or the transports' buffers change.
calls: dict[tuple, object] = {}
# Recorded eager calls (graphs/record.py), least recent first: (call signature, outputs) ->
# Record. Forgotten with the calls (the graphs hold the transports' addresses).
records: OrderedDict[tuple, object] = OrderedDict()


def forget() -> None:
    """Forget the decided and recorded calls (the road, the tuned choices or the buffers
    change)."""
    calls.clear()
    records.clear()


def tuned_key(M: int, N: int, K: int, dtype: torch.dtype, collective: str) -> tuple:
    """The key of a group's ``tuned`` choices: calls of any of its contexts with these shapes
    share it."""
    return (M, N, K, str(dtype), collective)


def tuned(ctx: Context, key: tuple) -> int | str | None:
    """What ``overlap.tune`` chose for calls of ``key`` (``tuned_key``) in ``ctx``'s group on
    its device, or None."""
    return ctx.state.tuned.get(key)


def set_tuned(
    group: dist.ProcessGroup | None, device: torch.device, key: tuple, choice: int | str | None
) -> None:
    """Record ``overlap.tune``'s ``choice`` for ``group`` on ``device`` (a chunk count or
    "plain"; None forgets it)."""
    s = state(group, device)
    if choice is None:
        s.tuned.pop(key, None)
    else:
        s.tuned[key] = choice
    forget()


def context(group: dist.ProcessGroup | None, device: torch.device) -> Context:
    """The context of ``group`` on ``device`` for the current stream (made on first use), of
    the default group of the moment for None: its ``group`` is that group's object.

    Raises:
        RuntimeError: ``MAX_CONTEXTS`` contexts exist already.
    """
    s = state(group, device)
    stream = current_raw_stream(device) if device.type == "cuda" else 0
    ctx = s.contexts.get(stream)
    if ctx is None:
        if sum(len(t.contexts) for t in states()) >= MAX_CONTEXTS:
            raise RuntimeError(
                f"{MAX_CONTEXTS} overlap contexts (one per group, device and caller stream) "
                "exist already; call overlap.release(group) for groups no longer used"
            )
        ctx = s.contexts[stream] = Context(s, device)
    return ctx


def contexts() -> list[Context]:
    """Every context kept now (tests and tools look at their transports)."""
    return [ctx for s in states() for ctx in s.contexts.values()]


def check_group(group) -> None:
    """Raises TypeError naming ``group`` unless it is a process group or None, and
    ValueError for what ``dist.new_group`` returns to a process outside the group."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            "group: this process is not a member of it (dist.new_group returned "
            "GroupMember.NON_GROUP_MEMBER here); call on the group's ranks only"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got "
                        f"{type(group).__name__}")  # fmt: skip


@atexit.register
def let_go() -> None:
    """At the interpreter's exit (``atexit``: before it finalizes), every reference the
    library holds to a process group dropped, nothing closed or synchronized: the group
    states, the decided and recorded calls (their keys hold the group), the watchdog's
    transports, validation mode's rendezvous (it holds the default group and store). A group
    that ``destroy_process_group`` let go of is then freed while Python still runs; kept until
    the interpreter finalizes, gloo's could abort the ending process (SIGABRT: its threads'
    work holds tensors; torch PR 179291). A state and its contexts refer to each other:
    collected here, not in the finalization. A call made after this (another exit handler's)
    starts afresh."""
    forget()
    agreement.forget()
    if _unwatch(drop(ALL)):
        gc.collect()  # (after ``_unwatch`` returned: its frame held the last state)


def _unwatch(mine: list[GroupState]) -> bool:
    """The watchdog stops watching the transports of the states ``mine`` (copies of their
    dicts: a daemon thread may still be calling); whether there were any."""
    for s in mine:
        for ctx in list(s.contexts.values()):
            for t in list(ctx._transports.values()):
                watchdog.forget(t)
        for t in list(s.shared.values()):
            watchdog.forget(t)
    return bool(mine)


def release(group: dist.ProcessGroup | None = None) -> None:
    """Free everything the library keeps for ``group``, the object the calls passed
    (``None`` for calls that passed none): the buffers of its transports,
    communicators, contexts and tuned choices.

    Every rank of the group calls it at the same point of the program, with no call of the
    group in flight; the next call of the group starts afresh. Communicators are dropped,
    not aborted or destroyed: torch's own process group stays usable. Call it before
    ``destroy_process_group``: what is kept for a destroyed group (the default one too: calls
    with ``group=None`` then find the new default group's) stays until the process ends.

    Raises:
        TypeError, ValueError: ``group`` is not a process group (or None), or this process
            is not a member of it (``check_group``).
    """
    check_group(group)
    mine = drop(group)
    for device in {s.device for s in mine if s.device.startswith("cuda")}:
        torch.cuda.synchronize(device)
    forget()  # (before the buffers the recorded graphs use are freed)
    for s in mine:
        for ctx in s.contexts.values():
            ctx.close()
        for t in s.shared.values():
            watchdog.forget(t)
            t.close()
