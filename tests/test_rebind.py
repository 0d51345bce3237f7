"""``graphs/rebind.py`` on CPU: reading a tensor map's base address back (the map encoded by a
stand-in for ``cuTensorMapReplaceAddress``, whose layout is the driver's secret) and the
memory span of a strided tensor (``graphs.span``). Binding a real graph needs a GPU:
tests/test_gpu.py (``test_recorded_moving_one_gpu``: inputs and outputs at new addresses
every call)."""

from __future__ import annotations

import random

import pytest
import torch

from overlap.graphs import rebind, span


def _encoder(shift: int, spread: bool = False):
    """A stand-in for ``cuTensorMapReplaceAddress``: the address's bits 4-47 at bit
    ``shift`` of the 1024-bit map (``spread``: bit 5 also flips bit 0 of the map, so one
    address bit lands on two map bits), the other bits left as they were."""

    def replace(tensor_map: bytes, address: int) -> bytes:
        v = int.from_bytes(tensor_map, "little")
        field = ((1 << 44) - 1) << shift
        v = (v & ~field) | ((address >> 4) << shift)
        if spread:
            v = (v & ~1) | ((address >> 5) & 1)
        return v.to_bytes(128, "little")

    return replace


@pytest.mark.parametrize("shift", [0, 64, 301])
def test_map_base_read_back(shift, monkeypatch):
    """A map's base is read back exactly, whatever bits of the map hold it."""
    monkeypatch.setattr(rebind, "_bits", [])
    monkeypatch.setattr(rebind, "_replace", _encoder(shift))
    rng = random.Random(shift)
    for _ in range(20):
        address = rng.randrange(1 << 44) << 4
        noise = rng.randrange(1 << 1024).to_bytes(128, "little")
        assert rebind._map_base(_encoder(shift)(noise, address)) == address


def test_map_base_refuses_other_encodings(monkeypatch):
    """An encoding that is not one map bit per address bit is not read (None): a wrong base
    would leave a moved tensor's map pointing at the old memory."""
    monkeypatch.setattr(rebind, "_bits", [])
    monkeypatch.setattr(rebind, "_replace", _encoder(64, spread=True))
    assert rebind._map_base(_encoder(64, spread=True)(bytes(128), 0x7F12_3456_7890)) is None


CASES = [((6, 4), (4, 1)), ((6, 4), (1, 6)), ((3, 5, 2), (20, 2, 1)), ((4, 0), (1, 1)),
         ((1, 7), (100, 3))]  # fmt: skip


@pytest.mark.parametrize("shape, strides", CASES)
def test_span(shape, strides):
    """Bytes from a tensor's first element to one past its last, against its offsets."""
    buf = torch.zeros(200, dtype=torch.float16)
    t = buf.as_strided(shape, strides)
    every = torch.cartesian_prod(*[torch.arange(n) for n in shape]).view(-1, len(shape))
    offsets = [sum(i * s for i, s in zip(idx, strides, strict=True)) for idx in every.tolist()]
    want = 0 if t.numel() == 0 else (max(offsets) + 1) * 2
    start, end = span(t)
    assert start == t.data_ptr() and end - start == want
