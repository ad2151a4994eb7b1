"""``muser-kv serve``'s HTTP handler: mlx-lm's ``APIHandler``, refusing up
front what would not run as asked, and saying in a response's headers what
the context policy dropped; and the hub-cache scan ``/v1/models`` makes."""

from __future__ import annotations

import argparse
import logging
import sys
import types
from typing import Any, Callable, List

from muser_kv.serving.server import mlx_lm_server as mlx
from muser_kv.serving.server.context_fit import LastRequest
from muser_kv.serving.server.request_checks import RequestRefused, check_body

log = logging.getLogger("muser_kv.serving.server.serve")  # serve's: one logger for the server

#: the request each handler thread is answering, as the context policy keeps it
LAST_REQUEST = LastRequest()


def rollback_depth(cli_args: argparse.Namespace) -> int:
    """How deep every cache the server installs with a draft model rolls back
    exactly: ``--retain``, raised to ``--num-draft-tokens`` (``MuseModelProvider``)."""
    return max(cli_args.retain, cli_args.num_draft_tokens)


class MuseAPIHandler(mlx.server.APIHandler):
    """mlx-lm's handler, refusing up front what would not run as asked: a body
    field of the wrong type (``check_body``), and a speculative request whose
    ``num_draft_tokens`` exceeds ``rollback_depth`` (it would fail at its first
    deep rollback, mid-request). mlx-lm answers a refusal here as any invalid
    parameter, HTTP 400 with one line; a ``RequestRefused`` from ``generate``
    (``admit``) gets 400 too, where mlx-lm answers 404 to whatever it raises."""

    def validate_model_parameters(self) -> None:
        check_body(self.body, chat=self.path != "/v1/completions")
        super().validate_model_parameters()
        if self.stream_options is not None:  # mlx-lm reads the key, absent or not
            self.stream_options = {"include_usage": False, **self.stream_options}
        cli = self.response_generator.model_provider.cli_args
        drafting = cli.draft_model is not None or self.requested_draft_model != "default_model"
        depth = rollback_depth(cli)
        if drafting and self.num_draft_tokens > depth:
            raise ValueError(
                f"num_draft_tokens must be at most {depth}: muser-kv's caches roll back "
                f"exactly {depth} rows (the server's --retain / --num-draft-tokens), got "
                f"{self.num_draft_tokens}")

    def handle_completion(self, request: Any, stop_words: List[str]) -> None:
        """mlx-lm's. A client that goes away mid-response ends it without a
        traceback: mlx-lm's handler stops the request's generation on its way
        out, and the generation thread logs the one line (``_abandoned``)."""
        LAST_REQUEST.request = None  # this thread's last request (a kept-alive connection's)
        try:
            super().handle_completion(request, stop_words)
        except ConnectionError as e:
            self.close_connection = True
            log.debug("muser-kv serve: the client went away (%s)", e)

    def _set_completion_headers(self, status_code: int = 200) -> None:
        # mlx-lm's handle_completion answers what generate() raises with 404,
        # from inside its except block: a refusal there is the client's error
        if status_code == 404 and isinstance(sys.exc_info()[1], RequestRefused):
            status_code = 400
        super()._set_completion_headers(status_code)
        self._fit_headers(status_code)

    def _set_stream_headers(self, status_code: int = 200) -> None:
        super()._set_stream_headers(status_code)
        self._fit_headers(status_code)

    def _fit_headers(self, status_code: int) -> None:
        """What the context policy did to the request answered (``context_fit``)."""
        request = LAST_REQUEST.request
        fit = request.fit if request is not None else None
        if status_code == 200 and fit is not None:
            for name, value in fit.headers().items():
                self.send_header(name, value)


def hub_cache_scan(scan: Callable[..., Any]) -> Callable[..., Any]:
    """``scan_cache_dir`` as mlx-lm's ``/v1/models`` calls it, after it has
    sent its 200: a hub cache that cannot be scanned (none at all, the usual
    case for a server of a local model directory; a file; unreadable) is one
    with no models, so the answer still lists the served model."""
    from huggingface_hub import CacheNotFound

    def scan_or_nothing(*args: Any, **kwargs: Any) -> Any:
        try:
            return scan(*args, **kwargs)
        except CacheNotFound:  # no hub cache: nothing downloaded to list
            pass
        except Exception as e:
            log.warning("muser-kv serve: /v1/models lists no hub models: the hub cache "
                        "cannot be scanned (%s)", e)
        return types.SimpleNamespace(repos=frozenset())  # what mlx-lm reads of a scan
    return scan_or_nothing
