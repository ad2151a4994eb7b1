"""What every write of a cache keeps: it never passes ``max_context``
(``ContextOverflow``), and a copy it takes is evaluated with the rows it
returns (``evaluated_with``); planes allocated whole need a ``max_context``
that bounds them (``require_bound``)."""

from __future__ import annotations

from typing import Tuple

import mlx.core as mx

from muser_kv.core.geometry import MuseGeometry, UnsupportedModel

Pair = Tuple[mx.array, mx.array]


class ContextOverflow(ValueError):
    """A write past the cache's ``max_context``. The cache never shifts on its
    own; deciding what to keep is the context policy's job."""

    def __init__(self, layer: int, end: int, max_context: int):
        self.layer = layer
        self.end = end
        self.max_context = max_context
        super().__init__(
            f"KV cache for layer {layer}: writing up to position {end} exceeds "
            f"max_context {max_context}"
        )


def require_bound(geometry: MuseGeometry, what: str) -> None:
    """Refuse (``UnsupportedModel``, before anything is allocated) to
    preallocate ``geometry`` when its ``max_context`` is no bound
    (``UNBOUNDED_CONTEXT``: the model's args name no context length and the
    caller gave none): ``what`` would take that many rows per global plane now.
    Growing planes need no bound."""
    if not geometry.bounded:
        raise UnsupportedModel(
            f"{what} allocates max_context rows per global plane now, and this model's args "
            "carry no max_position_embeddings: pass max_context (the positions to preallocate, "
            "at most the model's context length); without preallocation global planes grow "
            "with no preset bound")


def evaluated_with(kv: Pair, copy: mx.array) -> Pair:
    """``kv`` with ``copy`` made part of what evaluating it computes (``mx.depends``:
    an edge, no kernel). A copy left lazy would keep what it reads (the plane
    before the store, or a whole staging shadow) alive, and hold the plane at
    the next store, where MLX would then copy it instead of donating it."""
    return tuple(mx.depends(list(kv), [copy]))
