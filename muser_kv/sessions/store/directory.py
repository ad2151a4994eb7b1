"""The directory tier: chunks as files in a local directory, the embedded
default of the KV store (the invariants every tier keeps: ``tiers``)."""

from __future__ import annotations

import errno
import io
import json
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import List, Optional, Tuple, Union

import numpy as np

from muser_kv.sessions.store.tiers import (
    KEY_PATTERN,
    Alloc,
    BlobTier,
    FrameError,
    PathLike,
    TierStats,
    check_bound,
    check_key,
    check_payload,
    frame_header,
    frame_size,
    log,
    parse_header,
    payload_view,
)
from muser_kv.sessions.temporaries import alive

#: A directory tier at its bound rescans the directory (to see other processes'
#: chunks and reads) at most this often; ``stats`` and ``gc`` always rescan.
RESCAN_INTERVAL_S = 2.0
STORE_FORMAT = "muser-kv-store"
STORE_VERSION = 1


def _write_all(fd: int, *parts: memoryview) -> None:
    """Write every byte of ``parts`` to ``fd`` (the one place chunk bytes reach a file)."""
    for part in parts:
        view = part
        while view.nbytes:
            n = os.write(fd, view[:1 << 30])
            view = view[n:]


def _read_payload(f: io.FileIO, n: int, alloc: Optional[Alloc]) -> Union[bytes, np.ndarray]:
    """The next ``n`` bytes of ``f``: into ``alloc(n)`` if given, else as bytes
    (fewer where the file ends early: the digest check refuses them)."""
    if alloc is None:
        return f.read(n) if n else b""
    out = alloc(n)
    view, done = out.data.cast("B"), 0
    while done < n:
        got = f.readinto(view[done:])
        if not got:
            return out[:done]
        done += got
    return out


_TEMPORARY = re.compile(r"\.([0-9a-f]{32,64})\.(\d+)-[0-9a-f]{16}\.tmp")
_OWN_FILES = {"store.json", "stats.json", ".lock"}
_OWN_TEMPORARY = re.compile(r"\.(?:store|stats)\.json\.\d+-[0-9a-f]{16}\.tmp")
_SHARD = re.compile(r"[0-9a-f]{2}")


class DirectoryTier(BlobTier):
    """Chunks as files ``path/<first 2 hex of the key>/<key>``, bounded in
    payload bytes, least recently used evicted first.

    * Writes go to ``.<key>.<pid>-<random>.tmp`` beside the target, are fsynced
      and renamed over it (``os.replace``): a reader, or a process killed
      mid-put, never sees a torn chunk. Temporaries of dead processes are
      removed on open. No directory fsync: a power cut may lose the latest
      puts, never tear one.
    * Recency is the file's mtime, which a read sets (``os.utime``); the index
      (key -> payload bytes, in LRU order) is rebuilt from the directory on
      open, so a restart keeps chunks and their order.
    * Several threads and processes may share a directory: the same key put
      twice leaves one copy (the last rename wins, both whole). The bound is
      exact within a process; a process sees the others' chunks when it
      rescans (on open, ``stats``, ``gc``, and when at its bound at most every
      RESCAN_INTERVAL_S), so several writers can pass it by what they put
      between rescans.
    * ``store.json`` marks the directory as a store and records the bound (a
      tier opened with ``max_bytes=None`` uses the recorded one); ``stats.json``
      holds the hit/miss/error counters of every process, updated under
      ``flock`` at most every ``tiers.FLUSH_INTERVAL_S`` and on close.
    """

    name = "dir"

    def __init__(self, path: PathLike, max_bytes: Optional[int] = None, *, create: bool = True):
        """``create=False`` opens only a store that exists (what ``stats`` and
        ``gc`` read or shrink): a missing path, a regular file or a directory
        without a valid ``store.json`` is a ``ValueError``, and nothing is made."""
        self.path = Path(path)
        bound = check_bound(max_bytes)
        if not create:
            self._check_exists()
        super().__init__()
        self._lock = threading.RLock()
        self._index: "OrderedDict[str, int]" = OrderedDict()  # key -> payload bytes, LRU first
        self._bytes = 0
        self._reserved = 0
        self._clock = 0
        self._scanned_at = 0.0
        self._writing: set = set()
        recorded = None
        try:
            if create:
                self.path.mkdir(parents=True, exist_ok=True)
            recorded = self._open_marker(bound, create)
        except OSError as e:
            if not create:
                raise ValueError(f"{self.path}: expected a muser-kv store directory, it cannot "
                                 f"be read ({e})") from None
            self._warn("open", "store directory %s cannot be opened (%s): every lookup misses until it can",
                       self.path, e)
        self.max_bytes = bound if bound is not None else recorded
        self._rescan(tidy=True)

    # -- layout -----------------------------------------------------------------

    def _file(self, key: str) -> Path:
        return self.path / key[:2] / key

    def _check_exists(self) -> None:
        """Refuse a path that is not a directory (its marker is checked when it
        is opened)."""
        if not self.path.exists():
            raise ValueError(f"{self.path}: expected a muser-kv store directory, got a path that "
                             "does not exist")
        if not self.path.is_dir():
            raise ValueError(f"{self.path}: expected a muser-kv store directory, got a file "
                             "that is not a directory")

    def _open_marker(self, bound: Optional[int], create: bool = True) -> Optional[int]:
        """Check (or, with ``create``, write) ``store.json``; the bound it records."""
        marker = self.path / "store.json"
        try:
            meta = json.loads(marker.read_text())
        except FileNotFoundError:
            foreign = sorted(n for n in os.listdir(self.path)
                             if n not in _OWN_FILES and not _SHARD.fullmatch(n)
                             and not _OWN_TEMPORARY.fullmatch(n))
            if foreign:
                raise ValueError(f"{self.path} is not a muser-kv store directory: it has no store.json "
                                 f"and holds other files ({', '.join(foreign[:5])})") from None
            if not create:
                raise ValueError(f"{self.path} is not a muser-kv store directory: it has no "
                                 "store.json") from None
            meta = None
        except ValueError as e:
            raise ValueError(f"{marker}: expected a muser-kv store marker (JSON), got unreadable "
                             f"content ({e})") from None
        if meta is not None:
            if not isinstance(meta, dict) or meta.get("format") != STORE_FORMAT:
                raise ValueError(f"{marker}: expected format {STORE_FORMAT!r}, got {meta!r}")
            if meta.get("version") != STORE_VERSION:
                raise ValueError(f"{marker}: expected store version {STORE_VERSION}, "
                                 f"got {meta.get('version')!r}")
        recorded = meta.get("max_bytes") if meta else None
        if meta is None or (bound is not None and bound != recorded):
            self._write_json("store.json", {"format": STORE_FORMAT, "version": STORE_VERSION,
                                            "max_bytes": bound})
            return bound
        return recorded if isinstance(recorded, int) else None

    def _write_json(self, name: str, value: object) -> None:
        tmp = self.path / f".{name}.{os.getpid()}-{secrets.token_hex(8)}.tmp"
        try:
            tmp.write_text(json.dumps(value))
            os.replace(tmp, self.path / name)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _tick(self) -> int:
        """A recency stamp (ns), strictly increasing within this tier."""
        with self._lock:
            self._clock = max(time.time_ns(), self._clock + 1)
            return self._clock

    def _rescan(self, tidy: bool = False) -> None:
        """Rebuild the index from the directory (LRU order by mtime); with
        ``tidy``, remove the temporaries of processes that are gone."""
        found: List[Tuple[int, str, int]] = []
        try:
            shards = [s for s in os.listdir(self.path) if _SHARD.fullmatch(s)]
        except OSError:
            shards = []
        me = os.getpid()
        for shard in shards:
            try:
                names = os.listdir(self.path / shard)
            except OSError:
                continue
            for name in names:
                if KEY_PATTERN.fullmatch(name) and name[:2] == shard:
                    try:
                        st = os.stat(self.path / shard / name)
                    except OSError:
                        continue
                    found.append((st.st_mtime_ns, name, max(st.st_size - frame_size(name), 0)))
                elif tidy:
                    m = _TEMPORARY.fullmatch(name)
                    if m and int(m.group(2)) != me and not alive(int(m.group(2))):
                        try:
                            os.unlink(self.path / shard / name)
                        except OSError:
                            pass
        found.sort()
        with self._lock:
            self._index = OrderedDict((k, n) for _, k, n in found)
            self._bytes = sum(self._index.values())
            if found:
                self._clock = max(self._clock, found[-1][0])
            self._scanned_at = time.monotonic()

    # -- the interface ------------------------------------------------------------

    def get(self, key: str) -> Optional[bytes]:
        payload = self._get(key, None)
        return None if payload is None else bytes(payload)

    def get_into(self, key: str, alloc: Alloc) -> Optional[np.ndarray]:
        out = self._get(key, alloc)
        return None if out is None else np.asarray(out)

    def _get(self, key: str, alloc: Optional[Alloc]) -> Union[bytes, np.ndarray, None]:
        """The verified payload: read into ``alloc(n)`` (and digested there) if
        given, else as bytes; None: a miss."""
        check_key(key)
        path = self._file(key)
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            with self._lock:
                n = self._index.pop(key, None)
                if n is not None:
                    self._bytes -= n
            self._counts.add(misses=1)
            return None
        except IsADirectoryError:
            self._drop_foreign(key, path)
            self._counts.add(misses=1, errors=1)
            return None
        except OSError as e:
            self._counts.add(misses=1, errors=1)
            self._warn(f"get:{e.errno}", "store directory %s: reading chunk %s failed (%s): a miss",
                       self.path, key, e)
            return None
        with f:
            st: Optional[os.stat_result] = None
            try:
                st = os.fstat(f.fileno())
                head = f.read(frame_size(key))
                n, digest = parse_header(key, head)
                if st.st_size - frame_size(key) != n:
                    raise FrameError(f"file of {st.st_size} bytes, the frame says "
                                     f"{frame_size(key)} + {n}")
                payload = _read_payload(f, n, alloc)
                check_payload(key, n, digest, payload)
            except FrameError as e:
                log.warning("store directory %s: chunk %s is corrupt (%s): deleted, a miss", self.path, key, e)
                self._discard_if_same(key, path, st)
                self._counts.add(misses=1, errors=1)
                return None
            except OSError as e:
                self._counts.add(misses=1, errors=1)
                self._warn(f"get:{e.errno}", "store directory %s: reading chunk %s failed (%s): a miss",
                           self.path, key, e)
                return None
            now = self._tick()
            try:
                os.utime(f.fileno(), ns=(now, now))
            except OSError:
                pass  # a read-only directory serves, without refreshing recency
        with self._lock:
            if key not in self._index:
                self._bytes += n
            self._index[key] = n
            self._index.move_to_end(key)
        self._counts.add(hits=1)
        self._maybe_flush()
        return payload

    def _drop_foreign(self, key: str, path: Path) -> None:
        """What lies at a chunk's path and is no file (a directory, say) is not
        what the key promises: a miss, and dropped, so the next put stores the
        chunk instead of finding its name taken forever."""
        log.warning("store directory %s: chunk %s is not a file: deleted, a miss", self.path, key)
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError as e:
            self._warn(f"drop:{e.errno}", "store directory %s: deleting what lies at chunk %s failed "
                       "(%s)", self.path, key, e)
        with self._lock:
            n = self._index.pop(key, None)
            if n is not None:
                self._bytes -= n

    def _discard_if_same(self, key: str, path: Path, st: Optional[os.stat_result]) -> None:
        """Delete the corrupt file ``st`` unless another put has replaced it since."""
        try:
            now = os.stat(path)
            if st is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(path)
        except OSError:
            pass
        with self._lock:
            n = self._index.pop(key, None)
            if n is not None:
                self._bytes -= n

    def put(self, key: str, blob: bytes, replace: bool = False) -> bool:
        check_key(key)
        payload = payload_view(blob)
        n = payload.nbytes
        path = self._file(key)
        try:
            found = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            pass
        except OSError as e:
            return self._put_failed(key, e)
        else:
            if not stat.S_ISREG(found.st_mode):
                self._drop_foreign(key, path)
            elif replace:
                return self._write(key, path, payload, n)
            else:
                now = self._tick()
                try:
                    os.utime(path, ns=(now, now))
                except OSError:
                    pass
                with self._lock:
                    if key in self._index:
                        self._index.move_to_end(key)
                return True
        if self.max_bytes is not None and n > self.max_bytes:
            self._counts.add(errors=1)
            self._warn("put:bound", "store directory %s: chunk %s of %d bytes is larger than the bound "
                       "(%d bytes): not stored", self.path, key, n, self.max_bytes)
            return False
        return self._write(key, path, payload, n)

    def _write(self, key: str, path: Path, payload: memoryview, n: int) -> bool:
        self._reserve(n)
        tmp = path.parent / f".{key}.{os.getpid()}-{secrets.token_hex(8)}.tmp"
        try:
            try:
                path.parent.mkdir(exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
                try:
                    _write_all(fd, memoryview(frame_header(key, payload)), payload)
                    now = self._tick()  # recency from one clock: the kernel's mtime is coarser
                    os.utime(fd, ns=(now, now))
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError as e:
            with self._lock:
                self._reserved -= n
            return self._put_failed(key, e)
        with self._lock:
            self._reserved -= n
            self._bytes += n - self._index.get(key, 0)
            self._index[key] = n
            self._index.move_to_end(key)
        self._maybe_flush()
        return True

    def _put_failed(self, key: str, e: OSError) -> bool:
        self._counts.add(errors=1)
        what = "disk full" if e.errno == errno.ENOSPC else "failed"
        self._warn(f"put:{e.errno}", "store directory %s: writing chunk %s %s (%s): not stored",
                   self.path, key, what, e)
        return False

    def _reserve(self, n: int) -> None:
        """Evict least recently used chunks until ``n`` more bytes fit the bound,
        and count them as on their way."""
        with self._lock:
            if self.max_bytes is None:
                self._reserved += n
                return
            if (self._bytes + self._reserved + n > self.max_bytes
                    and time.monotonic() - self._scanned_at >= RESCAN_INTERVAL_S):
                self._rescan()
            self._evict_until(self.max_bytes - n - self._reserved)
            self._reserved += n

    def _evict_until(self, limit: int) -> int:
        evicted = 0
        with self._lock:
            while self._index and self._bytes > max(limit, 0):
                key, n = self._index.popitem(last=False)
                self._bytes -= n
                try:
                    os.unlink(self._file(key))
                    evicted += 1
                except FileNotFoundError:
                    pass
                except OSError as e:
                    self._warn(f"evict:{e.errno}", "store directory %s: evicting chunk %s failed (%s)",
                               self.path, key, e)
        return evicted

    def contains(self, key: str) -> bool:
        check_key(key)
        try:
            return stat.S_ISREG(os.stat(self._file(key), follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return False
        except OSError as e:
            self._counts.add(errors=1)
            self._warn(f"contains:{e.errno}", "store directory %s: looking up chunk %s failed (%s)",
                       self.path, key, e)
            return False

    def delete(self, key: str) -> None:
        check_key(key)
        try:
            os.unlink(self._file(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            self._warn(f"delete:{e.errno}", "store directory %s: deleting chunk %s failed (%s)",
                       self.path, key, e)
        with self._lock:
            n = self._index.pop(key, None)
            if n is not None:
                self._bytes -= n

    def _shared_counts(self) -> Tuple[int, int, int]:
        try:
            d = json.loads((self.path / "stats.json").read_text())
            return int(d["hits"]), int(d["misses"]), int(d["errors"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0, 0, 0

    def stats(self) -> TierStats:
        self._rescan()
        hits, misses, errors = self._shared_counts()
        with self._counts.lock:
            hits += self._counts.hits
            misses += self._counts.misses
            errors += self._counts.errors
        with self._lock:
            return TierStats(self.name, len(self._index), self._bytes, self.max_bytes, hits, misses, errors)

    def gc(self, max_bytes: Optional[int] = None) -> int:
        bound = check_bound(max_bytes)
        bound = self.max_bytes if bound is None else bound
        self._rescan()
        if bound is None:
            return 0
        return self._evict_until(bound)

    def flush(self) -> None:
        counts = self._counts.take()
        if not any(counts):
            return
        import fcntl

        try:
            fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                hits, misses, errors = self._shared_counts()
                self._write_json("stats.json", {"hits": hits + counts[0], "misses": misses + counts[1],
                                                "errors": errors + counts[2]})
            finally:
                os.close(fd)  # releases the lock
        except OSError as e:
            self._counts.give_back(counts)
            log.debug("store directory %s: counters not written (%s)", self.path, e)
