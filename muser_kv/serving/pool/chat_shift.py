"""The pool's chat shift: what a slot keeps of a conversation that outgrows
``max_context`` (``ContextPolicy.SHIFT``), the system prologue and the newest
whole turns, and the digest by which a slot remembers the turns it dropped.
The turn rules themselves (``complete_chat_turns``) are ``serving.policy``'s.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence, Tuple

from muser_kv.serving.policy import (
    ContextTooLong,
    Message,
    check_context_budget,
    complete_chat_turns,
)


@dataclass(frozen=True)
class ChatShift:
    """What a chat shift keeps: the system prologue and the newest whole turns.

    ``retained`` is the new prompt's messages in order; ``dropped_turns`` how many
    of the oldest turns went; ``tokens`` the retained positions (without the
    output reserve)."""

    retained: Tuple[Message, ...]
    dropped_turns: int
    tokens: int

    @property
    def shifted(self) -> bool:
        return self.dropped_turns > 0


def shift_chat(messages: Sequence[Message], max_context: int, output_reserve: int = 0) -> ChatShift:
    """Drop the oldest whole turns until system + retained turns + reserve fit.

    Keeps the most turns that fit (a suffix of the turns) and always the whole
    system prologue. Raises ``ContextTooLong`` when the system prologue, the newest
    turn and ``output_reserve`` cannot fit ``max_context`` together: that is the
    smallest context a chat shift may produce."""
    check_context_budget(max_context, output_reserve)
    chat = complete_chat_turns(messages)
    budget = max_context - output_reserve
    sizes = chat.turn_tokens
    used = chat.system_tokens
    minimum = used + (sizes[-1] if sizes else 0) + output_reserve
    if minimum > max_context:
        what = "system content" + (", newest turn" if sizes else "") + " and output reserve"
        raise ContextTooLong(minimum, max_context, what)
    keep = 0
    for size in reversed(sizes):
        if used + size > budget:
            break
        used += size
        keep += 1
    dropped = len(sizes) - keep
    retained = chat.system + tuple(m for turn in chat.turns[dropped:] for m in turn)
    return ChatShift(retained, dropped, used)


def turn_digest(turn: Sequence[Message]) -> bytes:
    """sha256 of a turn's roles, image flags and token ids: how a slot remembers
    the turns a shift dropped without keeping their tokens."""
    h = hashlib.sha256()
    for m in turn:
        h.update(f"{m.role}\0{int(m.image)}\0{len(m.tokens)}\0".encode())
        h.update(b"".join(t.to_bytes(8, "little") for t in m.tokens))
    return h.digest()
