"""The factory: a cache list for a model (``make_prompt_cache``) or a geometry
(``make_cache_for``), one cache per layer of its regime, bound into one list.

It sits above the regimes and the batch class so that nothing below it
imports upward: importing it enters every regime (``base.REGIMES``) and the
batch class (``base.BATCH``)."""

from __future__ import annotations

from typing import Any, List, Optional

from muser_kv.caches import batch as _batch  # noqa: F401  (enters base.BATCH)
from muser_kv.caches import cachelist, mlx_lm_attention, prompt_files
from muser_kv.caches.base import MuseKVCache
from muser_kv.caches.growing import GlobalKVCache
from muser_kv.caches.sliding import SlidingKVCache
from muser_kv.caches.speculative import DEFAULT_RETAIN
from muser_kv.caches.writes import require_bound
from muser_kv.core import kernels
from muser_kv.core.counts import count
from muser_kv.core.geometry import LayerKind, MuseGeometry
from muser_kv.core.kernels import PLANE_DTYPE
from muser_kv.core.planes import Planes
from muser_kv.core.precision import DtypeLike, parse_plane_dtype, plane_dtype_for


def make_prompt_cache(
    model: Any,
    max_context: Optional[int] = None,
    retain: int = DEFAULT_RETAIN,
    sliding_layout: str = "token_major",
    plane_dtype: DtypeLike = None,
    batch_slots: int = 1,
    preallocate: bool = False,
) -> List[MuseKVCache]:
    """One cache per layer of an mlx-lm Muse model, sized from its args.

    ``max_context`` defaults to the model's ``max_position_embeddings``; where
    the model's args carry none (mlx-lm's Cohere2 and GPT-OSS), to no preset
    bound (``UNBOUNDED_CONTEXT``): rings of the window's rows, global planes
    that grow for as long as memory lasts. Every sliding ring is allocated
    (zero-filled) now, at the footprint formula's rows rounded up to a multiple
    of 256. Global planes grow with the sequence: 256 rows at first, doubling
    before the write that needs more, never past ``max_context`` rounded up to
    256 (one bitwise copy per doubling; at most twice the live rows, rounded up
    to 256). ``preallocate=True`` allocates them whole now instead:
    what a fixed-slot deployment wants (its memory is known at start and
    never grows), and what ``footprint`` reports; it needs a bound
    (``UnsupportedModel`` where there is none: pass ``max_context``).
    ``retain`` is how many overwritten rows each sliding ring keeps, i.e. how
    deep ``trim`` and speculative rollback are exact past the wrap (0 turns the
    retention and its one extra copy per token off). ``sliding_layout`` picks the
    rings' layout (``token_major``, the default, or ``head_major``).
    ``plane_dtype`` (f16 or bf16) overrides the planes' type, which otherwise
    follows the model: bf16 for a model whose attention runs in bf16, else f16
    (``muser_kv.precision``). ``batch_slots`` is how many sequences a batch merged
    from these caches (mlx-lm's ``BatchGenerator``) preallocates room for; a
    batch that outgrows it is given larger planes once (``batch.py``).

    The caches form one list (``muser_kv.cachelist``): drive them together, in
    list order, as mlx-lm does; a layer written alone puts the list out of step.
    A model without the fields muser-kv needs, or with a layer type it does not
    serve, raises ``UnsupportedModel`` naming the field.
    """
    geometry = MuseGeometry.from_model(model, max_context)
    return make_cache_for(geometry, retain, sliding_layout, plane_dtype_for(model, plane_dtype),
                          model=model, batch_slots=batch_slots, preallocate=preallocate)


def make_cache_for(
    geometry: MuseGeometry, retain: int = DEFAULT_RETAIN, sliding_layout: str = "token_major",
    plane_dtype: DtypeLike = PLANE_DTYPE, *, model: Any = None, batch_slots: int = 1,
    allocate: bool = True, preallocate: bool = False,
) -> List[MuseKVCache]:
    """One cache per layer of ``geometry``, with planes of ``plane_dtype``, bound
    into one list (``muser_kv.cachelist``); ``model``, when given, is the model
    the list serves (a session saved from it records that model's fingerprint).
    ``allocate=False`` leaves the planes unallocated, for a caller that installs
    every layer before anyone else sees the list (``load_session``): their
    zeros would be replaced unread. ``preallocate`` is ``make_prompt_cache``'s."""
    if not isinstance(geometry, MuseGeometry):
        raise TypeError(f"make_cache_for needs a MuseGeometry, got {type(geometry).__name__}")
    if not isinstance(preallocate, bool):
        raise TypeError(f"preallocate must be True or False, got {preallocate!r}")
    if preallocate:
        require_bound(geometry, "preallocate=True")
    retain = count(retain, "retain")
    batch_slots = count(batch_slots, "batch_slots", minimum=1)
    if sliding_layout not in (kernels.TOKEN_MAJOR, kernels.HEAD_MAJOR):
        raise ValueError(f"sliding_layout must be token_major or head_major, got {sliding_layout!r}")
    dtype = parse_plane_dtype(plane_dtype) or PLANE_DTYPE
    caches: List[MuseKVCache] = []
    for i in range(geometry.num_layers):
        capacity = geometry.capacity(i)
        heads, dim = geometry.layer_dims(i)
        if geometry.layer_kind(i) is LayerKind.SLIDING:
            planes = Planes(kv_heads=heads, head_dim=dim,
                            capacity=capacity, layout=sliding_layout, dtype=dtype,
                            allocate=allocate)
            caches.append(SlidingKVCache(planes, window=geometry.window,
                                         max_context=geometry.max_context, layer=i, retain=retain))
        else:
            planes = Planes(kv_heads=heads, head_dim=dim,
                            capacity=capacity, layout=kernels.HEAD_MAJOR, dtype=dtype,
                            allocate=allocate, growing=not preallocate)
            caches.append(GlobalKVCache(planes, window=geometry.window,
                                        max_context=geometry.max_context, layer=i))
    for c in caches:
        c.batch_slots = batch_slots
    cachelist.bind(caches, model, model_layers=geometry.model_layers or geometry.num_layers)
    if model is not None:
        mlx_lm_attention.route(model)  # its decode steps attend with muser-kv's attention
    prompt_files.register()  # a list that may be saved: mlx-lm's loader must find its classes
    return caches
