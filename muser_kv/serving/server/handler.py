"""``muser-kv serve``'s HTTP handler: mlx-lm's ``APIHandler``, refusing up
front what would not run as asked, answering every refusal in OpenAI's error
shape (``errors``), and saying in a response's headers what the context
policy dropped; and the hub-cache scan ``/v1/models`` makes."""

from __future__ import annotations

import argparse
import io
import logging
import socket
import sys
import types
from pathlib import Path
from typing import Any, Callable, List, Optional

from muser_kv.serving.server import mlx_lm_server as mlx
from muser_kv.serving.server.body import DEFAULT_MAX_BODY_BYTES, read_body
from muser_kv.serving.server.context_fit import LastRequest
from muser_kv.serving.server.errors import error_body, error_event, raw_response
from muser_kv.serving.server.http import THREAD_CLIENT, Wire
from muser_kv.serving.server.metrics import Metrics
from muser_kv.serving.server.request_checks import RequestRefused, check_body

log = logging.getLogger("muser_kv.serving.server.serve")  # serve's: one logger for the server

#: the request each handler thread is answering, as the context policy keeps it
LAST_REQUEST = LastRequest()


def rollback_depth(cli_args: argparse.Namespace) -> int:
    """How deep every cache the server installs with a draft model rolls back
    exactly: ``--retain``, raised to ``--num-draft-tokens`` (``MuseModelProvider``)."""
    return max(cli_args.retain, cli_args.num_draft_tokens)


#: the paths mlx-lm's ``do_POST`` answers (others get its 404)
POST_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
SHUTTING_DOWN = "this server is shutting down"


class MuseAPIHandler(mlx.server.APIHandler):
    """mlx-lm's handler, refusing up front what would not run as asked: a body
    that cannot be read as a JSON object (``read_body``: its length, encoding,
    JSON, nesting, Unicode), a body field of the wrong type or one serve does
    not honour (``check_body``), a model other than the served one unless the
    operator allows loading others (``check_model_names``), and a speculative
    request whose ``num_draft_tokens`` exceeds ``rollback_depth`` (it would
    fail at its first deep rollback, mid-request).

    Every error is answered in OpenAI's shape (``answer_error``), mlx-lm's own
    included: they pass through ``_set_completion_headers``, which answers in
    full and mutes mlx-lm's own body that follows. A ``RequestRefused`` gets
    its status (400 unless it says otherwise), where mlx-lm answers 404 to
    whatever ``generate`` raises.

    The connection is the server's (``http.MuseHTTPServer``): it closes an
    idle or half-sent one after its ``timeout``, and knows this handler while
    it serves, so that the drain can end its response (``cut_off``). A stream
    that waits to start is kept alive (``_queued``)."""

    @property
    def timeout(self) -> Optional[float]:  # type: ignore[override]
        """The socket timeout ``StreamRequestHandler.setup`` sets: the server's
        ``--connection-timeout``."""
        limits = getattr(self.server, "limits", None)
        return limits.timeout if limits is not None else None

    def setup(self) -> None:
        super().setup()
        self.wfile: Any = Wire(self.wfile)
        self._streaming = False
        self.in_request = False  #: a whole request read, its answer not finished
        opened = getattr(self.server, "opened", None)
        if opened is not None:
            opened(self)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            closed = getattr(self.server, "closed", None)
            if closed is not None:
                closed(self)

    def do_POST(self) -> None:
        """mlx-lm's, given a body ``read_body`` has read and checked: a body it
        refuses is answered here, before any of mlx-lm's handler runs."""
        try:
            self._post()
        finally:
            self.in_request = False

    def _post(self) -> None:
        if self.path not in POST_PATHS:
            return super().do_POST()  # mlx-lm's 404, answered in OpenAI's shape
        limit = getattr(self.response_generator.cli_args, "max_body_bytes", DEFAULT_MAX_BODY_BYTES)
        try:
            raw, _ = read_body(self.headers, self.rfile, limit)
        except RequestRefused as e:
            self.close_connection = True
            if e.status == 408:
                count = getattr(self.server, "count_timeout", None)
                if count is not None:
                    count()
            self.answer_error(e.status, str(e), e.code)
            return None
        connection = self.rfile
        self.rfile = io.BytesIO(raw)  # mlx-lm reads Content-Length bytes from it
        self.in_request = True
        try:
            return super().do_POST()
        finally:
            self.rfile = connection

    def answer_error(self, status: int, message: str, code: Optional[str] = None) -> None:
        """Answer this request with HTTP ``status`` and OpenAI's error body,
        whole; what mlx-lm writes after it for the same error goes nowhere."""
        if getattr(self, "_answered", False):
            return
        self._answered = True
        if self._streaming:  # a queued stream's headers are sent: the error is an event
            self.wfile.write(error_event(message, code, status))
            self.wfile.flush()
            self.wfile.mute()
            return
        body = error_body(status, message, code)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        mlx.set_cors_headers(self)
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        self.wfile.mute()

    @property
    def metrics(self) -> Metrics:
        """The server's counters (``MuseResponseGenerator.metrics``)."""
        generator: Any = self.response_generator
        return generator.metrics

    def send_response(self, code: int, message: Optional[str] = None) -> None:
        """``BaseHTTPRequestHandler``'s, counted (``/metrics``)."""
        self.metrics.response(self.path, code)
        super().send_response(code, message)

    def do_GET(self) -> None:
        """mlx-lm's, and ``/metrics`` (Prometheus' text format)."""
        if self.path.split("?")[0] != "/metrics":
            return super().do_GET()
        body = self.metrics.render().encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        return None

    def handle_one_request(self) -> None:
        self._answered = False  # each request of a kept-alive connection
        super().handle_one_request()

    def check_model_names(self) -> None:
        """A request may name only the served model (``--model``, as given or
        resolved, as ``/v1/models`` lists it), its ``--adapter-path`` and
        ``--draft-model``: mlx-lm's server loads any path a request names (a
        model, an adapter, a draft), which an operator must allow
        (``--allow-model-loading``; a server started without ``--model`` loads
        what requests name). A name of the served model is served as mlx-lm's
        default, so it never reloads the model under another key."""
        cli = self.response_generator.cli_args
        if cli.model is None or getattr(cli, "allow_model_loading", False):
            return
        served = {"default_model", cli.model, str(Path(cli.model).resolve())}
        allow = "; --allow-model-loading lets requests load other models"
        model = self.body.get("model", "default_model")
        if model not in served:
            raise RequestRefused(f"model {model!r} is not served here: this server serves "
                                 f"{cli.model} (--model){allow}", status=404,
                                 code="model_not_found")
        adapters = self.body.get("adapters")
        if adapters is not None and adapters != cli.adapter_path:
            raise RequestRefused(f"adapters {adapters!r} are not served here: this server "
                                 f"serves adapters {cli.adapter_path} (--adapter-path){allow}",
                                 status=404, code="model_not_found")
        draft = self.body.get("draft_model", "default_model")
        if draft not in ("default_model", cli.draft_model):
            raise RequestRefused(f"draft_model {draft!r} is not served here: this server "
                                 f"drafts with {cli.draft_model} (--draft-model){allow}",
                                 status=404, code="model_not_found")
        self.requested_model, self.adapter = "default_model", None

    def validate_model_parameters(self) -> None:
        check_body(self.body, chat=self.path != "/v1/completions")
        self.check_model_names()
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
        THREAD_CLIENT.connection = self.connection
        timer = THREAD_CLIENT.timer = self.metrics.request()
        THREAD_CLIENT.waiting = self._queued if self.stream else None
        try:
            super().handle_completion(request, stop_words)
        except (ConnectionError, TimeoutError) as e:
            self.close_connection = True
            log.debug("muser-kv serve: the client went away (%s)", e)
        finally:
            timer.done()
            THREAD_CLIENT.connection = THREAD_CLIENT.timer = THREAD_CLIENT.waiting = None

    def _set_completion_headers(self, status_code: int = 200) -> None:
        """mlx-lm's, except for an error (``/health``'s 503 aside, which is
        its answer): that is answered whole here, in OpenAI's shape, with the
        exception being handled as its message (mlx-lm calls this from inside
        its ``except`` blocks) and its status where it is a ``RequestRefused``."""
        if status_code >= 400 and self.path != "/health":
            error = sys.exc_info()[1]
            if isinstance(error, RequestRefused):
                self.answer_error(error.status, str(error), error.code)
            elif error is not None:
                self.answer_error(status_code, str(error))
            else:
                self.answer_error(status_code, f"{self.command} {self.path} is not an "
                                               "endpoint of this server")
            return
        super()._set_completion_headers(status_code)
        self._fit_headers(status_code)

    def _set_stream_headers(self, status_code: int = 200) -> None:
        """mlx-lm's, once: a stream that waited in the queue had them sent
        (``_queued``), and mlx-lm's ``end_headers`` after this call is skipped."""
        if self._streaming:
            self._headers_sent_early = True
            return
        super()._set_stream_headers(status_code)
        self._streaming = True
        self._fit_headers(status_code)

    def end_headers(self) -> None:
        if getattr(self, "_headers_sent_early", False):
            self._headers_sent_early = False
            return
        super().end_headers()

    def _queued(self) -> None:
        """A stream waiting to start (``--queue-keepalive``): its headers (200,
        an event stream) at the first call, and an SSE comment at each, so that
        its connection stays alive and its client knows it is queued. A refusal
        after this comes as an error event (``answer_error``)."""
        if not self._streaming:
            self._set_stream_headers(200)
            self.end_headers()
        self.wfile.write(f": queued, {self.metrics.waiting} requests waiting\n\n".encode())
        self.wfile.flush()

    def cut_off(self, reason: str = SHUTTING_DOWN) -> None:
        """End this connection's response now (the drain, past its grace): a
        request not yet answered gets 503, a stream an error event and
        ``[DONE]``; the handler's later writes fail as if its client had gone."""
        wire = self.wfile
        if not isinstance(wire, Wire):
            return
        if wire.written == 0:
            data = raw_response(503, "Service Unavailable", reason, "server_shutting_down")
        elif self._streaming:
            data = error_event(f"{reason}; this answer is cut off", "server_shutting_down")
        else:
            data = b""
        wire.end(data, reason)
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

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
