"""``muser-kv serve --context-policy``: what a request that outgrows the
context keeps, decided in the handler's thread before it is queued (the rules
are ``muser_kv.serving.policy``'s; this module applies them to mlx-lm's
requests and says what it did).

A request *fits* when its prompt and its ``max_tokens`` fit ``--max-context``
positions (every generated token is written back: ``admit``). One that does
not, under ``shift`` (the default):

* **Chat** (``/v1/chat/completions``). The messages split as
  ``complete_chat_turns`` splits them: the system messages that lead, then
  whole turns (a turn starts at a user message; its assistant and tool
  messages stay attached). The fewest oldest turns are dropped so that the
  prompt, rendered by the model's chat template as mlx-lm renders it, and
  ``max_tokens`` fit; where no number of them does, the fewest so that the
  prompt leaves room for one token (``max_tokens`` is then cut to what
  fits, as for any request: ``finish_reason`` "length"). The system messages
  and the newest turn are never dropped: when they alone leave no room, the
  request is refused (400, naming their tokens and the context). The kept
  prompt starts with the same system messages, so the prompt cache and the KV
  store serve its prefix as for any other request.
* **Raw** (``/v1/completions``). A prompt that leaves room for one token is
  kept whole (``max_tokens`` cut as above): a raw prompt has no turns, and its
  middle is dropped only when it must be. One that leaves none keeps its first
  ``--context-keep`` tokens and the newest suffix that leaves ``max_tokens``
  positions (``compact_raw``), or, where the head leaves fewer, the longest
  suffix that leaves one; refused when ``--context-keep`` leaves no room for a
  suffix and one token.

Under ``error`` nothing is dropped: a prompt that leaves no room for one token
is refused, as the server always did. The client is told in the response's
headers (``X-Muser-Turns-Dropped`` for a chat, ``X-Muser-Tokens-Dropped`` for a
raw prompt, ``X-Muser-Prompt-Tokens``: the prompt tokens served) and in the
usage's ``prompt_tokens``.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from muser_kv.serving.policy import ContextPolicy, ContextPolicyError, Message, compact_raw, complete_chat_turns
from muser_kv.serving.server.mlx_lm_server import server as mlx_server
from muser_kv.serving.server.request_checks import RequestRefused

#: the response headers that say what the policy did
TURNS_DROPPED, TOKENS_DROPPED, PROMPT_TOKENS = (
    "X-Muser-Turns-Dropped", "X-Muser-Tokens-Dropped", "X-Muser-Prompt-Tokens")


@dataclass(frozen=True)
class Fit:
    """What the policy keeps of one request: its prompt's length, and what was
    dropped (whole turns of a chat, whose kept ``messages`` are given; or the
    middle tokens ``[keep, keep + tokens_dropped)`` of a raw prompt)."""

    chat: bool
    prompt_tokens: int
    turns_dropped: int = 0
    messages: Optional[List[Any]] = None  #: a shifted chat's kept messages
    keep: int = 0
    tokens_dropped: int = 0

    def headers(self) -> Dict[str, str]:
        dropped = ({TURNS_DROPPED: str(self.turns_dropped)} if self.chat
                   else {TOKENS_DROPPED: str(self.tokens_dropped)})
        return {**dropped, PROMPT_TOKENS: str(self.prompt_tokens)}


@dataclass
class FittedRequest(mlx_server.CompletionRequest):
    """mlx-lm's request, with what the context policy keeps of it once decided
    (``settle``: in the handler's thread where the model is loaded, else in the
    generation thread, before it is tokenized there)."""

    fit: Optional[Fit] = None
    #: mlx-lm's tokenizations of this request by message list (``tokenized``),
    #: shared with the policy's candidates (``dataclasses.replace`` hands the
    #: same dict on)
    tokenizations: Dict[int, Tuple[Tuple[Any, ...], Any]] = dataclasses.field(
        default_factory=dict, repr=False, compare=False)
    #: whether its client is still connected (serve's ``http.ClientWatch``), for
    #: the generation thread to drop a request whose client has gone
    client: Any = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, request: Any) -> "FittedRequest":
        """A copy of mlx-lm's ``request`` (its message list a new list), not yet fitted."""
        fields = {f.name: getattr(request, f.name) for f in dataclasses.fields(mlx_server.CompletionRequest)}
        fields["messages"] = list(fields["messages"] or [])
        return cls(**fields)

    def tokenized(self, tokenizer: Any, args: Any, tokenize: Callable[[], Any]) -> Any:
        """``tokenize()`` (mlx-lm's ``_tokenize`` of this request with ``tokenizer``
        and ``args``), made once per message list: the handler's thread
        tokenizes a request (and the policy's candidates) to fit and admit it,
        and the generation thread takes the result for the messages kept rather
        than tokenizing the prompt again (at 130k tokens that is a fraction of a
        second of a returning chat's path). A result is reused only for the
        same tokenizer, arguments, message list, raw prompt and tools."""
        key = (tokenizer, args, self.messages, self.prompt, self.tools)
        memo = self.tokenizations.get(id(self.messages))
        if memo is None or any(a is not b for a, b in zip(memo[0], key)):
            memo = self.tokenizations[id(self.messages)] = (key, tokenize())
        return memo[1]

    def settle(self, fit: Fit) -> None:
        self.fit = fit
        if fit.messages is not None:
            self.messages = fit.messages

    def tokens(self, prompt: Sequence[int]) -> List[int]:
        """The prompt's tokens as kept (a raw prompt's middle left out)."""
        if self.fit is None or not self.fit.tokens_dropped:
            return list(prompt)
        keep, dropped = self.fit.keep, self.fit.tokens_dropped
        return list(prompt[:keep]) + list(prompt[keep + dropped:])


def _turn_starts(messages: Sequence[Any]) -> Tuple[int, List[int]]:
    """How many system messages lead, and where each turn starts (indices into
    ``messages``), as ``complete_chat_turns`` splits them. A role other than
    system and user (assistant, tool, any other) stays attached to its turn."""
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
    try:
        chat = complete_chat_turns([Message(r if r in ("system", "user") else "tool", ())
                                    for r in roles])
    except ContextPolicyError as e:
        raise RequestRefused(f"the chat does not fit the context and cannot be shifted: {e}") \
            from None
    starts, at = [], len(chat.system)
    for turn in chat.turns:
        starts.append(at)
        at += len(turn)
    return len(chat.system), starts


def _smallest(fits: Callable[[int], bool], lo: int, hi: int, guess: int) -> Optional[int]:
    """The smallest ``d`` in ``[lo, hi]`` with ``fits(d)`` (``None``: none);
    ``fits`` holds from some ``d`` on (dropping more turns never lengthens a
    rendered prompt). Each call of ``fits`` tokenizes a candidate, so the search
    starts at ``guess`` and gallops away from it, then bisects: a right guess
    costs two calls (it fits, one fewer does not), a wrong one about twice the
    log of its error. The ``d`` returned always fits."""
    if lo > hi:
        return None
    g = min(max(guess, lo), hi)
    step = 1
    if fits(g):  # the answer is in [lo, g]
        top = g
        while top - step >= lo and fits(top - step):
            top -= step
            step *= 2
        a, b = max(lo, top - step + 1), top
    else:  # the answer is in (g, hi]
        bottom = g
        while bottom + step < hi and not fits(bottom + step):
            bottom += step
            step *= 2
        a, b = bottom + 1, min(bottom + step, hi)
        if not fits(b):
            return None
    while a < b:  # b fits; everything below a does not
        mid = (a + b) // 2
        if fits(mid):
            b = mid
        else:
            a = mid + 1
    return a


def _guess(messages: Sequence[Any], starts: Sequence[int], n: int, most: int) -> int:
    """The fewest oldest turns whose dropping leaves at most ``most`` of the
    ``n`` tokens, if tokens went as the messages' characters: a start for
    ``_smallest``, never a decision."""
    sizes = [len(str(m.get("content", "")) if isinstance(m, dict) else "") + 1 for m in messages]
    per_char = n / max(1, sum(sizes))
    drop, d = float(n - most), 0
    ends = list(starts[1:]) + [len(messages)]
    while d < len(starts) - 1 and drop > 0:
        drop -= per_char * sum(sizes[starts[d]:ends[d]])
        d += 1
    return d


def fit_chat(request: Any, max_tokens: int, max_context: int,
             length: Callable[[Any], int]) -> Fit:
    """The fewest oldest whole turns of a chat dropped so that it fits (module
    doc); ``length(request)`` is the prompt's length as mlx-lm tokenizes it."""
    n = length(request)
    if n + max_tokens <= max_context:
        return Fit(True, n)
    messages = list(request.messages)
    n_system, starts = _turn_starts(messages)
    lengths: Dict[int, int] = {0: n}
    kept_lists: Dict[int, List[Any]] = {}

    def kept(d: int) -> List[Any]:
        """The messages kept when ``d`` turns are dropped: one list per ``d``, so
        the one settled on is the one tokenized (``FittedRequest.tokenized``)."""
        if d not in kept_lists:
            kept_lists[d] = messages[:n_system] + messages[starts[d]:]
        return kept_lists[d]

    def length_of(d: int) -> int:
        if d not in lengths:
            lengths[d] = length(dataclasses.replace(request, messages=kept(d)))
        return lengths[d]

    def fits(room: int) -> Callable[[int], bool]:
        return lambda d: length_of(d) + room <= max_context

    newest = len(starts) - 1
    for room in (max_tokens, 1):
        d = _smallest(fits(room), 0, newest,
                      _guess(messages, starts, n, max_context - room))
        if d is not None:
            return Fit(True, length_of(d), turns_dropped=d,
                       messages=kept(d) if d else None)
    least = length_of(newest) if starts else n
    raise RequestRefused(
        f"the system messages and the newest turn have {least} tokens; this server's context "
        f"is {max_context} tokens (--max-context), so they leave no room for an answer "
        f"(--context-policy shift drops whole turns, never these)")


def fit_raw(request: Any, max_tokens: int, max_context: int, keep: int,
            tokens: Callable[[Any], Sequence[int]]) -> Fit:
    """A raw prompt that leaves no room for one token, compacted (module doc)."""
    prompt = tokens(request)
    n = len(prompt)
    if n < max_context:
        return Fit(False, n)
    # room for max_tokens after the kept head and one newest token, else (as a
    # chat's shift) for one token: the most of the prompt, max_tokens cut
    room = max_tokens if keep + 1 + max_tokens <= max_context else 1
    if keep + 1 + room > max_context:
        raise RequestRefused(
            f"prompt has {n} tokens; this server's context is {max_context} tokens "
            f"(--max-context), and --context-keep {keep} leaves no room for its newest "
            f"tokens and an answer")
    try:
        kept = compact_raw(prompt, max_context, output_reserve=room, keep_prefix=keep)
    except ContextPolicyError as e:
        raise RequestRefused(f"prompt has {n} tokens; this server's context is "
                             f"{max_context} tokens (--max-context): {e}") from None
    return Fit(False, len(kept.tokens), keep=keep, tokens_dropped=kept.dropped)


def fit_request(request: Any, max_tokens: int, max_context: int, policy: ContextPolicy,
                keep: int, tokens: Callable[[Any], Sequence[int]]) -> Fit:
    """What the server keeps of ``request`` under ``policy`` (module doc);
    ``tokens(request)`` is its prompt as mlx-lm tokenizes it (leaving ``request``
    as it was).
    Raises ``RequestRefused``. Under ``error``, the request as sent (``admit``
    refuses one that leaves no room)."""
    if policy is ContextPolicy.ERROR:
        return Fit(request.request_type == "chat", len(tokens(request)))
    if request.request_type == "chat":
        return fit_chat(request, max_tokens, max_context, lambda r: len(tokens(r)))
    return fit_raw(request, max_tokens, max_context, keep, tokens)


class LastRequest(threading.local):
    """The request the current thread's handler is serving, as ``generate``
    queued it: its ``fit`` is read where the handler writes its headers, after
    the generation thread has tokenized it."""

    request: Optional[FittedRequest] = None
