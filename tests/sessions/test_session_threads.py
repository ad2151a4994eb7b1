"""Sessions from any thread: a server reads and loads sessions on worker
threads, while other threads save. MLX streams belong to the thread that made
them, so a load that reused another thread's streams raised "There is no
Stream(cpu, N) in current thread" everywhere but in the first thread that
loaded. Every result here must be a whole session: one of the two that were
saved, bit for bit, never a mix."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, List

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from oracle import bits16

import muser_kv


@pytest.fixture(scope="module", params=[mx.float16, mx.bfloat16], ids=["f16", "bf16"])
def model(request):
    return tiny_model(request.param)


def live(model, tokens: List[int]) -> list:
    cache = muser_kv.make_prompt_cache(model, 64)
    model(mx.array([tokens]), cache=cache)
    mx.eval([a for c in cache for a in c.kv_state])
    return cache


def rows(snapshot: muser_kv.SessionSnapshot) -> tuple:
    """A snapshot as bits: its position and every layer's start and rows."""
    return (snapshot.position,) + tuple(
        (cut.start, bits16(cut.keys).tobytes(), bits16(cut.values).tobytes())
        for cut in snapshot.layers)


def in_threads(jobs: List[Callable[[], object]]) -> list:
    """Run every job on its own thread, all at once; their results, or raise
    the first error one of them met."""
    results: list = [None] * len(jobs)
    errors: list = []
    start = threading.Barrier(len(jobs))

    def run(i: int) -> None:
        try:
            start.wait()
            results[i] = jobs[i]()
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    if errors:
        raise errors[0]
    return results


def test_read_and_load_outside_the_first_thread(model, tmp_path):
    """The failing case as found: a session saved in the main thread, then read
    and loaded in one thread, then in another (each its own first use)."""
    cache = live(model, list(range(1, 40)))
    path = tmp_path / "s.safetensors"
    muser_kv.save_session(path, cache)
    want = rows(muser_kv.SessionSnapshot.capture(cache))
    for _ in range(2):
        got_read, got_load = in_threads([
            lambda: rows(muser_kv.read_session(path)),
            lambda: rows(muser_kv.SessionSnapshot.capture(muser_kv.load_session(path, model))),
        ])
        assert got_read == want and got_load == want


def test_a_cache_loaded_in_a_thread_decodes_in_another_as_the_live_one(model, tmp_path):
    cache = live(model, list(range(1, 40)))
    path = tmp_path / "s.safetensors"
    in_threads([lambda: muser_kv.save_session(path, cache)])
    (loaded,) = in_threads([lambda: muser_kv.load_session(path, model)])
    step = mx.array([[7]])
    want = model(step, cache=cache)
    got = model(step, cache=loaded)
    assert np.array_equal(bits16(want), bits16(got))


def test_concurrent_reads_loads_and_saves_each_see_a_whole_session(model, tmp_path):
    """Two sessions (wrapped rings, different positions) saved over one path
    again and again by two threads, while six threads read and load it: each
    result is one of the two, bit for bit (saves are atomic renames)."""
    a = live(model, list(range(1, 40)))
    b = live(model, list(range(50, 71)))
    want = {rows(muser_kv.SessionSnapshot.capture(c)) for c in (a, b)}
    assert len(want) == 2
    path = tmp_path / "shared.safetensors"
    muser_kv.save_session(path, a)
    rounds = 4

    def saver(cache) -> int:
        for _ in range(rounds):
            muser_kv.save_session(path, cache)
        return rounds

    def reader() -> list:
        return [rows(muser_kv.read_session(path)) for _ in range(rounds)]

    def loader() -> list:
        return [rows(muser_kv.SessionSnapshot.capture(muser_kv.load_session(path, model)))
                for _ in range(rounds)]

    results = in_threads([lambda: saver(a), lambda: saver(b)] + [reader, loader] * 3)
    seen = [r for result in results[2:] for r in result]
    assert len(seen) == 6 * rounds
    assert all(r in want for r in seen)
    assert not list(Path(tmp_path).glob("*.tmp*")), "a save left a temporary"
