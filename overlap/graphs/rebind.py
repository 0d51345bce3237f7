"""A recorded call's CUDA graph pointed at another call's tensors (``record.py``).

A graph holds the addresses of the tensors it was captured with. Activations move from call
to call (a training step frees and makes them in an order that depends on what ran before),
so a record that only an identical address set may replay is found again only where the
caching allocator happens to repeat itself: in the model bench about half of the overlapped
training calls ran eagerly. ``bind`` finds, once per record, every place in the executable
graph where the *moved* tensors' addresses (the input and the outputs of a dense call) live;
``Binding.rebind`` writes the addresses of the next call's tensors there through the
driver's executable-graph updates, which leave launches already enqueued alone. The GPU
work is unchanged; the host pays one driver call per node that holds a moved address.

Where the addresses live, and what is patched:

- kernel nodes: every 8-byte word of a parameter whose value lies inside a moved tensor (a
  pointer, also one inside a struct parameter), moved by the tensor's displacement; and
  every 128-byte parameter that is a TMA tensor map whose base lies inside one, re-encoded
  with ``cuTensorMapReplaceAddress``. A tensor map is opaque: a map is one of a moved
  tensor's own where encoding that tensor's address into it changes nothing; otherwise its
  base is read from the bits that hold it, learnt once per process by encoding probe
  addresses (``_map_bits``), and trusted only where encoding it again gives the same bytes.
  A map whose base cannot be read and whose words hold a moved address refuses the graph;
- memcpy nodes (the copy engines' transfers into ``out``): source and destination.

A graph whose other nodes hold a moved address (a memset), whose kernels take their
parameters through ``extra``, or whose node kinds are not the ones a dense call captures is
not rebindable (``bind`` returns None), nor is any graph where a driver call fails (a driver
before CUDA 12.4, a torch without ``raw_cuda_graph_exec``). An address that a kernel reads
from device memory (a pointer array) cannot be seen here: only the dense calls' graphs (the
GEMM kernel, fills of its own counters, copies, stream memory operations on the transports'
flags) are bound, and the GPU tests move every tensor they can.

A graph that cannot be bound is pointed at other tensors by the driver instead (``update``,
``cuGraphExecUpdate`` from a capture of the call for them: ``record.py``).

The driver is called through ctypes: the parameters are raw bytes (cuda-python's structs
cannot hold a kernel's parameter buffer or a tensor map as bytes).
"""

from __future__ import annotations

import ctypes
import functools
from ctypes import POINTER, byref, c_int, c_size_t, c_uint, c_uint64, c_void_p

import torch

_KERNEL, _MEMCPY, _MEMSET, _EMPTY, _WAIT_EVENT, _EVENT_RECORD, _MEM_OP = 0, 1, 2, 5, 6, 7, 12
_HARMLESS = {_EMPTY, _WAIT_EVENT, _EVENT_RECORD, _MEM_OP}  # hold no tensor's address here
_DEVICE, _UNIFIED = 2, 4  # CUmemorytype: where a memcpy's address is a device address
_MAP = 128  # bytes of a CUtensorMap


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", c_void_p), ("grid", c_uint * 3), ("block", c_uint * 3),
                ("shared", c_uint), ("params", c_void_p), ("extra", c_void_p),
                ("kern", c_void_p), ("ctx", c_void_p)]  # fmt: skip


def _side(p: str) -> list:
    return [(p + "XInBytes", c_size_t), (p + "Y", c_size_t), (p + "Z", c_size_t),
            (p + "LOD", c_size_t), (p + "MemoryType", c_int), (p + "Host", c_void_p),
            (p + "Device", c_uint64), (p + "Array", c_void_p), (p + "Reserved", c_void_p),
            (p + "Pitch", c_size_t), (p + "Height", c_size_t)]  # fmt: skip


class _Memcpy(ctypes.Structure):  # CUDA_MEMCPY3D
    _fields_ = [*_side("src"), *_side("dst"), ("width", c_size_t), ("height", c_size_t),
                ("depth", c_size_t)]  # fmt: skip


class _Memset(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [
        ("dst", c_uint64),
        ("pitch", c_size_t),
        ("value", c_uint),
        ("element_size", c_uint),
        ("width", c_size_t),
        ("height", c_size_t),
    ]


def span(t: torch.Tensor) -> tuple[int, int]:
    """``t``'s memory: the address of its first element and one past its last byte (an empty
    tensor spans nothing). Also the ops' check that ``out`` shares no memory with the
    inputs."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + t.element_size() * (1 + last)


class DriverError(RuntimeError):
    """A driver call of ``bind`` or ``rebind`` failed."""


@functools.cache
def _cuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _call(name: str, *args) -> None:
    err = getattr(_cuda(), name)(*args)
    if err:
        raise DriverError(f"{name} failed (CUresult {err})")


def _param_info(func: int, kern: int) -> list[tuple[int, int]]:
    """(offset, size) of each of a kernel's parameters."""
    get, handle = ("cuFuncGetParamInfo", func) if func else ("cuKernelGetParamInfo", kern)
    out, off, size = [], c_size_t(), c_size_t()
    while getattr(_cuda(), get)(c_void_p(handle), c_size_t(len(out)), byref(off), byref(size)) == 0:
        out.append((off.value, size.value))
    return out


def _replace(tensor_map: bytes, address: int) -> bytes:
    """``tensor_map`` with its base address ``address`` (``cuTensorMapReplaceAddress``)."""
    buf = _aligned(_MAP)
    ctypes.memmove(buf.at, tensor_map, _MAP)
    _call("cuTensorMapReplaceAddress", c_void_p(buf.at), c_void_p(address))
    return ctypes.string_at(buf.at, _MAP)


class _aligned:  # noqa: N801 (a buffer, 128-byte aligned as a tensor map must be)
    def __init__(self, n: int) -> None:
        self.raw = ctypes.create_string_buffer(n + 128)
        self.at = (ctypes.addressof(self.raw) + 127) & ~127


_bits: list[list[int] | None] = []  # [which bit of a tensor map holds address bit 4 + i]


def _map_bits(sample: bytes) -> list[int] | None:
    """Which bit of a tensor map holds each address bit from 4 to 47 (addresses are 16-byte
    aligned and below 2^48), learnt once from ``sample`` by encoding one-bit addresses; None
    where the driver refuses them or the encoding is not one bit per address bit."""
    if not _bits:
        try:
            probes = [int.from_bytes(_replace(sample, 1 << i), "little") for i in range(4, 48)]
        except DriverError:
            probes = []
        fixed = functools.reduce(lambda a, b: a & b, probes, (1 << 1024) - 1)
        ones = [p ^ fixed for p in probes]
        one_each = all(o and not o & (o - 1) for o in ones) and len(set(ones)) == len(ones)
        _bits.append([o.bit_length() - 1 for o in ones] if probes and one_each else None)
    return _bits[0]


def _map_base(tensor_map: bytes, known: tuple[int, ...] = ()) -> int | None:
    """The base address a tensor map holds: one of ``known`` where encoding it gives the
    same map, else read from the bits ``_map_bits`` found; None where it cannot be read
    back exactly."""
    for base in known:
        if _replace(tensor_map, base) == tensor_map:
            return base
    bits = _map_bits(tensor_map)
    if bits is None:
        return None
    v = int.from_bytes(tensor_map, "little")
    base = sum(((v >> b) & 1) << (4 + i) for i, b in enumerate(bits))
    return base if _replace(tensor_map, base) == tensor_map else None


class _Kernel:
    """A kernel node's parameters, copied to a buffer of ours that the patches write."""

    def __init__(self, node: int, kp: _KernelParams, info: list[tuple[int, int]]) -> None:
        self.node, self.kp = node, _KernelParams.from_buffer_copy(kp)
        src = ctypes.cast(kp.params, POINTER(c_void_p))  # (the node's parameters)
        self.buf = _aligned(max(o + s for o, s in info) if info else 8)
        self.ptrs = (c_void_p * max(len(info), 1))()
        for i, (o, s) in enumerate(info):
            ctypes.memmove(self.buf.at + o, src[i], s)
            self.ptrs[i] = self.buf.at + o
        self.info = info
        self.kp.params, self.kp.extra = ctypes.addressof(self.ptrs), None
        self.words: list[tuple[c_uint64, int, int]] = []  # (word, tensor, offset into it)
        self.maps: list[tuple[int, int, int]] = []  # (address in buf, tensor, offset)

    def apply(self, bases: tuple[int, ...], exe: int) -> None:
        for word, t, off in self.words:
            word.value = bases[t] + off
        for at, t, off in self.maps:
            _call("cuTensorMapReplaceAddress", c_void_p(at), c_void_p(bases[t] + off))
        _call("cuGraphExecKernelNodeSetParams_v2", c_void_p(exe), c_void_p(self.node),
              byref(self.kp))  # fmt: skip


class _Copy:
    """A memcpy node whose source or destination lies in a moved tensor."""

    def __init__(self, node: int, mc: _Memcpy, ctx: int) -> None:
        self.node, self.mc, self.ctx = node, mc, ctx
        self.ends: list[tuple[str, int, int]] = []  # (field, tensor, offset)

    def apply(self, bases: tuple[int, ...], exe: int) -> None:
        for field, t, off in self.ends:
            setattr(self.mc, field, bases[t] + off)
        _call("cuGraphExecMemcpyNodeSetParams", c_void_p(exe), c_void_p(self.node),
              byref(self.mc), c_void_p(self.ctx))  # fmt: skip


class Binding:
    """Where a graph holds the moved tensors' addresses (``bind``)."""

    def __init__(self, exe: int, nodes: list, bases: tuple[int, ...]) -> None:
        self.exe, self.nodes, self.bases = exe, nodes, bases

    def rebind(self, bases: tuple[int, ...]) -> None:
        """Point the graph at tensors at ``bases`` (same dtypes, shapes and strides, one per
        moved tensor of ``bind``); raises ``DriverError`` where the driver refuses."""
        for n in self.nodes:
            n.apply(bases, self.exe)
        self.bases = bases


def update(graph: torch.cuda.CUDAGraph, source: torch.cuda.CUDAGraph) -> None:
    """Update ``graph``'s executable graph (instantiated) from ``source`` (captured with
    ``keep_graph=True``: the same call for other tensors), ``cuGraphExecUpdate``: launches
    already enqueued are left alone; raises ``DriverError`` where the driver refuses (another
    topology, a node it cannot update)."""
    info = (c_uint64 * 4)()  # CUgraphExecUpdateResultInfo (result, errorNode, errorFromNode)
    try:
        exe, g = graph.raw_cuda_graph_exec(), source.raw_cuda_graph()
        _call("cuGraphExecUpdate_v2", c_void_p(exe), c_void_p(g), byref(info))
    except (OSError, AttributeError) as e:  # (no libcuda, a torch without the raw handles)
        raise DriverError(str(e)) from e


def bind(graph: torch.cuda.CUDAGraph, moved: tuple[torch.Tensor, ...]) -> Binding | None:
    """A ``Binding`` of ``graph`` (captured with ``keep_graph=True``, instantiated) for the
    tensors ``moved``, or None where it is not rebindable (module docstring)."""
    try:
        return _bind(graph, moved)
    except (DriverError, OSError, AttributeError):
        return None


def _bind(graph: torch.cuda.CUDAGraph, moved: tuple[torch.Tensor, ...]) -> Binding | None:
    bases = tuple(t.data_ptr() for t in moved)
    spans = [span(t) for t in moved]

    def where(address: int) -> tuple[int, int] | None:  # (tensor, offset) of an address
        for i, (lo, hi) in enumerate(spans):
            if lo <= address < hi:
                return i, address - lo
        return None

    g, exe = graph.raw_cuda_graph(), graph.raw_cuda_graph_exec()
    n = c_size_t()
    _call("cuGraphGetNodes", c_void_p(g), None, byref(n))
    nodes = (c_void_p * n.value)()
    _call("cuGraphGetNodes", c_void_p(g), nodes, byref(n))
    ctx = c_void_p()
    _call("cuCtxGetCurrent", byref(ctx))
    patched: list = []
    for node in nodes[: n.value]:
        kind = c_int()
        _call("cuGraphNodeGetType", c_void_p(node), byref(kind))
        if kind.value == _KERNEL:
            kp = _KernelParams()
            _call("cuGraphKernelNodeGetParams_v2", c_void_p(node), byref(kp))
            if not kp.params:
                return None  # (parameters through `extra`: not readable here)
            k = _Kernel(node, kp, _param_info(kp.func or 0, kp.kern or 0))
            for o, s in k.info:
                at = k.buf.at + o
                words = []
                for a in range(at, at + s - 7, 8):
                    word = c_uint64.from_address(a)
                    if (hit := where(word.value)) is not None:
                        words.append((word, *hit))
                if s == _MAP and o % 64 == 0:  # a tensor map (Triton's TMA descriptors)
                    base = _map_base(ctypes.string_at(at, _MAP), bases)
                    if base is not None and (hit := where(base)) is not None:
                        k.maps.append((at, *hit))
                        continue
                    if words:  # a moved address in a map that cannot be read: refuse
                        return None
                k.words.extend(words)
            if k.words or k.maps:
                patched.append(k)
        elif kind.value == _MEMCPY:
            mc = _Memcpy()
            _call("cuGraphMemcpyNodeGetParams", c_void_p(node), byref(mc))
            c = _Copy(node, mc, ctx.value)
            for side in ("src", "dst"):
                if getattr(mc, side + "MemoryType") not in (_DEVICE, _UNIFIED):
                    continue
                f = {n: getattr(mc, side + n) for n in ("Device", "XInBytes", "Y", "Z", "Height")}
                start, rows = f["Device"], f["Y"] + f["Z"] * f["Height"]
                first = start + f["XInBytes"] + getattr(mc, side + "Pitch") * rows
                if (hit := where(first)) is not None:  # the field moves with the tensor
                    c.ends.append((side + "Device", hit[0], hit[1] - (first - start)))
            if c.ends:
                patched.append(c)
        elif kind.value == _MEMSET:
            ms = _Memset()
            _call("cuGraphMemsetNodeGetParams", c_void_p(node), byref(ms))
            if where(ms.dst) is not None:
                return None
        elif kind.value not in _HARMLESS:
            return None
    return Binding(exe, patched, bases)
