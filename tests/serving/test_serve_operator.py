"""``muser-kv serve`` as an operator runs it: every connection answered, every
malformed request a 400 (or 404, 408, 411, 413) in OpenAI's error shape, a
client that left dropped before its prefill, SIGTERM a drain.

The servers are the real command in a subprocess (``tests/servers.py``) over
the tiny random-weight Muse Glimmer of ``local_model``, reached over loopback
with raw sockets where a test sends what no HTTP client library would.
mlx-lm 0.32.2's own server fails each of these: a burst of 32 connections
gets resets (its listen queue holds 5), a body that is not UTF-8 or nests too
deep or has a negative length closes the connection with no status, a
departed client's prompt is prefilled in full, SIGTERM kills (exit -15, the
KV store's queued writes lost).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import metal_plugin
import pytest
from local_model import write_local_model
from servers import REQUEST_TIMEOUT, Server, ids, serving, words

TIMEOUT = 2.0  # --connection-timeout of the servers here
MAX_BODY = 250_000  # --max-body-bytes: more than NESTED
BOUND = 3  # --max-connections of the bounded server


def skip_under_emulator() -> None:
    if os.environ.get(metal_plugin.EMULATOR_ENV):
        pytest.skip("the servers run the command itself, which does not install the tests' "
                    "Metal emulator")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_local_model(tmp_path_factory.mktemp("model") / "muse")


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory) -> Iterator[Dict[str, Server]]:
    """``plain``: short timeouts and a small body bound, 8-token prefill steps
    (a prompt's prefill is many chunks); ``bounded``: at most ``BOUND``
    connections open."""
    skip_under_emulator()
    logs = tmp_path_factory.mktemp("logs")
    common = ("--prompt-cache-size", "0", "--connection-timeout", str(TIMEOUT))
    flags = {"plain": (*common, "--max-body-bytes", str(MAX_BODY), "--prefill-step-size", "8"),
             "bounded": (*common, "--max-connections", str(BOUND))}
    with serving({name: Server(model_dir, logs / f"{name}.log", *extra)
                  for name, extra in flags.items()}) as started:
        yield dict(started)


def exchange(server: Server, data: bytes, wait: float = REQUEST_TIMEOUT) -> bytes:
    """Send ``data`` on a new connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as s:
        s.sendall(data)
        got = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return got
            got += chunk


def post(server: Server, body: bytes, path: str = "/v1/completions", headers: bytes = b"") -> bytes:
    return exchange(server, b"POST %s HTTP/1.0\r\nContent-Length: %d\r\n%s\r\n"
                    % (path.encode(), len(body), headers) + body)


def parsed(response: bytes) -> Tuple[int, Any]:
    """(status, the JSON body) of a whole HTTP response."""
    assert response.startswith(b"HTTP/1."), response[:200]
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def refusal(response: bytes) -> Tuple[int, str, str]:
    """(status, message, code) of an answer in OpenAI's error shape (asserted)."""
    status, body = parsed(response)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return status, error["message"], error["code"]


def completion(prompt: List[int], max_tokens: int = 6, **extra: Any) -> Dict[str, Any]:
    return dict({"prompt": words(prompt), "max_tokens": max_tokens, "temperature": 0,
                 "logprobs": True}, **extra)


def tokens(out: Dict[str, Any]) -> List[int]:
    return [t["id"] for t in out["choices"][0]["logprobs"]["content"]]


# -- every malformed request: a status and one line, before any model work ------------------

NESTED = b"[" * 100_000 + b"]" * 100_000
MALFORMED = [
    ("not-utf8", b'{"prompt": "t1 \xff t2"}', b"", 400, "the request body is not UTF-8: byte 15"),
    ("nested", NESTED, b"", 400, "the request body nests 100,000 levels of arrays and objects; at most 64"),
    ("not-json", b'{"prompt": ', b"", 400, "the request body is not JSON: Expecting value"),
    ("not-object", b'["t1"]', b"", 400, "the request body must be a JSON object, got a JSON list"),
    ("surrogate-prompt", b'{"prompt": "t1 \\ud800"}', b"", 400,
     "prompt is not valid Unicode (a lone surrogate"),
    ("surrogate-message", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', b"", 400,
     "messages[0].content is not valid Unicode"),
    ("template", b'{"messages": [{"role": "user", "content": "t5"}], "chat_template_kwargs": '
                 b'{"add_generation_prompt": false}}', b"", 400,
     "the request cannot be rendered and tokenized: TypeError: "),
    ("n", b'{"prompt": "t1", "n": 5}', b"", 400,
     "n must be 1: this server generates one choice per request, got 5"),
    ("echo", b'{"prompt": "t1", "echo": true}', b"", 400, "echo must be false"),
    ("response_format", b'{"prompt": "t1", "response_format": {"type": "json_object"}}', b"",
     400, 'response_format must be {"type": "text"} or null'),
    ("mlx-lm-check", b'{"prompt": "t1", "temperature": -1}', b"", 400,
     "temperature must be at least 0"),
    ("model", b'{"prompt": "t1", "model": "/etc"}', b"", 404,
     "model '/etc' is not served here"),
    ("too-large", b"{}", b"", 413, None),  # Content-Length rewritten below
]


@pytest.mark.parametrize("name, body, headers, status, message", MALFORMED,
                         ids=[m[0] for m in MALFORMED])
def test_a_malformed_request_gets_its_status_and_one_line(servers, name, body, headers, status,
                                                          message):
    server = servers["plain"]
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    if name == "too-large":
        got = exchange(server, b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n"
                       % (MAX_BODY + 1))
        message = f"request body of {MAX_BODY + 1:,} bytes is more than this server takes"
    else:
        got = post(server, body, path, headers)
    answered, said, _ = refusal(got)
    assert (answered, said[:len(message)]) == (status, message), said
    assert "\n" not in said


@pytest.mark.parametrize("head, status, message", [
    (b"Content-Length: -5\r\n", 400, "Content-Length must be a decimal integer >= 0, got '-5'"),
    (b"Content-Length: 5x\r\n", 400, "Content-Length must be a decimal integer >= 0, got '5x'"),
    (b"", 411, "a POST needs a Content-Length header"),
], ids=["negative", "not-a-number", "absent"])
def test_a_bad_content_length_is_refused(servers, head, status, message):
    got = exchange(servers["plain"], b"POST /v1/completions HTTP/1.0\r\n" + head + b"\r\n")
    answered, said, _ = refusal(got)
    assert (answered, said[:len(message)]) == (status, message)


def test_an_unknown_path_and_a_refusal_inside_mlx_lm_are_in_openai_shape(servers):
    assert refusal(post(servers["plain"], b"{}", "/v2/nothing"))[:2] == (
        404, "POST /v2/nothing is not an endpoint of this server")


def test_the_served_model_by_any_of_its_names_is_served_as_the_default(servers, model_dir):
    server = servers["plain"]
    body = completion(ids(12, 1))
    alone = tokens(server.post("/v1/completions", body))
    for name in (str(model_dir), str(model_dir.resolve()), "default_model"):
        assert tokens(server.post("/v1/completions", dict(body, model=name))) == alone


# -- connections: a burst accepted, idle ones closed, a bound answered 503 --------------------


def test_a_burst_of_connections_is_every_one_answered(servers):
    """96 clients connect at the same instant: every one gets its answer
    (mlx-lm's listen queue of 5 resets some of every 32)."""
    server, n = servers["plain"], 96
    barrier = threading.Barrier(n)

    def health(_: int) -> Any:
        barrier.wait(timeout=30)
        try:
            return parsed(exchange(server, b"GET /health HTTP/1.0\r\n\r\n", wait=30))[0]
        except OSError as e:
            return type(e).__name__

    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(health, range(n)))
    assert answers == [200] * n


def test_idle_and_half_sent_connections_are_closed(servers):
    server = servers["plain"]
    for sent in (b"", b"POST /v1/completions HTTP/1.0\r\nContent-Len"):
        start = time.monotonic()
        got = exchange(server, sent, wait=TIMEOUT + 10)
        assert got == b"" and time.monotonic() - start < TIMEOUT + 5
    start = time.monotonic()  # headers whole, the body cut short: 408
    got = exchange(server, b"POST /v1/completions HTTP/1.0\r\nContent-Length: 40\r\n\r\n{",
                   wait=TIMEOUT + 10)
    assert refusal(got)[0] == 408 and time.monotonic() - start < TIMEOUT + 5
    assert server.get("/health") == 200


def test_connections_past_the_bound_get_503_and_the_server_serves_on(servers):
    server = servers["bounded"]
    refused = scrape(server)["muser_kv_connections_refused_total"]
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=10)
            for _ in range(BOUND)]
    try:
        # each held connection counts once the server has accepted it, which a
        # loaded machine may take a while to do: ask until the bound is met
        deadline = time.monotonic() + 20
        got = exchange(server, b"GET /health HTTP/1.0\r\n\r\n")
        while parsed(got)[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
            got = exchange(server, b"GET /health HTTP/1.0\r\n\r\n")
        status, message, code = refusal(got)
        assert (status, code) == (503, "server_busy")
        assert f"{BOUND} connections open (--max-connections)" in message
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while server.get("/health") != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.get("/health") == 200
    assert scrape(server)["muser_kv_connections_refused_total"] >= refused + 1


# -- a client that left costs nothing ---------------------------------------------------------

DROPPED = re.compile(r"client went away (while it was queued|during its prefill \((\d+) of "
                     r"(\d+) prompt tokens\))")


@pytest.mark.parametrize("extra", [{}, {"seed": 0}], ids=["batched", "one-at-a-time"])
def test_a_client_gone_before_its_answer_is_dropped_before_its_prefill_ends(servers, extra):
    """Clients send a long prompt and close their connection at once: each
    request is dropped while queued or between its 8-token prefill chunks,
    never prefilled whole (mlx-lm notices only after the whole prefill), and
    the next request gets its solo tokens."""
    server = servers["plain"]
    body = completion(ids(12, 2), **extra)
    alone = tokens(server.post("/v1/completions", body))
    before, counted = len(server.whole_log()), scrape(server)
    for seed in range(4):
        data = json.dumps(completion(ids(200, 10 + seed), 50, **extra)).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n"
                      % len(data) + data)
    deadline = time.monotonic() + REQUEST_TIMEOUT
    while len(DROPPED.findall(server.whole_log()[before:])) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    log = server.whole_log()[before:]
    drops = DROPPED.findall(log)
    assert len(drops) == 4, log
    for _, done, total in drops:
        assert not done or int(done) < int(total), drops
    assert "Traceback" not in log, log
    assert tokens(server.post("/v1/completions", body)) == alone
    after = scrape(server)
    gone = sum(after[f'muser_kv_clients_gone_total{{where="{w}"}}']
               - counted[f'muser_kv_clients_gone_total{{where="{w}"}}']
               for w in ("queued", "prefill", "generation"))
    assert gone == 4
    settled_idle(server)


def test_a_client_gone_during_a_non_streamed_answer_stops_its_decode(servers):
    """A client that asked for 250 tokens, not streamed, and closes its
    connection 0.3 s later: its decode stops at the next step, far short of
    250 (mlx-lm decodes to the end and notices at its write)."""
    server = servers["plain"]
    before = len(server.whole_log())
    data = json.dumps(completion(ids(5, 1), 250, logit_bias={"255": -100})).encode()  # no </s>
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(data)
                  + data)
        time.sleep(0.3)
    went = re.compile(r"client went away after (\d+) of at most (\d+) tokens")
    deadline = time.monotonic() + REQUEST_TIMEOUT
    while not went.search(server.whole_log()[before:]) and time.monotonic() < deadline:
        time.sleep(0.05)
    found = went.search(server.whole_log()[before:])
    assert found, server.whole_log()[before:]
    generated, most = map(int, found.groups())
    assert most == 250 and generated < most // 2
    settled_idle(server)


def settled_idle(server: Server) -> None:
    """Every request's handler has ended (none left waiting for an answer
    that will not come): nothing waiting or running, one connection open
    (the scrape's own), within a few seconds."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = scrape(server)
        busy = (now["muser_kv_requests_waiting"], now["muser_kv_requests_running"],
                now["muser_kv_connections_open"])
        if busy == (0, 0, 1):
            return
        time.sleep(0.1)
    raise AssertionError(f"still waiting, running, open: {busy}")


# -- SIGTERM drains ----------------------------------------------------------------------------


def chunk_files(directory: Path) -> List[Path]:
    return [p for p in directory.glob("??/*") if p.is_file() and not p.name.startswith(".")]


def stream(server: Server, body: Dict[str, Any]) -> Tuple[socket.socket, Iterator[bytes]]:
    """A streamed completion on a raw socket: the socket and its SSE ``data:`` payloads."""
    data = json.dumps(dict(body, stream=True)).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=REQUEST_TIMEOUT)
    s.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    reader = s.makefile("rb")
    status = reader.readline()
    assert status.startswith(b"HTTP/1.0 200"), status

    def events() -> Iterator[bytes]:
        for line in reader:
            if line.startswith(b"data: "):
                yield line[len(b"data: "):].strip()
    return s, events()


def streamed_text(events: List[bytes]) -> Tuple[str, Optional[str]]:
    """(text, finish_reason) of a stream's events (the error event has no choices)."""
    text, finish = "", None
    for e in events:
        if e == b"[DONE]":
            continue
        for c in json.loads(e).get("choices", []):
            text += c.get("text", "")
            finish = c.get("finish_reason") or finish
    return text, finish


def stopped(server: Server, timeout: float = 60) -> Optional[int]:
    try:
        return server.proc.wait(timeout)
    finally:
        server.stop()


def test_sigterm_lets_a_running_stream_finish_then_flushes_the_store(model_dir, tmp_path):
    """SIGTERM while a stream runs and the store has writes queued: no new
    connection is accepted, an idle one is closed at once, the stream ends whole (``[DONE]``, the tokens it
    gives alone), the process exits 0, and every chunk is written: a restart
    over the directory, served the same requests, has nothing left to write
    and answers them identically."""
    skip_under_emulator()
    store = tmp_path / "store"
    flags = ("--kv-store", str(store), "--prompt-cache-size", "0")
    bodies = [completion(ids(150, 20 + i), 30) for i in range(4)]
    streamed_body = completion(ids(20, 30), 60, logit_bias={"255": -100})  # no </s>: to its length

    def run(log: str) -> Tuple[List[List[int]], Tuple[str, Optional[str]], int]:
        server = Server(model_dir, tmp_path / log, *flags)
        with serving({"s": server}):
            with ThreadPoolExecutor(len(bodies)) as pool:
                answers = [tokens(o) for o in pool.map(
                    lambda b: server.post("/v1/completions", b), bodies)]
            idle = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            time.sleep(0.2)  # accepted, no request yet
            conn, events = stream(server, streamed_body)
            got = [next(events)]
            server.proc.send_signal(signal.SIGTERM)
            with idle:  # closed at once, not waited for: a 503 saying why, or nothing
                assert idle.recv(4096)[:12] in (b"", b"HTTP/1.0 503")
            deadline = time.monotonic() + 10
            refused = False
            while not refused and time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
                    time.sleep(0.05)
                except OSError:
                    refused = True
            got += list(events)
            conn.close()
            assert refused, "the server still accepts connections after SIGTERM"
            assert got[-1] == b"[DONE]", got[-3:]
            status = stopped(server)
        log = server.log_path.read_text()
        assert status == 0, log
        assert "drained: 1 requests finished, 0 ended with an error" in log, log
        return answers, streamed_text(got), len(chunk_files(store))

    first, first_stream, files = run("first.log")
    again, again_stream, files_again = run("again.log")
    assert (again, again_stream) == (first, first_stream)
    assert first_stream[1] == "length" and first_stream[0]
    assert files_again == files > 0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_past_the_grace_a_stream_ends_with_an_error_event(model_dir, tmp_path, signum):
    skip_under_emulator()
    server = Server(model_dir, tmp_path / "serve.log", "--drain-grace", "0.05",
                    "--prompt-cache-size", "0")
    with serving({"s": server}):
        conn, events = stream(server, completion(ids(20, 40), 230, logit_bias={"255": -100}))
        got = [next(events)]
        server.proc.send_signal(signum)
        got += list(events)
        conn.close()
        status = stopped(server)
    assert status == 0, server.log_path.read_text()
    assert got[-1] == b"[DONE]"
    error = json.loads(got[-2])["error"]
    assert (error["code"], error["type"]) == ("server_shutting_down", "server_error")
    assert error["message"].startswith("this server is shutting down")
    assert streamed_text(got)[1] is None  # no finish: the answer is cut off, and says so


# -- /metrics ----------------------------------------------------------------------------------


def scrape(server: Server) -> Dict[str, float]:
    """``GET /metrics``: each sample (``name{labels}``) and its value."""
    got = exchange(server, b"GET /metrics HTTP/1.0\r\n\r\n")
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"text/plain; version=0.0.4" in head, head
    samples = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metrics_count_what_the_clients_sent_under_load(servers):
    """Scraped while 6 completions run and after: the requests by status,
    prompt and generated tokens, one time to first token per answer and one
    time between tokens per further token, nothing left waiting or running."""
    server = servers["plain"]
    ok = 'muser_kv_requests_total{path="/v1/completions",status="%d"}'
    before = scrape(server)
    bodies = [completion(ids(20 + 10 * i, 50 + i), 4 + i) for i in range(6)]
    with ThreadPoolExecutor(len(bodies) + 1) as pool:
        answers = pool.map(lambda b: server.post("/v1/completions", b), bodies)
        during = pool.submit(scrape, server)
        answers = list(answers)
        during.result()
    for body in (b'{"prompt": "t1", "n": 2}', b"\xff"):
        assert refusal(post(server, body))[0] == 400
    after = scrape(server)

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    generated = [a["usage"]["completion_tokens"] for a in answers]
    assert grew(ok % 200) == 6 and grew(ok % 400) == 2
    assert grew("muser_kv_prompt_tokens_total") == sum(a["usage"]["prompt_tokens"] for a in answers)
    assert grew("muser_kv_generation_tokens_total") == sum(generated)
    assert grew("muser_kv_time_to_first_token_seconds_count") == 6
    assert grew("muser_kv_time_between_tokens_seconds_count") == sum(generated) - 6
    assert after["muser_kv_requests_waiting"] == after["muser_kv_requests_running"] == 0
    assert after["muser_kv_connections_open"] >= 1  # the scrape's own
    assert 'muser_kv_kv_store_tier_chunks{tier="memory"}' in after


def test_the_server_announces_the_port_it_listens_on(servers):
    """``--port 0`` (every server here) binds any free port; the line the server
    writes once it listens names that port, in a URL a client can use as is."""
    from muser_kv.serving.server.shutdown import listening_url

    server = next(iter(servers.values()))
    assert f"muser-kv serve: listening on http://127.0.0.1:{server.port}\n" in server.whole_log()
    assert server.get("/health") == 200
    assert listening_url(("::1", 8080, 0, 0)) == "http://[::1]:8080"
