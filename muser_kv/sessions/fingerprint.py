"""A model's fingerprint: which model a session's K/V came from, cheaply.

A session is only meaningful under the weights that computed it: the same
geometry with other weights (another checkpoint, a fine-tune, other random
weights) continues a restored session into nonsense, silently. So a session
records the fingerprint of its model and a load compares it.

The fingerprint is two sha256 digests:

* ``config``: the model's args, as canonical JSON (every field, sorted);
* ``weights``: every parameter's name, dtype and shape, plus the bytes of a
  few small slices of each -- ``SAMPLE`` elements from the start, middle and
  end of its first, middle and last rows (views of the weights, never a whole
  tensor: the cost grows with the number of parameters, not their size, so
  a 17 GB model costs what a tiny one with the same layer count costs).

It tells models apart that differ anywhere a sample falls -- which is every
parameter for different random weights, another checkpoint or a fine-tune
that touches whole rows or columns -- and never tells apart the same weights
(loaded twice, in another process, on another backend). It is not a
cryptographic commitment to every weight: an edit confined to unsampled
elements goes unseen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Dict, List, Mapping, Optional, Tuple, cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from muser_kv.sessions.tensorfile import show

#: Names the scheme, so a later one is never compared with this one.
SCHEME = "muser-kv-fingerprint-1"
#: Elements per sampled slice.
SAMPLE = 16
#: The keys a fingerprint holds.
KEYS = ("scheme", "config", "weights")


def _config_json(args: Any) -> str:
    if dataclasses.is_dataclass(args) and not isinstance(args, type):
        fields = dataclasses.asdict(args)
    else:
        fields = dict(vars(args))
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), default=repr)


def _spans(n: int) -> List[slice]:
    """Start, middle and end slices of ``SAMPLE`` elements of an axis of ``n``."""
    k = min(SAMPLE, n)
    starts = sorted({0, max(0, n // 2 - k // 2), n - k})
    return [slice(s, s + k) for s in starts]


def _samples(w: mx.array) -> Optional[mx.array]:
    """The sampled elements of ``w`` as one flat array, in the scheme's order
    (for each sampled row: its start, middle and end spans), gathered by index:
    one small op per parameter, and never a whole tensor read."""
    if w.ndim == 0:
        return w.reshape(1)
    if w.size == 0:
        return None
    if w.ndim == 1:
        return w[mx.array([i for s in _spans(w.shape[0]) for i in range(s.start, s.stop)])]
    rows = sorted({0, w.shape[0] // 2, w.shape[0] - 1})
    width = w.size // w.shape[0]
    columns = [i for s in _spans(width) for i in range(s.start, s.stop)]
    if w.ndim == 2:
        return w[mx.array([r for r in rows for _ in columns]), mx.array(columns * len(rows))]
    # a row of more dimensions: its flat view (of that row only), then the columns
    return mx.concatenate([mx.take(w[r].reshape(-1), mx.array(columns)) for r in rows])


def model_fingerprint(model: Any) -> Dict[str, str]:
    """``{"scheme", "config", "weights"}`` for an mlx-lm model (see the module doc).
    Every sample is gathered on the model's device and their bytes, in order,
    come back in one array: one evaluation, one copy to the host."""
    args = getattr(model, "args", None)
    config = hashlib.sha256(_config_json(args).encode() if args is not None else b"")
    weights = hashlib.sha256()
    # tree_flatten returns a list of (name, array) when given no destination
    flat = cast(List[Tuple[str, Any]], tree_flatten(model.parameters()))
    params = sorted(flat, key=lambda kv: kv[0])
    samples = []
    for name, w in params:
        weights.update(f"{name}:{w.dtype}:{list(w.shape)};".encode())
        picked = _samples(w)
        if picked is not None:
            samples.append(picked if picked.dtype == mx.uint8 else picked.view(mx.uint8))
    if samples:
        weights.update(np.asarray(mx.concatenate(samples)).tobytes())
    return {"scheme": SCHEME, "config": config.hexdigest(), "weights": weights.hexdigest()}


def check_fingerprint(value: Any) -> Optional[Dict[str, str]]:
    """A fingerprint read from a file: None, or exactly ``KEYS`` as strings
    (``ValueError`` otherwise)."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) != set(KEYS) or not all(
            isinstance(value[k], str) for k in KEYS):
        raise ValueError(f"expected null or an object of {list(KEYS)} strings, got {show(value)}")
    return dict(value)


def differs(recorded: Mapping[str, str], model: Mapping[str, str]) -> Optional[str]:
    """Which part of two fingerprints differs (``scheme``, ``config`` or
    ``weights``), or None when they match."""
    for key in KEYS:
        if recorded.get(key) != model.get(key):
            return key
    return None
