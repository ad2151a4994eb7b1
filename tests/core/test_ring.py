"""Ring arithmetic: walks through wraps, fail-closed continuity, and a property
test against a plain list of positions."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muser_kv import CacheDiscontinuity, Ring, Run


def state(r: Ring):
    return (r.len, r.origin_logical, r.origin_physical)


def test_fill_then_first_wrap():
    r = Ring(2048)
    for p in range(2048):
        assert r.append(p) == p
    assert state(r) == (2048, 0, 0)
    assert r.append(2048) == 0  # overwrite slot 0
    assert state(r) == (2048, 1, 1)
    assert r.append(2049) == 1
    assert state(r) == (2048, 2, 2)


def test_append_batch_wrap_1900_plus_512():
    r = Ring(2048)
    assert r.append_batch(0, 1900) == (0, 1900)
    assert r.append_batch(1900, 512) == (0, 512)
    assert state(r) == (2048, 364, 364)
    # steady state: every 512-chunk evicts 512 old rows, all new rows live
    assert r.append_batch(2412, 512) == (0, 512)
    assert state(r) == (2048, 876, 876)


def test_chunk_wider_than_ring_returns_source_first():
    r = Ring(16)
    r.append_batch(0, 10)
    first, count = r.append_batch(10, 37)
    assert (first, count) == (37 + 10 - 16 - 10, 16)  # 21 rows of the chunk scrolled out
    assert state(r) == (16, 31, 31 % 16)
    assert r.end == 47


def test_nope_never_wraps():
    r = Ring(131072)
    r.append_batch(0, 100_000)
    r.append_batch(100_000, 31_072)
    assert state(r) == (131072, 0, 0)


@pytest.mark.parametrize("bad", [0, 4, 6, 100])
def test_discontinuity_fails_closed(bad):
    r = Ring(8, layer=7)
    r.append_batch(0, 5)
    before = state(r)
    with pytest.raises(CacheDiscontinuity) as e:
        r.append(bad)
    assert (e.value.layer, e.value.expected, e.value.got) == (7, 5, bad)
    with pytest.raises(CacheDiscontinuity):
        r.append_batch(bad, 3)
    assert state(r) == before


def test_runs_split_at_the_seam():
    r = Ring(8, len=8, origin_logical=13, origin_physical=5)
    runs = r.live_runs()
    assert [(x.physical, x.length, x.source) for x in runs] == [(5, 3, 0), (0, 5, 3)]
    assert [r.physical(p) for p in range(13, 21)] == [5, 6, 7, 0, 1, 2, 3, 4]
    with pytest.raises(IndexError):
        r.physical(12)


# -- property test: random appends and batches against a list of positions ---

ops = st.lists(
    st.one_of(st.just(("append", 1)), st.tuples(st.just("batch"), st.integers(0, 40))),
    min_size=1, max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 24), ops=ops)
def test_ring_matches_list_oracle(capacity, ops):
    ring = Ring(capacity)
    history = []          # every position ever written, in order
    # The oracle's ring: a ring filled from empty one position at a time holds
    # position p in slot p % capacity. The oracle may use that formula; the Ring
    # must get the same answer from its origins alone.
    slots = [None] * capacity
    for kind, n in ops:
        start = len(history)
        if kind == "append":
            assert ring.append(start) == start % capacity
            slots[start % capacity] = start
            history.append(start)
        else:
            first, count = ring.append_batch(start, n)
            assert first + count == n
            positions = list(range(start, start + n))
            history.extend(positions)
            live = positions[first:]
            assert live == positions[max(0, n - capacity):]
            for p in live:
                slots[p % capacity] = p
        # the live window is exactly the newest min(len(history), capacity) positions
        window = history[-capacity:]
        assert ring.len == len(window)
        assert ring.origin_logical == (window[0] if window else 0)
        assert ring.end == len(history)
        # explicit-origin translation agrees with where every row was put
        assert [slots[ring.physical(p)] for p in window] == window
        # origins advance together: the rotation equals origin_logical % capacity
        assert ring.origin_physical == ring.origin_logical % capacity
        runs = ring.live_runs()
        assert sum(r.length for r in runs) == ring.len and len(runs) <= 2
        assert [slots[r.physical + i] for r in runs for i in range(r.length)] == window


def test_ring_module_does_not_import_mlx():
    import ast
    import pathlib

    import muser_kv.core.ring as ring_mod

    tree = ast.parse(pathlib.Path(ring_mod.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in n.names} | {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(name.startswith("mlx") for name in names)


# -- plans: the one place positions become rows ----------------------------------

from muser_kv.core.ring import Read  # noqa: E402


def test_write_plan_reads_and_runs():
    r = Ring(8)
    w = r.write(0, 5)
    assert (w.read, w.rows, w.offset, w.runs, w.evicted) == (Read.PREFIX, 5, 0, (Run(0, 5, 0),), (0, 0))
    assert state(r) == (0, 0, 0)  # a plan changes nothing
    r = w.after
    w = r.write(5, 3)  # fills the ring exactly: still read in place
    assert (w.read, w.rows, w.offset) == (Read.PREFIX, 8, 5)
    r = w.after
    w = r.write(8, 1)  # one token into a full ring: the ring as it lies
    assert (w.read, w.rows, w.runs, w.evicted) == (Read.RING, 8, (Run(0, 1, 0),), (0, 1))
    r = w.after
    w = r.write(9, 3)  # a chunk that wraps: the staging shadow, old rows first
    assert (w.read, w.rows, w.offset) == (Read.SHADOW, 11, 8)
    assert w.runs == (Run(1, 3, 0),) and w.evicted == (1, 4)
    w = w.after.write(12, 20)  # wider than the ring: only its last 8 rows land
    assert w.read is Read.SHADOW and w.evicted == (4, 24)  # old rows 4..11, chunk rows 12..23
    assert sum(x.length for x in w.runs) == 8 and w.runs[0].source == 12
    with pytest.raises(CacheDiscontinuity):
        w.after.write(31, 1)
    with pytest.raises(ValueError):
        w.after.write(32, 0)


def test_trim_plan_puts_back_what_was_overwritten():
    r = Ring(8)
    r.append_batch(0, 13)  # live [5, 13), origin_physical 5
    assert r.trimmable(None) == 0 and r.trimmable(2) == 3 and r.trimmable(0) == 13
    t = r.trimmed(3)  # end 10: live [2, 10), rows 2..4 come back
    assert state(t.after) == (8, 2, 2) and t.restore == (2, 5)
    assert t.runs == (Run(2, 3, 0),)
    t = r.trimmed(11)  # end 2: live [0, 2), both from retained copies
    assert state(t.after) == (2, 0, 0) and t.restore == (0, 2)
    fresh = Ring(8)
    fresh.append_batch(0, 6)
    assert fresh.trimmable(None) == 6 and fresh.trimmed(6).restore == (0, 0)


def test_installed_and_ahead():
    r = Ring.installed(8, 13, 8)
    assert state(r) == (8, 13, 5)
    # the next rows a full ring overwrites: its oldest live rows
    assert r.runs(r.origin_logical, 3) == [Run(5, 3, 0)]
    assert r.runs(r.origin_logical, 4) == [Run(5, 3, 0), Run(0, 1, 3)]


def test_step_is_append_when_in_step_and_nothing_otherwise():
    """``step`` reserves the same row as ``append`` for one token, and changes
    nothing (returns -1) when the neighbour is not ``lead`` ahead or the end is
    at the limit."""
    for capacity, filled in ((8, 3), (8, 8), (8, 13)):
        a, b = Ring(capacity), Ring(capacity)
        a.append_batch(0, filled)
        b.assign(a)
        prev = Ring(capacity)
        prev.append_batch(0, filled + 1)  # the layer before, one token ahead
        assert a.step(prev, 1, 1000) == b.append(b.end) and a == b
        before = a.copy()
        assert a.step(prev, 1, 1000) == -1 and a == before  # prev is level now, not 1 ahead
        assert a.step(a, 0, a.end) == -1 and a == before  # at the limit
        assert a.step(a, 0, a.end + 1) == b.append(b.end) and a == b
        assert a.end == a.origin_logical + a.len == b.end
    split = Ring(8, 3, 0, 6)  # live rows split around the end: read through the shadow
    before = split.copy()
    assert split.read_for(1) is Read.SHADOW
    assert split.step(split, 0, 1000) == -1 and split == before and split.end == before.end


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 12), st.lists(st.integers(1, 20), min_size=1, max_size=12), st.data())
def test_write_and_trim_plans_match_a_list_oracle(capacity, chunks, data):
    """Every plan against a plain list: which positions land where, which leave,
    what a trim needs back -- the ring's answers are the only arithmetic."""
    r, slots, pos = Ring(capacity), [None] * capacity, 0
    for n in chunks:
        w = r.write(pos, n)
        live_before = set(s for s in slots if s is not None)
        for run in w.runs:
            for i in range(run.length):
                slots[run.physical + i] = pos + run.source + i
        live_after = set(s for s in slots if s is not None)
        lo, hi = w.evicted  # what leaves the window: old rows, and chunk rows that never land
        assert set(range(lo, hi)) == (live_before | set(range(pos, pos + n))) - live_after
        assert live_after == set(range(max(0, pos + n - capacity), pos + n))
        r, pos = w.after, pos + n
        assert [r.physical(p) for p in sorted(live_after)] == [slots.index(p) for p in sorted(live_after)]
    k = data.draw(st.integers(0, pos))
    first = data.draw(st.one_of(st.none(), st.integers(0, r.origin_logical)))
    depth = r.trimmable(first)
    if k <= depth:
        t = r.trimmed(k)
        end = pos - k
        want = set(range(max(0, end - capacity), end))
        assert set(range(t.after.origin_logical, t.after.end)) == want
        lo, hi = t.restore
        # what comes back is exactly what is live after but not in the ring now
        assert set(range(lo, hi)) == want - set(range(r.origin_logical, r.end))
        if first is not None and hi > lo:
            assert lo >= first
        for run in t.runs:
            for i in range(run.length):
                assert t.after.physical(lo + run.source + i) == run.physical + i
