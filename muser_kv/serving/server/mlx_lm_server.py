"""Every mlx-lm internal ``muser-kv serve`` relies on, named here and nowhere else.

``muser-kv serve`` is mlx-lm's server (``mlx_lm.server``, written against
0.32.2) with a few of its parts replaced. That reaches past mlx-lm's public
surface in three ways, each listed in ``REQUIRED``:

* module globals of ``mlx_lm.server`` it substitutes while it runs
  (``SUBSTITUTED``, through ``substituted``);
* members of mlx-lm's classes it overrides and calls through ``super()``,
  with their parameters (``ModelProvider._load``, ``ResponseGenerator._tokenize``
  and ``_next_request``, ``APIHandler._set_*_headers``, ``PromptTrie.add``,
  ``BatchGenerator.next``, every ``__init__``, ...), or whose state it
  reads: ``ModelProvider``'s path maps (``model_key_for``), a
  ``GenerationContext``'s ``_should_stop`` (``stopped``), the tries under
  ``LRUPromptCache`` (``ExactPromptCache``), a ``BatchGenerator``'s decode
  batch and the step it has queued (``generation_batch``, ``queued_step``);
* private functions of ``mlx_lm.utils`` it calls (``config_dir``,
  ``model_classes``).

The other serving modules read these through this module's names only; the
members they override are named here too. At import, a member that is gone,
a callable whose parameters changed, or an instance attribute its class's
``__init__`` no longer sets raises ``ImportError`` naming it (``require``), so
another mlx-lm fails when serve starts, not mid-request.
"""

from __future__ import annotations

import contextlib
import http.server
import inspect
import re
import socketserver
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import mlx_lm.server as server
from mlx_lm import utils
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models import cache

#: what ``substituted`` replaces in ``mlx_lm.server`` while ``muser-kv serve`` runs
SUBSTITUTED = ("argparse", "ModelProvider", "LRUPromptCache", "ResponseGenerator",
               "_run_http_server", "scan_cache_dir", "BatchGenerator")


@dataclass(frozen=True)
class Member:
    """One mlx-lm member serve relies on. ``params``: a callable's parameters,
    in order, as serve calls or overrides it (``None``: not a callable, or its
    parameters unchecked). ``instance``: an attribute that ``owner.__init__``
    sets on each instance rather than one of the class."""

    owner: Any
    name: str
    params: Optional[Tuple[str, ...]] = None
    instance: bool = False

    @property
    def qualname(self) -> str:
        return f"{getattr(self.owner, '__module__', '')}.{self.owner.__name__}.{self.name}" \
            if isinstance(self.owner, type) else f"{self.owner.__name__}.{self.name}"

    def problem(self) -> Optional[str]:
        """What is wrong with this member in the installed mlx-lm; ``None`` if nothing."""
        if self.instance:
            return self._instance_problem()
        if not hasattr(self.owner, self.name):
            return f"{self.qualname} is gone"
        if self.params is None:
            return None
        value = getattr(self.owner, self.name)
        if not callable(value):
            return f"{self.qualname} is no longer callable"
        try:
            have = tuple(inspect.signature(value).parameters)
        except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
            return None
        if have[:len(self.params)] != self.params:
            return f"{self.qualname} takes ({', '.join(have)}), serve expects ({', '.join(self.params)})"
        return None

    def _instance_problem(self) -> Optional[str]:
        try:
            source = inspect.getsource(self.owner.__init__)
        except (OSError, TypeError):  # no source installed: only a run can tell
            return None
        if not re.search(rf"\bself\.{re.escape(self.name)}\s*(?::[^=]*)?=(?!=)", source):
            return f"{self.qualname} is no longer set by {self.owner.__name__}.__init__"
        return None


#: every mlx-lm internal the serving modules touch (the module doc's three kinds)
REQUIRED: Tuple[Member, ...] = (
    # substituted module globals, and what the substitutes call
    Member(server, "argparse"),
    Member(server, "ModelProvider"),
    Member(server, "LRUPromptCache"),
    Member(server, "ResponseGenerator"),
    Member(server, "_run_http_server",
           ("host", "port", "response_generator", "server_class", "handler_class")),
    Member(server, "scan_cache_dir", ()),
    Member(server, "main", ()),
    Member(server, "run", ("host", "port", "model_provider")),
    Member(server, "APIHandler"),
    Member(server, "ThreadingHTTPServer"),
    Member(server, "GenerationContext"),
    Member(server, "Response"),
    Member(server, "CompletionRequest"),
    Member(server, "BatchGenerator"),
    # ModelProvider: the load serve wraps, the maps it reads
    Member(server.ModelProvider, "__init__", ("self", "cli_args")),
    Member(server.ModelProvider, "_load", ("self", "model_path", "adapter_path", "draft_model_path")),
    Member(server.ModelProvider, "reset", ("self",)),
    Member(server.ModelProvider, "_model_map", instance=True),
    Member(server.ModelProvider, "_adapter_map", instance=True),
    Member(server.ModelProvider, "_draft_model_map", instance=True),
    # ResponseGenerator: the generation thread's steps serve overrides
    Member(server.ResponseGenerator, "__init__", ("self", "model_provider", "prompt_cache")),
    Member(server.ResponseGenerator, "_tokenize", ("self", "tokenizer", "request", "args")),
    Member(server.ResponseGenerator, "_next_request", ("self", "timeout")),
    Member(server.ResponseGenerator, "generate",
           ("self", "request", "generation_args", "progress_callback")),
    Member(server.ResponseGenerator, "is_healthy"),
    Member(server.ResponseGenerator, "stop_and_join", ("self",)),
    Member(server.ResponseGenerator, "_await_response", ("self", "response_queue")),
    Member(server.ResponseGenerator, "_time_budget", instance=True),
    Member(server.ResponseGenerator, "requests", instance=True),
    Member(server.GenerationContext, "_should_stop"),
    Member(server.GenerationContext, "stop", ("self",)),
    Member(server.ResponseGenerator, "_serve_single", ("self", "request", "stream")),
    # BatchGenerator (scheduler.ServeBatchGenerator): the step it overrides,
    # the settings it holds per step, the decode batch and its queued step,
    # whose rows are the responses' log-probabilities in order
    Member(BatchGenerator, "__init__",
           ("self", "model", "max_tokens", "stop_tokens", "sampler", "logits_processors",
            "completion_batch_size", "prefill_batch_size", "prefill_step_size", "max_kv_size",
            "stream")),
    Member(BatchGenerator, "next", ("self",)),
    Member(BatchGenerator, "stream"),
    Member(BatchGenerator, "prefill_batch_size", instance=True),
    Member(BatchGenerator, "prefill_step_size", instance=True),
    Member(BatchGenerator, "_generation_batch", instance=True),
    Member(GenerationBatch, "next", ("self",)),
    Member(GenerationBatch, "_next_tokens", instance=True),
    Member(GenerationBatch, "_next_logprobs", instance=True),
    # APIHandler: the checks and headers serve extends
    Member(server.APIHandler, "validate_model_parameters", ("self",)),
    Member(server.APIHandler, "handle_completion", ("self", "request", "stop_words")),
    Member(server.APIHandler, "_set_completion_headers", ("self", "status_code")),
    Member(server.APIHandler, "_set_stream_headers", ("self", "status_code")),
    Member(server.APIHandler, "_set_cors_headers", ("self",)),
    Member(server.APIHandler, "do_POST", ("self",)),
    Member(server.APIHandler, "do_GET", ("self",)),
    # the standard library's handler members MuseAPIHandler overrides (mlx-lm's
    # APIHandler is a BaseHTTPRequestHandler): its connection's timeout, set-up
    # and tear-down, each request, each status line
    Member(socketserver.StreamRequestHandler, "timeout"),
    Member(socketserver.StreamRequestHandler, "setup", ("self",)),
    Member(socketserver.StreamRequestHandler, "finish", ("self",)),
    Member(http.server.BaseHTTPRequestHandler, "handle_one_request", ("self",)),
    Member(http.server.BaseHTTPRequestHandler, "send_response", ("self", "code", "message")),
    Member(http.server.BaseHTTPRequestHandler, "end_headers", ("self",)),
    # the prompt cache ExactPromptCache extends; the trie ExactPromptTrie
    # extends; the result its search builds, field by field in this order
    Member(cache, "LRUPromptCache"),
    Member(cache, "PromptTrie"),
    Member(cache, "PromptTrieResult", ("model", "exact", "shorter", "longer", "common_prefix")),
    Member(cache.LRUPromptCache, "__init__", ("self", "max_size", "max_bytes")),
    Member(cache.PromptTrie, "__init__", ("self",)),
    Member(cache.LRUPromptCache, "_trie", instance=True),
    Member(cache.PromptTrie, "_trie", instance=True),
    Member(cache.LRUPromptCache, "fetch_nearest_cache", ("self", "model", "tokens")),
    Member(cache.LRUPromptCache, "insert_cache", ("self", "model", "tokens", "prompt_cache")),
    Member(cache.PromptTrie, "add", ("self", "model", "tokens", "value")),
    Member(cache.PromptTrie, "get", ("self", "model", "tokens")),
    Member(cache.PromptTrie, "pop", ("self", "model", "tokens")),
    Member(cache.PromptTrie, "search", ("self", "model", "tokens")),
    Member(cache.PromptTrie, "pop_prefixes", ("self", "model", "tokens")),
    # mlx_lm.utils: a model's config and classes, before any weights
    Member(utils, "_download", ("path_or_hf_repo", "revision", "allow_patterns")),
    Member(utils, "_get_classes", ("config",)),
    Member(utils, "load_config", ("model_path",)),
)


def problems(members: Tuple[Member, ...] = REQUIRED) -> List[str]:
    """One line per member the installed mlx-lm no longer has as serve uses it."""
    return [p for p in (m.problem() for m in members) if p is not None]


def require(members: Tuple[Member, ...] = REQUIRED) -> None:
    """Raise ``ImportError`` naming every member of ``members`` the installed
    mlx-lm no longer has as serve uses it (``problems``)."""
    found = problems(members)
    if found:
        raise ImportError(f"muser-kv serve wraps mlx-lm 0.32.2's server; this mlx-lm "
                          f"({getattr(server, '__version__', '?')}) differs: " + "; ".join(found))


require()


# -- the internals, under the names the serving modules use --------------------


def config_dir(path: str) -> Path:
    """The local directory of ``path``'s ``*.json`` (downloaded if it is a hub
    repository): ``mlx_lm.utils._download``."""
    return utils._download(path, allow_patterns=["*.json"])


def model_classes(config: Dict[str, Any]) -> Tuple[Any, Any]:
    """The model class and its args class for ``config``: ``mlx_lm.utils._get_classes``."""
    return utils._get_classes(config)


def load_config(path: Any) -> Dict[str, Any]:
    return utils.load_config(path)


def model_key_for(provider: Any, model_path: str, adapter_path: Optional[str],
                  draft_model_path: str) -> Tuple[Any, Any, Any]:
    """The ``model_key`` ``provider`` (a ``ModelProvider``) gives a request's
    names, through its path maps as its ``load`` does."""
    adapter_path = provider._adapter_map.get(model_path, adapter_path)
    model_path = provider._model_map.get(model_path, model_path)
    draft_model_path = provider._draft_model_map.get(draft_model_path, draft_model_path)
    return (model_path, adapter_path, draft_model_path)





def generation_batch(generator: Any) -> Any:
    """A ``BatchGenerator``'s decode batch (a ``GenerationBatch``)."""
    return generator._generation_batch


def queued_step(batch: Any) -> Tuple[Any, List[Any]]:
    """The decode step a ``GenerationBatch`` has queued and its next ``next``
    returns: its tokens (one array, ``None`` when there are none) and its
    log-probability rows, one per sequence in the batch's order."""
    return batch._next_tokens, batch._next_logprobs


def stopped(ctx: Any) -> bool:
    """Whether a ``GenerationContext``'s handler stopped it (its client went away)."""
    return bool(ctx._should_stop)


def stop(ctx: Any) -> None:
    """Stop a ``GenerationContext``: mlx-lm's generation thread drops its request
    at its next check, as when the handler stops it."""
    ctx.stop()


def set_cors_headers(handler: Any) -> None:
    """An ``APIHandler``'s CORS headers (``--allowed-origins``), on the response it is sending."""
    handler._set_cors_headers()


def set_prompt_trie(prompt_cache: Any, trie: Any) -> None:
    """Give an ``LRUPromptCache`` the trie it keeps its entries in (at its ``__init__``)."""
    prompt_cache._trie = trie


def trie_root(trie: Any, model: Any) -> Dict[Any, Any]:
    """The root node of ``model``'s keys in a ``PromptTrie``."""
    return trie._trie[model]


@contextlib.contextmanager
def substituted(replacements: Dict[str, Any]) -> Iterator[None]:
    """``mlx_lm.server`` with every one of ``SUBSTITUTED`` replaced by
    ``replacements``' value, for the duration of the block, then put back."""
    if set(replacements) != set(SUBSTITUTED):
        raise ValueError(f"substituted replaces exactly {SUBSTITUTED}, got {tuple(replacements)}")
    saved = {name: getattr(server, name) for name in replacements}
    for name, value in replacements.items():
        setattr(server, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(server, name, value)


def run_http_server_with(handler: type, serve: Callable[[Callable[[type], Any], Any], Any]
                         ) -> Callable[..., Any]:
    """mlx-lm's ``_run_http_server``, serving with ``handler`` whatever handler
    class its caller passes, run by ``serve(run, response_generator)``: ``run(
    server_class)`` runs mlx-lm's with that server class until its accept loop
    returns."""
    run_http_server = server._run_http_server

    def run_with_our_handler(host: str, port: int, response_generator: Any,
                             server_class: Any = server.ThreadingHTTPServer,
                             handler_class: Any = None) -> Any:
        return serve(lambda cls: run_http_server(host, port, response_generator, cls, handler),
                     response_generator)
    return run_with_our_handler
