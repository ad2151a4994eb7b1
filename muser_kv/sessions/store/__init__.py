"""The KV store: chunks of K/V rows named by a prefix hash chain, kept in tiers
(memory; a directory or Redis: ``tiers``, ``directory``, ``redis_tier``), from
which any stored point of a conversation is rebuilt exactly (``store.KVStore``,
the facade over the planner, ``planner``, and the tier manager, ``manager``)."""

from muser_kv.sessions.store.chunks import CHUNK, ChunkFormatError
from muser_kv.sessions.store.store import KVStore, PutReport, StoreStats

__all__ = ["CHUNK", "ChunkFormatError", "KVStore", "PutReport", "StoreStats"]
