"""``muser-kv serve`` as a plain HTTP client finds it on a machine that serves a
local model directory: no Hugging Face hub cache, clients that go away
mid-stream, chat messages without content.

One server (the real command in a subprocess, ``tests/servers.py``) over the
tiny random-weight Muse Glimmer of ``local_model`` (its 256 positions), with
``HF_HUB_CACHE`` and ``HF_HOME`` pointing at directories that do not exist,
and no prompt cache (``--prompt-cache-size 0``: a request gives the tokens it
gives alone, whatever came before it). A request with a ``seed`` runs on
mlx-lm's one-at-a-time path, one without on its batched path.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List

import metal_plugin
import pytest
from local_model import write_local_model
from servers import REQUEST_TIMEOUT, Server, openai_error, words

CONTEXT = 256  # local_model's max_position_embeddings: the server's --max-context
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_local_model(tmp_path_factory.mktemp("model") / "muse")


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    """Where the server's hub cache would be: nothing there when it starts."""
    return tmp_path_factory.mktemp("hub") / "hub-cache"


@pytest.fixture(scope="module")
def server(model_dir, hub, tmp_path_factory) -> Iterator[Server]:
    if os.environ.get(metal_plugin.EMULATOR_ENV):
        pytest.skip("the server runs the command itself, which does not install the tests' "
                    "Metal emulator")
    home = tmp_path_factory.mktemp("home") / "hf-home"
    s = Server(model_dir, tmp_path_factory.mktemp("logs") / "serve.log", "--prompt-cache-size",
               "0", env={"HF_HUB_CACHE": str(hub), "HF_HOME": str(home)})
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def models(server: Server) -> Dict[str, Any]:
    """``GET /v1/models``: the JSON it answers (an empty body fails here)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/models",
                                timeout=REQUEST_TIMEOUT) as r:
        assert r.status == 200
        body = r.read()
    assert body, f"/v1/models answered 200 with an empty body\n{server.log()}"
    return json.loads(body)


def write_hub_repo(hub: Path, repo_id: str) -> None:
    """A model in the hub cache's layout, with the files by which mlx-lm's
    ``/v1/models`` takes a repo for an mlx-lm model."""
    commit = "0" * 40
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors.index.json", "tokenizer_config.json"):
        (snapshot / name).write_text("{}")


def test_models_lists_the_served_model_with_no_hub_cache(server, model_dir, hub):
    """No hub cache (mlx-lm's scan raises CacheNotFound after the 200 is sent):
    the list holds the served model, as mlx-lm names it (its resolved path).
    Once a hub cache holds an mlx-lm model, mlx-lm's listing of it is there too."""
    served = {"id": str(model_dir.resolve()), "object": "model"}
    assert not hub.exists()
    listed = models(server)
    assert listed["object"] == "list"
    assert [{k: m[k] for k in served} for m in listed["data"]] == [served]
    write_hub_repo(hub, "mlx-community/tiny-muse")
    ids = [m["id"] for m in models(server)["data"]]
    assert sorted(ids) == sorted(["mlx-community/tiny-muse", served["id"]])
    assert "Traceback" not in server.whole_log()


def completion(**extra: Any) -> Dict[str, Any]:
    return dict({"prompt": words(PROMPT), "max_tokens": 8, "temperature": 0,
                 "logprobs": True}, **extra)


def tokens(out: Dict[str, Any]) -> List[int]:
    return [t["id"] for t in out["choices"][0]["logprobs"]["content"]]


def drop_after_first_chunk(server: Server, body: Dict[str, Any]) -> None:
    """Stream ``body``, read up to its first generated chunk, and hang up."""
    data = json.dumps(dict(body, stream=True)).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=REQUEST_TIMEOUT) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(data) + data)
        got = b""
        while b"\ndata: {" not in got:
            chunk = s.recv(4096)
            assert chunk, f"the stream ended before its first chunk: {got!r}"
            got += chunk
        assert got.startswith(b"HTTP/1.0 200"), got[:200]


WENT_AWAY = re.compile(r"client went away after (\d+) of at most (\d+) tokens; its generation "
                       r"is stopped")


@pytest.mark.parametrize("path", [{}, {"seed": 0}], ids=["batched", "one-at-a-time"])
def test_a_dropped_stream_stops_its_generation_and_the_next_request_runs(server, path):
    """A client reads the first chunk of a stream that could run to the
    context and hangs up: the log gets one line for it (no traceback) saying
    how many tokens it generated, far fewer than it could have, and the
    next request gives the tokens it gives alone."""
    alone = tokens(server.post("/v1/completions", completion(**path)))
    before = len(server.whole_log())
    drop_after_first_chunk(server, completion(max_tokens=100_000, **path))
    after = tokens(server.post("/v1/completions", completion(**path)))
    assert after == alone
    deadline = time.monotonic() + REQUEST_TIMEOUT  # the line may follow the next answer
    while not WENT_AWAY.search(server.whole_log()[before:]) and time.monotonic() < deadline:
        time.sleep(0.05)
    log = server.whole_log()[before:]
    lines = [line for line in log.splitlines() if "went away" in line]
    assert len(lines) == 1, log
    assert "Traceback" not in log and "BrokenPipe" not in log, log
    generated, most = map(int, WENT_AWAY.search(lines[0]).groups())
    assert most == CONTEXT - len(PROMPT)  # max_tokens, cut to the context
    assert 0 < generated < most // 4, lines[0]
    assert server.get("/health") == 200


def chat(*messages: Dict[str, Any]) -> Dict[str, Any]:
    return {"messages": list(messages), "max_tokens": 3, "temperature": 0}


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "lookup", "arguments": json.dumps({"word": "t9"})}}
NEEDS_CONTENT = ("must be a string or a list of content parts, got {came} (only an assistant "
                 "message with tool_calls may have none; this is a \"{role}\" message)")


@pytest.mark.parametrize("body, at, came, role", [
    (chat({"role": "user"}), 0, "no content", "user"),
    (chat({"role": "user", "content": None}), 0, "null", "user"),
    (chat({"role": "system"}, {"role": "user", "content": "t5"}), 0, "no content", "system"),
    (chat({"role": "user", "content": "t5"}, {"role": "assistant"},
          {"role": "user", "content": "t6"}), 1, "no content", "assistant"),
    (chat({"role": "user", "content": "t5"}, {"role": "assistant", "tool_calls": [CALL]},
          {"role": "tool", "tool_call_id": "call_1"}), 2, "no content", "tool"),
], ids=["user", "user-null", "system", "assistant-without-tool-calls", "tool"])
def test_a_message_without_content_is_refused_naming_it(server, body, at, came, role):
    status, out = server.send("/v1/chat/completions", body)
    assert (status, out) == (400, openai_error(f"messages[{at}].content "
                                               + NEEDS_CONTENT.format(came=came, role=role)))


@pytest.mark.parametrize("content", ["absent", None])
def test_an_assistant_message_with_tool_calls_needs_no_content(server, content):
    assistant: Dict[str, Any] = {"role": "assistant", "tool_calls": [CALL]}
    if content != "absent":
        assistant["content"] = content
    out = server.post("/v1/chat/completions", chat(
        {"role": "user", "content": "t5 t6"}, assistant,
        {"role": "tool", "tool_call_id": "call_1", "content": "t7"},
        {"role": "user", "content": "t8"}))
    assert out["choices"][0]["finish_reason"] in ("stop", "length")
