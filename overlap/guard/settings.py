"""Validation mode's switch and the timeout of its waits and of the watchdog.

Off by default (it costs a store round trip and a host synchronization per call). Turn it on
with ``overlap.configure(validate=True)``, ``OVERLAP_VALIDATE=1``, or
``TORCH_DISTRIBUTED_DEBUG=DETAIL``; set the timeout with ``configure(timeout=)`` or
``OVERLAP_TIMEOUT``. Every rank of a group must use the same setting: validation is itself a
rendezvous.
"""

from __future__ import annotations

import math
import os


def _env_validate() -> bool:
    return (
        os.environ.get("OVERLAP_VALIDATE", "0") == "1"
        or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
    )


# timeout None: not set (validation mode takes DEFAULT_TIMEOUT, the watchdog the group's own)
_settings = {
    "validate": _env_validate(),
    "timeout": float(os.environ["OVERLAP_TIMEOUT"]) if "OVERLAP_TIMEOUT" in os.environ else None,
}
DEFAULT_TIMEOUT = 300.0


def configure(*, validate: bool | None = None, timeout: float | None = None) -> None:
    """Turn validation mode on or off and set the timeout in seconds of its waits and of the
    watchdog (``overlap.guard``; unset: 300 s for validation mode, the process group's own
    timeout for the watchdog).

    Every rank of a group must use the same setting: validation is itself a rendezvous.

    Raises:
        TypeError: ``validate`` is not a bool, or ``timeout`` not a number.
        ValueError: ``timeout`` is not positive and finite.
    """
    if validate is not None and not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
        if not 0 < timeout < math.inf:  # (False for NaN)
            raise ValueError(f"timeout must be positive and finite seconds, got {timeout!r}")
        _settings["timeout"] = float(timeout)
    if validate is not None:
        _settings["validate"] = validate


def validating() -> bool:
    """Whether validation mode is on."""
    return _settings["validate"]


def timeout() -> float:
    """The validation timeout in seconds."""
    return _settings["timeout"] or DEFAULT_TIMEOUT


def timeout_set() -> float | None:
    """The timeout that ``configure`` or ``OVERLAP_TIMEOUT`` set, or None (the watchdog then
    takes each group's own)."""
    return _settings["timeout"]
