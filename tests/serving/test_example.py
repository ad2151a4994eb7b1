"""Smoke test for examples/decode.py: its main() in-process on a tiny model,
asserting on the printed report (footprint equality, ring state, tokens vs mlx-lm)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import numpy as np
import pytest

import muser_kv

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "decode.py"

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


def test_decode_example_report(example: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert example.main(FLAGS) == 0
    out = capsys.readouterr().out

    # rows are allocated in whole granules of 256: each 16-row ring takes 256
    expected_bytes = (6 * 256 + 2 * 256) * ROW_BYTES
    assert (
        f"cache bytes: {expected_bytes:,} B; footprint(geometry, 256).slot_bytes: "
        f"{expected_bytes:,} B; equal: True"
    ) in out

    # 70 + 8 positions written: the sliding ring holds the last 16 (62..77),
    # its oldest at physical row 62 % 16; the global plane holds all 78 in order.
    assert "sliding layer 0 ring: capacity=16 len=16 origin_logical=62 origin_physical=14" in out
    assert "global layer 3 ring: capacity=256 len=78 origin_logical=0 origin_physical=0" in out

    assert re.search(r"^muser-kv +prefill +70 tok .* decode +8 tok .* tok/s$", out, re.M), out
    assert re.search(r"^mlx-lm +prefill +70 tok .* decode +8 tok .* tok/s$", out, re.M), out
    assert re.search(r"^speed ratio muser-kv / mlx-lm: prefill [\d.]+x, decode [\d.]+x$", out, re.M)
    assert "tokens match mlx-lm: True (8 of 8;" in out, out


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
