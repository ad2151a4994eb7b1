"""``muser-kv selftest``: what it says without a GPU, and its checks themselves,
run here on the emulated Metal backend (the CPU plays the GPU's part: both the
kernels and the reference path run on it)."""

import io
import re
import subprocess
import sys

import mlx.core as mx
import pytest

from muser_kv.core import kernels
from muser_kv.core.kernels import KernelBackend
from muser_kv.serving import selftest

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


def test_every_kernel_passes_on_emulated_metal(emulator, monkeypatch):
    monkeypatch.setattr(mx.fast, "metal_kernel", emulator)
    reports = selftest.run_checks(KernelBackend("metal"), mx.cpu)
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
    assert re.match(r"gather +FAIL +\d+ of 80 cases differ; first: H=2 D=128", lines[2]), lines[2]
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
    assert report.kernel == "gather" and report.cases == 80
    assert report.failures == [report.failures[0]] and report.failures[0].startswith(
        f"{label}: key snapshot: "), report.failures
    out = io.StringIO()
    assert selftest.summarize(reports, "emulated metal", out) == 1
    assert out.getvalue().splitlines()[0].startswith(f"gather       FAIL  1 of 80 cases differ; first: {label}")


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
    assert spread[0].ok and spread[0].cases == 80
    with pytest.raises(ValueError, match="rebuilds the backends by name"):
        selftest.run_checks(type("Sub", (KernelBackend,), {})("metal"), mx.cpu, jobs=2)
