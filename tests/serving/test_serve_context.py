"""``muser-kv serve --context-policy``, as a client sees it: the real command
in a subprocess (tests/servers.py) over a tiny random-weight Muse Glimmer,
``--max-context 128``, greedy, answers read as token ids from ``logprobs``.

The local chat template renders a chat as every message's words and one
generation marker, so a chat's prompt has (its words + 1) tokens. ``shift``
drops the oldest whole turns of a chat whose prompt and ``max_tokens`` do not
fit, and its answer is the answer to the chat with those turns dropped by hand
(sent to a server that keeps no prompt cache); ``error`` and an impossible fit
(the system messages and the newest turn alone leave no room) get 400 naming
the context; the server goes on serving, and a request on another chat sent
at the same time gets its solo tokens."""

from __future__ import annotations

import http.client
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Sequence, Tuple

import metal_plugin
import pytest
from local_model import write_local_model
from servers import REQUEST_TIMEOUT, Server, ids, serving, words

CONTEXT = 128
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """``shift`` (the default policy, ``--context-keep 4``) and ``error`` (no
    prompt cache: every answer a prefill from nothing), stopped in any case."""
    if os.environ.get(metal_plugin.EMULATOR_ENV):
        pytest.skip("the servers run the command itself, which does not install the tests' "
                    "Metal emulator")
    model = write_local_model(tmp_path_factory.mktemp("model") / "muse")
    logs = tmp_path_factory.mktemp("logs")
    context = ("--max-context", str(CONTEXT))
    with serving({"shift": Server(model, logs / "shift.log", *context, "--context-keep", "4"),
                  "error": Server(model, logs / "error.log", *context, "--context-policy",
                                  "error", "--prompt-cache-size", "0")}) as started:
        yield started



def message(role: str, n: int, seed: int) -> Dict[str, str]:
    return {"role": role, "content": words(ids(n, seed))}


def ask(server: Server, path: str, body: Dict[str, Any]) -> Tuple[int, Dict[str, str], Any]:
    """(status, the response's headers, its JSON body)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_TIMEOUT)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), json.loads(r.read() or b"null")
    finally:
        conn.close()


def answered(server: Server, path: str, body: Dict[str, Any]) -> Tuple[Dict[str, str], Any]:
    status, headers, out = ask(server, path, dict(body, temperature=0, logprobs=True))
    assert status == 200, f"{status} {out}\n{server.log()}"
    return headers, out


def tokens(out: Dict[str, Any]) -> List[int]:
    return [t["id"] for t in out["choices"][0]["logprobs"]["content"]]


#: a system message, then three turns (the first with a tool exchange attached):
#: 20 + (30 + 4 + 4 + 10) + (30 + 10) + 20 words, 129 tokens with the marker
SYSTEM = [message("system", 20, 1)]
TURNS = [[message("user", 30, 2), message("assistant", 4, 3), message("tool", 4, 4),
          message("assistant", 10, 5)],
         [message("user", 30, 6), message("assistant", 10, 7)],
         [message("user", 20, 8)]]


def chat(turns: Sequence[List[Dict[str, str]]]) -> List[Dict[str, str]]:
    return SYSTEM + [m for turn in turns for m in turn]


@pytest.mark.parametrize("max_tokens, dropped", [(10, 1), (60, 2)])
def test_a_shifted_chat_answers_as_the_chat_with_its_oldest_turns_dropped(servers, max_tokens,
                                                                           dropped):
    """A 129-token chat asking for 10 tokens of a 128-token context: its first
    turn, tool messages and all, goes; asking for 60: its first two go. The answer is
    the one the chat with those turns dropped by hand gets, and the response
    says how many turns went and how many prompt tokens were served."""
    kept = chat(TURNS[dropped:])
    kept_tokens = sum(len(m["content"].split()) for m in kept) + 1
    headers, out = answered(servers["shift"], CHAT, {"messages": chat(TURNS),
                                                     "max_tokens": max_tokens})
    _, by_hand = answered(servers["error"], CHAT, {"messages": kept, "max_tokens": max_tokens})
    assert tokens(out) == tokens(by_hand)
    assert out["choices"][0]["finish_reason"] == by_hand["choices"][0]["finish_reason"]
    assert headers["X-Muser-Turns-Dropped"] == str(dropped)
    assert headers["X-Muser-Prompt-Tokens"] == str(kept_tokens)
    assert out["usage"]["prompt_tokens"] == kept_tokens
    # a chat that fits is served whole, and says so
    headers, _ = answered(servers["shift"], CHAT, {"messages": kept, "max_tokens": max_tokens})
    assert headers["X-Muser-Turns-Dropped"] == "0"


def test_a_streamed_shifted_chat_says_what_was_dropped(servers):
    status, headers, _ = stream(servers["shift"], {"messages": chat(TURNS), "max_tokens": 10})
    assert status == 200
    assert headers["X-Muser-Turns-Dropped"] == "1"


def stream(server: Server, body: Dict[str, Any]) -> Tuple[int, Dict[str, str], str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_TIMEOUT)
    try:
        conn.request("POST", CHAT, json.dumps(dict(body, stream=True, temperature=0)),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read().decode()
    finally:
        conn.close()


def test_error_and_an_impossible_fit_are_refused_and_the_server_goes_on(servers):
    """Under ``error`` a chat whose prompt leaves no room is refused with the
    context named; under ``shift`` so is one whose system message and newest
    turn alone leave none (nothing it may drop makes it fit). A request on
    another chat sent with them gets its solo tokens, and both servers go on."""
    too_long = chat(TURNS[:2] + [[message("user", 60, 9)]])  # 169 tokens
    impossible = SYSTEM + [message("user", 110, 10)]  # 131 tokens
    other = {"messages": [message("system", 8, 11), message("user", 16, 12)], "max_tokens": 8}
    _, solo = answered(servers["shift"], CHAT, other)
    with ThreadPoolExecutor(3) as pool:
        normal = pool.submit(answered, servers["shift"], CHAT, other)
        refused = list(pool.map(lambda a: ask(servers[a[0]], CHAT, a[1]), [
            ("error", {"messages": too_long, "max_tokens": 10}),
            ("shift", {"messages": impossible, "max_tokens": 10})]))
        assert tokens(normal.result()[1]) == tokens(solo)
    (status, _, error), (shift_status, _, impossible_error) = refused
    assert status == 400
    assert error["error"]["message"].startswith(f"prompt has 169 tokens; this server's context is "
                                     f"{CONTEXT} tokens")
    assert shift_status == 400
    assert impossible_error["error"]["message"].startswith(
        f"the system messages and the newest turn have 131 tokens; this server's context is "
        f"{CONTEXT} tokens")
    # the shift server serves the too-long chat: its first two turns go
    headers, _ = answered(servers["shift"], CHAT, {"messages": too_long, "max_tokens": 10})
    assert headers["X-Muser-Turns-Dropped"] == "2"
    for s in servers.values():
        assert tokens(answered(s, CHAT, other)[1]) == tokens(solo)


def test_a_raw_prompt_that_leaves_no_room_keeps_its_head_and_newest_tokens(servers):
    """A 140-token completion prompt, 10 answer tokens: the first 4 tokens
    (``--context-keep 4``) and the newest 114 are kept, the answer that prompt
    gets sent whole; a prompt that leaves room is served whole, max_tokens cut
    to what fits (finish_reason "length")."""
    prompt = ids(140, 20)
    kept = prompt[:4] + prompt[140 - 114:]
    body = {"max_tokens": 10}
    headers, out = answered(servers["shift"], "/v1/completions", dict(body, prompt=words(prompt)))
    _, by_hand = answered(servers["error"], "/v1/completions", dict(body, prompt=words(kept)))
    assert tokens(out) == tokens(by_hand)
    assert (headers["X-Muser-Tokens-Dropped"], headers["X-Muser-Prompt-Tokens"]) == ("22", "118")
    assert out["usage"]["prompt_tokens"] == 118
    headers, out = answered(servers["shift"], "/v1/completions",
                            dict(body, prompt=words(prompt[:120])))
    assert headers["X-Muser-Tokens-Dropped"] == "0"
    assert (len(tokens(out)), out["choices"][0]["finish_reason"]) == (8, "length")
