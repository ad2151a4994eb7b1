"""The context policy as pure logic: whole turns, the system
prologue always kept, refusal when the smallest unit plus reserve cannot fit,
raw prefix + newest suffix."""

import inspect
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import muser_kv
from muser_kv import (
    ContextPolicy,
    ContextTooLong,
    LineageMismatch,
    Message,
    SystemAfterTurns,
    compact_raw,
    complete_chat_turns,
    shift_chat,
)


def msg(role, n, first=1, image=False):
    return Message(role, tuple(range(first, first + n)), image)


def test_message_validates_role_and_tokens():
    assert Message("user", [1, 2]).tokens == (1, 2)
    for bad in ("developer", "User", ""):
        with pytest.raises(ValueError, match="role"):
            Message(bad, (1,))
    with pytest.raises(ValueError, match=">= 0"):
        Message("user", (1, -2))
    with pytest.raises(TypeError):
        Message("user", "hello")
    with pytest.raises(TypeError):
        Message("user", (1, True))
    with pytest.raises(TypeError):
        Message("user", (1,), image=1)


def test_policy_enum():
    assert ContextPolicy("shift") is ContextPolicy.SHIFT
    assert ContextPolicy("error") is ContextPolicy.ERROR
    default = inspect.signature(muser_kv.SlotPool).parameters["policy"].default
    assert default is ContextPolicy.SHIFT


def test_turns_keep_assistant_tool_and_image_attached():
    sys_a, sys_b = msg("system", 3), msg("system", 2, 50)
    u1, a1, t1, a1b = msg("user", 4), msg("assistant", 2), msg("tool", 5), msg("assistant", 1)
    u2, img, a2 = msg("user", 1), msg("user", 7, image=True), msg("assistant", 3)
    chat = complete_chat_turns([sys_a, sys_b, u1, a1, t1, a1b, u2, img, a2])
    assert chat.system == (sys_a, sys_b)
    assert chat.turns == ((u1, a1, t1, a1b), (u2,), (img, a2))
    assert chat.system_tokens == 5 and chat.turn_tokens == (12, 1, 10) and chat.tokens == 28
    assert chat.messages == (sys_a, sys_b, u1, a1, t1, a1b, u2, img, a2)


def test_image_message_is_part_of_its_turn():
    u, image, a = msg("user", 2), msg("tool", 9, image=True), msg("assistant", 1)
    assert complete_chat_turns([u, image, a]).turns == ((u, image, a),)


def test_opening_unit_before_the_first_user_message():
    greet, u, a = msg("assistant", 2), msg("user", 3), msg("assistant", 1)
    chat = complete_chat_turns([msg("system", 1), greet, u, a])
    assert chat.turns == ((greet,), (u, a))


def test_no_turns_and_no_messages():
    assert complete_chat_turns([]).turns == ()
    s = msg("system", 4)
    assert complete_chat_turns([s]) == muser_kv.ChatTurns((s,), ())


def test_system_after_turns_is_refused_with_its_index():
    with pytest.raises(SystemAfterTurns, match="message 3 is a system message") as e:
        complete_chat_turns([msg("system", 1), msg("user", 1), msg("assistant", 1),
                             msg("system", 1)])
    assert e.value.index == 3
    assert isinstance(e.value, muser_kv.ContextPolicyError) and isinstance(e.value, ValueError)
    with pytest.raises(SystemAfterTurns):
        shift_chat([msg("user", 1), msg("system", 1)], 100)


def test_shift_chat_keeps_everything_that_fits():
    messages = [msg("system", 5), msg("user", 10), msg("assistant", 10)]
    out = shift_chat(messages, 30, 5)
    assert out.retained == tuple(messages) and out.dropped_turns == 0 and out.tokens == 25
    assert not out.shifted


def test_shift_chat_drops_oldest_whole_turns():
    s = msg("system", 6)
    t1 = (msg("user", 10), msg("assistant", 10))  # 20
    t2 = (msg("user", 5), msg("tool", 7, image=True), msg("assistant", 3))  # 15
    t3 = (msg("user", 8),)  # 8
    messages = [s, *t1, *t2, *t3]
    # 6 + 20 + 15 + 8 = 49 positions; reserve 10
    assert shift_chat(messages, 59, 10).dropped_turns == 0
    out = shift_chat(messages, 58, 10)
    assert out.retained == (s, *t2, *t3) and out.dropped_turns == 1 and out.tokens == 29
    out = shift_chat(messages, 38, 10)
    assert out.retained == (s, *t3) and out.dropped_turns == 2 and out.tokens == 14
    # a turn is never split even where part of it would fit
    out = shift_chat(messages, 38, 10)
    assert all(m not in out.retained for m in t2)


def test_shift_chat_refuses_when_system_newest_turn_and_reserve_cannot_fit():
    s, u, a = msg("system", 6), msg("user", 8), msg("assistant", 3)
    old = msg("user", 30)
    assert shift_chat([s, old, u, a], 6 + 11 + 4, 4).retained == (s, u, a)
    with pytest.raises(ContextTooLong) as e:
        shift_chat([s, old, u, a], 6 + 11 + 4 - 1, 4)
    assert (e.value.needed, e.value.available) == (21, 20)
    assert "21 positions" in str(e.value) and "max_context is 20" in str(e.value)
    assert "system content, newest turn and output reserve" in str(e.value)
    with pytest.raises(ContextTooLong, match="system content and output reserve"):
        shift_chat([msg("system", 10)], 12, 3)
    assert pickle.loads(pickle.dumps(e.value)).needed == 21


def test_shift_chat_validates_budget():
    for bad in ((0, 0), (10, -1), (10.0, 0), (True, 0)):
        with pytest.raises(ValueError):
            shift_chat([msg("user", 1)], *bad)


def test_compact_raw_keeps_prefix_and_newest_suffix():
    tokens = tuple(range(100))
    assert compact_raw(tokens, 120, 20, 10) == muser_kv.RawCompaction(tokens, 0)
    out = compact_raw(tokens, 60, 10, 8)
    assert out.tokens == tokens[:8] + tokens[58:] and len(out.tokens) == 50 and out.dropped == 50
    out = compact_raw(tokens, 60, 10, 0)
    assert out.tokens == tokens[50:]
    assert compact_raw(tokens, 60, 10, 49).tokens == tokens[:49] + (99,)
    with pytest.raises(ContextTooLong) as e:
        compact_raw(tokens, 60, 10, 50)
    assert (e.value.needed, e.value.available) == (61, 60)
    with pytest.raises(ContextTooLong) as e:
        compact_raw(tokens[:20], 15, 0, 30)
    assert (e.value.needed, e.value.available) == (20, 15)
    with pytest.raises(ValueError):
        compact_raw(tokens, 60, 10, -1)


def test_error_messages_name_their_sizes():
    assert "slot 2 (epoch 5)" in str(LineageMismatch("x", 2, 5))
    assert str(ContextTooLong(70, 64)) == "the request needs 70 positions but max_context is 64 (6 too many)"


# -- the property ---------------------------------------------------------------

token_counts = st.integers(min_value=0, max_value=12)


@st.composite
def conversations(draw):
    system = [Message("system", (1,) * n) for n in draw(st.lists(token_counts, max_size=2))]
    turns = []
    for _ in range(draw(st.integers(0, 6))):
        turn = [Message("user", (2,) * draw(token_counts), draw(st.booleans()))]
        for role in draw(st.lists(st.sampled_from(["assistant", "tool"]), max_size=3)):
            turn.append(Message(role, (3,) * draw(token_counts), draw(st.booleans())))
        turns.append(tuple(turn))
    return system, turns


@settings(max_examples=300, deadline=None)
@given(conversations(), st.integers(1, 80), st.integers(0, 30))
def test_shift_keeps_system_and_a_maximal_suffix_of_whole_turns(conv, max_context, reserve):
    system, turns = conv
    messages = system + [m for t in turns for m in t]
    size = lambda ms: sum(len(m.tokens) for m in ms)  # noqa: E731
    minimum = size(system) + (size(turns[-1]) if turns else 0) + reserve
    if minimum > max_context:
        with pytest.raises(ContextTooLong) as e:
            shift_chat(messages, max_context, reserve)
        assert (e.value.needed, e.value.available) == (minimum, max_context)
        return
    out = shift_chat(messages, max_context, reserve)
    kept = turns[out.dropped_turns:]
    assert out.retained == tuple(system) + tuple(m for t in kept for m in t)
    assert out.tokens == size(out.retained)
    assert out.tokens + reserve <= max_context
    if out.dropped_turns:  # one more turn would not have fit
        assert out.tokens + size(turns[out.dropped_turns - 1]) + reserve > max_context
    assert complete_chat_turns(out.retained).turns == tuple(kept)
