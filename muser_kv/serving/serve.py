"""``muser-kv serve``: mlx-lm's HTTP server, with muser-kv's caches.

The server is mlx-lm's own (``mlx_lm.server.main``, 0.32.2): its argument
parser and every flag, its HTTP handler, its batching and its prompt-cache
logic. While it runs, four names it looks up at run time are substituted,
here and nowhere else (``substituted``), and put back afterwards:

==================  =========================================================
``argparse``        the same module, whose ``ArgumentParser`` also takes
                    muser-kv's flags (``--max-context``, ``--retain``,
                    ``--plane-dtype``) and refuses ``--kv-bits`` and
                    ``--retain 0`` with a draft model
``ModelProvider``   ``MuseModelProvider``: mlx-lm's loader, then
                    ``muser_kv.install`` on every model it loads
``LRUPromptCache``  ``ExactPromptCache`` (``muser_kv.prompt_cache``)
``_run_http_server`` the same function, serving with ``MuseAPIHandler``
                    (mlx-lm's handler; a request whose ``num_draft_tokens``
                    is deeper than the caches roll back exactly is refused
                    with 400 before it runs)
==================  =========================================================

Everything else is mlx-lm's. The server builds each request's caches with
``make_prompt_cache(model)``, which returns ``model.make_cache()``: the hook
``install`` sets. It batches when the caches have ``merge`` (muser-kv's do:
``muser_kv.batch``), and serves one request at a time otherwise (a draft
model, a request with a seed), with the same caches and prompt cache. Before
the server starts, the ``--model`` config is checked (``check_model``, through
mlx-lm 0.32.2's private ``mlx_lm.utils._download`` and ``_get_classes``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import types
from typing import Any, Iterable, Iterator, List, Optional, Sequence

import mlx_lm.server as server

from muser_kv.caches.growing import GlobalKVCache
from muser_kv.caches.sliding import SlidingKVCache
from muser_kv.caches.speculative import DEFAULT_RETAIN
from muser_kv.core.geometry import MuseGeometry, UnsupportedModel
from muser_kv.serving.install import install
from muser_kv.serving.prompt_cache import ExactPromptCache

log = logging.getLogger(__name__)

PROG = "muser-kv serve"

#: what ``substituted`` replaces in ``mlx_lm.server``; a server without them is
#: not the one this module was written against
SUBSTITUTED = ("argparse", "ModelProvider", "LRUPromptCache", "_run_http_server")

for _name in SUBSTITUTED + ("main", "APIHandler", "ThreadingHTTPServer"):
    if not hasattr(server, _name):  # pragma: no cover - another mlx-lm
        raise ImportError(f"muser-kv serve wraps mlx-lm 0.32.2's server; mlx_lm.server has no "
                          f"{_name!r} (mlx-lm {getattr(server, '__version__', '?')})")


class ServeRefused(Exception):
    """The server cannot start with these arguments (one line says why)."""


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """muser-kv's flags, as one group of the server's parser."""
    g = parser.add_argument_group("muser-kv caches")
    g.add_argument("--max-context", type=_positive, default=None,
                   help="positions each sequence's caches hold, preallocated (default: the "
                        "model's max_position_embeddings); every prompt-cache entry holds "
                        "this many rows per global layer")
    g.add_argument("--retain", type=_non_negative, default=DEFAULT_RETAIN,
                   help="overwritten rows each sliding ring keeps: how many tokens a cache "
                        "past the wrap can trim exactly, for prompt-cache reuse and "
                        f"speculative rollback (default {DEFAULT_RETAIN}; raised to "
                        "--num-draft-tokens when a draft model is loaded; 0: none)")
    g.add_argument("--plane-dtype", choices=("float16", "bfloat16"), default=None,
                   help="the planes' dtype (default: the model's attention dtype, bf16 for a "
                        "bf16 model, else f16)")


def _check_arguments(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    if ns.draft_model is not None and ns.retain == 0:
        parser.error("--retain 0 keeps no overwritten rows, so no speculative rollback past the "
                     "wrap is exact; a --draft-model needs --retain >= --num-draft-tokens "
                     f"({ns.num_draft_tokens})")
    if ns.kv_bits is not None:
        parser.error("--kv-bits quantizes the KV cache through mlx-lm's to_quantized; "
                     "muser-kv's planes are exact f16/bf16 and are never quantized (mlx-lm's "
                     "own Muse Glimmer caches refuse it too: RotatingKVCache.to_quantized is "
                     "not implemented)")


def _argparse_with(argv: Sequence[str]) -> types.ModuleType:
    """``argparse``, whose ``ArgumentParser`` is the server's parser with
    muser-kv's flags added, reading ``argv`` (not ``sys.argv``)."""

    class ArgumentParser(argparse.ArgumentParser):
        def __init__(self, *args: Any, **kwargs: Any):
            kwargs["prog"] = PROG
            kwargs["description"] = ("mlx-lm's HTTP server (mlx_lm.server: the same flags) with "
                                     "muser-kv's exact, preallocated KV caches")
            super().__init__(*args, **kwargs)
            self._muser_kv = False

        def parse_args(self, args: Optional[Iterable[str]] = None, namespace: Any = None) -> Any:
            if not self._muser_kv:  # after mlx-lm's own flags, so --help lists them last
                add_arguments(self)
                self._muser_kv = True
            ns = super().parse_args(list(argv) if args is None else args, namespace)
            _check_arguments(self, ns)
            return ns

    module = types.ModuleType("argparse")
    module.__dict__.update(argparse.__dict__, ArgumentParser=ArgumentParser)
    return module


def check_model(path: str, max_context: Optional[int]) -> Optional[MuseGeometry]:
    """The geometry muser-kv would give the model at ``path``, from its
    ``config.json`` alone (no weights read), so the server refuses a model it
    cannot serve before it starts rather than in its generation thread. Raises
    ``ServeRefused`` naming what is missing; ``None`` for a custom architecture
    (``model_file``), which only its load can tell."""
    from mlx_lm.utils import _download, _get_classes, load_config

    try:
        config = load_config(_download(path, allow_patterns=["*.json"]))
        if config.get("model_file"):
            return None
        _, args_class = _get_classes(config)
        return MuseGeometry.from_model_args(args_class.from_dict(config), max_context)
    except Exception as e:  # whatever it is, mlx-lm's load would not serve it either
        raise ServeRefused(f"{path}: {e}") from e


class MuseModelProvider(server.ModelProvider):
    """mlx-lm's ``ModelProvider``: every model it loads gets muser-kv's caches
    (``install``). The model must be Muse-shaped (``UnsupportedModel``
    otherwise, and the load is undone). A draft model that is Muse-shaped
    gets them too, one that is not keeps mlx-lm's: the target model verifies
    every drafted token, so a draft's caches decide only how many are accepted.
    When a draft model is loaded, ``retain`` is raised to ``--num-draft-tokens``
    so every rollback ``speculative_generate_step`` asks for is exact."""

    def __init__(self, cli_args: argparse.Namespace):
        super().__init__(cli_args)
        if cli_args.model is not None:
            check_model(cli_args.model, cli_args.max_context)

    def _install(self, model: Any, drafts: Optional[int]) -> Any:
        a = self.cli_args
        return install(model, max_context=a.max_context, retain=a.retain,
                       plane_dtype=a.plane_dtype, num_draft_tokens=drafts)

    def _load(self, model_path: str, adapter_path: Optional[str] = None,
              draft_model_path: Optional[str] = None) -> None:
        super()._load(model_path, adapter_path, draft_model_path)
        try:
            drafts = self.cli_args.num_draft_tokens if self.draft_model is not None else None
            self._install(self.model, drafts)
            if self.draft_model is not None:
                try:
                    self._install(self.draft_model, drafts)
                except UnsupportedModel as e:
                    log.info("muser-kv serve: the draft model keeps mlx-lm's caches (%s)", e)
        except Exception:
            self.reset()  # no model is left serving without muser-kv's caches
            raise
        # mlx-lm decided batchability on its own caches; these are muser-kv's,
        # which all merge (muser_kv.batch): mlx-lm's other rule, no draft model,
        # is what remains. Decided without building a cache (its planes are
        # preallocated: at 131k a cache list is 1.8 GB).
        self.is_batchable = self.draft_model is None and all(
            hasattr(cls, "merge") for cls in (SlidingKVCache, GlobalKVCache))


def rollback_depth(cli_args: argparse.Namespace) -> int:
    """How deep every cache the server installs with a draft model rolls back
    exactly: ``--retain``, raised to ``--num-draft-tokens`` (``MuseModelProvider``)."""
    return max(cli_args.retain, cli_args.num_draft_tokens)


class MuseAPIHandler(server.APIHandler):
    """mlx-lm's handler, refusing up front what muser-kv's caches cannot do
    exactly: a speculative request whose ``num_draft_tokens`` exceeds
    ``rollback_depth`` would fail at its first deep rollback, mid-request.
    mlx-lm answers a refusal here as any invalid parameter: HTTP 400, one line."""

    def validate_model_parameters(self) -> None:
        super().validate_model_parameters()
        cli = self.response_generator.model_provider.cli_args
        drafting = cli.draft_model is not None or self.requested_draft_model != "default_model"
        depth = rollback_depth(cli)
        if drafting and self.num_draft_tokens > depth:
            raise ValueError(
                f"num_draft_tokens must be at most {depth}: muser-kv's caches roll back "
                f"exactly {depth} rows (the server's --retain / --num-draft-tokens), got "
                f"{self.num_draft_tokens}")


def _serving_with(run_http_server: Any) -> Any:
    def run_with_our_handler(host: str, port: int, response_generator: Any,
                             server_class: Any = server.ThreadingHTTPServer,
                             handler_class: Any = None) -> Any:
        return run_http_server(host, port, response_generator, server_class, MuseAPIHandler)
    return run_with_our_handler


@contextlib.contextmanager
def substituted(argv: Sequence[str]) -> Iterator[None]:
    """``mlx_lm.server`` with ``SUBSTITUTED`` replaced (module doc), for the
    duration of the block."""
    replacements = {"argparse": _argparse_with(argv), "ModelProvider": MuseModelProvider,
                    "LRUPromptCache": ExactPromptCache,
                    "_run_http_server": _serving_with(server._run_http_server)}
    saved = {name: getattr(server, name) for name in replacements}
    for name, value in replacements.items():
        setattr(server, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(server, name, value)


def main(argv: Optional[List[str]] = None) -> int:
    """Run mlx-lm's server with muser-kv's caches until interrupted; 2 (one
    line on stderr) when it cannot start."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        with substituted(argv):
            server.main()
    except ServeRefused as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
