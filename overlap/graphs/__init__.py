"""CUDA graphs of the library's own calls: a repeated eager call recorded once and replayed
(``record.py``), its graph pointed at the tensors of the call that replays it (``rebind.py``,
ctypes patching of the executable graph's nodes).

A layer of its own between ``context`` and ``ops``: the ops reach it only through the names
below (``tests/test_layout.py``), and an op's call goes through it in two steps, ``replay``
before anything is made for the call, else ``recorded`` around the issue itself:

- ``signature``, ``outputs``, ``bases``: a call's key (its memo's, ``context.calls``, and with
  its outputs its record's) and the addresses its key leaves out;
- ``replay(key, at)``: the call's recorded graph replayed for the tensors at ``at``, if any;
- ``recorded(call, ctx, cls, ...)``: the call issued, recorded on its first sightings and
  replayed from then on;
- ``span``: a tensor's memory (also the ops' check that ``out`` shares none with the inputs).

Module state and constants (``record.MAX_RECORDS``, ``records``) are read where they live:
patch them there.
"""

from .rebind import span
from .record import bases, outputs, recorded, replay, signature

__all__ = ["bases", "outputs", "recorded", "replay", "signature", "span"]
