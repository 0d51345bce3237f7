"""Test tiers (see README "Tests"):

- no devices: plan properties, argument checks (test_plan.py, test_errors.py);
- Triton interpreter on CPU tensors: the real kernel (test_kernel.py);
- 2, 4 and 8 CPU ranks on gloo: the real chunk plan, signal protocol and collectives end to end
  (test_distributed.py);
- GPU, marker ``gpu``, deselected by default: NCCL on CUDA devices (test_gpu.py).

``pytest -m quick`` is a first check of about a minute on 2 cores: the tests named in
``QUICK`` below, one or a few of each kind (plans, errors, the kernel, each family of ops on
gloo ranks, the example), marked here so that no test file carries the list.

Triton reads TRITON_INTERPRET when a kernel is defined, so it is set here, before any test
imports overlap.gemm; spawned ranks inherit it.
"""

import importlib.util
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

# Test ids: ``file::name`` takes every parametrization, ``file`` every test in it. A file here
# that does not exist, or (when whole files are collected) a name that matches no test, fails
# the run: the list cannot go stale quietly.
QUICK = (
    "tests/test_plan.py",
    "tests/test_errors.py",
    "tests/test_install.py",
    "tests/test_layout.py::test_no_import_cycles",
    "tests/test_layout.py::test_layers_import_what_they_may",
    "tests/test_kernel.py::test_nan_and_inf_land_where_the_product_has_them",
    "tests/test_kernel.py::test_counter_short_of_its_target_raises",
    "tests/test_kernel.py::test_kernel_alone_is_the_calls_kernel",
    "tests/test_transport.py::test_all_gather_protocol",
    "tests/test_distributed.py::test_two_ranks_all_collectives",
    "tests/test_autograd.py::test_backward_single_process_matches_torch",
    "tests/test_all_gather.py::test_forward_two_ranks",
    "tests/test_uneven.py::test_uneven_all_to_all[2]",
    "tests/test_embedding.py::test_embedding_bag_all_to_all[2]",
    "tests/test_nn.py::test_layers_match_the_unsharded_linear[2]",
    "tests/test_example.py::test_readme_example_runs",
)


def pytest_configure(config: pytest.Config) -> None:
    spec = importlib.util.find_spec("overlap")
    if spec is not None and spec.origin is None:  # a folder named overlap, no __init__.py
        where = ", ".join(spec.submodule_search_locations)
        raise pytest.UsageError(
            f"`import overlap` finds the folder {where} (a clone's folder, from the folder "
            "above it: the current directory comes first), not the package: run from inside "
            "the clone, or through the clone's scripts/python"
        )


def _listed(nodeid: str, entry: str) -> bool:
    return nodeid == entry or nodeid.startswith((entry + "::", entry + "["))


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects on the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    files = {item.nodeid.split("::")[0] for item in items}
    narrowed = any("::" in arg for arg in config.args)
    for entry in QUICK:
        file = entry.split("::")[0]
        matched = [item for item in items if _listed(item.nodeid, entry)]
        if not (config.rootpath / file).exists() or (
            not matched and file in files and not narrowed
        ):
            raise pytest.UsageError(f"tests/conftest.py QUICK names {entry!r}: no such test")
        for item in matched:
            item.add_marker(pytest.mark.quick)
