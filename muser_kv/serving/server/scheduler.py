"""The batched generation ``muser-kv serve`` runs: mlx-lm's ``BatchGenerator``
(substituted for it in ``mlx_lm.server``), changed in what a token's path
waits for and in how much prefill a decode step carries.

**The chosen token's log-probability is read with its step.** mlx-lm's server
builds every streamed token's response with ``r.logprobs[r.token].item()``.
By then ``BatchGenerator`` has queued the next decode step, and the indexing
is a new array behind it on the stream, so the read waits for the whole next
step and the host's build of the step after no longer overlaps the device.
Here the chosen tokens' log-probabilities are gathered on the stream before
the next step is queued (one gather for the batch), so reading them waits
only for the step they belong to, which the step's own token read has already
waited for; the response's ``logprobs`` (``StepLogprobs``) answers
``[token]`` with that value (the same bits), and every other use with the row.

**A prefill budget.** mlx-lm follows every decode step with one prefill chunk
(``--prefill-step-size`` tokens) for each prompt in flight, so a long prompt
adds a whole chunk's time to every running stream's next token until it has
prefilled. With ``prefill_budget`` (``--prefill-budget``, tokens) a prompt
prefills in chunks of at most that many tokens, and while any sequence
decodes, at most ``budget // chunk`` prompts (at least one) prefill beside it,
so a running stream's gap is one decode step and at most one budget of
prefill. Prompts that started prefilling together while nothing decoded go on
together (mlx-lm's prompt batch gives each a chunk per step) until they end.
The chunks do not depend on the load: a prompt is cut at the same positions
whether it prefills alone or beside running streams, so joining a batch
changes none of its rows. 0: mlx-lm's scheduling.

**Step timing** (``muser_kv.serving.server.scheduler`` at DEBUG, e.g.
``--log-level DEBUG``): every ``CLOCK_STEPS`` decode steps one line gives the
median and longest time between steps (the server's response loop and
everything else the generation thread does between them), inside a step, and
inside the log-probability read, and again whenever a call decodes nothing or
the batch empties. Off,
it costs one comparison per step.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import mlx.core as mx

from muser_kv.serving.server import mlx_lm_server as mlx

log = logging.getLogger(__name__)

#: decode steps per timing line
CLOCK_STEPS = 256


class StepLogprobs:
    """One response's log-probabilities: the row mlx-lm's ``BatchGenerator``
    gives, and its chosen token's value, read with its step. ``[token]`` is that
    value (``.item()`` gives it without touching the stream); any other index,
    negation (``_format_top_logprobs``'s ``-logprobs``) and every other
    attribute (``shape``, ``astype``, ...) are the row's."""

    __slots__ = ("row", "token", "value")

    def __init__(self, row: mx.array, token: int, value: float):
        self.row, self.token, self.value = row, token, value

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int) and index == self.token:
            return ReadValue(self.value)
        return self.row[index]

    def __neg__(self) -> mx.array:
        return -self.row

    def __getattr__(self, name: str) -> Any:
        if name in StepLogprobs.__slots__:  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.row, name)


@dataclass(frozen=True)
class ReadValue:
    """A value already on the host, with an array's ``item()``."""

    value: float

    def item(self) -> float:
        return self.value


@dataclass
class StepClock:
    """Times of the generation thread's decode steps, logged every
    ``CLOCK_STEPS`` (``flush``) as medians and maxima in milliseconds."""

    between: List[float] = field(default_factory=list)
    inside: List[float] = field(default_factory=list)
    read: List[float] = field(default_factory=list)
    batch: List[int] = field(default_factory=list)
    last_end: Optional[float] = None

    def step(self, start: float, after_step: float, end: float, sequences: int) -> None:
        if self.last_end is not None:
            self.between.append(start - self.last_end)
        self.inside.append(after_step - start)
        self.read.append(end - after_step)
        self.batch.append(sequences)
        self.last_end = end
        if len(self.inside) >= CLOCK_STEPS:
            self.flush()

    def idle(self) -> None:
        """No decode step ran: the next one's wait is not a gap between steps,
        and the steps so far are logged."""
        self.last_end = None
        self.flush()

    def flush(self) -> None:
        if not self.inside:
            return

        def ms(xs: List[float]) -> str:
            return (f"median {statistics.median(xs) * 1e3:.2f} max {max(xs) * 1e3:.2f} ms"
                    if xs else "none")
        log.debug("muser-kv steps: %d decode steps of %d-%d sequences; between steps %s; "
                  "in a step %s; log-probability read %s", len(self.inside), min(self.batch),
                  max(self.batch), ms(self.between), ms(self.inside), ms(self.read))
        self.between.clear()
        self.inside.clear()
        self.read.clear()
        self.batch.clear()


class ServeBatchGenerator(mlx.BatchGenerator):
    """mlx-lm's ``BatchGenerator`` whose responses carry their chosen token's
    log-probability read with its step, and whose prefill is held to
    ``prefill_budget`` tokens per decode step (module doc)."""

    def __init__(self, model: Any, *, prefill_budget: int = 0, **kwargs: Any):
        if prefill_budget > 0:
            kwargs["prefill_step_size"] = min(kwargs.get("prefill_step_size", 2048),
                                              prefill_budget)
        super().__init__(model, **kwargs)
        self.prefill_budget = prefill_budget
        self._prompts = self.prefill_batch_size  # prompts prefilled at once, none decoding
        self._prompts_decoding = (max(1, prefill_budget // self.prefill_step_size)
                                  if prefill_budget > 0 else self._prompts)
        self.clock = StepClock()

    def next(self) -> Tuple[List[Any], List[Any]]:
        generation = mlx.generation_batch(self)
        decoding = len(generation) > 0
        self.prefill_batch_size = min(self._prompts, self._prompts_decoding) if decoding \
            else self._prompts
        timed = log.isEnabledFor(logging.DEBUG)
        start = time.perf_counter() if timed else 0.0
        chosen = None
        if decoding:
            tokens, rows = mlx.queued_step(generation)
            if tokens is not None and len(rows) == len(generation):
                with mx.stream(self.stream):  # before the next step is queued behind it
                    chosen = mx.take_along_axis(mx.stack(rows), tokens.reshape(-1, 1), axis=-1)[:, 0]
                    mx.async_eval(chosen)
        prompt_responses, generation_responses = super().next()
        after_step = time.perf_counter() if timed else 0.0
        if chosen is not None and generation_responses:
            values: List[Any] = chosen.tolist()  # type: ignore[assignment]
            # the step's responses are its rows', in order (GenerationBatch.next)
            for r, value in zip(generation_responses, values):
                r.logprobs = StepLogprobs(r.logprobs, r.token, value)
        if timed:
            if generation_responses:
                self.clock.step(start, after_step, time.perf_counter(), len(generation_responses))
            if not generation_responses or not len(mlx.generation_batch(self)):
                self.clock.idle()
        return prompt_responses, generation_responses


def batch_generator(settings: Callable[[], Any]) -> Callable[..., ServeBatchGenerator]:
    """What ``mlx_lm.server`` constructs as its ``BatchGenerator``: a
    ``ServeBatchGenerator`` with the parsed flags' ``prefill_budget``
    (``settings()``: the server's parsed arguments, once parsed)."""

    def make(model: Any, **kwargs: Any) -> ServeBatchGenerator:
        budget = getattr(settings(), "prefill_budget", 0) or 0
        return ServeBatchGenerator(model, prefill_budget=budget, **kwargs)
    return make
