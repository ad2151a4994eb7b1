"""Which element type a model's planes get: the rule, stated once.

A model's planes hold K/V in the type its attention computes in, read off the
model itself -- the dtype of the keys its first attention layer hands its
cache, from a lazy forward of one token that is never evaluated (no kernel runs,
so it costs host time only) -- never guessed from a config:

* bf16 attention -> **bf16 planes**. K/V are then stored bit for bit as the
  model produced them (as mlx-lm's own caches store them) and attention stays
  in bf16. f16 planes would meet bf16 queries, MLX would promote attention to
  f32, and the residual stream with it (several times slower decode:
  docs/performance.md).
* f16 or f32 attention -> **f16 planes**, the production encoding (an f32
  model's K/V round to nearest even on the way in).

Quantized checkpoints need no rule of their own: mlx-lm's 4- and 8-bit layers
hold uint32 weights but compute in the dtype of their scales and embeddings,
and that is the dtype their keys arrive in. ``plane_dtype=`` overrides the
choice (f16 or bf16 only).
"""

from __future__ import annotations

from typing import Any, NoReturn, Optional, Union

import mlx.core as mx

from muser_kv.core.kernels import PLANE_DTYPES

DtypeLike = Union[None, str, mx.Dtype]

_NAMES = {"float16": mx.float16, "f16": mx.float16, "fp16": mx.float16, "half": mx.float16,
          "bfloat16": mx.bfloat16, "bf16": mx.bfloat16}


def parse_plane_dtype(value: DtypeLike) -> Optional[mx.Dtype]:
    """``None`` (follow the model), an ``mx.Dtype`` or a name -> a plane dtype;
    anything but f16 / bf16 is refused with the accepted values."""
    if value is None:
        return None
    dtype = _NAMES.get(value.lower()) if isinstance(value, str) else value
    if not isinstance(dtype, mx.Dtype) or dtype not in PLANE_DTYPES:
        raise ValueError(
            f"plane_dtype must be float16 or bfloat16 (or None: follow the model), got {value!r}")
    return dtype


class _Probed(Exception):
    def __init__(self, dtype: mx.Dtype):
        self.dtype = dtype


class _ProbeCache:
    """Stands in for a layer's cache for one lazy forward: reports the dtype of
    the first keys it is handed and stops the forward there."""

    offset = 0

    def make_mask(self, *args: Any, **kwargs: Any) -> None:
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> NoReturn:
        raise _Probed(keys.dtype)


def attention_dtype(model: Any) -> mx.Dtype:
    """The dtype of the K/V ``model`` hands its caches (see the module doc)."""
    layers = getattr(model, "layers", None)
    count = len(layers) if layers is not None else int(model.args.num_hidden_layers)
    try:
        model(mx.array([[0]], dtype=mx.int32), cache=[_ProbeCache() for _ in range(count)])
    except _Probed as found:
        return found.dtype
    raise TypeError(f"{type(model).__name__} ran a forward without handing its cache any keys: "
                    "cannot tell which dtype its attention computes in")


def plane_dtype_for(model: Any, plane_dtype: DtypeLike = None) -> mx.Dtype:
    """The plane dtype for ``model``: ``plane_dtype`` if given, else bf16 for a
    model whose attention computes in bf16 and f16 for any other."""
    chosen = parse_plane_dtype(plane_dtype)
    if chosen is not None:
        return chosen
    return mx.bfloat16 if attention_dtype(model) == mx.bfloat16 else mx.float16
