"""One restore path: a snapshot install, a session load and a
KV-store rebuild go through one gate -- each check once per restore, the same
refusal with the same error -- and one install loop, so the lists they give
for one state are one list, bit for bit, allocation included. (A handoff
receive is pinned alongside in ``test_handoff.py``: it needs two processes.)"""

from __future__ import annotations

import collections

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model

import muser_kv
from muser_kv import (
    KVStore,
    ModelMismatch,
    ProductionF16Required,
    SessionSnapshot,
    SnapshotMismatch,
    load_session,
    save_session,
)
from muser_kv.sessions import restore

CONTEXT = 128
#: past the ring wrap (window 16), not a multiple of it: rotations tell installs apart
POSITION = 43


def tokens(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in (np.arange(n) * 7 + 3 + 11 * seed) % 251 + 1]


def live(model, position: int = POSITION, preallocate: bool = False):
    cache = muser_kv.make_prompt_cache(model, CONTEXT, preallocate=preallocate)
    toks = tokens(position)
    for s in range(0, position, 11):
        model(mx.array([toks[s:s + 11]]), cache=cache)
    mx.eval([c.kv_state for c in cache])
    return cache


def bits(x: mx.array) -> np.ndarray:
    return np.array(x.view(mx.uint16))


def whole(cache):
    """Everything attention is handed and a restore sets: each plane's bits in
    their allocated shape, and each ring."""
    return [(bits(k), bits(v), c.meta_state) for c in cache for k, v in [c.kv_state]]


def assert_one_list(got, want, what):
    assert len(got) == len(want), what
    for i, ((gk, gv, gm), (wk, wv, wm)) in enumerate(zip(got, want)):
        assert gk.shape == wk.shape, f"{what}: layer {i} allocates {gk.shape}, not {wk.shape}"
        assert np.array_equal(gk, wk) and np.array_equal(gv, wv), f"{what}: layer {i} differs"
        assert gm == wm, f"{what}: layer {i} meta {gm} != {wm}"


def next_logits(model, cache, token: int = 7) -> np.ndarray:
    return bits(model(mx.array([[token]]), cache=cache)[0, -1])


@pytest.fixture
def gate(monkeypatch):
    """Every call of the gate's checks: ``calls[name]`` counts them and
    ``raised`` lists the class each refusal of ``check_session`` raised."""
    calls: collections.Counter = collections.Counter()
    raised: list = []
    for name in ("check_session", "check_cut", "check_stored", "check_start"):
        real = getattr(restore, name)

        def spy(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            try:
                return _real(*a, **k)
            except Exception as e:
                if _name == "check_session":
                    raised.append(type(e))
                raise

        monkeypatch.setattr(restore, name, spy)
    return calls, raised


def restores(model, tmp_path, source, *, encoding=None, preallocate=False):
    """Each restore kind of ``source`` (a live list of ``model``) into lists
    of ``target_model``: ``{kind: restore(target_model, into)}``."""
    snap = SessionSnapshot.capture(source)
    path = tmp_path / "s.safetensors"
    save_session(path, source, **({"encoding": encoding} if encoding else {}))
    store = KVStore()
    store.put(tokens(POSITION), source)
    if encoding:
        snap = snap.encoded(encoding)
    return {
        "install": lambda target, into: snap.install(into),
        "restore_into": lambda target, into: muser_kv.restore_into(into, snap),
        "load": lambda target, into: load_session(path, target, preallocate=preallocate),
        "store": lambda target, into: store.longest_prefix(tokens(POSITION) + [1], model,
                                                           into=into)[1],
    }


@pytest.mark.parametrize("wrong", ["model", "geometry", "encoding"])
def test_every_restore_kind_refuses_through_the_one_gate_with_one_error(tmp_path, gate, wrong):
    """The same wrong input, to every restore kind: the same error class, raised
    by the one gate (``check_session``, once), before the target changes. The
    store has no refusal of geometry or encoding to give: its rows are keyed
    by both, so a list of another finds none (a miss, the list untouched)."""
    calls, raised = gate
    model = tiny_model(mx.float16)
    source = live(model)
    target = {"model": tiny_model(mx.float16, seed=1),
              "geometry": tiny_model(mx.float16, sliding_window=32),
              "encoding": model}[wrong]
    error = {"model": ModelMismatch, "geometry": SnapshotMismatch,
             "encoding": ProductionF16Required}[wrong]
    kinds = restores(model, tmp_path, source, encoding="f32le" if wrong == "encoding" else None)
    fields = set()
    for kind, run in kinds.items():
        # a session of its own, but a store rebuilds only into an empty list (its
        # rows are f16: a list of another encoding is a bf16 one)
        into = (muser_kv.make_prompt_cache(
            target, CONTEXT, plane_dtype=mx.bfloat16 if wrong == "encoding" else None)
            if kind == "store" else live(target, 20))
        before = whole(into)
        calls.clear()
        raised.clear()
        if kind == "store" and wrong != "model":
            assert {c.offset for c in run(target, into)} == {0}, kind
            assert calls["check_session"] == 0, kind
            continue
        with pytest.raises(error) as e:
            run(target, into)
        assert calls["check_session"] == 1 and raised == [error], (kind, calls, raised)
        assert calls["check_start"] == 0, f"{kind}: a layer was checked past a refusal"
        assert_one_list(whole(into), before, f"{kind} refused")
        if isinstance(e.value, SnapshotMismatch) and not isinstance(e.value, ModelMismatch):
            fields.add((str(e.value.field).split(" ")[0], str(e.value.expected),
                        str(e.value.got)))
    assert len(fields) <= 1, f"the kinds refused in other terms: {fields}"


def test_each_check_runs_once_per_restore(tmp_path, gate):
    """A restore that passes: one ``check_session`` and one start check per
    layer, whichever kind it is (a load checks the file's table, the others
    the rows in memory)."""
    calls, _ = gate
    model = tiny_model(mx.float16)
    source = live(model)
    layers = len(source)
    for kind, run in restores(model, tmp_path, source).items():
        calls.clear()
        got = run(model, muser_kv.make_prompt_cache(model, CONTEXT))
        per_layer = "check_stored" if kind == "load" else "check_cut"
        assert calls["check_session"] == 1, (kind, calls)
        assert calls["check_start"] == layers and calls[per_layer] == layers, (kind, calls)
        if got is not None:
            assert {c.offset for c in got} == {POSITION}, kind


@pytest.mark.parametrize("preallocate", [False, True], ids=["growing", "preallocated"])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_an_install_a_load_and_a_rebuild_of_one_state_are_one_list(tmp_path, dtype, preallocate):
    """The lists every restore kind builds for one state are one list: planes
    bitwise equal in their allocated shapes, the same rings, the same next
    logits as the live list, bit for bit (global planes growing, as
    ``make_prompt_cache`` makes them, or preallocated)."""
    model = tiny_model(dtype)
    source = live(model, preallocate=preallocate)
    want = next_logits(model, live(model, preallocate=preallocate))
    lists = {}
    for kind, run in restores(model, tmp_path, source, preallocate=preallocate).items():
        into = muser_kv.make_prompt_cache(model, CONTEXT, preallocate=preallocate)
        got = run(model, into)
        lists[kind] = got if got is not None else into
    first = next(iter(lists))
    for kind, cache in lists.items():
        assert_one_list(whole(cache), whole(lists[first]), f"{kind} vs {first}")
    assert_one_list(whole(lists[first]), whole(source), f"{first} vs the live list")
    for kind, cache in lists.items():
        assert np.array_equal(next_logits(model, cache), want), kind
