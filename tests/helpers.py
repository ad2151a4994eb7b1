"""Small helpers several test modules share (tests/ is on sys.path: conftest)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from conftest import tiny_model
from mlx.utils import tree_flatten, tree_unflatten
from oracle import bits

import muser_kv

#: The K/V heads and head_dim of the plane-level tests' rows.
H, D = 2, 128


def kv(n, dtype=mx.float32, seed=0):
    """``n`` random K and V rows, model-shaped ``[1, H, n, D]``."""
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    k = (mx.random.normal((1, H, n, D), key=k1) * 3).astype(dtype)
    v = (mx.random.normal((1, H, n, D), key=k2) * 3).astype(dtype)
    return k, v


def live_bits(cache):
    """Every layer's ring state and live rows in logical order (what a trim restores)."""
    out = []
    for c in cache:
        start, k, v = c.snapshot()
        out.append((c.meta_state, start, bits(k).copy(), bits(v).copy()))
    return out


def noisy_copy(model, scale, seed):
    """The target with its weights perturbed: a draft that agrees some of the time."""
    draft = tiny_model(mx.float32)
    rng = np.random.default_rng(seed)
    params = [(k, v + mx.array(rng.standard_normal(v.shape).astype(np.float32)) * scale)
              for k, v in tree_flatten(model.parameters())]
    draft.update(tree_unflatten(params))
    mx.eval(draft.parameters())
    return draft


def continue_logits(model, cache, tokens):
    """Decode ``tokens`` one at a time; the logits of every step, as f32 numpy."""
    out = []
    for t in tokens:
        logits = model(mx.array([[t]]), cache=cache)
        out.append(np.array(logits[0, -1].astype(mx.float32)))
    return np.stack(out)


def restored_logits(model, path, tokens):
    """Load the session at ``path`` and continue it with ``tokens``."""
    cache = muser_kv.load_session(path, model)
    return continue_logits(model, cache, tokens)
