"""Which path each op's calls took, and a one-time notice when a cause the user can change
kept calls off the overlapped path.

Every call of a public op counts once (``count``) under the op's name (the function the user
called; a backward's overlapped input gradient under the op that computes it), keyed by what
ran: ``"overlap via ce"``,
``"overlap via torch"``, ``"replayed via ce"`` (a recorded call, ``graphs/record.py``),
``"updated via ce"`` (a recorded call at new addresses, its graph updated) or
``"plain: <reason>"``. ``overlap.stats()`` returns the counts since the last reset.

The notice goes through Python's ``logging`` (logger ``"overlap"``, level WARNING), once per
(op, reason) per process, for the reasons in ``_NOTICED`` (CPU tensors without Triton's
interpreter, a product too small for the planner): silence it
with ``logging.getLogger("overlap").setLevel(logging.ERROR)``. The other plain-path reasons
(world size 1, an empty product, ``overlap.tune``'s choice) are the expected behaviour and
are only counted.
"""

from __future__ import annotations

import logging
from collections import Counter

_log = logging.getLogger("overlap")
_counts: dict[str, Counter] = {}
_noticed: set[tuple[str, str]] = set()
# the starts of plain-path reasons that the user can change (overlap/plan/ and ops/engine.py)
_NOTICED = ("CPU tensors", "small product", "the Triton interpreter")


class Stats(dict):
    """``{op: {how: calls}}``; ``str()`` gives a table."""

    def __str__(self) -> str:
        if not self:
            return "overlap: no calls counted"
        rows = [(op, how, n) for op, hows in sorted(self.items()) for how, n in hows.items()]
        w_op = max(len(r[0]) for r in rows)
        w_how = max(len(r[1]) for r in rows)
        lines = [f"{'op':<{w_op}}  {'path':<{w_how}}  calls"]
        lines += [f"{op:<{w_op}}  {how:<{w_how}}  {n:>5}" for op, how, n in rows]
        return "\n".join(lines)


def count(op: str, how: str) -> None:
    """Count one call of ``op`` that ran ``how`` (see the module docstring)."""
    c = _counts.get(op)
    if c is None:
        c = _counts[op] = Counter()
    c[how] += 1
    if c[how] == 1 and how.startswith("plain: ") and (op, how) not in _noticed:
        _noticed.add((op, how))
        reason = how[len("plain: ") :]
        if reason.startswith(_NOTICED):
            _log.warning("overlap.%s runs the plain path (matmul, then the collective): %s",
                         op, reason)  # fmt: skip


def stats(reset: bool = False) -> Stats:
    """How many calls of each op took each path since the start (or the last reset).

    Args:
        reset: clear the counts after reading them.

    Returns:
        ``Stats`` (a dict ``{op: {how: calls}}``, ``how`` as "overlap via ce" (or "torch",
        "cupy"), "replayed via ce", "updated via ce", "plain: <reason>"); ``print(overlap.stats())``
        shows a table.
    """
    out = Stats({op: dict(c) for op, c in _counts.items()})
    if reset:
        _counts.clear()
    return out
