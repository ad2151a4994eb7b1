"""``muser-kv serve``: mlx-lm's HTTP server, with muser-kv's caches.

The server is mlx-lm's own (``mlx_lm.server.main``, 0.32.2): its argument
parser and every flag, its HTTP handler, its batching and its prompt-cache
logic. While it runs, seven names it looks up at run time are substituted
(``substituted``, through ``mlx_lm_server.substituted``), and put back
afterwards:

=====================  ======================================================
``argparse``           the same module, whose ``ArgumentParser`` also takes
                       muser-kv's flags (``--max-context``,
                       ``--context-policy``, ``--context-keep``, ``--retain``,
                       ``--plane-dtype``, ``--sliding-layout``,
                       ``--kv-memory``, ``--kv-store``, ``--kv-store-bytes``,
                       ``--kv-store-memory``, ``--kv-store-checkpoint``,
                       ``--prefill-budget``, ``--cuda-attention``) and refuses
                       ``--kv-bits`` and ``--retain 0`` with a draft model
``ModelProvider``      ``MuseModelProvider``: mlx-lm's loader, then
                       ``muser_kv.install`` on every model it loads, and the
                       loaded model's ``Limits`` published for the handler
``LRUPromptCache``     ``ExactPromptCache`` (``serving.server.prompt_cache``),
                       with a ``KVStore`` attached (the memory tier, and
                       ``--kv-store``'s directory or Redis)
``ResponseGenerator``  ``MuseResponseGenerator``: mlx-lm's generation thread,
                       serving what the context policy keeps of each request
                       (``context_fit``: a chat's oldest whole turns dropped, a
                       raw prompt's middle), and
                       admitting each request where it tokenizes it (``admit``:
                       a prompt that cannot fit is refused, ``max_tokens`` is
                       cut so that no write passes ``max_context``; the
                       prompt's segments cut at its checkpoints), with
                       ``--kv-memory`` taking a request off the queue only
                       while its planes fit the budget (``KVBudget``), and
                       dropping a request whose client went away (closed its
                       connection: ``http.ClientWatch``) when it reaches the
                       queue's head, or at its next prefill chunk or step
                       (``_departed``, ``Answers``, ``Window``); a queued
                       stream is kept alive (``_await_response``)
``_run_http_server``   the same function, serving with ``MuseAPIHandler``
                       (``serving.server.handler``: mlx-lm's handler; a body
                       that cannot be read, a field of the wrong type or not
                       honoured, a model not served, and a request whose
                       ``num_draft_tokens`` is deeper than the caches roll back
                       exactly, are refused before the request is queued, in
                       OpenAI's error shape; a client that goes away
                       mid-response ends it without a traceback; a response's
                       headers say what the context policy dropped; /metrics)
                       on ``http.MuseHTTPServer`` (its connections bounded),
                       drained on SIGTERM or SIGINT (``shutdown``)
``scan_cache_dir``     huggingface_hub's, for ``/v1/models``: a hub cache that
                       cannot be scanned (none, on a machine that serves a
                       model directory) lists no hub models, where mlx-lm's
                       answer would lose its body (``hub_cache_scan``)
``BatchGenerator``     ``ServeBatchGenerator`` (``serving.server.scheduler``):
                       mlx-lm's, whose streamed tokens' log-probabilities
                       are read with their step (not behind the next one),
                       and whose prefill is held to ``--prefill-budget``
                       tokens per decode step
=====================  ======================================================

Everything else is mlx-lm's. The server builds each request's caches with
``make_prompt_cache(model)``, which returns ``model.make_cache()``: the hook
``install`` sets. It batches when the caches have ``merge`` (muser-kv's do:
``muser_kv.batch``), and serves one request at a time otherwise (a draft
model, a request with a seed), with the same caches and prompt cache. Before
the server starts, the ``--model`` config is checked (``check_model``, from
its ``config.json`` and model classes alone). Every mlx-lm internal this
relies on (the substituted names, the private members read, called or
overridden) is named in ``serving.server.mlx_lm_server`` and read through it.

A refusal (``RequestRefused``) is one line with HTTP 400, whether the handler
raises it or the generation thread does; either way the request fails alone
and the server keeps serving. The checks themselves (``check_body``,
``admit``) are in ``serving.server.request_checks``; this module calls them.

Each request's global planes grow with it (``make_prompt_cache``'s default), so
memory follows the chats' lengths. ``--kv-memory BYTES`` bounds it: a request
waits in the queue, in order, until the planes of every admitted sequence and
its own fit (``kv_budget.KVBudget``: every batch slot at the longest sequence's
planes, as mlx-lm's batches hold them), and one whose planes alone exceed the
budget is refused with 400. Prompt-cache entries are evicted, oldest first, to
keep them within what the admitted sequences leave.
"""

from __future__ import annotations

import copy
import functools
import logging
import sys
import time
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

from muser_kv.serving.checkpoints import split_segments
from muser_kv.serving.policy import ContextPolicy
from muser_kv.serving.server import mlx_lm_server as mlx
from muser_kv.serving.server.answers import Answers, Window
from muser_kv.serving.server.context_fit import FittedRequest, fit_request
from muser_kv.serving.server.handler import LAST_REQUEST, MuseAPIHandler, hub_cache_scan
from muser_kv.serving.server.http import DEFAULT_QUEUE_KEEPALIVE, THREAD_CLIENT, ClientGone, ClientWatch, WaitingQueue
from muser_kv.serving.server.kv_budget import KVBudget, KVMemoryExceeded
from muser_kv.serving.server.metrics import Metrics
from muser_kv.serving.server.prompt_cache import ExactPromptCache
from muser_kv.serving.server.provider import (  # noqa: F401  (serve's names)
    MuseModelProvider,
    ServeRefused,
    check_budget,
    check_model,
    sequence_planes,
)
from muser_kv.serving.server.request_checks import Limits, RequestRefused, admit
from muser_kv.serving.server.scheduler import batch_generator
from muser_kv.serving.server.serve_flags import PROG, argparse_with
from muser_kv.serving.server.shutdown import serve_until_drained
from muser_kv.sessions.store import KVStore

log = logging.getLogger(__name__)

#: Landing buffers made per idle wait of the generation thread (its waits are 0.1 s).
IDLE_RESTOCK_BYTES = 64 << 20


def _prepare(store: KVStore, model: Any) -> None:
    """``store.prepare(model)``: a returning chat's first lookup then finds the
    model's fingerprint taken and its reads' buffers made (a failure is a log
    line: the lookups make what they need as they go)."""
    try:
        store.prepare(model)
    except Exception:
        log.exception("muser-kv serve: preparing the KV store for the loaded model failed")


class MuseResponseGenerator(mlx.server.ResponseGenerator):
    """mlx-lm's generation thread, admitting each request (``admit``) where
    mlx-lm tokenizes it: ``_tokenize``, on the batched and the one-at-a-time
    path alike, inside the ``try`` that fails one request alone. There the
    provider's ``limits`` are the model the request runs on. ``generate``, in
    the handler's thread, runs the same check before the request is queued
    when the request is for the model ``limits`` describes (a copy of the
    request, tokenized as mlx-lm will), so a refusal costs the generation
    thread nothing; the generation thread's check holds whatever the handler saw."""

    model_provider: MuseModelProvider
    metrics: Metrics

    @property
    def is_healthy(self) -> bool:
        """``/health``: mlx-lm's (its generation thread is up) and the provider
        ``ready``, so a client or orchestrator that waits for 200 never sends its
        first request into a model load."""
        return bool(super().is_healthy) and self.model_provider.ready

    @property  # type: ignore[override]
    def _time_budget(self) -> Window:
        return self._window

    @_time_budget.setter
    def _time_budget(self, budget: Any) -> None:  # mlx-lm's __init__ sets it
        self._window = Window(budget, cuttable=mx_distributed_size() == 1,
                               waiting=self._request_waiting)

    def _request_waiting(self) -> bool:
        """A request is queued that the generation thread would take now (not
        one held back for ``--kv-memory``, which waits for a sequence to end)."""
        return self._waiting is None and not self.requests.empty()

    def _abandoned(self, tokens: int, max_tokens: int, prefill: Any = None) -> None:
        """A request whose client went away gets no more steps (``Answers``):
        one line, and the batched steps end here so that mlx-lm drops it now."""
        self.metrics.client_gone("prefill" if prefill is not None and tokens == 0
                                 else "generation")
        if prefill is not None and tokens == 0:
            log.warning("muser-kv serve: a request's client went away during its prefill "
                        "(%d of %d prompt tokens); its prefill is stopped", *prefill)
        else:
            log.warning("muser-kv serve: a request's client went away after %d of at most %d "
                        "tokens; its generation is stopped", tokens, max_tokens)
        self._window.cut = True

    def _with_answers(self, item: Any, release: Callable[[], None]) -> Any:
        """``item`` (mlx-lm's queued request) with its response queue as the
        generation thread uses it (``Answers``)."""
        rqueue, request, args = item
        client = getattr(request, "client", None)
        return Answers(rqueue, release, args, self._abandoned, client,
                        single=lambda: self._serving_single), request, args

    def _serve_single(self, request: Any, stream: Any) -> Any:
        """mlx-lm's one-at-a-time path, noted while it runs: there, and only
        there, a prefill report may raise (``Answers``)."""
        self._serving_single = True
        try:
            return super()._serve_single(request, stream)
        finally:
            self._serving_single = False

    def _departed(self, item: Any) -> bool:
        """Whether ``item``'s client closed its connection while the request
        waited in the queue: then it is answered ``ClientGone`` (nobody reads
        it) and never prefilled, and its place in the queue is free."""
        rqueue, request, _ = item
        client = getattr(request, "client", None)
        if client is None or not client.gone():
            return False
        log.warning("muser-kv serve: a request's client went away while it was queued; it "
                    "is dropped before its prefill")
        self.metrics.client_gone("queued")
        rqueue.put(ClientGone("the client went away while its request was queued"))
        return True

    def __init__(self, model_provider: MuseModelProvider, prompt_cache: Any):
        # set before mlx-lm's __init__ starts the generation thread, which reads them
        self._kv_memory: Optional[int] = getattr(model_provider.cli_args, "kv_memory", None)
        self._kv: Optional[KVBudget] = None
        self._waiting: Any = None  # the queue's head, until its planes fit
        self._answers: Dict[int, Answers] = {}
        self._alone: Optional[int] = None  # a request for another model: it runs alone
        self._admissions = 0
        self._one_process = mx_distributed_size() == 1  # ranks must drop the same requests
        self._serving_single = False
        self.metrics = Metrics()  #: what ``/metrics`` answers
        self.metrics.sources.append(self._memory_metrics)
        if self._kv_memory is not None and mx_distributed_size() > 1:
            raise ServeRefused("--kv-memory admits requests on one process; it does not "
                               "run distributed")
        a = model_provider.cli_args
        self._store: Optional[KVStore] = None
        if isinstance(prompt_cache, ExactPromptCache) and (a.kv_store or a.kv_store_memory):
            store = self._store = KVStore(a.kv_store, memory_bytes=a.kv_store_memory,
                                          store_bytes=a.kv_store_bytes)
            prompt_cache.attach(store, self._store_model)
            model_provider.on_load.append(functools.partial(_prepare, store))
        super().__init__(model_provider, prompt_cache)

    def close_store(self) -> None:
        """Write out the KV store's queued writes and close it: the drain's
        last step, after the generation thread has stopped putting."""
        if self._store is not None:
            try:
                self._store.flush()
                self._store.close()
            except Exception:
                log.exception("muser-kv serve: flushing the KV store at shutdown failed")

    def _memory_metrics(self) -> Iterator[Tuple[str, str, str, Any]]:
        """``/metrics``' KV memory and KV store samples, read when scraped."""
        kv = self._kv
        yield ("kv_memory_bytes", "gauge", "KV plane bytes the admitted sequences may hold "
               "(--kv-memory's count; 0 without the flag)", kv.admitted_bytes if kv else 0)
        if self._kv_memory is not None:
            yield ("kv_memory_budget_bytes", "gauge", "--kv-memory", self._kv_memory)
        if self._store is None:
            return
        s = self._store.stats()
        yield ("kv_store_lookups_total", "counter", "KV store lookups", s.lookups)
        yield ("kv_store_hits_total", "counter", "KV store lookups that rebuilt tokens", s.hits)
        yield ("kv_store_misses_total", "counter", "KV store lookups that rebuilt nothing",
               s.lookups - s.hits)
        yield ("kv_store_rebuilt_tokens_total", "counter", "tokens rebuilt from the KV store "
               "instead of prefilled", s.reused_tokens)
        yield ("kv_store_pending_writes", "gauge", "KV store writes queued (write-behind)",
               s.pending_writes)
        for t in s.tiers:
            tier = f'{{tier="{t.name}"}}'
            yield (f"kv_store_tier_bytes{tier}", "gauge", "bytes a KV store tier holds", t.bytes)
            yield (f"kv_store_tier_chunks{tier}", "gauge", "chunks a KV store tier holds",
                   t.chunks)
            yield (f"kv_store_tier_hits_total{tier}", "counter", "chunk reads a tier served",
                   t.hits)
            yield (f"kv_store_tier_misses_total{tier}", "counter", "chunk reads a tier missed",
                   t.misses)

    def _store_model(self, key: Any) -> Any:
        """The model whose lists the store keeps under ``key``: the loaded one,
        with no draft model (a draft's caches ride in the same list)."""
        p = self.model_provider
        if p.model is None or p.draft_model is not None or p.model_key != key:
            return None
        return p.model

    def _limits_for(self, args: Any) -> Optional[Limits]:
        """The loaded model's ``limits`` when the request (``args``) is for it."""
        limits, names = self.model_provider.limits, args.model
        if limits is None or limits.key != self.model_provider.model_key_for(
                names.model, names.adapter, names.draft):
            return None
        return limits

    def _prompt(self, tokenizer: Any, request: Any, args: Any) -> List[int]:
        """``request``'s prompt as mlx-lm tokenizes it (a copy of it), as the
        context policy keeps it (``FittedRequest``)."""
        if not isinstance(request, FittedRequest):
            return list(self._mlx_lm_tokenize(tokenizer, request, args)[0])
        prompt = request.tokenized(
            tokenizer, args, lambda: self._mlx_lm_tokenize(tokenizer, request, args))[0]
        return request.tokens(prompt)

    def _mlx_lm_tokenize(self, tokenizer: Any, request: Any, args: Any) -> Any:
        """mlx-lm's ``_tokenize`` of a copy of ``request`` (mlx-lm converts the
        messages' content in place), leaving ``request`` as it was. What the
        chat template or the tokenizer cannot take is the request's content
        (``chat_template_kwargs`` that collide with mlx-lm's own, messages the
        template refuses): refused, where mlx-lm answers 404."""
        try:
            return super()._tokenize(tokenizer, copy.deepcopy(request), args)
        except RequestRefused:
            raise
        except Exception as e:
            raise RequestRefused(f"the request cannot be rendered and tokenized: "
                                 f"{type(e).__name__}: {e}") from e

    def _settle(self, request: Any, args: Any, tokenizer: Any, max_context: int) -> None:
        """Decide what the context policy keeps of ``request`` (a
        ``FittedRequest`` not fitted yet; ``context_fit``), on the model whose
        ``tokenizer`` and context are given."""
        if isinstance(request, FittedRequest) and request.fit is None:
            cli = self.model_provider.cli_args
            start = time.perf_counter()
            fit = fit_request(
                request, args.max_tokens, max_context,
                ContextPolicy(getattr(cli, "context_policy", "shift")),
                getattr(cli, "context_keep", 0), lambda r: self._prompt(tokenizer, r, args))
            request.settle(fit)
            dropped = (f", {fit.turns_dropped} turns dropped" if fit.turns_dropped else
                       f", {fit.tokens_dropped} tokens dropped" if fit.tokens_dropped else "")
            log.info("muser-kv request: %d prompt tokens, tokenized and fitted in %.3f s "
                     "(tokenizations: %d%s)", fit.prompt_tokens, time.perf_counter() - start,
                     len(request.tokenizations), dropped)

    def _positions(self, request: Any, args: Any) -> Optional[int]:
        """The positions ``request`` may write (its prompt and ``max_tokens``, as
        ``admit`` cuts it), when it is for the model ``limits`` describes (its
        prompt tokenized as mlx-lm will, as the context policy keeps it);
        ``None`` otherwise."""
        limits = self._limits_for(args)
        if limits is None:
            return None
        self._settle(request, args, limits.tokenizer, limits.max_context)
        fit = request.fit if isinstance(request, FittedRequest) else None
        n = fit.prompt_tokens if fit is not None else len(
            self._prompt(limits.tokenizer, request, args))
        return n + admit(limits, n, args)

    def generate(self, request: Any, generation_args: Any,
                 progress_callback: Optional[Callable[[int, int], None]] = None) -> Any:
        """mlx-lm's, for what the context policy keeps of the request
        (``context_fit``; ``LAST_REQUEST`` tells the handler what it dropped),
        refused here, in the handler's thread, when it cannot run as asked."""
        request = LAST_REQUEST.request = FittedRequest.of(request)
        if THREAD_CLIENT.connection is not None and self._one_process:
            request.client = ClientWatch(THREAD_CLIENT.connection)
        positions = self._positions(request, generation_args)
        limits = self.model_provider.limits
        if positions is not None and limits is not None and limits.planes is not None \
                and self._kv_memory is not None:
            try:
                KVBudget(self._kv_memory, limits.planes).check(positions)
            except KVMemoryExceeded as e:
                raise RequestRefused(str(e)) from None
        ctx, answers = super().generate(request, generation_args, progress_callback)
        THREAD_CLIENT.waiting = None  # started: mlx-lm's own keepalive from here
        timer = THREAD_CLIENT.timer
        if timer is None:
            return ctx, answers
        timer.started(len(ctx.prompt))
        return ctx, timer.tokens(answers)

    def _await_response(self, response_queue: Any) -> Any:
        """mlx-lm's wait for a request's next answer (in the handler's thread),
        calling the handler's ``waiting`` every ``--queue-keepalive`` seconds
        while the request waits to start (``THREAD_CLIENT``)."""
        waiting = THREAD_CLIENT.waiting
        if waiting is not None:
            interval = getattr(self.cli_args, "queue_keepalive", DEFAULT_QUEUE_KEEPALIVE)
            response_queue = WaitingQueue(response_queue, waiting, interval)
        return super()._await_response(response_queue)

    def _next_request(self, timeout: Optional[float] = None) -> Any:
        """mlx-lm's next request. An idle wait first restocks the store's landing
        buffers (``_restock``). Under ``--kv-memory`` the queue's head is taken
        only once its planes and those of every admitted sequence fit the budget
        (until then the generation thread serves the batch it has); one whose
        planes alone exceed it is refused. Prompt-cache entries are evicted,
        oldest first, to stay within what the admitted sequences leave."""
        if timeout is not None:  # mlx-lm waits only when it has no batch to run: idle
            self._restock()
        if self._kv_memory is None:
            item = super()._next_request(timeout)
            if item is None or self._departed(item):
                return None
            return self._with_answers(item, lambda: None)
        kv = self._budget()
        if kv is not None:
            for key, answers in list(self._answers.items()):
                if answers.ctx is not None and mlx.stopped(answers.ctx):
                    self._release(key)
            self.prompt_cache.trim_to(n_bytes=kv.budget - kv.admitted_bytes)
        item = self._waiting
        if item is None:
            item = super()._next_request(timeout)
            if item is None:
                return None
        self._waiting = None
        if self._departed(item):
            return None
        rqueue, request, args = item
        try:
            positions = self._positions(request, args)
        except Exception:  # mlx-lm's own tokenization refuses it, in the loop
            return item
        if kv is None or positions is None:
            # another model than the one the budget was sized for: it runs alone
            if self._answers:
                return self._wait(item, timeout)
            return self._admitted(item, kv, None)
        try:
            kv.check(positions)
        except KVMemoryExceeded as e:
            rqueue.put(RequestRefused(str(e)))
            return None
        if self._alone is not None or not kv.fits(positions):
            log.info("muser-kv serve: a request of %d positions waits for KV memory (%d "
                     "sequences hold %d of %d bytes)", positions, len(kv.admitted), kv.admitted_bytes,
                     kv.budget)
            return self._wait(item, timeout)
        self.prompt_cache.trim_to(n_bytes=kv.budget - kv.cost(
            list(kv.admitted.values()) + [positions]))
        return self._admitted(item, kv, positions)

    def _restock(self) -> None:
        """Make ``IDLE_RESTOCK_BYTES`` of the landing buffers the store's lookups
        took, while idle: a request arriving meanwhile shares the CPU with at
        most that much being made."""
        store = getattr(self.prompt_cache, "store", None)
        if store is not None:
            store.restock(IDLE_RESTOCK_BYTES)

    def _budget(self) -> Optional[KVBudget]:
        limits = self.model_provider.limits
        if limits is None or limits.planes is None or self._kv_memory is None:
            return None
        if self._kv is None or self._kv.planes != limits.planes:
            self._kv = KVBudget(self._kv_memory, limits.planes)
        return self._kv

    def _wait(self, item: Any, timeout: Optional[float]) -> Any:
        self._waiting = item
        if timeout:
            time.sleep(min(timeout, 0.01))
        return None

    def _admitted(self, item: Any, kv: Optional[KVBudget], positions: Optional[int]) -> Any:
        self._admissions += 1
        key = self._admissions
        if kv is not None and positions is not None:
            kv.admit(key, positions)
        else:
            self._alone = key
        answered = self._with_answers(item, lambda: self._release(key))
        self._answers[key] = answered[0]
        return answered

    def _release(self, key: int) -> None:
        self._answers.pop(key, None)
        if self._alone == key:
            self._alone = None
        if self._kv is not None:
            self._kv.release(key)

    def _tokenize(self, tokenizer: Any, request: Any, args: Any) -> Any:
        """mlx-lm's, admitting the request, with its segments cut at the prompt's
        checkpoints (``split_segments``) when a store is behind the prompt cache."""
        limits = self.model_provider.limits
        if limits is None:  # pragma: no cover - mlx-lm tokenizes only after a load
            raise RuntimeError("muser-kv serve: a request tokenized with no model loaded")
        # the handler fitted it where the model it runs on was loaded; else here
        self._settle(request, args, tokenizer, limits.max_context)
        if isinstance(request, FittedRequest):  # what the handler's fit tokenized, if it did
            tokenized = request.tokenized(
                tokenizer, args, lambda: self._mlx_lm_tokenize(tokenizer, request, args))
        else:
            tokenized = super()._tokenize(tokenizer, request, args)
        if isinstance(request, FittedRequest) and request.fit and request.fit.tokens_dropped:
            prompt = request.tokens(tokenized[0])  # a raw prompt's middle left out
            tokenized = (prompt, [prompt], *tokenized[2:])
        args.max_tokens = admit(limits, len(tokenized[0]), args)
        interval = getattr(self.model_provider.cli_args, "kv_store_checkpoint", 0)
        if interval and getattr(self.prompt_cache, "store", None) is not None:
            prompt, segments, types, *rest = tokenized
            segments, types = split_segments(segments, types, interval)
            tokenized = (prompt, segments, types, *rest)
        return tokenized


def mx_distributed_size() -> int:
    import mlx.core as mx

    return mx.distributed.init().size()


def substituted(argv: Sequence[str]) -> ContextManager[None]:
    """``mlx_lm.server`` with ``mlx_lm_server.SUBSTITUTED`` replaced (module
    doc), for the duration of the block."""
    flags = argparse_with(argv)
    return mlx.substituted({
        "argparse": flags, "BatchGenerator": batch_generator(lambda: flags.parsed),
        "ModelProvider": MuseModelProvider,
        "LRUPromptCache": ExactPromptCache, "ResponseGenerator": MuseResponseGenerator,
        "_run_http_server": mlx.run_http_server_with(MuseAPIHandler, serve_until_drained),
        "scan_cache_dir": hub_cache_scan(mlx.server.scan_cache_dir)})


def main(argv: Optional[List[str]] = None) -> int:
    """Run mlx-lm's server with muser-kv's caches until interrupted; 2 (one
    line on stderr) when it cannot start."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        with substituted(argv):
            mlx.server.main()
    except ServeRefused as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
