"""``muser-kv serve --kv-memory BYTES``: a server that admits a request only
while its planes fit.

The real command in a subprocess over a tiny Muse Glimmer whose context is
4,096 positions, so its global planes grow with each request. With a budget
that fits exactly two of the requests sent, four sent at once are all answered
with the tokens each gets alone (greedy, no prompt cache), the ones past two
waiting until another finishes; a request whose planes alone exceed the budget
is refused with 400 naming it, and a budget below one sequence's planes at
their smallest stops the server before it starts.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List

import metal_plugin
import pytest
from local_model import write_local_model
from servers import REQUEST_TIMEOUT, Server, ids, words

from muser_kv.serving.server import serve
from muser_kv.serving.server.kv_budget import KVBudget, KVMemoryExceeded, SequencePlanes

CONTEXT = 4096
PROMPT, TOKENS = 40, 60  # 100 positions: planes of 512 rows per global layer in a batch
KEEPALIVE = 0.02  # --queue-keepalive: seconds between a queued stream's comments


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_local_model(tmp_path_factory.mktemp("model") / "muse",
                             max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def planes(model_dir) -> SequencePlanes:
    geometry = serve.check_model(str(model_dir), None)
    assert geometry is not None and geometry.max_context == CONTEXT
    return SequencePlanes.of(geometry, 2048)  # mlx-lm's --prefill-step-size default



def test_the_budget_counts_every_slot_at_the_longest_sequence(planes):
    assert planes.rows(1) == 256 and planes.rows(PROMPT + TOKENS) == 512
    assert planes.rows(CONTEXT) == CONTEXT  # never past the preallocated plane
    one = planes.bytes(100)
    two = 2 * one + planes.transient(2, 100)
    kv = KVBudget(two, planes)
    assert kv.fits(100)
    kv.admit("a", 100)
    assert kv.fits(90) and not kv.fits(1500)  # a longer one costs both slots more
    kv.admit("b", 90)
    assert kv.admitted_bytes == two and not kv.fits(1)
    kv.release("a")
    assert kv.fits(100)
    with pytest.raises(KVMemoryExceeded, match="need .* bytes \\(3000 positions"):
        kv.check(3000)
    with pytest.raises(ValueError, match="positive int of bytes"):
        KVBudget(0, planes)


def test_the_budget_counts_one_layers_old_planes_while_they_are_replaced(planes):
    """A growth (or a batch taking more slots) holds one layer's old planes
    until they are copied: a budget of the slots' planes alone admits one
    sequence fewer than it seems to."""
    rows = planes.rows(100)
    assert planes.transient(3, 100) == 3 * max(planes.layer_row_bytes * rows,
                                               planes.layer_ring_bytes) > 0
    assert 0 < planes.layer_row_bytes < planes.row_bytes  # one global layer of several
    kv = KVBudget(2 * planes.bytes(100), planes)
    kv.admit("a", 100)
    assert not kv.fits(100)  # two slots' planes fit; their transient does not
    kv = KVBudget(2 * planes.bytes(100) + planes.transient(2, 100), planes)
    kv.admit("a", 100)
    assert kv.fits(100)


def test_a_budget_below_one_sequence_is_refused_before_the_server_starts(model_dir, planes,
                                                                         capsys):
    least = planes.bytes(1) + planes.transient(1, 1)
    assert serve.main(["--model", str(model_dir), "--kv-memory", str(least - 1)]) == 2
    err = capsys.readouterr().err
    assert "--kv-memory" in err and f"smallest ({least:,} bytes)" in err


@pytest.fixture(scope="module")
def server(model_dir, planes, tmp_path_factory):
    if os.environ.get(metal_plugin.EMULATOR_ENV):
        pytest.skip("the server runs the command itself, which does not install the tests' "
                    "Metal emulator")
    budget = KVBudget(1, planes).cost([PROMPT + TOKENS + 1] * 2)  # (+1: room for a BOS token)
    assert KVBudget(1, planes).cost([PROMPT + TOKENS] * 3) > budget
    s = Server(model_dir, tmp_path_factory.mktemp("logs") / "kv.log", "--prompt-cache-size",
               "0", "--kv-memory", str(budget), "--log-level", "INFO",
               "--queue-keepalive", str(KEEPALIVE))
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


#: the local tokenizer's </s> (vocab 256, last): kept out, so every answer runs to max_tokens
EOS = 255


def complete(server: Server, prompt: List[int], max_tokens: int = TOKENS) -> List[int]:
    out = server.post("/v1/completions", {"prompt": words(prompt), "max_tokens": max_tokens,
                                          "temperature": 0, "logprobs": True,
                                          "logit_bias": {str(EOS): -1000}})
    return [t["id"] for t in out["choices"][0]["logprobs"]["content"]]


def test_requests_past_the_budget_wait_and_are_answered_exactly(server):
    prompts = [ids(PROMPT, 10 + i) for i in range(4)]
    solo = [complete(server, p) for p in prompts]
    assert "waits for KV memory" not in server.log()
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: complete(server, p), prompts))
    assert together == solo
    assert all(len(t) == TOKENS for t in solo) and len({tuple(t) for t in solo}) == 4
    assert "waits for KV memory" in server.log()


def test_a_request_whose_planes_alone_exceed_the_budget_is_refused(server):
    status, out = server.send("/v1/completions", {"prompt": words(ids(1500, 3)),
                                                  "max_tokens": 20, "temperature": 0})
    assert status == 400, (status, out)
    assert "more than this server's --kv-memory" in str(out)
    assert len(complete(server, ids(PROMPT, 4))) == TOKENS  # and the server goes on


def raw_stream(server: Server, prompt: List[int]) -> socket.socket:
    data = json.dumps({"prompt": words(prompt), "max_tokens": TOKENS, "temperature": 0,
                       "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=REQUEST_TIMEOUT)
    s.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(data)
              + data)
    return s


def read_all(s: socket.socket) -> bytes:
    got = b""
    with s:
        while chunk := s.recv(65536):
            got += chunk
    return got


def stream_text(response: bytes) -> str:
    events = [line[6:] for line in response.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", response[-200:]
    return "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])


def test_a_stream_waiting_for_kv_memory_is_kept_alive_and_told_it_is_queued(server):
    """Two requests hold the budget; a stream sent behind them gets its
    headers and ``: queued`` comments while it waits, then the text it gets
    alone."""
    prompts = [ids(PROMPT, 20 + i) for i in range(3)]
    alone = stream_text(read_all(raw_stream(server, prompts[2])))
    with ThreadPoolExecutor(2) as pool:
        holders = [pool.submit(complete, server, p) for p in prompts[:2]]
        time.sleep(0.05)
        got = read_all(raw_stream(server, prompts[2]))
        [h.result() for h in holders]
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"text/event-stream" in head, head
    assert body.startswith(b": queued, "), body[:200]
    assert re.match(rb": queued, \d+ requests waiting\n\n", body)
    assert stream_text(body) == alone


def test_clients_gone_while_waiting_for_kv_memory_are_dropped_before_their_prefill(server):
    """Two requests hold the budget; six clients send theirs behind them and
    close at once: each is dropped when it reaches the queue's head (or at its
    first prefill chunk), and a request sent after them gets its solo tokens."""
    prompts = [ids(PROMPT, 30 + i) for i in range(3)]
    alone = complete(server, prompts[2])
    before = len(server.whole_log())
    with ThreadPoolExecutor(2) as pool:
        holders = [pool.submit(complete, server, p) for p in prompts[:2]]
        time.sleep(0.05)
        for i in range(6):
            raw_stream(server, ids(PROMPT, 40 + i)).close()
        assert complete(server, prompts[2]) == alone
        [h.result() for h in holders]
    log = server.whole_log()[before:]
    drops = re.findall(r"client went away (while it was queued|during its prefill)", log)
    assert len(drops) == 6, log
    assert "Traceback" not in log
