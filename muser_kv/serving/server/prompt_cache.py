"""The server's prompt cache for muser-kv's caches: mlx-lm's ``LRUPromptCache``
with a prefix choice that is exact past the wrap.

mlx-lm's ``LRUPromptCache`` (``mlx_lm/models/cache.py``, 0.32.2) keeps caches
by the tokens they hold in a trie. ``fetch_nearest_cache`` returns a deep copy
of the best entry for a prompt: the exact one, else a longer one trimmed back
to the common prefix (``trim_prompt_cache``) when ``can_trim_prompt_cache``
says it can, else the longest stored prefix. ``insert_cache`` of a trimmable
cache drops every stored prefix of it, since a trim would give them back.
Both assume a trimmable cache trims any count exactly. A muser-kv sliding ring
past its wrap trims exactly only ``trimmable_depth()`` tokens (its retained
rows) and refuses more, so with mlx-lm's class a longer entry past that depth
fails the request (the trim raises inside the server), and the prefixes it
dropped are gone for good.

``ExactPromptCache`` is mlx-lm's class with its own ``fetch_nearest_cache`` and
``insert_cache`` bookkeeping; what changes is the choice behind them, made in
its trie (``ExactPromptTrie``), for every model key whose entries hold muser-kv
caches (lists of mlx-lm's caches only get mlx-lm's behaviour, unchanged):

* **fetch**: among every stored entry, the one that reuses the most prompt
  tokens that it can give back exactly: an entry that is a prefix of the prompt
  as it is, a longer one only when every layer can trim the surplus exactly
  (``exact_trim_depth``, the minimum over the list, and ``can_trim_prompt_cache``);
  at equal reuse the smaller trim wins. An entry past its depth is passed over,
  for a shorter one or a fresh prefill. At least one prompt token is always left
  to compute (an entry equal to the whole prompt is reused one token short, by a
  trim of one, or passed over): mlx-lm returns it whole, and its server then
  fails on the empty remainder (batched: ``insert_segments`` raises in the
  generation thread).
* **insert**: a stored prefix is dropped only when the new entry can be trimmed
  back to it exactly (``len(tokens) - len(prefix) + 1 <= depth``: one more than
  the distance, because a prompt equal to the prefix is reused one token short);
  the others stay.
* **keys say what the caches hold**: an entry is keyed by the tokens its first
  (the main model's) layer holds. mlx-lm's speculative path stores a cache that
  holds one token fewer than the key it gives (the last token, when it came
  from the target model, was never fed to it); keyed as given, a later request
  reusing it would miss that token.

Every reuse is exact: the tokens an entry is keyed by are the tokens its caches
hold, a trim is taken only within every layer's exact depth, and a trim that
refuses anyway (a broken depth) is logged and answered with a fresh prefill,
never with a failed request.

**Behind it, a KV store** (``attach``; ``muser_kv.KVStore``): every list
inserted is also put into the store, and a prompt the entries reuse less of
than the store can rebuild (a regenerate, an edited message, a branch, an entry
evicted, a server restarted over the same directory or sharing one Redis) is
answered from the store. A store that fails is a log line and a fresh prefill.
A list inserted as a ``"checkpoint"`` (``muser_kv.serving.checkpoints``: the
server's prefill passing a multiple of ``--kv-store-checkpoint``) is put into
the store only: it is never an entry, and costs no memory beyond the store's.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from mlx_lm.models.cache import (
    LRUPromptCache,
    PromptTrie,
    PromptTrieResult,
    can_trim_prompt_cache,
)

from muser_kv.caches.base import MuseKVCache
from muser_kv.serving.checkpoints import CHECKPOINT
from muser_kv.serving.server import mlx_lm_server as mlx
from muser_kv.sessions.store import KVStore

log = logging.getLogger(__name__)


def is_muser_list(caches: Sequence[Any]) -> bool:
    """Whether a cache list holds a muser-kv cache (its reuse follows this module)."""
    return any(isinstance(c, MuseKVCache) for c in caches)


def exact_trim_depth(caches: Sequence[Any]) -> int:
    """How many newest tokens every layer of ``caches`` can forget exactly: the
    minimum over the list of each muser-kv cache's ``trimmable_depth()`` and, for
    a cache of mlx-lm's (a draft model's, say), its offset while it says it is
    trimmable (mlx-lm's caches trim exactly then), else 0."""
    depth: Optional[int] = None
    for c in caches:
        if isinstance(c, MuseKVCache):
            d = c.trimmable_depth()
        else:
            d = int(getattr(c, "offset", 0)) if c.is_trimmable() else 0
        depth = d if depth is None else min(depth, d)
    return depth or 0


def list_tokens(caches: Sequence[Any]) -> Optional[int]:
    """How many tokens a muser-kv list holds: its first layer's offset (the main
    model's, in a list that carries a draft model's caches after it); ``None``
    for a list whose first layer is not muser-kv's."""
    first = caches[0] if caches else None
    return first.offset if isinstance(first, MuseKVCache) else None


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class ExactPromptTrie(PromptTrie):
    """mlx-lm's ``PromptTrie`` (it stores the entries) with the choice of
    ``search`` and ``pop_prefixes`` made exact for muser-kv entries (module doc).

    Beside the trie it keeps every key of a model once more, as an array with
    its entry, so a search compares the prompt with each stored key in one
    vectorised pass instead of walking a trie of tens of thousands of nodes per
    candidate; ``add``, ``pop`` and ``pop_prefixes`` keep the two in step.
    """

    def __init__(self) -> None:
        super().__init__()
        self._keys: Dict[Any, Dict[Tuple[int, ...], Tuple[np.ndarray, Any]]] = {}

    # -- keeping the key index ----------------------------------------------------

    def add(self, model: Any, tokens: List[int], value: Any) -> Any:
        prev = super().add(model, tokens, value)
        self._keys.setdefault(model, {})[tuple(tokens)] = (np.asarray(tokens, np.int64), value)
        return prev

    def pop(self, model: Any, tokens: List[int]) -> Any:
        value = super().pop(model, tokens)
        self._forget(model, tokens)
        return value

    def _forget(self, model: Any, tokens: Sequence[int]) -> None:
        keys = self._keys.get(model)
        if keys is not None:
            keys.pop(tuple(tokens), None)
            if not keys:
                del self._keys[model]

    def is_muser(self, model: Any) -> bool:
        keys = self._keys.get(model)
        if not keys:
            return False
        _, value = next(iter(keys.values()))
        return is_muser_list(value.prompt_cache)

    # -- the choice ----------------------------------------------------------------

    def search(self, model: Any, tokens: List[int]) -> PromptTrieResult:
        """The entry ``fetch_nearest_cache`` should reuse for ``tokens``, as a
        ``PromptTrieResult`` that mlx-lm's fetch turns into exactly that reuse:
        ``shorter`` for an entry reused as it is, ``longer`` with
        ``common_prefix`` = the tokens reused for one to trim (never ``exact``)."""
        if not self.is_muser(model):
            return super().search(model, tokens)
        best = self.choose(model, tokens)
        if best is None:
            return PromptTrieResult(model, None, None, None, 0)
        key, reuse, trim = best
        if trim == 0:
            return PromptTrieResult(model, None, list(key), None, reuse)
        return PromptTrieResult(model, None, None, list(key), reuse)

    def choose(self, model: Any, tokens: Sequence[int]) -> Optional[Tuple[Tuple[int, ...], int, int]]:
        """``(key, reused tokens, tokens to trim)`` of the stored entry that reuses
        the most of ``tokens`` exactly, leaving at least one token to compute
        (at equal reuse the smaller trim); ``None`` when none reuses any."""
        keys = self._keys.get(model)
        if not keys or len(tokens) < 2:
            return None
        prompt = np.asarray(tokens, np.int64)
        limit = len(tokens) - 1
        best: Optional[Tuple[Tuple[int, ...], int, int]] = None
        for key, (array, value) in keys.items():
            reuse = min(limit, _common(array, prompt))
            trim = len(key) - reuse
            if reuse <= 0 or (best is not None and (reuse, -trim) <= (best[1], -best[2])):
                continue
            if trim and not self.trims_exactly(value.prompt_cache, trim):
                continue
            best = (key, reuse, trim)
        return best

    @staticmethod
    def trims_exactly(caches: List[Any], n: int) -> bool:
        """Whether mlx-lm's ``trim_prompt_cache(caches, n)`` trims ``n`` exactly."""
        return can_trim_prompt_cache(caches) and exact_trim_depth(caches) >= n

    def pop_prefixes(self, model: Any, tokens: List[int]) -> List[Tuple[int, Any]]:
        """Drop the stored prefixes of the entry just added at ``tokens`` that it
        can be trimmed back to exactly (every one, for mlx-lm's own caches)."""
        if not self.is_muser(model):
            popped = super().pop_prefixes(model, tokens)
            for length, _ in popped:
                self._forget(model, tokens[:length])
            return popped
        entry = self.get(model, tokens)
        depth = exact_trim_depth(entry.prompt_cache) if can_trim_prompt_cache(
            entry.prompt_cache) else 0
        reach = len(tokens) + 1 - depth  # a prefix at least this long is given back by a trim
        popped = []
        current = mlx.trie_root(self, model)
        for i, tok in enumerate(tokens):
            if "__value__" in current and i >= reach:
                popped.append((i, current.pop("__value__")))
                self._forget(model, tokens[:i])
            current = current[tok]
        return popped


class ExactPromptCache(LRUPromptCache):
    """mlx-lm's server prompt cache, exact for muser-kv's caches past the wrap
    (module doc); for lists of mlx-lm's caches it is mlx-lm's, unchanged."""

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63):
        super().__init__(max_size, max_bytes)
        self.trie = ExactPromptTrie()  #: the trie mlx-lm's cache keeps its entries in
        mlx.set_prompt_trie(self, self.trie)
        self.store: Optional[KVStore] = None
        self._model_for: Callable[[Any], Any] = lambda key: None

    def attach(self, store: Optional[KVStore], model_for: Callable[[Any], Any]) -> None:
        """Put every inserted list into ``store`` and ask it where the entries fall
        short. ``model_for(key)`` is the model a model key's lists are of, or
        ``None`` where the store must stay out (a list carrying a draft model's
        caches beside the main model's)."""
        self.store, self._model_for = store, model_for

    def fetch_nearest_cache(self, model: Any, tokens: List[int]) -> Tuple[Optional[List[Any]], List[int]]:
        """mlx-lm's lookup of the entries, then the store where they fall short.
        Where a store is attached, one log line gives the time of each part (what
        a client's wait before the prefill is made of)."""
        started = time.perf_counter()
        try:
            cache, rest = super().fetch_nearest_cache(model, tokens)
        except ValueError:
            if not self.trie.is_muser(model):
                raise
            # a trim within every layer's exact depth refused: the depth was
            # wrong; the stored entry is untouched (the trim ran on a copy)
            log.exception("muser-kv prompt cache: a trim within the exact depth was refused; "
                          "prefilling this prompt afresh")
            cache, rest = None, tokens
        reuse = len(tokens) - len(rest)
        entries_s = time.perf_counter() - started
        store = self.store
        if store is None or reuse >= len(tokens) - 1:
            if store is not None:
                log.info("muser-kv request path: entries %.3f s (reuse %d of %d tokens)",
                         entries_s, reuse, len(tokens))
            return cache, rest
        owner = self._model_for(model)
        if owner is None:
            return cache, rest
        read_before = store.read_totals()
        started = time.perf_counter()
        try:
            n, rebuilt = store.longest_prefix(tokens, owner, beyond=reuse)
        except Exception:
            log.exception("muser-kv prompt cache: the KV store failed a lookup; reusing %d "
                          "tokens from memory", reuse)
            return cache, rest
        read_bytes, read_s = (a - b for a, b in zip(store.read_totals(), read_before))
        log.info("muser-kv request path: entries %.3f s (reuse %d of %d tokens), KV store "
                 "%.3f s (%s; %d B read from the byte tier in %.3f s)", entries_s, reuse,
                 len(tokens), time.perf_counter() - started,
                 f"rebuilt {n}" if n > reuse else "nothing deeper", read_bytes, read_s)
        if n > reuse:
            log.info("muser-kv prompt cache: rebuilt %d tokens from the KV store (the entries "
                     "reuse %d)", n, reuse)
            return rebuilt, list(tokens[n:])
        return cache, rest

    def insert_cache(self, model: Any, tokens: List[int], prompt_cache: List[Any], *,
                     cache_type: str = "assistant") -> None:
        """mlx-lm's insert, keyed by the tokens a muser-kv list holds (module doc);
        a list that holds more tokens than it is keyed by, or none, is not kept
        (nothing would say what its extra tokens are). A ``CHECKPOINT`` list (a
        prefill passing a multiple of ``--kv-store-checkpoint``) is only put
        into the store, never kept as an entry."""
        if cache_type == CHECKPOINT:
            if list_tokens(prompt_cache) == len(tokens):
                self._put(model, tokens, prompt_cache)
            return
        n = list_tokens(prompt_cache)
        if n is not None and n != len(tokens):
            if n > len(tokens) or n == 0:
                log.warning("muser-kv prompt cache: not keeping a cache that holds %d tokens "
                            "under a key of %d", n, len(tokens))
                return
            tokens = tokens[:n]
        started = time.perf_counter()
        for c in prompt_cache:  # an entry holds its rows, not a growth's headroom
            if isinstance(c, MuseKVCache):
                c.fit()
        fitted = time.perf_counter()
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        inserted = time.perf_counter()
        if n is not None:
            self._put(model, tokens, prompt_cache)
        if self.store is not None:
            log.info("muser-kv prompt cache: kept %d tokens (fit %.3f s, insert %.3f s, KV store "
                     "put %.3f s)", len(tokens), fitted - started, inserted - fitted,
                     time.perf_counter() - inserted)

    def _put(self, model: Any, tokens: List[int], prompt_cache: List[Any]) -> None:
        """Put a muser-kv list holding ``tokens`` into the store, where there is
        one and it keeps ``model``'s lists; a failure is a log line."""
        store = self.store
        owner = self._model_for(model) if store is not None else None
        if store is None or owner is None or not all(
                isinstance(c, MuseKVCache) for c in prompt_cache):
            return
        try:
            store.put(tokens, prompt_cache, owner)
        except Exception:
            log.exception("muser-kv prompt cache: the KV store failed a put of %d tokens",
                          len(tokens))
