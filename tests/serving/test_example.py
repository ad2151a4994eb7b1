"""Tests of examples/decode.py: the README's command 1 exactly as written (a
subprocess, its exit status), and its main() in-process on a tiny model,
asserting on the printed report (bytes held and a preallocated list's, ring
state, the contract checks, tokens vs mlx-lm)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import numpy as np
import pytest
from metal_plugin import EMULATOR_ENV

import muser_kv
from muser_kv.core.kernels import BACKEND_ENV

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "decode.py"

# 8 layers (6 sliding, 2 global), window 16, a 70-token prompt in 16-token
# chunks (the chunk from 64 wraps the rings), then 8 decode steps: 78 positions.
FLAGS = [
    "--layers", "8", "--hidden", "64", "--heads", "4", "--vocab", "256",
    "--window", "16", "--prompt", "70", "--tokens", "8", "--chunk", "16",
    "--max-context", "256", "--compare",
]
ROW_BYTES = 2 * 2 * 128 * 2  # K and V, 2 KV heads x 128, f16


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("decode_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example()


def readme_command_1() -> list:
    """The example's invocation in the README's command 1 (the part after the
    venv and the install), as argv: the README's words, not a friendly variant."""
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("# 1."))
    command = lines[first + 1]
    parts = [shlex.split(p) for p in command.split("&&")]
    run = [p for p in parts if "examples/decode.py" in p]
    assert len(run) == 1, command
    interpreter, *argv = run[0]
    assert interpreter == ".venv/bin/python", command  # the venv the command made: this one here
    return argv


def test_the_readme_command_1_exits_0() -> None:
    """The README's command 1 exited 1: the example compared the growing global
    planes' bytes with the preallocated footprint. Run as written (its
    default flags), from the repository root, in a process of its own, in the
    environment a user has: none of the suite's backend selections (the
    emulated-Metal run selects one that only its own processes can serve)."""
    argv = readme_command_1()
    assert argv[0] == "examples/decode.py"
    env = {k: v for k, v in os.environ.items() if k not in (BACKEND_ENV, EMULATOR_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "cache contract (positions, rings, bytes): holds" in out, out
    held = re.search(r"^cache bytes held: ([\d,]+) B = 39 sliding rings ([\d,]+) B \(preallocated\) "
                     r"\+ 13 global planes ([\d,]+) B \(growing: ", out, re.M)
    assert held, out
    total, rings, planes = (int(g.replace(",", "")) for g in held.groups())
    assert total == rings + planes
    full = re.search(r"^a preallocated list would take: ([\d,]+) B \(footprint\(geometry, (\d+)\)",
                     out, re.M)
    assert full, out
    assert planes < int(full.group(1).replace(",", "")) - rings  # the global planes grew, no more


def test_decode_example_report(example: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert example.main(FLAGS) == 0
    out = capsys.readouterr().out

    # rows are allocated in whole granules of 256: each 16-row ring takes 256,
    # and a global plane holding 78 rows one granule, as a preallocated one of 256
    rings, planes = 6 * 256 * ROW_BYTES, 2 * 256 * ROW_BYTES
    assert (f"cache bytes held: {rings + planes:,} B = 6 sliding rings {rings:,} B (preallocated) "
            f"+ 2 global planes {planes:,} B (growing: 256 rows allocated for 78 held)") in out
    assert (f"a preallocated list would take: {rings + planes:,} B "
            "(footprint(geometry, 256).slot_bytes;") in out
    assert "cache contract (positions, rings, bytes): holds" in out

    # 70 + 8 positions written: the sliding ring holds the last 16 (62..77),
    # its oldest at physical row 62 % 16; the global plane holds all 78 in order.
    assert "sliding layer 0 ring: capacity=16 len=16 origin_logical=62 origin_physical=14" in out
    assert "global layer 3 ring: capacity=256 len=78 origin_logical=0 origin_physical=0" in out

    assert re.search(r"^muser-kv +prefill +70 tok .* decode +8 tok .* tok/s$", out, re.M), out
    assert re.search(r"^mlx-lm +prefill +70 tok .* decode +8 tok .* tok/s$", out, re.M), out
    assert re.search(r"^speed ratio muser-kv / mlx-lm: prefill [\d.]+x, decode [\d.]+x$", out, re.M)
    assert "tokens match mlx-lm: True (8 of 8;" in out, out


def test_the_contract_checks_can_fail(example: ModuleType) -> None:
    """The exit status rests on checks that fail when the cache is not what its
    contract says: a list one token off, a preallocated list (held == the
    footprint, which the checks accept), a ring of another window."""
    ns = example.parse_args([f for f in FLAGS if f != "--compare"])
    model = example.build_model(ns)
    geometry = muser_kv.MuseGeometry.from_model_args(model.args, ns.max_context)
    cache = muser_kv.make_prompt_cache(model, max_context=ns.max_context)
    mx.eval(model(mx.array([list(range(1, 41))]), cache=cache))
    assert example.contract_failures(cache, geometry, ns.max_context, 40) == []
    off = example.contract_failures(cache, geometry, ns.max_context, 41)
    assert any("layer 0 is at position 40, expected 41" in line for line in off), off
    assert any("sliding layer 0 ring" in line for line in off), off
    full = muser_kv.make_prompt_cache(model, max_context=ns.max_context, preallocate=True)
    mx.eval(model(mx.array([list(range(1, 41))]), cache=full))
    assert example.contract_failures(full, geometry, ns.max_context, 40) == []
    wider = dataclasses.replace(geometry, window=32)
    bad = example.contract_failures(cache, wider, ns.max_context, 40)
    assert any("sliding layer 0 ring" in line for line in bad), bad


def test_first_difference(example: ModuleType) -> None:
    assert example.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert example.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert example.first_difference([1, 2], [1, 2, 3]) == 2


def test_refuses_a_run_past_max_context(example: ModuleType) -> None:
    with pytest.raises(SystemExit):
        example.main(["--prompt", "250", "--tokens", "8", "--max-context", "256"])


def test_progress_bars_show_prefill_and_decode_as_what_they_are(example, monkeypatch):
    """The prefill bar read 160/160 [00:20] while the prefill took 8.62 s: it
    ran on through the decode. Now the prefill bar closes when the first token
    comes out, and a decode bar counts the generated tokens from there."""
    import time as clock

    events = []

    class Bar:
        def __init__(self, total=None, desc="", **kwargs):
            self.total, self.desc, self.n, self.closed = total, desc, 0, False
            self.opened = clock.perf_counter()
            events.append(("open", desc, total))

        def update(self, k=1):
            self.n += k
            events.append(("update", self.desc, self.n))

        def close(self):
            if not self.closed:
                self.closed = True
                self.lifetime = clock.perf_counter() - self.opened
                bars[self.desc] = self
                events.append(("close", self.desc, self.n))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

    bars = {}
    real = example.generate_step

    def recorded(*args, **kwargs):
        for i, out in enumerate(real(*args, **kwargs)):
            events.append(("token", i, None))
            yield out

    monkeypatch.setattr(example, "tqdm", Bar)
    monkeypatch.setattr(example, "generate_step", recorded)
    flags = [f for f in FLAGS if f != "--compare"]
    ns = example.parse_args(flags)
    model = example.build_model(ns)
    prompt = mx.array(np.random.default_rng(0).integers(0, ns.vocab, ns.prompt), mx.int32)
    cache = muser_kv.make_prompt_cache(model, max_context=ns.max_context)
    run = example.decode(model, cache, prompt, ns, "muser-kv")

    assert [e[1:] for e in events if e[0] == "open"] == [("prefill (muser-kv)", 70),
                                                        ("decode (muser-kv)", 8)]
    order = [(e[0], e[1]) for e in events if e[0] in ("open", "close", "token")]
    assert order.index(("close", "prefill (muser-kv)")) < order.index(("token", 1))
    assert order.index(("close", "prefill (muser-kv)")) < order.index(("open", "decode (muser-kv)"))
    assert bars["prefill (muser-kv)"].n == 70 and bars["decode (muser-kv)"].n == 8
    # each bar's elapsed time is its phase's
    assert bars["prefill (muser-kv)"].lifetime == pytest.approx(run.prefill_s, abs=0.25)
    assert bars["decode (muser-kv)"].lifetime == pytest.approx(run.decode_s, abs=0.25)
