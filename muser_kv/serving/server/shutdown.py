"""``muser-kv serve`` on SIGTERM or SIGINT: a drain, not a kill.

1. The server stops accepting: its accept loop ends and its listening socket
   closes, so a new connection is refused by the kernel and a load balancer
   moves on.
2. Requests already running, streamed or not, and those queued behind them
   may finish within ``--drain-grace`` seconds; a connection with no whole
   request yet (idle, or half-sent) is closed at once.
3. Past the grace, each one left is ended (``MuseAPIHandler.cut_off``): a
   request not yet answered gets 503, a stream an error event and ``[DONE]``,
   so no client takes a cut-off answer for a whole one.
4. The generation thread stops (mlx-lm's ``stop_and_join``) and the KV store's
   write-behind is flushed and closed (``close_store``): every chunk a finished
   answer put is on disk (or in Redis) when the process exits, with status 0.

A second signal during the grace ends it at once (step 3 follows). SIGKILL
stays what it is: the store's files are written atomically, so nothing is
torn, and what was still queued for writing is lost."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional

from muser_kv.serving.server.http import ConnectionLimits, server_class

log = logging.getLogger("muser_kv.serving.server.serve")  # serve's: one logger for the server

DEFAULT_GRACE = 30.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Drain:
    """One server's drain (module doc). ``started`` is given the HTTP server
    once it listens; ``on_signals`` installs the handlers for its block;
    ``finish`` runs the drain after the accept loop has returned."""

    def __init__(self, grace: float):
        self.grace = grace
        self.server: Any = None
        self.signalled: Optional[int] = None  #: the signal that started the drain
        self._hurry = threading.Event()
        self._met: List[Any] = []  #: the requests running or queued when the signal came

    def started(self, server: Any) -> None:
        self.server = server

    @contextmanager
    def on_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can be set only in the main thread
            return
        saved = {s: signal.signal(s, self._signal) for s in SIGNALS}
        try:
            yield
        finally:
            for s, handler in saved.items():
                signal.signal(s, handler)

    def _signal(self, signum: int, frame: Any) -> None:
        if self.signalled is not None:
            self._hurry.set()  # a second signal: no more grace
            return
        self.signalled = signum
        server = self.server
        if server is not None:
            server.accepting = False
            # shutdown() waits for the accept loop, which runs in this (the main)
            # thread; the requests met are counted there too (no lock is taken here)
            threading.Thread(target=self._begin, args=(server,), daemon=True).start()

    def _begin(self, server: Any) -> None:
        self._met = [h for h in server.handlers() if h.in_request]
        server.shutdown()

    def finish(self, stop_generation: Callable[[], None], close_store: Callable[[], None]) -> bool:
        """Steps 1-4 of the module doc, once the accept loop has returned
        after a signal; whether it did (nothing otherwise)."""
        server = self.server
        if self.signalled is None or server is None:
            return False
        server.server_close()
        name = signal.Signals(self.signalled).name
        for handler in server.handlers():
            if not handler.in_request:  # idle, or its request not whole yet: nothing to finish
                handler.cut_off()
        log.warning("muser-kv serve: %s: draining (%d requests met, up to %g s)", name,
                    len(self._met), self.grace)
        deadline = time.monotonic() + self.grace
        while any(h.in_request for h in server.handlers()) and time.monotonic() < deadline \
                and not self._hurry.is_set():
            time.sleep(0.05)
        left = server.handlers()
        cut = [h for h in left if h.in_request]
        for handler in left:
            handler.cut_off()
        stop_generation()
        close_store()
        log.warning("muser-kv serve: drained: %d requests finished, %d ended with an error; "
                    "the KV store is flushed", len([h for h in self._met if h not in cut]),
                    len(cut))
        return True


def connection_metrics(server: Any) -> Iterator[Any]:
    """``/metrics``' samples of the HTTP server's connections (``http.MuseHTTPServer``)."""
    yield ("connections_open", "gauge", "connections open now", server.open_connections)
    yield ("connections_refused_total", "counter", "connections answered 503 at once "
           "(past --max-connections, or while shutting down)", server.refused)
    yield ("connections_timed_out_total", "counter", "requests whose body did not arrive "
           "within --connection-timeout (408)", server.timed_out)


#: the line serve logs once it listens (``serve_until_drained``), its port a group:
#: how a client that started it with ``--port 0`` finds the port
LISTENING = re.compile(r"muser-kv serve: listening on http://(?:\[[^\]]+\]|[^\s:/]+):(\d+)")


def listening_url(address: Any) -> str:
    """The URL a listening socket's ``address`` answers on: its own port, the
    one the kernel chose where ``--port 0`` asked for any free one."""
    host, port = address[0], address[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve_until_drained(run: Callable[[type], Any], response_generator: Any) -> None:
    """Run the HTTP server (``run(server_class)``: mlx-lm's accept loop) within
    the connection limits of ``response_generator``'s flags, and drain it on
    SIGTERM or SIGINT (module doc). ``response_generator`` is serve's: it
    stops (``stop_and_join``) and closes its store (``close_store``)."""
    cli = response_generator.cli_args
    drain = Drain(getattr(cli, "drain_grace", DEFAULT_GRACE))
    metrics = response_generator.metrics

    def started(server: Any) -> None:
        drain.started(server)
        metrics.sources.append(lambda: connection_metrics(server))
        log.warning("muser-kv serve: listening on %s", listening_url(server.server_address))

    with drain.on_signals():
        run(server_class(ConnectionLimits.of(cli), started))
    if drain.finish(response_generator.stop_and_join, response_generator.close_store):
        # everything is written: the interpreter's teardown is skipped, since
        # MLX's native threads abort it (std::terminate, exit -6), mlx-lm's own
        # SIGINT path included
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
