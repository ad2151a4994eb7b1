"""What a request to ``muser-kv serve`` may ask, checked before it runs: the
body's fields as mlx-lm's handler reads them (``check_body``), and the prompt
and sampling against the loaded model's ``Limits`` (``admit``). A request that
fails either is refused (``RequestRefused``: one line, HTTP 400) and fails alone."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from muser_kv.serving.server.kv_budget import SequencePlanes


class RequestRefused(ValueError):
    """A request this server does not run as asked (one line says why): the
    client's error, answered before the request's first token with HTTP
    ``status`` (400 unless the refusal says otherwise: 404 for a model not
    served, 413 for a body too large, ...) and OpenAI's error ``code``."""

    def __init__(self, message: str, status: int = 400, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.code = status, code


ModelKey = Tuple[Optional[str], Optional[str], Optional[str]]


@dataclass(frozen=True)
class Limits:
    """What the model the provider has loaded admits, published as one value
    (``MuseModelProvider.limits``) so that another thread reads a consistent set."""

    key: ModelKey  #: the provider's ``model_key`` for this load
    tokenizer: Any
    max_context: int  #: positions every cache of a request holds (model and Muse draft)
    vocab_size: int  #: the width of the model's logits
    #: what a sequence's planes cost (model and Muse draft), for ``--kv-memory``
    planes: Optional[SequencePlanes] = None


def admit(limits: Limits, prompt_tokens: int, args: Any) -> int:
    """How many tokens a request (mlx-lm's ``GenerationArguments``) with a
    prompt of ``prompt_tokens`` tokens may generate: its ``max_tokens``, cut to
    what fits. Every generated token is fed back to the model, the last one
    included (mlx-lm computes the next token ahead on all its paths; a
    speculative round writes no further), so a request writes ``prompt_tokens
    + max_tokens`` positions. The invariant: that sum is at most
    ``max_context``, decided before the prompt is prefilled, so no write ever
    raises ``ContextOverflow`` (batched, it would kill the generation thread
    and every request in it). Refused (``RequestRefused``): a prompt with no
    room for one token, an empty one, and a ``top_k`` or ``logit_bias`` id
    outside the vocabulary (each fails inside the generation thread; batched,
    each kills it)."""
    n, context, vocab = prompt_tokens, limits.max_context, limits.vocab_size
    if n == 0:
        raise RequestRefused("prompt has 0 tokens; a request needs at least one")
    if n >= context:
        raise RequestRefused(f"prompt has {n} tokens; this server's context is {context} tokens "
                             f"(--max-context), so a prompt must have fewer than {context}")
    top_k = args.sampling.top_k
    if top_k >= vocab:
        raise RequestRefused(f"top_k must be less than {vocab} (the model's vocabulary), "
                             f"got {top_k}")
    bad = sorted(k for k in args.logits.logit_bias or {} if not 0 <= k < vocab)
    if bad:
        raise RequestRefused(f"logit_bias token ids must be less than {vocab} (the model's "
                             f"vocabulary), got {bad[0]}")
    return min(args.max_tokens, context - n)


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _refuse(field: str, expected: str, value: Any) -> RequestRefused:
    return RequestRefused(f"{field} must be {expected}, got {_show(value)}")


def _int(v: Any) -> bool:
    return type(v) is int  # JSON true is a bool, and a bool is not a count


def _number(v: Any) -> bool:
    return type(v) is int or (type(v) is float and math.isfinite(v))  # Python's JSON reads NaN


def _or_null(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _string_list(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is str for x in v)


_NUMBER = (_number, "a finite number")
_INT = (_int, "an integer")

#: the type each body field mlx-lm's handler reads must have, where mlx-lm's
#: ``validate_model_parameters`` checks none or lets a bool or a NaN through:
#: anything else kills its generation thread (``stop``, ``top_logprobs``), or
#: leaves the request without a whole answer (``seed``, ``stream_options``), or
#: is silently taken for something else (``max_tokens: true`` is 1). Ranges stay
#: mlx-lm's (its check runs next); those that need the model are ``admit``'s.
BODY_FIELDS: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "stream": (lambda v: type(v) is bool, "true or false"),
    "stream_options": (_or_null(lambda v: isinstance(v, dict) and type(
        v.get("include_usage", False)) is bool), 'null or an object whose "include_usage" '
                                                 "is true or false"),
    "model": (lambda v: type(v) is str, "a string"),
    "draft_model": (_or_null(lambda v: type(v) is str), "a string or null"),
    "adapters": (_or_null(lambda v: type(v) is str), "a string or null"),
    "num_draft_tokens": _INT,
    "max_completion_tokens": (_or_null(_int), "an integer or null"),
    "max_tokens": _INT,
    "temperature": _NUMBER, "top_p": _NUMBER, "top_k": _INT, "min_p": _NUMBER,
    "repetition_penalty": _NUMBER, "repetition_context_size": _INT,
    "presence_penalty": _NUMBER, "presence_context_size": _INT,
    "frequency_penalty": _NUMBER, "frequency_context_size": _INT,
    "xtc_probability": (lambda v: type(v) is float and math.isfinite(v), "a finite float"),
    "xtc_threshold": (lambda v: type(v) is float and math.isfinite(v), "a finite float"),
    "logit_bias": (_or_null(lambda v: isinstance(v, dict)), "an object or null"),
    "logprobs": (lambda v: type(v) is bool, "true or false"),
    "top_logprobs": _INT,
    "seed": (_or_null(lambda v: _int(v) and 0 <= v < 2 ** 64),
             "an integer from 0 to 2**64 - 1, or null"),
    "chat_template_kwargs": (_or_null(lambda v: isinstance(v, dict)), "an object or null"),
    "stop": (_or_null(lambda v: type(v) is str or _string_list(v)),
             "a string, a list of strings or null"),
}

#: fields of OpenAI's API that serve does not honour, each allowed only at the
#: value that asks for what serve does: mlx-lm's handler ignores them, so
#: ``n: 5`` would get one choice as if it had been asked for
UNHONOURED: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "n": (lambda v: v is None or (_int(v) and v == 1),
          "1: this server generates one choice per request"),
    "best_of": (lambda v: v is None or (_int(v) and v == 1),
                "1: this server generates one choice per request"),
    "echo": (lambda v: v is None or v is False, "false: this server does not echo the prompt"),
    "suffix": (lambda v: v is None or v == "", "null: this server completes no suffix"),
    "response_format": (lambda v: v is None or v == {"type": "text"},
                        '{"type": "text"} or null: this server does not constrain its output'),
}

#: the fields of one endpoint's request (``handle_text_completions``,
#: ``handle_chat_completions``); ``messages`` is checked by ``check_messages``
TEXT_FIELDS = {"prompt": (lambda v: type(v) is str, "a string")}
CHAT_FIELDS = {
    "tools": (_or_null(lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v)),
              "a list of objects or null"),
    "role_mapping": (_or_null(lambda v: isinstance(v, dict) and all(
        type(x) is str for x in v.values())), "an object of strings or null"),
}


def check_messages(messages: Any) -> None:
    """A chat's ``messages`` as mlx-lm's handler and chat template read them:
    a non-empty list of objects, each with a string ``role`` and a ``content``
    that is a string or a list of content parts (objects with a string
    ``type``; a text part with a string ``text``). As in OpenAI's chat API,
    only an assistant message that carries ``tool_calls`` (or the older
    ``function_call``) may have no content (absent or null): mlx-lm would
    render any message without one as empty, so a client's malformed turn
    would be answered as if it had said nothing. Raises ``RequestRefused``."""
    if not isinstance(messages, list) or not messages:
        raise _refuse("messages", "a non-empty list of messages", messages)
    for i, message in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _refuse(at, "an object", message)
        role = message.get("role")
        if type(role) is not str:
            raise _refuse(f"{at}.role", "a string", role)
        calls = message.get("tool_calls")
        if calls is not None and not (isinstance(calls, list)
                                      and all(isinstance(c, dict) for c in calls)):
            raise _refuse(f"{at}.tool_calls", "a list of objects or null", calls)
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or type(part.get("type")) is not str:
                    raise _refuse(f"{at}.content[{j}]", 'an object with a string "type"', part)
                if part["type"] == "text" and type(part.get("text")) is not str:
                    raise _refuse(f"{at}.content[{j}].text", "a string", part.get("text"))
        elif type(content) is str:
            pass
        elif content is None and role == "assistant" and (
                calls or message.get("function_call") is not None):
            pass
        elif content is None:
            came = "null" if "content" in message else "no content"
            raise RequestRefused(
                f"{at}.content must be a string or a list of content parts, got {came} (only "
                f"an assistant message with tool_calls may have none; this is a {_show(role)} "
                "message)")
        else:
            raise _refuse(f"{at}.content", "a string or a list of content parts", content)


def check_body(body: Dict[str, Any], chat: bool) -> None:
    """Every field of a request ``body`` mlx-lm reads, by ``BODY_FIELDS`` and
    the endpoint's own (``chat``: ``/v1/chat/completions``); an absent field is
    mlx-lm's default; a field of ``UNHONOURED`` only at the value serve
    honours. Raises ``RequestRefused`` naming the first that is wrong."""
    fields = dict(BODY_FIELDS, **UNHONOURED, **(CHAT_FIELDS if chat else TEXT_FIELDS))
    if body.get("max_completion_tokens") is not None:
        del fields["max_tokens"]  # not read: mlx-lm takes max_completion_tokens first
    for name, (ok, expected) in fields.items():
        if name in body and not ok(body[name]):
            raise _refuse(name, expected, body[name])
    for key, value in (body.get("logit_bias") or {}).items():
        if not (key.isascii() and key.isdigit()):  # int() would read "-1", the last id
            raise _refuse("logit_bias keys", "token ids (decimal integers >= 0)", key)
        if not _number(value):
            raise _refuse(f"logit_bias[{key!r}]", "a finite number", value)
    if chat and "messages" in body:
        check_messages(body["messages"])
