"""What every write of a cache keeps: it never passes ``max_context``
(``ContextOverflow``), and a copy it takes is evaluated with the rows it
returns (``evaluated_with``)."""

from __future__ import annotations

from typing import Tuple

import mlx.core as mx

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


def evaluated_with(kv: Pair, copy: mx.array) -> Pair:
    """``kv`` with ``copy`` made part of what evaluating it computes (``mx.depends``:
    an edge, no kernel). A copy left lazy would keep what it reads (the plane
    before the store, or a whole staging shadow) alive, and hold the plane at
    the next store, where MLX would then copy it instead of donating it."""
    return tuple(mx.depends(list(kv), [copy]))
