"""Context policy: what a request keeps when it outgrows ``max_context``
(docs/policy.md). Pure logic on token ids; no arrays, no tokenizer. Shared by
the two serving stacks: the library's slots (``serving.pool``: ``shift_chat``,
``ChatShift``) and ``muser-kv serve`` (``serving.server.context_fit``).

The engine never shifts: a cache refuses a write past ``max_context``
(``ContextOverflow``). Deciding what survives is the server's job, and it keeps
semantic units, never token counts:

* **Chat.** Messages split into a *system prologue* (every ``system`` message,
  all of which must come before the first turn) and *turns*. A turn starts at
  each ``user`` message and owns everything after it up to the next one:
  assistant replies, tool calls and results, image-bearing messages. A shift
  drops the oldest whole turns, never part of one, and never the system
  prologue (``pool.chat_shift``).
* **Raw.** A configured prefix plus the newest suffix that fits (``compact_raw``).

Every count here is a number of positions: the prompt is the concatenation of
the messages' token ids, so a message costs ``len(message.tokens)`` positions.
Positions past ``max_context - output_reserve`` belong to generation.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass
from typing import Iterable, Sequence, Tuple

#: The roles a message may carry.
ROLES = ("system", "user", "assistant", "tool")


class ContextPolicy(str, enum.Enum):
    """What a request that does not fit does."""

    #: Drop the oldest whole turns, rebuild the rest at true positions (default).
    SHIFT = "shift"
    #: Refuse the request; the session is not touched.
    ERROR = "error"


# -- errors -------------------------------------------------------------------


class ContextPolicyError(ValueError):
    """Base of every refusal the context policy makes."""


class ContextTooLong(ContextPolicyError):
    """The smallest context the policy may keep needs more positions than exist.

    ``needed`` counts the retained tokens plus the output reserve; ``available``
    is ``max_context``."""

    def __init__(self, needed: int, available: int, what: str = "the request"):
        self.needed = needed
        self.available = available
        self.what = what
        super().__init__(
            f"{what} needs {needed} positions but max_context is {available} "
            f"({needed - available} too many)"
        )

    def __reduce__(self):
        return type(self), (self.needed, self.available, self.what)


class SystemAfterTurns(ContextPolicyError):
    """A ``system`` message after the first turn: the system prologue must be one
    leading run, or a shift could not keep "the system content" as one unit."""

    def __init__(self, index: int):
        self.index = index
        super().__init__(
            f"message {index} is a system message after the conversation turns began; "
            "all system messages must precede the first turn"
        )

    def __reduce__(self):
        return type(self), (self.index,)


class LineageMismatch(ContextPolicyError):
    """A continuation that does not extend the slot's retained context: the
    system content differs, or the retained turns are not one exact ordered run."""

    def __init__(self, reason: str, slot: int | None = None, epoch: int | None = None):
        self.reason = reason
        self.slot = slot
        self.epoch = epoch
        where = "" if slot is None else f"slot {slot} (epoch {epoch}): "
        super().__init__(f"{where}continuation refused: {reason}")

    def __reduce__(self):
        return type(self), (self.reason, self.slot, self.epoch)


# -- records ------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """One chat message as token ids. ``tokens`` are the positions it occupies
    in the prompt (template tokens included); ``image`` marks an image-bearing
    message, which stays attached to its turn like any other."""

    role: str
    tokens: Tuple[int, ...]
    image: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Message role must be one of {ROLES}, got {self.role!r}")
        if isinstance(self.tokens, (str, bytes)):
            raise TypeError("Message tokens must be a sequence of token ids, not text")
        tokens = []
        for t in self.tokens:
            if isinstance(t, bool):
                raise TypeError(f"Message token ids must be ints, got {t!r}")
            t = operator.index(t)
            if t < 0:
                raise ValueError(f"Message token ids must be >= 0, got {t}")
            tokens.append(t)
        object.__setattr__(self, "tokens", tuple(tokens))
        if not isinstance(self.image, bool):
            raise TypeError(f"Message image must be a bool, got {self.image!r}")


Turn = Tuple[Message, ...]


@dataclass(frozen=True)
class ChatTurns:
    """A conversation split into its system prologue and its turns.

    Every turn but possibly the first starts with a ``user`` message; a first
    turn that does not is the *opening unit* (non-system messages before the
    first user message, e.g. an assistant greeting), dropped like any turn."""

    system: Tuple[Message, ...]
    turns: Tuple[Turn, ...]

    @property
    def system_tokens(self) -> int:
        return count_tokens(self.system)

    @property
    def turn_tokens(self) -> Tuple[int, ...]:
        return tuple(count_tokens(t) for t in self.turns)

    @property
    def tokens(self) -> int:
        return self.system_tokens + sum(self.turn_tokens)

    @property
    def conversation(self) -> Tuple[Message, ...]:
        """The turns' messages, flattened in order."""
        return tuple(m for turn in self.turns for m in turn)

    @property
    def messages(self) -> Tuple[Message, ...]:
        return self.system + self.conversation


@dataclass(frozen=True)
class RawCompaction:
    """What a raw shift keeps: ``tokens`` (the prefix, then the newest suffix)
    and how many middle tokens were ``dropped``."""

    tokens: Tuple[int, ...]
    dropped: int


# -- the rules ----------------------------------------------------------------


def count_tokens(messages: Iterable[Message]) -> int:
    """Positions a run of messages occupies: the sum of their token counts."""
    return sum(len(m.tokens) for m in messages)


def prompt_tokens(messages: Iterable[Message]) -> Tuple[int, ...]:
    """The prompt: every message's token ids, concatenated in order."""
    return tuple(t for m in messages for t in m.tokens)


def _check_messages(messages: Sequence[Message]) -> Tuple[Message, ...]:
    out = tuple(messages)
    for i, m in enumerate(out):
        if not isinstance(m, Message):
            raise TypeError(f"message {i} must be a muser_kv.Message, got {type(m).__name__}")
    return out


def complete_chat_turns(messages: Sequence[Message]) -> ChatTurns:
    """Split ``messages`` into the system prologue and whole turns.

    A turn begins at each ``user`` message and keeps every following non-user
    message, so a shift can only ever remove complete replay units. Raises
    ``SystemAfterTurns`` for a system message once the turns have begun."""
    messages = _check_messages(messages)
    system = []
    i = 0
    while i < len(messages) and messages[i].role == "system":
        system.append(messages[i])
        i += 1
    turns: list = []
    for j in range(i, len(messages)):
        m = messages[j]
        if m.role == "system":
            raise SystemAfterTurns(j)
        if m.role == "user" or not turns:
            turns.append([m])
        else:
            turns[-1].append(m)
    return ChatTurns(tuple(system), tuple(tuple(t) for t in turns))


def check_context_budget(max_context: int, output_reserve: int) -> None:
    """Refuse a ``max_context`` below 1 or an ``output_reserve`` below 0 (both ints)."""
    for name, value, low in (("max_context", max_context, 1), ("output_reserve", output_reserve, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def compact_raw(tokens: Sequence[int], max_context: int, output_reserve: int = 0,
                keep_prefix: int = 0) -> RawCompaction:
    """Keep the first ``keep_prefix`` tokens plus the newest suffix that fits.

    A prompt that fits is returned whole. Otherwise the suffix gets every position
    the prefix and the reserve leave, and must get at least one: ``ContextTooLong``
    when ``keep_prefix + 1 + output_reserve`` exceeds ``max_context`` (or when a
    prompt no longer than its prefix does not fit)."""
    check_context_budget(max_context, output_reserve)
    if isinstance(keep_prefix, bool) or not isinstance(keep_prefix, int) or keep_prefix < 0:
        raise ValueError(f"keep_prefix must be an int >= 0, got {keep_prefix!r}")
    tokens = tuple(operator.index(t) for t in tokens)
    n = len(tokens)
    if n + output_reserve <= max_context:
        return RawCompaction(tokens, 0)
    if n <= keep_prefix:
        raise ContextTooLong(n + output_reserve, max_context, "raw prompt (all prefix) and output reserve")
    suffix = max_context - output_reserve - keep_prefix
    if suffix < 1:
        raise ContextTooLong(keep_prefix + 1 + output_reserve, max_context,
                             "raw prefix, newest token and output reserve")
    return RawCompaction(tokens[:keep_prefix] + tokens[n - suffix:], n - keep_prefix - suffix)
