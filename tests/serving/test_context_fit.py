"""``muser-kv serve``'s context policy on mlx-lm's requests
(``muser_kv.serving.server.context_fit``), with a stand-in for the chat template: a
chat's prompt is its messages' words plus one generation marker, as the tests'
local template renders it. Through HTTP: test_serve_context."""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import pytest
from mlx_lm.server import CompletionRequest

from muser_kv import ContextPolicy
from muser_kv.serving.server.context_fit import FittedRequest, fit_request
from muser_kv.serving.server.request_checks import RequestRefused


def length(request: Any) -> List[int]:
    return [0] * (sum(len(m["content"].split()) for m in request.messages) + 1)


def chat_of(sizes: List[List[int]], system: int = 5) -> CompletionRequest:
    """A system message of ``system`` words, then per turn a user message and
    its replies (assistant and tool, alternating) of the given words."""
    messages: List[Dict[str, str]] = [{"role": "system", "content": "w " * system}]
    for turn in sizes:
        for i, n in enumerate(turn):
            role = "user" if i == 0 else ("assistant", "tool")[i % 2]
            messages.append({"role": role, "content": "w " * n})
    return CompletionRequest("chat", "", messages, None, None)


def fit(request: Any, max_tokens: int, context: int, keep: int = 0):
    return fit_request(request, max_tokens, context, ContextPolicy.SHIFT, keep, length)


@pytest.mark.parametrize("seed", range(40))
def test_a_chat_drops_the_fewest_oldest_whole_turns_that_fit(seed):
    """Against a scan turn by turn: the fewest oldest turns whose dropping
    leaves room for max_tokens, else for one token, else a refusal."""
    rng = np.random.default_rng(seed)
    sizes = [[int(n) for n in rng.integers(1, 20, rng.integers(1, 4))]
             for _ in range(rng.integers(1, 8))]
    request = chat_of(sizes)
    context, max_tokens = int(rng.integers(10, 120)), int(rng.integers(1, 60))
    lengths = [6 + sum(map(sum, sizes[d:])) for d in range(len(sizes))]
    want = next((d for room in (max_tokens, 1) for d, n in enumerate(lengths)
                 if n + room <= context), None)
    if want is None:
        with pytest.raises(RequestRefused, match=f"newest turn have {lengths[-1]} tokens; "
                                                 f"this server's context is {context} tokens"):
            fit(request, max_tokens, context)
        return
    got = fit(request, max_tokens, context)
    assert (got.turns_dropped, got.prompt_tokens) == (want, lengths[want])
    kept = FittedRequest.of(request)
    kept.settle(got)
    first_kept = 1 + sum(map(len, sizes[:want]))
    assert kept.messages == request.messages[:1] + request.messages[first_kept:]
    assert got.headers() == {"X-Muser-Turns-Dropped": str(want),
                             "X-Muser-Prompt-Tokens": str(lengths[want])}


def test_a_chat_with_a_system_message_after_its_turns_is_refused_only_when_it_must_shift():
    request = chat_of([[10, 10], [10]])
    request.messages.insert(2, {"role": "system", "content": "w"})
    assert fit(request, 5, 100).turns_dropped == 0
    with pytest.raises(RequestRefused, match="cannot be shifted: message 2 is a system message"):
        fit(request, 5, 30)


def test_error_keeps_every_request_as_sent():
    request = chat_of([[30], [30]])
    got = fit_request(request, 10, 40, ContextPolicy.ERROR, 0, length)
    assert (got.turns_dropped, got.prompt_tokens, got.messages) == (0, 66, None)


def raw(n: int) -> CompletionRequest:
    return CompletionRequest("text", " ".join(f"t{i}" for i in range(n)), [], None, None)


def words(request: Any) -> List[int]:
    return [int(w[1:]) for w in request.prompt.split()]


@pytest.mark.parametrize("n, max_tokens, keep, kept", [
    (63, 10, 4, list(range(63))),  # leaves room for one token: whole, max_tokens cut
    (64, 10, 4, list(range(4)) + list(range(14, 64))),  # 4 + 50 + 10 = 64
    (200, 10, 0, list(range(146, 200))),
    (200, 100, 3, list(range(3)) + list(range(140, 200))),  # 60 = 64 - 3 - 1 left: 3 + 60 + 1
])
def test_a_raw_prompt_keeps_its_head_and_newest_tokens_only_when_it_must(n, max_tokens, keep,
                                                                         kept):
    request = FittedRequest.of(raw(n))
    got = fit_request(request, max_tokens, 64, ContextPolicy.SHIFT, keep, words)
    request.settle(got)
    assert request.tokens(words(request)) == kept
    assert (got.prompt_tokens, got.tokens_dropped) == (len(kept), n - len(kept))
    assert got.headers()["X-Muser-Tokens-Dropped"] == str(n - len(kept))


def test_a_context_keep_that_leaves_no_room_is_refused():
    with pytest.raises(RequestRefused, match="--context-keep 63 leaves no room"):
        fit_request(raw(64), 10, 64, ContextPolicy.SHIFT, 63, words)


@pytest.mark.parametrize("seed", range(20))
def test_the_search_finds_the_fewest_turns_from_any_guess_and_a_right_guess_costs_two_renders(
        seed):
    """``_smallest`` against a scan, from every guess, ``fits`` holding from some
    point on (or nowhere); each candidate rendered once; a right guess renders
    two candidates, a wrong one few more than a bisection would."""
    from muser_kv.serving.server.context_fit import _smallest

    rng = np.random.default_rng(seed)
    hi = int(rng.integers(0, 40))
    first = int(rng.integers(0, hi + 2))  # hi + 1: nothing fits
    for guess in range(-1, hi + 2):
        asked: list = []

        def fits(d, asked=asked):
            asked.append(d)
            return d >= first

        got = _smallest(fits, 0, hi, guess)
        assert got == (first if first <= hi else None), (hi, first, guess)
        assert len(asked) - len(set(asked)) <= 1  # the end found fitting is asked again
        if guess == first and 0 < first <= hi:
            assert len(set(asked)) == 2
        assert len(set(asked)) <= 2 * (abs(guess - first) + 1).bit_length() + 2
