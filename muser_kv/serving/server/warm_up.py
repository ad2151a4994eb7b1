"""What a loaded model's first request would otherwise wait for, done before
the server says it is ready: a process's first forward pays for starting the
GPU's libraries and loading the kernels it uses (on MLX CUDA, cuBLAS and cuDNN
and the compiled kernels), which is no part of any request. ``warm_up`` runs
one short chat's worth of work on a throwaway cache and a throwaway store: a
prefill past 256 rows (so a decode step reads planes MLX CUDA's cuDNN
attention can take), decode steps, a KV store put and the rebuild of it. It
touches nothing a request uses: not the prompt cache, not the server's store,
no random state."""

from __future__ import annotations

import logging
import time
from typing import Any

import mlx.core as mx

from muser_kv.serving.install import installed, vocab_size
from muser_kv.sessions.store import KVStore
from muser_kv.sessions.store.store import fresh_list

log = logging.getLogger(__name__)

#: the warm-up prompt: past one 256-row allocation, so a decode step's global
#: planes are read the way a long chat's are
PROMPT = 300
DECODE = 2
#: the throwaway store's memory bound: the warm-up's rows, many times over
STORE_BYTES = 1 << 30


def warm_up(model: Any) -> float:
    """Run the warm-up (module doc) on ``model`` (muser-kv installed); its
    seconds. A failure is a log line, never the server's: a request then pays
    what the warm-up would have."""
    t0 = time.perf_counter()
    try:
        n = _prompt_tokens(model)
        tokens = [i % vocab_size(model) for i in range(n + DECODE)]
        cache = fresh_list(model)
        logits = model(mx.array([tokens[:n]]), cache=cache)
        mx.eval(logits)
        for i in range(n, n + DECODE):
            logits = model(mx.array([[tokens[i]]]), cache=cache)
            mx.eval(logits)
        store = KVStore(None, memory_bytes=STORE_BYTES)
        try:
            store.put(tokens, cache, model)
            _, rebuilt = store.longest_prefix(tokens + [0], model)
            mx.eval(model(mx.array([[0]]), cache=rebuilt))
        finally:
            store.close()
    except Exception:
        log.exception("muser-kv serve: the warm-up failed; the first request pays for what "
                      "it would have started")
        return time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    log.info("muser-kv serve: warmed up in %.2f s (a %d-token prefill, %d decode steps, a KV "
             "store put and its rebuild, on throwaway caches)", seconds, n, DECODE)
    return seconds


def _prompt_tokens(model: Any) -> int:
    """``PROMPT``, or fewer where the installed context holds less (with room
    for the decode steps and the rebuilt list's one)."""
    context = getattr(installed(model), "max_context", None)
    if context is None:
        return PROMPT
    return max(1, min(PROMPT, context - DECODE - 1))
