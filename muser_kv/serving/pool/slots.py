"""SlotPool: up to four serving sessions over one model, plus one hidden staging
session that rebuilds a shifted context off to the side (docs/policy.md).

Invariants, each with a test (``tests/serving/test_slots.py``):

* **Weights once, KV per slot.** Every session owns a cache list of its own, its
  planes one slot of planes the pool allocates once per layer for ``slots + 1``
  sequences -- the serving slots and the staging session -- so the pool costs
  ``footprint(geometry, max_context, slots + 1).total_bytes``, allocated when the
  pool is built, not when the first shift needs it; the model is shared.
* **Busy slots decode together.** ``step`` feeds one token to each of several
  slots in one batched forward over those shared planes (``batch.py``: each
  slot's ring stays its own, a slot not in the step is not written), so decode
  reads the weights once for all of them; each slot's tokens are its solo run's.
* **Staging is not a slot.** ``slot(i)`` accepts ``0 <= i < slots`` only; no
  index, handle or result ever refers to the staging cache, so it can never
  admit or decode a request.
* **The engine never shifts.** A request whose retained context, new tokens and
  output reserve fit is appended to the live cache. One that does not is
  refused (``ContextPolicy.ERROR``) before anything changes, or shifted
  (``ContextPolicy.SHIFT``): ``shift_chat`` picks the system prologue plus the
  newest whole turns, they are prefilled into staging at their true positions
  ``0 .. n-1`` (RoPE rows are rotated at store time, so survivors cannot be slid
  down in place), and only a staging prefill that fully evaluated is published
  by one reference assignment. Any failure before that leaves the live cache,
  history and epoch exactly as they were. The demoted session's slot (or a
  failed rebuild's) becomes the next staging session, emptied first: a handle
  taken with ``slot(i)`` is valid until that slot's next request.
* **Epochs and lineage.** Each shift advances the slot's context epoch (so does
  ``reset``; a rebuild that drops nothing -- a regenerated or edited reply, a
  stale slot -- keeps it, since the retained turns are unchanged). A
  continuation must carry the identical system prologue and then the retained
  turns as one exact ordered run -- preceded by nothing, or by the newest of the
  turns the slot's shifts dropped (checked by digest), as a client resending
  the whole conversation would -- else ``LineageMismatch``.
* **Rebuilt equals fresh.** A rebuild starts from a pristine cache and feeds
  the retained tokens in ``prefill_chunk`` chunks from position 0, so its state
  and logits are bitwise those of a fresh ``make_prompt_cache`` fed the same
  tokens the same way.

Operations are serialized by one pool lock: the model and the staging session
are shared by every slot.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import mlx.core as mx

from muser_kv.caches.base import MuseKVCache
from muser_kv.caches.batch import make_slot_caches
from muser_kv.caches.speculative import DEFAULT_RETAIN
from muser_kv.core.counts import count
from muser_kv.core.geometry import Footprint, MuseGeometry, footprint
from muser_kv.core.precision import DtypeLike, plane_dtype_for
from muser_kv.serving.install import vocab_size
from muser_kv.serving.policy import (
    ChatTurns,
    ContextPolicy,
    ContextTooLong,
    LineageMismatch,
    Message,
    complete_chat_turns,
    count_tokens,
    prompt_tokens,
)
from muser_kv.serving.pool.chat_shift import shift_chat, turn_digest

#: A pool serves at most this many concurrent slots, beside its staging session
#: (docs/policy.md).
MAX_SLOTS = 4

#: Positions per prefill chunk by default.
DEFAULT_PREFILL_CHUNK = 512

Cache = Tuple[MuseKVCache, ...]


class StaleSession(RuntimeError):
    """The slot's live cache no longer matches its history (an append failed and
    could not be trimmed back exactly). Its next ``prefill`` rebuilds the context
    in staging; ``decode`` is refused until then."""

    def __init__(self, slot: int):
        self.slot = slot
        super().__init__(
            f"slot {slot}: an earlier append failed and could not be undone exactly; "
            "prefill the conversation again to rebuild it"
        )

    def __reduce__(self):
        return type(self), (self.slot,)


class EmptySlot(RuntimeError):
    """A slot that holds no conversation (never prefilled, or reset) was asked to
    decode: there is no context for the token to follow."""

    def __init__(self, slot: int):
        self.slot = slot
        super().__init__(
            f"slot {slot} holds no conversation (never prefilled, or reset): prefill it before "
            "decoding")

    def __reduce__(self):
        return type(self), (self.slot,)


@dataclass
class _Session:
    """One slot's serving state. Replaced wholesale on a rebuild or reset, so a
    swap publishes cache, history, epoch and lineage in one assignment; only
    ``pending`` and ``stale`` change in place."""

    cache: Cache
    epoch: int = 0
    history: Tuple[Message, ...] = ()
    dropped: Tuple[bytes, ...] = ()
    pending: List[int] = field(default_factory=list)
    stale: bool = False


@dataclass(frozen=True, eq=False)
class Slot:
    """A read-only view of one serving slot, taken when ``SlotPool.slot`` was called.

    ``history`` is the retained context the cache holds (system prologue, then
    the retained turns and any appended messages); ``pending`` the tokens decoded
    after it; ``position`` the next logical position. ``cache`` is the live cache
    for inspection only, valid until the slot's next request (a rebuild replaces
    it, and a stale handle then keeps the old session's memory alive)."""

    index: int
    epoch: int
    position: int
    history: Tuple[Message, ...]
    pending: Tuple[int, ...]
    dropped_turns: int
    stale: bool
    cache: Cache


@dataclass(frozen=True, eq=False)
class Prefill:
    """What a request did. ``logits`` are the last position's (``[vocab]``);
    ``retained`` is the slot's history now, what the next continuation must
    carry; ``dropped_turns`` counts the turns this request's shift dropped;
    ``rebuilt`` is True when the context went through staging; ``computed`` is
    how many positions the model ran."""

    logits: mx.array
    epoch: int
    position: int
    retained: Tuple[Message, ...]
    dropped_turns: int
    rebuilt: bool
    computed: int


def prefill_tokens(model: Any, cache: Sequence[MuseKVCache], tokens: Sequence[int],
                   chunk: int) -> mx.array:
    """Feed ``tokens`` in chunks of ``chunk`` and return the last position's logits.

    Each chunk is evaluated (logits and every plane) before the next is built, so
    a failure surfaces here, inside the caller's ``try``, and memory stays at one
    chunk's activations."""
    if not tokens:
        raise ValueError("no tokens to prefill")
    caches = list(cache)
    logits: Optional[mx.array] = None
    for start in range(0, len(tokens), chunk):
        out = model(mx.array([list(tokens[start:start + chunk])], dtype=mx.uint32), cache=caches)
        logits = out[0, -1]
        mx.eval(logits, [c.kv_state for c in caches])
    assert logits is not None
    return logits


class SlotPool:
    """``slots`` independent serving sessions sharing ``model``'s weights, plus
    one hidden staging session for context shifts.

    ``max_context`` defaults to the model's ``max_position_embeddings``; a
    model whose args carry none needs it given (every plane is allocated whole).
    ``output_reserve`` positions are kept free for generation by every request
    (per-request override in ``prefill``). ``prefill_chunk`` is the prefill
    chunk width; ``retain`` is passed to every cache (``trim`` depth past the wrap);
    ``plane_dtype`` overrides the planes' type, which follows the model as in
    ``make_prompt_cache`` (bf16 for a bf16 model, else f16).
    """

    def __init__(self, model: Any, slots: int = 1, max_context: Optional[int] = None,
                 policy: ContextPolicy | str = ContextPolicy.SHIFT, output_reserve: int = 0, *,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, retain: int = DEFAULT_RETAIN,
                 plane_dtype: DtypeLike = None):
        args = getattr(model, "args", None)
        if args is None:
            raise TypeError(f"SlotPool needs an mlx-lm model with .args, got {type(model).__name__}")
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"a SlotPool serves 1 to {MAX_SLOTS} slots, got {slots!r}")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an int >= 1, got {prefill_chunk!r}")
        self.model = model
        self.geometry = MuseGeometry.from_model(model, max_context)
        self.max_context = self.geometry.max_context
        self.policy = ContextPolicy(policy)
        self.output_reserve = self._reserve(output_reserve)
        self.prefill_chunk = prefill_chunk
        self.retain = count(retain, "retain")
        self.plane_dtype = plane_dtype_for(model, plane_dtype)
        self.vocab_size = vocab_size(model)
        self.slots = slots
        self._lock = threading.RLock()
        # every session's planes, staging's too, are slots of shared planes: a
        # batched step reads them all in place (``batch.py``)
        self._batch, physical = make_slot_caches(self.geometry, slots + 1, self.retain,
                                                 self.plane_dtype, model=model)
        self._physical: List[Cache] = [tuple(c) for c in physical]
        self._sessions: List[_Session] = [_Session(self._physical[i]) for i in range(slots)]
        self._staging: Optional[Cache] = self._physical[slots]

    # -- facts -----------------------------------------------------------------

    def __len__(self) -> int:
        return self.slots

    def __repr__(self) -> str:
        return (f"SlotPool(slots={self.slots}, max_context={self.max_context}, "
                f"policy={self.policy.value}, output_reserve={self.output_reserve}, "
                f"nbytes={self.nbytes})")

    @property
    def footprint(self) -> Footprint:
        """The formula for this pool: ``slots + 1`` sessions (staging included)."""
        return footprint(self.geometry, self.max_context, self.slots + 1)

    @property
    def nbytes(self) -> int:
        """Plane bytes of every cache the pool holds, staging included."""
        with self._lock:
            caches = [s.cache for s in self._sessions]
            if self._staging is not None:
                caches.append(self._staging)
            return sum(c.nbytes for cache in caches for c in cache)

    def slot(self, index: int) -> Slot:
        """A read-only view of serving slot ``index`` (``0 <= index < slots``)."""
        with self._lock:
            i = self._index(index)
            s = self._sessions[i]
            return Slot(i, s.epoch, s.cache[0].offset, s.history, tuple(s.pending),
                        len(s.dropped), s.stale, s.cache)

    # -- requests --------------------------------------------------------------

    def prefill(self, slot: int, messages: Sequence[Message], *, epoch: Optional[int] = None,
                output_reserve: Optional[int] = None) -> Prefill:
        """Bring slot ``slot`` to ``messages`` and return the last position's logits.

        ``messages`` is the whole conversation as the client sees it; it must
        continue the slot's retained context (see the module docstring), and
        ``epoch``, when given, must be the slot's current epoch. The live cache is
        extended in place when the retained context plus the new tokens plus the
        reserve fit and the cache holds an exact prefix of them; otherwise the
        context (shifted, if it must be and the policy allows) is rebuilt in
        staging and swapped in."""
        reserve = self.output_reserve if output_reserve is None else self._reserve(output_reserve)
        messages = self._check_messages(messages)
        with self._lock:
            i = self._index(slot)
            try:
                return self._prefill(i, messages, epoch, reserve)
            finally:
                self._restock()

    def decode(self, slot: int, token: int) -> mx.array:
        """Feed one token to slot ``slot``; its logits ``[vocab]``. The token joins
        the slot's ``pending`` tokens. Never shifts: a full context raises
        ``ContextTooLong``; a failed step is trimmed back exactly when possible.
        A slot with no conversation (never prefilled, or reset) refuses
        (``EmptySlot``): a token needs a context to follow."""
        token = self._check_token(token)
        with self._lock:
            i, session, _ = self._decodable(slot)
            logits = self._append(i, session, (token,))
            session.pending.append(token)
            return logits

    def step(self, tokens: Mapping[int, int]) -> Dict[int, mx.array]:
        """Feed one token to each slot in ``tokens`` (slot -> token), every one in a
        single batched forward (decode reads the weights once for all of them);
        each slot's logits ``[vocab]``. Each token joins its slot's ``pending``
        tokens, as with ``decode``, whose refusals apply to every slot before any
        work; a failed step trims every slot back exactly when possible."""
        with self._lock:
            plan = []
            for slot, token in dict(tokens).items():
                token = self._check_token(token)
                i, session, position = self._decodable(slot)
                plan.append((i, token, self._physical.index(session.cache), position))
            if not plan:
                return {}
            rows = len(self._physical)
            active, inputs = [False] * rows, [0] * rows
            for _, token, p, _ in plan:
                active[p], inputs[p] = True, token
            for b in self._batch:
                b.active = active
            try:
                logits = self.model(mx.array(inputs, dtype=mx.uint32)[:, None], cache=self._batch)
                out = {i: logits[p, -1] for i, _, p, _ in plan}
                mx.eval(list(out.values()), [b.state for b in self._batch])
            except BaseException:
                for i, _, _, start in plan:
                    self._roll_back(self._sessions[i], start)
                raise
            finally:
                for b in self._batch:
                    b.active = None
            for i, token, _, _ in plan:
                self._sessions[i].pending.append(token)
            return out

    def _decodable(self, slot: int) -> Tuple[int, _Session, int]:
        """Slot ``slot``'s index, session and position, if it can take one more
        token (a live, non-stale conversation with room left), else the refusal."""
        i = self._index(slot)
        session = self._sessions[i]
        if session.stale:
            raise StaleSession(i)
        position = session.cache[0].offset
        if position == 0:
            raise EmptySlot(i)
        if position + 1 > self.max_context:
            raise ContextTooLong(position + 1, self.max_context, f"slot {i}: decoding one more token")
        return i, session, position

    def reset(self, slot: int) -> None:
        """End slot ``slot``'s conversation: an empty cache, no history, and a new
        epoch (so a continuation naming the old epoch is refused)."""
        with self._lock:
            i = self._index(slot)
            try:
                staging = self._take_staging()
                self._sessions[i] = _Session(staging, epoch=self._sessions[i].epoch + 1)
            finally:
                self._restock()

    # -- internals -------------------------------------------------------------

    def _pristine(self) -> Cache:
        """The one slot no session holds, emptied: every row zero, rings empty,
        nothing retained (the state of a fresh cache, bit for bit)."""
        held = {id(s.cache) for s in self._sessions}
        free = next(c for c in self._physical if id(c) not in held)
        for c in free:
            c.reset()
        mx.eval([c.kv_state for c in free])
        return free

    def _take_staging(self) -> Cache:
        """Move the staging cache out of the pool; pristine by construction."""
        staging, self._staging = self._staging, None
        return staging if staging is not None else self._pristine()

    def _restock(self) -> None:
        """Make the slot no session holds (a demoted session's, or a failed
        rebuild's) the pristine staging session. A failure here is deferred to
        the next rebuild, so it never hides the request's own exception."""
        if self._staging is None:
            try:
                self._staging = self._pristine()
            except Exception:
                self._staging = None

    def _index(self, index: int) -> int:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.slots:
            raise IndexError(
                f"slot {index!r} out of range: this pool serves slots 0..{self.slots - 1} "
                "(the staging session is not a slot)"
            )
        return index

    def _reserve(self, value: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.max_context:
            raise ValueError(f"output_reserve must be an int in [0, {self.max_context}), got {value!r}")
        return value

    def _check_token(self, token: int) -> int:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
            raise ValueError(f"token id must be an int in [0, {self.vocab_size}), got {token!r}")
        return token

    def _check_messages(self, messages: Sequence[Message]) -> Tuple[Message, ...]:
        messages = tuple(messages)
        if not messages:
            raise ValueError("a request needs at least one message")
        for j, m in enumerate(messages):
            if not isinstance(m, Message):
                raise TypeError(f"message {j} must be a muser_kv.Message, got {type(m).__name__}")
            if any(t >= self.vocab_size for t in m.tokens):
                raise ValueError(
                    f"message {j}: token id {max(m.tokens)} outside the model's vocabulary "
                    f"[0, {self.vocab_size})"
                )
        return messages

    def _continuation(self, i: int, session: _Session, request: ChatTurns) -> Tuple[Message, ...]:
        """The request's retained view: system prologue, the retained run, then the
        new messages. Turns before the run are accepted only when they are the
        newest turns the slot's shifts dropped (the longest such match wins)."""
        if not session.history and not session.dropped:
            return request.messages
        held = complete_chat_turns(session.history)
        if request.system != held.system:
            raise LineageMismatch(
                f"system content differs from the retained prologue ({len(held.system)} messages, "
                f"{held.system_tokens} tokens)", i, session.epoch)
        run = held.conversation
        conversation = request.conversation
        starts = [0]
        for turn in request.turns:
            starts.append(starts[-1] + len(turn))
        deepest = min(len(session.dropped), len(request.turns))
        digests = [turn_digest(t) for t in request.turns[:deepest]]
        for j in range(deepest, -1, -1):
            s = starts[j]
            if conversation[s:s + len(run)] != run:
                continue
            if j and tuple(digests[:j]) != session.dropped[-j:]:
                continue
            return request.system + conversation[s:]
        raise LineageMismatch(
            f"the {len(held.turns)} retained turns ({len(run)} messages) do not appear as one "
            f"exact ordered run, preceded only by turns the slot's shifts dropped", i, session.epoch)

    def _prefill(self, i: int, messages: Tuple[Message, ...], epoch: Optional[int],
                 reserve: int) -> Prefill:
        session = self._sessions[i]
        if epoch is not None and epoch != session.epoch:
            raise LineageMismatch(f"request names epoch {epoch}", i, session.epoch)
        view = self._continuation(i, session, complete_chat_turns(messages))
        total = count_tokens(view)
        if total == 0:
            raise ValueError("the request's retained context has no tokens to prefill")
        if total + reserve <= self.max_context:
            new = prompt_tokens(view[len(session.history):])
            pending = session.pending
            if not session.stale and len(new) > len(pending) and list(new[:len(pending)]) == pending:
                feed = new[len(pending):]
                logits = self._append(i, session, feed)
                session.history = view
                session.pending = []
                return Prefill(logits, session.epoch, total, view, 0, False, len(feed))
            return self._rebuild(i, session, view, (), session.epoch)
        if self.policy is ContextPolicy.ERROR:
            raise ContextTooLong(total + reserve, self.max_context,
                                 f"slot {i}: the request ({total} prompt tokens + {reserve} output "
                                 f"reserve) under ContextPolicy.ERROR")
        shift = shift_chat(view, self.max_context, reserve)
        dropped = tuple(turn_digest(t) for t in complete_chat_turns(view).turns[:shift.dropped_turns])
        return self._rebuild(i, session, shift.retained, dropped, session.epoch + 1)

    def _rebuild(self, i: int, session: _Session, retained: Tuple[Message, ...],
                 dropped: Tuple[bytes, ...], epoch: int) -> Prefill:
        """Prefill ``retained`` into staging at positions ``0 .. n-1``; publish it
        as slot ``i``'s session only once every chunk evaluated. A failure drops
        the staging cache and leaves the live session untouched."""
        tokens = prompt_tokens(retained)
        staging = self._take_staging()
        logits = prefill_tokens(self.model, staging, tokens, self.prefill_chunk)
        self._sessions[i] = _Session(staging, epoch, retained, session.dropped + dropped)
        return Prefill(logits, epoch, len(tokens), retained, len(dropped), True, len(tokens))

    def _append(self, i: int, session: _Session, tokens: Sequence[int]) -> mx.array:
        """Extend the live cache. On failure, trim every layer back to where it
        was; a layer that cannot be trimmed exactly marks the session stale."""
        start = session.cache[0].offset
        try:
            return prefill_tokens(self.model, session.cache, tokens, self.prefill_chunk)
        except BaseException:
            self._roll_back(session, start)
            raise

    @staticmethod
    def _roll_back(session: _Session, start: int) -> None:
        """Trim the cache back to ``start``, exactly, or mark the session stale.
        A failure part-way through a chunk leaves the layers it reached one chunk
        ahead of the rest (a list is never in any other shape, ``cachelist``):
        those are trimmed back to the rest first, then the whole list to ``start``
        -- each a trim over the list, all or nothing."""
        try:
            behind = min(c.offset for c in session.cache)
            for target in (behind, start):
                for c in session.cache:
                    extra = c.offset - target
                    if extra > 0:
                        c.trim(extra)
            mx.eval([c.kv_state for c in session.cache])
        except Exception:
            session.stale = True
