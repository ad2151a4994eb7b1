"""A soak of ``muser-kv serve`` as traffic meets it: everything
``test_serve_operator`` checks one at a time, at once, for a bounded while.

One server (the real command, ``tests/servers.py``) over the tiny random-weight
Muse Glimmer of ``local_model``, with a KV store directory. First every request
of ``REQUESTS`` (mixed prompt and answer lengths, completions and chats) is
answered alone: its solo tokens. Then, for ``MUSER_KV_SOAK_SECONDS`` (default
8 s; ``benchmarks/device.sh soak`` runs it longer), at once:

* clients sending ``REQUESTS`` in a seeded order, some streamed;
* bursts of connections (``/health`` and requests) opened at the same instant;
* clients that close their connection before their answer, mid-stream, or
  while an answer that is not streamed is decoded;
* every malformed body of ``MALFORMED``;
* the store directory damaged: chunk files flipped, truncated, removed (a
  memory tier of 1 MB, so most lookups read the directory).

Then three streams of ``LONG`` tokens start and the server gets SIGTERM in
their middle.

Asserted: every request got a status (no reset, no connection closed without
one), every 200 answer is its request's solo tokens, nothing is left waiting,
running or open after the traffic (``/metrics``), the server's RSS after
the traffic is within ``RSS_SLACK`` of before plus what the store's memory
tier grew by (``/metrics``), the drain ends every stream with ``[DONE]`` and
exits 0, and a server restarted over the same store answers each request with
its solo tokens again.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import metal_plugin
import pytest
from local_model import write_local_model
from servers import Server, ids, serving, words

SECONDS = float(os.environ.get("MUSER_KV_SOAK_SECONDS", 8))
#: what the server's RSS may grow by over the traffic, beyond the store's memory
#: tier: MLX's buffer cache for the largest batch's activations and planes, and
#: the allocator's high-water mark, on the tiny model
RSS_SLACK = 384 << 20
COMPLETIONS, CHATS = "/v1/completions", "/v1/chat/completions"
LONG = 80  # tokens of the streams SIGTERM meets
#: every loop of the traffic ends at the deadline, and after at most this many rounds
ROUNDS = int(SECONDS * 50) + 50


def request(i: int) -> Tuple[str, Dict[str, Any]]:
    """The ``i``-th request: prompts of 8 to 160 tokens, answers of 3 to 24."""
    rng = random.Random(i)
    prompt, answer = rng.randint(8, 160), rng.randint(3, 24)
    if i % 3 == 2:
        return CHATS, {"messages": [{"role": "system", "content": words(ids(12, 500))},
                                    {"role": "user", "content": words(ids(prompt, 600 + i))}],
                       "max_tokens": answer, "temperature": 0, "logprobs": True}
    return COMPLETIONS, {"prompt": words(ids(prompt, 700 + i)), "max_tokens": answer,
                         "temperature": 0, "logprobs": True}


REQUESTS = [request(i) for i in range(9)]

MALFORMED = [b'{"prompt": "t1 \xff"}', b"[" * 5000 + b"]" * 5000, b'{"prompt": ',
             b'{"prompt": "\\ud800"}', b'{"prompt": "t1", "n": 3}', b'{"prompt": "t1", "model": "/etc"}',
             b'{"prompt": "t1", "max_tokens": -1}', b'["t1"]']


def exchange(port: int, data: bytes, wait: float = 60) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(data)
        got = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return got
            got += chunk


def http(path: str, body: Dict[str, Any], stream: bool = False) -> bytes:
    data = json.dumps(dict(body, stream=True) if stream else body).encode()
    return b"POST %s HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % (path.encode(), len(data)) + data


def answer_tokens(response: bytes) -> Tuple[int, Optional[List[int]], str]:
    """(status, the tokens of a 200 non-streamed answer, the text of a stream)."""
    assert response.startswith(b"HTTP/1.0 "), response[:100]
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    if status != 200:
        json.loads(body)["error"]["message"]  # OpenAI's shape, or this raises
        return status, None, ""
    if b"text/event-stream" in head:
        events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
        assert events and events[-1] == b"[DONE]", body[-300:]
        text = "".join(c.get("text", c.get("delta", {}).get("content") or "")
                       for e in events[:-1] for c in json.loads(e).get("choices", []))
        return status, None, text
    out = json.loads(body)
    return status, [t["id"] for t in out["choices"][0]["logprobs"]["content"]], ""


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def metrics(port: int) -> Dict[str, float]:
    got = exchange(port, b"GET /metrics HTTP/1.0\r\n\r\n").decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in got.partition("\r\n\r\n")[2].splitlines()
            if line and not line.startswith("#")}


def memory_tier_bytes(port: int) -> float:
    return metrics(port)['muser_kv_kv_store_tier_bytes{tier="memory"}']


def settled(port: int, seconds: float = 15) -> Tuple[float, float, float]:
    """(requests waiting, running, connections open) once nothing is left but
    the scrape's own connection, or after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        m = metrics(port)
        now = (m["muser_kv_requests_waiting"], m["muser_kv_requests_running"],
               m["muser_kv_connections_open"])
        if now == (0, 0, 1) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def chunk_files(directory: Path) -> List[Path]:
    return [p for p in directory.glob("??/*") if p.is_file() and not p.name.startswith(".")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_local_model(tmp_path_factory.mktemp("model") / "muse")


def solo_answers(server: Server) -> Dict[int, Tuple[List[int], str]]:
    """Each request alone: its tokens, and the text of it streamed."""
    out = {}
    for i, (path, body) in enumerate(REQUESTS):
        status, tokens, _ = answer_tokens(exchange(server.port, http(path, body)))
        _, _, text = answer_tokens(exchange(server.port, http(path, body, stream=True)))
        assert status == 200 and tokens
        out[i] = (tokens, text)
    return out


def test_soak(model_dir, tmp_path):
    if os.environ.get(metal_plugin.EMULATOR_ENV):
        pytest.skip("the server runs the command itself, which does not install the tests' "
                    "Metal emulator")
    store = tmp_path / "store"
    # a memory tier of 1 MB: most lookups read the directory the traffic damages
    flags = ("--kv-store", str(store), "--kv-store-memory", str(1 << 20),
             "--connection-timeout", "5", "--drain-grace", "60", "--prefill-step-size", "32")
    server = Server(model_dir, tmp_path / "soak.log", *flags)
    failures: List[str] = []
    with serving({"s": server}):
        solo = solo_answers(server)
        port, pid = server.port, server.proc.pid
        rss_before, tier_before = rss(pid), memory_tier_bytes(port)
        deadline = time.monotonic() + SECONDS
        counts = {"answered": 0, "streamed": 0, "refused": 0, "dropped": 0, "malformed": 0}
        lock = threading.Lock()

        def note(key: str, problem: Optional[str] = None) -> None:
            with lock:
                counts[key] += 1
                if problem:
                    failures.append(problem)

        def client(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(ROUNDS):
                if time.monotonic() > deadline:
                    return
                i = rng.randrange(len(REQUESTS))
                streamed = rng.random() < 0.3
                try:
                    status, tokens, text = answer_tokens(
                        exchange(port, http(*REQUESTS[i], stream=streamed)))
                except (OSError, AssertionError, ValueError) as e:
                    note("answered", f"request {i}: {type(e).__name__}: {e}")
                    continue
                if status != 200:
                    note("refused", f"request {i}: status {status}")
                elif streamed:
                    note("streamed", None if text == solo[i][1] else f"stream {i} differs")
                else:
                    note("answered", None if tokens == solo[i][0] else f"request {i} differs")

        def leaver(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(ROUNDS):
                if time.monotonic() > deadline:
                    return
                path, body = REQUESTS[rng.randrange(len(REQUESTS))]
                kind = rng.randrange(3)
                with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                    s.sendall(http(path, dict(body, max_tokens=200), stream=kind < 2))
                    if kind == 1:
                        s.recv(200)  # the stream started: leave mid-stream
                    elif kind == 2:
                        time.sleep(rng.uniform(0.05, 0.3))  # leave an answer not streamed
                note("dropped")
                time.sleep(0.05)

        def burst(_: int) -> None:
            for _ in range(ROUNDS):
                if time.monotonic() > deadline:
                    return
                with ThreadPoolExecutor(32) as pool:
                    got = list(pool.map(lambda j: _status(port, j, solo), range(32)))
                for problem in got:
                    note("answered", problem)
                time.sleep(0.5)

        def malformed(_: int) -> None:
            for _ in range(ROUNDS):
                if time.monotonic() > deadline:
                    return
                for body in MALFORMED:
                    got = exchange(port, b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d"
                                   b"\r\n\r\n" % len(body) + body)
                    status = int(got.split()[1]) if got.startswith(b"HTTP/1.0 ") else None
                    note("malformed", None if status in (400, 404) else
                         f"malformed {body[:30]!r}: {got[:80]!r}")
                time.sleep(0.2)

        def damage(_: int) -> None:
            rng = random.Random(7)
            for _ in range(ROUNDS):
                if time.monotonic() > deadline:
                    return
                time.sleep(0.5)
                files = chunk_files(store)
                if not files:
                    continue
                path = rng.choice(files)
                try:
                    kind = rng.randrange(3)
                    if kind == 0:
                        data = bytearray(path.read_bytes())
                        data[len(data) // 2] ^= 0x10
                        path.write_bytes(bytes(data))
                    elif kind == 1:
                        path.write_bytes(path.read_bytes()[:17])
                    else:
                        path.unlink()
                except OSError:
                    pass  # the server evicted or replaced it meanwhile

        jobs = [(client, s) for s in range(4)] + [(leaver, 10), (burst, 20), (malformed, 30),
                                                  (damage, 40)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            for f in [pool.submit(job, seed) for job, seed in jobs]:
                f.result()
        assert server.proc.poll() is None, server.log()
        assert not failures, failures[:10]
        assert counts["answered"] > len(REQUESTS) and counts["malformed"] >= len(MALFORMED), counts
        idle = settled(port)  # the departed clients' requests dropped, every handler ended
        assert idle == (0, 0, 1), f"waiting, running, connections open: {idle}"
        rss_after, tier_after = rss(pid), memory_tier_bytes(port)
        assert rss_after - rss_before <= tier_after - tier_before + RSS_SLACK, (
            rss_before, rss_after, tier_before, tier_after)

        # SIGTERM in the middle of streams: each ends whole, the process exits 0
        long = [(path, dict(body, max_tokens=LONG)) for path, body in REQUESTS[:3]]
        alone = [answer_tokens(exchange(port, http(*r, stream=True)))[2] for r in long]
        streams = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in long]
        for s, r in zip(streams, long):
            s.sendall(http(*r, stream=True))
        for s in streams:
            assert s.recv(16).startswith(b"HTTP/1.0 200")  # each stream has started
        server.proc.send_signal(signal.SIGTERM)
        ended = []
        for s in streams:
            with s:
                rest = b"HTTP/1.0 200"
                while chunk := s.recv(65536):
                    rest += chunk
                ended.append(answer_tokens(rest)[2])
        assert ended == alone
        assert server.proc.wait(60) == 0, server.log()
        assert ", 0 ended with an error; the KV store is flushed" in server.whole_log()

    again = Server(model_dir, tmp_path / "again.log", *flags)
    with serving({"s": again}):
        assert solo_answers(again) == solo


def _status(port: int, j: int, solo: Dict[int, Tuple[List[int], str]]) -> Optional[str]:
    """One connection of a burst: ``/health`` or a request; a problem, or ``None``."""
    try:
        if j % 4:
            got = exchange(port, b"GET /health HTTP/1.0\r\n\r\n", wait=60)
            return None if got.startswith(b"HTTP/1.0 200") else f"health: {got[:60]!r}"
        i = j // 4 % len(REQUESTS)
        status, tokens, _ = answer_tokens(exchange(port, http(*REQUESTS[i]), wait=60))
        return None if status == 200 and tokens == solo[i][0] else f"burst {i}: {status}"
    except (OSError, AssertionError, ValueError) as e:
        return f"burst {j}: {type(e).__name__}: {e}"
