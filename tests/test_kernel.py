"""Triton interpreter (TRITON_INTERPRET=1, set in conftest.py): the real kernel on CPU tensors.

Each case poisons the slot buffer with NaN, runs the GEMM of a plan, maps every slot back to
the standard layout through the plan (``chunk_slot``, ``x_row``) and compares with a float64
product; counters must grow by exactly the tiles of each chunk. At large K the bound is torch's
own error on the same data.
"""

from __future__ import annotations

import pytest
import torch
from _dist import mismatch, poison_with_specials

from overlap.collectives import COLLECTIVES
from overlap.contract import Epilogue
from overlap.gemm import chunked_matmul
from overlap.plan import MAX_CHUNKS, make_plan
from overlap.signal import wait_counter

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _counters() -> torch.Tensor:
    """Zeroed chunk counters, more than any plan uses (the rest must stay 0)."""
    return torch.zeros(MAX_CHUNKS, dtype=torch.int32)


def _standard(p, flat):
    std = torch.full((p.M, p.N), float("nan"), dtype=torch.float64)
    for c in range(p.n_chunks):
        off, rows, cols, row0, col0 = p.chunk_slot(c)
        block = flat[off : off + rows * cols].view(rows, cols).double()
        idx = torch.tensor([p.x_row(row0 + i) for i in range(rows)])
        std[idx, col0 : col0 + cols] = block
    return std


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D, rows contiguous) as a view whose rows start one element off 16 bytes, so
    the kernel loads it through pointers instead of TMA."""
    wide = torch.empty(t.shape[0], t.shape[1] + 1, dtype=t.dtype)
    wide[:, 1:] = t
    return wide[:, 1:]


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(200, 70, 48), (96, 64, 64), (130, 97, 45), (24, 130, 32)])
@pytest.mark.parametrize("aligned", [True, False])
def test_kernel_writes_every_slot(collective, dtype, shape, aligned):
    """``aligned``: TMA loads of x and w; else pointer loads."""
    M, N, K = shape
    R = 3 if M % 3 == 0 else 2
    p = make_plan(
        M,
        N,
        K,
        world_size=R,
        collective=collective,
        dtype_bits=dtype.itemsize * 8,
        interpreter=True,
        chunks=3,
    )
    assert p.path == "overlap", p.reason
    x = torch.randn(M, K).to(dtype)
    w = torch.randn(N, K).to(dtype).t()  # linear.weight.t(): K-contiguous
    if shape[0] == 96:
        w = w.contiguous()  # and the [K, N] row-major layout
    if not aligned:
        x, w = _misaligned(x), _misaligned(w.t()).t()
    flat = torch.full((M * N,), float("nan"), dtype=dtype)
    counters = _counters()
    chunked_matmul(x, w, flat, counters, p, scale=0.5)
    got = _standard(p, flat)
    ref = 0.5 * (x.double() @ w.double())
    assert not torch.isnan(got).any(), "unwritten elements"
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], err
    assert counters[: p.n_chunks].tolist() == list(p.tiles_per_chunk)
    assert not counters[p.n_chunks :].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_error_at_large_k_is_torchs_own(dtype):
    """At K = 16384 the kernel's error against float64 stays within 2.5x of torch's own
    matmul's on the same inputs (measured: fp16 1.0x, 2.1e-4; fp32 1.4x, 4.2e-7). A flat bound
    cannot tell fp16 accumulation apart: rounding the running sum to fp16 at every K block gave
    3.3e-3 here (16x torch's), and less at smaller K, where ``TOL`` (2e-3) would pass it."""
    M, N, K = 64, 32, 16384  # (small M and N: the interpreter's time goes with the tiles)
    p = make_plan(M, N, K, world_size=2, collective="all_reduce",
                  dtype_bits=dtype.itemsize * 8, interpreter=True, chunks=2)  # fmt: skip
    x, w = torch.randn(M, K).to(dtype), torch.randn(N, K).to(dtype).t()
    flat = torch.full((M * N,), float("nan"), dtype=dtype)
    chunked_matmul(x, w, flat, _counters(), p)
    ref = x.double() @ w.double()

    def error(y: torch.Tensor) -> float:
        return ((y.double() - ref).norm() / ref.norm()).item()

    ours, torchs = error(_standard(p, flat)), error(x @ w)
    assert ours <= 2.5 * torchs, f"{ours:.3g} against torch's {torchs:.3g}"


def test_epilogue_needs_a_blocked_plan():
    p = make_plan(
        64, 64, 32, world_size=2, collective="all_reduce", dtype_bits=32, interpreter=True, chunks=2
    )
    counters = _counters()
    epi = Epilogue(torch.empty(64, 64), torch.empty(2, 32, 64), counters, 0)
    with pytest.raises(ValueError, match="blocked plan"):
        chunked_matmul(torch.randn(64, 32), torch.randn(32, 64), torch.empty(64 * 64),
                       counters, p, epilogue=epi)  # fmt: skip


@pytest.mark.parametrize("part", ["peers", "own", "half"])
def test_part_needs_an_epilogue_and_a_known_name(part):
    """``part`` other than "all" launches a blocked plan's peers' or own tiles: without an
    epilogue (no own block) or under another name it raises, naming ``part``."""
    p = make_plan(
        64, 64, 32, world_size=2, collective="all_reduce", dtype_bits=32, interpreter=True, chunks=2
    )
    with pytest.raises(ValueError, match="part="):
        chunked_matmul(torch.randn(64, 32), torch.randn(32, 64), torch.empty(64 * 64),
                       _counters(), p, part=part)  # fmt: skip
    if part == "half":  # (with an epilogue too)
        bp = make_plan(64, 64, 32, world_size=2, collective="reduce_scatter", dtype_bits=32,
                       interpreter=True, chunks=2, blocked=True)  # fmt: skip
        counters = _counters()
        epi = Epilogue(torch.empty(32, 64), torch.empty(2, 32, 64), counters, 0)
        with pytest.raises(ValueError, match="part="):
            chunked_matmul(torch.randn(64, 32), torch.randn(32, 64), torch.empty(64 * 64),
                           counters, bp, epilogue=epi, part=part)  # fmt: skip


def test_a_launch_names_every_kernel_argument():
    """The kernel's signature is the one list of its parameters (constexprs last): a launch
    names each of them, and one missing or unknown raises before anything is launched."""
    from overlap.gemm import matmul as mm

    names = mm._launch.names
    assert names[mm._launch.n_args] == "RUNS" and names[-1] == "ASM_BARRIER"
    a = {n: i for i, n in enumerate(names)}
    assert mm._launch.values(a) == tuple(range(len(names)))  # the signature's order
    a.pop("hi")
    with pytest.raises(TypeError, match=r"missing \['hi'\], unknown \[\]"):
        mm._launch.values(a)
    with pytest.raises(TypeError, match=r"missing \[\], unknown \['n_tiles'\]"):
        mm._launch.values({**a, "hi": 0, "n_tiles": 0})
    with pytest.raises(TypeError, match=r"missing \['hi'\], unknown \['n_tiles'\]"):
        mm._launch.values({**a, "n_tiles": 0})


def test_a_compiled_kernel_is_kept_per_device_and_specialization():
    """The launcher's key (``gemm/launch.py``): the device (Triton loads a kernel per device),
    each integer by value, each tensor by dtype and 16-byte alignment, constexprs, warps and
    stages; the same values on the same device give the same key."""
    from overlap.gemm import matmul as mm

    L = mm._launch
    t = torch.empty(64)
    base = tuple(t if n.endswith("_ptr") else 3 for n in L.names[: L.n_args]) + tuple(
        range(len(L.names) - L.n_args))  # fmt: skip
    k = L.key(0, base, 8, 3)
    assert k == L.key(0, tuple(base), 8, 3)
    assert k != L.key(1, base, 8, 3), "the device is in the key"
    assert k != L.key(0, base, 4, 3) and k != L.key(0, base, 8, 4)
    i = next(j for j, n in enumerate(L.names[: L.n_args]) if not n.endswith("_ptr"))
    other = list(base)
    other[i] = 16
    assert k != L.key(0, tuple(other), 8, 3), "integers by value"


def test_counter_short_of_its_target_raises():
    """On CPU a counter left short of its tile count (tiles lost) raises, never passes."""
    p = make_plan(
        64, 64, 32, world_size=2, collective="all_reduce", dtype_bits=32, interpreter=True, chunks=2
    )
    counters = _counters()
    chunked_matmul(torch.randn(64, 32), torch.randn(32, 64), torch.empty(64 * 64), counters, p)
    for c in range(p.n_chunks):
        wait_counter(counters, c, p.tiles_per_chunk[c], None)  # reached: no error
    with pytest.raises(RuntimeError, match="did not signal"):
        wait_counter(counters, 0, p.tiles_per_chunk[0] + 1, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nan_and_inf_land_where_the_product_has_them(dtype):
    M, N, K = 96, 70, 48
    p = make_plan(
        M, N, K, world_size=2, collective="all_reduce", dtype_bits=dtype.itemsize * 8,
        interpreter=True, chunks=3,
    )  # fmt: skip
    x, w_nk = torch.randn(M, K).to(dtype), torch.randn(N, K).to(dtype)
    poison_with_specials(x, w_nk)
    w = w_nk.t()
    flat = torch.full((M * N,), float("nan"), dtype=dtype)
    counters = _counters()
    chunked_matmul(x, w, flat, counters, p)
    assert counters[: p.n_chunks].tolist() == list(p.tiles_per_chunk)
    assert not mismatch(_standard(p, flat), x.double() @ w.double(), TOL[dtype])


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize(
    ("R", "rank", "shape"),
    [(2, 0, (128, 70, 48)), (2, 1, (200, 64, 40)), (3, 2, (192, 45, 33)), (3, 1, (192, 64, 33))],
)
@pytest.mark.parametrize("specials", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_blocked_plan_fused_epilogue(collective, R, rank, shape, specials, dtype):
    """The copy-engine transport's kernel on one rank: the peers' bands go to the slot buffer
    (standard rows), this rank's block goes to ``out`` with every peer's pushed partial added
    (all-to-all: stored as is); every peer's flag set. ``specials``:
    NaN and Inf in x and w, this rank's block included: they must land where the product has
    them, with the partials added to the rest."""
    M, N, K = shape
    p = make_plan(
        M, N, K, world_size=R, collective=collective, dtype_bits=dtype.itemsize * 8,
        interpreter=True, chunks=2 * R, blocked=True,
    )  # fmt: skip
    assert p.path == "overlap" and p.blocked and p.n_row_bands == R * p.bands_per_block
    B = M // R
    x, w_nk = torch.randn(M, K), torch.randn(N, K)
    if specials:
        poison_with_specials(x, w_nk)
        x = x.roll(rank * B, 0)  # specials in this rank's own block too
    x, w = x.to(dtype), w_nk.t().contiguous().to(dtype)
    recv = torch.randn(R, B, N).to(dtype)
    recv[rank] = float("nan")  # this rank's own slot is never read
    flags = torch.ones(R * p.bands_per_block, dtype=torch.int32)  # contract.SET
    flat = torch.full((M * N,), float("nan"), dtype=dtype)
    out = torch.full((B if collective == "reduce_scatter" else M, N), float("nan"), dtype=dtype)
    counters = _counters()
    epi = Epilogue(out, recv, flags, rank)
    chunked_matmul(x, w, flat, counters, p, scale=0.5, epilogue=epi)
    prod = 0.5 * (x.double() @ w.double())
    own = slice(rank * B, (rank + 1) * B)
    peers = [s for s in range(R) if s != rank]
    got = flat.view(M, N).double()
    for s in peers:  # the bands this rank pushes: plain product rows in the slot buffer
        block = slice(s * B, (s + 1) * B)
        assert mismatch(got[block], prod[block], TOL[dtype]) is None
    assert torch.isnan(got[own]).all(), "this rank's block must not go to the slot buffer"
    want = prod[own] + (sum(recv[s].double() for s in peers) if p.spec.reduces else 0)
    mine = out if collective == "reduce_scatter" else out[own]
    assert mismatch(mine.double(), want, TOL[dtype]) is None
    if collective != "reduce_scatter":
        rest = torch.cat([out[s * B : (s + 1) * B] for s in peers])
        assert torch.isnan(rest).all(), "rows of other blocks are the transport's to fill"
    assert counters[: p.n_chunks].tolist() == list(p.tiles_per_chunk)


@pytest.mark.parametrize("blocked", [False, True])
def test_kernel_alone_is_the_calls_kernel(blocked):
    """``bench.kernel_alone`` (the bench's and ``tools/gemm_sweep.py``'s "this library's
    GEMM") runs the call's kernel: the product in the slots and, for the copy engines' blocked
    plan, this rank's block in ``out`` with the peers' partials added."""
    from overlap.bench import kernel_alone

    R, rank, (M, N, K) = 2, 1, (128, 64, 48)
    p = make_plan(M, N, K, world_size=R, collective="all_reduce", dtype_bits=32,
                  interpreter=True, chunks=4, blocked=blocked)  # fmt: skip
    x, w = torch.randn(M, K), torch.randn(K, N)
    launch, bufs = kernel_alone(x, w, p, rank)
    launch()
    prod, B = x.double() @ w.double(), M // R
    if not blocked:
        assert not mismatch(_standard(p, bufs["slots"]), prod, 1e-5)
        return
    own = slice(rank * B, (rank + 1) * B)
    got = bufs["slots"].view(M, N).double()
    assert mismatch(got[:B], prod[:B], 1e-5) is None  # the peer's block, to push
    want = prod[own] + bufs["recv"][0].double()
    assert mismatch(bufs["out"][own].double(), want, 1e-5) is None
