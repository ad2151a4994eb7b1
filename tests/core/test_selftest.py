"""``muser-kv selftest``: what it says without a GPU, and its checks themselves,
run here on the emulated Metal backend (the CPU plays the GPU's part: both the
kernels and the reference path run on it)."""

import io
import re
import subprocess
import sys

import mlx.core as mx
import pytest
from nvrtc import recording_cuda_kernel

from muser_kv.core import kernel_cases, kernels, selftest
from muser_kv.core.kernels import KernelBackend

NO_GPU = not (mx.metal.is_available() or mx.cuda.is_available())


@pytest.mark.skipif(not NO_GPU, reason="this MLX has a GPU backend")
def test_nothing_to_test_without_a_gpu():
    proc = subprocess.run([sys.executable, "-m", "muser_kv", "selftest"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "nothing to test" in proc.stdout, proc.stdout


@pytest.mark.skipif(not NO_GPU, reason="this MLX has a GPU backend")
def test_an_unavailable_backend_is_an_error():
    out = io.StringIO()
    assert selftest.main("cuda", out=out) == 2
    assert "not available" in out.getvalue()


def _recorded_calls(monkeypatch):
    """Every kernel call the selftest's cases make, through a recording stand-in
    for ``mx.fast.cuda_kernel`` (nothing runs): {group: [KernelCall]}."""
    recorded = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", recording_cuda_kernel(recorded))
    by_group = {}
    for group, group_cases in selftest.groups(
            selftest.cases(KernelBackend("cuda"), selftest.ReferenceBackend())).items():
        start = len(recorded)
        for case in group_cases:
            case.run()
        by_group[group] = recorded[start:]
    return by_group


def _geometry(call):
    """(kv_heads, head_dim, head_major): a kernel call's last three params."""
    return tuple(int(x) for x in call.inputs[call.input_names.index("params")].tolist()[-3:])


def test_one_compile_per_kernel_and_type_pair(monkeypatch):
    """The selftest builds 16 kernel programs -- (kernel, template) pairs: batch_store
    and stage 3 input types x 2 plane types, gather and install 2 plane types --
    one per group, and each group still runs both head geometries and both
    layouts. Head geometry or layout back among the template values would make 64."""
    by_group = _recorded_calls(monkeypatch)
    assert len(by_group) == 16
    programs = {(c.name, tuple(c.template)) for calls in by_group.values() for c in calls}
    assert len(programs) == 16, sorted(programs, key=str)
    h_d = {(h, d) for h, d in selftest.GEOMETRIES}
    for group, calls in by_group.items():
        kernel = group[0]
        assert {(c.name, tuple(c.template)) for c in calls} == {
            (f"muser_kv_{kernel}", tuple(calls[0].template))}, group  # one program a group
        assert {n for n, _ in calls[0].template} == ({"T", "P"} if group[1] else {"P"})
        seen = {_geometry(c) for c in calls}
        if kernel in ("batch_store", "stage"):
            assert seen == {(h, d, hm) for h, d in h_d for hm in (0, 1)}, (group, seen)
        else:  # a token-major plane goes to gather/install as one head of kv_dim
            assert seen == {(h, d, 1) for h, d in h_d} | {(1, h * d, 0) for h, d in h_d}, \
                (group, seen)
    # one kernel call per case: the shared stores and ring states, in every
    # geometry, plane type and layout (stage and the ring states at exact and padded rows)
    counts = {k: sum(len(c) for g, c in by_group.items() if g[0] == k) for k in selftest.KERNELS}
    stores = len(h_d) * len(selftest.PLANE_DTYPES) * len(selftest.INPUT_DTYPES) * 2 \
        * len(kernel_cases.STORE_CASES)
    per_state = len(h_d) * len(selftest.PLANE_DTYPES) * 2 * 2
    states = per_state * len(kernel_cases.RING_STATES)
    empty = per_state * sum(1 for _, n, _ in kernel_cases.RING_STATES if n == 0)
    # an empty ring's gather is the reference path's (nothing to read): no kernel call
    assert counts == {"batch_store": stores, "stage": 2 * stores, "gather": states - empty,
                      "install": states}, counts
    assert stores == 168 and states == 96 and empty == 16


def _cases(kernel: str) -> int:
    """How many cases the selftest checks ``kernel`` on (96 for gather and install)."""
    return sum(1 for c in selftest.cases(KernelBackend("metal"), selftest.ReferenceBackend())
               if c.kernel == kernel)


def test_default_jobs(monkeypatch):
    """About the square root of the programs, never more than the CPUs."""
    monkeypatch.setattr(selftest.os, "sched_getaffinity", lambda _: set(range(16)), raising=False)
    assert [selftest.default_jobs(n) for n in (1, 4, 5, 16, 64)] == [1, 2, 3, 4, 8]
    monkeypatch.setattr(selftest.os, "sched_getaffinity", lambda _: {0, 1}, raising=False)
    assert selftest.default_jobs(16) == 2


def test_every_kernel_passes_on_emulated_metal(emulator, monkeypatch):
    monkeypatch.setattr(mx.fast, "metal_kernel", emulator)
    start = len(emulator.calls)
    reports = selftest.run_checks(KernelBackend("metal"), mx.cpu)
    calls = emulator.calls[start:]
    # 16 (kernel, template) instantiations ran every case
    assert len({(c.kernel, c.key[8]) for c in calls}) == 16
    out = io.StringIO()
    assert selftest.summarize(reports, "emulated metal", out) == 0, out.getvalue()
    lines = out.getvalue().splitlines()
    assert [line.split()[:2] for line in lines[:4]] == [[k, "ok"] for k in selftest.KERNELS]
    assert lines[-1].startswith("selftest passed")
    assert all(r.cases >= 80 for r in reports)
    kinds = {c.kernel for c in emulator.calls}
    assert {f"muser_kv_{k}" for k in selftest.KERNELS} <= kinds


def test_a_broken_kernel_fails_the_selftest(emulator, monkeypatch):
    """Negative control: gather reads one row too far; only gather fails, and the
    line names the first differing case and element."""
    real = kernels.kernel_source

    def source(name):
        text = real(name)
        if name == "gather":
            text = text.replace("((uint32_t)params[1] + row) % capacity",
                                "((uint32_t)params[1] + row + 1u) % capacity")
        return text

    monkeypatch.setattr(kernels, "kernel_source", source)
    monkeypatch.setattr(mx.fast, "metal_kernel", emulator)
    reports = selftest.run_checks(KernelBackend("metal"), mx.cpu)
    out = io.StringIO()
    assert selftest.summarize(reports, "emulated metal", out) == 1
    lines = out.getvalue().splitlines()
    assert re.match(rf"gather +FAIL +\d+ of {_cases('gather')} cases differ; first: H=2 D=128",
                    lines[2]), lines[2]
    assert "key snapshot:" in lines[2] and "kernel 0x" in lines[2]
    assert all(line.split()[1] == "ok" for i, line in enumerate(lines[:4]) if i != 2)
    assert lines[-1] == "selftest FAILED: gather differs from the reference path"


def test_one_wrong_case_fails_and_is_named(emulator, monkeypatch):
    """Cases are evaluated and compared per instantiation, all at once: one wrong
    case among its group's still fails alone, under its own label."""
    monkeypatch.setattr(mx.fast, "metal_kernel", emulator)
    wrong = 7  # the 7th gather call: the 7th gather case, in the report's order

    class OneWrong(KernelBackend):
        calls = 0

        def gather(self, *args):
            keys, values = super().gather(*args)
            OneWrong.calls += 1
            if OneWrong.calls == wrong:  # flip the lowest bit of the first row's keys
                keys = mx.concatenate([(keys[:1].view(mx.uint16) ^ 1).view(keys.dtype), keys[1:]])
            return keys, values

    reports = selftest.run_checks(OneWrong("metal"), mx.cpu, kernels_to_check=("gather",))
    label = [c.label for c in selftest.cases(KernelBackend("metal"), selftest.ReferenceBackend())
             if c.kernel == "gather"][wrong - 1]
    [report] = reports
    assert report.kernel == "gather" and report.cases == _cases("gather")
    assert report.failures == [report.failures[0]] and report.failures[0].startswith(
        f"{label}: key snapshot: "), report.failures
    out = io.StringIO()
    assert selftest.summarize(reports, "emulated metal", out) == 1
    assert out.getvalue().splitlines()[0].startswith(
        f"gather       FAIL  1 of {_cases('gather')} cases differ; first: {label}")


def test_worker_processes_give_the_same_reports(emulator, monkeypatch):
    """--jobs: the instantiations spread over spawned processes (the emulator
    installed in each) give the in-process reports."""
    import metal_plugin

    monkeypatch.setattr(mx.fast, "metal_kernel", emulator)
    alone = selftest.run_checks(KernelBackend("metal"), mx.cpu, kernels_to_check=("install",))
    spread = selftest.run_checks(KernelBackend("metal"), mx.cpu, jobs=2,
                                 kernels_to_check=("install",), initializer=metal_plugin.install)
    assert [(r.kernel, r.cases, r.elements, r.failures) for r in spread] == \
        [(r.kernel, r.cases, r.elements, r.failures) for r in alone]
    assert spread[0].ok and spread[0].cases == _cases("install")
    with pytest.raises(ValueError, match="rebuilds the backends by name"):
        selftest.run_checks(type("Sub", (KernelBackend,), {})("metal"), mx.cpu, jobs=2)
