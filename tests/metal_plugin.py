"""``--metal-emulator``: the whole suite on the Metal backend, on a machine without Metal.

With the option, the session selects ``MUSER_KV_BACKEND=metal`` and replaces
``mx.fast.metal_kernel`` with the emulator (``metal_emulator``): every cache,
session, policy and model test then runs its kernels as MLX's own Metal text,
compiled by clang behind the MSL shim and executed on the CPU, and still
compares its results bitwise with the oracles. Child processes the tests start
inherit ``MUSER_KV_METAL_EMULATOR=1`` and install the emulator the same way
(``conftest`` does it at import).

The kernel-form tests (host C++, NVRTC, the Metal module itself, the selftest's,
decode attention's, whose kernels the rest of this run leaves to the reference)
drive each form directly rather than through the selected backend: they are
deselected in this run, which the default run already covers. So are the tests
that build no cache (ring arithmetic, policy, counts, install, geometry, the
session file format, the stand-ins for mlx-lm's kernels: no muser-kv kernel
runs there) and the ``slow`` ones, which repeat other tests' kernel calls at
the real window (the same Metal text, larger grids), to keep this run within
CI's budget. The session fails if no kernel
(or not every kernel) went through the emulator: the option cannot pass by
running the reference path.

Without the option, ``MUSER_KV_BACKEND=metal`` on a machine without Metal is a
usage error (it would only fail every test with "No Metal back-end").
"""

from __future__ import annotations

import os
from typing import Dict, Set

import mlx.core as mx
import pytest

from muser_kv.core import kernels

OPTION = "--metal-emulator"
EMULATOR_ENV = "MUSER_KV_METAL_EMULATOR"
DIRECT_KERNEL_TESTS = ("test_kernels_host.py", "test_kernels_nvrtc.py", "test_kernels_metal.py",
                       "test_selftest.py", "test_attention.py", "test_attention_mma_nvrtc.py",
                       "test_attention_mma_emulated.py")
NO_KERNEL_TESTS = ("test_ring.py", "test_policy.py", "test_counts.py", "test_install.py",
                   "test_geometry.py", "test_session_files.py", "test_mlx_lm_kernels.py")
KERNELS = ("batch_store", "stage", "gather", "install")

_installed = None


def install():
    """Route the Metal backend through the emulator in this process; returns it."""
    global _installed
    if _installed is None:
        from metal_emulator import default_emulator

        _installed = default_emulator()
        os.environ[kernels.BACKEND_ENV] = "metal"
        os.environ[EMULATOR_ENV] = "1"
        mx.fast.metal_kernel = _installed
        # decode attention's kernels run here one thread at a time, every layer of
        # every decode step of every model test: tests/core/test_attention.py
        # executes their Metal form through the emulator (in the default run,
        # where it is not deselected); the rest of this run attends through the
        # reference, as the CPU does
        kernels.KernelBackend.attend = kernels.ReferenceBackend.attend  # type: ignore[method-assign]
        kernels._make.cache_clear()
    return _installed


def addoption(parser) -> None:
    parser.addoption(OPTION, action="store_true",
                     help="run the suite on MUSER_KV_BACKEND=metal with MLX's Metal text "
                          "compiled by clang and executed on the CPU (needs clang++ >= 17)")


def configure(config) -> None:
    if config.getoption("metal_emulator") or os.environ.get(EMULATOR_ENV):
        from metal_emulator import ClangMissing

        try:
            install()
        except ClangMissing as e:
            raise pytest.UsageError(f"{OPTION}: {e}") from e
        return
    if os.environ.get(kernels.BACKEND_ENV) == "metal" and not mx.metal.is_available():
        raise pytest.UsageError(
            f"{kernels.BACKEND_ENV}=metal needs Apple's Metal, which this MLX lacks; "
            f"on Linux add {OPTION} to run MLX's Metal text through the clang emulator")


def collection_modifyitems(config, items) -> None:
    if _installed is None:
        return
    keep, drop = [], []
    for item in items:
        skip = (item.path.name in DIRECT_KERNEL_TESTS + NO_KERNEL_TESTS
                or item.get_closest_marker("slow") is not None)
        (drop if skip else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


#: what xdist's workers' emulators ran, gathered in the controlling process
#: (which runs no test): kernel calls by name, and the MLX texts compiled
_workers_calls: Dict[str, int] = {}
_workers_compiled: Set[str] = set()


def _used() -> Dict[str, int]:
    """Kernel calls by name (``muser_kv_`` dropped), this process's and its workers'."""
    used = dict(_workers_calls)
    for call in _installed.calls:
        name = call.kernel.removeprefix("muser_kv_")
        used[name] = used.get(name, 0) + 1
    return used


def _missing() -> list:
    used = _used()
    return [k for k in KERNELS if k not in used]


def _whole_suite(config) -> bool:
    return (config.args_source == pytest.Config.ArgsSource.TESTPATHS
            and not config.getoption("keyword") and not config.getoption("markexpr"))


def _failure(config) -> str:
    """Why this emulated run must fail although its tests passed, or ''."""
    if not _used():
        return "no kernel went through the emulator"
    if _missing() and _whole_suite(config):
        return f"the whole suite never called {', '.join(_missing())}"
    return ""


def sessionfinish(session) -> None:
    if _installed is None:
        return
    output = getattr(session.config, "workeroutput", None)
    if output is not None:  # an xdist worker: its controller judges the whole run
        output["metal_calls"] = _used()
        output["metal_compiled"] = sorted(_installed.compiled)
        return
    if session.exitstatus == 0 and session.testscollected \
            and _failure(session.config):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def testnodedown(node) -> None:
    """An xdist worker ended: add what its emulator ran to this run's account."""
    output = getattr(node, "workeroutput", None) or {}
    for name, n in output.get("metal_calls", {}).items():
        _workers_calls[name] = _workers_calls.get(name, 0) + n
    _workers_compiled.update(output.get("metal_compiled", ()))


def terminal_summary(terminalreporter) -> None:
    if _installed is None:
        return
    used = _used()
    failure = _failure(terminalreporter.config)
    line = (f"emulated Metal: {sum(used.values())} kernel calls ("
            + ", ".join(f"{k} {used.get(k, 0)}" for k in KERNELS)
            + f"), {len(_workers_compiled | set(_installed.compiled))} distinct MLX texts "
            "compiled and run"
            + (f"; FAILED: {failure}" if failure else ""))
    terminalreporter.write_sep("=", line, red=bool(failure), green=not failure)
