"""Session files under attack (issue #10, items 1-4 and 11): every malformed
file raises muser-kv's own error naming what was expected and what came; the
whole header is covered by a checksum, so every single-bit flip is refused;
killed saves leave no temporaries past the next save or load; a save names
the caller's path; and a session loads only into the model it came from."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from oracle import bits

import muser_kv
import muser_kv.serving.cli
from muser_kv import SessionFileError, SnapshotError, load_session, read_session, save_session

HERE = Path(__file__).resolve().parents[1]
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def model():
    return tiny_model()


class Blob(bytes):
    def __repr__(self) -> str:  # hypothesis prints its arguments
        return f"<session file, {len(self)} bytes>"


@pytest.fixture(scope="module")
def blob(model, tmp_path_factory):
    """A session of the tiny model at position 20 (rings wrapped), as bytes."""
    cache = muser_kv.make_prompt_cache(model, 64)
    model(mx.array([list(range(1, 21))]), cache=cache)
    path = tmp_path_factory.mktemp("blob") / "s.safetensors"
    save_session(path, cache, {"user": "ada", "turns": [1, 2]})
    return Blob(path.read_bytes())


@pytest.fixture
def path(blob, tmp_path):
    p = tmp_path / "session.safetensors"
    p.write_bytes(blob)
    return p


# -- the safetensors layout, edited by hand ------------------------------------------


def split(data: bytes):
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def join(table: dict, payload: bytes) -> bytes:
    head = json.dumps(table, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + payload


def resign(metadata: dict) -> None:
    """The header checksum as the README states it, computed independently."""
    pairs = sorted([k, v] for k, v in metadata.items() if k != "header_sha256")
    text = json.dumps(pairs, separators=(",", ":"), ensure_ascii=True)
    metadata["header_sha256"] = hashlib.sha256(text.encode()).hexdigest()


def edit(path: Path, *, fields=None, tensor=None, sign=True) -> None:
    table, payload = split(path.read_bytes())
    table["__metadata__"].update(fields or {})
    for name, entry in (tensor or {}).items():
        table[name].update(entry)
    if sign:
        resign(table["__metadata__"])
    path.write_bytes(join(table, payload))


def inspect(path, capsys):
    rc = muser_kv.serving.cli.main(["inspect", str(path)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def assert_refused_everywhere(path, model, capsys, match):
    """read_session and load_session raise SessionFileError; inspect exits
    non-zero: 2 with one line on stderr for a file it cannot read, 1 with the
    tensor's line flagged when the header reads but a tensor is wrong."""
    with pytest.raises(SessionFileError, match=match):
        read_session(path)
    with pytest.raises(SessionFileError, match=match):
        load_session(path, model)
    rc, out, err = inspect(path, capsys)
    assert "Traceback" not in out + err
    if rc == 2:
        assert out == "" and len(err.strip().splitlines()) == 1, err
        assert err.startswith("muser-kv inspect: session file ")
    else:
        assert rc == 1 and "result: 1 problem(s)" in out, (rc, out, err)
        assert [line for line in out.splitlines() if "layers.0.keys" in line][0].endswith(")")


# -- item 1: malformed files get muser-kv's error, and inspect one line ---------------


@pytest.mark.parametrize("field", ["user", "geometry", "position", "starts", "checksums", "model"])
def test_a_deeply_nested_header_field_is_refused_by_name(path, blob, model, capsys, field):
    edit(path, fields={field: DEEP})  # signed, as a writer that means it would
    assert_refused_everywhere(path, model, capsys, r"header field '%s': expected JSON, got text "
                                                    r"that is not \(nested too deeply\)" % field)
    path.write_bytes(blob)
    edit(path, fields={field: DEEP}, sign=False)  # as corruption: the checksum says so first
    assert_refused_everywhere(path, model, capsys, r"corrupted header \(checksum mismatch\)")


@pytest.mark.parametrize("dtype", ["BF16", "F8_E4M3", "F8_E5M2", "I64", "F16x"])
def test_a_tensor_of_another_dtype_is_refused_by_name(path, model, capsys, dtype):
    table, _ = split(path.read_bytes())
    shape = table["layers.0.keys"]["shape"]
    # keep the byte span: an 8-bit type holds twice the elements, an I64 half
    size = {"F8_E4M3": 2, "F8_E5M2": 2, "I64": 0.25}.get(dtype, 1)
    edit(path, tensor={"layers.0.keys": {"dtype": dtype,
                                          "shape": [int(shape[0] * size)] + shape[1:]}})
    match = (r"wrong encoding for tensor 'layers.0.keys': encoding f16le expects dtype float16, "
             r"got bfloat16" if dtype == "BF16" else
             rf"tensor 'layers.0.keys': dtype expected one of \['BF16', 'F16', 'F32'\], "
             rf"got '{dtype}'")
    assert_refused_everywhere(path, model, capsys, match)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70)
                    | st.floats(allow_nan=True) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
FIELDS = ["geometry", "position", "encoding", "starts", "checksums", "user", "model"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=JSON, raw=st.booleans())
def test_any_signed_header_value_is_refused_or_loads(path, blob, field, value, raw):
    """Whatever a field holds (a writer that signs its header can put anything
    there), reading the file raises a SnapshotError or returns a session."""
    path.write_bytes(blob)
    text = value if raw and isinstance(value, str) else json.dumps(value)
    edit(path, fields={field: text})
    try:
        read_session(path)
    except SnapshotError as e:
        assert str(e)
    # anything else propagates and fails the test


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(["dtype", "shape", "data_offsets"]), value=JSON)
def test_any_tensor_entry_is_refused_or_loads(path, blob, key, value):
    path.write_bytes(blob)
    edit(path, tensor={"layers.3.values": {key: value}})
    try:
        read_session(path)
    except SnapshotError as e:
        assert str(e)


# -- item 2: the header is covered by a checksum ----------------------------------------


def tiny_session(path: Path) -> None:
    """Two layers, 1 KV head of 8: a header of ~1 KB, every bit of it flippable."""
    geo = muser_kv.MuseGeometry(num_layers=2, window=4, max_context=256, num_heads=1,
                                kv_heads=1, head_dim=8,
                                layer_kinds=(muser_kv.LayerKind.SLIDING, muser_kv.LayerKind.GLOBAL))
    cache = muser_kv.make_cache_for(geo)
    k = mx.array(np.random.default_rng(0).standard_normal((1, 1, 6, 8)).astype(np.float16))
    for c in cache:
        c.update_and_fetch(k, k)
    save_session(path, cache, {"note": "bit flips"})


def same_session(a, b) -> bool:
    if (a.geometry, a.position, a.encoding, a.model) != (b.geometry, b.position, b.encoding,
                                                         b.model):
        return False
    return all(x.start == y.start and np.array_equal(bits(x.keys), bits(y.keys))
               and np.array_equal(bits(x.values), bits(y.values))
               for x, y in zip(a.layers, b.layers))


def test_every_single_bit_flip_in_the_header_is_refused_or_harmless(tmp_path):
    """All of the header: the 8-byte length, the tensor table, every metadata
    field. Before the header checksum, "max_context":256 flipped to 254, 252,
    246 or 216 loaded as a session with a smaller context."""
    good = tmp_path / "good.safetensors"
    tiny_session(good)
    blob = good.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    original = read_session(good)
    bad = tmp_path / "bad.safetensors"
    loaded = []
    for byte in range(8 + n):
        for bit in range(8):
            flipped = bytearray(blob)
            flipped[byte] ^= 1 << bit
            bad.write_bytes(bytes(flipped))
            try:
                snap = read_session(bad)
            except SnapshotError:
                continue
            loaded.append((byte, bit))
            assert same_session(snap, original), f"flip of bit {bit} of byte {byte} loaded"
    assert len(loaded) < 8 * (8 + n) // 100  # nearly every flip is refused outright


@pytest.mark.parametrize("context", [254, 252, 246, 216])
def test_a_flipped_max_context_is_refused(model, tmp_path, context):
    """256 is 0b100000000... in ASCII '256': one flipped bit of one digit gives
    254, 252, 246 or 216, and the file loaded as a session of that context."""
    path = tmp_path / "s.safetensors"
    cache = muser_kv.make_prompt_cache(model)  # max_position_embeddings: 256
    model(mx.array([[1, 2, 3]]), cache=cache)
    save_session(path, cache)
    data = path.read_bytes()
    old, new = b'\\"max_context\\":256', f'\\"max_context\\":{context}'.encode()
    assert data.count(old) == 1
    flipped = data.replace(old, new)
    assert sum(bin(a ^ b).count("1") for a, b in zip(data, flipped)) == 1
    path.write_bytes(flipped)
    with pytest.raises(SessionFileError, match=r"corrupted header \(checksum mismatch\)"):
        load_session(path, model)


def test_a_flipped_checksum_field_is_refused(path, model):
    table, payload = split(path.read_bytes())
    digest = table["__metadata__"]["header_sha256"]
    table["__metadata__"]["header_sha256"] = ("0" if digest[0] != "0" else "1") + digest[1:]
    path.write_bytes(join(table, payload))
    with pytest.raises(SessionFileError, match=r"corrupted header \(checksum mismatch\)"):
        load_session(path, model)
    edit(path, fields={"header_sha256": "nope"}, sign=False)
    with pytest.raises(SessionFileError, match=r"header_sha256\) expected 64 lowercase hex"):
        load_session(path, model)


def test_every_header_field_is_covered(path, model):
    """Each field changed (user metadata included), checksum left as it was."""
    table, _ = split(path.read_bytes())
    meta = table["__metadata__"]
    assert set(meta) == {"format", "version", "geometry", "position", "encoding", "starts",
                         "checksums", "user", "model", "header_sha256"}
    changes = {"geometry": meta["geometry"].replace('"window":16', '"window":15'),
               "position": "19", "encoding": "f32le",
               "starts": meta["starts"].replace("4", "5", 1),
               "checksums": meta["checksums"].replace("a", "b", 1),
               "user": json.dumps({"user": "eve", "turns": [1, 2]}),
               "model": "null", "extra": "field"}
    _, payload = split(path.read_bytes())
    for key, value in changes.items():
        assert value != meta.get(key), key
        path.write_bytes(join(dict(table, __metadata__=dict(meta, **{key: value})), payload))
        with pytest.raises(SessionFileError, match=r"corrupted header \(checksum mismatch\)"):
            read_session(path)


# -- item 3: killed saves leave no temporaries past the next save or load ---------------


KILLED_SAVE = r"""
import os, signal, sys
sys.path[:0] = [sys.argv[2]]
import mlx.core as mx
import muser_kv, muser_kv.sessions.save as save_mod
from conftest import tiny_model

model = tiny_model()
cache = muser_kv.make_prompt_cache(model, 64)
model(mx.array([[1, 2, 3]]), cache=cache)

def dies_mid_write(tmp, arrays, header):
    with open(tmp, "wb") as f:
        f.write(b"half a session" * 4096)
        f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

save_mod.write_tensors = dies_mid_write
muser_kv.save_session(sys.argv[1], cache)
"""


def killed_save(target: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]))
    proc = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(target), str(HERE)],
                          env=env, timeout=300)
    assert proc.returncode == -signal.SIGKILL


def temporaries(directory: Path, name: str):
    return sorted(p.name for p in directory.iterdir()
                  if p.name.startswith(f".{name}.") and p.name.endswith(".tmp"))


def test_stale_temporaries_of_killed_saves_are_removed_by_the_next_save_or_load(model, tmp_path):
    target = tmp_path / "chat.safetensors"
    killed_save(target)
    first = temporaries(tmp_path, target.name)
    assert len(first) == 1 and not target.exists()
    killed_save(target)  # a save tidies before it writes: the first one is gone
    stale = temporaries(tmp_path, target.name)
    assert len(stale) == 1 and stale != first
    # what must survive: other targets' temporaries, other files, and a
    # temporary of a process that is still running (it may be saving now)
    keeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        others = {f".other.safetensors.{os.getpid() + 1}-0123456789abcdef.tmp": b"x",
                  ".chat.safetensors.notes": b"y", "chat.safetensors.bak": b"z",
                  f".chat.safetensors.{keeper.pid}-fedcba9876543210.tmp": b"live"}
        for name, data in others.items():
            (tmp_path / name).write_bytes(data)
        cache = muser_kv.make_prompt_cache(model, 64)
        model(mx.array([[4, 5]]), cache=cache)
        save_session(target, cache)
        assert not set(stale) & set(os.listdir(tmp_path))
        for name, data in others.items():
            assert (tmp_path / name).read_bytes() == data, name
        killed_save(target)
        assert len(temporaries(tmp_path, target.name)) == 2  # the new stale one and the live one
        assert load_session(target, model)[0].offset == 2
        assert temporaries(tmp_path, target.name) == [
            f".chat.safetensors.{keeper.pid}-fedcba9876543210.tmp"]
    finally:
        keeper.kill()
        keeper.wait()
    save_session(target, cache)  # its process is gone now: stale as well
    assert temporaries(tmp_path, target.name) == []


@pytest.mark.parametrize("failure", ["writer", "interrupt", "fsync", "replace"])
def test_a_failed_save_removes_its_own_temporary(model, tmp_path, monkeypatch, failure):
    import muser_kv.sessions.save as save_mod

    def boom(*args, **kwargs):
        raise KeyboardInterrupt() if failure == "interrupt" else OSError(28, "No space left")

    target = {"writer": (save_mod, "write_tensors"), "interrupt": (save_mod, "write_tensors"),
              "fsync": (save_mod, "fsync_path"), "replace": (save_mod.os, "replace")}[failure]
    cache = muser_kv.make_prompt_cache(model, 64)
    model(mx.array([[4, 5]]), cache=cache)
    monkeypatch.setattr(*target, boom)
    with pytest.raises((OSError, KeyboardInterrupt)):
        save_session(tmp_path / "s.safetensors", cache)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


# -- item 4: a save names the caller's path; metadata is refused by muser-kv ------------


def test_saving_into_a_missing_directory_names_the_callers_path(model, tmp_path):
    cache = muser_kv.make_prompt_cache(model, 64)
    target = tmp_path / "no" / "such" / "dir" / "chat.safetensors"
    with pytest.raises(FileNotFoundError) as e:
        save_session(target, cache)
    assert e.value.filename == str(target)
    assert "directory" in str(e.value) and str(target.parent) in str(e.value)
    assert ".tmp" not in str(e.value)


def test_a_missing_file_is_not_found_rather_than_untrusted(model, tmp_path, capsys):
    """No file at the path: ``FileNotFoundError`` (as ``open`` raises), never
    ``SessionFileError``, whichever reader is asked; nothing is created."""
    path = tmp_path / "absent.safetensors"
    for call in (lambda: read_session(path), lambda: load_session(path, model)):
        with pytest.raises(FileNotFoundError) as e:
            call()
        assert e.value.filename == str(path)
    assert muser_kv.serving.cli.main(["inspect", str(path)]) == 2
    assert "No such file" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_a_write_error_names_the_callers_path(model, tmp_path):
    cache = muser_kv.make_prompt_cache(model, 64)
    target = tmp_path / "a_directory.safetensors"
    target.mkdir()  # os.replace onto a directory fails
    with pytest.raises(OSError) as e:
        save_session(target, cache)
    assert e.value.filename == str(target) and ".tmp" not in str(e.value)
    assert os.listdir(tmp_path) == [target.name]


class Opaque:
    pass


def deeply_nested():
    deep = []
    for _ in range(100_000):
        deep = [deep]
    return {"deep": deep}


@pytest.mark.parametrize("metadata", [
    lambda: {"x": Opaque()}, lambda: {1: "int key"}, lambda: {"x": float("nan")},
    lambda: {"x": {"y": set()}}, lambda: ["not", "a", "mapping"], deeply_nested],
    ids=["object", "int-key", "nan", "set", "list", "deep"])
def test_metadata_that_is_not_json_is_refused_by_muser_kv(model, tmp_path, metadata):
    """It raised a raw TypeError (or none at all, for an int key or a NaN)."""
    cache = muser_kv.make_prompt_cache(model, 64)
    metadata = metadata()
    with pytest.raises(muser_kv.SessionMetadataError, match="session metadata .*expected"):
        save_session(tmp_path / "s.safetensors", cache, metadata)
    assert os.listdir(tmp_path) == []


# -- item 11: a session loads into the model it came from -------------------------------


def test_a_session_is_refused_by_a_model_with_other_weights(path, model):
    """Same geometry, other weights (another seed): it loaded without a word."""
    other = tiny_model(seed=1)
    with pytest.raises(muser_kv.ModelMismatch, match=r"model fingerprint weights .*"
                                                     r"allow_other_model=True"):
        load_session(path, other)
    assert load_session(path, other, allow_other_model=True)[0].offset == 20
    assert load_session(path, tiny_model())[0].offset == 20  # the same weights, rebuilt


def test_a_session_is_refused_by_a_model_with_another_config(path):
    other = tiny_model(rope_theta=10_000.0)  # same geometry and weights, another RoPE
    with pytest.raises(muser_kv.ModelMismatch, match=r"model fingerprint config"):
        load_session(path, other)


def test_a_session_that_records_no_model_needs_consent(model, tmp_path):
    geo = muser_kv.MuseGeometry.from_model_args(model.args, 64)
    cache = muser_kv.make_cache_for(geo)  # a bare geometry: no model known
    path = tmp_path / "bare.safetensors"
    save_session(path, cache)
    assert read_session(path).model is None
    with pytest.raises(muser_kv.ModelMismatch, match=r"records none"):
        load_session(path, model)
    assert load_session(path, model, allow_other_model=True)[0].offset == 0
    save_session(path, cache, model=model)  # the caller names the model
    assert load_session(path, model)[0].offset == 0


def test_restore_into_a_list_of_another_model_is_refused(model):
    source = muser_kv.make_prompt_cache(model, 64)
    model(mx.array([[1, 2, 3]]), cache=source)
    snap = muser_kv.SessionSnapshot.capture(source)
    assert snap.model == muser_kv.model_fingerprint(model)
    other = tiny_model(seed=2)
    target = muser_kv.make_prompt_cache(other, 64)
    with pytest.raises(muser_kv.ModelMismatch):
        muser_kv.restore_into(target, snap)
    assert all(c.offset == 0 for c in target)
    muser_kv.restore_into(target, snap, allow_other_model=True)
    assert all(c.offset == 3 for c in target)



@pytest.mark.parametrize("as_path", [str, Path], ids=["str", "Path"])
def test_restore_into_refuses_a_path_naming_read_session(model, tmp_path, as_path):
    """A file is read with read_session (verified) before it is restored:
    restore_into given its path refuses it, naming read_session, and leaves
    the list as it was."""
    source = muser_kv.make_prompt_cache(model)
    model(mx.array([[1, 2, 3]]), cache=source)
    path = tmp_path / "x.safetensors"
    save_session(path, source)
    target = muser_kv.make_prompt_cache(model)
    model(mx.array([[4, 5]]), cache=target)
    with pytest.raises(TypeError, match=r"got the path '.*x\.safetensors'.*muser_kv\.read_session\(path\)"):
        muser_kv.restore_into(target, as_path(path))
    with pytest.raises(TypeError, match=r"takes a SessionSnapshot, got a dict"):
        muser_kv.restore_into(target, {})  # type: ignore[arg-type]
    assert [c.offset for c in target] == [2] * len(target)
    muser_kv.restore_into(target, read_session(as_path(path)))
    assert [c.offset for c in target] == [3] * len(target)


def _oracle_fingerprint_weights(params):
    """The fingerprint's weights digest, spelled out with numpy on whole copies:
    names, dtypes and shapes, then for each parameter (by name) the elements of
    its start, middle and end spans of its first, middle and last rows."""
    k = muser_kv.sessions.fingerprint.SAMPLE
    h = hashlib.sha256()
    for name, w in sorted(params.items()):
        h.update(f"{name}:{w.dtype}:{list(w.shape)};".encode())
    for _, w in sorted(params.items()):
        a = np.array(w.view(mx.uint16) if w.dtype == mx.bfloat16 else w)
        if a.ndim == 0:
            h.update(a.reshape(1).tobytes())
            continue
        if a.size == 0:
            continue
        rows = [a] if a.ndim == 1 else [a[r].reshape(-1) for r in
                                        sorted({0, a.shape[0] // 2, a.shape[0] - 1})]
        for row in rows:
            n = row.shape[0]
            m = min(k, n)
            for start in sorted({0, max(0, n // 2 - m // 2), n - m}):
                h.update(np.ascontiguousarray(row[start:start + m]).tobytes())
    return h.hexdigest()


def test_the_fingerprint_is_the_schemes_bytes_for_every_kind_of_parameter():
    """Sessions saved earlier carry this digest: it must stay what the scheme
    says, for 0-d, 1-d, 2-d and 3-d parameters, empty ones, overlapping spans,
    a transposed (strided) view, and every dtype a model holds."""
    rng = np.random.default_rng(3)

    class Params:
        args = None

        def __init__(self):
            self.p = {
                "a": mx.array(3.5), "b": mx.arange(7, dtype=mx.float32),
                "c": mx.array(rng.standard_normal((5, 3, 40))).astype(mx.bfloat16),
                "d": mx.zeros((0, 4)), "e": mx.array(rng.standard_normal((20, 20))).astype(mx.float16),
                "f": mx.array([True, False, True]),
                "g": mx.array(rng.integers(0, 2 ** 31, (4, 100)), dtype=mx.uint32),
                "h": mx.array(rng.standard_normal(300)).astype(mx.bfloat16),
                "i": mx.array(rng.standard_normal((40, 3))).T,
            }
            mx.eval(self.p)

        def parameters(self):
            return self.p

    for model in (Params(), tiny_model(), tiny_model(seed=2)):
        params = dict(tree_flatten(model.parameters()))
        assert muser_kv.model_fingerprint(model)["weights"] == _oracle_fingerprint_weights(params)


def test_the_fingerprint_reads_slices_not_weights():
    """Well under a second for a 17 GB model: it costs per parameter, not per
    byte. 52 layers here (the real model's parameter count), and a 512 MiB
    weight costs what a small one does (hashing it would take ~0.3 s)."""
    model = tiny_model(num_hidden_layers=52)
    t0 = time.perf_counter()
    muser_kv.model_fingerprint(model)
    assert time.perf_counter() - t0 < 0.5

    class Big:
        args = None

        def __init__(self, rows):
            self.w = mx.zeros((rows, 16384), mx.float32)
            mx.eval(self.w)

        def parameters(self):
            return {"w": self.w}

    big, small = Big(8192), Big(4)  # 512 MiB, 256 KiB
    times = []
    for m in (small, big, small, big):
        t0 = time.perf_counter()
        muser_kv.model_fingerprint(m)
        times.append(time.perf_counter() - t0)
    assert max(times[1], times[3]) < 0.05, times
    del big
