"""A request's path through ``muser-kv serve`` before its prefill: the prompt is
tokenized once. The handler's thread tokenizes a request to fit it to the
context and admit it; the generation thread serves that same tokenization
rather than rendering and tokenizing the whole chat again (at 130k tokens each
pass is a fraction of a second of a returning chat's time to first token).

mlx-lm's generation thread runs in this process (``MuseResponseGenerator`` over
a ``MuseModelProvider``), fed as its HTTP handler feeds it, on a tiny model on
disk with the local chat template; mlx-lm's ``_tokenize`` is counted."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Dict, List

import mlx_lm.server as mlx_server
import pytest
from local_model import write_local_model
from servers import generation_args, serve_args, words

from muser_kv.serving.server import serve
from muser_kv.serving.server.handler import LAST_REQUEST
from muser_kv.serving.server.prompt_cache import ExactPromptCache

CONTEXT = 1024
START_TIMEOUT = 60


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_local_model(tmp_path_factory.mktemp("muse") / "muse", dtype="bfloat16",
                             max_position_embeddings=CONTEXT, num_hidden_layers=4,
                             head_dim=32)


@pytest.fixture
def counted(monkeypatch) -> List[int]:
    """The number of messages of each chat mlx-lm's ``_tokenize`` renders."""
    seen: List[int] = []
    real = mlx_server.ResponseGenerator._tokenize

    def counting(self, tokenizer, request, args):
        seen.append(len(request.messages or []))
        return real(self, tokenizer, request, args)

    monkeypatch.setattr(mlx_server.ResponseGenerator, "_tokenize", counting)
    return seen


@pytest.fixture
def generator(model_dir):
    provider = serve.MuseModelProvider(serve_args(
        ["--model", str(model_dir), "--max-context", str(CONTEXT)]))
    gen = serve.MuseResponseGenerator(provider, ExactPromptCache(4))
    deadline = time.monotonic() + START_TIMEOUT
    while provider.limits is None:  # the generation thread loads the model
        assert time.monotonic() < deadline and gen.generation_available()
        time.sleep(0.02)
    yield gen
    gen.stop_and_join()


def chat(turns: int, words_per_message: int) -> List[Dict[str, str]]:
    messages = [{"role": "system", "content": words(range(2, 2 + words_per_message))}]
    for t in range(turns):
        messages.append({"role": "user", "content": words(
            range(10 + t, 10 + t + words_per_message))})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": words(range(5, 9))})
    return messages


def ask(gen, messages: List[Dict[str, str]], max_tokens: int = 3):
    request = mlx_server.CompletionRequest("chat", "", messages, None, None)
    ctx, responses = gen.generate(request, generation_args(max_tokens, logprobs=False))
    tokens = [r.token for r in responses]
    return ctx, tokens


def test_a_chat_that_fits_is_tokenized_once_for_the_handler_and_the_generation_thread(
        generator, counted, caplog):
    messages = chat(3, 40)
    with caplog.at_level(logging.INFO, logger="muser_kv.serving.server.serve"):
        ctx, tokens = ask(generator, messages)
    assert counted == [len(messages)], (
        f"mlx-lm's _tokenize rendered chats of {counted} messages for one request of "
        f"{len(messages)}: the generation thread must serve the handler's tokenization")
    tokenizer = generator.model_provider.tokenizer
    assert list(ctx.prompt) == list(tokenizer.apply_chat_template(
        messages, add_generation_prompt=True))
    assert len(tokens) == 3
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("muser-kv request:")]
    assert len(said) == 1 and said[0].startswith(f"muser-kv request: {len(ctx.prompt)} prompt tokens")
    assert "(tokenizations: 1)" in said[0]
    # asked again, the prompt cache reuses a prefix and mlx-lm drops the segments it
    # covers; the tokenization the request keeps, shared by its two threads, stays whole
    again, _ = ask(generator, messages)
    assert again.prompt_cache_count > 0
    kept = LAST_REQUEST.request
    ((_, (prompt, segments, *_)),) = kept.tokenizations.values()
    assert list(prompt) == list(ctx.prompt) and sum(map(len, segments)) == len(prompt)


def test_a_shifted_chat_is_served_as_the_policy_kept_it_each_candidate_tokenized_once(
        generator, counted, caplog):
    """Too long for the context: the handler renders the whole chat, then the
    candidates of its bisection; the generation thread renders nothing more, and
    the prompt it serves is the kept chat's (the system message and the newest
    whole turns), as mlx-lm tokenizes it."""
    messages = chat(12, 90)  # a system message and 12 turns of ~94 tokens: over 1,024
    with caplog.at_level(logging.INFO, logger="muser_kv.serving.server.serve"):
        ctx, _ = ask(generator, messages)
    assert counted[0] == len(messages) and len(counted) > 1
    # turns of like sizes: the guess from characters is right, so two candidates are
    # rendered (it fits; one turn fewer dropped does not), not a bisection's log2(12) + 1
    assert len(counted) == 3, counted
    assert len(counted) == len(set(counted)), (
        f"mlx-lm's _tokenize rendered chats of {counted} messages: one list rendered twice")
    tokenizer = generator.model_provider.tokenizer
    n = len(ctx.prompt)
    assert n + 3 <= CONTEXT
    kept = None
    for start in range(1, len(messages)):
        candidate = messages[:1] + messages[start:]
        if messages[start]["role"] == "user" and len(candidate) in counted and len(
                tokenizer.apply_chat_template(candidate, add_generation_prompt=True)) == n:
            kept = candidate
            break
    assert kept is not None, "the served prompt is no rendered suffix of whole turns"
    assert list(ctx.prompt) == list(tokenizer.apply_chat_template(kept, add_generation_prompt=True))
    dropped = sum(m["role"] == "user" for m in messages) - sum(m["role"] == "user" for m in kept)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("muser-kv request:")]
    assert len(said) == 1 and said[0].startswith(f"muser-kv request: {n} prompt tokens, ")
    assert said[0].endswith(f"(tokenizations: {len(counted)}, {dropped} turns dropped)")
