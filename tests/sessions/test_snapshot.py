"""Sessions: the logical cut, safetensors on disk, the fail-closed gate, and a
rotation-preserving, all-or-nothing restore."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import xxhash
from conftest import tiny_model
from oracle import bits
from safetensors import safe_open
from safetensors.numpy import save_file

import muser_kv
import muser_kv.serving.cli
import muser_kv.sessions.save as save_mod
from muser_kv import (
    LayerCut,
    LayerKind,
    ProductionF16Required,
    SessionFileError,
    SessionSnapshot,
    SnapshotMismatch,
    load_session,
    read_session,
    save_session,
)

CONTEXT = 128
WINDOW = 16  # tiny_model's default sliding window
POSITIONS = [1, 15, 16, 17, 40]


@pytest.fixture(scope="module")
def model():
    return tiny_model(mx.float32)


def tokens(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in (np.arange(n) * 7 + 3 + 11 * seed) % 251 + 1]


def filled(model, position: int, max_context: int = CONTEXT, seed: int = 0):
    """A live cache at ``position``, filled the way mlx-lm drives it: a prefill
    chunk, then chunks of 5 and single decode tokens (so rings wrap both ways)."""
    cache = muser_kv.make_prompt_cache(model, max_context)
    toks = tokens(position, seed)
    sizes = [11, 1, 5, 1, 1]
    i = k = 0
    while i < position:
        n = min(sizes[k % len(sizes)], position - i)
        model(mx.array([toks[i:i + n]]), cache=cache)
        i += n
        k += 1
    mx.eval([a for c in cache for a in c.state])
    assert all(c.offset == position for c in cache)
    return cache


def state(cache):
    """Everything a restore may change, as plain data: plane bits and rings."""
    return [(bits(c.keys).copy(), bits(c.values).copy(), c.ring.copy()) for c in cache]


def assert_state(cache, expected):
    assert len(cache) == len(expected)
    for c, (k, v, ring) in zip(cache, expected):
        np.testing.assert_array_equal(bits(c.keys), k, err_msg=f"layer {c.layer} keys")
        np.testing.assert_array_equal(bits(c.values), v, err_msg=f"layer {c.layer} values")
        assert c.ring == ring, f"layer {c.layer}: {c.ring} != {ring}"


def next_logits(model, cache, token: int = 5) -> np.ndarray:
    out = model(mx.array([[token]]), cache=cache)
    return np.array(out.astype(mx.float32)).view(np.uint32)


# -- file surgery for the refusal tests ------------------------------------------


def resign(metadata: dict) -> dict:
    """Recompute the header checksum the way the README states it (sha256 of
    the sorted [key, value] pairs of every other field, compact ASCII JSON),
    as someone editing a header on purpose would."""
    pairs = sorted([k, v] for k, v in metadata.items() if k != "header_sha256")
    text = json.dumps(pairs, separators=(",", ":"), ensure_ascii=True)
    metadata["header_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    return metadata


def rewrite(path: Path, *, header=None, drop=(), add=None, arrays=None, sign=True) -> None:
    """Rewrite a session file with header fields changed / tensors dropped or
    added; the header is re-signed (``sign``) so the gates behind its checksum
    are what refuses."""
    with safe_open(str(path), framework="numpy") as f:
        metadata = dict(f.metadata())
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    metadata.update(header or {})
    if sign:
        resign(metadata)
    tensors.update(arrays or {})
    for n in drop:
        del tensors[n]
    tensors.update(add or {})
    save_file(tensors, str(path), metadata=metadata)


def payload_offset(blob: bytes, name: str) -> int:
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    return 8 + n + header[name]["data_offsets"][0]


@pytest.fixture(scope="module")
def session40(model, tmp_path_factory):
    """A live cache at position 40 (rings wrapped and rotated) and its file's bytes.
    Shared: tests must not write to this cache."""
    cache = filled(model, 40)
    path = tmp_path_factory.mktemp("session40") / "session.safetensors"
    save_session(path, cache, {"prompt": "hello", "turns": [1, 2]})
    return cache, path.read_bytes()


@pytest.fixture
def saved(session40, tmp_path):
    """A fresh copy of the position-40 session file, alone in its directory."""
    cache, blob = session40
    path = tmp_path / "session.safetensors"
    path.write_bytes(blob)
    return path, cache


# -- round trip --------------------------------------------------------------------


@pytest.mark.parametrize("position", POSITIONS)
def test_round_trip_is_bitwise_and_keeps_rotation(model, tmp_path, position):
    live = filled(model, position)
    path = tmp_path / "s.safetensors"
    save_session(path, live)
    restored = load_session(path, model)
    assert_state(restored, state(live))
    for c in restored:
        ring = c.ring
        assert ring.origin_physical == ring.origin_logical % ring.capacity
        if c.kind is LayerKind.SLIDING:
            assert ring.origin_logical == max(0, position - WINDOW)
    if position in (17, 40):  # wrapped mid-rotation: 1 and 24 % 16 = 8
        assert restored[0].ring.origin_physical == {17: 1, 40: 8}[position]
    # the restored session replays the live one bit for bit
    np.testing.assert_array_equal(next_logits(model, restored), next_logits(model, live))
    assert_state(restored, state(live))


def test_session_after_a_speculative_trim_round_trips(model, tmp_path):
    # mlx-lm rewinds rejected draft tokens with trim(); the wrapped rings put back
    # the rows those tokens overwrote, and the cut taken afterwards must replay.
    live = filled(model, 40)
    for c in live:
        assert c.trim(3) == 3
    assert all(c.offset == 37 for c in live)
    save_session(tmp_path / "t.safetensors", live)
    restored = load_session(tmp_path / "t.safetensors", model)
    for a, b in zip(live, restored):
        assert a.ring == b.ring
        for x, y in zip(unrotated(a), unrotated(b)):
            np.testing.assert_array_equal(bits(x), bits(y))
    np.testing.assert_array_equal(next_logits(model, restored), next_logits(model, live))


def test_install_into_a_live_cache_replaces_it_exactly(model):
    source = filled(model, 40)
    target = filled(model, 7, seed=3)
    snap = SessionSnapshot.capture(source)
    snap.install(target)
    assert_state(target, state(source))
    other = filled(model, 21, seed=5)
    muser_kv.restore_into(other, snap)
    assert_state(other, state(source))


def test_empty_session_round_trips(model, tmp_path):
    live = muser_kv.make_prompt_cache(model, CONTEXT)
    save_session(tmp_path / "e.safetensors", live)
    snap = read_session(tmp_path / "e.safetensors")
    assert snap.position == 0 and all(c.rows == 0 and c.start == 0 for c in snap.layers)
    restored = load_session(tmp_path / "e.safetensors", model)
    assert_state(restored, state(live))


@pytest.mark.parametrize("position", [5, 12])
def test_ring_smaller_than_window_round_trips(model, tmp_path, position):
    # max_context 12 < window 16: the rings hold min(max_context, window) = 12 rows
    live = filled(model, position, max_context=12)
    save_session(tmp_path / "small.safetensors", live)
    snap = read_session(tmp_path / "small.safetensors")
    for _i, cut in enumerate(snap.layers):
        assert (cut.start, cut.rows) == (0, position)  # min(position, capacity 12)
    restored = load_session(tmp_path / "small.safetensors", model)
    assert_state(restored, state(live))
    assert restored[0].ring.capacity == 12


# -- the logical cut contract ------------------------------------------------------


def unrotated(plane) -> tuple[np.ndarray, np.ndarray]:
    """The live rows in logical order, computed here from the raw plane and ring."""
    ring, out = plane.ring, []
    for x in (plane.keys, plane.values):
        a = np.array(x)
        if plane.kind is LayerKind.SLIDING:
            rows = [a[(ring.origin_physical + i) % ring.capacity] for i in range(ring.len)]
            rows = np.stack(rows).reshape(ring.len, plane.kv_heads, plane.head_dim) if rows else \
                np.zeros((0, plane.kv_heads, plane.head_dim), np.float16)
        else:
            rows = a[:, :ring.len, :].transpose(1, 0, 2)
        out.append(rows)
    return out[0], out[1]


@pytest.mark.parametrize("position", POSITIONS)
def test_logical_cut_contract_on_disk(model, tmp_path, position):
    live = filled(model, position)
    path = tmp_path / "cut.safetensors"
    snap = save_session(path, live)
    assert snap.position == position and snap.encoding == "f16le"
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
        starts = json.loads(meta["starts"])
        for i, c in enumerate(live):
            if c.kind is LayerKind.SLIDING:
                count = min(position, WINDOW)
                assert (starts[i], snap.starts[i]) == (position - count,) * 2
            else:
                count = position
                assert starts[i] == snap.starts[i] == 0
            k, v = f.get_tensor(f"layers.{i}.keys"), f.get_tensor(f"layers.{i}.values")
            assert k.shape == v.shape == (count, 2, 128) and k.dtype == np.float16
            ek, ev = unrotated(c)  # logical order, never rotated
            np.testing.assert_array_equal(bits(k), bits(ek))
            np.testing.assert_array_equal(bits(v), bits(ev))
            # version 3's digest, computed independently: XXH3-128 of the bytes
            checksums = json.loads(meta["checksums"])
            for name, t in ((f"layers.{i}.keys", k), (f"layers.{i}.values", v)):
                assert checksums[name] == xxhash.xxh3_128(t.tobytes()).hexdigest()
    assert meta["format"] == "muser-kv-session" and meta["version"] == "3"
    assert json.loads(meta["position"]) == position
    assert json.loads(meta["geometry"])["window"] == WINDOW


def test_capture_refuses_layers_at_different_positions():
    geometry = muser_kv.MuseGeometry(num_layers=4, window=8, max_context=32, num_heads=2,
                                     kv_heads=2, head_dim=16)
    cache = muser_kv.make_cache_for(geometry)
    k = mx.ones((1, 2, 3, 16), mx.float16)
    for c in cache:
        c.update_and_fetch(k, k)
    for c in cache[:2]:  # a write that reached layers 0 and 1 only
        c.update_and_fetch(k[:, :, :1], k[:, :, :1])
    with pytest.raises(SnapshotMismatch, match=r"layer 2 .*position.* expected 4, got 3"):
        SessionSnapshot.capture(cache)


# -- the gate: refusals leave the live cache as it was ---------------------------------


def test_gate_checks_every_layer_before_installing_any(model):
    source = SessionSnapshot.capture(filled(model, 40))
    target = filled(model, 9, seed=2)
    before = state(target)
    last = source.layers[-1]  # a global layer: [0, 40)
    cases = {
        "start": LayerCut(1, last.keys, last.values),
        "rows": LayerCut(0, last.keys[:39], last.values[:39]),
        "dtype": LayerCut(0, last.keys, last.values.astype(mx.bfloat16)),
        "kv_heads": LayerCut(0, last.keys[:, :1], last.values[:, :1]),
        "head_dim": LayerCut(0, last.keys[..., :64], last.values[..., :64]),
    }
    for field, cut in cases.items():
        bad = dataclasses.replace(source, layers=source.layers[:-1] + (cut,))
        with pytest.raises(SnapshotMismatch, match=rf"layer 7 \(full_attention\).*{field}") as e:
            bad.install(target)
        assert e.value.layer == 7
        assert_state(target, before)


def test_gate_names_expected_and_got(model):
    snap = SessionSnapshot.capture(filled(model, 20))
    g = snap.geometry
    with pytest.raises(SnapshotMismatch, match=r"geometry.window expected 32, got 16"):
        snap.check(dataclasses.replace(g, window=32))
    kinds = tuple(LayerKind.GLOBAL if i == 0 else k for i, k in enumerate(g.layer_kinds))
    with pytest.raises(SnapshotMismatch, match=r"geometry.layer_kinds"):
        snap.check(dataclasses.replace(g, layer_kinds=kinds))
    with pytest.raises(SnapshotMismatch, match=r"geometry.kv_heads expected 4, got 2"):
        snap.check(dataclasses.replace(g, kv_heads=4, num_heads=4))


def test_install_into_another_geometry_is_refused(model):
    snap = SessionSnapshot.capture(filled(model, 20))
    other = filled(tiny_model(sliding_window=32), 5)
    before = state(other)
    with pytest.raises(SnapshotMismatch, match=r"geometry.window expected 32, got 16"):
        snap.install(other)
    assert_state(other, before)


def test_a_plane_failing_mid_install_rolls_back_every_layer(model, monkeypatch):
    snap = SessionSnapshot.capture(filled(model, 40))
    target = filled(model, 17, seed=4)
    before = state(target)
    depths = [c.trimmable_depth() for c in target]
    plane = target[5]

    def boom(*a, **k):
        raise RuntimeError("device lost")

    monkeypatch.setattr(plane, "install", boom)
    with pytest.raises(RuntimeError, match="device lost"):
        snap.install(target)
    assert_state(target, before)
    # the very ring objects are back, so what the caches retained still applies
    assert [c.trimmable_depth() for c in target] == depths


# -- f32 interchange ------------------------------------------------------------------


def test_f32_file_needs_convert(model, tmp_path):
    live = filled(model, 40)
    path = tmp_path / "f32.safetensors"
    save_session(path, live, encoding="f32le")
    blob = path.read_bytes()
    snap = read_session(path)
    assert snap.encoding == "f32le" and snap.layers[0].keys.dtype == mx.float32
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata()["encoding"] == "f32le"
        assert f.get_tensor("layers.3.keys").dtype == np.float32
    with pytest.raises(ProductionF16Required, match="convert=True"):
        load_session(path, model)
    restored = load_session(path, model, convert=True)  # f16 -> f32 -> f16 is exact
    assert_state(restored, state(live))
    assert path.read_bytes() == blob
    # the same refusal into a live cache leaves it untouched
    target = filled(model, 3, seed=1)
    before = state(target)
    with pytest.raises(ProductionF16Required):
        snap.install(target)
    assert_state(target, before)
    snap.install(target, convert=True)
    assert_state(target, state(live))


def test_f32_conversion_rounds_to_nearest_even(model):
    snap = SessionSnapshot.capture(filled(model, 4)).encoded("f32le")
    # 1 + 2^-11 lies halfway between two f16 values: ties go to the even one (1.0)
    halfway = mx.full(snap.layers[3].keys.shape, 1 + 2.0 ** -11, mx.float32)
    cut = LayerCut(0, halfway, halfway)
    odd = dataclasses.replace(snap, layers=snap.layers[:3] + (cut,) + snap.layers[4:])
    target = muser_kv.make_prompt_cache(model, CONTEXT)
    odd.install(target, convert=True)
    _, k, _ = target[3].snapshot()
    assert (bits(k) == np.float16(1.0).view(np.uint16)).all()


# -- refusals on load: each with a clear error, the file left as it was ------------------


def refuse(path: Path, model, exc, match: str, **kw):
    blob = path.read_bytes()
    with pytest.raises(exc, match=match):
        load_session(path, model, **kw)
    assert path.read_bytes() == blob


def test_load_refuses_another_geometry(saved):
    path, _ = saved
    refuse(path, tiny_model(sliding_window=32), SnapshotMismatch,
           r"geometry.window \(expected: the model's; got: file .*\) expected 32, got 16")
    refuse(path, tiny_model(num_hidden_layers=4), SnapshotMismatch,
           r"geometry.num_layers .* expected 4, got 8")
    refuse(path, tiny_model(head_dim=64), SnapshotMismatch,
           r"geometry.head_dim .* expected 64, got 128")
    refuse(path, tiny_model(), SnapshotMismatch, r"geometry.max_context .* expected 64, got 128",
           max_context=64)
    refuse(path, tiny_model(max_position_embeddings=100), SnapshotMismatch, r"max_context")


def test_load_refuses_unknown_format_and_version(saved, model):
    path, _ = saved
    rewrite(path, header={"version": "4"})
    refuse(path, model, SessionFileError,
           r"unsupported version: expected one of \['2', '3'\], got '4'")
    rewrite(path, header={"version": "1"})
    refuse(path, model, SessionFileError,
           r"unsupported version: expected one of \['2', '3'\], got '1' \(version 1 files carry "
           r"no header checksum")
    # a version 3 file relabelled 2: its XXH3-128 digests are not sha256s
    rewrite(path, header={"version": "2"})
    refuse(path, model, SessionFileError,
           r"corrupted tensor \(checksum mismatch\) 'layers.0.keys': sha256 expected")
    rewrite(path, header={"version": "3", "format": "kvpack"})
    refuse(path, model, SessionFileError, r"format expected 'muser-kv-session', got 'kvpack'")


def test_load_refuses_unknown_or_wrong_encoding(saved, model):
    path, _ = saved
    rewrite(path, header={"encoding": "f8le"})
    refuse(path, model, SessionFileError, r"unknown encoding: expected one of .*got 'f8le'")
    rewrite(path, header={"encoding": "bf16le"})
    refuse(path, model, SessionFileError,
           r"wrong encoding for tensor 'layers.0.keys': encoding bf16le expects dtype bfloat16, "
           r"got float16")
    # header says f32, tensors are f16 (checksums still match their bytes)
    rewrite(path, header={"encoding": "f32le"})
    refuse(path, model, SessionFileError,
           r"wrong encoding for tensor 'layers.0.keys': encoding f32le expects dtype float32, "
           r"got float16")


@pytest.mark.parametrize("keep", [0.0, 0.01, 0.5, 0.999, -1])
def test_load_refuses_a_truncated_file(saved, model, keep):
    path, _ = saved
    blob = path.read_bytes()
    n = len(blob) - 1 if keep == -1 else int(len(blob) * keep)
    path.write_bytes(blob[:n])
    refuse(path, model, SessionFileError, r"truncated")
    with pytest.raises(SessionFileError):
        read_session(path)


def test_load_refuses_a_flipped_bit(saved, model):
    path, _ = saved
    blob = bytearray(path.read_bytes())
    blob[payload_offset(bytes(blob), "layers.3.values") + 77] ^= 0x10
    path.write_bytes(bytes(blob))
    refuse(path, model, SessionFileError,
           r"corrupted tensor \(checksum mismatch\) 'layers.3.values': xxh3-128 expected")


def test_load_refuses_a_missing_or_unexpected_tensor(saved, model):
    path, _ = saved
    rewrite(path, drop=["layers.5.keys"])
    refuse(path, model, SessionFileError, r"missing tensor 'layers.5.keys'")
    rewrite(path, add={"layers.5.keys": np.zeros((16, 2, 128), np.float16)})  # checksum wrong
    refuse(path, model, SessionFileError, r"'layers.5.keys'.*checksum|checksum.*'layers.5.keys'")
    path2 = path.with_name("extra.safetensors")
    save_session(path2, saved[1])
    rewrite(path2, add={"layers.8.keys": np.zeros((1, 2, 128), np.float16)})
    refuse(path2, model, SessionFileError, r"unexpected tensor 'layers.8.keys'")


def test_load_refuses_a_header_that_breaks_the_cut(saved, model):
    path, _ = saved
    rewrite(path, header={"position": "39"})  # tensors still verify; the gate does not
    refuse(path, model, SnapshotMismatch,
           r"layer 0 \(sliding_attention\): start expected 23, got 24")
    rewrite(path, header={"position": "40", "starts": json.dumps([24, 24, 24, 0, 24, 24, 24, 1])})
    refuse(path, model, SnapshotMismatch, r"layer 7 \(full_attention\): start expected 0, got 1")


def test_read_session_verifies(saved):
    path, live = saved
    snap = read_session(path)
    assert snap.position == 40 and snap.geometry.window == WINDOW
    for cut, c in zip(snap.layers, live):
        start, k, v = c.snapshot()
        assert cut.start == start
        np.testing.assert_array_equal(bits(cut.keys), bits(k))
        np.testing.assert_array_equal(bits(cut.values), bits(v))


# -- atomic save ------------------------------------------------------------------------


def test_failed_save_leaves_the_old_file_and_no_temp(saved, model, monkeypatch):
    path, _ = saved
    blob = path.read_bytes()
    newer = filled(model, 17, seed=9)

    def torn_writer(tmp, arrays, header):
        Path(tmp).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(save_mod, "write_tensors", torn_writer)
    with pytest.raises(OSError, match="disk full"):
        save_session(path, newer)
    assert path.read_bytes() == blob
    assert os.listdir(path.parent) == [path.name]
    # and with no old file: nothing appears at all
    with pytest.raises(OSError, match="disk full"):
        save_session(path.with_name("new.safetensors"), newer)
    assert os.listdir(path.parent) == [path.name]


def test_failed_replace_leaves_the_old_file_and_no_temp(saved, model, monkeypatch):
    path, _ = saved
    blob = path.read_bytes()

    def boom(src, dst):
        raise OSError("replace failed")

    monkeypatch.setattr(save_mod.os, "replace", boom)
    with pytest.raises(OSError, match="replace failed"):
        save_session(path, filled(model, 3))
    monkeypatch.undo()
    assert path.read_bytes() == blob
    assert os.listdir(path.parent) == [path.name]


def test_save_overwrites_atomically_and_refuses_bad_metadata(saved, model):
    path, _ = saved
    blob = path.read_bytes()
    with pytest.raises(TypeError):
        save_session(path, filled(model, 3), {"not json": object()})
    assert path.read_bytes() == blob
    newer = filled(model, 17, seed=9)
    save_session(path, newer, {"v": 2})
    assert os.listdir(path.parent) == [path.name]
    assert read_session(path).position == 17
    assert_state(load_session(path, model), state(newer))


# -- muser-kv inspect ----------------------------------------------------------------------


def test_inspect_prints_the_header_and_verifies(saved, capsys):
    path, _ = saved
    assert muser_kv.serving.cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    for text in ("format: muser-kv-session", "version: 3", "tensor checksums: xxh3-128",
                 "position: 40", "encoding: f16le",
                 '"prompt": "hello"', "window 16", "max_context 128", "2 KV heads x 128",
                 "gate: OK", "result: OK"):
        assert text in out, text
    lines = [line for line in out.splitlines() if "layers." in line]
    assert len(lines) == 16 and all(line.endswith("OK") for line in lines)
    l0 = next(line for line in lines if "layers.0.keys" in line).split()
    assert l0[:4] == ["0", "sliding_attention", "24", "16"] and "float16" in l0
    l3 = next(line for line in lines if "layers.3.values" in line).split()
    assert l3[:4] == ["3", "full_attention", "0", "40"]
    assert "MISMATCH" not in out


def test_inspect_flags_a_mismatch(saved, capsys):
    path, _ = saved
    blob = bytearray(path.read_bytes())
    blob[payload_offset(bytes(blob), "layers.6.keys")] ^= 0x01
    path.write_bytes(bytes(blob))
    assert muser_kv.serving.cli.main(["inspect", str(path)]) == 1
    out = capsys.readouterr().out
    bad = [line for line in out.splitlines() if "MISMATCH" in line]
    assert len(bad) == 1 and "layers.6.keys" in bad[0]
    assert "result: 1 problem(s)" in out


def test_inspect_refuses_unreadable_files(saved, tmp_path, capsys):
    path, _ = saved
    path.write_bytes(path.read_bytes()[:-3])
    assert muser_kv.serving.cli.main(["inspect", str(path)]) == 2
    assert "truncated" in capsys.readouterr().err
    assert muser_kv.serving.cli.main(["inspect", str(tmp_path / "absent.safetensors")]) == 2
    other = tmp_path / "weights.safetensors"
    save_file({"w": np.zeros(3, np.float32)}, str(other))
    assert muser_kv.serving.cli.main(["inspect", str(other)]) == 2
    assert "format expected 'muser-kv-session'" in capsys.readouterr().err
