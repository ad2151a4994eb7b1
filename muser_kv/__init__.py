"""muser-kv: exact KV caches for mlx-lm's sliding-window models.

Sliding-window layers get a fixed ring with explicit origins; global layers get
a growing head-major plane; planes are f16, or bf16 for a bf16 model.
``make_prompt_cache(model)`` is a drop-in for mlx-lm's ``model.make_cache()``.

The package is four layers, each importing only those below it (checked by
import-linter in CI): ``core`` <- ``caches`` <- ``sessions`` <- ``serving``.
Every public name is here, in one ``__all__``.
"""

from muser_kv.caches import prompt_files as _prompt_files
from muser_kv.caches.base import MuseKVCache
from muser_kv.caches.cachelist import CacheList, CacheListMismatch, CacheOutOfStep
from muser_kv.caches.factory import make_cache_for, make_prompt_cache
from muser_kv.caches.growing import GlobalKVCache
from muser_kv.caches.masks import causal_mask
from muser_kv.caches.mlx_lm_attention import route as route_attention
from muser_kv.caches.sliding import SlidingKVCache
from muser_kv.caches.speculative import (
    DEFAULT_RETAIN,
    MAX_BLOCK,
    SpeculativeCheckpoint,
    checkpoint,
)
from muser_kv.caches.writes import ContextOverflow
from muser_kv.core.attention import decode_attention, set_decode_attention
from muser_kv.core.geometry import (
    UNBOUNDED_CONTEXT,
    Footprint,
    LayerKind,
    MuseGeometry,
    UnsupportedModel,
    footprint,
)
from muser_kv.core.planes import Planes
from muser_kv.core.precision import attention_dtype, plane_dtype_for
from muser_kv.core.ring import CacheDiscontinuity, Ring, Run
from muser_kv.serving.install import Installed, install, installed, uninstall
from muser_kv.serving.policy import (
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
)
from muser_kv.serving.pool.chat_shift import ChatShift, shift_chat
from muser_kv.serving.pool.slots import MAX_SLOTS, EmptySlot, Prefill, Slot, SlotPool, StaleSession
from muser_kv.sessions.fingerprint import model_fingerprint
from muser_kv.sessions.format import (
    EncodingMismatch,
    ModelMismatch,
    ProductionF16Required,
    SessionFileError,
    SessionHeader,
    SessionMetadataError,
    SnapshotError,
    SnapshotMismatch,
)
from muser_kv.sessions.handoff import recv_session, send_session
from muser_kv.sessions.load import load_session
from muser_kv.sessions.reading import read_session
from muser_kv.sessions.save import save_session
from muser_kv.sessions.snapshot import LayerCut, SessionSnapshot, restore_into
from muser_kv.sessions.store import KVStore, PutReport, StoreStats
from muser_kv.sessions.temporaries import tidy_temporaries

__version__ = "0.1.0"

__all__ = [
    "decode_attention", "set_decode_attention", "route_attention",
    # core: the layer plan, footprint, the ring
    "CacheDiscontinuity",
    "Footprint",
    "LayerKind",
    "MuseGeometry",
    "Planes",
    "Ring",
    "Run",
    "UNBOUNDED_CONTEXT",
    "UnsupportedModel",
    "attention_dtype",
    "footprint",
    "plane_dtype_for",
    # caches: the regimes, the list, speculative checkpoints, the factory
    "CacheList",
    "CacheListMismatch",
    "CacheOutOfStep",
    "ContextOverflow",
    "DEFAULT_RETAIN",
    "GlobalKVCache",
    "MAX_BLOCK",
    "MuseKVCache",
    "SlidingKVCache",
    "SpeculativeCheckpoint",
    "causal_mask",
    "checkpoint",
    "make_cache_for",
    "make_prompt_cache",
    "register_prompt_files",
    # sessions: files, restore, fingerprint, handoff
    "EncodingMismatch",
    "KVStore",
    "LayerCut",
    "ModelMismatch",
    "ProductionF16Required",
    "PutReport",
    "SessionFileError",
    "SessionHeader",
    "SessionMetadataError",
    "SessionSnapshot",
    "SnapshotError",
    "SnapshotMismatch",
    "StoreStats",
    "load_session",
    "model_fingerprint",
    "read_session",
    "recv_session",
    "restore_into",
    "save_session",
    "send_session",
    "tidy_temporaries",
    # serving: the shared policy, the slot pool, mlx-lm's hook
    "ChatShift",
    "ChatTurns",
    "ContextPolicy",
    "ContextPolicyError",
    "ContextTooLong",
    "EmptySlot",
    "Installed",
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
    "install",
    "installed",
    "shift_chat",
    "uninstall",
]

_prompt_files.name_classes()  # what mlx-lm's save_prompt_cache writes: muser_kv.SlidingKVCache & co.
_prompt_files.register_if_loaded()  # and where its load_prompt_cache finds them
register_prompt_files = _prompt_files.register
