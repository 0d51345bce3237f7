"""Validation mode and the watchdog: ranks agree on each call before any collective runs, and
no wait is endless.

One module per job, each importing only those above it in this list:

- ``settings``: validation mode on or off, and the timeout (``configure``, ``validating``,
  ``timeout``);
- ``groups``: which process group ``group=None`` means at the moment (``default``), its name
  and its own timeout;
- ``agreement``: validation mode's rendezvous, each call's ``fingerprint`` published and
  compared across the ranks before anything is launched (``agree``, ``RankMismatchError``);
- ``watch``: validation mode's watch of one call's collectives, a timer thread that releases
  a call not finished in time (``Watch``, ``arm``);
- ``watchdog``: with validation off, the calls through the transports torch does not watch,
  and ``PeerTimeoutError`` raised in the thread that issued one not finished in time
  (``Watchdog``; the process's is ``watchdog.dog``, whose ``issued`` and ``forget`` the module
  names).

The names below are the package's: callers write ``guard.agree(...)``, ``guard.validating()``,
``guard.watchdog.issued(...)``. Module state and constants (``settings._settings``,
``watchdog.RECYCLE``) are read where they live: patch them there.
"""

from . import watchdog
from .agreement import RankMismatchError, Rendezvous, agree, fingerprint
from .groups import default, group_name, group_timeout
from .settings import configure, timeout, validating
from .watch import Watch, arm
from .watchdog import PeerTimeoutError, Watchdog

__all__ = [
    "PeerTimeoutError",
    "RankMismatchError",
    "Rendezvous",
    "Watch",
    "Watchdog",
    "agree",
    "arm",
    "configure",
    "default",
    "fingerprint",
    "group_name",
    "group_timeout",
    "timeout",
    "validating",
    "watchdog",
]
