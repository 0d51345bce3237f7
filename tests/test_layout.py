"""No devices: the layout the architecture claims (``overlap/__init__.py``, the README's
Layout), checked on the source and in fresh interpreters.

- ``import overlap`` and a world-size-1 call work with Triton, cuda-python and CuPy missing;
- the transports (``overlap/comm``) and the pure layers below them import no Triton and no
  kernel; plans, the collective table and the kernel contract import neither torch nor Triton
  when imported; kernel files import no ``torch.distributed``;
- no two modules of the package import each other, directly or through others (lazy imports
  inside functions count too).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

PKG = pathlib.Path(__file__).resolve().parent.parent / "overlap"


def _imports(path: pathlib.Path, top_only: bool = False) -> set[str]:
    """Absolute names of the modules ``path`` imports: anywhere in the file, or (``top_only``)
    when it is imported (module-level statements, not ``if TYPE_CHECKING:`` blocks)."""
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body if top_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            if node.module is None:  # `from . import guard`: modules of the package
                names |= {f"{base}.{a.name}" for a in node.names}
                continue
            target = f"{base}.{node.module}" if node.level else node.module
            names |= {target} | {f"{target}.{a.name}" for a in node.names}
    return names


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in PKG.rglob("*.py")}
    return {m: {n for n in _imports(p) if n in files and n != m} for m, p in files.items()}


# The package's layers, lowest first: a module imports only modules of its own layer or below
# (within a layer, test_no_import_cycles keeps the imports one way). A module belongs to the
# entry that names it or the package nearest above it; "overlap" is the package's own
# __init__ alone.
LAYERS = (
    ("overlap.plan", "overlap.collectives", "overlap.stats"),
    ("overlap.contract",),
    ("overlap.signal",),
    ("overlap.gemm",),
    ("overlap.guard.settings", "overlap.guard.groups"),
    ("overlap.guard.agreement", "overlap.guard.watch", "overlap.guard.watchdog"),
    ("overlap.guard",),
    ("overlap.state",),
    ("overlap.comm",),
    ("overlap.context",),
    ("overlap.graphs.rebind",),
    ("overlap.graphs.record",),
    ("overlap.graphs",),
    ("overlap.ops",),
    ("overlap.nn",),
    ("overlap.tuner",),
    ("overlap.bench", "overlap"),
)


def _layer(m: str) -> int:
    level = {name: i for i, names in enumerate(LAYERS) for name in names}
    if m == "overlap":
        return level[m]
    parts = m.split(".")
    for k in range(len(parts), 1, -1):
        if ".".join(parts[:k]) in level:
            return level[".".join(parts[:k])]
    raise AssertionError(f"{m} is in no layer of LAYERS")


def test_no_import_runs_back_up():
    """Every module of the package is in a layer of ``LAYERS`` and imports nothing above it."""
    graph = _graph()
    for m, names in graph.items():
        up = {n for n in names if _layer(n) > _layer(m)}
        assert not up, f"{m} (layer {_layer(m)}) imports {sorted(up)}, above it"


def test_graphs_are_reached_through_their_package():
    """Outside ``overlap/graphs/`` the package imports the names of ``overlap.graphs``, never
    its modules (recording and rebinding stay behind them)."""
    for m, names in _graph().items():
        bad = {n for n in names if n.startswith("overlap.graphs.")}
        assert m.startswith("overlap.graphs") or not bad, f"{m} imports {sorted(bad)}"


def test_layers_import_what_they_may():
    graph = {m: _imports(p) for m, p in ((_module(p), p) for p in PKG.rglob("*.py"))}
    kernel_free = [m for m in graph if m.startswith("overlap.comm")]
    kernel_free += [m for m in graph if m.startswith("overlap.plan")]
    kernel_free += ["overlap.collectives", "overlap.contract", "overlap.context", "overlap.state"]
    for m in kernel_free:
        bad = {n for n in graph[m] if n.split(".")[0] == "triton" or n.startswith("overlap.gemm")}
        assert not bad, f"{m} imports {bad}"
    pure = [PKG / "collectives.py", PKG / "contract.py", *(PKG / "plan").glob("*.py")]
    for path in pure:  # pure Python when imported
        top = _imports(path, top_only=True)
        assert not {n for n in top if n.split(".")[0] in ("torch", "triton")}, path.name
    for m in (m for m in graph if m.startswith("overlap.gemm")):
        assert not {n for n in graph[m] if n.startswith("torch.distributed")}, m


def test_nothing_outside_ops_imports_its_private_modules():
    """``overlap.ops._*`` are the ops' own: the rest of the package and the tools import what
    ``overlap.ops`` exports, or its public modules (``engine``)."""
    tools = PKG.parent / "tools"
    paths = [p for p in PKG.rglob("*.py") if p.parent.name != "ops"] + list(tools.glob("*.py"))
    for path in paths:
        source = path.read_text()
        names = _imports(path) if path.is_relative_to(PKG) else set()
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
        bad = {n for n in names if n.startswith("overlap.ops._")}
        assert not bad, f"{path.relative_to(PKG.parent)} imports {bad}"


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError(" -> ".join([*path, m, n]))
            if n not in state:
                visit(n, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


_BLOCKED = textwrap.dedent(
    """
    import importlib.abc, sys

    class Missing(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("triton", "cuda", "cupy"):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, Missing())
    import torch
    import overlap
    assert not any(m.split(".")[0] in ("triton", "cuda", "cupy") for m in sys.modules)
    x, w = torch.randn(6, 5, dtype=torch.float64).float(), torch.randn(5, 3)
    y = overlap.matmul_allreduce(x, w)
    torch.testing.assert_close(y.double(), x.double() @ w.double(), rtol=1e-5, atol=1e-5)
    print(overlap.plan(x, w).describe())
    """
)


def test_import_without_triton_cuda_python_or_cupy():
    done = subprocess.run(
        [sys.executable, "-c", _BLOCKED], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "world size 1" in done.stdout
