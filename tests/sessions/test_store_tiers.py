"""The KV store's byte tiers (muser_kv/sessions/store/: tiers.py, directory.py,
redis_tier.py): a local
directory and a real ``redis-server`` (the ``redis_server`` fixture) behind one
interface. Every stored chunk is verified on read, faults are misses with one
log line, a chunk is whole or absent (threads, processes, SIGKILL mid-put)."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from muser_kv.sessions.store import directory, redis_tier, tiers
from muser_kv.sessions.store.directory import DirectoryTier
from muser_kv.sessions.store.redis_tier import RedisTier
from muser_kv.sessions.store.store import open_tier

ROOT = Path(__file__).resolve().parents[2]


def key(i: int) -> str:
    return f"{i:032x}"


def blob(i: int, n: int = 1000) -> bytes:
    """Distinct, position-dependent bytes for key ``i`` (a torn or swapped chunk shows)."""
    seed = (i * 2654435761 + n) & 0xFFFFFFFF
    return (seed.to_bytes(4, "little") * (n // 4 + 1))[:n]


@pytest.fixture(params=["dir", "redis"])
def make(request, tmp_path):
    """make(max_bytes=None) -> a fresh tier of the parameter's kind (closed at the end)."""
    made = []
    if request.param == "dir":
        def factory(max_bytes=None):
            made.append(DirectoryTier(tmp_path / "store", max_bytes))
            return made[-1]
    else:
        server = request.getfixturevalue("redis_server")

        def factory(max_bytes=None):
            made.append(RedisTier(server.url, max_bytes, timeout=0.5, backoff=0.05, backoff_max=0.2))
            return made[-1]
        factory.server = server
    factory.kind = request.param
    yield factory
    for t in made:
        t.close()


def redis_client(url):
    import redis

    return redis.Redis.from_url(url)


def store_warnings(caplog):
    return [r for r in caplog.records if r.name == "muser_kv.store" and r.levelno == logging.WARNING]


# -- shared behaviour --------------------------------------------------------


def test_round_trip(make):
    t = make()
    big = os.urandom(8 << 20)
    assert t.get(key(1)) is None and not t.contains(key(1))
    assert t.put(key(1), blob(1)) and t.put(key(2), bytearray(blob(2, 7))) and t.put(key(3), b"")
    assert t.put(key(4), memoryview(big))
    assert t.get(key(1)) == blob(1) and t.get(key(2)) == blob(2, 7) and t.get(key(3)) == b""
    assert t.get(key(4)) == big
    assert t.contains(key(4))
    t.delete(key(4))
    t.delete(key(4))  # absent: nothing to do
    assert t.get(key(4)) is None and not t.contains(key(4))
    s = t.stats()
    assert (s.name, s.chunks, s.hits, s.misses, s.errors) == (make.kind, 3, 4, 2, 0)
    if make.kind == "dir":
        assert s.bytes == 1007
    else:  # the memory Redis reports: at least the framed values
        assert s.bytes >= 1007 + 3 * tiers.frame_size(key(1))
    made = []

    def alloc(n):
        made.append(np.full(n, 0xAB, dtype=np.uint8))
        return made[-1]

    got = t.get_into(key(2), alloc)  # the payload lands in the caller's buffer
    assert got.tobytes() == blob(2, 7) and np.shares_memory(got, made[-1])
    assert t.get_into(key(4), alloc) is None and len(made) == 1


def test_keys_and_blobs_are_checked(make):
    t = make()
    for bad in ["", "ab" * 15, "AB" * 16, "../" + "a" * 32, "g" * 32, "a" * 65, 12]:
        with pytest.raises(ValueError, match="32 to 64 lowercase hex"):
            t.put(bad, b"x")
        with pytest.raises(ValueError, match="32 to 64 lowercase hex"):
            t.get(bad)
    with pytest.raises(TypeError, match="bytes"):
        t.put(key(1), "text")
    assert t.put("f" * 64, b"x") and t.get("f" * 64) == b"x"


def test_a_present_key_costs_a_lookup_not_a_write(make, monkeypatch):
    t = make()
    assert t.put(key(1), blob(1))
    if make.kind == "dir":
        path = tmp_file(t, key(1))
        inode = os.stat(path).st_ino
        writes = []
        real = directory._write_all
        monkeypatch.setattr(directory, "_write_all", lambda *a: (writes.append(a), real(*a)))
        assert t.put(key(1), blob(1)) and t.put(key(1), blob(1))
        assert writes == [] and os.stat(path).st_ino == inode
        assert t.put(key(2), blob(2)) and len(writes) == 1  # the counter does count writes
    else:
        c = redis_client(make.server.url)

        def sets():
            return c.info("commandstats").get("cmdstat_set", {}).get("calls", 0)

        before = sets()
        assert t.put(key(1), blob(1)) and t.put(key(1), blob(1))
        assert sets() == before
        assert t.put(key(2), blob(2)) and sets() == before + 1
    assert t.get(key(1)) == blob(1)


def tmp_file(t: DirectoryTier, k: str) -> Path:
    return t.path / k[:2] / k


def corrupt(make, t, k, how):
    """Flip a bit of the payload, of the header, or cut the stored chunk short."""
    if make.kind == "dir":
        path = tmp_file(t, k)
        data = bytearray(path.read_bytes())
    else:
        c = redis_client(make.server.url)
        data = bytearray(c.get(RedisTier.PREFIX + k))
    if how == "payload bit":
        data[-100] ^= 0x10
    elif how == "header bit":
        data[3] ^= 0x01
    elif how == "length":
        data[12] ^= 0x01
    else:
        data = data[:-1]
    if make.kind == "dir":
        path.write_bytes(bytes(data))
    elif how == "truncated":
        c.set(RedisTier.PREFIX + k, bytes(data))
    else:
        c.setrange(RedisTier.PREFIX + k, 0, bytes(data))


@pytest.mark.parametrize("via", ["get", "get_into"])
@pytest.mark.parametrize("how", ["payload bit", "header bit", "length", "truncated"])
def test_a_corrupt_chunk_is_a_miss_logged_and_deleted(make, how, via, caplog):
    t = make()
    assert t.put(key(1), blob(1)) and t.put(key(2), blob(2))
    corrupt(make, t, key(1), how)
    with caplog.at_level(logging.WARNING, "muser_kv.store"):
        if via == "get":
            assert t.get(key(1)) is None
        else:
            assert t.get_into(key(1), lambda n: np.zeros(n, dtype=np.uint8)) is None
    lines = store_warnings(caplog)
    assert len(lines) == 1 and key(1) in lines[0].getMessage() and "corrupt" in lines[0].getMessage()
    assert not t.contains(key(1))
    assert t.get(key(2)) == blob(2)
    s = t.stats()
    assert (s.chunks, s.misses, s.errors, s.hits) == (1, 1, 1, 1)
    assert t.put(key(1), blob(1)) and t.get(key(1)) == blob(1)  # stored anew, whole


def test_threads_see_whole_blobs(make):
    t = make(max_bytes=60_000 if make.kind == "dir" else None)  # the dir evicts while they run
    errors = []

    def work(w):
        try:
            for r in range(40):
                i = (r * 7 + w) % 12 if r % 2 else 100 + w * 100 + r  # shared keys, and own
                n = 1000 + 997 * (i % 9)
                assert t.put(key(i), blob(i, n))
                got = t.get(key(i))
                assert got is None or got == blob(i, n), f"a torn or foreign blob for {i}"
                j = (i + 5) % 12
                got = t.get(key(j))
                assert got is None or got == blob(j, 1000 + 997 * (j % 9))
        except BaseException as e:  # noqa: B036 - reported to the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    s = t.stats()
    assert s.errors == 0
    if make.kind == "dir":
        assert s.bytes <= 60_000


# -- the directory ---------------------------------------------------------


def test_directory_lru_order_and_byte_bound(tmp_path):
    t = DirectoryTier(tmp_path / "s", max_bytes=3000)
    for i in (1, 2, 3):
        assert t.put(key(i), blob(i))
    assert t.get(key(1)) == blob(1)          # 1 is now the most recent
    assert t.put(key(2), blob(2))            # a present put refreshes 2 too
    assert t.put(key(4), blob(4))            # passes the bound: 3, the least recent, goes
    assert [t.contains(key(i)) for i in (1, 2, 3, 4)] == [True, True, False, True]
    assert t.stats().bytes == 3000 and t.stats().capacity == 3000
    assert t.put(key(5), blob(5, 2500))      # needs room for 2,500: 1 and 2 go, 4 (newest) too
    assert [t.contains(key(i)) for i in (1, 2, 4, 5)] == [False, False, False, True]
    assert not t.put(key(6), blob(6, 3001))  # larger than the bound: refused, nothing evicted
    assert t.contains(key(5))
    for i in (7, 8):
        assert t.put(key(i), blob(i, 200))
    assert t.gc(max_bytes=400) == 1 and not t.contains(key(5))
    assert t.gc() == 0 and t.stats().chunks == 2
    t.close()


def test_directory_restart_keeps_chunks_order_and_counters(tmp_path):
    t = DirectoryTier(tmp_path / "s", max_bytes=3000)
    for i in (1, 2, 3):
        assert t.put(key(i), blob(i))
    assert t.get(key(1)) == blob(1) and t.get(key(9)) is None
    t.close()
    t = DirectoryTier(tmp_path / "s")        # the bound is the one recorded
    s = t.stats()
    assert (s.chunks, s.bytes, s.capacity, s.hits, s.misses) == (3, 3000, 3000, 1, 1)
    assert t.put(key(4), blob(4))            # 2 is the least recently used across the restart
    assert [t.contains(key(i)) for i in (1, 2, 3, 4)] == [True, False, True, True]
    assert t.get(key(3)) == blob(3)
    t.close()
    s = DirectoryTier(tmp_path / "s").stats()
    assert (s.hits, s.misses, s.hit_rate) == (2, 1, 2 / 3)


def test_directory_refuses_a_directory_that_is_not_a_store(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a muser-kv store directory.*notes.txt"):
        DirectoryTier(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "store.json").write_text('{"format": "muser-kv-store", "version": 99}')
    with pytest.raises(ValueError, match="expected store version 1, got 99"):
        DirectoryTier(tmp_path / "s")


CHILD_PUT = r"""
import sys, time
from pathlib import Path
from muser_kv.sessions.store import directory
real = directory._write_all
def slow(fd, *parts):
    head, payload = parts
    real(fd, head, payload[: payload.nbytes // 2])
    Path(sys.argv[2]).write_text("half")
    time.sleep(60)
    real(fd, payload[payload.nbytes // 2:])
directory._write_all = slow
t = directory.DirectoryTier(sys.argv[1])
t.put("%s", bytes(32 << 20))
"""


def test_sigkill_during_a_put_leaves_no_torn_chunk(tmp_path):
    store, marker = tmp_path / "s", tmp_path / "half"
    DirectoryTier(store).close()
    k = key(7)
    child = subprocess.Popen([sys.executable, "-c", CHILD_PUT % k, str(store), str(marker)],
                             env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=str(ROOT))
    try:
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert child.poll() is None, f"child exited {child.returncode}"
            assert time.monotonic() < deadline, "the child never reached the middle of its put"
            time.sleep(0.02)
        t = DirectoryTier(store)
        assert not t.contains(k) and t.get(k) is None  # mid-put: nothing visible
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    temporaries = list((store / k[:2]).glob(".*.tmp"))
    assert len(temporaries) == 1 and temporaries[0].stat().st_size > 16 << 20  # it was half written
    assert not t.contains(k) and t.get(k) is None
    t = DirectoryTier(store)                          # open removes a dead process's temporaries
    assert list((store / k[:2]).glob(".*.tmp")) == []
    assert t.stats().chunks == 0
    assert t.put(k, b"whole") and t.get(k) == b"whole"


def test_a_full_disk_is_a_refused_put_and_one_log_line(tmp_path, monkeypatch, caplog):
    t = DirectoryTier(tmp_path / "s")
    assert t.put(key(1), blob(1))

    def full(fd, *parts):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(directory, "_write_all", full)
    with caplog.at_level(logging.WARNING, "muser_kv.store"):
        assert not t.put(key(2), blob(2))
        assert not t.put(key(3), blob(3))  # the same fault again: counted, not logged again
    lines = store_warnings(caplog)
    assert len(lines) == 1 and "disk full" in lines[0].getMessage() and key(2) in lines[0].getMessage()
    assert not t.contains(key(2)) and list(t.path.rglob("*.tmp")) == []
    assert t.get(key(1)) == blob(1)
    assert t.stats().errors == 2 and t.stats().chunks == 1
    monkeypatch.undo()
    assert t.put(key(2), blob(2)) and t.get(key(2)) == blob(2)


def test_a_read_only_directory_serves_and_refuses_puts(tmp_path, monkeypatch, caplog):
    t = DirectoryTier(tmp_path / "s")
    assert t.put(key(1), blob(1))
    if os.geteuid() != 0:
        for d in (t.path, t.path / key(1)[:2]):
            d.chmod(0o555)
    else:  # root writes through permission bits: refuse the store's file creations instead
        real_open = os.open

        def read_only(path, flags, *a, **kw):
            if str(path).startswith(str(t.path)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_open(path, flags, *a, **kw)

        monkeypatch.setattr(directory.os, "open", read_only)
    try:
        with caplog.at_level(logging.WARNING, "muser_kv.store"):
            assert not t.put(key(2), blob(2))
            assert t.get(key(1)) == blob(1)
        lines = store_warnings(caplog)
        assert len(lines) == 1 and "Permission denied" in lines[0].getMessage()
        assert not t.contains(key(2))
    finally:
        for d in (t.path, t.path / key(1)[:2]):
            d.chmod(0o755)


def test_a_vanished_directory_is_misses_and_refused_puts(tmp_path, caplog):
    import shutil

    t = DirectoryTier(tmp_path / "s")
    assert t.put(key(1), blob(1))
    shutil.rmtree(t.path)
    with caplog.at_level(logging.WARNING, "muser_kv.store"):
        assert t.get(key(1)) is None and not t.contains(key(1))
        assert not t.put(key(2), blob(2))
        s = t.stats()
    assert len(store_warnings(caplog)) == 1
    assert s.chunks == 0 and s.errors == 1


CHILD_MIX = r"""
import sys
from muser_kv.sessions.store import directory
sys.path.insert(0, sys.argv[3])
from test_store_tiers import blob, key
t = directory.DirectoryTier(sys.argv[1])
me = int(sys.argv[2])
for r in range(60):
    i = r % 15 if r % 2 else 1000 * me + r
    assert t.put(key(i), blob(i, 20000 + i % 7)), i
    got = t.get(key(i))
    assert got is None or got == blob(i, 20000 + i % 7), i
t.close()
"""


def test_two_processes_share_one_directory(tmp_path):
    store = tmp_path / "s"
    DirectoryTier(store).close()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    children = [subprocess.Popen([sys.executable, "-c", CHILD_MIX, str(store), str(me),
                                  str(Path(__file__).parent)], env=env, cwd=str(ROOT))
                for me in (1, 2)]
    assert [c.wait(timeout=60) for c in children] == [0, 0]
    t = DirectoryTier(store)
    for i in [r % 15 for r in range(1, 60, 2)] + [1000 * me + r for me in (1, 2) for r in range(0, 60, 2)]:
        assert t.get(key(i)) == blob(i, 20000 + i % 7)
    s = t.stats()
    assert s.chunks == len(set(r % 15 for r in range(1, 60, 2))) + 60 and s.errors == 0
    assert s.hits >= 60 and list(store.rglob("*.tmp")) == []


# -- Redis -----------------------------------------------------------------


def test_redis_killed_mid_use_misses_fast_and_recovers(redis_server, caplog):
    t = RedisTier(redis_server.url, timeout=0.5, backoff=0.05, backoff_max=0.2)
    big = os.urandom(32 << 20)
    assert t.put(key(1), blob(1)) and t.put(key(2), big)
    results, stop = [], threading.Event()

    def reader():  # reads a large chunk while the server dies under it
        while not stop.is_set():
            results.append(t.get(key(2)))

    th = threading.Thread(target=reader)
    with caplog.at_level(logging.WARNING, "muser_kv.store"):
        th.start()
        time.sleep(0.2)
        redis_server.kill()
        time.sleep(0.1)
        slowest = 0.0
        for _ in range(30):
            start = time.monotonic()
            assert t.get(key(1)) is None and not t.put(key(3), blob(3)) and not t.contains(key(1))
            slowest = max(slowest, time.monotonic() - start)
            time.sleep(0.01)
        stop.set()
        th.join()
    assert slowest < 0.5, f"a call on a dead Redis took {slowest:.3f} s"
    assert all(r is None or r == big for r in results) and None in results and big in results
    assert len([r for r in store_warnings(caplog) if "failed" in r.getMessage()]) == 1
    redis_server.restart()  # empty: a fresh server on the same port
    deadline = time.monotonic() + 2
    while not t.put(key(1), blob(1)):
        assert time.monotonic() < deadline, "the tier did not recover after Redis came back"
        time.sleep(0.05)
    assert t.get(key(1)) == blob(1)
    t.close()


def test_redis_hung_costs_one_timeout_per_backoff(redis_server):
    t = RedisTier(redis_server.url, timeout=0.2, backoff=1.0, backoff_max=1.0)
    assert t.put(key(1), blob(1))
    t.get(key(1))
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert t.get(key(1)) is None
        first = time.monotonic() - start
        start = time.monotonic()
        for _ in range(20):
            assert t.get(key(1)) is None
        rest = time.monotonic() - start
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert 0.15 < first < 1.0 and rest < 0.25, (first, rest)  # one timeout, then none
    time.sleep(1.0)
    assert t.get(key(1)) == blob(1)
    t.close()


def test_redis_bound_is_the_servers_lru_and_gc_evicts_to_max_bytes(redis_server):
    c = redis_client(redis_server.url)
    c.config_set("maxmemory-policy", "allkeys-lru")
    c.config_set("maxmemory", int(c.info("memory")["used_memory"]) + (4 << 20))
    t = RedisTier(redis_server.url)
    for i in range(24):  # 12 MB into a 4 MB margin: Redis evicts, every put succeeds
        assert t.put(key(i), blob(i, 512 << 10))
    s = t.stats()
    assert s.capacity == int(c.config_get("maxmemory")["maxmemory"])
    assert 0 < s.chunks < 24 and s.bytes <= 5 << 20  # one value may pass before Redis evicts
    assert t.get(key(23)) == blob(23, 512 << 10)
    c.config_set("maxmemory", 0)
    c.flushdb()
    t = RedisTier(redis_server.url)
    for i in range(6):
        assert t.put(key(i), blob(i, 512 << 10))
    per_chunk = t.stats().bytes // 6  # Redis's memory for one: payload, frame, allocator's rounding
    assert per_chunk >= (512 << 10) + tiers.frame_size(key(0))
    t = RedisTier(redis_server.url, max_bytes=3 * per_chunk)
    assert t.gc() == 3
    after = t.stats()
    assert after.chunks == 3 and after.bytes <= 3 * per_chunk and after.capacity == 3 * per_chunk
    assert t.gc(max_bytes=0) == 3 and t.stats().chunks == 0
    t.close()


def test_redis_refuses_a_value_too_large_without_going_down(redis_server, monkeypatch, caplog):
    monkeypatch.setattr(redis_tier, "REDIS_MAX_VALUE", 2000)
    t = RedisTier(redis_server.url)
    with caplog.at_level(logging.WARNING, "muser_kv.store"):
        assert not t.put(key(1), blob(1, 3000))
    assert len(store_warnings(caplog)) == 1 and "larger than a Redis value" in caplog.text
    assert t.put(key(2), blob(2)) and t.get(key(2)) == blob(2) and not t.contains(key(1))
    t.close()


def take_foreign(t, via: str, caplog) -> list:
    """Meet key 1, which holds something that is no chunk, ``via`` get, get_into
    or put (a put then reads its chunk back); the store's warnings logged."""
    with caplog.at_level(logging.WARNING, "muser_kv.store"):
        if via == "get":
            assert t.get(key(1)) is None
        elif via == "get_into":
            assert t.get_into(key(1), lambda n: np.zeros(n, dtype=np.uint8)) is None
        else:
            assert t.put(key(1), blob(1)) and t.get(key(1)) == blob(1)
    return store_warnings(caplog)


@pytest.mark.parametrize("via", ["get", "get_into", "put"])
def test_redis_a_key_of_another_type_is_a_miss_dropped_and_stored_again(redis_server, via, caplog):
    """A key of ours holding a list is no chunk: not contained, and the first
    get or put deletes it (a put then stores the chunk, whole)."""
    t = RedisTier(redis_server.url)
    assert t.put(key(1), blob(1)) and t.put(key(2), blob(2))
    c = redis_client(redis_server.url)
    c.delete(RedisTier.PREFIX + key(1))
    c.rpush(RedisTier.PREFIX + key(1), b"a", b"b")
    assert not t.contains(key(1))
    lines = take_foreign(t, via, caplog)
    assert len(lines) == 1 and key(1) in lines[0].getMessage() and "type" in lines[0].getMessage()
    assert t.get(key(2)) == blob(2)  # not a fault: the tier is not marked down
    if via != "put":
        assert not c.exists(RedisTier.PREFIX + key(1))
        assert t.put(key(1), blob(1)) and t.get(key(1)) == blob(1)  # stored anew, whole
    assert c.type(RedisTier.PREFIX + key(1)) == b"string" and t.contains(key(1))
    s = t.stats()
    assert (s.chunks, s.hits, s.misses, s.errors) == (2, 2, via != "put", 1)
    t.close()


def test_redis_counters_are_shared(redis_server):
    a, b = (RedisTier(redis_server.url) for _ in range(2))
    assert a.put(key(1), blob(1)) and b.get(key(1)) == blob(1) and a.get(key(2)) is None
    a.close()
    b.close()
    s = RedisTier(redis_server.url).stats()
    assert (s.hits, s.misses, s.chunks) == (1, 1, 1)


# -- opening, the CLI -------------------------------------------------------


def test_open_tier_picks_the_tier_and_names_the_missing_extra(tmp_path, monkeypatch):
    assert isinstance(open_tier(str(tmp_path / "s"), 10), DirectoryTier)
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[store\]'"):
        open_tier("redis://127.0.0.1:1/0")


def cli(*args):
    out = subprocess.run([sys.executable, "-m", "muser_kv", "store", *args], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=str(ROOT),
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_cli_store_stats_and_gc(tmp_path):
    t = DirectoryTier(tmp_path / "s", max_bytes=10_000)
    for i in range(4):
        assert t.put(key(i), blob(i))
    t.get(key(0))
    t.get(key(9))
    t.close()
    out = cli("stats", str(tmp_path / "s"))
    assert "chunks: 4" in out and "bytes: 4,000" in out and "capacity: 10,000" in out
    assert "hit rate: 50.0% (1 hits, 1 misses)" in out
    out = cli("gc", str(tmp_path / "s"), "--max-bytes", "2500")
    assert "evicted 2 chunk(s), 2,000 bytes" in out and "now 2 chunk(s), 2,000 bytes" in out
    assert [DirectoryTier(tmp_path / "s").contains(key(i)) for i in range(4)] == [True, False, False, True]



def tree(root: Path) -> list:
    """Every path under ``root`` with its bytes (None: a directory)."""
    return sorted((str(p.relative_to(root)), None if p.is_dir() else p.read_bytes())
                  for p in root.rglob("*"))


NOT_A_STORE = {
    "missing": ("no/such", lambda at: None, "does not exist"),
    "a file": ("file", lambda at: at.write_text("mine"), "not a directory"),
    "an empty directory": ("empty", lambda at: at.mkdir(), "has no store.json"),
    "other files": ("mine", lambda at: (at.mkdir(), (at / "notes.txt").write_text("mine")),
                    "holds other files"),
    "a marker that is not JSON": ("bad", lambda at: (at.mkdir(), (at / "store.json").write_text("{")),
                                  "marker (JSON)"),
    "a marker of another format": (
        "other", lambda at: (at.mkdir(), (at / "store.json").write_text('{"format": "other-tool"}')),
        "expected format 'muser-kv-store'"),
}


@pytest.mark.parametrize("action", ["stats", "gc"])
@pytest.mark.parametrize("case", sorted(NOT_A_STORE))
def test_cli_store_refuses_a_location_that_is_not_a_store(tmp_path, case, action):
    """``stats`` and ``gc`` read or shrink a store that exists: anything else
    is exit 2 and one line on stderr, and nothing is made or changed there."""
    name, make_it, why = NOT_A_STORE[case]
    root = tmp_path / "root"
    root.mkdir()
    at = root / name
    make_it(at)
    before = tree(root)
    out = subprocess.run([sys.executable, "-m", "muser_kv", "store", action, str(at)],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         cwd=str(ROOT), timeout=60)
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"muser-kv store {action}: "), out.stderr
    assert str(at) in lines[0] and why in lines[0], lines[0]
    assert tree(root) == before


def test_cli_store_on_redis(redis_server, capsys):
    from muser_kv.serving.cli import main

    r = RedisTier(redis_server.url)
    assert r.put(key(1), blob(1))
    r.close()
    assert main(["store", "stats", redis_server.url]) == 0
    out = capsys.readouterr().out
    assert "chunks: 1" in out and "capacity: unbounded" in out and "no lookups yet" in out
    assert main(["store", "gc", redis_server.url]) == 0
    assert "no bound" in capsys.readouterr().out
    assert main(["store", "gc", redis_server.url, "--max-bytes", "0"]) == 0
    assert "evicted 1 chunk(s)" in capsys.readouterr().out


@pytest.mark.parametrize("via", ["get", "get_into", "put"])
def test_directory_something_not_a_file_at_a_chunks_path_is_a_miss_dropped_and_stored_again(
        tmp_path, via, caplog):
    """The directory tier's twin of Redis's wrong type: a directory where a
    chunk's file should be is no chunk: not contained, and the first get or put
    deletes it (a put then stores the chunk, whole)."""
    t = DirectoryTier(tmp_path / "s")
    assert t.put(key(1), blob(1)) and t.put(key(2), blob(2))
    path = next(p for p in (tmp_path / "s").rglob(key(1)))
    path.unlink()
    path.mkdir()
    (path / "other").write_bytes(b"x")
    assert not t.contains(key(1))
    lines = take_foreign(t, via, caplog)
    assert len(lines) == 1 and key(1) in lines[0].getMessage() and "not a file" in lines[0].getMessage()
    assert t.get(key(2)) == blob(2)
    if via != "put":
        assert not path.exists()
        assert t.put(key(1), blob(1)) and t.get(key(1)) == blob(1)  # stored anew, whole
    assert path.is_file() and t.contains(key(1))
    t.close()


def test_a_redis_server_started_on_a_port_another_holds_moves_to_its_own(redis_server,
                                                                       tmp_path, monkeypatch):
    """The tests' ``RedisServer`` is the redis answering on its port: given a
    port another redis-server holds (a free port taken before its bind), it
    does not take that server's answers for its own but starts on another."""
    import servers

    ports = iter([redis_server.port])
    real = servers.free_port
    monkeypatch.setattr(servers, "free_port", lambda: next(ports, None) or real())
    second = servers.RedisServer(tmp_path / "second")
    try:
        assert second.port != redis_server.port
        assert second.pid() == second.proc.pid != redis_server.pid()
        assert redis_server.pid() == redis_server.proc.pid
    finally:
        second.stop()
