"""Test tiers (see README "Tests"):

- no devices: plan properties, argument checks (test_plan.py, test_errors.py);
- Triton interpreter on CPU tensors: the real kernel (test_kernel.py);
- 2, 4 and 8 CPU ranks on gloo: the real chunk plan, signal protocol and collectives end to end
  (test_distributed.py);
- GPU, marker ``gpu``, deselected by default: NCCL on CUDA devices (test_gpu.py).

``pytest -m quick`` is a first check of under a minute on 2 cores: the tests named in
``QUICK`` below, one or a few of each kind (plans, errors, the kernel, each family of ops on
gloo ranks, the layers, the tuner, validation and the watchdog, the calls' memo and cache
keys, the example), marked here so that no test file carries the list.

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
    "tests/test_install.py::test_scripts_python_picks_the_installed_python",
    "tests/test_layout.py::test_no_import_cycles",
    "tests/test_layout.py::test_no_import_runs_back_up",
    "tests/test_layout.py::test_layers_import_what_they_may",
    "tests/test_kernel.py::test_nan_and_inf_land_where_the_product_has_them",
    "tests/test_kernel.py::test_counter_short_of_its_target_raises",
    "tests/test_kernel.py::test_kernel_alone_is_the_calls_kernel",
    "tests/test_kernel.py::test_a_launch_names_every_kernel_argument",
    "tests/test_transport.py::test_all_gather_protocol",
    "tests/test_distributed.py::test_two_ranks_all_collectives[float32]",
    "tests/test_autograd.py::test_backward_single_process_matches_torch",
    "tests/test_all_gather.py::test_forward_two_ranks",
    "tests/test_uneven.py::test_uneven_all_to_all[2]",
    "tests/test_embedding.py::test_embedding_bag_all_to_all[2]",
    "tests/test_run_exchange.py",
    # the layers (overlap.nn)
    "tests/test_nn.py::test_layers_match_the_unsharded_linear[2]",
    "tests/test_nn.py::test_share_input_after_an_in_place_change",
    "tests/test_nn.py::test_share_input_with_a_sibling_frozen_after_sharing",
    "tests/test_nn.py::test_world_size_one_computes_nn_linear",
    "tests/test_nn.py::test_from_linear_keeps_requires_grad",
    # the tuner
    "tests/test_tuner.py::test_release_of_the_default_group_forgets_its_tuned_choices",
    "tests/test_tuner.py::test_tune_rejects_bad_candidates",
    "tests/test_tuner.py::test_tune_refuses_graph_capture",
    "tests/test_tuner.py::test_the_cache_key_holds_what_changes_the_timing",
    # validation and the watchdog (overlap/guard)
    "tests/test_validation.py::test_every_fingerprint_field_is_caught_before_launch",
    "tests/test_validation.py::test_configure_rejects_bad_arguments",
    "tests/test_validation.py::test_watch_releases_a_host_held_in_the_issue",
    "tests/test_watchdog.py",
    # the decided calls' memo and the cache keys
    "tests/test_plain_again.py::test_checks_after_a_memo_hit",
    "tests/test_cache_keys.py::test_record_signature_has_every_field",
    "tests/test_cache_keys.py::test_record_signature_none_in_validation_mode",
    "tests/test_example.py::test_readme_example_runs",
    "tests/test_docs.py",
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


def pytest_ignore_collect(collection_path, config: pytest.Config) -> bool | None:
    """``-m quick`` alone: the files that ``QUICK`` does not name are not even imported."""
    if config.getoption("markexpr") != "quick" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_") or not collection_path.is_relative_to(
        config.rootpath
    ):
        return None
    rel = collection_path.relative_to(config.rootpath).as_posix()
    return True if rel not in {entry.split("::")[0] for entry in QUICK} else None


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
