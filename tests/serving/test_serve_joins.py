"""A request arriving while others stream joins the running batch after the
current step: mlx-lm's generation thread looks at its queue only between
0.5 s runs of steps, so a joining request waited up to that long for its
first token. Counted in the running stream's tokens, over HTTP on the CPU."""

from __future__ import annotations

import http.client
import json
import os
import threading
from typing import Any, List

import metal_plugin
import pytest
from local_model import write_local_model
from servers import REQUEST_TIMEOUT, Server, ids, serving, words

EOS = 255  # the local tokenizer's end token at the tiny models' vocabulary of 256


def stream(port: int, prompt: List[int], max_tokens: int, chunks: List[Any]) -> None:
    """A streaming completion at temperature 0 that never ends early; every
    chunk with text appended to ``chunks`` as it arrives."""
    body = {"prompt": words(prompt), "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "logit_bias": {str(EOS): -1000.0}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data:") and line != "data: [DONE]":
            text = (json.loads(line[5:])["choices"] or [{}])[0].get("text")
            if text:
                chunks.append(text)
    conn.close()


def test_a_request_joins_a_running_stream_within_a_few_of_its_tokens(tmp_path):
    if os.environ.get(metal_plugin.EMULATOR_ENV):
        pytest.skip("the server runs the command itself, which does not install the tests' "
                    "Metal emulator")
    model = write_local_model(tmp_path / "muse")
    server = Server(model, tmp_path / "serve.log", "--prompt-cache-size", "0")
    with serving({"s": server}):
        running: List[str] = []
        first = threading.Thread(target=stream, args=(server.port, ids(12, 1), 230, running))
        first.start()
        for _ in range(2000):  # bounded wait for the stream to be under way
            if len(running) >= 5 or not first.is_alive():
                break
            first.join(0.005)
        waits = []
        for seed in (2, 3, 4):  # three joins: a 0.5 s window may end early by chance once
            joined: List[str] = []
            sent = len(running)
            second = threading.Thread(target=stream, args=(server.port, ids(10, seed), 4, joined))
            second.start()
            for _ in range(20000):  # until the joining request's first token
                if joined or not second.is_alive():
                    break
                second.join(0.001)
            waits.append(len(running) - sent)
            second.join(REQUEST_TIMEOUT)
            assert len(joined) == 4, server.log()
        first.join(REQUEST_TIMEOUT)
        assert len(running) == 230, server.log()
        # the running stream's tokens while each request waited for its first
        assert max(waits) <= 12, waits  # mlx-lm alone: up to 0.5 s of its tokens
