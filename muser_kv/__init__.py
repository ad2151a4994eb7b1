"""muser-kv: exact, preallocated KV caches for Muse-shaped MLX models.

Sliding RoPE layers get a fixed f16 ring with explicit origins; global NoPE
layers get a growing head-major plane. ``make_prompt_cache(model)`` is a drop-in
for mlx-lm's ``model.make_cache()``.
"""

from .cache import MuseKVCache, causal_mask, make_cache_for, make_prompt_cache
from .geometry import Footprint, LayerKind, MuseGeometry, footprint
from .plane import ContextOverflow, KvPlane
from .ring import CacheDiscontinuity, Ring, Run
from .speculative import DEFAULT_RETAIN, MAX_BLOCK, SpeculativeCheckpoint, checkpoint

__version__ = "0.1.0"

__all__ = [
    "CacheDiscontinuity",
    "DEFAULT_RETAIN",
    "MAX_BLOCK",
    "SpeculativeCheckpoint",
    "checkpoint",
    "ContextOverflow",
    "Footprint",
    "KvPlane",
    "LayerKind",
    "MuseGeometry",
    "MuseKVCache",
    "Ring",
    "Run",
    "causal_mask",
    "footprint",
    "make_cache_for",
    "make_prompt_cache",
]

from .snapshot import (  # noqa: E402  (sessions: snapshots on disk, bit-exact restore)
    LayerCut,
    ProductionF16Required,
    SessionFileError,
    SessionSnapshot,
    SnapshotError,
    SnapshotMismatch,
    load_session,
    read_session,
    restore_into,
    save_session,
)

__all__ += [
    "LayerCut",
    "ProductionF16Required",
    "SessionFileError",
    "SessionSnapshot",
    "SnapshotError",
    "SnapshotMismatch",
    "load_session",
    "read_session",
    "restore_into",
    "save_session",
]

from .policy import (  # noqa: E402  (context policy: what a request keeps past max_context)
    ChatShift,
    ChatTurns,
    ContextPolicy,
    ContextPolicyError,
    ContextTooLong,
    LineageMismatch,
    Message,
    RawCompaction,
    SystemAfterTurns,
    compact_raw,
    complete_chat_turns,
    shift_chat,
)
from .slots import MAX_SLOTS, Prefill, Slot, SlotPool, StaleSession  # noqa: E402

__all__ += [
    "ChatShift",
    "ChatTurns",
    "ContextPolicy",
    "ContextPolicyError",
    "ContextTooLong",
    "LineageMismatch",
    "MAX_SLOTS",
    "Message",
    "Prefill",
    "RawCompaction",
    "Slot",
    "SlotPool",
    "StaleSession",
    "SystemAfterTurns",
    "compact_raw",
    "complete_chat_turns",
    "shift_chat",
]
