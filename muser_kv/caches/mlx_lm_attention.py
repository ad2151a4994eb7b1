"""mlx-lm's attention call, routed to muser-kv's decode attention for its caches.

mlx-lm's sliding-window models call ``scaled_dot_product_attention(queries,
keys, values, cache=..., scale=..., mask=...)``, which each model module
imports from ``mlx_lm.models.base`` (``REPLACED``). ``route(model)``
replaces that name in the modules the model's layers come from with
``scaled_dot_product_attention`` below, once: a decode step (1 to
``MAX_QUERIES`` tokens; the backend's ``max_queries``) whose keys and values are what a muser-kv cache just
returned goes to ``core.attention`` through the cache's backend (lengths as
integers, no mask), and so does every chunk on the CPU (the reference backend
takes any length: a token's bits there never depend on how its request was
chunked); every other call (a prefill chunk on a GPU, another cache, no
cache) goes to mlx-lm's function unchanged. ``make_prompt_cache`` routes the
model it builds caches for, so ``generate``, ``chat``, ``BatchGenerator``,
``serve`` and a user's own ``generate_step`` all take it.

mlx-lm's function is checked at the first ``route`` (its module, its
parameters, in order): another mlx-lm fails there, naming what changed.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

import mlx.core as mx

from muser_kv.caches.masks import DecodeMask
from muser_kv.core.attention import decode_attention

#: the mlx-lm function replaced, and its parameters as mlx-lm's models call it
REPLACED = ("mlx_lm.models.base", "scaled_dot_product_attention")
PARAMS = ("queries", "keys", "values", "cache", "scale", "mask", "sinks")

_original: list = []
#: the keys of the last few decode reads and their caches, weakly (neither a
#: plane nor a finished request's caches are held here), by the keys' id: a
#: layer handed another layer's K/V and no cache (Gemma 4's KV-shared layers)
#: attends as that layer did, while those keys are the last its cache returned
_fetched_by: Dict[int, Tuple[Any, Any]] = {}


def _shared(keys: mx.array) -> Any:
    """The cache whose last decode read returned ``keys`` (the array itself,
    not another at a reused id), or ``None``."""
    entry = _fetched_by.get(id(keys))
    if entry is None or entry[0]() is not keys:
        return None
    return entry[1]()


def original() -> Callable[..., mx.array]:
    """mlx-lm's ``scaled_dot_product_attention``, checked once."""
    if not _original:
        module = __import__(REPLACED[0], fromlist=[REPLACED[1]])
        function = getattr(module, REPLACED[1], None)
        if function is None:
            raise ImportError(f"{'.'.join(REPLACED)} is gone: muser-kv routes decode attention "
                              "through it")
        have = tuple(inspect.signature(function).parameters)
        if have != PARAMS:
            raise ImportError(f"{'.'.join(REPLACED)} takes ({', '.join(have)}), muser-kv "
                              f"expects ({', '.join(PARAMS)})")
        _original.append(function)
    return _original[0]


def scaled_dot_product_attention(queries: mx.array, keys: mx.array, values: mx.array,
                                 cache: Any, scale: float, mask: Any,
                                 sinks: Optional[mx.array] = None) -> mx.array:
    """mlx-lm's function, with a muser-kv cache's decode step (the keys and
    values it just returned, at most the backend's ``max_queries`` tokens) answered by
    muser-kv's decode attention, which ignores ``mask``: the cache describes
    each sequence's keys (``decode_read``). A ``DecodeMask`` (a batch's decode
    step) must be answered so: anything else raises rather than attend
    without the sequences' lengths."""
    if cache is None:  # a layer sharing an earlier layer's K/V (Gemma 4): that cache's read
        cache = _shared(keys)
    reader = getattr(cache, "decode_read", None)
    if reader is not None and queries.shape[2] <= cache.backend.max_queries \
            and decode_attention() == "muser":
        read = reader(keys, values)
        if read is not None:
            _fetched_by[id(keys)] = (weakref.ref(keys), weakref.ref(cache))
            if len(_fetched_by) > 1024:  # the oldest first: a forward's own stay
                del _fetched_by[next(iter(_fetched_by))]
            return cache.backend.attend(queries, read, scale, sinks)
    if isinstance(mask, DecodeMask):
        raise RuntimeError(
            "a muser-kv batch's decode step reached attention without its keys as the cache "
            "returned them: its mask is the sequences' lengths, which only muser-kv's decode "
            "attention reads")
    return original()(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def route(model: Any) -> None:
    """Route the attention of ``model``'s layers (mlx-lm's ``REPLACED`` name in
    each module they come from) through ``scaled_dot_product_attention``.
    Idempotent; a model that is not mlx-lm's (no ``modules``) is left as is."""
    modules = getattr(model, "modules", None)
    if modules is None or "mlx_lm" not in sys.modules:  # no mlx-lm model to route
        return
    function = original()
    for name in {type(m).__module__ for m in modules()}:
        module = sys.modules.get(name)
        if module is not None and getattr(module, REPLACED[1], None) is function:
            setattr(module, REPLACED[1], scaled_dot_product_attention)
