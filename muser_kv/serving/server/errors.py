"""What a client of ``muser-kv serve`` is told when its request is not
answered: one JSON body in OpenAI's shape, whatever refused it.

OpenAI's API answers an error as ``{"error": {"message", "type", "param",
"code"}}``, and its clients read the message from there: a body of
``{"error": "..."}`` (mlx-lm's) shows a user only the status. Every refusal
the server writes (the handler's, mlx-lm's, the connection bound's, the
drain's) is built here, so a client parses one shape."""

from __future__ import annotations

import json
from typing import Optional

#: OpenAI's error ``type`` for each status the server answers with
ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error",
               408: "invalid_request_error", 411: "invalid_request_error",
               413: "invalid_request_error", 500: "server_error", 503: "server_error"}
#: a short ``code`` where the refusal names none
DEFAULT_CODES = {400: "invalid_request", 404: "not_found", 408: "request_timeout",
                 411: "length_required", 413: "request_too_large", 500: "internal_error",
                 503: "unavailable"}


def error_body(status: int, message: str, code: Optional[str] = None) -> bytes:
    """The body answering a refusal with HTTP ``status``: OpenAI's error object."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": code or DEFAULT_CODES.get(status, str(status))}}).encode()


def error_event(message: str, code: Optional[str], status: int = 503) -> bytes:
    """An SSE event that ends a stream with an error (OpenAI's error object,
    typed as ``status`` would be), then ``[DONE]``: a client that reads events
    sees why its answer is cut or refused."""
    return b"data: " + error_body(status, message, code) + b"\n\ndata: [DONE]\n\n"


def raw_response(status: int, reason: str, message: str, code: Optional[str] = None,
                 retry_after: Optional[int] = None) -> bytes:
    """A whole HTTP/1.0 response with an error body, for a connection the
    server answers without a handler (the connection bound)."""
    body = error_body(status, message, code)
    head = [f"HTTP/1.0 {status} {reason}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Connection: close"]
    if retry_after is not None:
        head.append(f"Retry-After: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body
