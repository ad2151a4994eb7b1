"""Ring arithmetic: the seeds' walks, fail-closed continuity, and a property
test against a plain list of positions."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muser_kv import CacheDiscontinuity, Ring


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

    import muser_kv.ring as ring_mod

    tree = ast.parse(pathlib.Path(ring_mod.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in n.names} | {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(name.startswith("mlx") for name in names)
