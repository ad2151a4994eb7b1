"""A batched decode step's graph is built without waiting for the device: no
``mx.eval`` in muser-kv's caches between one step's tokens and the next's, so
the host's build of a step overlaps the device's run of the one before."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model

import muser_kv
from muser_kv.caches.batch import BatchKVCache


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_a_batched_decode_step_at_different_rows_evaluates_nothing(layout, monkeypatch):
    """Sequences at different rows (a scatter per plane, its index built anew):
    building the step's graph calls neither ``mx.eval`` nor ``mx.async_eval``."""
    model = tiny_model(mx.float32)
    rng = np.random.default_rng(7)
    caches = []
    for n in (19, 6, 27):
        cache = muser_kv.make_prompt_cache(model, max_context=128, sliding_layout=layout)
        model(mx.array(rng.integers(0, 255, (1, n)), mx.uint32), cache=cache)
        caches.append(cache)
    batch = [BatchKVCache.merge(list(layer)) for layer in zip(*caches)]
    waits = []
    for name in ("eval", "async_eval"):
        original = getattr(mx, name)
        monkeypatch.setattr(mx, name, lambda *a, _f=original, _n=name, **k: (
            waits.append(_n), _f(*a, **k))[1])
    for _ in range(3):  # every step at new rows
        out = model(mx.zeros((3, 1), mx.uint32), cache=batch)
        assert waits == []
        np.asarray(out)  # the step runs; its reads are the caller's, as mlx-lm's are
