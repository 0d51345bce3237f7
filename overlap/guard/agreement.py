"""Validation mode's agreement: ranks agree on each call before any collective runs.

When validation mode is on (``overlap.guard.settings``), every call with more than one rank
publishes a fingerprint of the call (``fingerprint``: the op, its dtype, the sizes every rank
must share, and the layout of the plan that runs: its transport and chunks) in the default
group's key-value store, under the group's name and the call's number in that group (calls that
make a host collective first, ``overlap.tune`` and ``embedding_bag_all_to_all(rank_dims=None)``,
agree before it), and waits up to ``timeout`` seconds for every rank's fingerprint (``agree``).
A rank that does not arrive (dead, or stuck elsewhere) gives ``TimeoutError`` naming it; ranks
that disagree give ``RankMismatchError`` with every rank's fingerprint. Both are raised before
this call has launched anything, so the GPU is never left waiting.

Store keys: ``overlap/<group name>/<call number>/<rank>`` and ``.../<call number>/verdict``
(``Rendezvous``); each rank deletes its key of call ``n - 2`` once every rank has reached call
``n - 1`` (so every rank has read it), rank 0 the verdict.

After a ``TimeoutError`` at call ``n`` this rank's calls on the group raise ``RuntimeError``
(saying so) until every rank has reached call ``n``: a late rank raises there too, and the
ranks go on in step; a dead rank never does (a new process group is needed).
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist

from . import settings
from .groups import group_name


class RankMismatchError(ValueError):
    """Ranks called the same collective with different arguments or plans."""


class Rendezvous:
    """Per-group agreement through the default store (``agree`` keeps one per group name: the
    call numbers must go on across contexts and ``overlap.release``, or a new count would
    meet the keys of old calls).

    Call ``n`` also has a verdict key, written once by whichever rank decides first
    (``compare_set``): "met" by a rank that found every fingerprint, or "gave up" by a rank
    whose wait timed out. So a rank that arrives after a peer gave up raises there too,
    instead of launching collectives that peer never joins; once every rank has failed call
    ``n`` their counts agree again. Until then (``out_of_step``) this rank's calls on the
    group raise at once: their numbers would meet the keys of other calls."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.world = dist.group.WORLD  # (made under this default group: ``agree``)
        self.store = dist.distributed_c10d._get_default_store()
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.name = group_name(group)
        self.prefix = f"overlap/{self.name}/"
        self.calls = 0
        self.out_of_step: tuple[int, str] | None = None  # (call, why) after a timeout here

    def _key(self, n: int, r: int) -> str:
        return f"{self.prefix}{n}/{r}"

    def _check_in_step(self) -> None:
        """Raise while a call this rank gave up on has not been reached by every rank."""
        n, why = self.out_of_step
        if self.store.check([self._key(n, r) for r in range(self.size)]):
            self.out_of_step = None  # every rank reached call n and failed it: in step again
            return
        raise RuntimeError(
            f"overlap: group {self.name!r} fell out of step at call #{n} ({why}); this rank's "
            f"later calls on it cannot be matched with the other ranks'. A rank that reaches "
            f"call #{n} late raises there too, and then the ranks are in step again. If a rank "
            "died or will not call again, every live rank must call overlap.release(group) "
            "and go on with a new process group (dist.new_group, or destroy_process_group and "
            "init_process_group again)."
        )

    def agree(self, fingerprint: str, what: str, splits=None) -> None:
        """Publish this rank's fingerprint of call ``what`` and check every rank's; with
        ``splits`` (``(sends, receives)``: rows per rank), also that what every rank sends
        to each other is what that one receives from it.

        Raises:
            TimeoutError: a rank did not publish within the timeout, or gave up on this call
                before this rank arrived.
            RankMismatchError: the fingerprints differ, or the splits do not match.
            RuntimeError: this rank gave up on an earlier call that a peer has not reached.
        """
        if self.out_of_step is not None:
            self._check_in_step()
        n = self.calls
        self.calls += 1
        keys = [self._key(n, r) for r in range(self.size)]
        verdict = f"{self.prefix}{n}/verdict"
        if splits is not None:
            fingerprint += f" splits={list(splits[0])}>{list(splits[1])}"
        self.store.set(keys[self.rank], fingerprint)
        try:
            self.store.wait(keys, timedelta(seconds=settings.timeout()))
        except RuntimeError as e:  # the store's "Wait timeout", or a store that went away
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            why = f"rank(s) {missing} did not reach it within {settings.timeout():g} s"
            try:
                seen = self.store.compare_set(verdict, "", f"gave up: {why}")
            except RuntimeError:  # the store went away
                seen = b""
            if seen != b"met":
                self.out_of_step = (n, why)
                raise TimeoutError(
                    f"{what}: rank(s) {missing} of the group did not reach call #{n} within "
                    f"{settings.timeout():g} s (dead, or waiting elsewhere); nothing was "
                    f"launched. ({e})"
                ) from e
        else:
            seen = self.store.compare_set(verdict, "", "met").decode()
            if seen != "met":
                raise TimeoutError(f"{what}: a rank gave up on call #{n} before this rank "
                                   f"arrived ({seen}); nothing was launched")  # fmt: skip
        if n >= 2:
            self.store.delete_key(self._key(n - 2, self.rank))
            if self.rank == 0:  # (every rank read it: all have reached call n - 1)
                self.store.delete_key(f"{self.prefix}{n - 2}/verdict")
        values = [v.decode() for v in self.store.multi_get(keys)]
        bad = any(v.split(" splits=")[0] != fingerprint.split(" splits=")[0] for v in values)
        if splits is not None and not bad:  # rank a sends rank b what b receives from a
            sr = [_parse_splits(v) for v in values]
            R = range(self.size)
            bad = any(sr[a][0][b] != sr[b][1][a] for a in R for b in R)
        if bad:
            table = "\n".join(f"  rank {r}: {v}" for r, v in enumerate(values))
            raise RankMismatchError(
                f"{what}: ranks disagree on call #{n}; nothing was launched.\n{table}"
            )


def _parse_splits(value: str) -> tuple[list[int], list[int]]:
    """The ``(sends, receives)`` a published fingerprint with splits carries."""
    sends, receives = value.split(" splits=")[1].split(">")
    return json.loads(sends), json.loads(receives)


_rendezvous: dict[str, Rendezvous] = {}  # group name -> its rendezvous (a few ints each)


def forget() -> None:
    """Drop every rendezvous (the process ends: ``overlap.context.let_go``; each holds the
    default group and store it was made under)."""
    _rendezvous.clear()


def agree(group: dist.ProcessGroup | None, fingerprint: str, what: str, splits=None) -> None:
    """``Rendezvous.agree`` on ``group``'s rendezvous (made on first use, and again under a
    new default group: after ``destroy_process_group`` torch numbers the groups from "0"
    again, and a name's old rendezvous holds the old store, ranks and count). Not covered: a
    second ``init_process_group`` given the same store object, whose new rendezvous counts
    from 0 and may meet the old one's last two keys."""
    name = group_name(group)
    rv = _rendezvous.get(name)
    if rv is None or rv.world is not dist.group.WORLD:
        rv = _rendezvous[name] = Rendezvous(group)
    rv.agree(fingerprint, what, splits)


def fingerprint(op: str, dtype: torch.dtype, sizes: dict[str, int | list], layout: str) -> str:
    """What every rank must agree on for a call to be valid, no more: the op's identity
    (``op``: the op and its collective or reduction), ``dtype``, the ``sizes`` that change a
    message or the result (each op names its own: ``M`` and ``N`` after a matmul, the
    gathered ``M`` and ``K`` before one, the ``width`` of an uneven exchange's rows: ``K``
    for the MoE dispatch, ``N`` for the others; the embedding bags' ``bags`` and ``mode``),
    and the plan's ``layout`` (its transport and how it cuts the messages: ``Plan.layout``).
    Sizes that only change this rank's own matmul (``K`` after it, ``N`` before it) are left
    out: ranks may differ in them. An uneven exchange's rows differ by rank: ``agree`` checks
    its splits instead.

    Format: ``"<op> <dtype> <name>=<size>... <layout>"``."""
    return " ".join([op, str(dtype).removeprefix("torch."),
                     *(f"{k}={v}" for k, v in sizes.items()), layout])  # fmt: skip
