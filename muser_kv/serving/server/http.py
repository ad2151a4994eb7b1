"""``muser-kv serve``'s HTTP server: mlx-lm's ``ThreadingHTTPServer`` (a
thread per connection), with bounds on its connections.

* **The listen queue** holds ``--listen-backlog`` connections (Python's
  default is 5: a burst of clients connecting at once to mlx-lm's server gets
  connection resets, ``GET /health`` on an idle server included).
* **Open connections** are at most ``--max-connections``; one past it is
  answered at once, without a handler thread, with HTTP 503 and OpenAI's
  error body (``Retry-After: 1``), and counted (``refused``).
* **An idle or half-sent connection** (no request line, headers or body within
  ``--connection-timeout`` seconds of the last bytes) is closed: each holds a
  thread. The same timeout bounds a write to a client that stopped reading.

The server also knows its handlers (``handlers``), so the drain on SIGTERM
(``shutdown``) can end what is still running, and a handler's write side is a
``Wire`` both it and the drain write through, one event at a time."""

from __future__ import annotations

import logging
import select
import socket
import threading
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from queue import Empty
from typing import Any, Callable, List, Optional, Set

from muser_kv.serving.server.errors import raw_response

log = logging.getLogger("muser_kv.serving.server.serve")  # serve's: one logger for the server

DEFAULT_BACKLOG = 1024
DEFAULT_MAX_CONNECTIONS = 512
DEFAULT_CONNECTION_TIMEOUT = 60.0
DEFAULT_QUEUE_KEEPALIVE = 5.0


@dataclass(frozen=True)
class ConnectionLimits:
    """What the server bounds about its connections (module doc)."""

    backlog: int = DEFAULT_BACKLOG
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    timeout: float = DEFAULT_CONNECTION_TIMEOUT  #: seconds without bytes before a close

    @classmethod
    def of(cls, cli_args: Any) -> "ConnectionLimits":
        return cls(getattr(cli_args, "listen_backlog", DEFAULT_BACKLOG),
                   getattr(cli_args, "max_connections", DEFAULT_MAX_CONNECTIONS),
                   getattr(cli_args, "connection_timeout", DEFAULT_CONNECTION_TIMEOUT))


class Wire:
    """A connection's write side (the handler's ``wfile``), shared by its
    handler and the drain: one write at a time, so an event the drain ends a
    stream with never lands inside one of the handler's. After ``mute`` (an
    error already answered in full) the handler's writes go nowhere; after
    ``end`` they raise ``ConnectionAbortedError``, which the handler takes as
    a client gone."""

    def __init__(self, raw: Any):
        self._raw = raw
        self._lock = threading.Lock()
        self.written = 0  #: bytes written to the client so far
        self._muted = False
        self._ended: Optional[str] = None

    def write(self, data: bytes) -> int:
        with self._lock:
            if self._ended is not None:
                raise ConnectionAbortedError(self._ended)
            if not self._muted:
                self._raw.write(data)
                self.written += len(data)
            return len(data)

    def flush(self) -> None:
        with self._lock:
            if self._ended is None and not self._muted:
                self._raw.flush()

    def mute(self) -> None:
        with self._lock:
            self._muted = True

    def end(self, data: bytes, reason: str) -> None:
        """Write ``data`` (unless muted or ended), then refuse every later write."""
        with self._lock:
            if self._ended is not None:
                return
            self._ended = reason
            if not self._muted and data:
                try:
                    self._raw.write(data)
                    self._raw.flush()
                except OSError:
                    pass

    @property
    def closed(self) -> bool:
        return bool(self._raw.closed)

    def close(self) -> None:
        self._raw.close()


def peer_gone(sock: Any) -> bool:
    """Whether the client at the other end of ``sock`` has closed its side
    (an end of stream waiting to be read, or a reset), without reading what
    it may still have sent."""
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
        events = poller.poll(0)
        if not events:
            return False
        if events[0][1] & (select.POLLHUP | select.POLLERR):
            return True
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):  # reset, or closed here
        return True


class ClientGone(ConnectionAbortedError):
    """A request whose client closed its connection before its answer was
    done: dropped, never answered."""


class ClientWatch:
    """Whether a request's client is still connected (``gone``), asked by the
    generation thread before the request's prefill and between its chunks;
    once gone, always gone. A copy for another process (mlx-lm shares requests
    between ranks by pickling them) watches nothing."""

    def __init__(self, connection: Any):
        self._connection = connection
        self._gone = False

    def gone(self) -> bool:
        if not self._gone and self._connection is not None:
            self._gone = peer_gone(self._connection)
        return self._gone

    def __reduce__(self) -> Any:
        return (ClientWatch, (None,))


class WaitingQueue:
    """A response queue whose empty waits call ``waiting`` at least every
    ``interval`` seconds (and pass the ``queue.Empty`` on to the waiter)."""

    def __init__(self, queue: Any, waiting: Callable[[], None], interval: float):
        self._queue, self._waiting, self._interval = queue, waiting, interval

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        try:
            return self._queue.get(block, self._interval if timeout is None
                                   else min(timeout, self._interval))
        except Empty:
            self._waiting()
            raise


class ThreadClient(threading.local):
    """The connection the current handler thread serves and its request's
    timer (``MuseAPIHandler`` sets them), for ``generate`` to watch and time."""

    connection: Any = None
    timer: Any = None  #: its request's ``metrics.RequestTimer``
    #: called now and then while its request waits to start (a stream's keepalive)
    waiting: Optional[Callable[[], None]] = None


THREAD_CLIENT = ThreadClient()


class MuseHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` within ``limits`` (module doc); ``server_class``
    makes the class mlx-lm's ``_run_http_server`` instantiates."""

    daemon_threads = True
    limits = ConnectionLimits()
    #: called with each server once it listens (the drain keeps it)
    on_start: Callable[["MuseHTTPServer"], None] = staticmethod(lambda server: None)

    def __init__(self, address: Any, handler: Any):
        self.request_queue_size = self.limits.backlog  # read by server_activate
        self._lock = threading.Lock()
        self._handlers: Set[Any] = set()
        self._open = 0
        self.refused = 0  #: connections answered 503 past --max-connections
        self.timed_out = 0  #: connections closed idle or half-sent
        self.accepting = True
        super().__init__(address, handler)
        type(self).on_start(self)

    @property
    def open_connections(self) -> int:
        with self._lock:
            return self._open

    def handlers(self) -> List[Any]:
        """The handlers serving a connection now."""
        with self._lock:
            return list(self._handlers)

    def opened(self, handler: Any) -> None:
        with self._lock:
            self._handlers.add(handler)

    def closed(self, handler: Any) -> None:
        with self._lock:
            self._handlers.discard(handler)

    def count_timeout(self) -> None:
        with self._lock:
            self.timed_out += 1

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            full = self._open >= self.limits.max_connections or not self.accepting
            if full:
                self.refused += 1
            else:
                self._open += 1
        if full:
            threading.Thread(target=self._refuse, args=(request,), daemon=True).start()
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._open -= 1

    def _refuse(self, request: Any) -> None:
        """Answer a connection past the bound with 503, then close it once the
        client has sent what it was sending (a close with unread bytes would
        reset the connection before the client reads the answer)."""
        why = (f"this server has {self.limits.max_connections} connections open "
               "(--max-connections); try again" if self.accepting else
               "this server is shutting down")
        try:
            request.settimeout(1.0)
            request.sendall(raw_response(503, "Service Unavailable", why, "server_busy",
                                         retry_after=1))
            request.shutdown(socket.SHUT_WR)
            for _ in range(64):  # read what the client sends, up to 64 KiB and 1 s a read
                if not request.recv(1024):
                    break
        except OSError:
            pass
        finally:
            self.shutdown_request(request)


def server_class(limits: ConnectionLimits,
                 on_start: Callable[[MuseHTTPServer], None]) -> type:
    """A ``MuseHTTPServer`` class bound to ``limits`` and ``on_start``, as
    mlx-lm's ``_run_http_server`` takes one (it sets the class's address family)."""
    return type("MuseHTTPServer", (MuseHTTPServer,),
                {"limits": limits, "on_start": staticmethod(on_start)})
