"""muser-kv: exact, preallocated KV caches for Muse-shaped MLX models.

Sliding RoPE layers get a fixed ring with explicit origins; global NoPE layers
get a growing head-major plane; planes are f16, or bf16 for a bf16 model. ``make_prompt_cache(model)`` is a drop-in
for mlx-lm's ``model.make_cache()``.
"""

from .cache import MuseKVCache, causal_mask, make_cache_for, make_prompt_cache
from .cachelist import CacheList, CacheListMismatch, CacheOutOfStep
from .geometry import Footprint, LayerKind, MuseGeometry, UnsupportedModel, footprint
from .cache import ContextOverflow
from .growing import GlobalKVCache
from .planes import Planes
from .sliding import SlidingKVCache
from .precision import attention_dtype, plane_dtype_for
from .ring import CacheDiscontinuity, Ring, Run
from .speculative import DEFAULT_RETAIN, MAX_BLOCK, SpeculativeCheckpoint, checkpoint

__version__ = "0.1.0"

__all__ = [
    "CacheDiscontinuity",
    "CacheList",
    "CacheListMismatch",
    "CacheOutOfStep",
    "UnsupportedModel",
    "DEFAULT_RETAIN",
    "MAX_BLOCK",
    "SpeculativeCheckpoint",
    "checkpoint",
    "ContextOverflow",
    "Footprint",
    "GlobalKVCache",
    "Planes",
    "SlidingKVCache",
    "LayerKind",
    "MuseGeometry",
    "MuseKVCache",
    "Ring",
    "Run",
    "attention_dtype",
    "causal_mask",
    "footprint",
    "make_cache_for",
    "make_prompt_cache",
    "plane_dtype_for",
]

from .snapshot import (  # noqa: E402  (sessions: snapshots on disk, bit-exact restore)
    EncodingMismatch,
    LayerCut,
    ModelMismatch,
    ProductionF16Required,
    SessionFileError,
    SessionHeader,
    SessionMetadataError,
    SessionSnapshot,
    SnapshotError,
    SnapshotMismatch,
    load_session,
    read_session,
    restore_into,
    save_session,
    tidy_temporaries,
)
from .fingerprint import model_fingerprint  # noqa: E402

__all__ += [
    "EncodingMismatch",
    "LayerCut",
    "ModelMismatch",
    "ProductionF16Required",
    "SessionFileError",
    "SessionHeader",
    "SessionMetadataError",
    "SessionSnapshot",
    "SnapshotError",
    "SnapshotMismatch",
    "load_session",
    "read_session",
    "restore_into",
    "save_session",
    "tidy_temporaries",
    "model_fingerprint",
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
from .slots import MAX_SLOTS, EmptySlot, Prefill, Slot, SlotPool, StaleSession  # noqa: E402

__all__ += [
    "ChatShift",
    "ChatTurns",
    "ContextPolicy",
    "ContextPolicyError",
    "ContextTooLong",
    "EmptySlot",
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

from .install import Installed, install, installed, uninstall  # noqa: E402  (mlx-lm's hook)

__all__ += ["Installed", "install", "installed", "uninstall"]

from . import prompt_files as _prompt_files  # noqa: E402

_prompt_files.register()  # mlx-lm's load_prompt_cache finds muser_kv.SlidingKVCache & co.

from .handoff import recv_session, send_session  # noqa: E402  (sessions between processes)

__all__ += ["recv_session", "send_session"]
