"""The generation thread's view of a request: ``Answers``, its response queue
(a departed client's request stopped, its reservation given back), and
``Window``, mlx-lm's run of batched steps between looks at the queue (cut
short for a departed client or a request waiting to join)."""

from __future__ import annotations

from typing import Any, Callable

from muser_kv.serving.server import mlx_lm_server as mlx
from muser_kv.serving.server.http import ClientGone


class Answers:
    """A request's response queue as the generation thread uses it: its last
    answer (``None``, or an exception) gives back its KV reservation; the
    ``GenerationContext`` it is sent is kept (a client that went away stops it).

    Once the handler has stopped the context (its client went away), mlx-lm's
    generation thread drops the request at its next check: one at a time,
    after the next token; batched, after the step that next gives it a token
    or a prefill report, when the run of steps ends, which ``abandoned`` ends
    there. ``abandoned`` is called once, at the first answer put after the
    stop, with the tokens generated so far, the request's ``max_tokens`` and,
    for a prefill report, its progress.

    A client that has closed its connection (``client``, an ``http.ClientWatch``)
    is noticed at each prefill report, between the prompt's chunks, and at each
    token, streamed or not: its context is stopped there, so that mlx-lm drops
    the request after this chunk or token; on the one-at-a-time path
    (``single()`` while it runs), which checks only after a token, a prefill
    report raises ``ClientGone``, which ends the request's prefill there
    (raised on the batched path, it would end mlx-lm's generation thread)."""

    def __init__(self, queue: Any, release: Callable[[], None], args: Any,
                 abandoned: Callable[[int, int, Any], None], client: Any = None,
                 single: Callable[[], bool] = lambda: False):
        self._queue, self._release, self._abandoned = queue, release, abandoned
        self._args = args  # its max_tokens as admit cuts it, in the generation thread
        self._client, self._single = client, single
        self.ctx: Any = None
        self.tokens = 0  #: tokens put (generated) so far
        self._gone = False
        self._ended = False  # its handler has been given its last answer

    def put(self, item: Any, *args: Any, **kwargs: Any) -> None:
        gone = isinstance(item, (tuple, mlx.server.Response)) and self.ctx is not None \
            and self._client is not None and self._client.gone()
        if gone:
            mlx.stop(self.ctx)  # the client closed its connection
            if self._single() and isinstance(item, tuple):
                self._note_stop(item)
                raise ClientGone("the client went away during its request's prefill")
        self._queue.put(item, *args, **kwargs)
        if item is None or isinstance(item, BaseException):
            self._release()
        elif isinstance(item, mlx.server.GenerationContext):
            self.ctx = item
        elif isinstance(item, (mlx.server.Response, tuple)):
            self.tokens += isinstance(item, mlx.server.Response)
            self._note_stop(item)
        if gone and not self._ended:
            # mlx-lm drops a stopped request without a last answer: its handler,
            # still waiting for one, is ended here (its connection is closed)
            self._ended = True
            self._queue.put(ClientGone("the client went away"))
            self._release()

    def _note_stop(self, item: Any) -> None:
        if not self._gone and self.ctx is not None and mlx.stopped(self.ctx):
            self._gone = True
            self._abandoned(self.tokens, self._args.max_tokens,
                            item if isinstance(item, tuple) else None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


class Window:
    """mlx-lm's ``TimeBudget``: how long its generation thread runs batched
    steps before it drops the requests whose handler stopped them and looks at
    its queue again (0.5 s). ``cut`` ends the run after the current step, so a
    request whose client went away is dropped after the step that gave it its
    last answer, and its steps no longer delay the next request. A request
    ``waiting`` in the queue ends it too, so that it joins the running batch
    after the current step rather than up to 0.5 s later. On one process only:
    on several, every rank must run the same steps."""

    def __init__(self, budget: Any, cuttable: bool, waiting: Callable[[], bool] = lambda: False):
        self._budget, self._cuttable, self._waiting = budget, cuttable, waiting
        self.cut = False

    def __iter__(self) -> "Window":
        self.cut = False
        iter(self._budget)
        return self

    def __next__(self) -> Any:
        if self._cuttable and (self.cut or self._waiting()):
            raise StopIteration
        return next(self._budget)
