"""Session files at disk speed: version 3's XXH3-128 digests on
every byte, version 2 (sha256) files still read, saves that die leave the old
file, and the chunked, threaded read and write giving the planes bit for bit."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import xxhash
from conftest import tiny_model

import muser_kv
import muser_kv.serving.cli
import muser_kv.sessions.format as fmt
import muser_kv.sessions.reading as reading
import muser_kv.sessions.save as save_mod
import muser_kv.sessions.tensorfile as tensorfile
from muser_kv import SessionFileError, load_session, read_session, save_session

HERE = Path(__file__).resolve().parents[1]
DATA = HERE / "data"
V2_MODEL = dict(head_dim=16, num_key_value_heads=1)  # tests/data/make_v2_sessions.py
WINDOW = 16


def tokens(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in (np.arange(n) * 7 + 3 + 11 * seed) % 251 + 1]


def filled(model, position: int, max_context: int = 128, seed: int = 0,
           sliding_layout: str = "token_major"):
    """Filled as mlx-lm drives it: a prefill chunk, then chunks of 5 and single
    tokens, so the rings wrap and rotate."""
    cache = muser_kv.make_prompt_cache(model, max_context, sliding_layout=sliding_layout)
    toks = tokens(position, seed)
    sizes, i, k = [11, 1, 5, 1, 1], 0, 0
    while i < position:
        n = min(sizes[k % len(sizes)], position - i)
        model(mx.array([toks[i:i + n]]), cache=cache)
        i, k = i + n, k + 1
    mx.eval([a for c in cache for a in c.state])
    return cache


def u16(x: mx.array) -> np.ndarray:
    """f16 or bf16 contents as their uint16 bit patterns."""
    return np.array(x.view(mx.uint16))


def state(cache):
    return [(u16(c.keys), u16(c.values), c.ring.copy()) for c in cache]


def assert_state(cache, expected):
    assert len(cache) == len(expected)
    for c, (k, v, ring) in zip(cache, expected):
        np.testing.assert_array_equal(u16(c.keys), k, err_msg=f"layer {c.layer} keys")
        np.testing.assert_array_equal(u16(c.values), v, err_msg=f"layer {c.layer} values")
        assert c.ring == ring, f"layer {c.layer}: {c.ring} != {ring}"


def split(data: bytes):
    """The safetensors layout read by hand: (table, payload)."""
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def payload_span(data: bytes, name: str):
    n = struct.unpack("<Q", data[:8])[0]
    begin, end = json.loads(data[8:8 + n])[name]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def file_rows(data: bytes, name: str) -> np.ndarray:
    """A tensor's bytes as uint16 bit patterns, straight from the file."""
    table, payload = split(data)
    begin, end = table[name]["data_offsets"]
    return np.frombuffer(payload[begin:end], np.uint16).reshape(table[name]["shape"])


def resign(metadata: dict) -> None:
    pairs = sorted([k, v] for k, v in metadata.items() if k != "header_sha256")
    text = json.dumps(pairs, separators=(",", ":"), ensure_ascii=True)
    metadata["header_sha256"] = hashlib.sha256(text.encode()).hexdigest()


def version2_file(path: Path, data: bytes) -> None:
    """``data`` (a version 3 file) rewritten as version 2 wrote it: the same
    bytes, sha256 of every tensor, the header re-signed; done here with json,
    struct and hashlib alone, not with muser-kv's writer."""
    table, payload = split(data)
    meta = table["__metadata__"]
    meta["version"] = "2"
    digests = {}
    for name, entry in table.items():
        if name != "__metadata__":
            begin, end = entry["data_offsets"]
            digests[name] = hashlib.sha256(payload[begin:end]).hexdigest()
    meta["checksums"] = json.dumps(digests, sort_keys=True)
    resign(meta)
    head = json.dumps(table, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + payload)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def session40(model, tmp_path_factory):
    cache = filled(model, 40)
    path = tmp_path_factory.mktemp("v3") / "s.safetensors"
    save_session(path, cache, {"turn": 3})
    return cache, path.read_bytes()


# -- version 3: XXH3-128 over every byte ---------------------------------------------


def test_version_3_digests_are_xxh3_128_of_the_bytes(session40):
    _, data = session40
    table, payload = split(data)
    meta = table["__metadata__"]
    assert meta["version"] == "3"
    checksums = json.loads(meta["checksums"])
    names = [n for n in table if n != "__metadata__"]
    assert sorted(checksums) == sorted(names) and len(names) == 16
    for name in names:
        begin, end = table[name]["data_offsets"]
        assert checksums[name] == xxhash.xxh3_128(payload[begin:end]).hexdigest(), name


@pytest.mark.parametrize("chunk", [None, 1000])
def test_a_flipped_byte_in_any_tensor_is_refused_and_changes_nothing(
        model, session40, tmp_path, monkeypatch, chunk):
    """Every tensor, at its first and last byte, in the middle, and on both sides
    of a chunk boundary (1000 B chunks split elements, and the 8 KiB tensors
    span several): refused by name, the file and a live target unchanged."""
    live, data = session40
    if chunk:
        monkeypatch.setattr(tensorfile, "CHUNK", chunk)
    target = filled(model, 17, seed=5)
    before = state(target)
    path = tmp_path / "s.safetensors"
    table, _ = split(data)
    for name in (n for n in table if n != "__metadata__"):
        begin, end = payload_span(data, name)
        for at in sorted({begin, end - 1, (begin + end) // 2, begin + 999, begin + 1000}):
            if not begin <= at < end:
                continue
            flipped = bytearray(data)
            flipped[at] ^= 0x04
            path.write_bytes(bytes(flipped))
            match = rf"corrupted tensor \(checksum mismatch\) '{name}': xxh3-128 expected"
            with pytest.raises(SessionFileError, match=match):
                muser_kv.restore_into(target, read_session(path))
            with pytest.raises(SessionFileError, match=match):
                load_session(path, model)
            assert path.read_bytes() == bytes(flipped)
    assert_state(target, before)
    path.write_bytes(data)
    assert_state(load_session(path, model), state(live))  # the same file, unflipped: loads


def test_a_flipped_byte_in_the_header_is_refused_and_changes_nothing(model, session40, tmp_path):
    """A byte of every stretch of the header (length, tensor table, every
    metadata field and the padding): refused, or the very same session."""
    live, data = session40
    n = struct.unpack("<Q", data[:8])[0]
    target = filled(model, 17, seed=5)
    before = state(target)
    path = tmp_path / "s.safetensors"
    loaded = 0
    for at in list(range(0, 8)) + list(range(8, 8 + n, 7)):
        flipped = bytearray(data)
        flipped[at] ^= 0x20
        path.write_bytes(bytes(flipped))
        try:
            cache = load_session(path, model)
        except muser_kv.SnapshotError:
            assert path.read_bytes() == bytes(flipped)
            with pytest.raises(muser_kv.SnapshotError):
                muser_kv.restore_into(target, read_session(path))
            continue
        loaded += 1
        assert_state(cache, state(live))  # harmless: JSON whitespace, the padding
    assert loaded < (8 + n // 7) // 20
    assert_state(target, before)


def test_a_digest_of_the_wrong_algorithm_or_length_is_refused(session40, tmp_path, model):
    live, data = session40
    table, payload = split(data)
    meta = table["__metadata__"]
    checksums = json.loads(meta["checksums"])
    begin, end = table["layers.2.keys"]["data_offsets"]
    checksums["layers.2.keys"] = hashlib.sha256(payload[begin:end]).hexdigest()
    meta["checksums"] = json.dumps(checksums, sort_keys=True)
    resign(meta)
    head = json.dumps(table, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path = tmp_path / "s.safetensors"
    path.write_bytes(struct.pack("<Q", len(head)) + head + payload)
    with pytest.raises(SessionFileError, match=r"'layers.2.keys': xxh3-128 expected [0-9a-f]{64}, "
                                                r"got [0-9a-f]{32}"):
        load_session(path, model)


# -- version 2 (sha256) files still load ------------------------------------------------


@pytest.mark.parametrize("name,dtype", [("f16", mx.float32), ("bf16", mx.bfloat16)])
def test_a_version_2_file_from_the_last_version_2_writer_loads_bitwise(name, dtype, tmp_path,
                                                                       capsys):
    """Files the version 2 writer made (tests/data/make_v2_sessions.py): every
    tensor's sha256 verified, the planes hold exactly the file's rows at the
    live rotation, and saving them again writes version 3 of the same rows."""
    path = DATA / f"session-v2-{name}.safetensors"
    data = path.read_bytes()
    assert split(data)[0]["__metadata__"]["version"] == "2"
    model = tiny_model(dtype, **V2_MODEL)
    cache = load_session(path, model, allow_other_model=True)
    starts = json.loads(split(data)[0]["__metadata__"]["starts"])
    for i, c in enumerate(cache):
        start, k, v = c.snapshot()
        assert (start, c.offset) == (starts[i], 40)
        assert c.ring.origin_physical == start % c.capacity  # the live rotation
        np.testing.assert_array_equal(u16(k), file_rows(data, f"layers.{i}.keys"))
        np.testing.assert_array_equal(u16(v), file_rows(data, f"layers.{i}.values"))
    again = tmp_path / "v3.safetensors"
    save_session(again, cache)
    data3 = again.read_bytes()
    assert split(data3)[0]["__metadata__"]["version"] == "3"
    for n in (n for n in split(data)[0] if n != "__metadata__"):
        np.testing.assert_array_equal(file_rows(data3, n), file_rows(data, n))
    assert muser_kv.serving.cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "version: 2  tensor checksums: sha256" in out and "result: OK" in out


def test_a_version_2_file_loads_bitwise_and_its_sha256_is_verified(model, session40, tmp_path,
                                                                   capsys):
    live, data = session40
    path = tmp_path / "v2.safetensors"
    version2_file(path, data)
    assert_state(load_session(path, model), state(live))
    snap = read_session(path)
    assert snap.position == 40
    flipped = bytearray(path.read_bytes())
    flipped[payload_span(bytes(flipped), "layers.5.values")[0] + 9] ^= 1
    path.write_bytes(bytes(flipped))
    with pytest.raises(SessionFileError, match=r"'layers.5.values': sha256 expected [0-9a-f]{64}"):
        load_session(path, model)
    assert muser_kv.serving.cli.main(["inspect", str(path)]) == 1
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "MISMATCH" in line] == [
        line for line in out.splitlines() if "layers.5.values" in line]


# -- saves that die leave the old file --------------------------------------------------


DYING_SAVE = r"""
import os, signal, sys
sys.path[:0] = [sys.argv[3]]
import mlx.core as mx
import numpy as np
import muser_kv, muser_kv.sessions.save as save_mod, muser_kv.sessions.tensorfile as tensorfile
from conftest import tiny_model

where, count = sys.argv[2].split(":")
count = int(count)
model = tiny_model()
cache = muser_kv.make_prompt_cache(model, 128)
model(mx.array([[(7 * i) % 200 + 1 for i in range(60)]]), cache=cache)
tensorfile.CHUNK = 1000
calls = [0]

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if where in ("write", "header"):  # an os.write of the real writer dies half-way:
    real = os.write              # the count-th, or the first at offset 0 (the header)
    def write(fd, data):
        calls[0] += 1
        if (calls[0] == count if where == "write" else os.lseek(fd, 0, os.SEEK_CUR) == 0):
            real(fd, bytes(data)[:len(data) // 2])
            die()
        return real(fd, data)
    tensorfile.os.write = write
elif where == "fsync":
    save_mod.fsync_path = lambda *a, **k: die()
elif where == "replace":
    save_mod.os.replace = lambda *a, **k: die()
muser_kv.save_session(sys.argv[1], cache)
"""


def dying_save(target: Path, where: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]))
    proc = subprocess.run([sys.executable, "-c", DYING_SAVE, str(target), where, str(HERE)],
                          env=env, timeout=300, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def temporaries(directory: Path, name: str):
    return sorted(p.name for p in directory.iterdir()
                  if p.name.startswith(f".{name}.") and p.name.endswith(".tmp"))


# the writer's os.write calls, 1000 B each: 16 tensors of 16 or 60 rows x 512 B
# (232 calls), then the header (test_the_header_is_the_writers_last_write);
# the first tensor, mid-way, the header, then the two steps after every byte is out
@pytest.mark.parametrize("where", ["write:1", "write:200", "header:0", "fsync:0", "replace:0"])
def test_a_save_killed_anywhere_leaves_the_old_file(model, session40, tmp_path, where):
    live, data = session40
    target = tmp_path / "chat.safetensors"
    target.write_bytes(data)
    dying_save(target, where)
    assert target.read_bytes() == data
    assert len(temporaries(tmp_path, target.name)) == 1  # what the killed save left
    assert_state(load_session(target, model), state(live))
    assert temporaries(tmp_path, target.name) == []  # the load tidied it


def test_the_header_is_the_writers_last_write(model, tmp_path, monkeypatch):
    """What test_a_save_killed_anywhere counts on: the header goes out last,
    after every tensor, in the bytes reserved for it at the front."""
    cache = filled(model, 40)
    monkeypatch.setattr(tensorfile, "CHUNK", 1000)
    writes = []
    real = os.write

    def write(fd, data):
        writes.append((os.lseek(fd, 0, os.SEEK_CUR), len(data)))
        return real(fd, data)

    monkeypatch.setattr(tensorfile.os, "write", write)
    path = tmp_path / "s.safetensors"
    save_session(path, cache)
    monkeypatch.undo()
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    head = [w for w in writes if w[0] < 8 + n]
    assert head and writes[-len(head):] == head  # every header write after every tensor's
    assert head[0][0] == 0 and sum(size for _, size in head) == 8 + n
    assert sum(size for _, size in writes) == path.stat().st_size


def test_a_save_that_runs_out_of_space_leaves_the_old_file_and_no_temporary(
        model, session40, tmp_path, monkeypatch):
    live, data = session40
    target = tmp_path / "chat.safetensors"
    target.write_bytes(data)
    newer = filled(model, 60, seed=3)
    real = tensorfile.write_all
    calls = [0]

    def short(fd, buf, chunk=None):
        calls[0] += 1
        if calls[0] == 5:
            os.write(fd, memoryview(buf).cast("B")[:100])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, buf, chunk)

    monkeypatch.setattr(tensorfile, "write_all", short)
    with pytest.raises(OSError, match=r"cannot save the session to .*chat.safetensors: No space"):
        save_session(target, newer)
    monkeypatch.undo()
    assert target.read_bytes() == data and os.listdir(tmp_path) == [target.name]
    assert_state(load_session(target, model), state(live))


# -- the chunked, threaded read and write: bitwise for odd sizes ---------------------


def odd_session(dtype, head_dim: int, kv_heads: int, position: int, max_context: int):
    geo = muser_kv.MuseGeometry(
        num_layers=4, window=8, max_context=max_context, num_heads=kv_heads, kv_heads=kv_heads,
        head_dim=head_dim)
    cache = muser_kv.make_cache_for(geo, plane_dtype=dtype)
    rng = np.random.default_rng(position)
    done = 0
    while done < position:
        n = min(int(rng.integers(1, 7)), position - done)
        x = mx.array(rng.standard_normal((1, kv_heads, n, head_dim)).astype(np.float32))
        for c in cache:
            c.update_and_fetch(x.astype(dtype), (x * 2).astype(dtype))
        done += n
    mx.eval([a for c in cache for a in c.state])
    return geo, cache


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("chunk,readers", [(1, 1), (7, 2), (1000, 3), (None, 8)])
def test_the_streamed_read_and_write_give_the_planes_bitwise(tmp_path, monkeypatch, dtype,
                                                             chunk, readers):
    """Tensors of 3 x 5 x 2 B (odd rows, heads and head_dim) that no chunk size
    here divides, one reader thread or several: read back bit for bit, at the
    live rotation, and the digests are of the bytes on disk."""
    if chunk:
        monkeypatch.setattr(tensorfile, "CHUNK", chunk)
    monkeypatch.setattr(tensorfile, "WORKERS", readers)
    geo, live = odd_session(dtype, head_dim=5, kv_heads=3, position=37, max_context=77)
    path = tmp_path / "odd.safetensors"
    save_session(path, live)
    data = path.read_bytes()
    table, payload = split(data)
    encoding = {mx.float16: "f16le", mx.bfloat16: "bf16le"}[dtype]
    assert table["__metadata__"]["encoding"] == encoding
    checksums = json.loads(table["__metadata__"]["checksums"])
    for i, c in enumerate(live):
        _, k, v = c.snapshot()
        for name, x in zip(fmt.tensor_names(i), (k, v)):
            np.testing.assert_array_equal(file_rows(data, name), u16(x))
            begin, end = table[name]["data_offsets"]
            assert checksums[name] == xxhash.xxh3_128(payload[begin:end]).hexdigest()
    target = muser_kv.make_cache_for(geo, plane_dtype=dtype)
    muser_kv.restore_into(target, read_session(path))
    assert_state(target, state(live))


def test_a_tensor_larger_than_a_chunk_reads_bitwise(tmp_path):
    """Global planes of 33,000 rows x 512 B: 16.1 MiB tensors, one real chunk
    (16 MiB) and a part of one."""
    assert tensorfile.CHUNK == 16 << 20
    geo = muser_kv.MuseGeometry(num_layers=4, window=8, max_context=33_000, num_heads=2,
                                kv_heads=2, head_dim=128)
    live = muser_kv.make_cache_for(geo)
    rng = np.random.default_rng(1)
    rows = mx.array(rng.standard_normal((33_000, 2, 128)).astype(np.float16))
    for c in live:
        if c.kind is muser_kv.LayerKind.GLOBAL:
            c.install(0, rows, -rows)
        else:
            c.install(33_000 - 8, rows[-8:], rows[:8])
    path = tmp_path / "big.safetensors"
    save_session(path, live)
    snap = read_session(path)
    assert snap.layers[3].keys.nbytes == 33_000 * 512 > tensorfile.CHUNK
    target = muser_kv.make_cache_for(geo)
    muser_kv.restore_into(target, snap)
    assert_state(target, state(live))


def test_a_file_that_shrinks_while_read_is_refused_and_the_threads_end(session40, tmp_path):
    _, data = session40
    path = tmp_path / "s.safetensors"
    path.write_bytes(data)
    threads = threading.active_count()
    with reading.Reader(path) as reader:
        os.truncate(path, len(data) - 700)  # after the table was read and checked
        with pytest.raises(SessionFileError, match=r"truncated: tensor 'layers.7.values' short"):
            for _ in reader.layers():
                pass
    assert threading.active_count() == threads


def test_a_destination_mlx_will_not_let_us_write_is_refused(session40, tmp_path, monkeypatch):
    """Tensors are read straight into MLX's buffers; should MLX ever hand out a
    read-only view of a new array, the load refuses rather than writing
    through it."""
    _, data = session40
    path = tmp_path / "s.safetensors"
    path.write_bytes(data)
    real = reading.stored_view

    def read_only(x):
        view = real(x)
        view.flags.writeable = False
        return view

    monkeypatch.setattr(reading, "stored_view", read_only)
    with pytest.raises(RuntimeError, match="read-only view of a new array"):
        read_session(path)


def test_the_digest_is_of_the_bytes_the_cache_installs(session40, tmp_path, monkeypatch):
    """The reader hashes the MLX array it read into, not a copy: a byte changed
    in that array after the read (as a reader racing a consumer would) fails
    that tensor's digest."""
    _, data = session40
    path = tmp_path / "s.safetensors"
    path.write_bytes(data)
    real = tensorfile.read_at

    def read_then_change(fd, entry, out, chunk=None):
        real(fd, entry, out, chunk)
        if entry.name == "layers.5.values" and entry.nbytes:
            memoryview(out).cast("B")[0] ^= 1

    monkeypatch.setattr(tensorfile, "read_at", read_then_change)
    with pytest.raises(SessionFileError, match=r"layers\.5\.values"):
        read_session(path)


@pytest.mark.parametrize("places", [True, False])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("position,chunk,readers", [(5, None, 2), (37, 1000, 3), (83, 7, 1)])
def test_load_session_is_bitwise_whichever_way_rows_reach_the_planes(
        tmp_path, monkeypatch, places, dtype, position, chunk, readers):
    """Rows read straight into new planes on the host (the CPU's and Metal's
    way) or uploaded as arrays and placed by the install (CUDA's way): the same
    planes and rings bit for bit, the zeros past the live rows included, before
    the wrap and rotated after it, and through chunks no row size divides."""
    monkeypatch.setattr(reading, "HOST_PLACES", places)
    monkeypatch.setattr(reading, "PLACE_CHUNK", chunk or reading.PLACE_CHUNK)
    monkeypatch.setattr(tensorfile, "WORKERS", readers)
    model = tiny_model(dtype, sliding_window=WINDOW)
    live = filled(model, position)
    path = tmp_path / "s.safetensors"
    save_session(path, live)
    restored = load_session(path, model)
    assert_state(restored, state(live))
    toks = mx.array([tokens(3, seed=position)])
    np.testing.assert_array_equal(u16(model(toks, cache=restored)), u16(model(toks, cache=live)))


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("position,chunk", [(5, None), (37, 1000), (83, 7)])
def test_a_save_from_the_planes_writes_the_file_a_gathered_cut_writes(
        tmp_path, monkeypatch, layout, dtype, position, chunk):
    """Rows written straight from the planes, along the ring's runs (the CPU's
    and Metal's way), or from a gathered cut (CUDA's): the same file byte for
    byte, both layouts, before the wrap and rotated after it, through staging
    no row size divides; and its tensors are the logical cut, by an oracle that
    unrotates the planes with numpy."""
    monkeypatch.setattr(reading, "PLACE_CHUNK", chunk or reading.PLACE_CHUNK)
    model = tiny_model(dtype, sliding_window=WINDOW)
    live = filled(model, position, sliding_layout=layout)
    direct = []
    real = save_mod.plane_rows
    monkeypatch.setattr(save_mod, "plane_rows", lambda c: direct.append(1) or real(c))
    files = {}
    for places in (True, False):
        monkeypatch.setattr(reading, "HOST_PLACES", places)
        path = tmp_path / f"{places}.safetensors"
        header = save_session(path, live)
        assert (header.position, header.encoding) == (position, fmt.plane_encoding(dtype))
        files[places] = path.read_bytes()
    assert direct == [1]  # the planes were read in place once, for HOST_PLACES only
    assert files[True] == files[False]
    table, _ = split(files[True])
    base = 8 + struct.unpack("<Q", files[True][:8])[0]
    for c in live:
        order = [r.physical + i for r in c.ring.live_runs() for i in range(r.length)]
        for name, plane in zip(fmt.tensor_names(c.layer), (u16(c.keys), u16(c.values))):
            if c.layout == "token_major":  # [R, H*D]
                want = plane[order].reshape(len(order), c.kv_heads, c.head_dim)
            else:  # [H, R, D]
                want = plane[:, order, :].transpose(1, 0, 2)
            lo, hi = table[name]["data_offsets"]
            got = np.frombuffer(files[True][base + lo:base + hi], np.uint16)
            np.testing.assert_array_equal(got.reshape(want.shape), want, err_msg=name)


def test_a_placed_tensor_that_fails_its_digest_names_it_and_nothing_is_returned(
        tmp_path, monkeypatch):
    """A byte flipped in a tensor read straight into a plane: the load refuses,
    naming that tensor."""
    monkeypatch.setattr(reading, "HOST_PLACES", True)
    model = tiny_model(mx.float16, sliding_window=WINDOW)
    path = tmp_path / "s.safetensors"
    save_session(path, filled(model, 40))
    data = bytearray(path.read_bytes())
    table, _ = split(bytes(data))
    begin, _ = table["layers.3.keys"]["data_offsets"]
    data[8 + struct.unpack("<Q", bytes(data[:8]))[0] + begin + 3] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(SessionFileError, match=r"layers\.3\.keys"):
        load_session(path, model)
