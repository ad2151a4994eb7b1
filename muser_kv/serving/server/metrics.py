"""``GET /metrics``: what ``muser-kv serve`` has done, in Prometheus' text
format (version 0.0.4), as vLLM's, SGLang's, TGI's and llama.cpp's servers
publish theirs.

Counted where it happens: a response's status as the handler sends it
(``response``), a completion request from its arrival to its last token
(``RequestTimer``: waiting until the generation thread answers it, then
running; its time to first token and time between tokens), the clients that
went away (``client_gone``, by where they were: queued, prefilling,
generating). Read when scraped: KV memory held against ``--kv-memory``, the
KV store's counters and each tier's, the HTTP server's connections
(``sources``). Counters only grow while the process lives."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

#: seconds: time to first token, and between tokens
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
#: the paths counted by name; any other is "other" (a client's path is not a label)
PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions", "/v1/models",
         "/health", "/metrics")
PREFIX = "muser_kv_"


class Histogram:
    """A Prometheus histogram: cumulative buckets, a sum and a count."""

    def __init__(self, buckets: Tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> List[str]:
        out = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}",
                f"{name}_count {self.count}"]
        return out


class Metrics:
    """The server's counters (module doc); every method is thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._responses: Counter = Counter()  # (path, status)
        self._gone: Counter = Counter()  # where the client was
        self.waiting = 0
        self.running = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tbt = Histogram(TBT_BUCKETS)
        #: gauges and counters read when scraped: name -> (type, help, read)
        self.sources: List[Callable[[], Iterable[Tuple[str, str, str, Any]]]] = []

    def response(self, path: str, status: int) -> None:
        path = path.split("?")[0]
        with self._lock:
            self._responses[(path if path in PATHS else "other", status)] += 1

    def client_gone(self, where: str) -> None:
        with self._lock:
            self._gone[where] += 1

    def request(self) -> "RequestTimer":
        return RequestTimer(self)

    def add(self, **deltas: Any) -> None:
        """Add each of ``deltas`` to the count it names, together."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def observe(self, histogram: Histogram, value: float) -> None:
        """``histogram.observe(value)`` under this object's lock."""
        with self._lock:
            histogram.observe(value)

    def render(self) -> str:
        """The text format: one ``# HELP``/``# TYPE`` pair per metric, then its samples."""
        out: List[str] = []

        def metric(name: str, kind: str, help_: str, samples: Iterable[str]) -> None:
            out.extend([f"# HELP {PREFIX}{name} {help_}", f"# TYPE {PREFIX}{name} {kind}"])
            out.extend(PREFIX + s for s in samples)

        with self._lock:
            metric("requests_total", "counter", "HTTP responses sent, by path and status",
                   [f'requests_total{{path="{p}",status="{s}"}} {n}'
                    for (p, s), n in sorted(self._responses.items())])
            metric("requests_waiting", "gauge", "completion requests not yet started "
                   "(queued, or waiting for KV memory)", [f"requests_waiting {self.waiting}"])
            metric("requests_running", "gauge", "completion requests started and not "
                   "finished", [f"requests_running {self.running}"])
            metric("prompt_tokens_total", "counter", "prompt tokens of the requests started",
                   [f"prompt_tokens_total {self.prompt_tokens}"])
            metric("generation_tokens_total", "counter", "tokens generated and sent",
                   [f"generation_tokens_total {self.generated_tokens}"])
            metric("time_to_first_token_seconds", "histogram", "from a request's arrival to "
                   "its first token", self.ttft.lines("time_to_first_token_seconds"))
            metric("time_between_tokens_seconds", "histogram", "between a request's "
                   "consecutive tokens", self.tbt.lines("time_between_tokens_seconds"))
            metric("clients_gone_total", "counter", "requests dropped because their client "
                   "closed its connection, by where the request was",
                   [f'clients_gone_total{{where="{w}"}} {self._gone[w]}'
                    for w in ("queued", "prefill", "generation")])
        by_name: Dict[str, Tuple[str, str, List[str]]] = {}
        for source in self.sources:
            for name, kind, help_, sample in source():
                by_name.setdefault(name.split("{")[0], (kind, help_, []))[2].append(
                    f"{name} {sample}")
        for name, (kind, help_, samples) in by_name.items():
            metric(name, kind, help_, samples)
        return "\n".join(out) + "\n"


class RequestTimer:
    """One completion request, counted from its arrival (waiting) through
    ``started`` (running: the generation thread took it) to ``done``; each
    token sent is timed (``tokens``)."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics
        self._arrived = time.monotonic()
        self._last: Optional[float] = None
        self._running = False
        self._done = False
        metrics.add(waiting=1)

    def started(self, prompt_tokens: int) -> None:
        if not self._running and not self._done:
            self._running = True
            self._metrics.add(waiting=-1, running=1, prompt_tokens=prompt_tokens)

    def tokens(self, answers: Iterable[Any]) -> Iterator[Any]:
        """``answers`` (mlx-lm's responses, one per token), each timed as it passes."""
        for answer in answers:
            now = time.monotonic()
            if self._last is None:
                self._metrics.observe(self._metrics.ttft, now - self._arrived)
            else:
                self._metrics.observe(self._metrics.tbt, now - self._last)
            self._last = now
            self._metrics.add(generated_tokens=1)
            yield answer

    def done(self) -> None:
        if not self._done:
            self._done = True
            self._metrics.add(**({"running": -1} if self._running else {"waiting": -1}))
