"""``benchmarks/determinism.py`` section 5, the check that tells on MLX CUDA
whether attention varies over the same rows: its comparison finds a differing
row or output where one is planted, and on the CPU every run of a whole list's
writes and reads repeats run 1 bit for bit (the CPU's promise)."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import determinism  # noqa: E402


def run(rows: int = 0, out: int = 0):
    """Two steps of two layers; ``rows`` / ``out`` plant a difference in step 1, layer 1."""
    kv = [[np.zeros(4, np.uint16), np.zeros(4, np.uint16)] for _ in range(2)]
    outs = [[np.zeros(4, np.uint16), np.zeros(4, np.uint16)] for _ in range(2)]
    kv[1][1][0] += rows
    outs[1][1][2] += out
    return list(zip(kv, outs))


def test_the_comparison_finds_what_differs():
    assert determinism._agreement([run(), run(), run()]) == [2, 2, "-"]
    assert determinism._agreement([run(), run(out=1), run()]) == [2, 1, "step 1, layer 1"]
    assert determinism._agreement([run(), run(rows=1, out=1), run(rows=1)]) == [0, 1,
                                                                                "step 1, layer 1"]


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU's promise; a GPU's is measured")
def test_on_the_cpu_every_run_repeats_run_1():
    rows = determinism.repeat_rows(determinism.parse_args(
        ["--steps", "3", "--runs", "2", "--heads", "4"]))  # few query heads: the CPU is slow
    assert len(rows) == 8  # 2 dtypes x growing / preallocated x 2 query orders
    for row in rows:
        assert row[3:] == [1, 1, "-", 1], row
