"""``ServeBatchGenerator`` (``serving.server.scheduler``), what ``muser-kv
serve`` batches with, in process over muser-kv's caches on the CPU: every
sequence's tokens are its tokens alone; a streamed token's log-probability is
read with its step (a host value, the bits mlx-lm's read gives); a long
prompt prefills in budget-sized chunks with a running stream's token between
every two of them."""

from __future__ import annotations

from typing import Dict, List, Tuple

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from mlx_lm.generate import BatchGenerator

import muser_kv
from muser_kv.serving.server.scheduler import ServeBatchGenerator, batch_generator

RUNNING, LONG = 16, 180  # a running chat's prompt; the long prompt joining it


@pytest.fixture(scope="module")
def model():
    return tiny_model(mx.float32)


@pytest.fixture
def ours(model, monkeypatch):
    monkeypatch.setattr(model, "make_cache",
                        lambda: muser_kv.make_prompt_cache(model, max_context=256), raising=False)
    return model


def prompts() -> Tuple[List[int], List[int]]:
    rng = np.random.default_rng(11)
    return rng.integers(0, 255, RUNNING).tolist(), rng.integers(0, 255, LONG).tolist()


def run(gen, joins: Dict[int, Tuple[List[int], int]]):
    """Drive ``gen``: the prompt of ``joins[k]`` inserted before call ``k`` of
    ``next``. Per call: (the sequences given a token, prompt tokens prefilled
    per sequence); and every sequence's tokens and log-probabilities read as
    mlx-lm's server reads them."""
    calls, tokens, logprobs, uids = [], {}, {}, {}
    done: set = set()
    for k in range(400):  # bounded: every answer below ends well within it
        if k in joins:
            prompt, n = joins[k]
            (uid,) = gen.insert([prompt], [n])
            uids[k] = uid
            tokens[uid], logprobs[uid] = [], []
        if len(done) == len(uids) and k > max(joins):
            break
        prompt_responses, responses = gen.next()
        stepped = {r.uid for r in responses}
        filled = {}
        for r in prompt_responses:
            filled[r.uid] = r.progress[0]
        for r in responses:
            tokens[r.uid].append(r.token)
            logprobs[r.uid].append(r.logprobs[r.token].item())
            if r.finish_reason is not None:
                done.add(r.uid)
        calls.append((stepped, filled))
    gen.close()
    return calls, [tokens[uids[k]] for k in sorted(uids)], [logprobs[uids[k]] for k in sorted(uids)]


def alone(model, make, prompt, n):
    _, (tokens,), (logprobs,) = run(make(), {0: (prompt, n)})
    return tokens, logprobs


def test_a_long_prompt_prefills_in_budget_chunks_between_a_running_streams_tokens(ours):
    running, long = prompts()

    def make():
        return ServeBatchGenerator(ours, prefill_budget=16, prefill_step_size=128,
                                   completion_batch_size=4, prefill_batch_size=4)
    calls, (got_running, got_long), _ = run(make(), {0: (running, 40), 3: (long, 8)})
    # the running stream's uid is 0, the long prompt's 1
    filled = [f[1] for _, f in calls if 1 in f]
    chunks = np.diff([0] + filled)
    assert len(chunks) >= LONG // 16 and max(chunks) <= 16, chunks
    for stepped, f in calls:
        if 1 in f and f[1] < LONG:  # the long prompt still prefilling
            assert 0 in stepped, "a prefill chunk without the running stream's token"
    assert got_running == alone(ours, make, running, 40)[0]
    assert got_long == alone(ours, make, long, 8)[0]


def test_the_chosen_log_probability_is_read_with_its_step(ours):
    """The value ``logprobs[token]`` gives is on the host already (no array to
    evaluate behind the next step) and is mlx-lm's own, bit for bit; the row's
    other uses (top log-probabilities) are the row's."""
    running, long = prompts()
    joins = {0: (running, 12), 2: (long[:40], 9)}
    _, want_tokens, want = run(BatchGenerator(ours, prefill_step_size=256), joins)
    gen = ServeBatchGenerator(ours, prefill_step_size=256)
    _, got_tokens, got = run(gen, joins)
    assert got_tokens == want_tokens and got == want
    gen = ServeBatchGenerator(ours, prefill_step_size=256)
    gen.insert([running], [3])
    seen = 0
    for _ in range(10):  # the server's call: next (next_generated skips it)
        for r in gen.next()[1]:
            value = r.logprobs[r.token]
            assert not isinstance(value, mx.array)
            assert r.logprobs.shape == (256,) and r.logprobs.astype(mx.float32)[r.token].item() \
                == value.item()
            top = mx.argpartition(-r.logprobs, kth=2)[:3].tolist()
            assert r.token in top and r.logprobs[top].tolist()[top.index(r.token)] == value.item()
            seen += 1
    assert seen == 3


def test_serve_constructs_it_with_the_parsed_budget(ours):
    class Parsed:
        prefill_budget = 64

    gen = batch_generator(lambda: Parsed)(ours, prefill_step_size=2048, prefill_batch_size=8)
    assert isinstance(gen, ServeBatchGenerator)
    assert (gen.prefill_budget, gen.prefill_step_size) == (64, 64)
    gen.close()


def test_a_decode_step_waits_for_the_device_once(ours, monkeypatch):
    """Two sequences at different rows, decoding: every step evaluates once (the
    step's own tokens, mlx-lm's read) and queues twice (the next step, and the
    chosen log-probabilities before it); nothing else in muser-kv's caches or
    the scheduler waits for the device."""
    running, long = prompts()
    gen = ServeBatchGenerator(ours, prefill_step_size=128)
    gen.insert([running, long[:37]], [12, 12])
    for _ in range(4):  # both prefilled and decoding
        gen.next()
    calls: List[str] = []
    for name in ("eval", "async_eval"):
        original = getattr(mx, name)
        monkeypatch.setattr(mx, name, lambda *a, _f=original, _n=name, **k: (
            calls.append(_n), _f(*a, **k))[1])
    for _ in range(5):
        calls.clear()
        _, responses = gen.next()
        assert len(responses) == 2 and all(r.finish_reason is None for r in responses)
        assert sorted(calls) == ["async_eval", "async_eval", "eval"], calls
    gen.close()
