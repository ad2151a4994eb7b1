"""A POST's body, read and parsed before any of mlx-lm's handler runs on it.

mlx-lm's ``do_POST`` reads ``Content-Length`` bytes and parses them with no
bound: a negative length, bytes that are not UTF-8 or JSON nested deeper than
Python's recursion limit raise past it, and the client gets no status line.
``read_body`` answers each with a ``RequestRefused`` (status and one line)
instead, and bounds what a client may send: ``max_bytes`` of body, ``MAX_DEPTH``
levels of nesting, and strings that are valid Unicode (JSON's ``"\\ud800"``
escape makes a lone surrogate, which no tokenizer takes)."""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Tuple

from muser_kv.serving.server.request_checks import RequestRefused

#: levels of arrays and objects a body may nest: an OpenAI request's deepest
#: (a tool's JSON schema) is a few tens
MAX_DEPTH = 64
#: ``--max-body-bytes``'s default: a 131k-token prompt is about 1 MB of text
DEFAULT_MAX_BODY_BYTES = 32 << 20


def content_length(value: Any, max_bytes: int) -> int:
    """The body's length from its ``Content-Length`` header (``None``: absent)."""
    if value is None:
        raise RequestRefused("a POST needs a Content-Length header (chunked bodies are not "
                             "read)", status=411)
    text = str(value).strip()
    if not (text.isascii() and text.isdigit()):
        raise RequestRefused(f"Content-Length must be a decimal integer >= 0, got {value!r}")
    n = int(text)
    if n > max_bytes:
        raise RequestRefused(f"request body of {n:,} bytes is more than this server takes "
                             f"({max_bytes:,} bytes, --max-body-bytes)", status=413)
    return n


def read_body(headers: Any, rfile: Any, max_bytes: int) -> Tuple[bytes, Dict[str, Any]]:
    """``(raw bytes, the JSON object)`` of a request whose ``headers`` and body
    stream ``rfile`` are given. Raises ``RequestRefused`` naming what is wrong:
    the length (411 absent, 400 not a count, 413 over ``max_bytes``), a body
    that ends early (400) or stalls past the connection's timeout (408), its
    encoding, its JSON, its nesting, a string that is not valid Unicode, a
    body that is not an object."""
    n = content_length(headers.get("Content-Length"), max_bytes)
    try:
        raw = rfile.read(n)
    except TimeoutError:
        raise RequestRefused(f"the request body did not arrive in time ({n:,} bytes "
                             "announced)", status=408) from None
    if len(raw) < n:
        raise RequestRefused(f"the request body ended after {len(raw):,} of the {n:,} bytes "
                             "its Content-Length announced")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestRefused(f"the request body is not UTF-8: byte {e.start} is "
                             f"0x{raw[e.start]:02x}") from None
    depth = _nesting(text)
    if depth > MAX_DEPTH:
        raise RequestRefused(f"the request body nests {depth:,} levels of arrays and objects; "
                             f"at most {MAX_DEPTH} are read")
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise RequestRefused(f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestRefused(f"the request body must be a JSON object, got a JSON "
                             f"{type(body).__name__}")
    where = _bad_string(body)
    if where is not None:
        raise RequestRefused(f"{where} is not valid Unicode (a lone surrogate escape such "
                             "as \\ud800): no tokenizer can read it")
    return raw, body


def _nesting(text: str) -> int:
    """How deep ``text``'s brackets nest outside strings (the most JSON would
    recurse), found without recursing: a body nested past the interpreter's
    limit is refused with its depth rather than a ``RecursionError``."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return 0  # cannot nest deeper than it has brackets
    depth = deepest = 0
    for m in _TOKENS.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


#: a JSON string (skipped whole) or a bracket
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _bad_string(body: Any) -> Any:
    """Where in ``body`` a string (a value or a key) holds a lone surrogate,
    as ``messages[0].content``; ``None`` if none does."""
    stack: List[Tuple[str, Any]] = [("", body)]
    while stack:
        at, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return at or "the body"
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((f"{at}.{k}" if at else str(k), k if _lone(k) else v))
        elif isinstance(value, list):
            stack.extend((f"{at}[{i}]", v) for i, v in enumerate(value))
    return None


def _lone(text: str) -> bool:
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True
