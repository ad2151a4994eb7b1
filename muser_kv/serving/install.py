"""``install``: make mlx-lm build muser-kv caches for a loaded model.

mlx-lm asks a model for its caches in one place: ``make_prompt_cache(model)``
returns ``model.make_cache()`` when the model has that attribute, and
``generate``, ``stream_generate``, ``speculative_generate_step``,
``BatchGenerator`` and the server all go through it. Setting ``make_cache`` on
the model instance is therefore the whole hook: nothing of mlx-lm is patched.
The geometry and the plane dtype are settled at ``install`` (a model muser-kv
does not serve is refused there, naming what is missing), so every later call
builds the same caches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import mlx.core as mx

from muser_kv.caches import prompt_files
from muser_kv.caches.base import MuseKVCache
from muser_kv.caches.factory import make_cache_for
from muser_kv.caches.speculative import DEFAULT_RETAIN
from muser_kv.caches.writes import require_bound
from muser_kv.core import kernels
from muser_kv.core.counts import count
from muser_kv.core.geometry import MuseGeometry
from muser_kv.core.precision import DtypeLike, plane_dtype_for

_MARK = "_muser_kv_install"


@dataclass(frozen=True)
class Installed:
    """What ``install`` settled for a model (``installed(model)``)."""

    max_context: int
    retain: int
    plane_dtype: mx.Dtype
    sliding_layout: str
    batch_slots: int


def install(model: Any, *, max_context: Optional[int] = None, retain: int = DEFAULT_RETAIN,
            plane_dtype: DtypeLike = None, sliding_layout: str = "token_major",
            num_draft_tokens: Optional[int] = None, batch_slots: int = 1,
            preallocate: bool = False) -> Any:
    """Make ``model.make_cache()`` (and so every mlx-lm code path) build
    muser-kv caches; returns ``model``.

    The arguments are ``make_prompt_cache``'s. ``num_draft_tokens``, when the
    caller will decode speculatively, raises ``retain`` to at least that draft
    length, so every rollback mlx-lm's ``speculative_generate_step`` asks for is
    exact (with ``retain=0`` such a request is refused here). Raises
    ``UnsupportedModel`` for a model that is not one muser-kv serves
    (docs/models.md), and for ``preallocate=True`` where neither the model's
    args nor the caller bound ``max_context``.
    """
    if not isinstance(preallocate, bool):
        raise TypeError(f"preallocate must be True or False, got {preallocate!r}")
    prompt_files.register()  # the model's prompt-cache files hold muser-kv's classes
    retain = count(retain, "retain")
    if num_draft_tokens is not None:
        drafts = count(num_draft_tokens, "num_draft_tokens", minimum=1)
        if retain == 0:
            raise ValueError(
                f"retain=0 keeps no overwritten rows, so no rollback past the wrap is exact; "
                f"speculative decoding with num_draft_tokens={drafts} needs retain >= {drafts}")
        retain = max(retain, drafts)
    if sliding_layout not in (kernels.TOKEN_MAJOR, kernels.HEAD_MAJOR):
        raise ValueError(f"sliding_layout must be token_major or head_major, got {sliding_layout!r}")
    geometry = MuseGeometry.from_model(model, max_context)
    if preallocate:  # refused now, not at mlx-lm's first make_cache()
        require_bound(geometry, "install(model, preallocate=True)")
    dtype = plane_dtype_for(model, plane_dtype)
    batch_slots = count(batch_slots, "batch_slots", minimum=1)

    def make_cache() -> List[MuseKVCache]:
        return make_cache_for(geometry, retain, sliding_layout, dtype, model=model,
                              batch_slots=batch_slots, preallocate=preallocate)

    model.make_cache = make_cache
    setattr(model, _MARK, Installed(geometry.max_context, retain, dtype, sliding_layout,
                                    batch_slots))
    return model


def installed(model: Any) -> Optional[Installed]:
    """The settings ``install`` gave ``model`` (``None`` when it was not installed)."""
    return getattr(model, _MARK, None)


def uninstall(model: Any) -> Any:
    """Give ``model`` back its own ``make_cache`` (mlx-lm's caches); returns ``model``."""
    if installed(model) is not None:
        del model.make_cache
        delattr(model, _MARK)
    return model


def checkpoint_context(path: Any) -> Optional[int]:
    """The ``max_position_embeddings`` of the checkpoint at ``path`` (its
    ``config.json``, or its ``text_config``), for a model whose mlx-lm args
    drop it (Cohere2, GPT-OSS, Muse Spark): the bound a cache is built for
    when none is asked for. ``None`` when the file names none or is unreadable
    locally (the cache then has no preset bound: ``UNBOUNDED_CONTEXT``)."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    for fields in (config, config.get("text_config") or {}):
        value = fields.get("max_position_embeddings") if isinstance(fields, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def vocab_size(model: Any) -> int:
    """The size of ``model``'s vocabulary, from its mlx-lm args, or from its
    language model's where a multimodal model keeps them apart (Muse Spark:
    ``args.text``)."""
    args = getattr(model, "args", None)
    for fields in (args, getattr(args, "text", None)):
        value = getattr(fields, "vocab_size", None)
        if value is not None:
            return int(value)
    raise TypeError(f"{type(model).__name__}'s args name no vocab_size (nor their text's)")


def context_for(model: Any, path: Any, max_context: Optional[int]) -> Optional[int]:
    """``max_context``, or, where the model's args carry no context length, the
    checkpoint's (``checkpoint_context``); ``None`` leaves it to ``install``."""
    if max_context is not None:
        return max_context
    args = getattr(model, "args", None)
    fields = getattr(args, "text", None) or args
    if getattr(fields, "max_position_embeddings", None):
        return None
    return checkpoint_context(path)
