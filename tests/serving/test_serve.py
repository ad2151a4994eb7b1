"""``muser-kv serve``: mlx-lm's server with muser-kv's caches, as a client sees it.

Each server is the real command (``python -m muser_kv serve``) in a
subprocess on a free loopback port, importing this checkout (PYTHONPATH = the
repository root), over a tiny random-weight Muse Glimmer written to disk
(``local_model``: window 16, so every prompt here wraps every ring). Requests
are greedy; tokens are read from ``logprobs`` (ids).

* Concurrent requests (completions and chat, 4 at once) each give the tokens
  of the same request sent alone: batched (no draft model), and one at a time
  (with a draft model, where mlx-lm's server does not batch). These servers
  keep no prompt cache (``--prompt-cache-size 0``), so a request sent alone
  and the same request sent with others both prefill from nothing: a reused
  entry would sum attention in another order and could flip a near-tie.
* With the prompt cache, a returning conversation reuses a wrapped entry
  trimmed within its exact depth (mlx-lm's rotating caches cannot: they
  re-prefill from the last stored prefix), passes over one beyond it with the
  same tokens a fresh server gives, and a prompt equal to a stored entry (a
  "continue" request, which kills mlx-lm 0.32.2's batched generation thread)
  is answered.
* The context and the body, while other requests run: ``batched`` and
  ``draft`` hold ``CONTEXT`` positions (``--max-context``). A prompt that
  cannot fit gets 400 naming the limit before it runs; one that fits but asks
  for more tokens than remain ends with ``finish_reason`` "length" after
  exactly the tokens that fit (streamed or not); a body field of the wrong type
  gets 400 naming it. mlx-lm 0.32.2's server loses its generation thread to
  each of these (``ContextOverflow`` mid-batch, ``"stop": 5``); here the next
  request gets its solo tokens.
* The speculative path (in-process, as the server drives it): the cache it
  leaves may hold one token fewer than its key; the entry is keyed by what it
  holds.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import metal_plugin
import pytest
from local_model import write_local_model
from servers import REQUEST_TIMEOUT, START_TIMEOUT, Server, ids, openai_error, serve_args, serving, words

import muser_kv
from muser_kv.serving.server import provider, serve, serve_flags
from muser_kv.serving.server.prompt_cache import ExactPromptCache

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = 64  # --max-context of the batched and draft servers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_local_model(tmp_path_factory.mktemp("model") / "muse")


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """Three servers, started together (their start-up overlaps), stopped in
    any case: ``batched`` and ``draft`` keep no prompt cache and hold
    ``CONTEXT`` positions, ``cached`` keeps one (and the model's 256)."""
    if os.environ.get(metal_plugin.EMULATOR_ENV):
        pytest.skip("the servers run the command itself, which does not install the tests' "
                    "Metal emulator; its caches run emulated in-process (test_batch, "
                    "test_prompt_cache)")
    logs = tmp_path_factory.mktemp("logs")
    # --context-policy error: these servers refuse a prompt that cannot fit, as
    # the tests below check (the shift is test_serve_context's)
    context = ("--max-context", str(CONTEXT), "--context-policy", "error",
               "--allow-model-loading")  # some tests below ask for other models
    flags = {"batched": ("--prompt-cache-size", "0", *context),
             "draft": ("--prompt-cache-size", "0", "--draft-model", str(model_dir),
                       "--num-draft-tokens", "3", *context),
             "cached": ("--retain", "16")}  # depths of 16 to ~48: the trims below are past them
    with serving({name: Server(model_dir, logs / f"{name}.log", *extra)
                  for name, extra in flags.items()}) as started:
        yield started



def complete(server: Server, prompt: Sequence[int], max_tokens: int = 10):
    out = server.post("/v1/completions", {"prompt": words(prompt), "max_tokens": max_tokens,
                                          "temperature": 0, "logprobs": True})
    got = [t["id"] for t in out["choices"][0]["logprobs"]["content"]]
    return got, out["usage"].get("prompt_tokens_details", {}).get("cached_tokens")


def chat(server: Server, system: Sequence[int], user: Sequence[int], max_tokens: int = 10):
    out = server.post("/v1/chat/completions", {
        "messages": [{"role": "system", "content": words(system)},
                     {"role": "user", "content": words(user)}],
        "max_tokens": max_tokens, "temperature": 0, "logprobs": True})
    assert out["object"] == "chat.completion"
    return [t["id"] for t in out["choices"][0]["logprobs"]["content"]], None


REQUESTS = [("complete", (ids(37, 1),)), ("chat", (ids(9, 2), ids(30, 3))),
            ("complete", (ids(45, 4),)), ("chat", (ids(20, 5), ids(21, 6)))]


def send(server: Server, request) -> List[int]:
    kind, args = request
    tokens, _ = (complete if kind == "complete" else chat)(server, *args)
    assert len(tokens) == 10
    return tokens


@pytest.mark.parametrize("name", ["batched", "draft"])
def test_concurrent_requests_give_their_solo_tokens(servers, name):
    server = servers[name]
    solo = [send(server, r) for r in REQUESTS]
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        together = list(pool.map(lambda r: send(server, r), REQUESTS))
    assert together == solo
    assert len({tuple(t) for t in solo}) == len(solo)  # four different answers


def test_a_draft_deeper_than_the_exact_rollback_is_refused_before_it_runs(servers):
    """The draft server rolls back exactly 64 rows (--retain 64 >= --num-draft-tokens
    3): a request asking for 65 draft tokens gets mlx-lm's 400 for an invalid
    parameter, naming the limit, before any token; 64 is served, with the
    tokens greedy decoding gives, and the server goes on serving."""
    server = servers["draft"]
    body = {"prompt": words(ids(37, 1)), "max_tokens": 10, "temperature": 0, "logprobs": True}
    status, out = server.send("/v1/completions", dict(body, num_draft_tokens=65))
    assert status == 400, (status, out)
    message = out["error"]["message"]
    assert "num_draft_tokens must be at most 64" in message and "got 65" in message
    deep = server.post("/v1/completions", dict(body, num_draft_tokens=64))
    got = [t["id"] for t in deep["choices"][0]["logprobs"]["content"]]
    assert got == send(servers["batched"], REQUESTS[0])


def test_a_returning_conversation_reuses_wrapped_entries_exactly(servers):
    server = servers["cached"]
    first = ids(64, 10)
    answer, cached = complete(server, first)
    assert cached == 0
    # back with the answer less its last 3 tokens, then more: the stored turn
    # (74 tokens, rings wrapped) is trimmed by 3, exactly; mlx-lm's rotating
    # caches cannot trim past the wrap and would reuse only the prompt's 63
    second = first + answer[:7] + ids(6, 11)
    _, cached = complete(server, second)
    assert cached == 71
    # a conversation that shares 3 tokens: no entry trims back that far
    third = first[:3] + ids(30, 12)
    tokens, cached = complete(server, third)
    assert cached == 0
    assert tokens == complete(servers["batched"], third)[0]  # what a fresh server gives
    # a prompt equal to a stored entry (prompt + answer: "continue"), reused one short
    _, cached = complete(server, first + answer)
    assert cached == 73
    assert server.get("/health") == 200


def test_a_request_for_a_model_muser_kv_cannot_serve_fails_alone(servers, model_dir):
    llama = write_local_model(model_dir.parent / "llama", model_type="llama")
    server = servers["batched"]
    before = send(server, REQUESTS[0])
    status, out = server.send("/v1/completions", {"model": str(llama), "prompt": "t1 t2",
                                                  "max_tokens": 2})
    assert status != 200 and "has no sliding-window layers" in out["error"]["message"]
    assert send(server, REQUESTS[0]) == before  # the Muse model is served again, as before


# -- the context and the body: refused or cut, and the server keeps serving ---------------------


@pytest.fixture(scope="module")
def solo(servers) -> Dict[str, List[int]]:
    """``REQUESTS[0]``'s tokens on the batched and draft servers, sent alone:
    what the next request after a refusal must give."""
    return {name: send(servers[name], REQUESTS[0]) for name in ("batched", "draft")}


def completion(prompt: Sequence[int], max_tokens: int, **extra: Any) -> Dict[str, Any]:
    return dict({"prompt": words(prompt), "max_tokens": max_tokens, "temperature": 0,
                 "logprobs": True}, **extra)


def answer(out: Dict[str, Any]) -> Tuple[List[int], str]:
    """(token ids, finish_reason) of a completion."""
    choice = out["choices"][0]
    return [t["id"] for t in choice["logprobs"]["content"]], choice["finish_reason"]


def open_stream(server: Server, body: Dict[str, Any]):
    """A streamed completion, its headers read: (connection, its events)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_TIMEOUT)
    conn.request("POST", "/v1/completions",
                 json.dumps(dict(body, stream=True, stream_options={"include_usage": True})),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, (response.status, response.read())

    def events() -> Iterator[Dict[str, Any]]:
        for line in response:  # server-sent events; ": keepalive" lines are comments
            if line.startswith(b"data: [DONE]"):
                return
            if line.startswith(b"data: "):
                yield json.loads(line[len(b"data: "):])
        raise AssertionError("the stream ended without [DONE]")

    return conn, events()


def streamed(events) -> Tuple[str, Optional[str], Optional[int]]:
    """(text, finish_reason, completion_tokens) of a stream's events."""
    text, finish, tokens = "", None, None
    for event in events:
        for choice in event["choices"]:
            text += choice.get("text", "")
            finish = choice["finish_reason"] or finish
        tokens = event.get("usage", {}).get("completion_tokens", tokens)
    return text, finish, tokens


def refused_for_context(n: int) -> str:
    return (f"prompt has {n} tokens; this server's context is {CONTEXT} tokens (--max-context), "
            f"so a prompt must have fewer than {CONTEXT}")


@pytest.mark.parametrize("name", ["batched", "draft"])
def test_a_prompt_that_cannot_fit_is_refused_while_others_run(servers, solo, name):
    """While a stream runs to the end of the context: a prompt of CONTEXT tokens
    (no position left to generate into) and a longer chat get 400 naming the
    limit, a body with ``"stop": 5`` gets 400 naming the field, a normal request
    sent with them gets its solo tokens; the stream ends with "length" after
    the CONTEXT - 8 tokens that fit, the text the same request gives unstreamed."""
    server = servers[name]
    streaming = completion(ids(8, 30), 1000)
    unstreamed = server.post("/v1/completions", dict(streaming, max_tokens=CONTEXT - 8))
    refusals = [
        ("/v1/completions", completion(ids(CONTEXT, 31), 3), refused_for_context(CONTEXT)),
        ("/v1/chat/completions",
         {"messages": [{"role": "system", "content": words(ids(40, 32))},
                       {"role": "user", "content": words(ids(30, 33))}], "max_tokens": 3},
         refused_for_context(40 + 30 + 1)),  # the template adds t1, the generation prompt
        ("/v1/completions", completion(ids(10, 34), 3, stop=5),
         "stop must be a string, a list of strings or null, got 5"),
    ]
    conn, events = open_stream(server, streaming)
    try:
        first = next(events)  # generating
        with ThreadPoolExecutor(len(refusals) + 1) as pool:
            normal = pool.submit(send, server, REQUESTS[0])
            answers = list(pool.map(lambda r: server.send(r[0], r[1]), refusals))
            assert answers == [(400, openai_error(message)) for _, _, message in refusals]
            assert normal.result() == solo[name]
        text, finish, tokens = streamed([first, *events])
    finally:
        conn.close()
    assert (finish, tokens) == ("length", CONTEXT - 8)
    assert text == unstreamed["choices"][0]["text"]
    assert send(server, REQUESTS[0]) == solo[name]


@pytest.mark.parametrize("name", ["batched", "draft"])
def test_a_generation_that_reaches_the_context_ends_with_length(servers, solo, name):
    """Prompts that fit, asking for more tokens than remain, sent together: each
    gets 200 with exactly CONTEXT - prompt tokens and finish_reason "length", the
    tokens the same request gives asking for exactly those; down to a prompt one
    short of CONTEXT, which gets one token."""
    server = servers[name]
    asks = [(ids(50, 40), 100), (ids(CONTEXT - 1, 41), 5), (ids(30, 42), CONTEXT)]
    exact = [answer(server.post("/v1/completions", completion(p, CONTEXT - len(p))))
             for p, _ in asks]
    assert [(len(t), f) for t, f in exact] == [(CONTEXT - len(p), "length") for p, _ in asks]
    with ThreadPoolExecutor(len(asks) + 1) as pool:
        normal = pool.submit(send, server, REQUESTS[0])
        cut = list(pool.map(lambda a: answer(server.post("/v1/completions", completion(*a))),
                            asks))
        assert normal.result() == solo[name]
    assert cut == exact
    assert send(server, REQUESTS[0]) == solo[name]


@pytest.mark.parametrize("name", ["batched", "draft"])
def test_the_generation_thread_admits_what_the_handler_could_not(servers, solo, model_dir,
                                                                 name):
    """A request for a model not loaded yet (the same weights under another
    path: another model key) reaches the generation thread unchecked, since the
    handler has no limits for it: the thread refuses the prompt that cannot
    fit with the same 400 and cuts the one that would pass the context; then
    the default model is loaded back and serves its solo tokens."""
    server = servers[name]
    alias = model_dir.parent / f"alias-{name}"
    alias.symlink_to(model_dir)
    status, out = server.send("/v1/completions",
                              completion(ids(CONTEXT + 5, 60), 3, model=str(alias)))
    assert (status, out) == (400, openai_error(refused_for_context(CONTEXT + 5)))
    tokens, finish = answer(server.post("/v1/completions",
                                        completion(ids(60, 61), 10, model=str(alias))))
    assert (len(tokens), finish) == (CONTEXT - 60, "length")
    assert send(server, REQUESTS[0]) == solo[name]


def chat_body(**extra: Any) -> Dict[str, Any]:
    return dict({"messages": [{"role": "user", "content": words(ids(10, 50))}],
                 "max_tokens": 3, "temperature": 0}, **extra)


CHAT = "/v1/chat/completions"

#: (server, endpoint, body, the whole error): each kills mlx-lm 0.32.2's
#: generation thread, or leaves the request without a whole answer, or is
#: served as something else, or is refused naming neither what was expected
#: nor what came
WRONG_BODIES = [
    ("batched", None, completion(ids(10, 50), 3, stop=[" t3", 5]),
     'stop must be a string, a list of strings or null, got [" t3", 5]'),
    ("draft", None, completion(ids(10, 50), 3, stop=5),
     "stop must be a string, a list of strings or null, got 5"),
    ("batched", None, completion(ids(10, 50), True), "max_tokens must be an integer, got true"),
    ("batched", None, completion(ids(10, 50), 3, max_completion_tokens="5"),
     'max_completion_tokens must be an integer or null, got "5"'),
    ("batched", None, completion(ids(10, 50), 3, temperature=float("nan")),
     "temperature must be a finite number, got NaN"),
    ("batched", None, completion(ids(10, 50), 3, top_logprobs=True),
     "top_logprobs must be an integer, got true"),
    ("batched", None, completion(ids(10, 50), 3, seed=-1),
     "seed must be an integer from 0 to 2**64 - 1, or null, got -1"),
    ("draft", None, completion(ids(10, 50), 3, num_draft_tokens=True),
     "num_draft_tokens must be an integer, got true"),
    ("batched", None, dict(completion(ids(10, 50), 3), prompt=["t1"]),
     'prompt must be a string, got ["t1"]'),
    ("batched", None, dict(completion(ids(10, 50), 3), prompt=""),
     "prompt has 0 tokens; a request needs at least one"),
    ("batched", None, completion(ids(10, 50), 3, temperature=0.5, top_k=256),
     "top_k must be less than 256 (the model's vocabulary), got 256"),
    ("batched", None, completion(ids(10, 50), 3, logit_bias={"9999": 1}),
     "logit_bias token ids must be less than 256 (the model's vocabulary), got 9999"),
    ("batched", None, completion(ids(10, 50), 3, logit_bias={"-1": 1}),
     'logit_bias keys must be token ids (decimal integers >= 0), got "-1"'),
    ("batched", None, completion(ids(10, 50), 3, stream=True, stream_options=5),
     'stream_options must be null or an object whose "include_usage" is true or false, got 5'),
    ("batched", CHAT, chat_body(messages="t1 t2"),
     'messages must be a non-empty list of messages, got "t1 t2"'),
    ("draft", CHAT, chat_body(messages=[{"role": "user", "content": 5}]),
     "messages[0].content must be a string or a list of content parts, got 5"),
    ("batched", CHAT, chat_body(tools=5), "tools must be a list of objects or null, got 5"),
]


@pytest.mark.parametrize("name, path, body, error", WRONG_BODIES,
                         ids=[e.split(" must ")[0].split(" has ")[0] for *_, e in WRONG_BODIES])
def test_a_body_field_of_the_wrong_type_is_refused_naming_it(servers, solo, name, path, body,
                                                             error):
    server = servers[name]
    assert server.send(path or "/v1/completions", body) == (400, openai_error(error))
    assert send(server, REQUESTS[0]) == solo[name]


# -- in-process: what the command is made of ----------------------------------------------------


def test_the_provider_installs_muser_kv_on_every_model_it_loads(model_dir):
    args = parse(["--model", str(model_dir), "--retain", "5", "--draft-model", str(model_dir),
                  "--num-draft-tokens", "7"])
    provider = serve.MuseModelProvider(args)
    model, _ = provider.load("default_model", None, "default_model")
    for m in (model, provider.draft_model):
        assert muser_kv.installed(m).retain == 7  # raised to the draft length
        assert isinstance(m.make_cache()[0], muser_kv.MuseKVCache)
    assert not provider.is_batchable  # mlx-lm's rule: a draft model is served alone
    plain = serve.MuseModelProvider(parse(["--model", str(model_dir), "--max-context", "64"]))
    plain.load("default_model")
    assert plain.is_batchable and muser_kv.installed(plain.model).max_context == 64


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_queued(model_dir):
    """The handler's thread refuses it (``MuseResponseGenerator.generate``, by
    the loaded model's ``limits``): the generation thread never sees it, so the
    refusal waits for no generation in flight (one at a time, all of it)."""
    from mlx_lm.server import CompletionRequest, ModelDescription

    provider = serve.MuseModelProvider(parse(["--model", str(model_dir), "--max-context", "16",
                                              "--context-policy", "error"]))  # no compaction
    generator = serve.MuseResponseGenerator(provider, ExactPromptCache())
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while provider.limits is None:  # the generation thread loads the default model
            assert time.monotonic() < deadline and generator.generation_available()
            time.sleep(0.05)
        assert (provider.limits.max_context, provider.limits.vocab_size) == (16, 256)

        def put(item, *args, **kwargs):
            raise AssertionError("queued")

        generator.requests.put = put
        args = SimpleNamespace(model=ModelDescription("default_model", "default_model", None),
                               sampling=SimpleNamespace(top_k=0),
                               logits=SimpleNamespace(logit_bias=None), max_tokens=5)
        fits, too_long = (CompletionRequest("text", words(ids(n, 70)), [], None, None)
                          for n in (15, 16))
        with pytest.raises(serve.RequestRefused, match="prompt has 16 tokens"):
            generator.generate(too_long, args)
        with pytest.raises(AssertionError, match="queued"):  # one that fits goes on
            generator.generate(fits, args)
    finally:
        generator.stop_and_join()


def test_the_provider_decides_batchability_without_building_a_cache(tmp_path, monkeypatch):
    """A preallocated cache list holds max_context rows per global plane (1.8 GB
    at 131k): loading a model builds none to decide batchability, yet the
    provider batches it. The one list a load builds is the warm-up's, which
    grows to its few hundred tokens only."""
    install_module = sys.modules["muser_kv.serving.install"]  # the module (the package exports its function)
    built = []
    real = install_module.make_cache_for

    def counted(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(install_module, "make_cache_for", counted)
    model_dir = write_local_model(tmp_path / "muse", max_position_embeddings=4096)
    provider = serve.MuseModelProvider(parse(["--model", str(model_dir)]))
    provider.load("default_model")
    assert provider.is_batchable and len(built) == 2  # the warm-up's
    whole = muser_kv.make_prompt_cache(provider.model, max_context=4096, preallocate=True)
    for warm in built:
        assert sum(c.nbytes for c in warm) * 2 <= sum(c.nbytes for c in whole)
    provider.model.make_cache()
    assert len(built) == 3  # the counter sees a build


def test_a_draft_model_muser_kv_does_not_serve_keeps_mlx_lm_caches(model_dir):
    llama = write_local_model(model_dir.parent / "llama-draft", model_type="llama")
    provider = serve.MuseModelProvider(parse(["--model", str(model_dir), "--draft-model",
                                              str(llama)]))
    provider.load("default_model", None, "default_model")
    assert muser_kv.installed(provider.model) is not None
    assert muser_kv.installed(provider.draft_model) is None
    assert not isinstance(provider.draft_model.make_cache()[0], muser_kv.MuseKVCache)


def parse(argv: List[str]) -> Any:
    return serve_args(argv)


def test_mlx_lm_flags_and_muser_kv_flags_parse_together(model_dir):
    args = parse(["--model", str(model_dir), "--port", "9", "--max-context", "128", "--retain",
                  "0", "--plane-dtype", "bfloat16", "--decode-concurrency", "4"])
    assert (args.port, args.max_context, args.retain, args.plane_dtype,
            args.decode_concurrency) == (9, 128, 0, "bfloat16", 4)
    assert parse(["--model", str(model_dir)]).retain == muser_kv.DEFAULT_RETAIN


@pytest.mark.parametrize("argv, message", [
    (["--kv-bits", "4"], "--kv-bits quantizes"),
    (["--retain", "-1"], "--retain: expected an int >= 0"),
    (["--max-context", "0"], "--max-context: expected a positive int"),
    (["--retain", "0", "--draft-model", "d"], "a --draft-model needs --retain >= "),
])
def test_bad_flags_are_refused_by_the_parser(model_dir, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        serve.main(["--model", str(model_dir), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_cuda_attention_defaults_to_mlx_kernels_unless_the_switch_is_set():
    """Identical repeats on MLX CUDA need MLX's own attention kernels: the
    default sets MLX's switch to 0; an explicit flag sets it either way; an
    environment that already chose is left as it is."""
    switch = serve_flags.CUDNN_SWITCH
    for environ, flag, want, value in [
            ({}, None, "mlx", "0"), ({}, "cudnn", "cudnn", "1"), ({}, "mlx", "mlx", "0"),
            ({switch: "1"}, None, "cudnn", "1"), ({switch: "0"}, None, "mlx", "0"),
            ({switch: "1"}, "mlx", "mlx", "0"), ({switch: "0"}, "cudnn", "cudnn", "1"),
            ({switch: " "}, None, "mlx", "0")]:
        got = serve_flags.cuda_attention(flag, environ)
        assert (got, environ[switch]) == (want, value), (environ, flag)


def test_the_parsed_flags_set_mlx_cuda_attention_before_any_model_loads(model_dir, monkeypatch,
                                                                         capsys):
    monkeypatch.delenv(serve_flags.CUDNN_SWITCH, raising=False)
    assert parse(["--model", str(model_dir)]).cuda_attention == "mlx"
    assert os.environ[serve_flags.CUDNN_SWITCH] == "0"
    assert parse(["--model", str(model_dir), "--cuda-attention", "cudnn"]).cuda_attention == "cudnn"
    assert os.environ[serve_flags.CUDNN_SWITCH] == "1"
    monkeypatch.setenv(serve_flags.CUDNN_SWITCH, "yes")
    with pytest.raises(SystemExit) as e:
        serve.main(["--model", str(model_dir)])
    assert e.value.code == 2
    assert "MLX_CUDA_USE_CUDNN_SDPA='yes': MLX reads an integer" in capsys.readouterr().err


@pytest.mark.parametrize("flag, says", [([], "decode muser-kv's, prefill chunks MLX's own "
                                              "kernels: a repeated request gets identical tokens"),
                                        (["--cuda-attention", "cudnn"], "decode muser-kv's, "
                                         "prefill chunks cuDNN's: a faster cold prefill, a "
                                         "repeated request may get other tokens")])
def test_the_start_up_log_says_which_attention_kernels_serve_on_mlx_cuda(model_dir, monkeypatch,
                                                                       caplog, flag, says):
    import logging

    args = parse(["--model", str(model_dir), *flag])
    for cuda in (False, True):
        monkeypatch.setattr(provider, "detect", lambda cuda=cuda: "cuda" if cuda else "reference")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=serve.__name__):
            serve.MuseModelProvider(args)
        lines = [r.getMessage() for r in caplog.records if "attention" in r.getMessage()]
        assert len(lines) == cuda, lines
        assert all(line.startswith(f"muser-kv serve: attention on MLX CUDA: {says} (")
                   for line in lines), lines


def test_a_model_muser_kv_cannot_serve_is_refused_before_the_server_starts(tmp_path, capsys):
    llama = write_local_model(tmp_path / "llama", model_type="llama")
    assert serve.main(["--model", str(llama)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("muser-kv serve: ") and "has no sliding-window layers" in err


def test_a_max_context_past_the_model_is_refused(model_dir, capsys):
    assert serve.main(["--model", str(model_dir), "--max-context", "257"]) == 2
    assert "exceeds the model's max_position_embeddings 256" in capsys.readouterr().err


def test_the_speculative_path_stores_entries_keyed_by_what_they_hold(model_dir):
    from mlx_lm import load
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = load(str(model_dir))
    draft, _ = load(str(model_dir))
    for m in (model, draft):
        muser_kv.install(m, num_draft_tokens=3)
    lru, short = ExactPromptCache(), 0
    for n in range(1, 10):  # as the server's single-request path does it
        prompt = ids(30, 20 + n)
        cache = make_prompt_cache(model) + make_prompt_cache(draft)
        key = list(prompt)
        for gen in stream_generate(model, tokenizer, prompt, max_tokens=n, draft_model=draft,
                                   num_draft_tokens=3, prompt_cache=cache):
            key.append(gen.token)
        short += cache[0].offset < len(key)
        lru.insert_cache("m", key, cache)
    assert short > 0  # the premise: some caches hold one token fewer than their key
    for tokens in (t for lrus in lru._lru._lrus.values() for _, t in lrus):
        assert lru.trie.get("m", tokens).prompt_cache[0].offset == len(tokens)


def test_health_answers_ok_only_once_the_model_is_loaded(model_dir, monkeypatch):
    """mlx-lm loads ``--model`` in its generation thread while ``/health``
    already answers 200, so a client that waited for 200 sent its first request
    into the load (20-25 s of the real geometry's weights). muser-kv serve is
    healthy once the model is loaded with its caches: the load is held here
    until ``/health``'s answer has been read."""
    import threading

    from mlx_lm import server as mlx_server

    release = threading.Event()
    real = mlx_server.ModelProvider._load

    def held(self, *args, **kwargs):
        assert release.wait(START_TIMEOUT)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(mlx_server.ModelProvider, "_load", held)
    provider = serve.MuseModelProvider(parse(["--model", str(model_dir)]))
    generator = serve.MuseResponseGenerator(provider, ExactPromptCache())
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not generator.generation_available():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert not generator.is_healthy and provider.limits is None
        release.set()
        while provider.limits is None or not generator.is_healthy:
            assert time.monotonic() < deadline and generator.generation_available()
            time.sleep(0.02)
        assert isinstance(provider.model.make_cache()[0], muser_kv.MuseKVCache)
    finally:
        release.set()
        generator.stop_and_join()
